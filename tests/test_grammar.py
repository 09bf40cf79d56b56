"""Grammar-constrained decoding (verispec.core.grammar) is exact under speculation.

Greedy: every kind of drafter (forcing drafters, a draft model, prompt lookup chains and trees,
lookahead's side branch) gives the tokens of masked plain decoding, computed here independently
(a full forward per token, the mask read from llguidance's own byte-per-token bias). Sampling:
the emitted tokens follow the masked target's exact law, enumerated. Each test checks that it
exercised what it names: drafts cut where they left the grammar, forced tokens drafted for free,
drafts accepted and refused.
"""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest
import torch

import verispec
from tests.distribution import FAST_SKEW, FULL, POWER, SKEW, assert_follows, runs_for, sample_runs
from tests.drafters import OracleDrafter, RandomDrafter
from tests.tiny import EOS, VOCAB, tiny_bpe_tokenizer, tiny_llama
from verispec.core.errors import VerispecError
from verispec.core.grammar import Constraint, Grammar
from verispec.core.policies import ConstantK, LoadCap
from verispec.core.sampling import warp_probs
from verispec.core.stopping import StoppingRules
from verispec.core.tree import TreeSettings
from verispec.core.types import DraftSource, Fate, GenerationResult, Proposal, SamplingParams
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.base import Drafter, DraftRequest
from verispec.drafters.lookahead import LookaheadDrafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.model.loading import LoadedModel

# Two to six free tokens, three forced ones, then free tokens from a narrower set: masks that
# change along the output, forced tokens in the middle, and no end (the budget stops it).
REGEX = r"(w1[0-9]|w2[0-9]|w3[0-9]){2,6}w10w11w12(w4[0-8]|w2[0-9])+"
GRAMMAR = Grammar.of(regex=REGEX)
NEW = 32
PROMPTS = [[1, 17, 42, 9, 33, 17, 42, 5], [1, 30, 31, 30, 31]]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_bpe_tokenizer()


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def smollm():
    return verispec.load("smollm2-135m-instruct")


def constraint(tokenizer, grammar: Grammar = GRAMMAR) -> Constraint:
    return Constraint.compile(grammar, tokenizer, VOCAB, {EOS})


def llguidance_matcher(tokenizer, grammar: Grammar, vocab: int = VOCAB) -> llguidance.LLMatcher:
    """The grammar engine's own matcher, apart from verispec.core.grammar's mask handling."""
    eos = tokenizer.eos_token_id
    return llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos),
                                grammar.llguidance())


def allowed(matcher: llguidance.LLMatcher, vocab: int = VOCAB) -> torch.Tensor:
    """[vocab] bool, from llguidance's one byte per token (0 refused, 200 allowed)."""
    return torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[:vocab] > 0


@torch.no_grad()
def masked_plain(model, tokenizer, prompt: list[int], n: int, grammar: Grammar = GRAMMAR) -> list[int]:
    """Masked plain decoding: a full forward per token, argmax over what the grammar allows."""
    vocab = model.get_output_embeddings().weight.shape[0]
    matcher, out = llguidance_matcher(tokenizer, grammar, vocab), []
    while len(out) < n and not matcher.is_stopped():
        logits = model(torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(logits.masked_fill(~allowed(matcher, vocab), float("-inf")).argmax()))
        assert matcher.consume_token(out[-1])
    return out


@pytest.fixture(scope="module")
def references(target, tokenizer):
    return [masked_plain(target, tokenizer, p, NEW) for p in PROMPTS]


def constrained(engine: SpeculativeEngine, prompt: list[int], grammar_state: Constraint,
                n: int = NEW) -> GenerationResult:
    """A constrained run; a token the grammar refuses reaching the output (the engine stops with
    an error) fails the test's assertion that the run is masked plain decoding."""
    try:
        return engine.generate(SequenceSpec(prompt, StoppingRules.build(n), constraint=grammar_state))
    except VerispecError as error:
        raise AssertionError(f"the output left the grammar: {error}") from error


