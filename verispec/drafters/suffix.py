"""Suffix decoding (SuffixDecoding, Oliaro et al. 2025): draft the continuation that most often
followed the context's longest matching suffix, in the request's own tokens and in earlier outputs
of the same model.

Instead of a suffix tree, a suffix index: every position of every indexed sequence is filed under
the two tokens before it, and a match is extended backwards from there. The occurrences of the
context's last `L` tokens and the tokens after each are what a suffix tree's node for that pattern
counts, so the frequency tree built from them is the suffix tree's subtree below the match; the
index costs a few entries per token where a depth-D suffix tree costs D nodes.

Two indexes are read: the request's own (prompt and output so far) and a cache shared by every
suffix drafter of one model (`shared_cache`), holding earlier outputs (each after the last tokens
of its prompt, so a repeated question matches from its first output token) within a bound on
tokens, least recently used sequences evicted first. The drafter is deterministic: draft_probs is
None (one-hot q), so verification stays exact.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from verispec.core.errors import VerispecError
from verispec.core.tree import TreeSettings
from verispec.core.types import Proposal
from verispec.drafters.base import Drafter, DraftRequest

ANCHOR = 2  # tokens a match must share at least (the index key)
MAX_OCCURRENCES = 64  # most recent occurrences of the anchor examined per source and step
THRESHOLDS = 3  # longest distinct match lengths whose frequency trees are compared


class SuffixIndex:
    """Sequences of tokens, every position filed under the ANCHOR tokens before it.

    Bounded by `max_tokens` (None: unbounded): past it, the least recently used sequences go
    (`touch` marks a sequence used; writing to it does too). Thread-safe: one cache serves every
    request of a model, a server's scheduler thread and callers of `generate` alike.
    """

    def __init__(self, max_tokens: int | None = None) -> None:
        self.max_tokens = max_tokens
        self._sequences: OrderedDict[int, list[int]] = OrderedDict()
        self._where: dict[tuple[int, ...], dict[tuple[int, int], None]] = {}  # anchor -> (seq, end)
        self._tokens = 0
        self._next = 0  # the next sequence's id
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Tokens held."""
        return self._tokens

    @property
    def sequences(self) -> int:
        return len(self._sequences)

    def start(self, tokens: list[int]) -> int:
        """A new sequence starting with `tokens`; returns its id."""
        with self._lock:
            seq, self._next = self._next, self._next + 1
            self._sequences[seq] = []
        self.extend(seq, tokens)
        return seq

    def extend(self, seq: int, tokens: list[int]) -> None:
        """Append tokens to sequence `seq` (ignored if it was evicted), then evict what is over."""
        with self._lock:
            sequence = self._sequences.get(seq)
            if sequence is None:
                return
            self._sequences.move_to_end(seq)
            for token in tokens:
                sequence.append(token)
                end = len(sequence)
                if end > ANCHOR:  # a position with ANCHOR tokens before it and one after
                    key = tuple(sequence[end - 1 - ANCHOR: end - 1])
                    self._where.setdefault(key, {})[seq, end - 1] = None
            self._tokens += len(tokens)
            while self.max_tokens is not None and self._tokens > self.max_tokens and self._sequences:
                self._evict(next(iter(self._sequences)))

    def resize(self, max_tokens: int | None) -> None:
        with self._lock:
            self.max_tokens = max_tokens
            while max_tokens is not None and self._tokens > max_tokens and self._sequences:
                self._evict(next(iter(self._sequences)))

    def clear(self) -> None:
        with self._lock:
            self._sequences.clear()
            self._where.clear()
            self._tokens = 0

    def mark(self) -> int:
        """The id the next sequence will get: `forget_since(mark)` drops what came after."""
        with self._lock:
            return self._next

    def take_since(self, mark: int) -> list[list[int]]:
        """Remove every sequence started at or after `mark`, and return them (oldest first): a
        benchmark holds back what each run of a question added, so that no run drafts from
        another's answer to the same question."""
        with self._lock:
            taken = [seq for seq in self._sequences if seq >= mark]
            sequences = [self._sequences[seq] for seq in sorted(taken)]
            for seq in taken:
                self._evict(seq)
        return sequences

    def _evict(self, seq: int) -> None:
        sequence = self._sequences.pop(seq)
        for end in range(ANCHOR, len(sequence)):
            key = tuple(sequence[end - ANCHOR: end])
            places = self._where[key]
            del places[seq, end]
            if not places:
                del self._where[key]
        self._tokens -= len(sequence)

    def touch(self, seqs: set[int]) -> None:
        """Mark sequences used (a draft came from them)."""
        with self._lock:
            for seq in seqs:
                if seq in self._sequences:
                    self._sequences.move_to_end(seq)

    def matches(self, context: list[int], depth: int, k: int, skip: int | None = None
                ) -> list[tuple[int, int, list[int]]]:
        """Occurrences of the context's last tokens: (match length, sequence, up to k tokens that
        followed), for the MAX_OCCURRENCES most recent occurrences of its last ANCHOR tokens
        (sequence `skip` left out). Match lengths are counted up to `depth`.

        Example: context [.., 7, 8, 9], a sequence [5, 8, 9, 4, 7, 8, 9, 6] -> (3, seq, [6, ..])
        from the second occurrence of 8 9 and (2, seq, [4, 7, ..]) from the first.
        """
        if len(context) < ANCHOR:
            return []
        found = []
        with self._lock:
            places = self._where.get(tuple(context[-ANCHOR:]), {})
            for seq, end in itertools.islice(reversed(places), MAX_OCCURRENCES):
                if seq == skip:
                    continue
                sequence = self._sequences[seq]
                length = ANCHOR
                limit = min(depth, end, len(context))
                while length < limit and sequence[end - 1 - length] == context[-1 - length]:
                    length += 1
                found.append((length, seq, sequence[end: end + k]))
        return found


