"""Every sampling drafter, end to end: the emitted tokens follow the target's distribution.

A tiny target with a 16-token vocabulary (so the exact law of its first three sampled tokens is
enumerated: tests/distribution.py), randomly initialised drafters of every kind that samples or
drafts under sampling (EAGLE, EAGLE-3, Medusa, Hydra, MTP, the block drafter, lookahead, early
exit, eagle-pld, self-speculation in int4, staged self-speculation behind prompt lookup at several
temperatures and top-p, and token trees of EAGLE, Medusa and prompt lookup), many seeded samples
of one prompt
through the batched engine, and the total variation of each emitted position against the
threshold for the sample size, which is chosen from the target's support so that a skew of TV
0.05 at any position fails the test with probability >= 0.99 (false alarm <= 1e-4 per test).
Each test also asserts that drafts were made at the positions it checks and that some were
accepted and some refused: a drafter that drafts nothing, or a target that accepts everything,
would pass a distribution test without testing anything.

These catch a drafter that reports a q other than the law it drew from (argmax drafting with its
softmax reported, q before the temperature / top-p warping, a staged guess kept without its q(x)
coin): scripts/mutate.py plants each and shows which test fails.
"""

from __future__ import annotations

import collections

import pytest
import torch

import verispec.drafters.model as model_drafter
from tests.distribution import POWER, Sampled, assert_follows, exact_marginals, runs_for, sample_runs
from tests.tiny import tiny_llama
from verispec.core.policies import ConstantK, LoadCap
from verispec.core.tree import TreeSettings
from verispec.core.types import Proposal, SamplingParams
from verispec.decoding.engine import SpeculativeEngine
from verispec.drafters.base import Drafter, DraftRequest
from verispec.drafters.block import BlockDrafter, BlockNet, block_settings
from verispec.drafters.eagle import EagleDrafter, EagleNet, eagle_settings
from verispec.drafters.eagle3 import Eagle3Drafter, Eagle3Net, eagle3_settings
from verispec.drafters.early_exit import early_exit_drafter
from verispec.drafters.hybrid import LookupThenModel
from verispec.drafters.hydra import HydraDrafter, HydraNet, hydra_settings
from verispec.drafters.learned import ReducedHead
from verispec.drafters.lookahead import LookaheadDrafter
from verispec.drafters.medusa import MedusaDrafter, MedusaNet, medusa_settings
from verispec.drafters.mtp import MTPDrafter, MTPNet, mtp_settings
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.drafters.self_spec import SelfDrafter, SelfSettings
from verispec.drafters.suffix import SuffixDrafter, SuffixSettings
from verispec.model.kernels import rows
from verispec.model.loading import LoadedModel

V = 16
NEW = 3  # positions checked: the first two are drafted at k >= 2, the third after them
PROMPT = [1, 5, 9, 1, 1, 5, 9]  # repetitive: prompt lookup (guessing 1, a likely token) and
# lookahead find drafts
REDUCED = torch.tensor([0, 1, 2, 3, 5, 7, 8, 9, 10, 11, 13, 14])  # q = 0 at 4, 6, 12, 15
SAMPLING = SamplingParams(do_sample=True, temperature=1.0)


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(seed=2, vocab=V)


@pytest.fixture(scope="module")
def exact(target) -> dict:
    """Exact marginals per sampling setting (and prompt), computed once."""
    cache: dict[tuple[SamplingParams, tuple[int, ...]], torch.Tensor] = {}

    def of(sampling: SamplingParams, prompt: list[int] = PROMPT) -> torch.Tensor:
        if (sampling, tuple(prompt)) not in cache:
            cache[sampling, tuple(prompt)] = exact_marginals(target, prompt, NEW, sampling)
        return cache[sampling, tuple(prompt)]

    return of


def _randomised(net: torch.nn.Module, std: float = 0.3) -> torch.nn.Module:
    """Random weights (norms kept at 1) large enough that q is far from uniform and from p."""
    torch.manual_seed(11)
    for name, p in net.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        else:
            torch.nn.init.normal_(p, std=std)
    return net


