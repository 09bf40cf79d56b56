"""One exception type for problems with what the user asked for.

The CLI prints these as a single line and exits non-zero; anything else is a bug and keeps its
traceback.
"""


class VerispecError(ValueError):
    """Bad input: an argument, a prompt, a model or a drafter that cannot be used as given."""
