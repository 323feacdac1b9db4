"""Disaggregated serving inside a replica (``cluster.disagg``): a prefill replica hands a
request on after its first token, a decode replica takes it in. A mixin of ``Replica``;
the coordinator that routes, times the KV transfer and records it is
``cluster.disagg.Disaggregation`` (``Replica.handoff``).

Prefill side (``hands_off``): when a request's prefill completes and it has more tokens
to make, its first token is emitted as on any replica (TTFT ends here, as in DistServe)
and the request, instead of joining the decoders, is handed to the coordinator
(``_hand_off``). It leaves the running set and the outstanding tokens a router reads;
its KV blocks stay held until the coordinator says the transfer is done
(``release_sent``). A prefill replica whose blocks are all held so (its decode pool
cannot keep up) admits nobody until a transfer lands: DistServe's backpressure.

Decode side: a handed-off request waits in ``incoming`` (first come, first served). At a
step boundary where new requests may be admitted (no preemption or swap-in pending, and
no request preempted here waiting to be recomputed: vLLM serves those first), the
replica takes in the oldest while it has a batch slot (``max_num_seqs``, counting
requests whose KV is still on its way) and its blocks fit above the watermark:
``KVSpace.take_over`` reserves what admitting it here would (contiguous allocation: its
whole reservation) or its KV, as a swapped request coming back (a request with a prompt
and one generated token whose KV exists elsewhere). Only then does the KV move: the decode side
pulls it into blocks it has reserved, as DistServe and vLLM's NIXL connector do, so the
KV always sits in some GPU's blocks. When the transfer lands (``land``) the request
joins the decoders at the next step boundary with its context its prompt plus its first
token; the decode replica never prefills it (unless a recompute preemption there drops
its KV: it is then prefilled again where it is, as any preempted request).

An arrival that can be taken in now, or a landing, ends a run of decode-only steps priced
together (an epoch) at its next step boundary, as an admissible arrival does
(``Replica.enqueue``). Client cancellation is not modelled for a request between
replicas (the configuration refuses ``client`` timeouts with roles).
"""
from __future__ import annotations

from simulator.kernel import python_of
from simulator.model.kv import rules as kvr

_held_tokens = python_of(kvr.held_tokens)


class ReplicaHandoff:
    """Mixin: both sides of a disaggregated replica (see module doc)."""

    # -- prefill side ------------------------------------------------------------------
    def _hand_off(self, s, t: float) -> None:
        """``s`` produced its first token in the step that ended at ``t``: hand it on."""
        s.where = "t"
        s.last_t = t                        # its first token left the engine at t
        s.depart = t + self.frame_time      # ... and the server one frame later
        del self.by_id[s.rid]
        self._outstanding -= s.output_tokens - s.generated
        self._sent += 1
        self.handoff.hand_off(self, s, t)

    def release_sent(self, s) -> None:
        """The KV of ``s`` has reached its decode replica: free its blocks here (and wake
        the loop if it waits for them: waiting requests and every block held by KV still
        to be sent)."""
        self.kv.free(s)
        self.kv_tokens -= _held_tokens(True, s.prompt_tokens, s.generated, 0)
        self._sent -= 1
        self._nudge(False)

    # -- decode side -------------------------------------------------------------------
    def receive(self, s) -> None:
        """``s`` (handed off by a prefill replica) is routed here now."""
        s.where = "i"
        self.incoming.append(s)
        self.by_id[s.rid] = s
        self._outstanding += s.output_tokens - s.generated
        self._nudge(len(self.incoming) == 1 and self._intake_fits(s))

    def land(self, s) -> None:
        """The KV of ``s`` has arrived: it decodes from the next step boundary on."""
        self.landed.append(s)
        self._nudge(True)

    def _nudge(self, now: bool) -> None:
        """Wake an idle loop; end an epoch at its next step boundary when ``now``."""
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()
        elif now and self._in_epoch:
            self._in_epoch = False
            self.process.interrupt()

    def _slot_free(self) -> bool:
        """A batch slot (``max_num_seqs``) is free, counting requests still landing."""
        return len(self.decoding) + len(self.prefilling) + self._landing < self.max_num_seqs

    def _may_take_in(self) -> bool:
        """New hand-offs may be taken in: a slot is free and no request preempted here
        waits to come back (vLLM serves its preempted requests before new ones; taking
        a hand-off into the blocks a preemption freed would starve them)."""
        return not len(self.waiting) and self._slot_free()

    def _intake_fits(self, s) -> bool:
        """Whether ``s`` could be taken in now (``KVSpace.take_over``)."""
        return self._may_take_in() and bool(self.kv.take_over(s, reserve=False))

    def _intake(self, now: float) -> None:
        """Take in waiting hand-offs, oldest first, while they may (``_may_take_in``) and
        their blocks fit (``KVSpace.take_over``); each one's transfer then starts
        (``Disaggregation.admitted``)."""
        kv = self.kv
        while self.incoming and self._may_take_in():
            s = self.incoming[0]
            tokens = kv.take_over(s)
            if not tokens:
                break
            self.incoming.popleft()
            self.kv_tokens += tokens
            self._landing += 1
            s.where = "l"
            self.handoff.admitted(self, s, now)

    def _join_landed(self) -> None:
        """Requests whose KV has landed join the decoders (at a step boundary)."""
        for s in self.landed:
            self._landing -= 1
            s.where = "d"
            self.decoding.append(s)
            if self.fast:
                self._join_fast(s, s.last_t)
            else:
                s.context = s.prompt_tokens + s.generated
        self.landed.clear()