@dataclass(frozen=True)
class SuffixSettings:
    """depth: longest match counted; factor: tokens drafted per matched token (the draft length
    adapts to the match's support, at most k); min_prob: the least frequency a drafted path may
    have among the continuations seen; cache_tokens: the shared cache's bound (0: none)."""

    depth: int = 32
    factor: float = 1.0
    min_prob: float = 0.1
    cache_tokens: int = 200_000

    def __post_init__(self) -> None:
        if self.depth < ANCHOR:
            raise VerispecError(f"suffix depth must be >= {ANCHOR}, got {self.depth}")
        if not self.factor > 0:
            raise VerispecError(f"suffix factor must be > 0, got {self.factor}")
        if not 0 <= self.min_prob <= 1:
            raise VerispecError(f"suffix min_prob must be in [0, 1], got {self.min_prob}")
        if self.cache_tokens < 0:
            raise VerispecError(f"suffix cache size must be >= 0 tokens, got {self.cache_tokens}")


# model -> owner (the method whose drafters share it) -> its cache of earlier outputs
_CACHES: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, SuffixIndex]] = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def shared_cache(model: torch.nn.Module, max_tokens: int, owner: str = "suffix") -> SuffixIndex:
    """The cache of earlier outputs shared by every suffix drafter of `model` that `owner` (a
    method) builds (resized to max_tokens if it exists with another bound). Each method keeps its
    own: one method's answers never feed another's drafts (a bench runs several on one question)."""
    with _CACHES_LOCK:
        caches = _CACHES.setdefault(model, {})
        cache = caches.get(owner)
        if cache is None:
            cache = caches[owner] = SuffixIndex(max_tokens)
    if cache.max_tokens != max_tokens:
        cache.resize(max_tokens)
    return cache


def _caches_of(model: torch.nn.Module) -> dict[str, SuffixIndex]:
    """`model`'s shared caches by owner (a copy of the mapping, taken under the lock)."""
    with _CACHES_LOCK:
        return dict(_CACHES.get(model, {}))


def outputs_mark(model: torch.nn.Module) -> dict[str, int]:
    """Where each of `model`'s shared caches stands now (owner -> `SuffixIndex.mark`)."""
    return {owner: cache.mark() for owner, cache in _caches_of(model).items()}


def take_outputs_since(model: torch.nn.Module, marks: dict[str, int]) -> dict[str, list[list[int]]]:
    """Remove what `model`'s shared caches took in since `marks` (a cache made since: all of it)
    and return it by owner (add_outputs puts it back)."""
    return {owner: cache.take_since(marks.get(owner, 0)) for owner, cache in _caches_of(model).items()}


def add_outputs(model: torch.nn.Module, outputs: dict[str, list[list[int]]]) -> None:
    """Put sequences take_outputs_since removed back into `model`'s caches, as new."""
    caches = _caches_of(model)
    for owner, sequences in outputs.items():
        for sequence in sequences:
            caches[owner].start(sequence)


def forget_outputs(model: torch.nn.Module) -> None:
    """Empty `model`'s shared caches, if it has any (a benchmark's warm-up must not leak into them)."""
    for cache in _caches_of(model).values():
        cache.clear()


