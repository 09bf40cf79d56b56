"""`auto` and the cost profile: the decision rule as a pure function of given costs, the
acceptance it tracks, the profile's cache (hit, and a miss on each part of its key), its table
and plot, greedy identity with `ar` whatever it chooses (lookup, self-drafter, plain; alone and
in a batch) and exact sampling."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time

import pytest
import torch

from tests.distribution import POWER, assert_follows, exact_marginals, runs_for, sample_runs
from tests.tiny import VOCAB, plain_greedy, tiny_foreign, tiny_llama, tiny_loaded
from verispec import methods, profile
from verispec.cli import main
from verispec.core import files
from verispec.core.policies import ConstantK, LoadCap
from verispec.core.stopping import StoppingRules
from verispec.core.tree import TreeSettings
from verispec.core.types import GenerationStats, Proposal, SamplingParams
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters import auto as auto_module
from verispec.drafters.auto import (
    MARGIN,
    Acceptance,
    AutoDrafter,
    CostProfile,
    DrafterCost,
    Pace,
    Survival,
    best_choice,
    expected_by_length,
    expected_tokens,
)
from verispec.drafters.base import Drafter, DraftRequest, Wrapper
from verispec.drafters.eagle import EagleDrafter, EagleNet, eagle_settings
from verispec.drafters.learned import SHIPPED, ReducedHead, weights_digest
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.drafters.self_spec import _WEIGHTS, SelfDrafter, SelfSettings
from verispec.drafters.suffix import SuffixDrafter, SuffixSettings
from verispec.methods import PLAIN, _auto_candidates, auto_profile, build_engine
from verispec.model.cached_model import CachedModel
from verispec.model.loading import DEFAULT_MODEL, LoadedModel, load_model
from verispec.model.lowbit import int4_target
from verispec.options import DraftOptions

NEW = 40
COPYING = [1, 17, 42, 9, 33, 17, 42, 9, 33, 5, 17, 42, 9, 33]
PROMPTS = [COPYING, [1, 60, 3, 22], [1, 8, 9, 10, 11, 12, 8, 9, 10]]


def flat_then_linear(per_row: float = 0.01, free_rows: int = 4) -> tuple[float, ...]:
    """A forward whose cost is flat up to `free_rows` rows, then grows with them: [17]."""
    return tuple(per_row * max(1.0, rows / free_rows) for rows in range(1, 18))


def fake_profile(free_rows: int = 4, **drafters: DrafterCost) -> CostProfile:
    return CostProfile(flat_then_linear(free_rows=free_rows), 300, 1e4, drafters)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Profiles cached under tmp_path (never the user's), measured with few repeats, on a machine
    read as idle and steady: the suite runs beside itself (a worker per core), which would leave a
    profile uncached at random (CI once read other processes' load as 189 cores). The tests of
    those two judgements set the readings themselves."""
    monkeypatch.setattr(profile, "cache_dir", lambda: tmp_path / "profiles")
    monkeypatch.setattr(profile, "REPEATS", 1)
    monkeypatch.setattr(profile, "ANSWER_TOKENS", 8)
    timed = profile.time_forward
    monkeypatch.setattr(profile, "time_forward", lambda *args: dataclasses.replace(timed(*args), noise=0.0))
    monkeypatch.setattr(profile.OthersLoad, "__exit__", lambda self, *exc: setattr(self, "cores", 0.0))
    profile._MEMO.clear()
    yield tmp_path / "profiles"
    profile._MEMO.clear()


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded()


@pytest.fixture(scope="module")
def references(loaded):
    return [plain_greedy(loaded.model, p, NEW) for p in PROMPTS]


# -- the decision rule, with given costs --------------------------------------------------------

def test_expected_tokens_is_the_standard_model():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(0.5, 1) == 1.5
    assert expected_tokens(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)


def test_plain_decoding_when_nothing_pays():
    costly = fake_profile(model=DrafterCost(0.0, 0.02))  # a draft token costs two target steps
    assert best_choice(costly, {"model": 0.99}, {"model": 8}).method is None
    useless = fake_profile(model=DrafterCost(0.0, 0.0))  # free, but never right
    assert best_choice(useless, {"model": 0.0}, {"model": 8}) == best_choice(useless, {}, {})


def test_a_candidate_must_beat_plain_decoding_by_the_margin():
    """A lookup modelled a hair faster than plain decoding is declined (the profile's noise is
    larger than the gain); one modelled clear of the margin is taken."""
    costs = fake_profile(lookup=DrafterCost(0.0, 0.0))  # T(2) = T(1): a kept token is all gain
    plain = 1 / costs.forward_seconds(1)

    def survival(gain: float) -> tuple[float, ...]:  # one token kept this often: (1 + gain) plain
        return (gain,)

    hair = best_choice(costs, {"lookup": survival(MARGIN / 2)}, {"lookup": 1})
    assert hair.method is None and hair.tokens_per_second == pytest.approx(plain)
    clear = best_choice(costs, {"lookup": survival(2 * MARGIN)}, {"lookup": 1})
    assert (clear.method, clear.k) == ("lookup", 1)
    assert clear.tokens_per_second == pytest.approx((1 + 2 * MARGIN) * plain)


def test_the_best_drafter_and_k_by_rate():
    costs = fake_profile(lookup=DrafterCost(0.0001, 0.0), model=DrafterCost(0.0, 0.001))
    # rows up to 4 are free: a good model drafter drafts 3, whatever longer k it may draft
    choice = best_choice(costs, {"model": 0.9}, {"model": 8})
    assert (choice.method, choice.k) == ("model", 3)
    assert choice.tokens_per_second == pytest.approx(expected_tokens(0.9, 3) / (0.01 + 0.003))
    # a lookup that agrees as often costs nothing per token: it wins where it has a draft
    both = best_choice(costs, {"lookup": 0.9, "model": 0.9}, {"lookup": 3, "model": 8})
    assert (both.method, both.k) == ("lookup", 3)
    # its draft is 2 tokens: the model's 3 may still be worth more
    assert best_choice(costs, {"lookup": 0.5, "model": 0.9}, {"lookup": 2, "model": 8}).method == "model"


def test_a_tree_is_priced_by_its_nodes_rows_and_drafted_whole_to_its_depth():
    """A tree of 3 nodes drafted to depth 2 verifies 4 rows and drafts TREE_LEVEL tokens' worth a
    level; its rate (kept a level, by its own trees) gives the tokens a step."""
    costs = fake_profile(free_rows=4, model=DrafterCost(0.0, 0.001))
    choice = best_choice(costs, {"model": 0.6}, {"model": 2}, trees={"model": 3})
    assert (choice.method, choice.k) == ("model", 2)
    assert choice.tokens_per_second == pytest.approx(
        expected_tokens(0.6, 2) / (0.01 + 0.001 * auto_module.TREE_LEVEL * 2))
    # where each row costs a tenth of a forward, the same tree pays for its 4 rows (a chain of 2
    # for 3): the chain is the faster
    sloped = CostProfile(tuple(0.01 + 0.001 * rows for rows in range(17)), 300, 1e4,
                         {"model": DrafterCost(0.0, 0.001)})
    tree = best_choice(sloped, {"model": 0.9}, {"model": 2}, trees={"model": 3})
    assert tree.tokens_per_second == pytest.approx(
        expected_tokens(0.9, 2) / (0.013 + 0.001 * auto_module.TREE_LEVEL * 2))
    assert best_choice(sloped, {"model": 0.9}, {"model": 2}).tokens_per_second > tree.tokens_per_second


def test_a_larger_batch_makes_the_verify_term_cost_more():
    """Rows beyond the flat part cost: what pays alone does not in a batch of 4."""
    costs = fake_profile(model=DrafterCost(0.0, 0.0001))
    assert best_choice(costs, {"model": 0.9}, {"model": 8}, batch=1).method == "model"
    assert best_choice(costs, {"model": 0.9}, {"model": 8}, batch=4).method is None
    assert costs.forward_seconds(40) == pytest.approx(0.1)  # extended past the 17 rows measured


def test_acceptance_starts_at_the_prior_and_follows_what_is_seen():
    rate = Acceptance(0.8)
    assert rate.rate == pytest.approx(0.8)
    for _ in range(60):
        rate.observe(judged=4, kept=0)
    assert rate.rate < 0.1
    for _ in range(60):
        rate.observe(judged=4, kept=4)
    assert rate.rate > 0.95


def test_a_drafter_sitting_out_drifts_back_to_its_prior_by_the_text_that_went_by():
    """A step of another drafter's that committed 8 tokens moves a resting drafter's acceptance
    back towards its prior as far as 8 plain steps do: by steps, a drafter refused twice sat out
    most of an answer behind the int4 self-drafter's long steps on the bfloat16 target."""
    plain, long = Acceptance(0.5), Acceptance(0.5)
    for rate in (plain, long):
        for _ in range(3):
            rate.observe(judged=2, kept=0)
    refused = plain.rate
    for _ in range(8):
        plain.rest(priced_out=False)
    long.rest(priced_out=False, tokens=8)
    assert refused < plain.rate < 0.5 and long.rate == pytest.approx(plain.rate)


