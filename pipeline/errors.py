"""The one error the pipeline reports to an operator: what is wrong, and with which file."""


class UsageError(Exception):
    """Bad input or options; ``str()`` is the message to print (the command exits 2)."""
