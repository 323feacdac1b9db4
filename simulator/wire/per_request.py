"""The per-request wire of a run with the rich network/stream model on: routing
across regions, connections (HTTP/1.1 pools or HTTP/2), each request's
``clientstream.ClientStream``, and client disconnects with the GPU time they waste.
``simulate`` builds one ``Wire`` when any stream or network setting departs from
the defaults."""
from __future__ import annotations

import numpy as np

from simulator.wire.clientstream import ClientStream, Link, StreamStats
from simulator.report.metrics import batch_share_seconds
from simulator.wire.network import NetworkTiming, net_time
from simulator.wire.reconnect import Reconnects, reconnects_on
from simulator.wire.stream import DisconnectDraws, stream_params


class Wire:
    """The per-request network and stream work of a run with the rich model on.

    Routing: without regions the router picks a replica when the request arrives, as
    in the default model. With regions a region-aware router picks the serving region
    when the client sends (``pick_region``) and a replica in it on arrival
    (``pick_in``); any other router picks its replica when the client sends. The
    request then pays its (client region, serving region) RTT, handshake and one way.

    Disconnects: a client drawn to leave does so ``after_s`` after its first token
    reached it (unless it already had the whole response). From then its stream
    delivers nothing and drains nothing, and under HTTP/1.1 its connection leaves the
    pool. The server learns of it one way later (signalled) or after the heartbeat
    timeout (silent) and cancels the request if it is still there.

    Waste, per disconnect: the time from the client leaving to the request stopping
    (its cancel, its last token, or the end of the run), in request-seconds and in
    GPU-seconds. A GPU-second here is the request's share of its replica: while it
    runs in a batch of B requests it holds ``gpus_per_replica / B`` GPUs (the batch
    size read from the replica's time series, sampled every step for runs of up to
    5,000 requests). A request blocked on its client's buffer still counts as running:
    it keeps its KV, hence its place in the batch."""

    def __init__(self, scenario, env, rec, replicas, router, pools, topo, net, downlinks,
                 draws: DisconnectDraws) -> None:
        self.scfg = scenario.stream
        self.protocol = scenario.network.protocol
        self.h2 = self.protocol == "http2"
        self.gpus = scenario.cluster.gpus_per_replica
        self.env, self.rec, self.replicas, self.router, self.pools = env, rec, replicas, router, pools
        self.topo, self.net, self.downlinks, self.dc = topo, net, downlinks, draws
        self.n_regions = len(topo.serving_names) if topo is not None else 1
        self.region_aware = topo is not None and hasattr(router, "pick_region")
        n = rec.n
        self.client_region = np.zeros(n, dtype=np.int64)
        self.region = np.zeros(n, dtype=np.int64)
        self.pre = np.full(n, -1, dtype=np.int64)   # replica chosen at send time, or -1
        self.key = np.zeros(n, dtype=np.int64)      # connection pool key: client x region
        self.released = np.zeros(n, dtype=bool)
        self.counted = np.zeros(n, dtype=bool)
        self.links: dict[int, Link] = {}            # HTTP/2: one downlink FIFO per client
        self.params: dict = {}                      # StreamParams per (client, region)
        self.stats = StreamStats()
        self.left: dict[int, tuple] = {}            # rid -> (time the client left, seq)
        self.released_at: dict[int, float] = {}     # rid -> when its connection went idle
        self.timed_out: dict[int, object] = {}      # rid -> seq closed by the write timeout
        #                                              (or by a drop it did not survive)
        # Connection drops and SSE reconnects (``reconnect``); ``deliver`` (the driver's)
        # takes a request sent again into a replica.
        self.reconnects = (Reconnects(self, self.scfg.reconnect, draws.drops)
                           if reconnects_on(self.scfg) else None)
        self.deliver = None

    def _timing(self, rid: int) -> NetworkTiming:
        if self.topo is None:
            return self.net
        return self.topo.timing[int(self.client_region[rid])][int(self.region[rid])]

    # -- a request's way in ---------------------------------------------------------
    def send(self, seq, now: float) -> float:
        """Route ``seq`` as its client sends it, take a connection; returns ``T_net``."""
        rid, c = seq.rid, seq.client
        r = 0
        if self.topo is not None:
            cr = int(self.topo.client_region[c])
            self.client_region[rid] = cr
            if self.region_aware:
                r = self.router.pick_region(self.replicas, cr)
            else:
                k = self.router.pick(self.replicas, seq)
                self.pre[rid] = k
                r = int(self.topo.replica_region[k])
        self.region[rid] = r
        key = c * self.n_regions + r
        self.key[rid] = key
        tm = self._timing(rid)
        is_new, pooled = self.pools.acquire(key, now, tm.handshake)
        seq.pooled = pooled
        self.rec.new_connection[rid] = is_new
        wait = 0.0 if is_new else self.pools.setup_wait(key, now, tm.handshake)
        return net_time(tm.send_time(seq.prompt_tokens), tm.handshake, is_new, wait)

    def replica_for(self, seq) -> int:
        """The replica ``seq`` joins on arrival."""
        k = int(self.pre[seq.rid])
        if k >= 0:
            return k
        if self.region_aware:
            return self.router.pick_in(self.replicas, int(self.region[seq.rid]))
        return self.router.pick(self.replicas, seq)

    def open_stream(self, seq, now: float) -> ClientStream:
        """The request's stream, its heartbeat clock starting now (it reached the server)."""
        rid, c = seq.rid, seq.client
        pk = (c, int(self.region[rid]))
        params = self.params.get(pk)
        if params is None:
            params = self.params[pk] = stream_params(self.scfg, self.downlinks[c],
                                                     self._timing(rid).deliver_s)
        link = None
        if self.h2:
            link = self.links.get(c)
            if link is None:
                link = self.links[c] = Link()
        # A client drawn to leave does so after its first attempt's first token.
        cb = ((lambda a, s=seq: self._first_token(s, a))
              if self.dc.leaves[rid] and self.rec.attempts[rid] == 1 else None)
        wto = ((lambda t, s=seq: self._write_timeout(s, t))
               if self.scfg.write_timeout_s is not None else None)
        st = ClientStream(params, now, link, cb, wto)
        if self.reconnects is not None:
            self.reconnects.attach(seq, st)
        return st

    # -- a request's way out -----------------------------------------------------------
    def _release(self, seq, free_at: float) -> None:
        rid = seq.rid
        if self.released[rid]:
            return
        self.released[rid] = True
        self.pools.release(int(self.key[rid]), free_at, seq.pooled)
        if self.dc.leaves[rid]:
            self.released_at[rid] = free_at

    def _count(self, seq) -> None:
        st = seq.stream
        if st is not None and st.result is not None and not self.counted[seq.rid]:
            self.counted[seq.rid] = True
            self.stats.add(st.result)

    def finished(self, seq, delivered_at: float) -> None:
        """The replica finished ``seq``; its last byte reached the client at ``delivered_at``."""
        self._release(seq, delivered_at)
        self._count(seq)

    def rejected(self, seq, now: float) -> None:
        """``seq`` was turned away on arrival; the client hears it one way later."""
        self._release(seq, now + self._timing(seq.rid).one_way)

    # -- disconnects ----------------------------------------------------------------------
    def _first_token(self, seq, arrival: float) -> None:
        t_left = float(arrival) + float(self.dc.after_s[seq.rid])
        self.env.timeout(max(t_left - self.env.now, 0.0)).callbacks.append(
            lambda _e: self._leave(seq, t_left))

    def _leave(self, seq, t: float) -> None:
        rid = seq.rid
        if self.rec.last_delivered[rid] <= t:
            return   # it had the whole response: an ordinary close, not a disconnect
        self.left[rid] = (t, seq)
        seq.stream.disconnect(t)
        if seq.pooled and not self.h2:
            # The client closed its connection: it can serve none of its later requests.
            self.pools.discard(int(self.key[rid]), self.released_at.pop(rid, None))
            seq.pooled = False
        notice = (self._timing(rid).one_way if self.dc.signalled[rid]
                  else self.scfg.disconnect.heartbeat_timeout_s)
        self.env.timeout(notice).callbacks.append(lambda _e: self._notice(seq))

    def _notice(self, seq) -> None:
        """The server learns the client is gone: cancel the request if still running."""
        if self.replicas[int(self.rec.replica[seq.rid])].cancel(seq.rid):
            self._release(seq, self.env.now)   # frees the HTTP/2 stream slot

    def _write_timeout(self, seq, t: float) -> None:
        """Its client did not drain for the write timeout: the server closes the stream
        at ``t`` and cancels the request (freeing its KV) if it is still running."""
        self.timed_out[seq.rid] = seq
        self.env.timeout(max(t - self.env.now, 0.0)).callbacks.append(
            lambda _e: self._notice(seq))

    # -- totals -------------------------------------------------------------------------
    def summary(self, sim_end: float) -> dict:
        """``meta`` entries: stream totals, disconnects and their waste; regions.
        Requests whose client left before their last token reached it are marked
        undelivered (``last_delivered`` = NaN) and ``cancelled``: not completed, and not
        unfinished either, however far the server got; a cancelled one gets the
        ``first_delivered`` its stream saw."""
        rec = self.rec
        waste = {True: [0, 0.0, 0.0], False: [0, 0.0, 0.0]}   # count, request-s, GPU-s
        cancelled = 0
        for rid, (t_left, seq) in self.left.items():
            self._count(seq)   # a cancelled stream is closed by the replica
            res = seq.stream.result
            if res is not None and np.isnan(rec.first_delivered[rid]):
                # Cancelled: the replica recorded no delivery, but the client did get
                # its first token(s) before it left.
                rec.first_delivered[rid] = res.first_arrival
            if rec.cancelled[rid]:
                end = rec.cancelled_at[rid]
                cancelled += 1
            elif not np.isnan(rec.last_token[rid]):
                end = rec.last_token[rid]
            else:
                end = sim_end
            end = max(float(end), float(t_left))
            series = rec.series[int(rec.replica[rid])]
            w = waste[bool(self.dc.signalled[rid])]
            w[0] += 1
            w[1] += end - t_left
            w[2] += self.gpus * batch_share_seconds(series[0], series[2], t_left, end)
            rec.last_delivered[rid] = np.nan
            # Its client left before the end reached it: it ends ``cancelled`` whether the
            # server cancelled it (``cancelled_at``) or finished generating first (a
            # silent disconnect found after the last token; ``cancelled_at`` stays NaN).
            rec.cancelled[rid] = True
        for rid, seq in self.timed_out.items():
            if rid in self.left:
                continue
            self._count(seq)
            res = seq.stream.result
            if res is not None and np.isnan(rec.first_delivered[rid]):
                rec.first_delivered[rid] = res.first_arrival
            # The server closed the stream before its end reached the client (its last
            # token may have been generated first, into the full buffer): cancelled.
            rec.last_delivered[rid] = np.nan
            rec.cancelled[rid] = True
        price = self.scfg.disconnect.gpu_cost_per_hour
        out = {"stream": {
            **self.stats.as_dict(),
            "disconnects": len(self.left),
            "disconnects_signalled": waste[True][0],
            "disconnects_unsignalled": waste[False][0],
            "disconnects_cancelled": cancelled,
            "wasted_request_s_signalled": waste[True][1],
            "wasted_request_s_unsignalled": waste[False][1],
            "wasted_gpu_s_signalled": waste[True][2],
            "wasted_gpu_s_unsignalled": waste[False][2],
            "wasted_cost_usd_unsignalled": (waste[False][2] / 3600.0 * price
                                            if price is not None else None),
        }}
        if self.reconnects is not None:
            out["stream"]["reconnect"] = self.reconnects.summary(self.stats)
        if self.topo is not None:
            routed = rec.replica >= 0
            reg = self.region[routed]
            rtt = self.topo.rtt[self.client_region[routed], reg]
            out["network"] = {
                "protocol": self.protocol,
                "requests_per_region": {nm: int((reg == j).sum())
                                        for j, nm in enumerate(self.topo.serving_names)},
                "mean_rtt_ms": float(rtt.mean() * 1000.0) if len(rtt) else None,
                "p99_rtt_ms": float(np.percentile(rtt, 99) * 1000.0) if len(rtt) else None,
            }
        return out
