"""The replica model replayed without SimPy, in Python."""
