"""Registration point for workload sources beyond the synthetic one (trace replay, ServeGen).

Importing this module runs their ``WORKLOADS.register`` calls (``kind: trace``,
``kind: servegen``).
"""
from simulator.workload import servegen  # noqa: F401  (registration side effects)
from simulator.workload import traces  # noqa: F401  (registration side effects)
