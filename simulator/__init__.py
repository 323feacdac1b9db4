"""latsim's simulator: a SimPy model of LLM serving, from the client's socket to
the last streamed token. ``simulate(scenario, seed)`` is the entry point."""
__version__ = "0.1.0"