TREE = TreeSettings(3, 8)
TREE_PROMPT = [1, 5, 9, 2, 5, 9, 3, 5, 9]  # "5 9" went on three ways: prompt lookup drafts a tree
MEDUSA_RANKS = [[0.5, 0.3, 0.1, 0.1]] * 3  # the heads' rank accuracies a Medusa tree is built from


class CountingLookupThenModel(LookupThenModel):
    """LookupThenModel counting, over every instance, the drafts each side proposed."""

    proposed: collections.Counter = collections.Counter()

    def propose(self, request: DraftRequest) -> Proposal:
        proposal = super().propose(request)
        if proposal.tokens.numel():
            self.proposed["lookup" if self.last is self.lookup else "model"] += 1
        return proposal


def drafter_factory(kind: str, target: torch.nn.Module):
    """A function making fresh drafters of `kind` for `target` (one per row of a batch), all
    sharing one set of random weights. "-tree": drafting TREE-shaped token trees."""
    tree = TREE if kind.endswith("-tree") else None
    kind = kind.removesuffix("-tree")
    if kind in ("eagle-pld", "eagle-suffix"):  # a lookup drafts where the text repeats, EAGLE elsewhere
        net = _randomised(EagleNet(**eagle_settings(target)))

        def lookup() -> Drafter:
            return PromptLookupDrafter(3, 1) if kind == "eagle-pld" else SuffixDrafter(SuffixSettings())
        return lambda: CountingLookupThenModel(
            lookup(), EagleDrafter(target, net, ReducedHead(target, REDUCED)), 2)
    if kind == "eagle":  # heads of 16 values: its layer runs in rows.cpp's loop where it can
        net = _randomised(EagleNet(**{**eagle_settings(target), "heads": 2}))

        def make() -> EagleDrafter:
            made = EagleDrafter(target, net, ReducedHead(target, REDUCED), tree=tree)
            assert (made.native is not None) == rows.available()
            return made
        return make
    if kind == "eagle-passes":  # EAGLE's network as a GPU runs it: fixed-shape passes (eager here)
        net = _randomised(EagleNet(**eagle_settings(target)))
        return lambda: EagleDrafter(target, net, ReducedHead(target, REDUCED), tree=tree, passes=True)
    if kind == "medusa":
        net = _randomised(MedusaNet(**medusa_settings(target, 3)))
        return lambda: MedusaDrafter(target, net, ReducedHead(target, REDUCED), tree, MEDUSA_RANKS)
    if kind == "pld":  # deterministic drafts (q one-hot), a tree of the prompt's continuations
        return lambda: PromptLookupDrafter(3, 1, tree)
    if kind == "early-exit":  # the target's first layer through its own norm and head
        return lambda: early_exit_drafter(target, 1, V)
    if kind == "eagle3":  # heads of 16 values on one key/value head: rows.cpp's loop where it can
        settings = eagle3_settings(target, None, len(REDUCED))
        net = _randomised(Eagle3Net(**{**settings, "heads": 2, "kv_heads": 1, "head_dim": 16}))

        def make3() -> Eagle3Drafter:
            made = Eagle3Drafter(target, net, REDUCED)
            assert (made.native is not None) == rows.available()
            return made
        return make3
    if kind == "hydra":
        net = _randomised(HydraNet(**hydra_settings(target, 3)))
        return lambda: HydraDrafter(target, net, ReducedHead(target, REDUCED))
    if kind == "mtp":
        net = _randomised(MTPNet(**mtp_settings(target, 3)))
        return lambda: MTPDrafter(target, net, ReducedHead(target, REDUCED))
    if kind == "block":  # reads the final state and the states after layers 0 and 2
        net = _randomised(BlockNet(**block_settings(target, (0, 2), layers=2, block=4)))
        return lambda: BlockDrafter(target, net, ReducedHead(target, REDUCED))
    if kind == "lookahead":
        return lambda: LookaheadDrafter(3, 3, 4, pool_context=True)
    if kind == "draft":  # an independent model: its q is far from p, and warping moves it
        net = tiny_llama(seed=5, vocab=V)
        return lambda: model_drafter.ModelDrafter(net, V)
    loaded = LoadedModel(target, None, "tiny-16")
    if kind == "self-int4":
        return lambda: SelfDrafter(loaded, SelfSettings("int4"))
    if kind == "self-int4-pld":
        return lambda: SelfDrafter(loaded, SelfSettings("int4"), lookup=PromptLookupDrafter(3, 1))
    raise ValueError(kind)


