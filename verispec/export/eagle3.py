"""A trained EAGLE-3 drafter written as a directory vLLM or SGLang loads as it is.

Both engines run the same network (see verispec.drafters.eagle3) but read it differently; what
each needs, as of vLLM 0.33 and SGLang 0.5:

vLLM ("vllm"): a speculators-format config.json (speculators_model_type "eagle3", the
  speculators_config with its proposal method and verifier, the drafter's own Llama config as
  transformer_layer_config, draft_vocab_size, target_hidden_size, the aux layer ids, and
  norm_before_residual, written false because vLLM's default for this format is true). Weights
  fc, layers.0.*, norm, lm_head, d2t (int64: target id = draft id + d2t) and t2d (bool over the
  target vocabulary, skipped on load). A key it does not know is an error. Aux id L is Hugging
  Face hidden_states[L].
SGLang ("sglang"): a plain Hugging Face config.json (architectures LlamaForCausalLMEagle3,
  tie_word_embeddings false, draft_vocab_size). Its module holds the layer as `midlayer`, so the
  layer's weights are written midlayer.* (layers.0.* would be skipped without a word: SGLang
  ignores keys it does not know). It has no norm_before_residual (always false) and always uses
  the target's embedding. Explicit aux ids there mean hidden_states[id + 1]; its default, like
  vLLM's, is (2, N // 2, N - 3), so for a drafter on the defaults no ids are written.

Neither directory holds an embedding: both engines borrow the target's, as verispec does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from verispec.core.errors import VerispecError
from verispec.drafters.eagle3 import Eagle3Drafter, default_aux_layers
from verispec.drafters.learned import load_drafter, write_safetensors
from verispec.model.loading import LoadedModel

FORMATS = ("vllm", "sglang")
WEIGHTS_FILE = "model.safetensors"
# Hub names of the built-in models, for the verifier an engine loads beside the drafter.
HUB_NAMES = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}
LAYER_PREFIX = {"vllm": "layers.0.", "sglang": "midlayer."}
# The engines' name for the method (speculators_model_type, algorithm, --speculative-config's
# method), which verispec's drafter kind is named after (tests/test_eagle3.py pins it).
ENGINE_METHOD = Eagle3Drafter.kind


def engine_tensors(weights: dict[str, torch.Tensor], fmt: str,
                   vocab_size: int) -> dict[str, torch.Tensor]:
    """A verispec eagle3 drafter's weights (net.* + vocab_ids) under the keys `fmt` loads."""
    if fmt not in FORMATS:
        raise VerispecError(f"unknown export format {fmt!r}; choose from {', '.join(FORMATS)}")
    vocab_ids = weights["vocab_ids"].long()  # [draft_vocab], increasing
    out = {}
    for name, value in weights.items():
        if name.startswith("net."):
            name = name.removeprefix("net.")
            if name.startswith("layers.0."):
                name = LAYER_PREFIX[fmt] + name.removeprefix("layers.0.")
            out[name] = value.contiguous()
    out["d2t"] = vocab_ids - torch.arange(len(vocab_ids))  # [draft_vocab] int64
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[vocab_ids] = True
    out["t2d"] = t2d  # [vocab] bool
    return out


def layer_config(settings: dict, target: LoadedModel, dtype: str) -> dict:
    """The drafter's own one-layer Llama config (the fields both engines read)."""
    config = target.model.config.get_text_config(decoder=True)
    theta = settings["rope_theta"]
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "hidden_size": settings["hidden"], "intermediate_size": settings["intermediate"],
            "num_attention_heads": settings["heads"], "num_key_value_heads": settings["kv_heads"],
            "head_dim": settings["head_dim"], "num_hidden_layers": 1, "hidden_act": "silu",
            "rms_norm_eps": settings["eps"], "rope_theta": theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_scaling": None,
            "max_position_embeddings": int(getattr(config, "max_position_embeddings", 2048)),
            "vocab_size": target.vocab_size, "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": False, "torch_dtype": dtype,
            "bos_token_id": getattr(config, "bos_token_id", None),
            "eos_token_id": getattr(config, "eos_token_id", None)}


def engine_config(settings: dict, target: LoadedModel, fmt: str, verifier: str,
                  num_speculative_tokens: int, dtype: str) -> dict:
    """config.json for `fmt`."""
    aux = list(settings["aux_layers"])
    layers = int(target.model.config.get_text_config(decoder=True).num_hidden_layers)
    base = layer_config(settings, target, dtype)
    common = {"draft_vocab_size": settings["draft_vocab"], "target_hidden_size": settings["hidden"]}
    if fmt == "vllm":
        return {"architectures": ["Eagle3Speculator"], "speculators_model_type": ENGINE_METHOD,
                "speculators_config": {
                    "algorithm": ENGINE_METHOD,
                    "proposal_methods": [{"proposal_type": "greedy",
                                          "speculative_tokens": num_speculative_tokens}],
                    "default_proposal_method": "greedy",
                    "verifier": {"name_or_path": verifier,
                                 "architectures": [type(target.model).__name__]}},
                "transformer_layer_config": base, **common, "norm_before_residual": False,
                "norm_before_fc": False, "eagle_aux_hidden_state_layer_ids": aux,
                "torch_dtype": dtype}
    config = {**base, "architectures": ["LlamaForCausalLMEagle3"], **common}
    if tuple(aux) != default_aux_layers(layers):
        if aux[0] == 0:
            raise VerispecError("SGLang cannot be told to read hidden_states[0] (the embeddings): "
                                "its explicit aux ids mean hidden_states[id + 1]")
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [a - 1 for a in aux]}
    return config


def launch_lines(fmt: str, verifier: str, out: Path, k: int) -> str:
    spec = json.dumps({"method": ENGINE_METHOD, "model": str(out), "num_speculative_tokens": k})
    if fmt == "vllm":
        return f"vllm serve {verifier} --speculative-config '{spec}'"
    return (f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {out} --speculative-num-steps {k} "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")


def export_eagle3(drafter_dir: str | Path, target: LoadedModel, out_dir: str | Path, fmt: str,
                  num_speculative_tokens: int = 3, verifier: str | None = None) -> Path:
    """Write the eagle3 drafter in drafter_dir (trained for `target`, which is checked) to
    out_dir as `fmt` loads it: config.json, model.safetensors, README.md with the launch line."""
    if fmt not in FORMATS:
        raise VerispecError(f"unknown export format {fmt!r}; choose from {', '.join(FORMATS)}")
    if num_speculative_tokens < 1:
        raise VerispecError("num_speculative_tokens must be >= 1")
    config, weights = load_drafter(drafter_dir, target.model, Eagle3Drafter.kind)
    tensors = engine_tensors(weights, fmt, target.vocab_size)
    dtype = str(weights["net.fc.weight"].dtype).removeprefix("torch.")
    verifier = verifier or HUB_NAMES.get(target.name, target.name)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise VerispecError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})
    engine = engine_config(config["settings"], target, fmt, verifier, num_speculative_tokens, dtype)
    (out / "config.json").write_text(json.dumps(engine, indent=1) + "\n")
    line = launch_lines(fmt, verifier, out.resolve(), num_speculative_tokens)
    (out / "README.md").write_text(
        f"# EAGLE-3 drafter for {verifier} ({fmt})\n\nWritten by `verispec export` from "
        f"{Path(drafter_dir).resolve()}. Draft vocabulary {config['settings']['draft_vocab']} of "
        f"{target.vocab_size} tokens; aux layers {config['settings']['aux_layers']} "
        f"(Hugging Face hidden_states indices). Serve it with:\n\n```\n{line}\n```\n")
    return out