def drafters(target, prompt: list[int], truth: list[int]) -> dict:
    return {
        "random": RandomDrafter(VOCAB),
        "oracle": OracleDrafter(len(prompt), truth, errors={0, 3, 4, 11, 12, 20}, vocab=VOCAB),
        "self": ModelDrafter(target, VOCAB),
        "draft-model": ModelDrafter(tiny_llama(seed=7, layers=1), VOCAB),
        "pld": PromptLookupDrafter(max_ngram=3),
        "pld-tree": PromptLookupDrafter(max_ngram=3, tree=TreeSettings(topk=3, nodes=12)),
        "self-tree": ModelDrafter(target, VOCAB, tree=TreeSettings(topk=2, nodes=12)),
        "lookahead": LookaheadDrafter(window=4, ngram=3, guesses=4),
    }


@pytest.mark.parametrize("k", [1, 5])
def test_constrained_speculation_equals_masked_plain_decoding(target, tokenizer, references, k):
    for prompt, truth in zip(PROMPTS, references):
        assert tokenizer.decode(truth).startswith("w")  # the reference itself obeys the grammar
        for name, drafter in drafters(target, prompt, truth).items():
            engine = SpeculativeEngine(target, drafter, ConstantK(k))
            result = constrained(engine, prompt, constraint(tokenizer))
            assert result.token_ids == truth, f"{name} with k={k} left masked plain decoding"
            assert result.stats.new_tokens == len(truth)
            forced = [s for s in result.steps if s.source is DraftSource.GRAMMAR]
            assert all(set(s.fates[:-1]) == {Fate.FORCED} for s in forced), name
            assert sum(s.fates.count(Fate.FORCED) for s in forced) == result.stats.forced_tokens
            if name == "random":  # its drafts never reach w10 w11: a step starts at them
                assert result.stats.forced_tokens >= 2


def test_drafts_leaving_the_grammar_are_cut_before_verification(target, tokenizer, references):
    """Random drafts mostly leave the grammar: the verifier sees them cut (fewer than k rows),
    and an oracle's correct drafts are kept whole."""
    prompt, truth = PROMPTS[0], references[0]
    k = 6
    random = SpeculativeEngine(target, RandomDrafter(VOCAB), ConstantK(k)).generate(
        SequenceSpec(prompt, StoppingRules.build(NEW), constraint=constraint(tokenizer)))
    drafted = [s.num_drafted for s in random.steps if s.source is not DraftSource.GRAMMAR]
    assert min(drafted) < k and random.token_ids == truth, drafted
    oracle = SpeculativeEngine(target, OracleDrafter(len(prompt), truth, set(), VOCAB), ConstantK(k))
    oracle = oracle.generate(SequenceSpec(prompt, StoppingRules.build(NEW), constraint=constraint(tokenizer)))
    assert any(s.num_accepted == k for s in oracle.steps if s.source is not DraftSource.GRAMMAR)


def test_a_row_with_a_grammar_beside_rows_without(target, tokenizer, references):
    """One batch: a constrained row, an unconstrained row, and a row with another grammar; each
    gives what it gives alone."""
    other = Grammar.of(regex=r"(w3[0-9]w4[0-8])+")
    engine = SpeculativeEngine(target, PromptLookupDrafter(max_ngram=3), ConstantK(4),
                               spawn=lambda: PromptLookupDrafter(max_ngram=3), load_cap=LoadCap(()))
    alone_free = SpeculativeEngine(target).generate(
        SequenceSpec(PROMPTS[1], StoppingRules.build(NEW))).token_ids
    rules = StoppingRules.build(NEW)
    results = engine.generate_batch([
        SequenceSpec(PROMPTS[0], rules, constraint=constraint(tokenizer)), SequenceSpec(PROMPTS[1], rules),
        SequenceSpec(PROMPTS[0], rules, constraint=constraint(tokenizer, other))])
    assert results[0].token_ids == references[0]
    assert results[1].token_ids == alone_free
    assert results[2].token_ids == masked_plain(target, tokenizer, PROMPTS[0], NEW, other)
    assert results[1].token_ids != masked_plain(target, tokenizer, PROMPTS[1], NEW)  # the mask mattered


def test_a_complete_grammar_ends_the_sequence(target, tokenizer):
    """A grammar with an end: the output stops there, before the budget, for every method."""
    grammar = Grammar.of(regex=r"(w1[0-9]|w2[0-9]){3}w10w11")
    truth = masked_plain(target, tokenizer, PROMPTS[0], NEW, grammar)
    assert len(truth) < NEW and tokenizer.decode(truth).endswith("w10w11")
    for drafter in (None, PromptLookupDrafter(max_ngram=3), ModelDrafter(target, VOCAB)):
        result = SpeculativeEngine(target, drafter, ConstantK(5)).generate(
            SequenceSpec(PROMPTS[0], StoppingRules.build(NEW), constraint=constraint(tokenizer, grammar)))
        assert result.token_ids == truth and result.steps[-1].finished


