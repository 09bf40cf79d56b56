"""Grammar-constrained decoding: JSON schemas, regular expressions and Lark grammars over the
target's tokens, exact under speculation.

The constrained target's next-token distribution is its own masked to the tokens the grammar
allows, renormalized, then warped (temperature, top-k, top-p) as vLLM and llama.cpp do. The
grammar engine is llguidance (pinned): a small wheel with no dependencies, JSON schema / regex /
Lark in one compiler, masks computed on the CPU in about 0.1 ms, rollback, and forced tokens.

A sequence's `Constraint` gives the engine four things each step:
- `forced()`: tokens the grammar leaves no choice about (a schema's keys and punctuation). They
  are the step's draft, proposed for free; their masked probability is 1, so verification always
  keeps them (fate FORCED).
- `cut(proposal)`: a chain cut before its first token the grammar refuses, each kept position's q
  renormalized over the allowed tokens (the kept drafts are draws from that masked q, so the
  rejection rule stays exact). Trees and drafts with a side branch are not cut: a refused node's
  masked probability is 0, so it is never accepted.
- `masks(proposal)`: the allowed tokens at the root and after every draft node, for the verifier.
- `commit(tokens)`: the tokens verification kept; True once the grammar is complete (nothing more
  may follow), which ends the sequence.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, replace

import llguidance
import torch

from verispec.core.errors import VerispecError
from verispec.core.types import Proposal

# JSON as people and models write it (json.dumps' separators), not whitespace-flexible: with one
# way to write the punctuation, llguidance can force it (free draft tokens).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "regex", "lark")


@dataclass(frozen=True)
class Grammar:
    """What the output must match: kind is one of KINDS; source is the schema as JSON text, the
    regular expression or the Lark grammar."""

    kind: str
    source: str = ""

    @staticmethod
    def of(json_schema: dict | str | None = None, regex: str | None = None,
           grammar: str | None = None) -> Grammar | None:
        """The grammar that at most one of the arguments names (None: unconstrained)."""
        given = [name for name, value in (("json_schema", json_schema), ("regex", regex),
                                          ("grammar", grammar)) if value is not None]
        if len(given) > 1:
            raise VerispecError(f"give one constraint, got {' and '.join(given)}")
        if json_schema is not None:
            return Grammar("json_schema", _schema_text(json_schema))
        if regex is not None:
            if not isinstance(regex, str) or not regex:
                raise VerispecError("regex must be a non-empty string")
            return Grammar("regex", regex)
        if grammar is not None:
            if not isinstance(grammar, str) or not grammar.strip():
                raise VerispecError("grammar must be a non-empty Lark grammar")
            return Grammar("lark", grammar)
        return None

    def llguidance(self) -> str:
        """The grammar in llguidance's own form."""
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, overrides=JSON_STYLE)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        raise VerispecError(f"unknown grammar kind {self.kind!r}; known: {', '.join(KINDS)}")