def frequency_tree(continuations: list[list[int]], depth: int, min_prob: float,
                   tree: TreeSettings | None) -> tuple[list[int], list[int], float]:
    """The most frequent continuations as a draft: (tokens, parents, score).

    Continuations are counted in a trie; a node's probability is the share of the continuations
    through its parent that go through it, a path's the product along it. Nodes are taken best
    path first while their path probability is at least min_prob: a chain follows the best child
    (depth nodes at most); a tree keeps tree.topk children per node and tree.nodes nodes in all.
    score: the sum of the taken nodes' path probabilities (the expected accepted tokens).

    Example: [[5, 6], [5, 6], [5, 7], [8]], chain -> tokens [5, 6], parents [-1, 0],
    score 3/4 + 2/4.
    """
    token_of: list[int] = []
    count: list[int] = []
    kids: list[dict[int, int]] = [{}]  # node -> {token: child}; node 0 is the root
    for continuation in continuations:
        node = 0
        for token in continuation[:depth]:
            child = kids[node].get(token)
            if child is None:
                child = kids[node][token] = len(kids)
                kids.append({})
                token_of.append(token)
                count.append(0)
            count[child - 1] += 1
            node = child
    total = len(continuations)
    order = itertools.count()
    heap = [(-count[c - 1] / total, next(order), c, -1, 1) for c in kids[0].values()]
    heapq.heapify(heap)
    tokens: list[int] = []
    parents: list[int] = []
    score = 0.0
    limit = depth if tree is None else tree.nodes
    taken_under: dict[int, int] = {}  # draft node -> children taken
    while heap and len(tokens) < limit:
        neg, _, node, parent, level = heapq.heappop(heap)
        if -neg < min_prob:
            break
        if tree is not None and taken_under.get(parent, 0) == tree.topk:
            continue
        taken_under[parent] = taken_under.get(parent, 0) + 1
        here = len(tokens)
        tokens.append(token_of[node - 1])
        parents.append(parent)
        score += -neg
        if level == depth:
            continue
        children = kids[node].values()
        if tree is None:  # a chain: only the best child goes on
            heap = []
            children = sorted(children, key=lambda c: -count[c - 1])[:1]
        for c in children:
            heapq.heappush(heap, (neg * count[c - 1] / count[node - 1], next(order), c, here, level + 1))
    return tokens, parents, score


class SuffixDrafter(Drafter):
    """Deterministic (one-hot q). Each step: the occurrences of the context's suffix in the
    request's own tokens and in the shared cache (other sequences), then, for the few longest
    match lengths, the frequency tree of what followed the occurrences matching at least that
    long, drafting min(k, ceil(factor * length)) deep; the tree with the best score is drafted.
    """

    def __init__(self, settings: SuffixSettings = SuffixSettings(), cache: SuffixIndex | None = None,
                 tree: TreeSettings | None = None) -> None:
        self.settings = settings
        self.cache = cache
        self.tree = tree
        self.local = SuffixIndex()
        self._local_seq: int | None = None
        self._cache_seq: int | None = None
        self._seen = 0  # context tokens indexed so far

    def reset(self) -> None:
        self.local.clear()
        self._local_seq = self._cache_seq = None
        self._seen = 0

    def _catch_up(self, context: list[int]) -> None:
        """Index the tokens committed since the last step (the whole prompt at the first)."""
        if self._local_seq is None:
            self._local_seq = self.local.start(context)
            if self.cache is not None:  # an output is cached after the tail of its prompt
                self._cache_seq = self.cache.start(context[-self.settings.depth:])
        else:
            new = context[self._seen:]
            self.local.extend(self._local_seq, new)
            if self.cache is not None:
                self.cache.extend(self._cache_seq, new)
        self._seen = len(context)

    def propose(self, request: DraftRequest) -> Proposal:
        context = request.tokens.tolist()
        self._catch_up(context)
        settings = self.settings
        # (match length, the shared cache's sequence or None for the request's own, continuation)
        found = [(n, None, c) for n, _, c in self.local.matches(context, settings.depth, request.k)]
        if self.cache is not None:
            found += self.cache.matches(context, settings.depth, request.k, skip=self._cache_seq)
        best: tuple[float, list[int], list[int]] = (0.0, [], [])
        used: set[int] = set()
        for length in sorted({length for length, _, _ in found}, reverse=True)[:THRESHOLDS]:
            chosen = [(seq, c) for n, seq, c in found if n >= length]
            depth = min(request.k, math.ceil(settings.factor * length))
            tokens, parents, score = frequency_tree([c for _, c in chosen], depth, settings.min_prob,
                                                    self.tree)
            if score > best[0]:
                best = (score, tokens, parents)
                used = {seq for seq, _ in chosen if seq is not None}
        if self.cache is not None and used:
            self.cache.touch(used)
        _, tokens, parents = best
        device = request.tokens.device
        draft = torch.tensor(tokens, dtype=torch.int64, device=device)
        if self.tree is None or parents == list(range(-1, len(parents) - 1)):
            return Proposal(draft)
        return Proposal(draft, parents=torch.tensor(parents, dtype=torch.int64, device=device))

    def commit(self, num_accepted: int) -> None:
        pass  # committed tokens are indexed at the next step, from the context
