"""``python -m simulator.cli``: the latsim command line."""
from simulator.cli.main import main

if __name__ == "__main__":
    main()
