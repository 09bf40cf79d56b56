"""Verifiers: pure functions of tensors that decide which draft tokens the target keeps."""

from __future__ import annotations

from typing import Protocol

import torch

from verispec.core.errors import VerispecError
from verispec.core.types import Proposal, SamplingParams, Verdict
from verispec.verifiers.distance import DistanceVerifier, tv_threshold
from verispec.verifiers.greedy import GreedyVerifier, greedy_accept
from verispec.verifiers.rejection import RejectionVerifier, rejection_sample
from verispec.verifiers.typical import TypicalVerifier


class Verifier(Protocol):
    lossless: bool

    def verify(self, proposal: Proposal, target_logits: torch.Tensor, sampling: SamplingParams,
               generator: torch.Generator | None) -> Verdict:
        """target_logits: [len(proposal) + 1, vocab]: one row per draft position plus the bonus."""
        ...


ACCEPTANCE = ("exact", "typical", "tv:X")


def check_acceptance(acceptance: str) -> str:
    """`acceptance` if it names a rule (ACCEPTANCE; "tv:X" with X in [0, 1]), else a clear error."""
    if not isinstance(acceptance, str) or (
            acceptance not in ACCEPTANCE[:2] and tv_threshold(acceptance) is None):
        raise VerispecError(f"unknown acceptance rule {acceptance!r}; choose from {', '.join(ACCEPTANCE)}")
    return acceptance


def verifier_for(sampling: SamplingParams, acceptance: str = "exact") -> Verifier:
    """The verifier for these sampling settings: lossless ("exact"), Medusa's typical acceptance
    ("typical", LOSSY), or distance acceptance ("tv:X", LOSSY: verispec.verifiers.distance).
    Under greedy decoding every rule keeps only argmax tokens, so all are exact there."""
    check_acceptance(acceptance)
    if sampling.greedy:
        return GreedyVerifier()
    if acceptance == "exact":
        return RejectionVerifier()
    threshold = tv_threshold(acceptance)
    return TypicalVerifier() if threshold is None else DistanceVerifier(threshold)


__all__ = ["ACCEPTANCE", "DistanceVerifier", "GreedyVerifier", "RejectionVerifier", "TypicalVerifier",
           "Verifier", "check_acceptance", "greedy_accept", "rejection_sample", "verifier_for"]
