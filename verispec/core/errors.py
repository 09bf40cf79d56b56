"""One exception type for problems with what the user asked for.

The CLI prints these as a single line and exits non-zero; anything else is a bug and keeps its
traceback.
"""


class VerispecError(ValueError):
    """Bad input: an argument, a prompt, a model or a drafter that cannot be used as given.

    `field`: the request field at fault where known ("prompt", "max_new_tokens", "stop", ...;
    verispec.request names them), so a server can name the body field in its 400."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
