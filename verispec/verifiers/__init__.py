"""Verifiers: pure functions of tensors that decide which draft tokens the target keeps."""

from __future__ import annotations

from typing import Protocol

import torch

from verispec.errors import VerispecError
from verispec.types import Proposal, SamplingParams, Verdict
from verispec.verifiers.greedy import GreedyVerifier, greedy_accept
from verispec.verifiers.rejection import RejectionVerifier, rejection_sample
from verispec.verifiers.typical import TypicalVerifier


class Verifier(Protocol):
    lossless: bool

    def verify(self, proposal: Proposal, target_logits: torch.Tensor, sampling: SamplingParams,
               generator: torch.Generator | None) -> Verdict:
        """target_logits: [len(proposal) + 1, vocab]: one row per draft position plus the bonus."""
        ...


ACCEPTANCE = ("exact", "typical")


def verifier_for(sampling: SamplingParams, acceptance: str = "exact") -> Verifier:
    """The verifier for these sampling settings: lossless ("exact"), or Medusa's typical
    acceptance ("typical", LOSSY; under greedy decoding it keeps only argmax tokens, so exact)."""
    if acceptance not in ACCEPTANCE:
        raise VerispecError(f"unknown acceptance rule {acceptance!r}; choose from {', '.join(ACCEPTANCE)}")
    if sampling.greedy:
        return GreedyVerifier()
    return RejectionVerifier() if acceptance == "exact" else TypicalVerifier()


__all__ = ["ACCEPTANCE", "Verifier", "GreedyVerifier", "RejectionVerifier", "TypicalVerifier",
           "greedy_accept", "rejection_sample", "verifier_for"]