def test_an_unseeded_answer_starts_from_the_acceptance_of_the_answers_before_it_where_higher():
    """The profile measured 0.5; answers whose drafts were kept move the next unseeded answer's
    starting rate up (by every step seen, the profile's figure weighing LEARNT_WEIGHT refusals);
    answers refused do not move it below the profile's (a drafter once priced out by unlucky
    answers would draft no more and never recover); a seeded answer starts from the profile's."""
    costs = fake_profile(4, model=DrafterCost(0.0, 0.0001, 0.5))
    auto = AutoDrafter(costs, {}, {"model": CatchingUp()}, {"model": 3}, PLAIN)
    unseeded, seeded = (DraftRequest(torch.zeros(10, dtype=torch.int64), 3, SamplingParams(), None,
                                     seeded=flag) for flag in (False, True))

    def answer(request: DraftRequest, kept: int, steps: int = 4) -> float:
        """An answer's steps, each keeping `kept` of its draft; its starting rate."""
        auto.reset()
        starts = []
        for _ in range(steps):
            assert auto.propose(request).choice[0] == "model"
            starts.append(auto.acceptance["model"].rate)
            auto.commit(kept)
        return starts[0]

    assert answer(unseeded, 3) == pytest.approx(0.5)
    # the profile's 0.5 as 3 kept and 3 refused, and 4 steps of 3 kept of 3
    assert auto.learnt["model"].rate == pytest.approx(15 / 18)
    assert answer(unseeded, 3) == pytest.approx(15 / 18)
    assert answer(seeded, 3) == pytest.approx(0.5)
    for _ in range(10):
        answer(unseeded, 0)
    assert auto.learnt["model"].rate < 0.5 and answer(unseeded, 0) == pytest.approx(0.5)


def test_survival_counts_each_position_kept_through_it(monkeypatch):
    """Against a direct count: of offers [4 kept 4, 4 kept 1, 2 kept 0, 4 kept 2] the first j
    tokens were all kept by 3/4, 2/4, 1/3 and 1/3 of the offers reaching j (no prior, no decay)."""
    monkeypatch.setattr(auto_module, "DECAY", 1.0)
    curve = Survival(0.5, 4)
    curve.kept, curve.seen = [0.0] * 4, [0.0] * 4
    for length, kept in ((4, 4), (4, 1), (2, 0), (4, 2)):
        curve.observe(length, kept)
    assert curve.curve == pytest.approx((3 / 4, 2 / 4, 1 / 3, 1 / 3))
    assert expected_by_length(curve.curve, 4) == pytest.approx(1 + 3 / 4 + 2 / 4 + 1 / 3 + 1 / 3)


def test_survival_starts_geometric_never_rises_and_learns_long_offers():
    curve = Survival(0.5, 8)
    assert curve.curve == pytest.approx(tuple(0.5 ** j for j in range(1, 9)))
    for _ in range(20):
        curve.observe(8, 8)  # long offers kept whole
        curve.observe(2, 0)  # short ones refused at once
    s = curve.curve
    assert all(a >= b for a, b in zip(s, s[1:]))
    assert s[-1] > 0.3 and expected_by_length(s, 8) > 3


def test_an_offer_drafted_whole_or_not_at_all():
    costs = fake_profile(lookup=DrafterCost(0.0, 0.0))
    sure_then_not = (0.9, 0.1, 0.05, 0.01, 0.0, 0.0, 0.0, 0.0)
    # free to cut it short, it drafts the 3 tokens whose rows cost nothing here
    assert best_choice(costs, {"lookup": sure_then_not}, {"lookup": 8}).k == 3
    whole = best_choice(costs, {"lookup": sure_then_not}, {"lookup": 8}, whole={"lookup"})
    assert whole.method is None  # 8 rows for ~1 token does not pay: plain decoding
    kept = best_choice(costs, {"lookup": (0.9,) * 8}, {"lookup": 8}, whole={"lookup"})
    assert (kept.method, kept.k) == ("lookup", 8)


class Offers(Drafter):
    """A lookup that offers the given drafts in turn (an empty one: no offer) and counts asks."""

    def __init__(self, offers: list[list[int]]) -> None:
        self.offers, self.asked = offers, 0

    def propose(self, request: DraftRequest) -> Proposal:
        self.asked += 1
        return Proposal(torch.tensor(self.offers[self.asked - 1], dtype=torch.int64))


def test_lookups_in_order_of_preference_and_every_offer_judged_as_the_text_decides_it():
    """The first lookup that offers is the candidate (the next is not asked); each position of its
    offer is counted once the committed text decides it, however few of it the step itself kept;
    a refusal decides the positions after it."""
    first, second = Offers([[7, 8, 9], [], [], [], [3, 4], []]), Offers([[1], [2], [3], [4], [5]])
    costs = fake_profile(first=DrafterCost(0.0, 0.0), second=DrafterCost(0.0, 0.0))
    auto = AutoDrafter(costs, {"first": first, "second": second}, {}, {"first": 8, "second": 8}, PLAIN)
    request = DraftRequest(torch.tensor([5, 6]), 8, SamplingParams(), None)
    assert auto.propose(request).tokens.tolist() == [7, 8, 9] and second.asked == 0
    auto.commit(0)  # the step kept none of it: the target said 7
    survival = auto.survival["first"]
    before, seen = survival.kept[:], survival.seen[:]
    auto.propose(DraftRequest(torch.tensor([5, 6, 7]), 8, SamplingParams(), None))
    # 7 decided (kept); 8, 9 not yet: neither counted
    assert second.asked == 1 and survival.kept == pytest.approx([0.9 * before[0] + 1] + before[1:])
    assert survival.seen == pytest.approx([0.9 * seen[0] + 1] + seen[1:])
    auto.commit(0)
    auto.propose(DraftRequest(torch.tensor([5, 6, 7, 8, 9]), 8, SamplingParams(), None))
    # now decided: all three kept, each of its positions counted once, the positions past it not
    assert survival.kept == pytest.approx([0.9 * k + 1 for k in before[:3]] + before[3:])
    assert survival.seen == pytest.approx([0.9 * k + 1 for k in seen[:3]] + seen[3:])
    auto.commit(0)
    before, seen = survival.kept[:], survival.seen[:]
    auto.propose(DraftRequest(torch.tensor([5, 6, 7, 8, 9, 1]), 8, SamplingParams(), None))
    auto.commit(0)
    assert auto.propose(DraftRequest(torch.tensor([5, 6, 7, 8, 9, 1, 2]), 8, SamplingParams(),
                                     None)).tokens.tolist() == [3, 4]
    auto.commit(0)
    auto.propose(DraftRequest(torch.tensor([5, 6, 7, 8, 9, 1, 2, 0]), 8, SamplingParams(), None))
    # [3, 4] refused at its first token: both positions counted, neither kept
    assert survival.kept == pytest.approx([0.9 * k for k in before[:2]] + before[2:])
    assert survival.seen == pytest.approx([0.9 * k + 1 for k in seen[:2]] + seen[2:])


# -- the profile: measured, cached, keyed ------------------------------------------------------

def test_the_profile_is_cached_and_measured_again_when_its_key_changes(cache, monkeypatch):
    loaded = tiny_loaded()
    measured = auto_profile(loaded)
    assert len(measured.forward) == profile.MAX_ROWS and measured.prefill_rate > 0
    assert set(measured.drafters) == {"suffix", "self-int4", "self-int8", "self-bf16"}
    assert measured.drafters["self-int8"].seconds(8) > 0
    files = list(cache.glob("*.json"))
    assert len(files) == 1

    calls = []

    def fake_measure(*args):
        calls.append(args)
        return measured

    monkeypatch.setattr(profile, "measure", fake_measure)
    profile._MEMO.clear()
    assert auto_profile(loaded) == measured and not calls  # read back from the file
    other_cpu = {"model": "another CPU", "flags": ""}
    for change in (lambda: monkeypatch.setattr(profile, "cpu_identity", lambda: other_cpu),
                   lambda: monkeypatch.setattr(torch, "__version__", "0.0-other"),
                   lambda: monkeypatch.setattr(profile, "code_digest", lambda: "an edited kernel"),
                   lambda: loaded.model.lm_head.weight.data.__setitem__((0, 0), 7.0)):
        profile._MEMO.clear()
        change()
        auto_profile(loaded)
        assert len(calls) == 1, "a changed key must measure again"
        calls.clear()
    assert len(list(cache.glob("*.json"))) == 5
    assert auto_profile(loaded, refresh=True) == measured and len(calls) == 1


