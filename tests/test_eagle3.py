"""EAGLE-3: the exported directories are what vLLM and SGLang load, and they compute what
verispec's drafter computes; speculative sampling with it emits the target's distribution.

`engine_draft_logits` below is written from the engines' published EAGLE-3 structure (vLLM's
and SGLang's llama_eagle3 models: fc over the three aux states, layer 0 whose attention reads
[input_layernorm(embedding) ; hidden_norm(feature)] with the un-normed feature as residual,
the final norm read both for logits and, before it, as the next feature; draft id j -> target
id j + d2t[j]). It reads only the exported config.json and model.safetensors, and shares no code
with verispec.drafters.eagle3: explicit softmax attention, rotate-half rotary embeddings,
repeat-interleaved key/value heads. `vllm_load` and `sglang_load` replay each engine's
weight-loading rules (names, stacking, what raises, what is skipped) on the exported keys.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distribution import POWER, assert_follows, exact_marginals, runs_for, sample_runs
from tests.tiny import save_tiny, tiny_llama, tiny_tokenizer
from verispec.cli import main
from verispec.core.errors import VerispecError
from verispec.core.policies import ConstantK, LoadCap
from verispec.core.stopping import StoppingRules
from verispec.core.tree import TreeSettings
from verispec.core.types import SamplingParams
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.base import DraftRequest
from verispec.drafters.eagle3 import Eagle3Drafter, Eagle3Net, default_aux_layers, eagle3_settings
from verispec.drafters.learned import save_drafter
from verispec.export import export_eagle3
from verispec.methods import build_engine
from verispec.model.loading import load_model
from verispec.options import DraftOptions
from verispec.training.data import build_dataset

# Float32 on both sides, different operation order (fused SDPA and a KV cache against explicit
# softmax over the whole sequence): agreement to float32 rounding, well under any flip of a draft.
ATOL = 1e-4
DRAFT_IDS = torch.tensor([0, 2, 3, 5, 8, 9, 13, 17, 20, 21, 30, 33, 40, 41, 50, 63])


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(str(save_tiny(tmp_path_factory.mktemp("target"), seed=0)))


def random_drafter(model, path: Path, seed: int = 7, vocab_ids: torch.Tensor = DRAFT_IDS,
                   aux: tuple[int, ...] | None = None) -> Path:
    """A randomly initialised eagle3 drafter directory for `model` reading the aux layers `aux`
    (default: the engines'), with weights large enough that drafts and logits are far from
    uniform."""
    torch.manual_seed(seed)
    settings = eagle3_settings(model, aux, len(vocab_ids))
    net = Eagle3Net(**settings)
    for name, p in net.named_parameters():
        torch.nn.init.normal_(p, mean=1.0 if name.endswith("norm.weight") else 0.0, std=0.3)
    weights = {"net." + k: v for k, v in net.state_dict().items()} | {"vocab_ids": vocab_ids}
    return save_drafter(path, "eagle3", model, settings, weights)


# ---- the engines' loading rules, replayed on the exported keys --------------------------------

STACKED = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
           (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))
LAYER_PARAMS = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                "mlp.down_proj.weight", "input_layernorm.weight", "hidden_norm.weight",
                "post_attention_layernorm.weight")


def _stack(name: str) -> str:
    for shard, fused in STACKED:
        if shard in name:
            return name.replace(shard, fused)
    return name


def vllm_load(keys: list[str]) -> set[str]:
    """vLLM's Eagle3LlamaForCausalLM.load_weights naming: t2d skipped, d2t renamed, midlayer. ->
    layers.0., everything but lm_head under model.; a name with no parameter raises."""
    params = ({"model.fc.weight", "model.norm.weight", "lm_head.weight", "draft_id_to_target_id"}
              | {f"model.layers.0.{p}" for p in LAYER_PARAMS})
    loaded = set()
    for name in keys:
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        else:
            name = name.replace("midlayer.", "layers.0.")
            name = name if "lm_head" in name else "model." + name
        name = _stack(name)
        if name not in params:
            raise KeyError(f"vLLM has no parameter {name}")
        loaded.add(name)
    return params - loaded  # parameters left at their initial values


def sglang_load(keys: list[str]) -> tuple[set[str], list[str]]:
    """SGLang's LlamaForCausalLMEagle3.load_weights naming: d2t becomes the hot-token map, t2d
    skipped, a name not among its parameters tried under model., else skipped without a word.
    Returns (parameters never loaded, keys skipped)."""
    params = ({"model.fc.weight", "model.norm.weight", "lm_head.weight"}
              | {f"model.midlayer.{p}" for p in LAYER_PARAMS})
    loaded, skipped, hot = set(), [], False
    for name in keys:
        if "d2t" in name:
            hot = True
            continue
        if "t2d" in name:
            continue
        fused = _stack(name)
        param = fused if fused in params else "model." + fused
        if param in params:
            loaded.add(param)
        else:
            skipped.append(name)
    assert hot, "SGLang drafts with the reduced head only when d2t is there"
    return params - loaded, skipped


def check_shapes(tensors: dict[str, torch.Tensor], layer: str, config: dict, vocab: int) -> None:
    """The shapes both engines build their parameters with, from the drafter's Llama config."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv, head_dim, inter = config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]
    draft_vocab = config["draft_vocab_size"]
    expected = {"fc.weight": (hidden, 3 * config.get("target_hidden_size", hidden)),
                f"{layer}self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
                f"{layer}self_attn.k_proj.weight": (kv * head_dim, 2 * hidden),
                f"{layer}self_attn.v_proj.weight": (kv * head_dim, 2 * hidden),
                f"{layer}self_attn.o_proj.weight": (hidden, heads * head_dim),
                f"{layer}mlp.gate_proj.weight": (inter, hidden),
                f"{layer}mlp.up_proj.weight": (inter, hidden),
                f"{layer}mlp.down_proj.weight": (hidden, inter),
                f"{layer}input_layernorm.weight": (hidden,), f"{layer}hidden_norm.weight": (hidden,),
                f"{layer}post_attention_layernorm.weight": (hidden,), "norm.weight": (hidden,),
                "lm_head.weight": (draft_vocab, hidden), "d2t": (draft_vocab,), "t2d": (vocab,)}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    target_ids = torch.arange(draft_vocab) + tensors["d2t"]
    assert int(target_ids.max()) < vocab and bool((target_ids.diff() > 0).all())
    assert torch.equal(tensors["t2d"].nonzero()[:, 0], target_ids)  # t2d marks exactly those ids


def engine_aux_states(config: dict, fmt: str, num_layers: int) -> list[int]:
    """The Hugging Face hidden_states indices whose states the engine feeds the export's fc, in
    order, read from its config.json the way the engine reads it (vLLM 0.33, SGLang 0.5).

    Both engines' Llama forward walks layers 0..N-1 and, before layer i runs, appends the residual
    stream entering it (hidden_states + residual, Hugging Face's hidden_states[i]) when i is in its
    capture list; so only indices 0..N-1 are ever captured, in layer order.
    vLLM: the capture list is the draft config's eagle_aux_hidden_state_layer_ids as they are
    (lifted from the speculators config), else (2, N // 2, N - 3).
    SGLang: set_eagle3_layers_to_capture(ids) with the draft config's
    eagle_config.eagle_aux_hidden_state_layer_ids captures [id + 1 for id in ids] ("for the ith
    layer, it takes the output of the (i-1)th layer"); without ids, [2, N // 2, N - 3].
    """
    default = [2, num_layers // 2, num_layers - 3]
    if fmt == "vllm":
        capture = config.get("eagle_aux_hidden_state_layer_ids") or default
    else:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        capture = default if ids is None else [i + 1 for i in ids]
    return [i for i in range(num_layers) if i in capture]


def layer_config_of(directory: Path, fmt: str) -> tuple[dict, dict]:
    """(top-level config, the drafter's Llama config with the EAGLE-3 fields) of an export."""
    config = json.loads((directory / "config.json").read_text())
    if fmt == "vllm":
        return config, {**config["transformer_layer_config"],
                        "draft_vocab_size": config["draft_vocab_size"],
                        "target_hidden_size": config["target_hidden_size"]}
    return config, config


# ---- an independent EAGLE-3 forward over the exported files ----------------------------------

def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    # x: [T, heads, head_dim]; Llama's rotate-half convention
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.double()[:, None] * inv_freq[None]  # [T, dim / 2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None].float()
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None].float()
    rotated = torch.cat([-x[..., dim // 2:], x[..., : dim // 2]], -1)
    return x * cos + rotated * sin


def engine_draft_logits(directory: Path, fmt: str, embedding: torch.Tensor, aux: torch.Tensor,
                        next_tokens: torch.Tensor, drafted: list[int]) -> torch.Tensor:
    """Draft logits over the target vocabulary [len(drafted) + 1, vocab] (-inf off the draft
    vocabulary), as the engine would compute them from the exported directory.

    aux: [n, 3 * hidden], the target's aux states at positions 0..n-1; next_tokens: [n], the token
    after each position; drafted: tokens drafted so far after the last real position. Row 0 is the
    first draft's logits (from position n - 1), row j the logits after drafted[j - 1].
    """
    config, layer_cfg = layer_config_of(directory, fmt)
    assert config.get("norm_before_residual", False) is False
    w = {k: v.float() for k, v in load_file(directory / "model.safetensors").items()}
    layer = "layers.0." if fmt == "vllm" else "midlayer."
    eps, heads = layer_cfg["rms_norm_eps"], layer_cfg["num_attention_heads"]
    kv_heads, head_dim = layer_cfg["num_key_value_heads"], layer_cfg["head_dim"]
    theta = layer_cfg["rope_theta"]
    features = [aux @ w["fc.weight"].T]  # [n, hidden]: fc only where the input is 3H wide
    tokens = [next_tokens]
    outputs = None
    for step in range(len(drafted) + 1):
        if step:  # a drafted position reads the previous position's output before the norm
            features.append(outputs[-1:])
            tokens.append(torch.tensor([drafted[step - 1]]))
        feature, token = torch.cat(features), torch.cat(tokens)
        length = feature.shape[0]
        x = torch.cat([_rms(embedding[token], w[layer + "input_layernorm.weight"], eps),
                       _rms(feature, w[layer + "hidden_norm.weight"], eps)], -1)  # [T, 2H]
        positions = torch.arange(length)
        q, k, v = ((x @ w[layer + f"self_attn.{n}_proj.weight"].T).view(length, -1, head_dim)
                   for n in "qkv")  # [T, heads or kv_heads, head_dim]
        q, k = _rope(q, positions, theta), _rope(k, positions, theta)
        k = k.repeat_interleave(heads // kv_heads, 1)
        v = v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
        scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
        attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(length, -1)
        residual = feature + attended @ w[layer + "self_attn.o_proj.weight"].T
        h = _rms(residual, w[layer + "post_attention_layernorm.weight"], eps)
        mlp = (torch.nn.functional.silu(h @ w[layer + "mlp.gate_proj.weight"].T)
               * (h @ w[layer + "mlp.up_proj.weight"].T)) @ w[layer + "mlp.down_proj.weight"].T
        outputs = residual + mlp  # [T, hidden], before the final norm
    reduced = _rms(outputs, w["norm.weight"], eps) @ w["lm_head.weight"].T  # [T, draft_vocab]
    full = torch.full((outputs.shape[0], len(w["t2d"])), float("-inf"))
    full[:, torch.arange(reduced.shape[1]) + w["d2t"].long()] = reduced
    return full[-(len(drafted) + 1):]


# ---- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_export_follows_the_engines_rules(target, tmp_path, fmt):
    drafter = random_drafter(target.model, tmp_path / "drafter")
    out = export_eagle3(drafter, target, tmp_path / fmt, fmt, num_speculative_tokens=3)
    tensors = load_file(out / "model.safetensors")
    config, layer_cfg = layer_config_of(out, fmt)
    layer = "layers.0." if fmt == "vllm" else "midlayer."
    check_shapes(tensors, layer, layer_cfg, target.vocab_size)
    assert not any("embed" in k for k in tensors)  # both engines use the target's embedding
    assert layer_cfg["num_hidden_layers"] == 1 and layer_cfg["model_type"] == "llama"
    assert layer_cfg["tie_word_embeddings"] is False
    if fmt == "vllm":
        assert vllm_load(list(tensors)) == set()  # every parameter loaded, no key unknown
        assert config["speculators_model_type"] == "eagle3"
        spec = config["speculators_config"]
        assert spec["algorithm"] == "eagle3" and spec["proposal_methods"][0]["speculative_tokens"] == 3
        assert spec["default_proposal_method"] in {m["proposal_type"] for m in spec["proposal_methods"]}
        assert spec["verifier"]["architectures"] == ["LlamaForCausalLM"] and spec["verifier"]["name_or_path"]
        assert config["norm_before_residual"] is False  # written: vLLM's default here is true
        assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # hidden_states indices
        with pytest.raises(KeyError):  # vLLM refuses a key it does not know
            vllm_load([*tensors, "model.embed_tokens.weight"])
    else:
        never, skipped = sglang_load(list(tensors))
        assert never == set() and skipped == []
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert "norm_before_residual" not in config or config["norm_before_residual"] is False
        assert "eagle_config" not in config  # the default aux layers: SGLang's own default
        # The vLLM layout's layer keys would be skipped by SGLang without a word:
        vllm_keys = load_file(export_eagle3(drafter, target, tmp_path / "v", "vllm") / "model.safetensors")
        assert sglang_load(list(vllm_keys))[1] == [k for k in vllm_keys if k.startswith("layers.0.")]
    assert "--speculative" in (out / "README.md").read_text()


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_exported_weights_give_verispecs_draft_logits(target, tmp_path, fmt, full_precision_drafting):
    model = target.model
    drafter_dir = random_drafter(model, tmp_path / "drafter")
    out = export_eagle3(drafter_dir, target, tmp_path / fmt, fmt)
    drafter = Eagle3Drafter.load(drafter_dir, model)
    tokens = torch.tensor([1, 17, 42, 9, 33, 17, 42, 5, 12, 60])
    with torch.no_grad():
        states = model.model(input_ids=tokens[None], output_hidden_states=True)
    layers = default_aux_layers(model.config.num_hidden_layers)
    aux = torch.cat([states.hidden_states[i][0, :-1] for i in layers], -1)  # [n, 3H]
    target_hidden = torch.cat([states.last_hidden_state[0, :-1], aux], -1)  # what the engine hands over
    embedding = model.get_input_embeddings().weight.detach()
    # Sampled drafts report q = softmax of the full-vocabulary draft logits at every position.
    generator = torch.Generator().manual_seed(0)
    proposal = drafter.propose(DraftRequest(tokens, 4, SamplingParams(do_sample=True), generator,
                                            target_hidden))
    drafted = proposal.tokens.tolist()
    reference = engine_draft_logits(out, fmt, embedding, aux, tokens[1:], drafted[:-1])
    torch.testing.assert_close(proposal.draft_probs, reference.softmax(-1), atol=ATOL, rtol=0)
    assert (reference.softmax(-1).gather(-1, proposal.tokens[:, None]) > 0).all()
    # Greedy: the same chain of argmaxes, and the drafter's own logits for the first draft.
    drafter.reset()
    greedy = drafter.propose(DraftRequest(tokens, 4, SamplingParams(), None, target_hidden)).tokens.tolist()
    expected = []
    for _ in range(4):
        expected.append(int(engine_draft_logits(out, fmt, embedding, aux, tokens[1:], expected)[-1].argmax()))
    assert greedy == expected
    drafter.reset()
    with torch.inference_mode():
        first = drafter.head.full(drafter.head.logits(drafter._extend(tokens, target_hidden, len(aux))))
    torch.testing.assert_close(first, reference[0], atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory):
    """Eight layers: room for aux layers other than the engines' default (2, 4, 5)."""
    return load_model(str(save_tiny(tmp_path_factory.mktemp("deep"), seed=0, layers=8)))


@pytest.mark.parametrize("aux", [(1, 3, 6), (2, 4, 5), (1, 2, 7)])
@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_exported_aux_ids_point_the_engine_at_the_layers_the_drafter_reads(deep_target, tmp_path,
                                                                           fmt, aux, full_precision_drafting):
    """The engine, reading the export's config as it does, feeds fc the states the drafter was
    trained on (its hidden_layers), and then computes the drafter's own first draft logits."""
    model = deep_target.model
    drafter_dir = random_drafter(model, tmp_path / "drafter", aux=aux)
    drafter = Eagle3Drafter.load(drafter_dir, model)
    assert drafter.hidden_layers == aux
    out = export_eagle3(drafter_dir, deep_target, tmp_path / fmt, fmt)
    config = json.loads((out / "config.json").read_text())
    read = engine_aux_states(config, fmt, model.config.num_hidden_layers)
    assert read == list(aux), f"{fmt} reads hidden_states {read}, the drafter {list(aux)}"
    tokens = torch.tensor([1, 17, 42, 9, 33, 17, 42, 5])
    with torch.no_grad():
        states = model.model(input_ids=tokens[None], output_hidden_states=True)
    engine_aux = torch.cat([states.hidden_states[i][0, :-1] for i in read], -1)  # [n, 3H]
    ours = torch.cat([states.last_hidden_state[0, :-1],
                      *(states.hidden_states[i][0, :-1] for i in drafter.hidden_layers)], -1)
    embedding = model.get_input_embeddings().weight.detach()
    with torch.inference_mode():
        first = drafter.head.full(drafter.head.logits(drafter._extend(tokens, ours, len(tokens) - 1)))
    torch.testing.assert_close(first, engine_draft_logits(out, fmt, embedding, engine_aux, tokens[1:], [])[0],
                               atol=ATOL, rtol=0)


def test_export_refuses_another_kind_or_target(target, tmp_path):
    drafter = random_drafter(target.model, tmp_path / "drafter")
    other = load_model(str(save_tiny(tmp_path / "other", seed=1)))
    with pytest.raises(VerispecError, match="trained for another target"):
        export_eagle3(drafter, other, tmp_path / "x", "vllm")
    with pytest.raises(VerispecError, match="unknown export format"):
        export_eagle3(drafter, target, tmp_path / "x", "tgi")


def test_cli_export(target, tmp_path, capsys):
    drafter = random_drafter(target.model, tmp_path / "drafter")
    out = tmp_path / "vllm"
    assert main(["export", "--model", target.name, "--method", "eagle3", "--drafter", str(drafter),
                 "--format", "vllm", "--out", str(out), "--num-speculative-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert f"vllm serve {target.name} --speculative-config" in printed
    assert '"num_speculative_tokens": 4' in printed
    assert json.loads((out / "config.json").read_text())["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"] == 4
    # Readable by the engine's user too (a container): safetensors alone writes owner-only files.
    mask = os.umask(0o022)
    os.umask(mask)
    for written in (out / "model.safetensors", drafter / "weights.safetensors"):
        assert written.stat().st_mode & 0o777 == 0o666 & ~mask, written
    assert main(["export", "--model", target.name, "--method", "eagle", "--format", "vllm",
                 "--out", str(tmp_path / "x")]) == 2
    assert "only eagle3 drafters export" in capsys.readouterr().err
    assert main(["export", "--model", target.name, "--format", "sglang", "--out", str(tmp_path / "x")]) == 2
    assert "no trained eagle3 drafter ships" in capsys.readouterr().err


# ---- sampling: the emitted tokens follow the target's distribution -----------------------------

SMALL_VOCAB = 16


@pytest.mark.slow  # 24 s on the AVX2 EPYC: sampled at TV 0.1 in the slow checks
@pytest.mark.parametrize("skew", POWER)
def test_eagle3_sampling_emits_the_targets_distribution(tmp_path, skew):
    """Three new tokens per run, temperature 1: the empirical law of each emitted token over many
    seeded runs is the target's own (computed exactly by tests.distribution.exact_marginals),
    with the sample size giving power against a skew of TV 0.05. The drafter is a saved random
    EAGLE-3 over half the vocabulary, loaded as a user's would be, so drafts are accepted,
    rejected and absent from the draft vocabulary at once."""
    model = tiny_llama(seed=2, vocab=SMALL_VOCAB, hidden=32)
    model.save_pretrained(tmp_path / "t")
    tiny_tokenizer(vocab=SMALL_VOCAB).save_pretrained(tmp_path / "t")
    target = load_model(str(tmp_path / "t"))
    saved = random_drafter(target.model, tmp_path / "d", seed=3, vocab_ids=torch.arange(0, SMALL_VOCAB, 2))

    def make():
        return Eagle3Drafter.load(saved, target.model)

    engine = SpeculativeEngine(target.model, make(), ConstantK(3), spawn=make, load_cap=LoadCap(()))
    prompt, sampling = [1, 5, 9, 7], SamplingParams(do_sample=True, temperature=1.0)
    exact = exact_marginals(target.model, prompt, 3, sampling)
    sampled = sample_runs(engine, prompt, 3, sampling, runs_for(exact, skew))
    sampled.check_drafting(positions=2)
    assert_follows(sampled, exact, "eagle3", skew)


def test_cli_trains_an_eagle3_that_decodes_exactly(target, tmp_path, capsys):
    """`verispec train eagle3` builds data with the aux-layer states and trains on it; method
    eagle3 with that drafter is plain greedy decoding token for token, as a chain and a tree."""
    out = tmp_path / "e3"
    assert main(["train", "eagle3", "--target", target.name, "--out", str(out), "--prompts", "4",
                 "--max-new-tokens", "10", "--steps", "3", "--vocab", "40"]) == 0
    meta = json.loads((out / "data" / "meta.json").read_text())
    assert meta["aux_layers"] == [0, 1, 2]
    settings = json.loads((out / "drafter.json").read_text())["settings"]
    assert settings["aux_layers"] == [0, 1, 2] and settings["draft_vocab"] == 40
    prompt = [1, 17, 42, 9, 33, 17, 42, 5]
    plain = build_engine(target, "ar").generate(SequenceSpec(prompt, StoppingRules.build(30))).token_ids
    for tree in (None, TreeSettings(3, 8)):
        options = DraftOptions(k=3, draft=str(out), tree=tree)
        assert build_engine(target, "eagle3", options).generate(
            SequenceSpec(prompt, StoppingRules.build(30))).token_ids == plain, tree
    # Data built without aux states (an eagle run's) is refused with what to do.
    plain_data = build_dataset(target, tmp_path / "plain", num_prompts=2, max_new_tokens=4)
    assert main(["train", "eagle3", "--target", target.name, "--out", str(tmp_path / "x"),
                 "--data", str(plain_data), "--steps", "1"]) == 2
    assert "has none" in capsys.readouterr().err
