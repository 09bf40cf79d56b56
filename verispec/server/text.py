"""Generated token ids -> text for a response, step by step."""

from __future__ import annotations

from verispec.display import TokenPieces


class TextStream(TokenPieces):
    """One sequence's response text as its steps arrive.

    `push` (TokenPieces) gives each token's piece and the rejected draft before it, for the
    playground. `content(final)` returns the next delta of the response text: held back while
    its tail could still begin a stop string, and ending before a stop string (OpenAI's
    convention; verispec's StoppingRules keep it).
    """

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()) -> None:
        super().__init__(tokenizer)
        self.stops = stops
        self.sent = 0  # characters of self.text already returned by content()
        self.stopped = False

    def content(self, final: bool) -> str:
        """The response text not yet returned (all of it, up to any stop string, when final)."""
        if self.stopped:
            return ""
        text = self.text
        longest = max((len(s) for s in self.stops), default=0)
        start = max(0, self.sent - longest)
        cuts = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if cuts:
            text = text[: min(cuts)]
            self.stopped = True
        elif not final:
            text = text[: len(text) - self._held(text)]
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        return max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if s.startswith(text[-n:])), default=0)