# -- sampling: the masked target's exact law ------------------------------------------------------

SAMPLING_REGEX = r"(w1[0-9]|w2[0-9])(w3[0-9]|w4[0-8])w10w11(w1[0-9]|w3[0-9])"
POSITIONS = 3  # two free tokens, then (canonically) the forced w10


@torch.no_grad()
def exact_masked_marginals(model, tokenizer, prompt: list[int], n: int, grammar: Grammar,
                           sampling: SamplingParams) -> torch.Tensor:
    """The masked target's exact law of each of its first n sampled tokens [n, vocab] float64:
    every path enumerated, each masked by a fresh llguidance matcher that consumed it."""
    paths, weights, out = [[]], torch.ones(1, dtype=torch.float64), []
    for position in range(n):
        logits = model(torch.tensor([prompt + p for p in paths])).logits[:, -1]  # [P, V]
        masks = []
        for path in paths:
            matcher = llguidance_matcher(tokenizer, grammar)
            assert matcher.consume_tokens(path)
            masks.append(allowed(matcher))
        probs = warp_probs(logits.masked_fill(~torch.stack(masks), float("-inf")), sampling).double()
        joint = weights[:, None] * probs
        out.append(joint.sum(0))
        if position == n - 1:
            break
        path_index, token = joint.nonzero(as_tuple=True)
        paths = [paths[i] + [t] for i, t in zip(path_index.tolist(), token.tolist())]
        weights = joint[path_index, token]
    return torch.stack(out)


PLAIN = SamplingParams(do_sample=True, temperature=1.0)
WARPED = SamplingParams(do_sample=True, temperature=0.7, top_p=0.8)
SLOW = pytest.mark.slow


# A draft model's chains and trees under a grammar sample at TV 0.1 in the slow checks (36 s and 52 s
# on the AVX2 EPYC); the default suite's is the fixed-law drafter's cut draft below (11 s). Each
# warp is checked alone against a hand-computed law in tests/test_warps.py.
@pytest.mark.parametrize(("sampling", "skew"), [
    pytest.param(PLAIN, FAST_SKEW, id="fast-t1.0", marks=SLOW),
    pytest.param(PLAIN, SKEW, id="full-t1.0", marks=FULL),
    pytest.param(WARPED, FAST_SKEW, id="fast-t0.7-p0.8", marks=SLOW),
    pytest.param(WARPED, SKEW, id="full-t0.7-p0.8", marks=FULL)])
def test_constrained_sampling_follows_the_masked_targets_law(tokenizer, sampling, skew, monkeypatch):
    """An independent draft model samples unconstrained drafts: most leave the grammar and are
    cut; the kept ones must be verified against q renormalized over the allowed tokens (with the
    raw q the emitted law is skewed: scripts/mutate.py plants that)."""
    target = tiny_llama(seed=2)
    grammar = Grammar.of(regex=SAMPLING_REGEX)
    cuts = {"drafts": 0, "cut": 0}
    original = Constraint.cut

    def counting(self, proposal):
        kept, masks = original(self, proposal)
        cuts["drafts"] += 1
        cuts["cut"] += len(kept) < len(proposal)
        return kept, masks

    monkeypatch.setattr(Constraint, "cut", counting)
    draft = tiny_llama(seed=5, layers=1)  # one model, a drafter (and cache) per row
    drafter = lambda: ModelDrafter(draft, VOCAB)  # noqa: E731
    engine = SpeculativeEngine(target, drafter(), ConstantK(3), spawn=drafter, load_cap=LoadCap(()))
    prompt = PROMPTS[1]
    exact = exact_masked_marginals(target, tokenizer, prompt, POSITIONS, grammar, sampling)
    sampled = sample_runs(engine, prompt, POSITIONS, sampling, runs=runs_for(exact, skew),
                          constraint=constraint(tokenizer, grammar))
    assert 0 < cuts["cut"] < cuts["drafts"], cuts  # drafts were cut, and some were kept whole
    sampled.check_drafting(positions=1)
    assert_follows(sampled, exact, f"constrained {sampling}", skew)


