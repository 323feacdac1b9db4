"""The ``latsim`` command line: one module per command group (``main`` holds the app
and ``run``; ``plan``: sweep and plan; ``trace``; ``serve``: serve and bench;
``report``)."""
from simulator.cli.main import main

__all__ = ["main"]
