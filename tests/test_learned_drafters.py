"""Trained drafters (EAGLE, EAGLE-3, Medusa, trained early exit): training, loading, target check,
exactness.

Everything runs on a tiny random target the tests build themselves: a few training steps must
lower the loss, every drafter (trained or freshly initialised) must reproduce plain greedy
decoding token for token, and a drafter made for another target must be refused.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny import TINY_RECIPE, VOCAB, assert_resumed_as_one_run, plain_greedy, save_tiny, tiny_llama
from verispec.bench.runner import BenchConfig, run_bench
from verispec.bench.summary import summarize
from verispec.cli import main
from verispec.core.errors import VerispecError
from verispec.core.policies import ConstantK
from verispec.core.stopping import StoppingRules
from verispec.core.tree import TreeSettings
from verispec.core.types import Proposal, SamplingParams
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.base import Drafter, DraftRequest
from verispec.drafters.block import BlockDrafter, BlockNet, block_settings
from verispec.drafters.distilled import distilled_drafter
from verispec.drafters.eagle import EagleDrafter, EagleNet, eagle_settings
from verispec.drafters.eagle3 import Eagle3Drafter, Eagle3Net, eagle3_settings
from verispec.drafters.hybrid import LookupThenModel
from verispec.drafters.learned import Int8Linear, ReducedHead, load_drafter, target_identity
from verispec.drafters.medusa import MedusaDrafter, MedusaNet, medusa_settings
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.drafters.suffix import SuffixDrafter, SuffixSettings
from verispec.drafters.trained_exit import trained_exit_drafter
from verispec.methods import METHODS, build_engine
from verispec.model.cached_model import CachedModel
from verispec.model.kernels import rows
from verispec.model.loading import load_model
from verispec.model.lowbit import Int8Groups
from verispec.options import DraftOptions
from verispec.training import trainer
from verispec.training.data import (
    Sequence,
    build_dataset,
    build_text_dataset,
    is_complete,
    load_dataset,
)
from verispec.training.kinds import block
from verispec.training.recipes import KINDS, RECIPES, recipe_for, train_drafter
from verispec.training.shell import collate
from verispec.training.trainer import TrainConfig

NEW = 40
PROMPTS = [[1, 17, 42, 9, 33, 17, 42, 5], [1, 60, 7]]
OPTIONS = TINY_RECIPE


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(str(save_tiny(tmp_path_factory.mktemp("target"), seed=0)))


@pytest.fixture(scope="module")
def data(tiny_data):
    """The tiny target's data (tests/conftest.py: the same seed-0 weights as `loaded`)."""
    return tiny_data


@pytest.fixture(scope="module")
def trained(tiny_trained):
    """A drafter of every kind, a few steps each (tests/conftest.py: OPTIONS, 4 steps)."""
    return tiny_trained


