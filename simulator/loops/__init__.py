"""Event loops that run the model: ``simulate`` picks one per run; ``simpy`` is the
reference SimPy process per replica, ``compiled`` the same model compiled with numba."""
