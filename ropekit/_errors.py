"""Exception types shared by several layers, defined below all of them."""

__all__ = ["CommandError"]


class CommandError(Exception):
    """A user error on the command line: printed as one line, exit code 2, no traceback."""