def run(target, exact, kind: str, sampling: SamplingParams, skew: float, k: int = 3,
        prompt: list[int] = PROMPT) -> Sampled:
    """Samples of the first NEW tokens with drafters of `kind`, as many as power against `skew`
    asks."""
    make = drafter_factory(kind, target)
    engine = SpeculativeEngine(target, make(), ConstantK(k), spawn=make, load_cap=LoadCap(()))
    return sample_runs(engine, prompt, NEW, sampling, runs_for(exact(sampling, prompt), skew))


# The default suite samples the core paths (a draft model's chain, prompt lookup's tree, staged
# drafting at t1.0-p0.8; tests/test_auto.py: auto, and auto with EAGLE); the rest are `slow` (8-28 s
# each on the AVX2 EPYC, ~250 s in all), sampled at TV 0.1 in .ci/run's slow checks.
SLOW = pytest.mark.slow


@SLOW
@pytest.mark.parametrize("kind", ["eagle", "eagle-passes", "eagle3", "medusa", "hydra", "mtp", "block"])
@pytest.mark.parametrize("skew", POWER)
def test_learned_drafters_sample_the_targets_distribution(target, exact, skew, kind):
    """Drafts drawn from each head's (block: each slot's) warped q, over a reduced vocabulary
    (q = 0 off it). Drafts made, kept and refused at both checked positions: the second head
    (slot) is accepted on its own q, not only reached."""
    sampled = run(target, exact, kind, SAMPLING, skew)
    sampled.check_drafting(positions=2)
    assert min(sampled.kept_by_position[:2]) > 0.05 * sampled.runs, sampled.kept_by_position
    assert_follows(sampled, exact(SAMPLING), kind, skew)


SLOW_TREES = ("eagle-tree", "eagle-passes-tree", "medusa-tree")


@pytest.mark.parametrize("kind", [*(pytest.param(kind, marks=SLOW) for kind in SLOW_TREES), "pld-tree"])
@pytest.mark.parametrize("skew", POWER)
def test_token_trees_sample_the_targets_distribution(target, exact, skew, kind):
    """Trees of sampled siblings (EAGLE: drawn without replacement) and deterministic ones (a
    Medusa tree of each head's top candidates, prompt lookup's trie of the context's matches),
    verified by multi-candidate rejection sampling."""
    sampling = SamplingParams(do_sample=True, temperature=0.9, top_k=12)
    sampled = run(target, exact, kind, sampling, skew, prompt=TREE_PROMPT)
    sampled.check_drafting(positions=1)
    assert sampled.steps_branching > 0, kind  # trees were drafted, not chains
    assert_follows(sampled, exact(sampling, TREE_PROMPT), kind, skew)


@SLOW
@pytest.mark.parametrize("kind", ["eagle-pld", "eagle-suffix"])
@pytest.mark.parametrize("skew", POWER)
def test_eagle_behind_a_lookup_samples_the_targets_distribution(target, exact, skew, kind):
    """eagle-pld, eagle-suffix: a deterministic lookup draft (prompt lookup, suffix decoding)
    where the context repeats, EAGLE's sampled draft elsewhere, both in the same run."""
    CountingLookupThenModel.proposed.clear()
    sampled = run(target, exact, kind, SAMPLING, skew)
    sampled.check_drafting(positions=2)
    proposed = CountingLookupThenModel.proposed
    assert min(proposed["lookup"], proposed["model"]) > 0.05 * sampled.runs, proposed
    assert_follows(sampled, exact(SAMPLING), kind, skew)


