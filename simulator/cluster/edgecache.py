"""The edge's result cache: which requests ask the same thing, which of them it
answers, and what the popularity laws say it should (``edge.cache``).

Keys (``prompt_keys``): a Zipf popularity over a catalogue of ``K`` prompts, drawn
independently per request (the independent reference model, IRM), or a trace's own
prompt identity (its ``hash_ids``: equal lists, equal prompt).

The cache (``lookup``) is played out in arrival order, before the cluster runs: a
request whose key holds a live entry is a hit and refreshes the entry's recency (LRU);
any other request is a miss and stores its key, evicting the least recently used
entry when ``capacity`` entries are held. An entry stored at ``t`` lives until
``t + ttl_s`` (a hit does not extend it). An entry counts from when its miss was
sent: a repeat that comes while that fetch is still in flight is a hit that waits
for it (request coalescing, as CDN caches collapse concurrent fetches); the wait is
the hit's ``T_queue`` (``cluster.edge``).

Closed forms for the tests and the summary's ``expected_hit_ratio`` (IRM):
- unbounded, no TTL, ``N`` requests: a request is a hit iff its key came before, so
  E[hits] = N - E[distinct keys] = N - sum_k (1 - (1 - p_k)^N)   (exact);
- LRU of ``C`` entries: Che's approximation (Che, Tung, Wang 2002, IEEE JSAC 20(7);
  its accuracy for Zipf shown by Fricker, Robert, Roberts 2012, ITC 24): with the
  characteristic time ``T_C`` solving sum_k (1 - exp(-p_k T_C)) = C, the hit ratio is
  sum_k p_k (1 - exp(-p_k T_C)) (``T`` in requests);
- TTL ``T`` (s), unbounded, Poisson arrivals of rate ``lambda``: each fetch of key
  ``k`` opens a window of ``T`` in which its ``lambda p_k T`` expected requests hit,
  then the next request misses (a renewal cycle), so key ``k``'s hit ratio is
  lambda p_k T / (1 + lambda p_k T)   (exact).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Optional

import numpy as np

MISS = -1


def zipf_probabilities(catalogue: int, exponent: float) -> np.ndarray:
    """p_k proportional to k^-s, k = 1..K."""
    w = np.arange(1, catalogue + 1, dtype=np.float64) ** -float(exponent)
    return w / w.sum()


def prompt_keys(pop, workload, rng: np.random.Generator) -> np.ndarray:
    """One integer key per request (``edge.cache.popularity``): a Zipf draw (0-based
    catalogue index) or the index of the request's distinct ``hash_ids`` list."""
    n = len(workload)
    if pop.kind == "zipf":
        return rng.choice(pop.catalogue, size=n, p=zipf_probabilities(pop.catalogue,
                                                                        pop.exponent))
    ids: dict = {}
    hashes = workload.hash_ids
    return np.array([ids.setdefault(tuple(np.asarray(h).tolist()), len(ids))
                     for h in hashes], dtype=np.int64)


def lookup(keys: np.ndarray, times: np.ndarray, capacity: Optional[int],
           ttl_s: Optional[float]) -> np.ndarray:
    """Play the cache out over requests with ``keys`` reaching it at ``times`` (sorted):
    for each request the index of the miss whose entry it hits, or ``MISS``. (A Python
    loop over an ``OrderedDict``, ~1 us a request: the cache's rule written once, and
    read here only.)"""
    n = len(keys)
    src = np.full(n, MISS, dtype=np.int64)
    entries: OrderedDict = OrderedDict()     # key -> (miss index, expiry), LRU first
    cap = capacity if capacity is not None else n + 1
    ttl = math.inf if ttl_s is None else float(ttl_s)
    for i in range(n):
        k = int(keys[i])
        e = entries.get(k)
        if e is not None:
            if e[1] > times[i]:
                src[i] = e[0]
                entries.move_to_end(k)
                continue
            del entries[k]                   # expired: fetched again below
        if len(entries) >= cap:
            entries.popitem(last=False)
        entries[k] = (i, times[i] + ttl)
    return src


def same_lengths(keys: np.ndarray, prompt: np.ndarray, output: np.ndarray):
    """Each request's prompt and output lengths replaced by those of the first request
    with its key (the same prompt has the same length and the same cached answer)."""
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    return prompt[first][inverse], output[first][inverse]


# -- closed forms (IRM) ---------------------------------------------------------------
def expected_hits_unbounded(p: np.ndarray, n: int) -> float:
    """E[hits] of an unbounded, TTL-free cache over ``n`` IRM requests (exact)."""
    return float(n - np.sum(-np.expm1(n * np.log1p(-np.minimum(p, 1 - 1e-16)))))


def distinct_variance_bound(p: np.ndarray, n: int) -> float:
    """An upper bound on Var[distinct keys] of ``n`` IRM requests: the keys' presence
    indicators are negatively associated (Dubhashi and Ranjan 1998, balls in bins), so
    the variance is at most the sum of theirs, sum_k q_k (1 - q_k)."""
    q = -np.expm1(n * np.log1p(-np.minimum(p, 1 - 1e-16)))
    return float(np.sum(q * (1.0 - q)))


def che_hit_ratio(p: np.ndarray, capacity: int) -> float:
    """Che's approximation of an LRU cache's hit ratio (module doc); 1 - misses of the
    cold start aside. A capacity of at least the catalogue holds everything: 1."""
    if capacity >= len(p):
        return 1.0
    lo, hi = 0.0, 1.0
    while np.sum(-np.expm1(-p * hi)) < capacity:
        hi *= 2.0
    for _ in range(200):                     # bisection to machine precision
        mid = 0.5 * (lo + hi)
        if np.sum(-np.expm1(-p * mid)) < capacity:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 4e-16 * hi:
            break                            # (~55 halvings: a 1e7 catalogue in seconds)
    return float(np.sum(p * -np.expm1(-p * 0.5 * (lo + hi))))


def ttl_hit_ratio(p: np.ndarray, rate: float, ttl_s: float) -> float:
    """Hit ratio of an unbounded TTL cache (no refresh on hit) under Poisson arrivals
    of ``rate`` per second (module doc; exact in the long run)."""
    x = rate * p * ttl_s
    return float(np.sum(p * x / (1.0 + x)))


def expected_hit_ratios(pop, capacity: Optional[int], ttl_s: Optional[float], n: int,
                        span_s: float) -> Optional[dict]:
    """What the popularity law says of a Zipf cache over ``n`` requests spanning
    ``span_s`` (None for a trace's keys, or a TTL shorter than the span, where it depends
    on the arrival process): ``no_eviction``, exact for a cache that never evicts
    (unbounded, or while it holds fewer than ``capacity`` prompts, as a short run from
    cold may); ``lru_che``, the steady state of an LRU cache (Che's approximation; 1
    when it holds the whole catalogue)."""
    if pop.kind != "zipf" or n == 0 or (ttl_s is not None and ttl_s < span_s):
        return None
    p = zipf_probabilities(pop.catalogue, pop.exponent)
    out = {"no_eviction": expected_hits_unbounded(p, n) / n}
    if capacity is not None:
        out["lru_che"] = che_hit_ratio(p, capacity)
    return out
