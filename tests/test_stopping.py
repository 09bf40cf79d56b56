"""EOS, stop strings and max_new_tokens falling inside an accepted block of draft tokens."""

from __future__ import annotations

from tests.tiny import VOCAB, plain_greedy, tiny_tokenizer
from verispec.core.policies import ConstantK
from verispec.core.stopping import StoppingRules
from verispec.core.types import Fate
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.model import ModelDrafter

PROMPT = [1, 17, 42, 9, 33]


def self_drafting(target, k=8):
    """The target drafting for itself: every draft is accepted, so blocks are k + 1 long."""
    return SpeculativeEngine(target, ModelDrafter(target, VOCAB), ConstantK(k))


def test_eos_inside_an_accepted_block_ends_generation_there(target):
    truth = plain_greedy(target, PROMPT, 40)
    position = next(i for i, t in enumerate(truth) if i >= 3 and t not in truth[:i])
    result = self_drafting(target).generate(
        SequenceSpec(PROMPT, StoppingRules.build(40, eos_token_id=truth[position])))
    assert result.token_ids == truth[: position + 1]  # EOS itself is emitted, nothing after it
    assert result.steps[-1].fates[-1] is Fate.ACCEPTED  # it was cut out of an accepted block
    assert result.stats.new_tokens == position + 1 == sum(len(s.tokens) for s in result.steps)


def test_stop_string_inside_an_accepted_block(target):
    tokenizer = tiny_tokenizer()
    truth = plain_greedy(target, PROMPT, 40)
    stop = tokenizer.decode(truth[4:6])
    rules = StoppingRules.build(40, stop_strings=[stop], tokenizer=tokenizer)
    result = self_drafting(target).generate(SequenceSpec(PROMPT, rules))
    text = tokenizer.decode(result.token_ids)
    assert text.endswith(stop) and stop not in tokenizer.decode(result.token_ids[:-1])
    assert result.token_ids == truth[: len(result.token_ids)]
    assert result.stats.new_tokens == len(result.token_ids) <= 6


def test_max_new_tokens_is_exact_whatever_k(target):
    truth = plain_greedy(target, PROMPT, 13)
    for k in (1, 4, 8, 16):
        result = self_drafting(target, k).generate(SequenceSpec(PROMPT, StoppingRules.build(13)))
        assert result.token_ids == truth
        assert result.stats.new_tokens == 13


def test_cut_reports_tokens_and_finish():
    rules = StoppingRules.build(5, eos_token_id=[7])
    assert rules.cut([1, 2], [3, 7, 4]) == (2, True)
    assert rules.cut([1, 2], [3, 4]) == (2, False)
    assert rules.cut([1, 2, 3], [4, 5, 6]) == (2, True)
