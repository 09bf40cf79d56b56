"""Distance acceptance ("tv:X", LOSSY): X = 0 is the exact rule token for token, a larger X keeps
more drafts, X = 1 keeps every draft the target could have sampled; bad rules are clear errors."""

from __future__ import annotations

import pytest

from tests.tiny import VOCAB, tiny_llama
from verispec.cli import build_parser
from verispec.core.errors import VerispecError
from verispec.core.policies import ConstantK
from verispec.core.stopping import StoppingRules
from verispec.core.types import SamplingParams
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.model import ModelDrafter
from verispec.verifiers import verifier_for

SAMPLING = SamplingParams(do_sample=True, temperature=1.0)
PROMPT = [1, 17, 42, 9, 33, 17, 42, 5]
SEEDS = range(12)


@pytest.fixture(scope="module")
def runs():
    """Per rule: the (tokens, accepted, drafted) of seeded samples, a draft model unlike the target."""
    target, draft = tiny_llama(seed=2), tiny_llama(seed=5)
    out = {}
    for rule in ("exact", "tv:0", "tv:0.25", "tv:1"):
        engine = SpeculativeEngine(target, ModelDrafter(draft, VOCAB), ConstantK(3), acceptance=rule)
        results = [engine.generate(
            SequenceSpec(PROMPT, StoppingRules.build(24), SAMPLING, seed)) for seed in SEEDS]
        out[rule] = ([r.token_ids for r in results],
                     sum(s.num_accepted for r in results for s in r.steps),
                     sum(s.num_drafted for r in results for s in r.steps))
    return out


def test_tv_zero_is_the_exact_rule(runs):
    assert runs["tv:0"][0] == runs["exact"][0]
    assert 0 < runs["exact"][1] < runs["exact"][2]  # drafts made, some kept, some refused


def test_a_larger_threshold_keeps_more_drafts(runs):
    rate = {rule: accepted / drafted for rule, (_, accepted, drafted) in runs.items()}
    assert rate["exact"] < rate["tv:0.25"] < rate["tv:1"] == 1.0  # measured: 0.60, 0.70, 1.0
    assert runs["tv:0.25"][0] != runs["exact"][0]  # lossy: the outputs change


def test_bad_rules_are_clear_errors():
    for rule in ("tv:2", "tv:x", "tv:", "fast"):
        with pytest.raises(VerispecError, match="acceptance"):
            verifier_for(SAMPLING, rule)
    assert not verifier_for(SAMPLING, "tv:0.1").lossless
    with pytest.raises(SystemExit):  # the command line refuses it too
        build_parser().parse_args(["generate", "--prompt", "x", "--acceptance", "tv:3"])
