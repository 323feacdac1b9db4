"""Applying one engine step's effects inside a replica: decode progress (per
request, or by the replica-wide tick counter in the fast mode), prefill progress
and first tokens, finishes, and the time-series samples. A mixin of ``Replica``
(see ``replica`` for the two bookkeeping modes and the delivery rule)."""
from __future__ import annotations

import heapq

from simulator.kernel import python_of
from simulator.model.kv import rules as kvr
from simulator.wire.frontend import first_token_wait_s

_held_tokens = python_of(kvr.held_tokens)
_first_wait_s = python_of(first_token_wait_s)


class ReplicaApply:
    """Mixin: a step's effects on the replica's requests (see module doc)."""

    #: The API server's time per output (``wire.frontend.FrontendTiming.per_output_s``):
    #: a first token waits for the step's outputs listed before it (0: no front end).
    first_out_s: float = 0.0
    #: Decoders that had their last token in the step ending at ``_ended_t`` and left
    #: the decoding list before its prefills were applied (per-request books): still
    #: outputs of that step ahead of its first tokens (``wire.frontend``).
    _ended_t: float = -1.0
    _ended_n: int = 0

    def _decode_fast(self, t: float, m: int, first_end: float, later_gaps) -> None:
        """``m`` decode steps of every decoder ended, the first at ``first_end``, the
        last at ``t``; ``later_gaps`` are the gaps between the later steps' ends."""
        itl = self.rec.itl
        nd = len(self.decoding)
        for tl, c in self._last_tok.items():
            if c:
                itl.add(first_end - tl, c)
        if later_gaps is not None:
            itl.add_many(later_gaps, nd)
        self._last_tok = {t: nd}
        self._last_dec_end = t
        self.ticks += m
        self.kv_tokens += m * nd
        self._outstanding -= m * nd

    def _decode_slow(self, dseqs, t: float) -> None:
        """One decode step for ``dseqs``, each client's frame queue updated exactly."""
        ft = self.frame_time
        itl = self.rec.itl
        common_old = self._last_end + ft
        fast = common_old <= t
        t_ft = t + ft
        same = 0
        done = []
        for s in dseqs:
            last = s.emit()
            s.context += 1
            if s.stream is not None:
                s.stream.emit(t)     # its own frame queue and client (``clientstream``)
                if last:
                    done.append(s)
                continue
            d_old = s.depart
            if fast and d_old == common_old:
                # Decoded at the previous step end and the client kept up: same gap.
                same += 1
                s.depart = t_ft
            else:
                d = (t if t > d_old else d_old) + ft
                s.depart = d
                itl.add(d - d_old)
            if last:
                done.append(s)
        if same:
            itl.add(t_ft - common_old, same)
        self._last_end = t
        self.kv_tokens += len(dseqs)
        self._outstanding -= len(dseqs)
        if done:
            self._finish_decoded(done, t)

    def _drop_decoding(self, done) -> None:
        """Take the requests ``done`` out of the decoding list (order kept)."""
        gone = set(map(id, done))
        self.decoding = [s for s in self.decoding if id(s) not in gone]

    def _finish_decoded(self, done, t: float) -> None:
        """Requests that produced their last token in the step ending at ``t``: out of
        the decoding list, then finished at their last frame's departure."""
        self._drop_decoding(done)
        self._ended_n = len(done) + (self._ended_n if self._ended_t == t else 0)
        self._ended_t = t
        for s in done:
            self._finish(s, t, s.depart)

    def _decode_spec(self, dseqs, t: float) -> None:
        """One speculative decoding step for ``dseqs`` (``model.speculative``): each
        emits 1 + its leading accepted drafts (a draw), at most the drafts it verified
        + 1, so never more than it has left. A step's tokens leave in one frame (one
        SSE event, as vLLM streams a step's output): the first one's gap is the time
        since the request's previous frame, the others' are 0 (pooled into the ITL
        histogram as zero gaps, which its lowest bin holds)."""
        sp = self.spec
        kv = self.kv
        rec = self.rec
        per_req = rec.spec_steps is not None
        ft = self.frame_time
        itl = rec.itl
        draws = sp.draws(len(dseqs))
        total = 0
        done = []
        for s, m in zip(dseqs, draws.tolist()):
            n = min(m, kv.decode_lookahead(s) + 1)
            total += n
            last = s.emit(n)
            s.context += n
            if per_req:
                rec.spec_steps[s.rid] += 1
                rec.spec_tokens[s.rid] += n
            if s.stream is not None:
                for _ in range(n):
                    s.stream.emit(t)
            else:
                d_old = s.depart
                d = (t if t > d_old else d_old) + ft
                s.depart = d
                itl.add(d - d_old)
                if n > 1:
                    itl.add(0.0, n - 1)
            if last:
                done.append(s)
        sp.seq_steps += len(dseqs)
        sp.tokens += total
        self.kv_tokens += total
        self._outstanding -= total
        if done:
            self._finish_decoded(done, t)

    def _prefill(self, chunks, t: float) -> None:
        """Prefill progress; a chunk that completes its prefill yields a token: the
        first one, or, for a request recomputing after a preemption, its next one."""
        rec = self.rec
        by_id = self.by_id
        ft = self.frame_time
        kv = self.kv
        tokens = 0
        for rid, n in chunks:
            s = by_id[rid]
            done = s.prefill_chunk(n)
            tokens += n + done
            kv.computed(s)
            if not done:
                continue
            self.prefilling.remove(s)
            resumed = s.generated > 0
            last = s.emit()
            wait = 0.0
            if not resumed:
                rec.first_token[rid] = t
                if s.stream is None:
                    ahead = len(self.decoding) + (self._ended_n if self._ended_t == t else 0)
                    wait = _first_wait_s(self.first_out_s, ahead)
                    rec.first_delivered[rid] = t + ft + self.one_way + wait
            if s.stream is not None:
                s.stream.emit(t)
            if last:
                self.kv_tokens += tokens
                self._outstanding -= tokens
                tokens = 0
                if resumed and not self.fast and s.stream is None:
                    d = (t if t > s.depart else s.depart) + ft
                    self.rec.itl.add(d - s.depart)
                    s.depart = d
                    self._finish(s, t, d)
                else:
                    if resumed:
                        self.rec.itl.add(t - s.last_t)
                    # A one-token answer's first token is its last: it leaves after the
                    # same front-end wait (TTFT never exceeds E2E).
                    self._finish(s, t, t + ft + wait)
                continue
            if self.hands_off:
                self._hand_off(s, t)    # a prefill replica (``handoff``)
                continue
            s.where = "d"
            self.decoding.append(s)
            if self.fast:
                if resumed:
                    # The gap since its last token before the preemption is one ITL.
                    self.rec.itl.add(t - s.last_t)
                self._join_fast(s, t)
            else:
                s.context = s.prompt_tokens + s.generated
                if s.stream is not None:
                    pass
                elif resumed:
                    d = (t if t > s.depart else s.depart) + ft
                    self.rec.itl.add(d - s.depart)
                    s.depart = d
                else:
                    s.depart = t + ft
        self.kv_tokens += tokens
        self._outstanding -= tokens

    def _finish_due(self, t: float) -> None:
        """Fast mode: decoders whose last token came from the step that ended at ``t``."""
        heap = self._finish_heap
        self._clean_top(heap)
        if not heap or heap[0][0] > self.ticks:
            return
        done = []
        while heap and heap[0][0] <= self.ticks:
            tick, _, ver, s = heapq.heappop(heap)
            if ver == s.ver:
                done.append(s)
        if not done:
            return
        self._drop_decoding(done)
        self._last_tok[t] -= len(done)
        recompute = False
        for s in done:
            s.generated = s.output_tokens
            s.ver += 1
            self._key_sum -= s.key
            recompute |= s.key == self._key_max
            self._finish(s, t, t + self.frame_time)
        if recompute:
            self._key_max = max((s.key for s in self.decoding), default=0)

    def _finish(self, s, t: float, depart: float) -> None:
        rec = self.rec
        rid = s.rid
        rec.last_token[rid] = t
        if s.stream is None:
            arrived = depart + self.one_way
        else:
            r = s.stream.close(t)
            rec.first_delivered[rid] = r.first_arrival
            arrived = r.last_arrival
            if len(r.gaps):
                rec.itl.add_many(r.gaps)
        rec.last_delivered[rid] = arrived
        rec.generated[rid] = s.generated
        if s.keys_out is not None:   # its answer's full blocks join the cache (sessions)
            self.kv.manager.register(rid, s.keys_out, s.prompt_tokens + s.generated - 1)
        self.kv.free(s)
        s.where = "x"
        self.kv_tokens -= _held_tokens(True, s.prompt_tokens, s.generated, 0)
        del self.by_id[rid]
        self.on_finish(s, arrived)

    def _sample(self, t: float) -> None:
        ts, wq, run, blk, kv, shared = self._series
        ts.append(t)
        wq.append(self.n_queued() + len(self.swapped))
        run.append(len(self.decoding) + len(self.prefilling))
        mgr = self.kv.manager
        blk.append(mgr.num_used)
        kv.append(self.kv_tokens)
        shared.append(mgr.shared_refs if mgr.prefix_caching else 0)
        self._last_sample = t
