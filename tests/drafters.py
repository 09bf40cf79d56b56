"""Forcing drafters for the equality tests: they make every acceptance pattern happen."""

from __future__ import annotations

import torch

from verispec.core.types import Proposal
from verispec.drafters.base import Drafter, DraftRequest
from verispec.drafters.vocab import TokenText
from verispec.model.cached_model import CachedModel


class RandomDrafter(Drafter):
    """Uniformly random tokens: almost never accepted under greedy verification."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.generator = torch.Generator().manual_seed(seed)

    def reset(self) -> None:
        pass

    def propose(self, request: DraftRequest) -> Proposal:
        return Proposal(torch.randint(0, self.vocab, (request.k,), generator=self.generator))

    def commit(self, num_accepted: int) -> None:
        pass


class OracleDrafter(Drafter):
    """Knows the true continuation and corrupts it at chosen absolute output positions.

    With errors at positions E, a draft starting at output position s is correct up to the first
    e in E with e >= s: partial acceptance, exactly where the test wants it.
    """

    def __init__(self, prompt_length: int, truth: list[int], errors: set[int], vocab: int) -> None:
        self.prompt_length = prompt_length
        self.truth = truth
        self.errors = errors
        self.vocab = vocab
        self.proposals = 0

    def reset(self) -> None:
        self.proposals = 0

    def propose(self, request: DraftRequest) -> Proposal:
        start = request.tokens.shape[0] - self.prompt_length
        tokens = [self.truth[i] if i < len(self.truth) else 0 for i in range(start, start + request.k)]
        tokens = [(t + 1) % self.vocab if start + j in self.errors else t for j, t in enumerate(tokens)]
        self.proposals += 1
        return Proposal(torch.tensor(tokens))

    def commit(self, num_accepted: int) -> None:
        pass


class TreeOracleDrafter(Drafter):
    """OracleDrafter's continuation as one branch of a random tree of decoys.

    Depth k: at every level the true token sits at a random place among `width` siblings (the
    others random tokens, some with random children of their own), so greedy tree verification
    must find the branch, and the errors set where it breaks off, as for OracleDrafter.
    """

    def __init__(self, prompt_length: int, truth: list[int], errors: set[int], vocab: int,
                 width: int = 3, seed: int = 0) -> None:
        self.chain = OracleDrafter(prompt_length, truth, errors, vocab)
        self.vocab = vocab
        self.width = width
        self.generator = torch.Generator().manual_seed(seed)

    def reset(self) -> None:
        self.chain.reset()

    def _random(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.generator).tolist()

    def propose(self, request: DraftRequest) -> Proposal:
        main = self.chain.propose(request).tokens.tolist()
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        for token in main:
            slot = int(torch.randint(0, self.width, (1,), generator=self.generator))
            siblings = self._random(self.width)
            siblings[slot] = token
            first = len(tokens)
            for i, sibling in enumerate(siblings):
                tokens.append(sibling)
                parents.append(parent)
                if i != slot and i % 2 == 0:  # a decoy branch one level deeper
                    tokens.append(self._random(1)[0])
                    parents.append(len(tokens) - 2)
            parent = first + slot + sum(1 for i in range(slot) if i % 2 == 0)
        return Proposal(torch.tensor(tokens), parents=torch.tensor(parents))

    def commit(self, num_accepted: int) -> None:
        pass


class TextOracle(CachedModel):
    """A draft model that knows the text to come, for a drafter with another tokenizer than the
    target's (verispec.drafters.cross): its logits favour the token whose text is the longest
    that continues the truth its context is in (one of `truths`, bytes: several for a batch).
    At the byte offsets in `errors` it slips: the byte token `stray` (another where `stray` is
    right) in place of the truth's byte, after which it goes on with the truth as if it had
    been right. Off every truth, `stray`. With single bytes among its pieces it can cut a word
    or a character anywhere (`bytewise`: it drafts byte by byte). It stands in for the draft
    model's CachedModel (its ids, rewound by the drafter)."""

    def __init__(self, text: TokenText, truths: list[bytes], errors: set[int], stray: int,
                 bytewise: bool = False) -> None:
        self.lean, self.model = None, None
        self.text, self.truths, self.errors, self.stray = text, truths, errors, stray
        self.choices = sorted(((piece, i) for i, piece in enumerate(text.pieces)
                               if piece and (len(piece) == 1 or not bytewise)),
                              key=lambda choice: -len(choice[0]))
        self.width = len(text.pieces)
        self.ids: list[int] = []

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def reset(self) -> None:
        self.ids = []

    def rewind(self, length: int) -> None:
        self.ids = self.ids[:length]

    def forward_tail(self, tokens: torch.Tensor, count: int) -> torch.Tensor:
        self.ids += tokens.tolist()
        return torch.stack([self._logits(self.ids[: len(self.ids) - count + 1 + j]) for j in range(count)])

    def _logits(self, ids: list[int]) -> torch.Tensor:
        spelled = self.text.text(ids)
        token = self.stray
        truth = next((t for t in self.truths if len(t) > len(spelled) and all(
            a == b or i in self.errors for i, (a, b) in enumerate(zip(spelled, t)))), None)
        if truth is not None:
            rest = truth[len(spelled):]
            if len(spelled) in self.errors:  # a slip: one wrong byte
                rest = rest[:1]
                token = next(i for i in (self.stray, *(i for _, i in self.choices))
                             if self.text.pieces[i] != rest)
            else:
                token = next((i for piece, i in self.choices if rest.startswith(piece)), self.stray)
        logits = torch.zeros(self.width)
        logits[token] = 5.0
        return logits
