"""The SimPy model of a replica: the engine loop (``replica``), a step's effects
(``apply``) and KV memory under pressure (``memory``)."""
