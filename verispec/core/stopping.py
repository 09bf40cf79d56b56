"""Where generation stops inside a block of newly committed tokens."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Characters beyond the longest stop string that the decoded tail must hold: decoding a tail that
# starts inside a character (or a word whose leading space its tokenizer drops when alone) can
# change its first few characters, never the rest.
TAIL_MARGIN = 8


@dataclass(frozen=True)
class StoppingRules:
    """EOS ids, stop strings (need a tokenizer) and a token budget.

    The token that ends generation is kept: an EOS token, the token that completes a stop string,
    the max_new_tokens-th token. Nothing after it is emitted.
    """

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    tokenizer: object | None = None

    @staticmethod
    def build(max_new_tokens: int, eos_token_id: int | Iterable[int] | None = None,
              stop_strings: str | Iterable[str] | None = None, tokenizer=None) -> StoppingRules:
        from verispec.core.errors import VerispecError

        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise VerispecError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}",
                                field="max_new_tokens")
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        stops = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings or ())
        if any(not s for s in stops):
            raise VerispecError("stop strings must be non-empty", field="stop")
        if stops and tokenizer is None:
            raise VerispecError("stop strings need a tokenizer to decode the output", field="stop")
        return StoppingRules(max_new_tokens, frozenset(eos), stops, tokenizer)

    def cut(self, generated: list[int], block: list[int]) -> tuple[int, bool]:
        """How many tokens of `block` (following `generated`) to emit, and whether to stop.

        Stop strings are looked for in the text of a tail of `generated` long enough to hold the
        longest of them (plus a margin for a character cut at the tail's start), not in the whole
        answer: the work per step does not grow with the answer's length."""
        longest_stop = max((len(s) for s in self.stop_strings), default=0)
        tail = self._tail(generated, longest_stop + TAIL_MARGIN) if self.stop_strings else []
        previous_text_length = len(self.tokenizer.decode(tail)) if self.stop_strings else 0
        for i, token in enumerate(block):
            count = len(generated) + i + 1
            if token in self.eos_token_ids or count >= self.max_new_tokens:
                return i + 1, True
            if self.stop_strings:
                text = self.tokenizer.decode(tail + block[: i + 1])
                recent = text[max(0, previous_text_length - longest_stop):]
                if any(s in recent for s in self.stop_strings):
                    return i + 1, True
                previous_text_length = len(text)
        return len(block), False

    def _tail(self, generated: list[int], chars: int) -> list[int]:
        """The shortest tail of `generated` (doubling from `chars` tokens) whose text has at least
        `chars` characters, or all of it."""
        size = chars
        while size < len(generated) and len(self.tokenizer.decode(generated[-size:])) < chars:
            size *= 2
        return generated[-size:] if size < len(generated) else generated
