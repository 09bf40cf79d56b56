"""Generated token ids -> text for a response, step by step."""

from __future__ import annotations

from verispec.types import Fate, Step


class TextStream:
    """One sequence's text as its steps arrive.

    `push` returns each new token's own piece of text (what the playground paints by fate) and
    the rejected draft text before each (struck out). `content(final)` returns the next delta of
    the response text: held back while its tail could still begin a stop string, and ending
    before a stop string (OpenAI's convention; verispec's StoppingRules keep it). Pieces of a
    character split across tokens arrive with the token that completes it.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.text = ""  # decoded so far, whole characters only
        self.sent = 0  # characters of self.text already returned by content()
        self.stopped = False

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def push(self, step: Step) -> tuple[list[str], list[str]]:
        """Pieces of text for the step's tokens, and the rejected draft shown before each."""
        pieces, rejected = [], []
        for token, fate in zip(step.tokens, step.fates):
            struck = ""
            if fate is Fate.RECOVERED and step.rejected:
                struck = self._decode(self.tokens + step.rejected[:1])[len(self.text):]
            rejected.append(struck)
            self.tokens.append(token)
            text = self._decode(self.tokens)
            if text.endswith("\ufffd"):
                pieces.append("")
                continue
            pieces.append(text[len(self.text):])
            self.text = text
        return pieces, rejected

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
