"""The ``latsim`` command line: one module per command group (``main`` holds the app
and its entry point; ``run``; ``plan``: sweep and plan; ``trace``; ``serve``: serve and
bench; ``report``; ``cost``). Importing this package imports no command's module."""


def main(argv=None) -> None:
    """The console script ``latsim`` (``simulator.cli.main.main``)."""
    from simulator.cli.main import main as _main
    _main(argv)


__all__ = ["main"]