def test_two_processes_wanting_one_profile_measure_it_once(cache, monkeypatch, capsys):
    """A second process (here a thread with its own copy of the target: the lock is a file's)
    asking for a profile another is measuring waits for it and reads what it cached."""
    first, second = tiny_loaded(), tiny_loaded()
    measured = auto_profile(first)
    profile._MEMO.clear()
    for path in cache.glob("*.json"):
        path.unlink()
    calls, ready, contended = [], threading.Barrier(2), threading.Event()
    flock = files.fcntl.flock

    def watched_flock(file, operation):
        try:
            return flock(file, operation)
        except BlockingIOError:
            contended.set()  # the other asker found the lock held
            raise

    def slow_measure(*args):
        calls.append(args)
        contended.wait(timeout=10)  # measuring until the other has asked (however busy the machine)
        return measured

    monkeypatch.setattr(files.fcntl, "flock", watched_flock)
    monkeypatch.setattr(profile, "measure", slow_measure)
    answers = {}

    def ask(loaded: LoadedModel) -> None:
        ready.wait()
        answers[id(loaded)] = auto_profile(loaded)

    threads = [threading.Thread(target=ask, args=(loaded,)) for loaded in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1, "the second must wait for the first's measurement, not measure again"
    assert list(answers.values()) == [measured, measured]
    assert len(list(cache.glob("*.json"))) == 1
    assert "another process is measuring this cost profile; waiting" in capsys.readouterr().err


def test_a_dip_in_the_forwards_timings_is_not_taken_for_a_cheaper_width(monkeypatch):
    """The profile's T(rows) never falls as the rows grow: a median that dipped under its
    neighbour's (a noisy VM) is pooled with it, and auto would otherwise draft to the dip."""
    seconds = {rows: 0.010 + 0.001 * rows for rows in range(1, profile.MAX_ROWS + 1)}
    seconds[9] = 0.0165  # under T(8) = 0.018
    clock = [0.0]

    def timed_rows(models, blocks, caches):
        clock[0] += seconds[blocks[0].shape[0]]

    monkeypatch.setattr(profile, "forward_rows", timed_rows)
    def perf_counter() -> float:  # a microsecond a reading besides the forwards' (the prefill's)
        clock[0] += 1e-6
        return clock[0]

    monkeypatch.setattr(profile.time, "perf_counter", perf_counter)
    monkeypatch.setattr(profile, "REPEATS", 1)
    loaded = tiny_loaded()
    timed = profile.time_forward(loaded, CachedModel(loaded.model), list(range(1, 40)))
    assert all(a <= b for a, b in zip(timed.forward, timed.forward[1:])), timed.forward
    assert timed.forward[7] == timed.forward[8] == pytest.approx((0.018 + 0.0165) / 2, abs=1e-5)
    assert timed.forward[9] == pytest.approx(0.020, abs=1e-5)  # the rest as measured


def test_the_code_digest_follows_the_forwards_source(tmp_path):
    """An edit to a kernel's or a drafter's source, or a re-shipped drafter (its drafter.json),
    changes the profile's key; a file outside the forward's folders does not."""
    (tmp_path / "model" / "kernels").mkdir(parents=True)
    (tmp_path / "drafters" / "trained" / "m" / "eagle").mkdir(parents=True)
    kernel, drafter, elsewhere = (tmp_path / "model/kernels/rows.cpp", tmp_path / "drafters/ngram.py",
                                  tmp_path / "cli.py")
    shipped = tmp_path / "drafters/trained/m/eagle/drafter.json"
    for path in (kernel, drafter, elsewhere, shipped):
        path.write_text("one")
    first = profile.code_digest(tmp_path)
    elsewhere.write_text("two")
    assert profile.code_digest(tmp_path) == first
    for path in (kernel, drafter, shipped):
        path.write_text("two")
        assert profile.code_digest(tmp_path) != first
        first = profile.code_digest(tmp_path)
    assert profile.code_digest() == profile.code_digest()  # the package's own, stable



def test_a_cpu_held_to_fewer_instructions_is_another_machine(monkeypatch):
    """The same CPU with torch or oneDNN held to AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
    as on a laptop without AVX-512) has other costs and other fastest kernels: the profile's CPU
    identity and the row kernels' cache key both change."""
    from verispec.model.kernels import rows

    identity, key = profile.cpu_identity(), rows.cpu_key()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2-held")
    assert profile.cpu_identity() != identity and rows.cpu_key() != key
    monkeypatch.undo()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert profile.cpu_identity() != identity and rows.cpu_key() != key

def test_a_stale_or_broken_file_is_measured_again(cache):
    assert profile.read_profile(cache / "absent.json", {}) is None
    cache.mkdir(parents=True)
    (cache / "broken.json").write_text("{not json")
    assert profile.read_profile(cache / "broken.json", {}) is None
    figures = fake_profile(pld=DrafterCost(0.001, 0.0, None))
    profile.write_profile(cache / "old.json", {"version": 0}, figures)
    assert profile.read_profile(cache / "old.json", {"version": 1}) is None
    assert profile.read_profile(cache / "old.json", {"version": 0}) == figures



class Knowing(Drafter):
    """A drafter that knows the greedy continuation of each prompt: it drafts it where the prompt
    is in `right`, and the next token shifted by one (always refused) elsewhere."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], right: set[tuple[int, ...]]) -> None:
        self.continuations, self.right = continuations, right

    def propose(self, request: DraftRequest) -> Proposal:
        context = tuple(request.tokens.tolist())
        prompt = next(p for p in self.continuations if context[:len(p)] == p)
        done = len(context) - len(prompt)
        draft = self.continuations[prompt][done:done + request.k]
        if prompt not in self.right:
            draft = [(token + 1) % VOCAB for token in draft]
        return Proposal(torch.tensor(draft, dtype=torch.int64))


def test_a_drafters_prior_is_its_acceptance_in_the_best_of_several_answers(loaded, references, monkeypatch):
    """The profile times each drafter answering several requests and takes as its prior the
    acceptance of the answer where it drafted best: a prior set too low is never corrected (the
    drafter is never chosen, so never judged), one too high is within a few steps. A drafter
    that drafts one answer right and two wrong gets 1.0, not the pooled share (kept as `pooled`,
    for auto's one-off choice of a self format); its answers' steps all count towards its cost.
    An answer ends at the model's end of text."""
    monkeypatch.setattr(profile, "ANSWER_TOKENS", 24)
    continuations = {tuple(p): ref for p, ref in zip(PROMPTS, references)}
    knowing = Knowing(continuations, right={tuple(PROMPTS[1])})
    cost = profile.drafter_cost(loaded, knowing, 3, PROMPTS)
    assert cost.acceptance == 1.0 and 0.0 < cost.pooled < 0.5  # one answer's kept drafts of three's
    everywhere = Knowing(continuations, right=set(continuations))
    assert profile.drafter_cost(loaded, everywhere, 3, PROMPTS).pooled == 1.0
    wrong = profile.drafter_cost(loaded, Knowing(continuations, right=set()), 3, PROMPTS)
    assert wrong.acceptance == wrong.pooled == 0.0

    steps = []
    real = SpeculativeEngine.generate

    def counted(self, spec):
        result = real(self, spec)
        steps.append(len(result.token_ids))
        return result

    monkeypatch.setattr(SpeculativeEngine, "generate", counted)
    ends = references[1][5]  # the end of text after the second prompt's fifth new token
    monkeypatch.setattr(LoadedModel, "eos_token_ids", property(lambda self: {ends}))
    profile.drafter_cost(loaded, knowing, 3, PROMPTS)
    assert steps[0] == 4 and steps[1:] == [24 if ends not in ref else ref.index(ends) + 1
                                           for ref in references], steps


def test_a_profile_measured_on_a_busy_machine_is_measured_again_and_not_cached(cache, monkeypatch, capsys):
    """Forward timings whose repeats disagree by more than NOISY are a busy machine's: timed
    again (the drafters' runs are not), and if every attempt is noisy, used for this process but
    not cached (with a warning); a steady attempt is cached. The noise itself is measured:
    repeats of a forward that takes alternately 1x and 3x its time read as noisy."""
    loaded = tiny_loaded()
    noisy = profile.ForwardCost(flat_then_linear(), 300, 1e4, noise=0.9)
    attempts, drafted = [], []
    real_cost = profile.drafter_cost
    monkeypatch.setattr(profile, "time_forward", lambda *args: attempts.append(args) or noisy)
    monkeypatch.setattr(profile, "drafter_cost", lambda *args: drafted.append(args) or real_cost(*args))
    measured = auto_profile(loaded)
    assert measured.forward == noisy.forward and measured.noise == noisy.noise
    assert len(attempts) == profile.ATTEMPTS
    # the drafters' runs (most of the time) are not repeated: one each
    assert len(drafted) == len(measured.drafters) >= 2
    assert not cache.exists() or not list(cache.glob("*.json"))
    assert "not cached" in capsys.readouterr().err
    steady = profile.ForwardCost(flat_then_linear(), 300, 1e4, noise=0.05)
    results = iter([noisy, steady])
    attempts.clear()
    monkeypatch.setattr(profile, "time_forward", lambda *args: attempts.append(args) or next(results))
    profile._MEMO.clear()
    assert auto_profile(loaded).noise == steady.noise and len(attempts) == 2
    assert len(list(cache.glob("*.json"))) == 1

    monkeypatch.undo()
    monkeypatch.setattr(profile, "REPEATS", 2)
    monkeypatch.setattr(profile, "ANSWER_TOKENS", 8)
    slow = iter(range(10**6))
    real = profile.forward_rows

    def uneven(*args):  # every other pass takes three times as long
        started = time.perf_counter()
        out = real(*args)
        if next(slow) % 2:
            time.sleep(2 * (time.perf_counter() - started) + 0.002)
        return out

    monkeypatch.setattr(profile, "forward_rows", uneven)
    measured = profile.measure(loaded, CachedModel(loaded.model), {}, {})
    assert measured.noise > profile.NOISY


def test_a_profile_measured_beside_a_steady_load_is_not_cached(cache, monkeypatch, capsys):
    """A job that keeps the cores busy throughout times steadily (the repeats agree) and slowly:
    where other processes kept more cores busy than this process's threads leave spare, the
    profile is used for this process but not cached; with that load gone it is cached."""
    loaded = tiny_loaded()
    steady = profile.ForwardCost(flat_then_linear(), 300, 1e4, noise=0.05)  # not a tiny forward
    monkeypatch.setattr(profile, "time_forward", lambda *args: steady)
    beyond_spare = {"cores": 1.0}
    seen = []

    def measured_load(self, *exc):
        self.cores = max(0.0, self.capacity - torch.get_num_threads()) + beyond_spare["cores"]
        seen.append(self.cores)

    monkeypatch.setattr(profile.OthersLoad, "__exit__", measured_load)
    assert auto_profile(loaded).forward == steady.forward
    assert not cache.exists() or not list(cache.glob("*.json"))
    assert f"other processes kept {seen[-1]:.1f} cores busy" in capsys.readouterr().err
    beyond_spare["cores"] = 0.1
    profile._MEMO.clear()
    auto_profile(loaded)
    assert len(list(cache.glob("*.json"))) == 1


def test_profile_command_prints_the_table_and_draws_the_plot(tiny_dir, cache, tmp_path, capsys):
    plot = tmp_path / "new folder" / "profile.png"  # its folder made
    assert main(["profile", "--model", str(tiny_dir), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "target forward, 300 tokens cached" in out and "prefill:" in out
    assert f"on {profile.cpu_description()} (cached in" in out  # a profile is a figure for one CPU
    for name in ("suffix", "self-int4", "self-int8", "self-bf16"):
        assert f"\n{name} " in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [path.name for path in plot.parent.iterdir()] == ["profile.png"]  # written whole


def test_a_plot_path_that_cannot_be_written_is_refused_before_measuring(tmp_path, capsys, monkeypatch):
    from verispec.cli import profile as profile_cli

    monkeypatch.setattr(profile_cli, "load_model", lambda *args: pytest.fail("the model was loaded"))
    (tmp_path / "file").write_text("")
    for plot, message in [(tmp_path, "is a directory"),
                          (tmp_path / "file" / "x.png", "cannot make its folder")]:
        assert main(["profile", "--plot", str(plot)]) == 2
        assert message in capsys.readouterr().err


# -- auto decodes exactly -------------------------------------------------------------------------

def auto_engine(loaded: LoadedModel, costs: CostProfile,
                settings: SelfSettings = SelfSettings("int8")) -> SpeculativeEngine:
    """An engine whose auto drafter decides by the given costs (not measured ones), its
    self-drafter staged behind prompt lookup as verispec.methods makes it."""
    limits = {"pld": 7, "suffix": 8, "self-int8-pld": 8}

    def make() -> AutoDrafter:
        models = {"self-int8-pld": SelfDrafter(loaded, settings, lookup=PromptLookupDrafter(3, 1))}
        # in order of preference, as verispec.methods gives them
        lookups = {"suffix": SuffixDrafter(SuffixSettings(cache_tokens=0)), "pld": PromptLookupDrafter(3, 1)}
        return AutoDrafter(costs, lookups, models, limits, PLAIN)
    return SpeculativeEngine(loaded.model, make(), ConstantK(16), spawn=make, load_cap=LoadCap(()))


def methods_chosen(results) -> set[str]:
    return {method for result in results for _, method, _ in result.stats.choices}


def test_auto_as_measured_gives_ar_tokens_and_says_what_it_chose(loaded, references, cache):
    engine = build_engine(loaded, "auto")
    [(name, model)] = engine.drafter.models.items()
    kept = [settings.fmt for settings, copies in _WEIGHTS.items() if loaded.model in copies]
    assert kept == [model.weights.settings.fmt]
    # the fastest format, staged behind prompt lookup, priced as the format alone
    assert name == f"self-{model.weights.settings.fmt}-pld" and model.lookup is not None
    assert engine.drafter.profile.drafters[name] == engine.drafter.profile.drafters[name.removesuffix("-pld")]
    results = [engine.generate(SequenceSpec(p, StoppingRules.build(NEW))) for p in PROMPTS]
    assert [r.token_ids for r in results] == references
    for result in results:
        choices = result.stats.choices
        assert choices and choices[0][0] == 0
        assert [start for start, _, _ in choices] == sorted({start for start, _, _ in choices})
        assert all(k == 0 for _, method, k in choices if method == PLAIN)
    total = GenerationStats.total([r.stats for r in results])  # the stretches one after another
    second = len(results[0].stats.choices)
    assert len(total.choices) == sum(len(r.stats.choices) for r in results)
    assert total.choices[second][0] == results[0].stats.new_tokens


@pytest.mark.parametrize("pooled, chosen", [((0.6, 0.9), "self-int8-pld"), ((None, None), "self-int4-pld")],
                         ids=["pooled", "best-answer"])
def test_auto_drafts_with_the_self_format_its_pooled_acceptance_makes_fastest(loaded, monkeypatch,
                                                                               pooled, chosen):
    """The self format is chosen once, by each format's acceptance pooled over the profile's
    answers: int4, cheaper and best in its best answer, loses to int8 where its answers pooled
    kept fewer; a profile without pooled figures falls back to the best answer's."""
    names, _ = _auto_candidates(loaded, DraftOptions())
    selves = {"self-int4": DrafterCost(0.0, 0.001, 0.95, pooled[0]),
              "self-int8": DrafterCost(0.0, 0.0012, 0.9, pooled[1])}
    assert set(selves) <= set(names)
    costs = fake_profile(**{**{name: DrafterCost(0.0, 0.05, 0.9) for name in names}, **selves})
    monkeypatch.setattr(methods, "cost_profile", lambda *args: costs)
    assert set(build_engine(loaded, "auto").drafter.models) == {chosen}


@pytest.mark.parametrize("costs, expected", [
    (fake_profile(pld=DrafterCost(0.0, 0.0), suffix=DrafterCost(0.0, 0.0),
                  **{"self-int8-pld": DrafterCost(0.0, 0.0001, 0.95)}), {"self-int8-pld"}),
    (fake_profile(pld=DrafterCost(0.0, 0.0, 0.95), suffix=DrafterCost(0.0, 0.0, 0.95),
                  **{"self-int8-pld": DrafterCost(0.0, 0.05)}), {"pld", "suffix", PLAIN}),
    # a second a lookup: a 16-token offer pays only against forwards of 60 ms and more, which a
    # loaded machine gave the tiny target at 0.1 s
    (fake_profile(pld=DrafterCost(1.0, 0.0), suffix=DrafterCost(1.0, 0.0),
                  **{"self-int8-pld": DrafterCost(0.0, 0.05)}), {PLAIN}),
], ids=["self-drafter", "lookups-and-plain", "plain"])
def test_whatever_auto_chooses_the_tokens_are_ar_s(loaded, references, costs, expected):
    engine = auto_engine(loaded, costs)
    results = [engine.generate(SequenceSpec(p, StoppingRules.build(NEW))) for p in PROMPTS]
    assert [r.token_ids for r in results] == references
    chosen = methods_chosen(results)
    # A self-drafter's fake cost is far below what its steps take here: auto learns the slowdown
    # as it drafts, and may then turn to the lookups.
    learned = {"pld", "suffix"} if expected == {"self-int8-pld"} else set()
    assert expected <= chosen and chosen <= expected | {PLAIN} | learned
    if chosen == {PLAIN}:
        assert all(step.num_drafted == 0 for r in results for step in r.steps)


def test_in_a_batch_auto_decides_by_the_batch_and_stays_exact(loaded, references, monkeypatch):
    """Alone, a cheap self-drafter pays; in a batch of three, the wider verify does not. (What
    auto learns from the real steps is held: the drafter's slowdown at 1, the target's pace at
    the profile's, the overhead at 0. The tiny model's real forwards cost about the same at any
    width, unlike the fake profile, and learnt, that shape priced the batch's verify in once the
    float32 layer loop went to C++; each is learnt and tested apart. So are trials of a drafter
    priced a little under plain decoding, which the batch's price for it is: EXPLORE_BAND 0.)"""
    monkeypatch.setattr(auto_module, "COST_DECAY", 1.0)
    monkeypatch.setattr(auto_module, "OVERHEAD_DECAY", 1.0)
    monkeypatch.setattr(auto_module, "EXPLORE_BAND", 0.0)
    monkeypatch.setattr(auto_module.Pace, "observe", lambda self, rows, ratio: None)
    costs = fake_profile(2, pld=DrafterCost(0.1, 0.0), suffix=DrafterCost(0.1, 0.0),
                         **{"self-int8-pld": DrafterCost(0.0, 0.0001, 0.9)})
    engine = auto_engine(loaded, costs)
    alone = engine.generate(SequenceSpec(PROMPTS[1], StoppingRules.build(NEW)))
    assert methods_chosen([alone]) == {"self-int8-pld"}
    batch = engine.generate_batch([SequenceSpec(p, StoppingRules.build(NEW)) for p in PROMPTS])
    assert [r.token_ids for r in batch] == references
    assert alone.token_ids == references[1]
    assert batch[0].stats.choices[0][1] == PLAIN


def test_auto_on_a_model_with_no_self_drafter_chooses_among_lookups(cache):
    foreign = LoadedModel(tiny_foreign(seed=1), None, "olmo2")
    engine = build_engine(foreign, "auto")
    assert list(engine.drafter.models) == [] and list(engine.drafter.lookups) == ["suffix"]
    result = engine.generate(SequenceSpec(COPYING, StoppingRules.build(24)))
    assert result.token_ids == plain_greedy(foreign.model, COPYING, 24)
    assert methods_chosen([result]) == {"suffix", PLAIN}


@pytest.mark.parametrize("skew", POWER)
def test_auto_samples_the_target_distribution(skew):
    """Sampling (temperature 1.5): auto drafting with the self-drafter (one of two layers, so
    that it is refused at times) and now and then a lookup; the first three tokens follow the
    target's exact marginals, drafts made at both positions, some kept and some refused."""
    model = tiny_llama(seed=2, vocab=6, layers=2)
    loaded = LoadedModel(model, None, "tiny-6")
    prompt = [1, 3, 4, 5, 2]  # nothing to look up at the first step
    # a forward costs the same at any width: drafting pays in the samples' batch of 500 too
    costs = CostProfile((0.01,) * 17, 300, 1e4, {"pld": DrafterCost(0.0, 0.0, 0.95),
                                                 "suffix": DrafterCost(0.0, 0.0, 0.95),
                                                 "self-int8-pld": DrafterCost(0.0, 0.0, 0.9)})
    # rescoring needs a vocabulary of 8 tokens
    engine = auto_engine(loaded, costs, SelfSettings("int8", skip=(1,), rescore=0))
    sampling = SamplingParams(True, 1.5)
    exact = exact_marginals(model, prompt, 3, sampling)
    sampled = sample_runs(engine, prompt, 3, sampling, runs_for(exact, skew))
    assert {"self-int8-pld"} < methods_chosen(sampled.results) <= {"pld", "suffix", "self-int8-pld"}
    sampled.check_drafting(positions=2)
    assert_follows(sampled, exact, "auto", skew)


# EAGLE's tree under slow (19 s on the AVX2 EPYC at TV 0.1): tests/test_tree_sampling.py's
# trees sample the target's law by default, and auto hands a tree's q to the same verifier
@pytest.mark.parametrize("tree", [None, pytest.param(TreeSettings(2, 3), marks=pytest.mark.slow)],
                         ids=["chain", "tree"])
@pytest.mark.parametrize("skew", POWER)
def test_auto_with_eagle_samples_the_target_distribution(skew, tree):
    """Sampling (temperature 1.5) with EAGLE among auto's candidates (a random one, so that it is
    refused at times), drafting chains or trees, sitting out the steps where suffix decoding's
    offer is chosen and catching up after them: the first three tokens follow the target's exact
    marginals, EAGLE drafted at both positions, some drafts kept and some refused."""
    model = tiny_llama(seed=2, vocab=6, layers=2)
    torch.manual_seed(4)
    net = EagleNet(**eagle_settings(model))
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.3)
    head = ReducedHead(model, torch.arange(6))
    prompt = [1, 3, 4, 5, 2]
    costs = CostProfile((0.01,) * 17, 300, 1e4, {"suffix": DrafterCost(0.0, 0.0, 0.95),
                                                 "eagle": DrafterCost(0.0, 0.0, 0.9)})

    def make() -> AutoDrafter:
        return AutoDrafter(costs, {"suffix": SuffixDrafter(SuffixSettings(cache_tokens=0))},
                           {"eagle": EagleDrafter(model, net, head, tree=tree)}, {"suffix": 8, "eagle": 2},
                           PLAIN, {} if tree is None else {"eagle": tree.nodes})
    engine = SpeculativeEngine(model, make(), ConstantK(16), spawn=make, load_cap=LoadCap(()))
    sampling = SamplingParams(True, 1.5)
    exact = exact_marginals(model, prompt, 3, sampling)
    sampled = sample_runs(engine, prompt, 3, sampling, runs_for(exact, skew))
    chosen = methods_chosen(sampled.results)
    assert "eagle" in chosen and chosen <= {"suffix", "eagle", PLAIN}
    eagle = [step for r in sampled.results for step in r.steps
             if step.choice and step.choice[0] == "eagle"]
    assert all((step.tree is None) == (tree is None) for step in eagle)
    sampled.check_drafting(positions=2)
    assert_follows(sampled, exact, "auto with eagle", skew)


def test_a_drafter_slower_than_its_profile_says_loses_its_place():
    """What auto saw a model drafter's steps take (its slowdown against the profile) enters the
    choice: the same figures choose the self-drafter at its profiled cost, plain decoding at ten
    times that."""
    costs = fake_profile(4, **{"self-int8": DrafterCost(0.0, 0.002)})
    assert best_choice(costs, {"self-int8": 0.9}, {"self-int8": 3}).method == "self-int8"
    assert best_choice(costs, {"self-int8": 0.9}, {"self-int8": 3}, 1, {"self-int8": 10.0}).method is None


def test_the_verify_is_priced_by_what_the_targets_forwards_took(monkeypatch):
    """A profile that read T(2) / T(1) = 1.2 prices a drafter kept 30% of the time out; forwards
    seen to cost the same over two rows as over one bring it in (at k = 1: three rows, unseen,
    take two rows' pace, and the profile's T(3) / T(2) stands). (No trials: EXPLORE_BAND 0.)"""
    monkeypatch.setattr(auto_module, "EXPLORE_BAND", 0.0)
    costs = CostProfile((0.010, 0.012, 0.014, 0.016), 300, 1e4, {"model": DrafterCost(0.0, 0.0015)})
    assert best_choice(costs, {"model": 0.3}, {"model": 3}).method is None
    pace = Pace()
    for _ in range(20):
        pace.observe(1, 1.0)
        pace.observe(2, 0.010 / 0.012)
    assert pace(3) == pace(2) == pytest.approx(0.010 / 0.012, rel=0.01)
    choice = best_choice(costs, {"model": 0.3}, {"model": 3}, pace=pace)
    assert (choice.method, choice.k) == ("model", 1)
    # auto prices by the pace it saw, but a seeded sequence by the profile alone
    priced = dataclasses.replace(costs, drafters={"model": DrafterCost(0.0, 0.0015, 0.3)})
    auto = AutoDrafter(priced, {}, {"model": Slow()}, {"model": 3}, PLAIN)
    seeded, unseeded = (DraftRequest(torch.zeros(10, dtype=torch.int64), 3, SamplingParams(), None,
                                     seeded=flag) for flag in (True, False))
    assert auto.propose(unseeded).choice == (PLAIN, 0)
    auto.commit(0)
    auto.pace = pace
    assert auto.propose(seeded).choice == (PLAIN, 0)
    auto.commit(0)
    assert auto.propose(unseeded).choice == ("model", 1)


def test_the_pace_starts_at_the_profile_takes_the_nearest_row_count_seen_and_resists_a_pause():
    pace = Pace()
    assert pace(1) == pace(9) == 1.0
    pace.observe(4, 0.5)  # one reading against the profile's prior weight
    assert pace(4) == pytest.approx((0.9 * 1.0 + 0.5) / 1.9)
    assert pace(1) == pace(8) == pace(4)  # nothing below 4 seen: the smallest above
    pace.observe(2, 0.8)
    assert pace(3) == pace(2) != pace(4) and pace(1) == pace(2) and pace(9) == pace(4)
    before = pace(4)
    pace.observe(4, 1000.0)  # a pause of the process: counted as twice the estimate at most
    assert pace(4) == pytest.approx((0.9 * before * 1.9 + 2 * before) / (0.9 * 1.9 + 1))


class Trees(Drafter):
    """A model drafter that drafts a tree of 3 nodes to depth 2 (two first tokens, one child)."""

    def propose(self, request: DraftRequest) -> Proposal:
        return Proposal(torch.tensor([1, 2, 3]), parents=torch.tensor([-1, -1, 0]))


def test_a_tree_step_is_judged_a_level_at_a_time_and_timed_as_levels():
    """A tree of 3 nodes whose path of 2 was kept whole counts no refusal (it judged two
    positions, not three), and its drafting time is held to TREE_LEVEL drafted tokens a level."""
    costs = fake_profile(4, model=DrafterCost(0.0, 0.001, 0.9))
    auto = AutoDrafter(costs, {}, {"model": Trees()}, {"model": 2}, PLAIN, {"model": 3})
    # two tokens of context: nothing to catch up on, so the step's time counts
    proposal = auto.propose(DraftRequest(torch.zeros(2, dtype=torch.int64), 4, SamplingParams(), None))
    assert proposal.choice == ("model", 2) and len(proposal) == 3 and not auto.caught_up
    refused = auto.acceptance["model"].refused
    auto.spent = 0.001 * auto_module.TREE_LEVEL * 2  # the drafting took what the profile says a tree does
    auto.commit(2)
    assert auto.acceptance["model"].refused == pytest.approx(auto_module.MODEL_DECAY * refused)
    assert auto.slowdown["model"] == pytest.approx(1.0, rel=0.05)


def test_a_return_after_a_stretch_sat_out_is_charged_its_re_read_spread_over_the_stretch():
    """A model drafter 40 tokens behind re-reads them if chosen: auto charges seconds a token
    re-read (measured at its returns) times 40, spread over its stretch (its mean run of steps
    chosen), so a re-read dearer than the drafts gain keeps plain decoding; the prompt it adopted,
    or a drafter that does not adopt it reads first, is charged nothing. A return's time teaches
    the re-read, not the drafting's pace; a run's end teaches the stretch."""
    costs = fake_profile(4, model=DrafterCost(0.0, 0.001, 0.9))
    auto = AutoDrafter(costs, {}, {"model": CatchingUp()}, {"model": 3}, PLAIN)  # adopts the prefill

    def step(context: int) -> tuple[str, int]:
        request = DraftRequest(torch.zeros(context, dtype=torch.int64), 3, SamplingParams(), None)
        return auto.propose(request).choice

    # before any return: a drafted token's cost times the profile's per row at 17 rows against one
    assert auto.reread["model"] == pytest.approx(0.001 * (17 / 4) / 17)
    assert auto.stretch["model"] == auto_module.STRETCH_PRIOR
    assert step(300) == ("model", 3) and not auto.caught_up  # the prompt adopted
    auto.commit(3)
    auto.reread["model"] = 0.005  # 40 tokens: 0.2 s, 0.05 s a step over a stretch of 4 steps
    assert step(340) == (PLAIN, 0)
    auto.commit(0)
    assert auto.stretch["model"] == pytest.approx(0.8 * auto_module.STRETCH_PRIOR + 0.2 * 1)
    auto.stretch["model"] = 40.0  # 0.005 s a step: the return pays
    assert step(341) == ("model", 3) and auto.caught_up == 41
    pace = auto.slowdown["model"]
    auto.spent = 0.003 + 41 * 0.002  # its drafting as profiled, and 2 ms a token re-read
    auto.commit(3)
    assert auto.reread["model"] == pytest.approx(0.5 * 0.005 + 0.5 * 0.002, rel=0.05)
    assert auto.slowdown["model"] == pace  # the return's time is not the drafting's pace
    assert step(345) == ("model", 3) and not auto.caught_up  # up to date: charged nothing
    first = AutoDrafter(costs, {}, {"model": Slow()}, {"model": 3}, PLAIN)  # reads the prompt itself
    first.reread["model"] = 1.0
    proposal = first.propose(DraftRequest(torch.zeros(300, dtype=torch.int64), 3, SamplingParams(), None))
    assert proposal.choice == ("model", 3) and first.caught_up == 300


def test_auto_counts_one_forward_a_step_and_only_for_steps_it_proposed():
    """A wrapper drafting a step itself (a prediction, a grammar) hands the forward on to auto,
    which did not propose that step: not counted; nor is a second report of one step."""
    costs = fake_profile(4, model=DrafterCost(0.0, 0.001, 0.9))
    auto = AutoDrafter(costs, {}, {"model": Slow()}, {"model": 3}, PLAIN)
    auto.observe_forward(1, 5.0)
    assert auto.pace.counts == {}
    auto.propose(DraftRequest(torch.zeros(10, dtype=torch.int64), 3, SamplingParams(), None))
    auto.observe_forward(4, 0.005)
    auto.observe_forward(4, 5.0)
    auto.commit(3)
    assert auto.pace(4) == pytest.approx((0.9 + 0.5) / 1.9)
    wrapped = Wrapper(Recording())  # and a wrapper hands the forward on
    wrapped.observe_forward(3, 0.1)
    assert wrapped.drafter.forwards == [(3, 0.1)]


def test_a_steps_overhead_is_paid_once_a_token_by_plain_decoding_and_once_a_step_by_a_draft(monkeypatch):
    """Seconds a step costs besides its forward and drafting (verification, bookkeeping) make a
    draft pay that the forward alone prices out (not for a seeded answer, priced by the profile
    alone); auto reads them from its steps' periods, at most as one forward (a pause of the
    process is not overhead), and not across a sequence's start, after a seeded step or after a
    step a wrapper drafted itself. (No trials: EXPLORE_BAND 0.)"""
    monkeypatch.setattr(auto_module, "EXPLORE_BAND", 0.0)
    costs = CostProfile((0.010, 0.012, 0.014, 0.016), 300, 1e4,
                        {"model": DrafterCost(0.0, 0.0015, 0.3)})
    assert best_choice(costs, {"model": 0.3}, {"model": 3}).method is None
    assert best_choice(costs, {"model": 0.3}, {"model": 3}, overhead=0.005).method == "model"
    auto = AutoDrafter(costs, {}, {"model": Slow()}, {"model": 3}, PLAIN)
    unseeded, seeded = (DraftRequest(torch.zeros(10, dtype=torch.int64), 3, SamplingParams(), None,
                                     seeded=flag) for flag in (False, True))
    auto.overhead = 0.005
    assert auto.propose(seeded).choice == (PLAIN, 0)
    auto.commit(0)
    auto.reset()
    assert auto.propose(unseeded).choice == ("model", 1)
    auto.commit(0)
    # The periods below are wall time, which a loaded machine stretches (a 10 ms sleep as the
    # forward, read as 10 ms): drafting kept 0.05 of the time pays at no overhead from none to a forward's,
    # so every step stays plain however the sleeps overrun.
    costs = CostProfile(costs.forward, 300, 1e4, {"model": DrafterCost(0.0, 0.0015, 0.05)})
    auto = AutoDrafter(costs, {}, {"model": Slow()}, {"model": 3}, PLAIN)
    assert best_choice(costs, {"model": 0.05}, {"model": 3}, overhead=0.01).method is None
    decay = auto_module.OVERHEAD_DECAY

    def step(request: DraftRequest, pause: float, forward: float = 0.01) -> float:
        """A plain step: its forward takes `forward`, then `pause` more before the next."""
        assert auto.propose(request).choice == (PLAIN, 0)
        time.sleep(forward)
        auto.observe_forward(1, forward)
        time.sleep(pause)
        auto.commit(0)
        return auto.overhead

    assert step(unseeded, 0.003) == 0.0  # the sequence's first step: nothing read yet
    read = step(unseeded, 0.05)  # the first step's 3 ms (and a little) besides its forward
    assert 0.003 <= read / (1 - decay) <= 0.01
    after_pause = step(unseeded, 0.003)  # the second's 50 ms: counted as one forward, 10 ms
    assert after_pause == pytest.approx(decay * read + (1 - decay) * 0.01)
    counted = step(seeded, 0.05)  # the third's, read at a seeded step
    assert counted != after_pause
    assert step(unseeded, 0.0) == counted  # a seeded step's period teaches nothing
    auto.reset()
    assert step(unseeded, 0.0) == counted  # nor does the period across a sequence's start
    auto.observe_forward(1, 0.01)  # a step a wrapper drafted itself
    auto.propose(unseeded)
    assert auto.overhead == counted


class Recording(Drafter):
    """Drafts three ones a step and records what each step's forward reported."""

    def __init__(self) -> None:
        self.forwards: list[tuple[int, float]] = []

    def propose(self, request: DraftRequest) -> Proposal:
        return Proposal(torch.ones(request.k, dtype=torch.int64))

    def observe_forward(self, rows: int, seconds: float) -> None:
        self.forwards.append((rows, seconds))


def test_the_engine_reports_each_forward_with_every_sequences_rows(loaded):
    """Alone, a step's forward scores the last token and the draft; in a batch, every sequence's
    rows: each drafter hears the whole pass, the size auto prices (T(batch * (k + 1)))."""
    drafters: list[Recording] = []

    def make() -> Recording:
        drafters.append(Recording())
        return drafters[-1]

    engine = SpeculativeEngine(loaded.model, make(), ConstantK(3), spawn=make, load_cap=LoadCap(()))
    alone = engine.generate(SequenceSpec(PROMPTS[1], StoppingRules.build(12)))
    # (the last step has no room for a draft: the drafter is not asked, and hears nothing)
    assert [rows for rows, _ in drafters[0].forwards] == [1 + step.num_drafted for step in alone.steps][:-1]
    assert alone.steps[-1].num_drafted == 0
    assert all(seconds > 0 for _, seconds in drafters[0].forwards)
    drafters[0].forwards.clear()
    engine.generate_batch([SequenceSpec(p, StoppingRules.build(12)) for p in PROMPTS[:2]])
    firsts = [drafter.forwards[0][0] for drafter in drafters if drafter.forwards]
    assert firsts == [8, 8]


class CatchingUp(Drafter):
    """A model drafter that drafts ones at once, but takes 10 ms a token to catch up on the
    context it did not see (beyond what a step leaves it behind: k accepted and the bonus)."""

    adopts_prefill = True

    def __init__(self) -> None:
        self.seen, self.slept = None, []

    def propose(self, request: DraftRequest) -> Proposal:
        context = request.tokens.shape[0]
        behind = 0 if self.seen is None else max(0, context - self.seen - request.k - 1)
        time.sleep(0.01 * behind)
        self.seen = context
        self.slept.append(behind > 0)
        return Proposal(torch.ones(request.k, dtype=torch.int64))


def test_catching_up_after_sitting_out_is_not_taken_for_the_drafters_pace():
    """A self-drafter's step after a stretch it sat out feeds that stretch first: auto does not
    count that step's time into its slowdown (it would price the drafter out, and the stretches
    grow); a step in the flow of drafting does count."""
    drafter = CatchingUp()
    costs = fake_profile(4, model=DrafterCost(0.0, 0.001, 0.9))
    auto = AutoDrafter(costs, {}, {"model": drafter}, {"model": 3}, PLAIN)

    def step(context: int) -> float:
        request = DraftRequest(torch.zeros(context, dtype=torch.int64), 3, SamplingParams(), None)
        assert auto.propose(request).choice == ("model", 3)
        auto.commit(3)
        return auto.slowdown["model"]

    paced = step(10)  # its first step, on the prompt it adopted
    assert step(14) != paced  # in the flow: measured
    measured = auto.slowdown["model"]
    assert step(60) == measured and drafter.slept == [False, False, True]  # 0.42 s of catching up
    assert step(64) != measured


def test_a_drafter_priced_out_by_a_stretch_of_load_comes_back():
    """A slowdown learnt while the machine was busy fades at each step the drafter sits out
    (RECOVERY), so auto tries it again instead of decoding plainly for the rest of the process."""
    costs = fake_profile(4, model=DrafterCost(0.0, 0.001, 0.9))
    auto = AutoDrafter(costs, {}, {"model": CatchingUp()}, {"model": 3}, PLAIN)
    auto.slowdown["model"] = 100.0  # as after steps taken under a passing load
    request = DraftRequest(torch.zeros(10, dtype=torch.int64), 3, SamplingParams(), None)
    plain = 0
    while auto.propose(request).choice == (PLAIN, 0):
        auto.commit(0)
        plain += 1
        assert plain < 200, auto.slowdown
    assert plain > 10 and auto.slowdown["model"] < 100


def test_a_drafter_priced_out_by_refusals_comes_back_at_longer_and_longer_intervals(monkeypatch):
    """Refusals in a row price a model drafter below plain decoding; its acceptance drifts back
    to the prior at each step it sits out, so auto tries it again instead of decoding plainly for
    the rest of the answer (EAGLE sat out 110 of 128 tokens so, on the 4-bit target). A return
    refused at once halves that drift: a drafter refused every time is tried ever more rarely
    (with a prior of 0.9 it took two steps of three without the halving). (Its slowdown is held at
    1: the fake drafter takes no time, which would price it in.)"""
    monkeypatch.setattr(auto_module, "COST_DECAY", 1.0)
    costs = fake_profile(4, model=DrafterCost(0.0, 0.001, 0.9))
    auto = AutoDrafter(costs, {}, {"model": CatchingUp()}, {"model": 3}, PLAIN)
    request = DraftRequest(torch.zeros(10, dtype=torch.int64), 3, SamplingParams(), None)
    chosen = []
    for _ in range(300):
        chosen.append(auto.propose(request).choice != (PLAIN, 0))
        auto.commit(0)  # every draft refused
    first_out = chosen.index(False)
    returns = [i for i in range(first_out, len(chosen)) if chosen[i] and not chosen[i - 1]]
    gaps = [later - earlier for earlier, later in zip(returns, returns[1:])]
    assert len(returns) >= 4 and sum(chosen[first_out:]) < 0.15 * (len(chosen) - first_out), returns
    assert gaps[-1] > 2 * gaps[0], gaps
    # a return whose draft is kept puts the drift back
    assert auto.acceptance["model"].recovery < 1 - auto_module.RECOVERY
    while auto.propose(request).choice == (PLAIN, 0):
        auto.commit(0)
    auto.commit(3)
    assert auto.acceptance["model"].recovery == 1 - auto_module.RECOVERY


def test_a_drafter_priced_a_little_under_plain_decoding_is_tried_and_kept_where_it_pays(monkeypatch):
    """A model drafter whose prior prices it just under plain decoding is tried at the answer's
    first plain step, then after EXPLORE_EVERY steps, each refused trial doubling the wait: where
    its drafts are kept it takes over the answer, where they are refused it costs a few trials.
    One priced far under plain decoding is never tried. (Slowdown held at 1, as above.)"""
    monkeypatch.setattr(auto_module, "COST_DECAY", 1.0)
    request = DraftRequest(torch.zeros(10, dtype=torch.int64), 3, SamplingParams(), None)

    def run(prior: float, kept: bool, steps: int = 128) -> tuple[list[bool], list[int]]:
        """Whether each step drafted, and auto's trials (drafted, first token kept)."""
        costs = CostProfile((0.010, 0.012, 0.014, 0.016), 300, 1e4,
                            {"model": DrafterCost(0.0, 0.0015, prior)})
        auto = AutoDrafter(costs, {}, {"model": CatchingUp()}, {"model": 3}, PLAIN)
        drafted = []
        for _ in range(steps):
            choice = auto.propose(request).choice
            drafted.append(choice != (PLAIN, 0))
            auto.commit(choice[1] if kept else 0)
        # runs that were one refused trial each leave the drafter's stretch at its prior
        assert kept or auto.stretch["model"] == auto_module.STRETCH_PRIOR, auto.stretch
        return drafted, auto.trials

    # at 0.3 a one-token draft models 1.3 / 0.0135 = 96 tokens/s against plain decoding's 100
    assert best_choice(CostProfile((0.010, 0.012), 300, 1e4, {"model": DrafterCost(0.0, 0.0015)}),
                       {"model": 0.3}, {"model": 3}).method is None
    paying, trials = run(0.3, kept=True)
    assert paying[0] and sum(paying) > 0.9 * len(paying) and trials == [1, 1]
    refused, trials = run(0.3, kept=False)
    tried = [step for step, drafted in enumerate(refused) if drafted]
    assert tried == [0, 33, 98] and trials == [3, 0], tried  # a refusal doubles the wait: 32, then 64
    assert run(0.1, kept=True) == ([False] * 128, [0, 0])  # 1.1 / 0.0135 = 81 tokens/s: out of the band


def test_a_drafter_priced_a_little_under_the_chosen_one_is_tried_too(monkeypatch):
    """A trial is owed against whatever step was chosen, not only plain decoding: a model drafter
    priced a little under the one chosen is tried (on the bfloat16 target EAGLE's prior priced it
    under the int4 self-drafter, which then drafted whole answers untried by it), takes over where
    its drafts are kept, and where they are refused is tried after 32, then 64 more steps."""
    monkeypatch.setattr(auto_module, "COST_DECAY", 1.0)
    request = DraftRequest(torch.zeros(10, dtype=torch.int64), 3, SamplingParams(), None)
    costs = CostProfile((0.010, 0.012, 0.014, 0.016), 300, 1e4,
                        {"first": DrafterCost(0.0, 0.0015, 0.5), "second": DrafterCost(0.0, 0.0015, 0.45)})

    def run(kept: bool) -> list[str]:
        """The drafter each step chose: first's drafts kept every other step, second's as `kept`."""
        auto = AutoDrafter(costs, {}, {"first": CatchingUp(), "second": CatchingUp()},
                           {"first": 3, "second": 3}, PLAIN)
        chosen = []
        for step in range(128):
            name, k = auto.propose(request).choice
            chosen.append(name)
            auto.commit(k if (name == "second" and kept) or (name == "first" and step % 2) else 0)
        return chosen

    # at the first step first models 1.5 / 0.0135 = 111 tokens/s, second 1.45 / 0.0135 = 107
    assert best_choice(costs, {"first": 0.5, "second": 0.45}, {"first": 3, "second": 3}).method == "first"
    paying = run(kept=True)
    assert paying[0] == "second" and paying.count("second") > 0.9 * len(paying), paying
    refused = run(kept=False)
    assert [step for step, name in enumerate(refused) if name == "second"] == [0, 33, 98]
    assert refused.count("first") == len(refused) - 3


class Watched(EagleDrafter):
    """An EAGLE drafter noting the target's hidden states it was handed, by context length."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: dict[int, torch.Tensor] = {}

    def propose(self, request: DraftRequest) -> Proposal:
        self.seen[request.tokens.shape[0]] = request.target_hidden.clone()
        return super().propose(request)


def auto_with_random_eagle(model, seed: int, kind: type[EagleDrafter],
                           tree: TreeSettings | None = None) -> SpeculativeEngine:
    """An engine whose auto chooses among suffix decoding and a random EAGLE (`kind`, drafting
    chains or `tree`, weights drawn from `seed`) priced as nearly free."""
    torch.manual_seed(seed)
    net = EagleNet(**eagle_settings(model))
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.3)
    head = ReducedHead(model, torch.arange(3, VOCAB - 13))
    costs = fake_profile(4, suffix=DrafterCost(0.0, 0.0), eagle=DrafterCost(0.0, 0.0001, 0.9))

    def make() -> AutoDrafter:
        return AutoDrafter(costs, {"suffix": SuffixDrafter(SuffixSettings(cache_tokens=0))},
                           {"eagle": kind(model, net, head, tree=tree)}, {"suffix": 8, "eagle": 2},
                           PLAIN, {} if tree is None else {"eagle": tree.nodes})
    return SpeculativeEngine(model, make(), ConstantK(16), spawn=make, load_cap=LoadCap(()))


def test_a_trained_drafter_among_autos_candidates_reads_the_targets_hidden_states(loaded, references):
    """EAGLE as one of auto's model drafters: the engine hands auto the target's hidden states
    (those of the target's own forward over the text, computed apart), EAGLE is chosen again
    after stretches it sat out (and catches up on them), and the tokens are ar's, alone and in a
    batch. (Seeded answers, each priced by the profile alone: what this random EAGLE keeps would
    price it out of the later answers, and unseeded, the wall time of its drafting on a loaded
    machine (a training run beside the suite) priced it out after its first stretch, 1 run in 3.)"""
    engine = auto_with_random_eagle(loaded.model, 3, Watched)
    assert engine.drafter.needs_hidden and engine.drafter.hidden_layers == ()
    results = [engine.generate(SequenceSpec(p, StoppingRules.build(NEW), seed=0)) for p in PROMPTS]
    assert [r.token_ids for r in results] == references
    stretches = [[method for _, method, _ in r.stats.choices] for r in results]
    assert all(methods.count("eagle") >= 2 for methods in stretches), stretches  # chosen again
    watched = engine.drafter.models["eagle"]
    for prompt, reference in zip(PROMPTS, references):
        watched.seen.clear()
        engine.generate(SequenceSpec(prompt, StoppingRules.build(NEW), seed=0))
        with torch.no_grad():  # the target's final hidden states over the whole text, computed apart
            text = torch.tensor([prompt + reference])
            truth = loaded.model(text, output_hidden_states=True).hidden_states[-1][0]  # [len, hidden]
        assert len(watched.seen) >= 3 and max(watched.seen) > len(prompt) + 3
        for length, states in watched.seen.items():  # [length - 1, hidden]
            torch.testing.assert_close(states, truth[: length - 1], rtol=0, atol=1e-5)
    batch = engine.generate_batch([SequenceSpec(p, StoppingRules.build(NEW)) for p in PROMPTS])
    assert [r.token_ids for r in batch] == references


def test_a_tree_drafting_eagle_among_autos_candidates_gives_ar_tokens(loaded, references, monkeypatch):
    """EAGLE drafting trees (3 nodes, depth 2) as one of auto's model drafters: chosen, each of
    its steps a tree verified at once, a whole path of one kept (a random EAGLE: seed 8 is one
    that guesses right at times), and the tokens are ar's, alone and in a batch. (Seeded answers,
    priced by the profile alone: under load, unseeded ones once chose EAGLE at a last step, whose
    one token left drafts a tree of depth 1.)"""
    monkeypatch.setattr(auto_module, "LEARNT_WEIGHT", 1e6)
    engine = auto_with_random_eagle(loaded.model, 8, EagleDrafter, TreeSettings(2, 3))
    results = [engine.generate(SequenceSpec(p, StoppingRules.build(NEW), seed=0)) for p in PROMPTS]
    assert [r.token_ids for r in results] == references
    eagle = [step for r in results for step in r.steps
             if step.choice and step.choice[0] == "eagle"]
    assert len(eagle) >= 3 and all(step.tree is not None and step.num_drafted == 3 for step in eagle)
    assert max(step.num_accepted for step in eagle) == 2
    batch = engine.generate_batch([SequenceSpec(p, StoppingRules.build(NEW)) for p in PROMPTS])
    assert [r.token_ids for r in batch] == references


@pytest.fixture(scope="module")
def builtin_int4():
    return load_model(DEFAULT_MODEL, "int4")


# Shapes as measured ones look, fixed here so that the test holds the rule, not this month's τ.
SHAPES = (methods.Shape(None, 1.5, 1), methods.Shape(None, 1.8), methods.Shape(TreeSettings(2, 3), 2.2))


@pytest.mark.parametrize("free_rows, shapes, depth, tree", [
    (4, SHAPES, 2, TreeSettings(2, 3)), (1, SHAPES, 1, None),
    (4, SHAPES[:2] + (methods.Shape(None, 2.3, 3),), 3, None)])
def test_the_shipped_eagle_is_a_candidate_drafting_the_shape_that_pays(
        builtin_int4, monkeypatch, free_rows, shapes, depth, tree):
    """On the built-in model auto also chooses the EAGLE drafter shipped for it (not one given
    with --draft: that is the user's method), drafting the shape its measured shapes make fastest
    by the profile: a tree of 3 nodes to depth 2 where verifying 4 rows is free, a chain of 1
    where each row costs a forward, and a chain of 3, deeper than eagle's default k, where that
    shape is the fastest."""
    eagle = dataclasses.replace(methods.METHODS["eagle"], shapes=shapes)
    monkeypatch.setitem(methods.METHODS, "eagle", eagle)
    builders, _ = _auto_candidates(builtin_int4, DraftOptions())
    assert "eagle" in builders
    builders, _ = _auto_candidates(builtin_int4, DraftOptions(draft="elsewhere"))
    assert "eagle" not in builders
    costs = CostProfile(flat_then_linear(free_rows=free_rows), 300, 1e4, {
        "suffix": DrafterCost(0.0, 0.0), "self-int8": DrafterCost(0.0, 0.05, 0.9),
        "self-bf16": DrafterCost(0.0, 0.08, 0.9), "eagle": DrafterCost(0.0, 0.0001, 0.4)})
    monkeypatch.setattr(methods, "cost_profile", lambda *args, **kwargs: costs)
    drafter = methods._auto(builtin_int4, DraftOptions())
    assert isinstance(drafter.models["eagle"], EagleDrafter) and drafter.needs_hidden
    assert drafter.limits["eagle"] == depth and drafter.models["eagle"].tree == tree
    assert drafter.trees == ({} if tree is None else {"eagle": tree.nodes})


def test_the_shapes_were_measured_with_the_drafters_shipped():
    """Each method's shapes carry τ measured with the drafter shipped for the built-in model: a
    re-shipped drafter (other weights) fails here until its shapes are measured again. A stale τ
    had the profile choose shapes for a drafter two re-ships old (docs/tuning.md)."""
    kinds = {spec.trained_kind for spec in methods.METHODS.values() if spec.shapes}
    assert kinds == set(methods.SHAPES_MEASURED_WITH)
    for kind in kinds:
        shipped = SHIPPED / DEFAULT_MODEL / kind
        assert weights_digest(shipped) == methods.SHAPES_MEASURED_WITH[kind], (
            f"{kind} was re-shipped: run `python scripts/shape_tau.py` for its methods and paste "
            "the shapes and the digest it prints into verispec/methods.py")


class Slow(Drafter):
    """A model drafter that drafts ones, 5 ms a proposal: far above a profile's 1 ms a token."""

    def propose(self, request: DraftRequest) -> Proposal:
        time.sleep(0.005)
        return Proposal(torch.ones(request.k, dtype=torch.int64))


def test_a_seeded_sequence_is_priced_by_the_profile_alone():
    """A seeded sequence's choices do not follow wall time: a slowdown learnt under load is not
    applied to it, and its own steps, however slow, teach none; an unseeded one's do both."""
    costs = fake_profile(4, model=DrafterCost(0.0, 0.001, 0.9))
    auto = AutoDrafter(costs, {}, {"model": Slow()}, {"model": 3}, PLAIN)
    seeded, unseeded = (DraftRequest(torch.zeros(10, dtype=torch.int64), 3, SamplingParams(), None,
                                     seeded=flag) for flag in (True, False))
    for _ in range(3):
        assert auto.propose(seeded).choice == ("model", 3)
        auto.commit(3)
    assert auto.slowdown["model"] == 1.0
    assert auto.propose(unseeded).choice == ("model", 3)
    auto.commit(3)
    assert auto.slowdown["model"] > 1.2  # 5 ms taken where 3 were predicted, weighed in by half
    auto.slowdown["model"] = 100.0
    assert auto.propose(unseeded).choice == (PLAIN, 0)
    auto.commit(0)
    assert auto.propose(seeded).choice == ("model", 3)


def test_a_seed_pins_autos_sampled_output_whatever_the_load(loaded):
    """Two seeded sampling runs, one after auto learnt that the self-drafter runs a hundred times
    slower than profiled (as under a passing load), choose alike and sample the same tokens."""
    costs = fake_profile(4, pld=DrafterCost(0.1, 0.0), suffix=DrafterCost(0.1, 0.0),
                         **{"self-int8-pld": DrafterCost(0.0, 0.0001, 0.9)})
    spec = SequenceSpec(PROMPTS[1], StoppingRules.build(NEW), SamplingParams(True, 0.9), seed=7)
    calm, loaded_down = auto_engine(loaded, costs), auto_engine(loaded, costs)
    loaded_down.drafter.slowdown["self-int8-pld"] = 100.0
    first, second = calm.generate(spec), loaded_down.generate(spec)
    assert methods_chosen([first]) == {"self-int8-pld"}
    assert first.token_ids == second.token_ids and first.stats.choices == second.stats.choices


def test_a_copy_in_the_targets_own_format_is_no_candidate():
    """On a 4-bit target, self-int4 would draft at a target forward a token: not a candidate."""
    tiny = tiny_llama(hidden=64)
    int4_target(tiny, None)
    builders, _ = _auto_candidates(LoadedModel(tiny, None, "tiny-int4"), DraftOptions())
    assert "self-int4" not in builders and "suffix" in builders
    builders, _ = _auto_candidates(LoadedModel(tiny_llama(hidden=64), None, "tiny"), DraftOptions())
    assert "self-int4" in builders


def test_profiles_go_where_verispec_profile_dir_says(monkeypatch, tmp_path):
    """The suite's own profiles (conftest sets the variable) and a user's choice of folder."""
    monkeypatch.setenv("VERISPEC_PROFILE_DIR", str(tmp_path / "mine"))
    assert profile.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("VERISPEC_PROFILE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert profile.cache_dir() == tmp_path / "xdg" / "verispec" / "profiles"


def test_measuring_a_profile_shows_a_bar_at_a_terminal_and_nothing_in_a_log(monkeypatch, cache):
    """A first command waits on the profile (13-18 s for the built-in model on 2 cores): at a
    terminal a bar names the target and the part being timed; piped to a log, stderr stays quiet."""
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    loaded = tiny_loaded()
    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        profile._MEMO.clear()
        auto_profile(loaded, refresh=True)
        text = stream.getvalue()
        assert (f"measuring {loaded.name}'s cost profile" in text and "self-int8" in text) == shown, text
        assert shown or text == ""
