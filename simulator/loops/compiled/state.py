"""The compiled loop's state layout: which column of which array holds what.

Per request (``RQ[rid, Q_*]``), per replica (``RS[r, R_*]`` integers, ``RF[r, F_*]``
floats), run-wide (``GI[G_*]``, ``GF[H_*]``) and the integer parameters (``IP[P_*]``)
and float parameters (``FP[D_*]``). The names follow the SimPy replica's fields."""
from __future__ import annotations

# Per request, integers (``Q_NEXT`` links the waiting or the swapped queue it is in;
# ``Q_FKEY`` is its live finish-heap entry, ``tick << 32 | rid``) and floats.
# ``Q_RESUMED``: it waits among the resumed requests; ``Q_ROUND``: the candidate round
# that last offered it from there.
# ``Q_DROPPED``: the KV its last preemption by recompute dropped (``Seq.dropped``).
(Q_PREFILLED, Q_GENERATED, Q_KEY, Q_PHASE, Q_HELD, Q_POOLED, Q_NEXT, Q_DPOS, Q_PLEN,
 Q_JOIN, Q_LATE, Q_DECODING, Q_SWAPBLK, Q_FKEY, Q_RESUMED, Q_ROUND, Q_DROPPED,
 Q_NCOLS) = range(18)
QF_LAST_T, QF_PREEMPTED_AT, QF_NCOLS = range(3)
# What is recorded per request: the ``Recorder``'s own arrays (``TS[T_*][rid]``).
(T_ENQ, T_SCHED, T_FIRST, T_FIRSTDEL, T_LAST, T_LASTDEL, T_GEN, T_REPLICA, T_REJ,
 T_NEWC, T_PREEMPTIONS, T_RECOMPUTED, T_PREEMPTED_S, T_SWAPPED, T_CACHED) = range(15)
RECORDED = ("enqueued", "scheduled", "first_token", "first_delivered", "last_token",
            "last_delivered", "generated", "replica", "rejected", "new_connection",
            "preemptions", "recomputed_tokens", "preempted_s", "swapped_bytes",
            "cached_tokens")

# Per replica, integers (``R_IHEAD``, ``R_ITAIL``, ``R_ILEN``: async scheduling's inbox,
# linked through ``Q_NEXT``, arrivals no decision has seen yet).
(R_TICKS, R_GROWN, R_LATE, R_KEYSUM, R_KEYMAX, R_FREE, R_KV, R_OUT, R_IDLE, R_WAKE,
 R_VER, R_INEP, R_MODE, R_EPK, R_EPM, R_HASENDS, R_NCLS, R_CPU, R_WLEN,
 R_ND, R_NP, R_NCH, R_STEPND, R_NLT, R_ADMISSIONS, R_QUERIED, R_NSER, R_SHEAD, R_STAIL,
 R_SLEN, R_RHEAD, R_RLEN, R_IHEAD, R_ITAIL, R_ILEN, R_NCOLS) = range(36)
MODE_NONE, MODE_STEP, MODE_EPOCH, MODE_COPY = 0, 1, 2, 3

# Per replica, floats (``F_DECIDED``: when the step now running was planned; ``F_STEPEND``:
# when the last step ended; async scheduling's ``_decided_at`` and ``_step_end``).
# ``F_LOAD``: this step's loads from the CPU tier (``model.kv.offload``).
F_EPSTART, F_LASTSAMPLE, F_LASTDEC, F_COPY, F_COPYING, F_DECIDED, F_STEPEND, F_LOAD, F_NCOLS = range(9)

# Run-wide integers and floats.
# ``G_ITL`` entries buffered, the current flush segment's start, and how many flushes
# (``ItlHistogram``'s, at the ends of ``ITL[2][:G_NFL]``) wait for Python.
(G_EID, G_STEPS, G_NEWC, G_REUSEDC, G_NEXT, G_RR, G_ITL, G_ITLSEG, G_NFL, G_RANDOM,
 G_ROUND, G_NCOLS) = range(12)
H_STEPTOT, H_T, H_NOW, H_SWAPCOPY, H_NCOLS = range(5)

# Integer parameters. The policy: its fill rule and order (numbers in ``queue.FILLS`` /
# ``ORDERS``), its requeue rule, and whether its order changes with time alone;
# ``P_PREFIX``: prefix caching (paged), the pools of ``prefix``; ``P_OFFLOAD``: a CPU tier
# under it (``model.kv.offload``, its arrays in ``prefix``).
(P_R, P_BUDGET, P_MAXSEQS, P_CHUNK, P_FILL, P_CAPACITY, P_WATERMARK, P_PAGED, P_BS,
 P_MAXLEN, P_ROUTER, P_REUSE, P_POOLSIZE, P_HASUNTIL, P_FLUSH, P_SERCAP,
 P_ORDER, P_SWAP, P_VICTIM, P_CPUBLOCKS, P_REQUEUE, P_TIMEDEP, P_PADDED, P_FILLBUDGET,
 P_FILLSEQS, P_PREFIX, P_ASYNC, P_OFFLOAD, P_NCOLS) = range(29)
ROUTER_RR, ROUTER_LEAST, ROUTER_RANDOM = 0, 1, 2

# Float parameters (``D_ONEWAY``: a frame's way to the client, with the API server's
# response side; ``D_NETONEWAY``: the network's alone; ``D_FIRSTOUT``: the API server's
# time per output listed ahead of a first token, ``wire.frontend``; ``D_OFFBPS``: the
# link a CPU tier's loads take).
(D_HANDSHAKE, D_ONEWAY, D_FT, D_INTERVAL, D_UNTIL, D_KEEPALIVE, D_BLOCKBYTES,
 D_SWAPBPS, D_NETONEWAY, D_FIRSTOUT, D_OFFBPS, D_NCOLS) = range(12)

# The waiting queues (``WQ[W_*]``, see ``queue``): per replica and class a FIFO linked
# through ``Q_NEXT`` (head, tail, length), the classes in the order each replica first saw
# them (``R_NCLS`` of them; one class when the order ignores classes), each class's next
# candidate; the fill rule's scratch: the candidates (request, prefill tokens, blocks),
# what it gives each, the prefilling requests' tokens left and what it gives each; and the
# order key's parameters.
(W_HEAD, W_TAIL, W_LEN, W_ORDER, W_CUR, W_CAND, W_CREM, W_CNEED, W_COUT, W_PREM, W_POUT,
 W_OP) = range(12)

# Events (as the SimPy replica's: kinds, SimPy's priorities) and what the loop yields.
URGENT, NORMAL = 0, 1
EV_ARRIVE, EV_DELIVER, EV_END, EV_WAKE, EV_INTERRUPT, EV_STOP = range(6)
Y_DONE, Y_ITL, Y_SERIES, Y_EMPTY = range(4)
