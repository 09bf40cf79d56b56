"""Where generation stops inside a block of newly committed tokens."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


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
        from verispec.errors import VerispecError

        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise VerispecError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        stops = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings or ())
        if any(not s for s in stops):
            raise VerispecError("stop strings must be non-empty")
        if stops and tokenizer is None:
            raise VerispecError("stop strings need a tokenizer to decode the output")
        return StoppingRules(max_new_tokens, frozenset(eos), stops, tokenizer)

    def cut(self, generated: list[int], block: list[int]) -> tuple[int, bool]:
        """How many tokens of `block` (following `generated`) to emit, and whether to stop."""
        longest_stop = max((len(s) for s in self.stop_strings), default=0)
        previous_text_length = len(self.tokenizer.decode(generated)) if self.stop_strings else 0
        for i, token in enumerate(block):
            count = len(generated) + i + 1
            if token in self.eos_token_ids or count >= self.max_new_tokens:
                return i + 1, True
            if self.stop_strings:
                text = self.tokenizer.decode(generated + block[: i + 1])
                tail = text[max(0, previous_text_length - longest_stop):]
                if any(s in tail for s in self.stop_strings):
                    return i + 1, True
                previous_text_length = len(text)
        return len(block), False
