"""Import every built-in plug-in module so its ``register`` calls run.

Add a new plug-in module here (one line) and it becomes available by name in
scenarios.
"""
from simulator import workload  # noqa: F401  arrivals, lengths, synthetic
from simulator.workload import plugins as _workload_plugins  # noqa: F401  trace, servegen (issue 4)
from simulator import cost as costmodel  # noqa: F401  profile cost model
from simulator.cluster import routers  # noqa: F401  replica routers
