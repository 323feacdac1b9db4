"""Deployment: what a replica of a scenario is (its KV capacity, KV arguments, bytes per
cached token, GPUs), computed from the scenario before any loop runs.

``replica``: one replica, asked of its cost model through the ``CostModel`` interface
(``simulator.cost.model``); ``fleet``: the whole cluster (a mixed fleet's pools:
``cluster.pools.plan_pools``) and the requests that can never run on it. ``cluster/``
and ``report/`` read these, never ``loops/``.
"""