@SLOW
@pytest.mark.parametrize("skew", POWER)
def test_constrained_tree_sampling_follows_the_masked_targets_law(tokenizer, skew, monkeypatch):
    """Token trees are masked, not cut: a node the grammar refuses has p = 0 and is never kept,
    and siblings drawn without replacement update the residual as without a grammar. Refused
    nodes were drafted (counted through the masks' rows) and the law still holds."""
    target = tiny_llama(seed=2)
    grammar = Grammar.of(regex=SAMPLING_REGEX)
    sampling = SamplingParams(do_sample=True, temperature=1.0)
    seen = {"nodes": 0, "refused": 0}
    original = Constraint.cut

    def counting(self, proposal):
        kept, masks = original(self, proposal)
        if proposal.parents is None:  # the grammar's forced tokens, or no draft
            return kept, masks
        assert kept is proposal  # a tree goes through whole
        tokens, parents = proposal.tokens.tolist(), proposal.parents.tolist()
        seen["nodes"] += len(tokens)
        seen["refused"] += sum(not bool(masks[parent + 1, token]) for token, parent in zip(tokens, parents))
        return kept, masks

    monkeypatch.setattr(Constraint, "cut", counting)
    draft = tiny_llama(seed=5, layers=1)  # one model, a drafter (and cache) per row
    drafter = lambda: ModelDrafter(draft, VOCAB,  # noqa: E731
                                   tree=TreeSettings(topk=3, nodes=8))
    engine = SpeculativeEngine(target, drafter(), ConstantK(2), spawn=drafter, load_cap=LoadCap(()))
    prompt = PROMPTS[1]
    exact = exact_masked_marginals(target, tokenizer, prompt, POSITIONS, grammar, sampling)
    sampled = sample_runs(engine, prompt, POSITIONS, sampling, runs=runs_for(exact, skew),
                          constraint=constraint(tokenizer, grammar))
    assert 0 < seen["refused"] < seen["nodes"], seen
    sampled.check_drafting(positions=1)
    assert_follows(sampled, exact, "constrained tree", skew)


class FixedLawDrafter(Drafter):
    """Drafts k tokens, each drawn from one fixed law q [vocab] (reported as drawn): most of its
    mass on two tokens the grammar allows at the first two positions, the rest spread over the
    vocabulary, so drafts are often cut and q is far from p on the allowed tokens."""

    def __init__(self, law: torch.Tensor) -> None:
        self.law = law

    def reset(self) -> None:
        pass

    def propose(self, request: DraftRequest) -> Proposal:
        tokens = torch.multinomial(self.law, request.k, replacement=True, generator=request.generator)
        return Proposal(tokens, self.law.expand(request.k, -1).clone())

    def commit(self, num_accepted: int) -> None:
        pass


@pytest.mark.parametrize("skew", POWER)
def test_a_cut_draft_is_verified_against_q_renormalized_over_the_grammar(tokenizer, skew):
    """The renormalization matters where q puts much of its mass on allowed tokens but not all:
    verified against the raw q, a position's law is off by (1 - Q)(p - residual): 0.14 and 0.21
    in total variation at the first two positions here, against thresholds of about 0.04 (a low
    temperature makes p peaked enough to show it; scripts/mutate.py: grammar-q-not-renormalized)."""
    target = tiny_llama(seed=2)
    grammar = Grammar.of(regex=SAMPLING_REGEX)
    sampling = SamplingParams(do_sample=True, temperature=0.15, top_p=0.9)
    prompt = PROMPTS[1]
    exact = exact_masked_marginals(target, tokenizer, prompt, POSITIONS, grammar, sampling)
    law = torch.full((VOCAB,), 0.1 / VOCAB)
    law[exact[0].argmax()] += 0.45  # the likeliest first token
    law[exact[1].argmax()] += 0.45  # the likeliest second token (refused first)
    engine = SpeculativeEngine(target, FixedLawDrafter(law), ConstantK(2),
                               spawn=lambda: FixedLawDrafter(law), load_cap=LoadCap(()))
    sampled = sample_runs(engine, prompt, POSITIONS, sampling, runs=runs_for(exact, skew),
                          constraint=constraint(tokenizer, grammar))
    sampled.check_drafting(positions=1)
    assert_follows(sampled, exact, "fixed-law drafter under a grammar", skew)


# -- the API and the built-in model ---------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
EXTRACT = "Extract the person as JSON with name, age and city: Maria Lopez is a 34-year-old architect " \
          "who lives in Valencia."


