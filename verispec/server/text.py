"""Generated token ids -> text for a response, step by step."""

from __future__ import annotations

from verispec.core.types import Step
from verispec.display import TokenPieces


class TextStream(TokenPieces):
    """One sequence's response text as its steps arrive.

    `push` (TokenPieces) gives each token's piece and the rejected draft before it, for the
    playground. `content(final)` returns the next delta of the response text: held back while
    its tail could still begin a stop string, and ending before a stop string (OpenAI's
    convention; verispec's StoppingRules keep it). Only the text not yet returned is searched,
    so the work per step does not grow with the answer: the text returned never ends with the
    beginning of a stop string, so no stop string can begin in it.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()) -> None:
        super().__init__(tokenizer)
        self.stops = stops
        self.pending = ""  # text decoded but not yet returned by content()
        self.stopped = False

    def push(self, step: Step) -> tuple[list[str], list[str]]:
        pieces, rejected = super().push(step)
        self.pending += "".join(pieces)
        return pieces, rejected

    def content(self, final: bool) -> str:
        """The response text not yet returned (all of it, up to any stop string, when final)."""
        if self.stopped:
            return ""
        text = self.pending
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            text = text[: min(cuts)]
            self.stopped = True
        elif not final:
            text = text[: len(text) - self._held(text)]
        self.pending = self.pending[len(text):]
        return text

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        return max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if s.startswith(text[-n:])), default=0)