@SLOW
@pytest.mark.parametrize("skew", POWER)
def test_early_exit_samples_the_targets_distribution(target, exact, skew):
    """The target's own first layer drafts from its warped q (temperature and top-k)."""
    sampling = SamplingParams(do_sample=True, temperature=0.8, top_k=10)
    sampled = run(target, exact, "early-exit", sampling, skew)
    sampled.check_drafting(positions=2)
    assert_follows(sampled, exact(sampling), "early-exit", skew)


@SLOW
@pytest.mark.parametrize("skew", POWER)
def test_lookahead_samples_the_targets_distribution(target, exact, skew):
    """A deterministic tree (q one-hot) and a side branch in the same target pass."""
    sampling = SamplingParams(do_sample=True, temperature=0.8)
    sampled = run(target, exact, "lookahead", sampling, skew)
    sampled.check_drafting(positions=1)
    assert_follows(sampled, exact(sampling), "lookahead", skew)


@SLOW
@pytest.mark.parametrize("skew", POWER)
def test_self_speculation_samples_the_targets_distribution(target, exact, skew):
    """The int4 copy drafts from its own warped q: temperature and top-p both change q."""
    sampling = SamplingParams(do_sample=True, temperature=0.7, top_p=0.9)
    sampled = run(target, exact, "self-int4", sampling, skew)
    sampled.check_drafting(positions=2)
    assert_follows(sampled, exact(sampling), "self-int4", skew)


@pytest.mark.parametrize("skew", POWER)
def test_a_draft_model_samples_the_targets_distribution(target, exact, skew):
    """An independent draft model under temperature and top-p: the q it reports must be the warped
    law it drew from (reporting q before the warping skews the output: scripts/mutate.py)."""
    sampling = SamplingParams(do_sample=True, temperature=0.6, top_p=0.8)
    sampled = run(target, exact, "draft", sampling, skew)
    sampled.check_drafting(positions=2)
    assert_follows(sampled, exact(sampling), "draft model", skew)


STAGED = [SamplingParams(do_sample=True, temperature=0.6),
          SamplingParams(do_sample=True, temperature=1.0, top_p=0.8),
          SamplingParams(do_sample=True, temperature=1.4, top_k=8)]


@pytest.mark.parametrize("sampling", [pytest.param(STAGED[0], id="t0.6", marks=SLOW),
                                      pytest.param(STAGED[1], id="t1.0-p0.8"),
                                      pytest.param(STAGED[2], id="t1.4-k8", marks=SLOW)])
@pytest.mark.parametrize("skew", POWER)
def test_staged_drafting_samples_the_targets_distribution(target, exact, skew, sampling, monkeypatch):
    """Prompt lookup's guesses go through the int4 drafter, which keeps guess x with
    probability q(x) and otherwise draws from q without x. Counted here: guesses offered, kept
    and replaced, so the test knows both sides of that coin were thrown."""
    seen = {"offered": 0, "kept": 0, "replaced": 0}
    original = model_drafter.ModelDrafter._check_guesses

    def counting(logits, guesses, request):
        drafted, probs, last = original(logits, guesses, request)
        kept = int((torch.stack(drafted[: len(guesses)]) == guesses[: len(drafted)]).cumprod(0).sum())
        seen["offered"] += 1
        seen["kept"] += kept
        seen["replaced"] += kept < min(len(guesses), len(drafted))
        return drafted, probs, last

    monkeypatch.setattr(model_drafter.ModelDrafter, "_check_guesses", staticmethod(counting))
    sampled = run(target, exact, "self-int4-pld", sampling, skew, k=4)
    sampled.check_drafting(positions=2)
    assert seen["offered"] > 0.5 * sampled.runs, seen
    assert min(seen["kept"], seen["replaced"]) > 0.05 * sampled.runs, seen
    assert_follows(sampled, exact(sampling), f"staged {sampling}", skew)
