"""The one exception type users see: its message becomes a single line on stderr and exit code 2."""


class GraftError(Exception):
    """A problem with the user's input or environment (not a bug): reported in one line, never a traceback."""