@pytest.mark.slow  # 22-27 s on the AVX2 EPYC; the README's --json-schema command runs by default
def test_json_schema_on_the_builtin_model(smollm):
    """Every method's output parses and matches the schema, identical to constrained `ar` and to
    masked plain decoding; the schema's keys and punctuation were forced."""
    prompt = verispec.request.encode_prompt(smollm, EXTRACT, chat=True)
    truth = masked_plain(smollm.model, smollm.tokenizer, prompt, 48, Grammar.of(json_schema=SCHEMA))
    for method in ("ar", "pld", "suffix", "eagle"):
        result = verispec.generate(smollm, EXTRACT, chat=True, method=method, json_schema=SCHEMA,
                                   max_new_tokens=48)
        assert result.token_ids == truth, method
        value = json.loads(result.text)
        assert set(value) == {"name", "age", "city"} and isinstance(value["age"], int), value
        assert result.stats.forced_tokens >= 3 and Fate.FORCED in {f for s in result.steps for f in s.fates}


def test_regex_and_lark_through_generate(smollm):
    date = verispec.generate(smollm, "Today's date?", chat=True, regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
                             method="pld", max_new_tokens=16)
    assert len(date.text) == 10 and date.text[4] == "-" and date.text[7] == "-"
    answer = verispec.generate(smollm, "Is water wet?", chat=True, max_new_tokens=8,
                               grammar='start: "yes" | "no"')
    assert answer.text in {"yes", "no"}


def test_bad_constraints_are_refused_before_any_work(smollm):
    with pytest.raises(VerispecError, match="bad regex"):
        verispec.generate(smollm, "x", regex="a(b")
    with pytest.raises(VerispecError, match="not valid JSON"):
        verispec.generate(smollm, "x", json_schema="{not json")
    with pytest.raises(VerispecError, match="JSON schema is a JSON object"):
        verispec.generate(smollm, "x", json_schema="[1, 2]")
    with pytest.raises(VerispecError, match="bad lark"):
        verispec.generate(smollm, "x", grammar="start: undefined_rule")
    with pytest.raises(VerispecError, match="give one constraint"):
        verispec.generate(smollm, "x", regex="a", grammar='start: "a"')
    with pytest.raises(VerispecError, match="one per prompt"):
        verispec.generate(smollm, ["x", "y"], regex=["a"])
    with pytest.raises(VerispecError, match="beam search takes no grammar"):
        verispec.generate(smollm, "x", regex="a", num_beams=2)
    with pytest.raises(VerispecError, match="needs the model's tokenizer"):
        verispec.generate(LoadedModel(smollm.model, None, "no tokenizer"), [1, 2], regex="a")


def test_a_batch_with_a_grammar_per_prompt(smollm):
    results = verispec.generate(smollm, [EXTRACT, "Name a colour."], chat=True, method="pld",
                                json_schema=[SCHEMA, None], max_new_tokens=24)
    assert json.loads(results[0].text)["age"] == 34
    alone = verispec.generate(smollm, "Name a colour.", chat=True, method="pld", max_new_tokens=24)
    assert results[1].token_ids == alone.token_ids


@pytest.mark.slow  # 13 s; the README's and docs/structured.md's commands run these flags
def test_the_command_line_takes_a_schema_file_and_a_regex(tmp_path, capsys):
    from verispec.cli import main

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(SCHEMA))
    assert main(["generate", "--method", "pld", "--prompt", EXTRACT, "--json-schema", str(schema),
                 "--max-new-tokens", "48", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert json.loads(out["text"])["age"] == 34 and out["stats"]["forced_tokens"] >= 3
    assert main(["generate", "--method", "pld", "--prompt", "When did the Berlin wall fall?", "--regex",
                 "The wall fell in [0-9]{4}[.]", "--max-new-tokens", "16", "--color", "always"]) == 0
    shown = capsys.readouterr().out
    assert "\033[35mThe" in shown and "forced by the grammar:" in shown  # painted magenta, counted


def test_the_command_line_refuses_a_schema_file_it_cannot_read(tmp_path, capsys):
    from verispec.cli import main

    schema = tmp_path / "person.json"
    schema.write_text("{not json")
    assert main(["generate", "--prompt", "x", "--json-schema", str(schema)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "cannot read the JSON schema file" in capsys.readouterr().err
