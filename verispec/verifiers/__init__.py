"""Verifiers: pure functions of tensors that decide which draft tokens the target keeps."""

from __future__ import annotations

from typing import Protocol

import torch

from verispec.types import Proposal, SamplingParams, Verdict
from verispec.verifiers.greedy import GreedyVerifier, greedy_accept
from verispec.verifiers.rejection import RejectionVerifier, rejection_sample


class Verifier(Protocol):
    lossless: bool

    def verify(self, proposal: Proposal, target_logits: torch.Tensor, sampling: SamplingParams,
               generator: torch.Generator | None) -> Verdict:
        """target_logits: [len(proposal) + 1, vocab]: one row per draft position plus the bonus."""
        ...


def verifier_for(sampling: SamplingParams) -> Verifier:
    """The lossless verifier for these sampling settings."""
    return GreedyVerifier() if sampling.greedy else RejectionVerifier()


__all__ = ["Verifier", "GreedyVerifier", "RejectionVerifier", "greedy_accept", "rejection_sample",
           "verifier_for"]