def test_dataset_holds_answers_and_hidden_states(loaded, data):
    meta, sequences = load_dataset(data)
    assert meta["exit_layer"] == 1 and len(sequences) == 12
    assert meta["dtype"] == "float32"  # the dtype the target ran in when it answered
    s = sequences[0]
    assert s.prompt_len < len(s.tokens) and s.hidden.shape == (len(s.tokens), 32)
    with torch.no_grad():
        out = loaded.model.model(input_ids=s.tokens[None], output_hidden_states=True)
    torch.testing.assert_close(s.hidden.float(), out.last_hidden_state[0], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(s.exit_hidden.float(), out.hidden_states[1][0], atol=1e-2, rtol=1e-2)
    # The answer is the target's own greedy continuation of the prompt. (The prompt holds pad ids,
    # the tiny tokenizer's unknown word, which HF generate() would mask without a mask given.)
    prompt = s.tokens[: s.prompt_len].tolist()
    answer = s.tokens[s.prompt_len:].tolist()
    plain = SpeculativeEngine(loaded.model).generate(SequenceSpec(prompt, StoppingRules.build(len(answer))))
    assert answer == plain.token_ids


def test_answers_from_verispecs_engine_equal_hugging_face_generate(loaded, monkeypatch):
    # The lean path answers through verispec's batched engine; generate() is the reference.
    import verispec.training.data as data_module
    prompts = [[1, 17, 42, 9, 33, 17, 42, 5], [1, 60, 7], [1, 5, 9, 11, 3], [1, 2]]
    assert data_module.lean_supported(loaded.model)
    engine = data_module.answer(loaded, prompts, 24)
    monkeypatch.setattr(data_module, "lean_supported", lambda model: False)
    assert engine == data_module.answer(loaded, prompts, 24)
    assert [s[: len(p)] for s, p in zip(engine, prompts)] == prompts
    assert all(len(s) - len(p) == 24 or s[-1] in loaded.eos_token_ids for s, p in zip(engine, prompts))


def test_a_larger_data_batches_adds_the_missing_shards(loaded, tmp_path):
    out = tmp_path / "data"
    build_dataset(loaded, out, num_prompts=12, max_new_tokens=4, batch_size=4, exit_layer=1,
                  max_batches=1)
    first = (out / "shard-00000.pt").stat().st_mtime_ns
    assert len(load_dataset(out)[1]) == 4
    assert is_complete(out, 1) and is_complete(out) and not is_complete(out, 3)
    build_dataset(loaded, out, num_prompts=12, max_new_tokens=4, batch_size=4, exit_layer=1,
                  max_batches=3)
    assert len(load_dataset(out)[1]) == 12 and is_complete(out, 3)
    assert (out / "shard-00000.pt").stat().st_mtime_ns == first  # kept, not rebuilt


def _fit(recipe, sequences, steps: int = 25) -> tuple[float, float]:
    """The recipe's loss before and after `steps` AdamW steps on all of `sequences`."""
    optimizer = torch.optim.AdamW(recipe.module.parameters(), lr=3e-3)
    with torch.no_grad():
        before = recipe.loss(sequences, 64)[0].item()
    for _ in range(steps):
        optimizer.zero_grad()
        loss = recipe.loss(sequences, 64)[0]
        if loss is not None:  # None: MTP ran its backward head by head itself
            loss.backward()
        optimizer.step()
    with torch.no_grad():
        return before, recipe.loss(sequences, 64)[0].item()


def test_answer_positions_are_those_that_predict_an_answer_token():
    def seq(length: int, prompt_len: int) -> Sequence:
        return Sequence(torch.arange(length), prompt_len, torch.zeros(length, 2), torch.zeros(length, 2))

    # Position i predicts token i + 1: the answer's first prediction comes from the prompt's
    # last position. The second sequence is cut to its last 5 tokens, 2 of them prompt.
    batch = collate([seq(6, 3), seq(8, 5)], max_len=5)
    assert batch.mask.tolist() == [[True] * 5, [True] * 5]
    assert batch.answer.tolist() == [[False, True, True, True, True], [False, True, True, True, True]]
    batch = collate([seq(3, 2), seq(6, 4)], max_len=8)
    assert batch.answer.tolist() == [[False, True, True, False, False, False],
                                     [False, False, False, True, True, True]]


@pytest.mark.parametrize("kind", KINDS)
def test_training_steps_reduce_the_loss(loaded, data, kind):
    meta, sequences = load_dataset(data)
    torch.manual_seed(0)
    recipe = recipe_for(kind, loaded, meta, sequences, OPTIONS)
    before, after = _fit(recipe, sequences)
    assert after < 0.8 * before, f"{kind}: loss {before:.4f} -> {after:.4f}"



@pytest.mark.parametrize("kind", KINDS)
def test_a_training_step_puts_every_tensor_on_the_targets_device(loaded, data, kind):
    """Training on a GPU (`--device cuda`) needs every tensor of a step on the target's device.
    This machine may have no GPU, so the default device is made `meta` for the step: a tensor
    made without naming its device lands there, and meeting the target's CPU tensors it fails
    the step. (Without a device named, a step's `torch.arange` would be a CPU tensor on a GPU.)"""
    meta, sequences = load_dataset(data)
    torch.manual_seed(0)
    recipe = recipe_for(kind, loaded, meta, sequences, OPTIONS)
    assert recipe.device == loaded.model.device
    assert all(p.device == recipe.device for p in recipe.module.parameters())
    with torch.device("meta"):
        loss, metrics = recipe.loss(sequences[:4], 64)
        if loss is not None:  # None: MTP ran its backward head by head itself
            loss.backward()
        if RECIPES[kind].static_tree:
            recipe.rank_accuracy(sequences[:2], 64)
    assert metrics["loss"] > 0 and all(p.grad is not None and p.grad.device == recipe.device
                                       for p in recipe.module.parameters() if p.requires_grad)
    batch = collate(sequences[:2], 64, "meta")  # the batch moves to the device it is asked for
    assert {t.device.type for t in (batch.tokens, batch.hidden, batch.mask, batch.answer)} == {"meta"}
    assert batch.hidden.dtype == torch.float32
    assert collate(sequences[:2], 64, aux=False).aux is None  # kinds that never read them


def test_eagles_loss_is_its_definition_over_the_real_positions(loaded, data):
    """EAGLE's training loss (its rows gathered, the head taken block by block) against the loss
    written out over whole padded tensors: at unrolled step s, position i reads its step s - 1
    prediction (the target's state at s = 0) and the token s + 1 ahead, and is taught the target's
    state s + 1 ahead (smooth L1) and its distribution there (0.1 x forward KL through the reduced
    head), padding left out."""
    meta, sequences = load_dataset(data)
    items = sorted(sequences, key=lambda s: len(s.tokens))[::len(sequences) // 3][:3]
    torch.manual_seed(0)
    recipe = recipe_for("eagle", loaded, meta, sequences, OPTIONS)
    b = collate(items, 64)
    assert not b.mask.all() and recipe.options.unroll >= 2  # padding to leave out, a step to unroll
    loss, metrics = recipe.loss(items, 64)
    mask, actual, features, expected = b.mask[:, 1:], b.hidden[:, 1:], b.hidden[:, :-1], 0.0
    for step in range(recipe.options.unroll):
        width = features.shape[1]
        predicted = recipe.module(recipe.embed[b.tokens[:, step + 1: step + 1 + width]], features,
                                  torch.arange(width))
        real, taught = mask[:, step: step + width], actual[:, step: step + width]
        smooth = torch.nn.functional.smooth_l1_loss(predicted, taught, reduction="none").mean(-1)
        p, q = (taught @ recipe.head_t).softmax(-1), (predicted @ recipe.head_t).softmax(-1)
        kl = (p * (p.log() - q.log())).sum(-1)
        expected = expected + smooth[real].mean() + 0.1 * kl[real].mean()
        same = (q.argmax(-1) == p.argmax(-1))[real].float().mean().item()
        assert metrics[f"top1_step{step + 1}"] == pytest.approx(same)
        features = predicted[:, :-1]
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)

@pytest.mark.parametrize("kind", KINDS)
def test_warm_start_begins_where_the_drafter_left_off(loaded, data, trained, kind):
    meta, sequences = load_dataset(data)
    fresh = recipe_for(kind, loaded, meta, sequences, OPTIONS)
    warm = recipe_for(kind, loaded, meta, sequences, replace(OPTIONS, init=str(trained[kind])))
    _, weights = load_drafter(trained[kind], loaded.model, kind)
    own = {k: v for k, v in weights.items() if k != "vocab_ids"}
    exported = {RECIPES[kind].prefix + k: v.half() for k, v in warm.module.state_dict().items()}
    assert exported.keys() == own.keys()
    for name, value in own.items():  # the trained weights, not a fresh initialisation
        assert torch.equal(exported[name], value), name
    assert any(not torch.equal(v.half(), own[RECIPES[kind].prefix + k])
               for k, v in fresh.module.state_dict().items())


def test_the_registry_and_the_recipes_name_the_same_trained_kinds():
    """Every method's trained kind can be trained, and every trainable kind is some method's."""
    assert {m.trained_kind for m in METHODS.values() if m.trained_kind} == set(KINDS)


def test_each_trainable_kind_lives_in_its_own_module():
    """A kind is one file of verispec.training.kinds (named after it) and one RECIPES entry: its
    module, loss and features come from that file, and no file holds two kinds."""
    homes = {}
    for name, kind in RECIPES.items():
        home = f"verispec.training.kinds.{name.replace('-', '_')}"
        assert kind.name == name
        assert importlib.import_module(home).KIND is kind, name
        functions = [kind.build, kind.loss] + ([kind.head_features] if kind.head_features else [])
        assert {f.__module__ for f in functions} == {home}, name
        homes[home] = name
    assert len(homes) == len(RECIPES)
    files = {p.stem for p in Path(block.__file__).parent.glob("*.py")} - {"__init__"}
    assert {home.rsplit(".", 1)[1] for home in homes} == files  # no kind file left unregistered


def test_warm_start_from_another_kind_or_shape_is_refused(loaded, data, trained):
    meta, sequences = load_dataset(data)
    with pytest.raises(VerispecError, match="holds a 'medusa' drafter, not 'eagle'"):
        recipe_for("eagle", loaded, meta, sequences, replace(OPTIONS, init=str(trained["medusa"])))
    with pytest.raises(VerispecError, match="cannot start this run"):
        recipe_for("medusa", loaded, meta, sequences,
                   replace(OPTIONS, heads=2, init=str(trained["medusa"])))


def test_trained_drafters_are_written_with_their_run(trained):
    for kind, path in trained.items():
        config = json.loads((path / "drafter.json").read_text())
        assert config["kind"] == kind
        if kind in ("medusa", "block"):  # measured on held-out data, for the static tree
            accuracy = torch.tensor(config["rank_accuracy"])
            heads = {"medusa": 3, "block": OPTIONS.block - 1}[kind]  # block: its slots
            assert accuracy.shape == (heads, 8) and accuracy.min() >= 0 and accuracy.sum(1).max() <= 1
        assert config["training"]["sequences"] == 12
        final = config["training"]["final_eval"]  # over every position, and the answers' only
        assert any(name.endswith("_answer") for name in final)
        assert all(0 <= value <= 1 for name, value in final.items() if name.startswith("eval_top1"))
        fit = config["training"]["fit"]  # an evaluation every step: the last third is steps 3 to 4
        assert fit["verdict"] in ("steps", "data", "neither") and (fit["since_step"], fit["step"]) == (3, 4)
        assert fit["held_out"] == final[f"eval_{fit['metric']}"]
        assert (path / "weights.safetensors").is_file()
        assert (path / "run" / "loss.png").is_file() and (path / "run" / "checkpoint.pt").is_file()


def loop_eagle3_net(draft_vocab: int) -> Eagle3Net:
    """An EAGLE-3 net over the tiny target (hidden 32, three aux layers) whose layer runs in
    rows.cpp's layer loop: heads of 16 values, two query heads on one key/value head, its own
    rotary base; random weights."""
    torch.manual_seed(4)
    net = Eagle3Net(hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=64, eps=1e-5,
                    rope_theta=50000.0, aux_layers=[0, 1, 2], draft_vocab=draft_vocab)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return net


def _drafters(loaded, trained):
    model = loaded.model
    torch.manual_seed(3)
    # Some tokens can never be drafted; 48 ids, a multiple of 16: the head runs in 8 bits on CPU.
    vocab_ids = torch.arange(3, VOCAB - 13)
    random_eagle = EagleNet(**eagle_settings(model))
    for p in random_eagle.parameters():
        torch.nn.init.normal_(p, std=0.3)
    mid_eagle = EagleNet(**eagle_settings(model), mid_layer=1)  # also reads layer 1's state
    for p in mid_eagle.parameters():
        torch.nn.init.normal_(p, std=0.3)
    loop_eagle = EagleNet(hidden=32, heads=2, intermediate=64)  # heads of 16: rows.cpp's layer loop
    for p in loop_eagle.parameters():
        torch.nn.init.normal_(p, std=0.3)
    loop_eagle3 = loop_eagle3_net(len(vocab_ids))
    random_medusa = MedusaNet(**medusa_settings(model, 3))
    torch.nn.init.normal_(random_medusa.weight, std=0.3)
    random_eagle3 = Eagle3Net(**eagle3_settings(model, None, len(vocab_ids)))
    for p in random_eagle3.parameters():
        torch.nn.init.normal_(p, std=0.3)
    random_block = BlockNet(**block_settings(model, (1,), layers=2, block=5))  # final + layer 1
    for p in random_block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return {
        "block": BlockDrafter.load(trained["block"], model),
        "block-tree": BlockDrafter.load(trained["block"], model, TreeSettings(3, 10)),
        "random-block": BlockDrafter(model, random_block, ReducedHead(model, vocab_ids)),
        "random-block-tree": BlockDrafter(model, random_block, ReducedHead(model, vocab_ids),
                                          TreeSettings(3, 12), [[0.5, 0.3, 0.1, 0.1]] * 4),
        "random-block-pld": LookupThenModel(
            PromptLookupDrafter(2, 1), BlockDrafter(model, random_block, ReducedHead(model, vocab_ids)), 3),
        "eagle3": Eagle3Drafter.load(trained["eagle3"], model),
        "eagle3-tree": Eagle3Drafter.load(trained["eagle3"], model, tree=TreeSettings(3, 10)),
        "random-eagle3": Eagle3Drafter(model, random_eagle3, vocab_ids),
        "random-eagle3-tree": Eagle3Drafter(model, random_eagle3, vocab_ids, tree=TreeSettings(4, 12)),
        "eagle": EagleDrafter.load(trained["eagle"], model),
        "medusa": MedusaDrafter.load(trained["medusa"], model),
        "early-exit": trained_exit_drafter(trained["early-exit"], model, VOCAB),
        "draft": distilled_drafter(trained["draft"], model, VOCAB),
        "random-eagle": EagleDrafter(model, random_eagle, ReducedHead(model, vocab_ids)),
        "random-medusa": MedusaDrafter(model, random_medusa, ReducedHead(model, vocab_ids)),
        "eagle-tree": EagleDrafter.load(trained["eagle"], model, tree=TreeSettings(3, 10)),
        "medusa-tree": MedusaDrafter.load(trained["medusa"], model, TreeSettings(3, 8)),
        "random-eagle-tree": EagleDrafter(model, random_eagle, ReducedHead(model, vocab_ids),
                                          tree=TreeSettings(4, 12)),
        "random-medusa-tree": MedusaDrafter(model, random_medusa, ReducedHead(model, vocab_ids),
                                            TreeSettings(4, 12), [[0.5, 0.3, 0.1, 0.1]] * 3),
        "eagle-pld": LookupThenModel(PromptLookupDrafter(3, 1), EagleDrafter.load(trained["eagle"], model),
                                     3),
        "eagle-suffix": LookupThenModel(SuffixDrafter(SuffixSettings()),
                                        EagleDrafter.load(trained["eagle"], model), 1),
        "random-eagle-pld": LookupThenModel(
            PromptLookupDrafter(2, 1), EagleDrafter(model, random_eagle, ReducedHead(model, vocab_ids)), 2),
        "mid-eagle": EagleDrafter(model, mid_eagle, ReducedHead(model, vocab_ids)),
        "loop-eagle": EagleDrafter(model, loop_eagle, ReducedHead(model, vocab_ids)),
        "loop-eagle-tree": EagleDrafter(model, loop_eagle, ReducedHead(model, vocab_ids),
                                        tree=TreeSettings(3, 10)),
        "loop-eagle3": Eagle3Drafter(model, loop_eagle3, vocab_ids),
        "loop-eagle3-tree": Eagle3Drafter(model, loop_eagle3, vocab_ids, tree=TreeSettings(3, 10)),
        "mid-eagle-tree": EagleDrafter(model, mid_eagle, ReducedHead(model, vocab_ids),
                                       tree=TreeSettings(3, 10)),
        "mid-eagle-pld": LookupThenModel(
            PromptLookupDrafter(2, 1), EagleDrafter(model, mid_eagle, ReducedHead(model, vocab_ids)), 2),
    }


# k = 3 in the default suite; the others under slow (.ci/run runs them), to keep the default suite
# under ten minutes (k = 16 took 31 s and k = 1 14 s on the AVX2 EPYC, 2026-11-30).
@pytest.mark.parametrize("k", [3, *(pytest.param(k, marks=pytest.mark.slow) for k in (1, 2, 5, 8, 12, 16))])
def test_learned_drafters_match_plain_decoding(loaded, trained, k):
    for prompt in PROMPTS:
        truth = plain_greedy(loaded.model, prompt, NEW)
        for name, drafter in _drafters(loaded, trained).items():
            engine = SpeculativeEngine(loaded.model, drafter, ConstantK(k))
            result = engine.generate(SequenceSpec(prompt, StoppingRules.build(NEW)))
            assert result.token_ids == truth, f"{name} with k={k} diverged from plain decoding"


def test_hybrid_takes_the_lookup_draft_when_there_is_one():
    class Spy(Drafter):
        needs_hidden = True

        def __init__(self):
            self.asked, self.committed = [], []

        def reset(self):
            pass

        def propose(self, request):
            self.asked.append(request.k)
            return Proposal(torch.tensor([7, 7]))

        def commit(self, num_accepted):
            self.committed.append(num_accepted)

    model = Spy()
    hybrid = LookupThenModel(PromptLookupDrafter(3, 2), model, model_k=2)
    assert hybrid.needs_hidden

    def request(tokens, k):
        return DraftRequest(torch.tensor(tokens), k, SamplingParams(), None)

    # "4 5" occurred before: the lookup copies what followed it, up to k tokens.
    assert hybrid.propose(request([1, 4, 5, 6, 8, 9, 4, 5], 3)).tokens.tolist() == [6, 8, 9]
    hybrid.commit(2)
    assert model.asked == [] and model.committed == []  # the model sat this step out
    # Nothing repeats: the model drafts, at most model_k tokens, and hears the verdict.
    assert hybrid.propose(request([1, 2, 3, 4], 5)).tokens.tolist() == [7, 7]
    hybrid.commit(1)
    assert model.asked == [2] and model.committed == [1]


@pytest.mark.parametrize("layers", [(), (1,)])
def test_engine_hands_drafters_the_targets_hidden_states(loaded, layers):
    seen: list[DraftRequest] = []

    class Recorder(Drafter):
        needs_hidden = True
        hidden_layers = layers

        def reset(self):
            pass

        def propose(self, request):
            seen.append(request)
            return Proposal(request.tokens[-2:])  # often wrong: exercises rejections

        def commit(self, num_accepted):
            pass

    engine = SpeculativeEngine(loaded.model, Recorder(), ConstantK(2))
    engine.generate(SequenceSpec(PROMPTS[0], StoppingRules.build(20)))
    assert len(seen) > 3
    for request in seen:
        with torch.no_grad():
            out = loaded.model.model(input_ids=request.tokens[None], output_hidden_states=True)
        # the final (normed) state, then the residual state after each of the layers asked for
        full = torch.cat([out.last_hidden_state[0], *(out.hidden_states[i][0] for i in layers)], -1)
        assert request.target_hidden.shape == (len(request.tokens) - 1, 32 * (1 + len(layers)))
        torch.testing.assert_close(request.target_hidden, full[:-1], atol=1e-4, rtol=1e-4)


def test_intermediate_states_agree_between_the_lean_and_the_models_own_forward(loaded):
    tokens = torch.tensor(PROMPTS[0])
    lean, own = CachedModel(loaded.model), CachedModel(loaded.model, pack=False)
    assert lean.lean is not None and own.lean is None
    for model in (lean, own):  # a prompt, then a block after it
        model.prefill(tokens[:5], (1,))
    logits_lean, hidden_lean = lean.forward_hidden(tokens[5:], None, (1,))
    logits_own, hidden_own = own.forward_hidden(tokens[5:], None, (1,))
    assert hidden_lean.shape == hidden_own.shape == (3, 64)
    torch.testing.assert_close(hidden_lean, hidden_own, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits_lean, logits_own, atol=1e-4, rtol=1e-4)


def test_sampled_drafts_report_their_q(loaded, trained):
    sampling = SamplingParams(do_sample=True, temperature=0.8)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.tensor(PROMPTS[0])
    with torch.no_grad():
        out = loaded.model.model(input_ids=tokens[None], output_hidden_states=True)
    hidden = out.last_hidden_state[0, :-1]
    for name, drafter in _drafters(loaded, trained).items():
        if name in ("early-exit", "draft"):
            continue
        drafter.reset()
        # the final state, then those after the layers the drafter reads (mid-eagle: 1; eagle3: 0-2)
        layers = getattr(drafter, "hidden_layers", ())
        states = torch.cat([hidden, *(out.hidden_states[i][0, :-1] for i in layers)], -1)
        proposal = drafter.propose(DraftRequest(tokens, 3, sampling, generator, states))
        q = proposal.draft_probs
        if name.endswith("-tree"):  # trees are chosen by rank: deterministic, q one-hot
            assert q is None and proposal.parents is not None
            continue
        assert q is not None and q.shape == (len(proposal), VOCAB)
        torch.testing.assert_close(q.sum(-1), torch.ones(len(proposal)))
        assert (q.gather(-1, proposal.tokens[:, None]) > 0).all(), f"{name}: drafted a q=0 token"
    outside = torch.cat([torch.arange(3), torch.arange(VOCAB - 5, VOCAB)])
    assert (_drafters(loaded, trained)["random-eagle"].propose(
        DraftRequest(tokens, 3, sampling, generator, hidden)).draft_probs[:, outside] == 0).all()


def test_seeded_sampling_repeats_exactly(loaded, trained):
    engine = build_engine(loaded, "eagle", DraftOptions(k=4, draft=str(trained["eagle"])))
    sampling = SamplingParams(do_sample=True, temperature=1.0)
    runs = [engine.generate(SequenceSpec(PROMPTS[0], StoppingRules.build(NEW), sampling, seed=5)).token_ids
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_drafter_for_another_target_is_refused(trained):
    other = tiny_llama(seed=1)
    for path in trained.values():
        with pytest.raises(VerispecError, match="trained for another target"):
            load_drafter(path, other)


def test_wrong_kind_and_missing_drafter_are_clear_errors(loaded, trained, tmp_path):
    with pytest.raises(VerispecError, match="holds a 'medusa' drafter, not 'eagle'"):
        EagleDrafter.load(trained["medusa"], loaded.model)
    with pytest.raises(VerispecError, match="not a trained verispec drafter"):
        EagleDrafter.load(tmp_path, loaded.model)
    with pytest.raises(VerispecError, match="no trained eagle drafter ships"):
        build_engine(loaded, "eagle")


def test_cli_trains_and_generates_with_the_result(loaded, data, tmp_path, capsys):
    target = str(loaded.name)
    out = tmp_path / "medusa"
    code = main(["train", "medusa", "--target", target, "--out", str(out), "--data", str(data),
                 "--steps", "2", "--heads", "2", "--exit-layer", "1", "--vocab", "40"])
    assert code == 0 and (out / "drafter.json").is_file()
    capsys.readouterr()
    code = main(["generate", "--model", target, "--prompt", "w7 w9", "--raw", "--method", "medusa",
                 "--draft", str(out), "--max-new-tokens", "12", "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["stats"]["new_tokens"] == 12


def test_cli_trains_a_drafter_in_parts_with_stop_at(loaded, data, tmp_path, capsys):
    """--stop-at exports a usable drafter at a step of the --steps schedule, evaluated there; the
    command run again resumes from its checkpoint and ends on the schedule one run ends on."""
    base = ["train", "eagle", "--target", str(loaded.name), "--data", str(data), "--steps", "4",
            "--exit-layer", "1", "--vocab", "40"]
    assert main([*base, "--out", str(tmp_path / "a"), "--stop-at", "2"]) == 0
    part = json.loads((tmp_path / "a" / "drafter.json").read_text())["training"]
    assert part["step"] == 2 and part["final_eval"]["eval_loss"] > 0  # evaluated where it stopped
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    assert main([*base, "--out", str(tmp_path / "b")]) == 0
    assert_resumed_as_one_run(tmp_path / "a" / "run", tmp_path / "b" / "run", 4)
    assert json.loads((tmp_path / "a" / "drafter.json").read_text())["training"]["step"] == 4
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "a"), "--stop-at", "3"]) == 2  # past it already
    assert "past 3" in capsys.readouterr().err
    assert main([*base, "--out", str(tmp_path / "c"), "--stop-at", "5"]) == 2
    assert "--stop-at must lie in 1..--steps (4)" in capsys.readouterr().err

def test_cli_says_whether_more_steps_or_more_data_would_help(loaded, data, tmp_path, capsys, monkeypatch):
    """With three evaluations or more, `verispec train` ends on the run's fit: the line
    describe_fit makes of drafter.json's training.fit (here an evaluation every step)."""
    @dataclass(frozen=True)
    class EveryStep(trainer.TrainConfig):
        eval_every: int = 1

    monkeypatch.setattr(trainer, "TrainConfig", EveryStep)
    assert main(["train", "eagle", "--target", str(loaded.name), "--data", str(data), "--steps", "4",
                 "--exit-layer", "1", "--vocab", "40", "--out", str(tmp_path / "a")]) == 0
    report = json.loads((tmp_path / "a" / "drafter.json").read_text())["training"]["fit"]
    assert (report["since_step"], report["step"]) == (3, 4)
    assert f"verispec: {trainer.describe_fit(report)}" in capsys.readouterr().err


def test_mid_state_eagle_starts_as_the_drafter_it_widens_then_learns(loaded, data, trained):
    meta, sequences = load_dataset(data)
    plain = recipe_for("eagle", loaded, meta, sequences, replace(OPTIONS, init=str(trained["eagle"])))
    torch.manual_seed(0)
    widened = recipe_for("eagle", loaded, meta, sequences,
                     replace(OPTIONS, init=str(trained["eagle"]), mid_state=True))
    assert widened.settings["mid_layer"] == meta["exit_layer"] == 1
    with torch.no_grad():  # the mid-layer input starts with zero weight: the same losses
        assert widened.loss(sequences, 64)[0].item() == pytest.approx(plain.loss(sequences, 64)[0].item(),
                                                                       rel=1e-5)
    before, after = _fit(widened, sequences)
    assert after < 0.8 * before
    assert widened.module.fuse.weight[:, 64:].abs().max() > 0  # the mid-layer input is used


def test_cli_trains_a_mid_state_eagle_that_decodes_exactly(loaded, data, trained, tmp_path, capsys):
    out = tmp_path / "mid"
    code = main(["train", "eagle", "--target", str(loaded.name), "--out", str(out), "--data", str(data),
                 "--steps", "2", "--exit-layer", "1", "--vocab", "48", "--mid-state",
                 "--init", str(trained["eagle"])])
    assert code == 0
    assert json.loads((out / "drafter.json").read_text())["settings"]["mid_layer"] == 1
    drafter = EagleDrafter.load(out, loaded.model)
    assert drafter.hidden_layers == (1,)
    tokens = torch.tensor(PROMPTS[0])
    with pytest.raises(VerispecError, match="reads the target's final state and its state after"):
        drafter.propose(DraftRequest(tokens, 2, SamplingParams(), None, torch.zeros(len(tokens) - 1, 32)))
    for method in ("eagle", "eagle-pld"):
        engine = build_engine(loaded, method, DraftOptions(k=3, draft=str(out)))
        for prompt in PROMPTS:
            result = engine.generate(SequenceSpec(prompt, StoppingRules.build(NEW)))
            assert result.token_ids == plain_greedy(loaded.model, prompt, NEW), method
    capsys.readouterr()
    assert main(["train", "medusa", "--target", str(loaded.name), "--out", str(tmp_path / "m"),
                 "--data", str(data), "--steps", "2", "--mid-state"]) == 2
    assert "--mid-state: not an option of the medusa drafter (its own: --heads)" in capsys.readouterr().err


def test_cli_continues_a_drafter_and_records_how(loaded, data, trained, tmp_path, capsys):
    out = tmp_path / "continued"
    code = main(["train", "medusa", "--target", str(loaded.name), "--out", str(out), "--data", str(data),
                 "--steps", "2", "--heads", "3", "--exit-layer", "1", "--vocab", "48",
                 "--init", str(trained["medusa"]), "--bf16", "off"])
    assert code == 0
    recorded = json.loads((out / "drafter.json").read_text())["training"]
    assert recorded["options"]["init"] == str(trained["medusa"])
    assert recorded["config"]["bf16"] is False
    assert main(["train", "eagle", "--target", str(loaded.name), "--out", str(tmp_path / "bad"),
                 "--data", str(data), "--steps", "2", "--init", str(trained["medusa"])]) == 2
    assert "holds a 'medusa' drafter, not 'eagle'" in capsys.readouterr().err


def _corpus(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_text_corpus_gives_the_targets_states_over_each_passage(loaded, tmp_path):
    words = " ".join(f"w{5 + i % 50}" for i in range(90))  # 90 tokens: chunks of 40, 40, 10
    corpus = _corpus(tmp_path / "c.jsonl", [json.dumps({"title": "w8", "text": words}),
                                            json.dumps({"text": "w6 w7 " * 20})])
    out = build_text_dataset(loaded, corpus, tmp_path / "text", chunk_tokens=40, batch_size=2,
                             exit_layer=1)
    meta, sequences = load_dataset(out)
    assert meta["corpus"] == "c.jsonl" and len(meta["corpus_sha256"]) == 16
    # 40 + 40 from the first document (its last 10 tokens are too short a passage), 40 from the second
    assert sorted(len(s.tokens) - s.prompt_len for s in sequences) == [40, 40, 40]
    tok = loaded.tokenizer
    passages = {tok.decode(s.tokens[s.prompt_len:]) for s in sequences}
    assert " ".join(words.split()[:40]) in passages and " ".join(("w6 w7 " * 20).split()) in passages
    s = sequences[0]
    with torch.no_grad():
        states = loaded.model.model(input_ids=s.tokens[None], output_hidden_states=True)
    torch.testing.assert_close(s.hidden.float(), states.last_hidden_state[0], atol=1e-2, rtol=1e-2)
    # The same directory with another corpus is refused, not mixed.
    other = _corpus(tmp_path / "c.jsonl", [json.dumps({"text": "w9 " * 50})])
    with pytest.raises(VerispecError, match="other settings"):
        build_text_dataset(loaded, other, out, chunk_tokens=40, exit_layer=1)


def test_data_at_another_exit_layer_is_not_mixed_in(loaded, data, tmp_path):
    corpus = _corpus(tmp_path / "c.txt", ["w5 w6 w7 " * 20])
    layer2 = build_text_dataset(loaded, corpus, tmp_path / "text", chunk_tokens=40, exit_layer=2)
    with pytest.raises(VerispecError, match="holds layer 2 states"):
        train_drafter("eagle", loaded, [data, layer2], tmp_path / "out", TrainConfig(steps=1), OPTIONS)


def test_cli_trains_on_self_distillation_and_a_corpus(loaded, data, tmp_path, capsys):
    corpus = _corpus(tmp_path / "corpus.txt", ["w5 w6 w7 w8 " * 12, "w9 w10 w11 " * 15])
    out = tmp_path / "eagle"
    code = main(["train", "eagle", "--target", str(loaded.name), "--out", str(out), "--data", str(data),
                 "--text", str(corpus), "--steps", "2", "--exit-layer", "1", "--vocab", "40"])
    assert code == 0
    recorded = json.loads((out / "drafter.json").read_text())["training"]
    assert [m.get("corpus") for m in recorded["data"]["sources"]] == [None, "corpus.txt"]
    assert recorded["sequences"] == 12 + 2  # the 12 answers and one passage per line
    assert main(["train", "eagle", "--target", str(loaded.name), "--out", str(tmp_path / "x"),
                 "--data", str(data), "--text-data", str(tmp_path / "t")]) == 2
    assert "give --text too" in capsys.readouterr().err
    bad = _corpus(tmp_path / "bad.jsonl", ['{"text": "w5 w6"}', "", "not json"])
    assert main(["train", "eagle", "--target", str(loaded.name), "--out", str(tmp_path / "y"),
                 "--data", str(tmp_path / "unbuilt"), "--text", str(bad)]) == 2
    assert "bad.jsonl:3 is not JSON" in capsys.readouterr().err  # the file's own line number
    empty = _corpus(tmp_path / "empty.txt", ["", "  "])
    assert main(["train", "eagle", "--target", str(loaded.name), "--out", str(tmp_path / "y"),
                 "--data", str(tmp_path / "unbuilt"), "--text", str(empty)]) == 2
    assert "empty.txt holds no documents" in capsys.readouterr().err
    assert not (tmp_path / "unbuilt").exists() and not (tmp_path / "y").exists()  # checked first


def test_cli_train_rejects_bad_settings(tmp_path, capsys):
    assert main(["train", "eagle", "--out", str(tmp_path / "x"), "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err


@pytest.mark.slow  # 25 s on the AVX2 EPYC
def test_bench_runs_trained_drafters_by_default(loaded, trained, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["w9 w8 w7"]}) + "\n")
    config = BenchConfig(model=loaded.name, out=tmp_path / "bench", questions=questions,
                         max_new_tokens=10, warmup=0, exit_layer=1,
                         trained=[str(trained[k]) for k in ("eagle", "medusa", "draft")])
    summaries = {s.label: s for s in summarize(run_bench(config, progress=False).runs)}
    for label in ("eagle", "medusa", "early-exit", "draft", "eagle-pld", "eagle-suffix"):
        assert summaries[label].overall.identical == "1/1", label
    with pytest.raises(VerispecError, match="not a trained verispec drafter"):
        run_bench(BenchConfig(model=loaded.name, out=tmp_path / "x", trained=[str(tmp_path)]))


def test_target_identity_survives_a_bfloat16_load():
    float32 = tiny_llama(seed=0)
    bf16 = tiny_llama(seed=0).to(torch.bfloat16)
    assert target_identity(float32) == target_identity(bf16)
    assert target_identity(float32) != target_identity(tiny_llama(seed=1))


def test_trained_exit_at_another_layer_is_refused(loaded, trained):
    with pytest.raises(VerispecError, match="is at layer 1, not 2"):
        build_engine(loaded, "early-exit", DraftOptions(draft=str(trained["early-exit"]), exit_layer=2))
    engine = build_engine(loaded, "early-exit", DraftOptions(draft=str(trained["early-exit"])))
    assert engine.drafter.exit_layer == 1


def shared_part(drafter: Drafter):
    """What a drafter reads its weights through: a trained network, or a model (a view of the
    target)."""
    return drafter.net if hasattr(drafter, "net") else drafter.lm.model


@pytest.mark.parametrize("kind", ["early-exit", "draft", "eagle", "medusa"])
def test_drafters_built_per_request_share_what_they_read(loaded, trained, tmp_path, kind):
    """A drafter per request (the server, each generate call) reuses the network read from its
    files, or the view of the target's first layers, and the weights prepared on it (0.4-0.5 s a
    drafter on the built-in model for early-exit and draft when each made its own); drafter files
    written again are read again."""
    def built(options: DraftOptions) -> Drafter:
        return build_engine(loaded, kind, options).drafter

    copy = tmp_path / kind
    shutil.copytree(trained[kind], copy)
    first = built(DraftOptions(draft=str(copy)))
    assert shared_part(first) is shared_part(built(DraftOptions(draft=str(copy))))
    weights = load_file(copy / "weights.safetensors")
    save_file({name: value * 2 if value.is_floating_point() else value for name, value in weights.items()},
              copy / "weights.safetensors")
    again = built(DraftOptions(draft=str(copy)))
    assert shared_part(again) is not shared_part(first)
    old, new = (dict(shared_part(d).named_parameters()) for d in (first, again))
    doubled = [name for name in old
               if torch.equal(new[name], 2 * old[name]) and not torch.equal(new[name], old[name])]
    assert doubled, "the files' new weights were not read"
    if kind == "early-exit":  # the plain exit's view: one per depth
        plain = built(DraftOptions(exit_layer=1))
        assert shared_part(plain) is shared_part(built(DraftOptions(exit_layer=1))) is not shared_part(first)
        assert shared_part(built(DraftOptions(exit_layer=2))) is not shared_part(plain)


def test_drafter_layer_cache_feeds_incrementally_as_one_pass():
    """EAGLE's layer with its KV cache: chunks, a rewind and growth past the first 256 slots give
    what one causal pass over the whole sequence gives."""
    from verispec.drafters.nn import DecoderLayer
    from verispec.model.kv_cache import KVCache

    torch.manual_seed(0)
    layer = DecoderLayer(32, 4, 64).eval()
    x = torch.randn(1, 300, 32)
    with torch.inference_mode():
        expected = layer(x, torch.arange(300))
        cache = KVCache()
        first = layer(x[:, :200], torch.arange(200), cache)
        layer(torch.randn(1, 5, 32), torch.arange(200, 205), cache)  # a draft, then rejected
        cache.rewind(200)
        rest = layer(x[:, 200:], torch.arange(200, 300), cache)
    assert cache.length == 300
    torch.testing.assert_close(torch.cat([first, rest], dim=1), expected, rtol=1e-5, atol=1e-5)


def test_block_drafter_drafts_with_the_slots_training_scores(loaded, data, trained, full_precision_drafting):
    """What BlockDrafter drafts from (the context's keys and values cached step by step, the
    block's dropped after each pass, fewer slots than trained) is what training scores: the
    recipe's one-pass outputs for a block at the same newest token, slot by slot."""
    meta, sequences = load_dataset(data)
    recipe = recipe_for("block", loaded, meta, sequences, replace(OPTIONS, init=str(trained["block"])))
    recipe.module.eval()
    drafter = BlockDrafter.load(trained["block"], loaded.model)
    assert drafter.hidden_layers == tuple(meta["aux_layers"]) == (0, 1, 2)
    s = max(sequences, key=lambda s: len(s.tokens))
    states = torch.cat([s.hidden, s.aux_hidden], -1).float()  # [T, 32 * 4]: as the engine hands them
    batch = collate([s], 64)
    with torch.no_grad():
        for n, k in ((3, 7), (4, 2), (9, 5), (len(s.tokens) - 1, 7)):  # grows, then jumps ahead
            request = DraftRequest(s.tokens[: n + 1], k, SamplingParams(), None, states[:n])
            drafted = drafter._features(request, k)  # [k, hidden]
            scored = block.block_outputs(recipe, batch, torch.tensor([[n]]))[0, 0, 1: 1 + k]
            torch.testing.assert_close(drafted, scored, atol=1e-4, rtol=1e-4)


def test_reduced_head_scores_its_tokens_as_the_targets_head_does():
    # Drafting runs the head prepacked on CPU; its logits must be the target's own for those ids.
    model = tiny_llama(seed=3)
    vocab_ids = torch.tensor([0, 3, 7, 11, 40])
    head = ReducedHead(model, vocab_ids)
    assert head.packed is not None  # float32 on CPU: the packed path is the one drafting uses
    hidden = torch.randn(4, model.config.hidden_size)  # [rows, hidden]: Medusa's heads, a tree level
    with torch.inference_mode():
        expected = model.get_output_embeddings()(hidden)[:, vocab_ids]
        torch.testing.assert_close(head.logits(hidden), expected)
        torch.testing.assert_close(head.logits(hidden[0]), expected[0])


@pytest.mark.skipif(not rows.available(), reason=f"row kernels: {rows.unavailable_reason()}")
def test_drafters_draft_in_8_bits_where_the_row_kernels_run(loaded):
    """On CPU a drafter's linear layers and reduced head multiply by their weights in 8-bit groups
    of 32 (a drafter's arithmetic decides what is drafted, never what is kept): each product is
    its input rounded to bfloat16 times the dequantized weight, computed here apart."""
    model = loaded.model
    torch.manual_seed(0)
    net = EagleNet(**eagle_settings(model))
    drafter = EagleDrafter(model, net, ReducedHead(model, torch.arange(48)))
    products = [m for m in drafter.net.modules() if isinstance(m, Int8Linear)]
    assert len(products) == 5  # fuse, qkv, out, gate_up, down
    assert not [m for m in drafter.net.modules() if isinstance(m, torch.nn.Linear)]
    assert isinstance(net.layer.qkv, torch.nn.Linear)  # the network training updates is untouched
    head = model.get_output_embeddings().weight[:48]
    cases = [(m.weight, m.bias, m) for m in products] + [(head, None, drafter.head.logits)]
    for weight, bias, product in cases:
        x = torch.randn(3, weight.shape[1])  # [rows, in]
        expected = torch.nn.functional.linear(x.to(torch.bfloat16).float(),
                                              Int8Groups.quantize(weight, 32).dequantize(), bias)
        with torch.inference_mode():
            torch.testing.assert_close(product(x), expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(product(x[1]), expected[1], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not rows.available(), reason=f"row kernels: {rows.unavailable_reason()}")
@pytest.mark.parametrize("kind", ["eagle", "mid-eagle", "eagle3"])
def test_eagles_layer_runs_in_the_row_kernels_layer_loop(loaded, kind):
    """With 8-bit products and heads of a multiple of 16 values, an EAGLE or EAGLE-3 decoder layer
    drafts through rows.cpp's layer loop (one call a pass): the features its Python layer
    computes, for a block, chain steps from predicted features, a tree level and a rewind.
    EAGLE-3's layer reads its normed embedding and feature side by side (with grouped key/value
    heads and its own rotary base), its residual the feature."""
    torch.manual_seed(5)
    if kind == "eagle3":
        net = loop_eagle3_net(48)
        make = lambda: Eagle3Drafter(loaded.model, net, torch.arange(48))  # noqa: E731
    else:
        net = EagleNet(hidden=32, heads=2, intermediate=64, mid_layer=1 if kind == "mid-eagle" else None)
        for p in net.parameters():
            torch.nn.init.normal_(p, std=0.3)
        make = lambda: EagleDrafter(loaded.model, net, ReducedHead(loaded.model, torch.arange(48)))  # noqa: E731
    loop, python = make(), make()
    assert loop.native is not None
    python.native = None
    calls = []
    stack = loop.native.stack
    loop.native = replace(loop.native, stack=type("Counted", (), {
        "run": lambda self, *a: calls.append(1) or stack.run(*a)})())
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, VOCAB, (30,), generator=generator)
    width = 32 * len(loop.hidden_layers) if kind == "eagle3" else 32 * (1 + len(loop.hidden_layers))
    states = torch.randn(30, width, generator=generator)  # [n, width]
    if kind == "eagle3":  # the final state, which EAGLE-3 does not read, then the aux states
        states = torch.cat([torch.zeros(30, 32), states], -1)

    def both(run):
        outs = [run(d) for d in (loop, python)]
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
        return outs[1]

    with torch.inference_mode():
        feature = both(lambda d: d._run(tokens[1:21], states[:20], torch.arange(20)))[-1]
        for step in range(3):
            feature = both(lambda d, step=step, feature=feature: d._net(
                tokens[20 + step].view(1), feature.view(1, -1), torch.tensor([20 + step])))[-1]
        past = loop.cache.length
        mask = torch.zeros(2, past + 2, dtype=torch.bool)  # two nodes under the last one
        mask[:, :20], mask[:, past - 1] = True, True
        mask[0, past], mask[1, past + 1] = True, True
        both(lambda d: d._net(tokens[:2], torch.stack([feature, feature]), torch.tensor([past, past]), mask))
        for d in (loop, python):
            d.cache.rewind(20)
        both(lambda d: d._run(tokens[21:26], states[20:25], torch.arange(20, 25)))
    assert len(calls) == 6


def test_learned_drafters_batch_with_each_rows_own_hidden_states(loaded, trained):
    """In a batch every row's EAGLE / Medusa / Hydra / MTP drafter reads its own sequence's target
    states (the mid-state ones a layer's too, while other rows read none): each row is its prompt
    alone."""
    prompts = [*PROMPTS, [1, 33, 34, 35, 36], [1, 9]]
    rules = [StoppingRules.build(n) for n in (NEW, 17, 29, 8)]
    truth = [plain_greedy(loaded.model, p, r.max_new_tokens) for p, r in zip(prompts, rules)]
    for name in ("eagle", "eagle3", "medusa-tree", "mid-eagle", "random-eagle-pld", "eagle3-tree",
                 "block", "random-block-tree"):
        def make(name=name):
            return _drafters(loaded, trained)[name]
        engine = SpeculativeEngine(loaded.model, make(), ConstantK(3), spawn=make)
        assert [r.token_ids for r in engine.generate_batch(SequenceSpec.batch(prompts, rules))] == truth, name
    engine = build_engine(loaded, "ar")
    for methods in (("eagle", "medusa", "eagle3"), ("hydra", "mtp", "block")):
        ways = [build_engine(loaded, m, DraftOptions(k=3, draft=trained[m])).speculation
                for m in methods] + [None]
        ids = [engine.add(SequenceSpec(p, r), speculation=w)[0] for p, r, w in zip(prompts, rules, ways)]
        got = {i: [] for i in ids}
        while engine.active:
            for row_id, step in engine.step():
                got[row_id] += step.tokens
        assert [got[i] for i in ids] == truth, methods


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.slow  # 18 s; the default suite keeps tests/test_greedy_equality.py's many calls
def test_no_method_leaks_across_200_generations(loaded, trained):
    """Issue 19's comparison set: after warm-up, 200 more generations with each method (greedy and
    sampled, engine reused as a server would) grow the resident set by less than 8 MiB."""
    engines = [build_engine(loaded, m, DraftOptions(draft=trained[m]))
               for m in ("medusa", "hydra", "mtp", "eagle", "block")] + [build_engine(loaded, "lookahead")]
    prompts = [PROMPTS[i % 2] for i in range(200)]

    def calls(count: int) -> None:
        for engine in engines:
            for i, prompt in enumerate(prompts[:count]):
                engine.generate(
                    SequenceSpec(prompt, StoppingRules.build(12), SamplingParams(do_sample=bool(i % 2)),
                                 seed=i))

    calls(20)
    before = _rss_mib()
    calls(200)
    assert _rss_mib() - before < 8
