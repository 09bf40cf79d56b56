"""Typical acceptance: the rule on worked examples, its lossy label, and greedy exactness."""

from __future__ import annotations

import pytest
import torch

from tests.drafters import TreeOracleDrafter
from tests.tiny import VOCAB, plain_greedy
from verispec.core.errors import VerispecError
from verispec.core.policies import ConstantK
from verispec.core.stopping import StoppingRules
from verispec.core.types import SamplingParams
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.verifiers import verifier_for
from verispec.verifiers.typical import typical_tree_accept


def test_flat_targets_accept_any_typical_token_and_refuse_the_rest():
    p = torch.zeros(3, 4)
    p[:, :2] = 0.5  # entropy ln 2: bar min(0.09, 0.15) = 0.09
    gen = torch.Generator().manual_seed(0)
    path, token = typical_tree_accept(torch.tensor([1, 0]), torch.tensor([-1, 0]), p, gen)
    assert path == [0, 1] and token in (0, 1)
    path, _ = typical_tree_accept(torch.tensor([2, 0]), torch.tensor([-1, 0]), p, gen)
    assert path == []


def test_the_longest_typical_branch_wins():
    p = torch.full((5, 4), 0.25)  # every token typical
    parents = torch.tensor([-1, -1, 1, 2])  # node 0 alone, node 1 -> 2 -> 3
    path, _ = typical_tree_accept(torch.tensor([0, 1, 2, 3]), parents, p, torch.Generator())
    assert path == [1, 2, 3]


def test_a_confident_target_accepts_only_its_top_token():
    p = torch.tensor([[0.97, 0.01, 0.01, 0.01], [0.25] * 4])
    bar_examples = [(torch.tensor([0]), [0]), (torch.tensor([1]), [])]
    for draft, expected in bar_examples:
        path, _ = typical_tree_accept(draft, torch.tensor([-1]), p, torch.Generator())
        assert path == expected


def test_typical_is_labelled_lossy_and_unknown_rules_are_refused():
    sampling = SamplingParams(do_sample=True, temperature=1.0)
    assert verifier_for(sampling, "typical").lossless is False
    assert verifier_for(sampling, "exact").lossless is True
    with pytest.raises(VerispecError, match="acceptance"):
        verifier_for(sampling, "fast")


def test_typical_under_greedy_decoding_is_plain_greedy(target):
    prompt = [1, 17, 42, 9, 33]
    truth = plain_greedy(target, prompt, 24)
    drafter = TreeOracleDrafter(len(prompt), truth, {2, 9}, VOCAB, width=3)
    engine = SpeculativeEngine(target, drafter, ConstantK(4), acceptance="typical")
    assert engine.generate(SequenceSpec(prompt, StoppingRules.build(24))).token_ids == truth
