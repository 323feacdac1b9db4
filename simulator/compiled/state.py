"""The compiled loop's state layout: which column of which array holds what.

Per request (``RQ[rid, Q_*]``), per replica (``RS[r, R_*]`` integers, ``RF[r, F_*]``
floats), run-wide (``GI[G_*]``, ``GF[H_*]``) and the integer parameters (``IP[P_*]``)
and float parameters (``FP[D_*]``). The names are those of ``fastreplica``'s fields."""
from __future__ import annotations

# Per request.
(Q_PREFILLED, Q_GENERATED, Q_KEY, Q_PHASE, Q_HELD, Q_POOLED, Q_NEXT, Q_DPOS,
 Q_NCOLS) = range(9)
# What is recorded per request: the ``Recorder``'s own arrays (``TS[T_*][rid]``).
(T_ENQ, T_SCHED, T_FIRST, T_FIRSTDEL, T_LAST, T_LASTDEL, T_GEN, T_REPLICA, T_REJ,
 T_NEWC) = range(10)
RECORDED = ("enqueued", "scheduled", "first_token", "first_delivered", "last_token",
            "last_delivered", "generated", "replica", "rejected", "new_connection")

# Per replica, integers.
(R_TICKS, R_GROWN, R_LATE, R_KEYSUM, R_KEYMAX, R_FREE, R_KV, R_OUT, R_IDLE, R_WAKE,
 R_VER, R_INEP, R_MODE, R_EPND, R_EPK, R_EPM, R_HASENDS, R_NCLS, R_UNUSED, R_WLEN,
 R_ND, R_NP, R_NCH, R_STEPND, R_NLT, R_ADMISSIONS, R_QUERIED, R_NSER,
 R_NCOLS) = range(29)
MODE_NONE, MODE_STEP, MODE_EPOCH = 0, 1, 2

# Per replica, floats.
F_EPSTART, F_LASTSAMPLE, F_NCOLS = range(3)

# Run-wide integers and floats.
G_EID, G_STEPS, G_NEWC, G_REUSEDC, G_NEXT, G_RR, G_ITL, G_NCOLS = range(8)
H_STEPTOT, H_T, H_NOW, H_NCOLS = range(4)

# Integer parameters.
(P_R, P_BUDGET, P_MAXSEQS, P_CHUNK, P_FIFO, P_CAPACITY, P_WATERMARK, P_PAGED, P_BS,
 P_MAXLEN, P_ROUTER, P_REUSE, P_POOLSIZE, P_HASUNTIL, P_MAXEPOCH, P_FLUSH, P_SERCAP,
 P_AGING, P_NCOLS) = range(19)
ROUTER_RR, ROUTER_LEAST = 0, 1

# Float parameters.
D_HANDSHAKE, D_ONEWAY, D_FT, D_INTERVAL, D_UNTIL, D_KEEPALIVE, D_AGING, D_NCOLS = range(8)

# The waiting queues (``WQ[W_*]``): per replica and class a FIFO linked through
# ``Q_NEXT`` (head, tail, length), the classes in the order each replica first saw them
# (``AgingPriorityQueue``'s dict order; ``R_NCLS`` of them), and scratch rows: each
# class's next candidate and the step's admissions. Without aging there is one class.
W_HEAD, W_TAIL, W_LEN, W_ORDER, W_CUR, W_ADM = range(6)

# Events (as ``fastreplica``: kinds, SimPy's priorities) and what the loop yields.
URGENT, NORMAL = 0, 1
EV_ARRIVE, EV_DELIVER, EV_END, EV_WAKE, EV_INTERRUPT, EV_STOP = range(6)
Y_DONE, Y_ITL, Y_SERIES, Y_PREEMPT, Y_EMPTY = range(5)