def _schema_text(schema: dict | str) -> str:
    """A JSON schema as JSON text, checked to be a JSON object."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as error:
            raise VerispecError(f"the JSON schema is not valid JSON: {error}") from None
    else:
        parsed = schema
    if not isinstance(parsed, dict):
        raise VerispecError(f"a JSON schema is a JSON object, got {type(parsed).__name__}")
    return json.dumps(parsed)


# An llguidance tokenizer costs about a second to build: one per (tokenizer, vocabulary width).
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ll_tokenizer(tokenizer, vocab_size: int, eos_ids: set[int]) -> llguidance.LLTokenizer:
    built = _TOKENIZERS.setdefault(tokenizer, {})
    key = (vocab_size, tuple(sorted(eos_ids)))
    if key not in built:
        eos = [t for t in sorted(eos_ids) if t < vocab_size] or None
        import llguidance.hf  # imports transformers (seconds): only when a grammar is used

        try:
            built[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        except Exception as error:  # a slow (Python) tokenizer, or one llguidance cannot read
            raise VerispecError(f"constrained decoding needs a fast Hugging Face tokenizer: {error}"
                                ) from None
    return built[key]


class Constraint:
    """One sequence's grammar state (an llguidance matcher) over a vocabulary of `vocab_size`."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, grammar: Grammar) -> None:
        self.matcher, self.vocab_size, self.grammar = matcher, vocab_size, grammar
        self._words = (vocab_size + 31) // 32  # int32 words of one bitmask row
        self._bits = torch.arange(32, dtype=torch.int32)

    @staticmethod
    def compile(grammar: Grammar, tokenizer, vocab_size: int, eos_ids: set[int]) -> Constraint:
        """A fresh constraint for `grammar` over the model's vocabulary; a bad schema, regex or
        grammar is a VerispecError naming the problem."""
        if tokenizer is None:
            raise VerispecError("constrained decoding needs the model's tokenizer")
        ll_tokenizer = _ll_tokenizer(tokenizer, vocab_size, eos_ids)
        try:
            text = grammar.llguidance()
        except ValueError as error:
            raise VerispecError(f"bad {grammar.kind.replace('_', ' ')}: {error}") from None
        problem = llguidance.LLMatcher.validate_grammar(text, ll_tokenizer)
        if problem and not problem.startswith("WARNING"):
            raise VerispecError(f"bad {grammar.kind.replace('_', ' ')}: {problem.strip()}")
        matcher = llguidance.LLMatcher(ll_tokenizer, text, log_level=0)
        if matcher.is_error():
            raise VerispecError(f"bad {grammar.kind.replace('_', ' ')}: {matcher.get_error()}")
        return Constraint(matcher, vocab_size, grammar)

    def copy(self) -> Constraint:
        """An independent copy in the same state (another sample of the same prompt)."""
        return Constraint(self.matcher.deep_copy(), self.vocab_size, self.grammar)

    def reset(self) -> None:
        self.matcher.reset()

    def forced(self) -> list[int]:
        """Tokens the grammar allows no alternative to, in order (often none)."""
        if self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        view = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())

    def _unpack(self, bitmask: torch.Tensor) -> torch.Tensor:
        """bitmask [n, words] int32 -> allowed [n, vocab] bool."""
        bits = (bitmask[:, :, None] >> self._bits) & 1  # [n, words, 32]
        return bits.reshape(bitmask.shape[0], -1)[:, : self.vocab_size].bool()

    def masks(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """The tokens allowed at the root and after each draft node (a chain is parents
        [-1, 0, 1, ...]). Node i's row is its state's mask; a node the grammar refuses (or below
        one) gets its parent's row, which never matters: it cannot be accepted. [1 + n, vocab]

        Example: regex "ab", draft tokens ["a", "b"] -> rows allow {a}, {b}, {EOS}."""
        bitmask = torch.zeros(1 + len(tokens), self._words, dtype=torch.int32)
        self._fill(bitmask, 0)
        paths: list[list[int] | None] = []
        for i, (token, parent) in enumerate(zip(tokens, parents)):
            above = [] if parent < 0 else paths[parent]
            path = None if above is None else above + [token]
            consumed = 0 if path is None else self.matcher.try_consume_tokens(path)
            if path is not None and consumed == len(path):
                self._fill(bitmask, i + 1)
            else:
                path = None
                bitmask[i + 1] = bitmask[parent + 1]
            if consumed:
                self.matcher.rollback(consumed)
            paths.append(path)
        return self._unpack(bitmask)

    def cut(self, proposal: Proposal) -> tuple[Proposal, torch.Tensor]:
        """The proposal the verifier sees and its masks [1 + n, vocab]: a plain chain is cut
        before its first refused token and its q renormalized over the allowed tokens."""
        tokens = proposal.tokens.tolist()
        if proposal.parents is not None or proposal.side is not None:
            return proposal, self.masks(tokens, proposal.tree_parents.tolist()).to(proposal.tokens.device)
        legal = self.matcher.validate_tokens(tokens)
        tokens = tokens[:legal]
        masks = self.masks(tokens, list(range(-1, legal - 1))).to(proposal.tokens.device)
        draft_probs = proposal.draft_probs
        if draft_probs is not None:
            kept = draft_probs[:legal] * masks[:legal]
            draft_probs = kept / kept.sum(-1, keepdim=True).clamp_min(torch.finfo(kept.dtype).tiny)
        if legal < len(proposal) or draft_probs is not None:
            proposal = replace(proposal, tokens=proposal.tokens[:legal], draft_probs=draft_probs)
        return proposal, masks

    def commit(self, tokens: list[int]) -> int | None:
        """Advance over tokens verification kept; the number of them after which the grammar is
        complete (the sequence ends there), else None."""
        for i, token in enumerate(tokens):
            if not self.matcher.consume_token(token):
                raise VerispecError(f"token {token} broke the grammar: {self.matcher.get_error()}")
            if self.matcher.is_stopped():
                return i + 1
        return None


def apply_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """The logits [n, vocab] with every token the grammar refuses at -inf (a new tensor)."""
    return logits.masked_fill(~masks, float("-inf"))
