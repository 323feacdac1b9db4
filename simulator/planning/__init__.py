"""Many runs: parameter sweeps (``sweep``), the capacity planner (``planner``) and where
their points run (``executors``: a process pool or Ray)."""
