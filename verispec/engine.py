"""The decode loop: propose -> verify -> commit -> adapt the draft length.

The engine owns the target's KV cache and rewinds it once per step, after verification. Each
drafter owns and rewinds its own state; verifiers are pure. Invariant at the start of a step: the
target cache holds every committed token but the last, which is fed together with the draft, so
one forward of 1 + k tokens scores all k drafts and yields the token after them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel

from verispec.cached_model import CachedModel
from verispec.drafters.base import Drafter, DraftRequest
from verispec.errors import VerispecError
from verispec.policies import ConstantK, DraftLengthPolicy
from verispec.stopping import StoppingRules
from verispec.tree import check_parents
from verispec.types import DraftTree, Fate, GenerationResult, GenerationStats, Proposal, SamplingParams, Step
from verispec.verifiers import verifier_for


def context_length(model: PreTrainedModel) -> int:
    """The longest sequence the model's positions allow."""
    config = model.config.get_text_config(decoder=True)
    return int(getattr(config, "max_position_embeddings", None) or 2**31)


class SpeculativeEngine:
    """Generates from `target`, optionally speculating with `drafter` (None: plain decoding)."""

    def __init__(self, target: PreTrainedModel, drafter: Drafter | None = None,
                 policy: DraftLengthPolicy | None = None, acceptance: str = "exact") -> None:
        """acceptance: "exact" (lossless) or "typical" (Medusa's typical acceptance, LOSSY under
        sampling; see verispec.verifiers.typical)."""
        verifier_for(SamplingParams(), acceptance)  # reject an unknown rule before any work
        self.acceptance = acceptance
        self.target = CachedModel(target)
        self.drafter = drafter
        self.policy = policy or ConstantK(0 if drafter is None else 5)
        self.max_length = context_length(target)
        self.vocab_size = target.get_input_embeddings().num_embeddings
        self.hidden_size = int(target.config.get_text_config(decoder=True).hidden_size)

    def check_prompt(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        if not prompt_ids:
            raise VerispecError("the prompt is empty: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise VerispecError(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if len(prompt_ids) + max_new_tokens > self.max_length:
            raise VerispecError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"the model's context of {self.max_length} tokens")

    def steps(self, prompt_ids: list[int], stopping: StoppingRules,
              sampling: SamplingParams = SamplingParams(),
              seed: int | None = None) -> Iterator[Step]:
        """Run generation, yielding each step's emitted tokens as soon as they are committed."""
        self.check_prompt(prompt_ids, stopping.max_new_tokens)
        device = self.target.device
        generator = torch.Generator(device=device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        verifier = verifier_for(sampling, self.acceptance)
        tokens = torch.tensor(prompt_ids, dtype=torch.int64, device=device)
        buffer = torch.cat([tokens, tokens.new_zeros(stopping.max_new_tokens)])  # [prompt + new]
        length = len(prompt_ids)
        generated: list[int] = []

        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()
        # The target's hidden state per committed position, for drafters that read it.
        hidden = None
        layers = tuple(getattr(self.drafter, "hidden_layers", ()))  # intermediate states wanted
        if getattr(self.drafter, "needs_hidden", False):
            hidden = torch.empty(buffer.shape[0], self.hidden_size * (1 + len(layers)),
                                 device=device, dtype=self.target.model.dtype)  # [prompt + new, .]
        if length > 1:
            prefill_hidden = self.target.prefill(buffer[: length - 1], layers)
            if hidden is not None:
                hidden[: length - 1] = prefill_hidden
            if getattr(self.drafter, "adopts_prefill", False):
                self.drafter.adopt_prefill(self.target)
        while True:
            remaining = stopping.max_new_tokens - len(generated)
            # Never draft past the budget: the step always adds one target token after the draft.
            k = min(self.policy.next_k(), remaining - 1) if self.drafter is not None else 0
            started = time.perf_counter()
            if k > 0:
                proposal = self.drafter.propose(DraftRequest(
                    buffer[:length], k, sampling, generator,
                    None if hidden is None else hidden[: length - 1]))
            else:
                proposal = Proposal(buffer[:0])
            drafted = time.perf_counter()
            num_drafted = len(proposal)
            tree, depth = proposal.parents, proposal.depth
            if tree is not None:  # a drafter's tree must be well formed before the target sees it
                check_parents(tree)
            side = proposal.side
            block = [buffer[length - 1: length], proposal.tokens, *(() if side is None else (side.tokens,))]
            logits, block_hidden = self.target.forward_hidden(torch.cat(block), tree, layers, side)
            if side is not None:  # side rows go back to the drafter, never to the verifier
                self.drafter.observe_side(logits[num_drafted + 1:])
                logits = logits[: num_drafted + 1]
            verdict = verifier.verify(proposal, logits, sampling, generator)
            path, accepted = list(verdict.path), verdict.num_accepted
            rows = [0] + [node + 1 for node in path]  # block rows to keep: root + accepted path
            if hidden is not None:
                hidden[length - 1: length + accepted] = block_hidden[rows]
            self.target.keep(length - 1, rows)
            if num_drafted:
                self.drafter.commit(accepted)
                self.policy.update(depth, accepted)
            verified = time.perf_counter()

            parents = proposal.tree_parents.tolist()
            drafted_tokens = proposal.tokens.tolist()
            end = path[-1] if path else -1
            alternatives = [drafted_tokens[i] for i, parent in enumerate(parents) if parent == end]
            block = [drafted_tokens[i] for i in path] + [verdict.next_token]
            fates = [Fate.ACCEPTED] * accepted + [Fate.RECOVERED if alternatives else Fate.BONUS]
            keep, finished = stopping.cut(generated, block)
            buffer[length: length + keep] = torch.tensor(block[:keep])
            length += keep
            generated += block[:keep]
            shown = None if tree is None else DraftTree(drafted_tokens, parents, path, depth)
            yield Step(block[:keep], fates[:keep], alternatives, num_drafted, accepted,
                       drafted - started, verified - drafted, finished, shown)
            if finished:
                return

    def generate(self, prompt_ids: list[int], stopping: StoppingRules,
                 sampling: SamplingParams = SamplingParams(),
                 seed: int | None = None,
                 on_step: Callable[[Step], None] | None = None) -> GenerationResult:
        """Run to completion and collect tokens, steps and statistics."""
        stats = GenerationStats()
        steps: list[Step] = []
        started = time.perf_counter()
        for step in self.steps(prompt_ids, stopping, sampling, seed):
            steps.append(step)
            stats.add(step)
            if on_step is not None:
                on_step(step)
        stats.total_seconds = time.perf_counter() - started
        new_tokens = [t for step in steps for t in step.tokens]
        return GenerationResult(list(prompt_ids), new_tokens, steps, stats)
