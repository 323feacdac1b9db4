"""The whole cluster of a scenario: the KV capacity a request may count on (the largest
pool's, in a mixed fleet) and the requests that can never run on it, before any loop."""
from __future__ import annotations

from typing import Optional

import numpy as np

from simulator.deploy.replica import replica_capacity
from simulator.model.kv import rules as kvr


def kv_capacity_blocks(scenario) -> int:
    """KV blocks per replica (``deploy.replica.replica_capacity``: what the cost model's
    memory rule leaves, or ``engine.kv.num_blocks`` when given and it fits). A mixed
    fleet: each pool's own (checked here); a request that fits the largest can run
    somewhere."""
    if scenario.cluster.pools:
        from simulator.cluster.pools import plan_pools
        return max(p.capacity for p in plan_pools(scenario))
    return replica_capacity(scenario)


def never_fit(scenario, workload, capacity: Optional[int] = None) -> dict:
    """Requests that can never run on a replica of this scenario (``kv.rules.never_fits``
    on every request at once, before the run): ``{"over_max_model_len": n,
    "over_capacity": n, "largest_blocks": blocks the largest request needs,
    "capacity_blocks": ..., "usable_blocks": capacity less the watermark}``."""
    kv = scenario.engine.kv
    cap = int(kv_capacity_blocks(scenario) if capacity is None else capacity)
    n = len(workload)
    why = np.zeros(n, np.int64)
    blocks = np.zeros(n, np.int64)
    wm = kvr.watermark_blocks(float(kv.watermark), cap)
    kvr.never_fits_each(kv.allocation == "paged", workload.prompt_tokens.astype(np.int64),
                        workload.output_tokens.astype(np.int64),
                        -1 if kv.max_model_len is None else int(kv.max_model_len),
                        int(kv.block_size), cap, wm, why, blocks)
    return {"over_max_model_len": int((why == kvr.OVER_MAX_MODEL_LEN).sum()),
            "over_capacity": int((why == kvr.OVER_CAPACITY).sum()),
            "largest_blocks": int(blocks.max()) if n else 0,
            "capacity_blocks": cap, "usable_blocks": cap - wm}
