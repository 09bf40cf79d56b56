"""`verispec train bytes`: a byte-level causal LM trained here, with multi-token prediction heads.

Gloeckle et al. (2024) train a shared trunk with n output heads, head i predicting the token i
places ahead, all read out through one shared unembedding; at n = 8 on bytes their 7B model
self-speculates 6.4x faster. verispec's byte model is that shape at a size two CPU cores train:
a `LlamaForCausalLM` over bytes (verispec.model.bytes) whose first L - 1 layers are the trunk
and whose last layer, final norm and LM head are head 1 (so the model that ships and decodes is
a plain Llama), plus `heads` more decoder layers on the trunk's output (verispec.drafters.mtp's
MTPNet, trunk_layer = L - 1), head i + 1 predicting byte t + 1 + i through the same norm and LM
head. Every head's loss is backpropagated in turn into the trunk's output
(verispec.training.losses.multi_head_backward), then once through the trunk. With heads = 0 it
trains the same model on next-byte prediction alone: the ablation.

The text is what every machine has or makes: the Python standard library's source (its code
and docstrings, PSF-licensed) and the answers the built-in model writes to the training-family
prompts (verispec.training.prompts; never Spec-Bench), laid out in the byte model's chat format.
Files and prompts are split once into training and held-out parts, by name.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from verispec.core.errors import VerispecError
from verispec.core.files import write_text
from verispec.drafters.learned import save_drafter
from verispec.drafters.mtp import MTPDrafter, MTPNet, mtp_settings
from verispec.model.bytes import ASSISTANT, BOS, EOS, PAD, USER, VOCAB_SIZE, byte_config, byte_tokenizer
from verispec.model.loading import LoadedModel
from verispec.request import encode_prompt
from verispec.training.data import answer, claim_directory
from verispec.training.losses import multi_head_backward
from verispec.training.prompts import PASSAGE_MODULES, SNIPPET_MODULES, make_prompts
from verispec.training.trainer import TrainConfig, train

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

BYTES_KIND = "bytes"  # `verispec train bytes`
MODEL_DIR = "model"  # where in the output directory the model goes
HEADS_DIR = MTPDrafter.kind  # and its extra heads, a trained drafter of that kind
COMPLETE = "complete"  # marker file written after the last batch of answers
LN2 = math.log(2)
HELD_OUT_EVERY = 20  # one file (and one prompt) in 20 is held out
# Packages whose code and docstrings the training prompts quote: never held out, so held-out
# code is text the training prompts do not show.
QUOTED = frozenset(name.split(".")[0] for name in SNIPPET_MODULES + PASSAGE_MODULES)


def held_out(name: str) -> bool:
    """Whether a file (path relative to the standard library) or a prompt is held out: a
    fixed hash of its name, so the split never depends on what else there is."""
    if name.endswith(".py") and Path(name).parts[0].removesuffix(".py") in QUOTED:
        return False
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


def stdlib_files(root: str | Path | None = None) -> list[str]:
    """The standard library's own Python files (no tests, no site-packages, no generated codec
    tables), relative to root (default: this Python's), sorted."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings"}
    return sorted(str(p.relative_to(base)) for p in base.rglob("*.py")
                  if not skip & set(p.relative_to(base).parts))


def utf8(text: str) -> torch.Tensor:
    """The UTF-8 bytes of text as token ids: [n] int64."""
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).long() if text else (
        torch.zeros(0, dtype=torch.int64))


def chat_ids(prompt: str, reply: str, ended: bool) -> torch.Tensor:
    """One conversation as the byte model's chat template lays it out (an unfinished reply
    has no EOS): [n] int64."""
    return torch.cat([torch.tensor([BOS, USER]), utf8(prompt), torch.tensor([ASSISTANT]),
                      utf8(reply), torch.tensor([EOS] if ended else [], dtype=torch.int64)])


def document_ids(text: str) -> torch.Tensor:
    """A raw document: BOS, its bytes, EOS: [n] int64."""
    return torch.cat([torch.tensor([BOS]), utf8(text), torch.tensor([EOS])])


def write_answers(target: LoadedModel, out_dir: str | Path, count: int = 2000, seed: int = 0,
                  max_new_tokens: int = 200, batch_size: int = 64,
                  max_batches: int | None = None) -> Path:
    """The target's greedy answers to `count` training-family prompts, as JSON lines
    {"prompt", "reply", "ended", "held_out"}, one file per batch (resumable: batches written are
    kept). Generated by the self-distillation pipeline (verispec.training.data.answer).
    max_batches: answer only the first this many batches (the prompts come in a random mix of
    kinds, so any first batches are a mix too); a larger number later adds the missing ones."""
    if target.tokenizer is None:
        raise VerispecError(f"{target.name} has no tokenizer to write answers with")
    out = Path(out_dir)
    meta = {"writer": target.name, "count": count, "seed": seed, "max_new_tokens": max_new_tokens}
    claim_directory(out, "answers.json", meta, "answers written")
    prompts = make_prompts(count, seed)
    eos = target.eos_token_ids
    batches = [prompts[i: i + batch_size] for i in range(0, len(prompts), batch_size)]
    batches = batches if max_batches is None else batches[:max_batches]
    for index, batch in enumerate(tqdm(batches, desc="answers for the byte model", unit="batch")):
        shard = out / f"answers-{index:05d}.jsonl"
        if shard.exists():
            continue
        ids = [encode_prompt(target, p, chat=None) for p in batch]
        lines = []
        for prompt, prompt_ids, sequence in zip(batch, ids, answer(target, ids, max_new_tokens)):
            reply = sequence[len(prompt_ids):]
            ended = bool(reply) and reply[-1] in eos
            text = target.tokenizer.decode(reply, skip_special_tokens=True)
            lines.append(json.dumps({"prompt": prompt, "reply": text, "ended": ended,
                                     "held_out": held_out(prompt)}))
        write_text(shard, "\n".join(lines) + "\n")
    (out / COMPLETE).touch()
    return out


def read_answers(data_dir: str | Path) -> list[dict]:
    """Every answer write_answers wrote into data_dir."""
    data = Path(data_dir)
    if not (data / COMPLETE).is_file():
        raise VerispecError(f"{data} holds no complete set of answers (write_answers makes it)")
    return [json.loads(line) for shard in sorted(data.glob("answers-*.jsonl"))
            for line in shard.read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class Corpus:
    """Token streams by source ("code", "chat") and split ("train", "held_out")."""

    streams: dict[tuple[str, str], torch.Tensor]  # each [n] int64: documents one after another
    sources: dict  # what went in: document and byte counts, the Python version

    @classmethod
    def build(cls, data_dir: str | Path, stdlib: str | Path | None = None) -> Corpus:
        root = Path(stdlib or sysconfig.get_paths()["stdlib"])
        parts: dict[tuple[str, str], list[torch.Tensor]] = {
            (kind, part): [] for kind in ("code", "chat") for part in ("train", "held_out")}
        for name in stdlib_files(root):
            text = (root / name).read_text(encoding="utf-8", errors="replace")
            parts[("code", "held_out" if held_out(name) else "train")].append(document_ids(text))
        for item in read_answers(data_dir):
            parts[("chat", "held_out" if item["held_out"] else "train")].append(
                chat_ids(item["prompt"], item["reply"], item["ended"]))
        streams = {key: torch.cat(found) if found else torch.zeros(0, dtype=torch.int64)
                   for key, found in parts.items()}
        sources = {"python": sys.version.split()[0], "stdlib": str(root),
                   **{f"{kind}_{part}": {"documents": len(parts[(kind, part)]),
                                         "bytes": len(streams[(kind, part)])}
                      for kind, part in parts}}
        return cls(streams, sources)

    def windows(self, kind: str, part: str, length: int) -> torch.Tensor:
        """The stream cut into whole windows of `length` tokens: [windows, length] int64."""
        stream = self.streams[(kind, part)]
        count = len(stream) // length
        return stream[: count * length].view(count, length)


@dataclass(frozen=True)
class Window:
    """A training or held-out window of the corpus."""

    tokens: torch.Tensor  # [T] int64
    kind: str  # "code" or "chat"


class ByteLM(torch.nn.Module):
    """The byte model and its extra heads, trained together: trunk = the model's first L - 1
    layers; head 1 = its last layer; head 1 + i = heads.layers[i - 1] (None: no extra heads)."""

    def __init__(self, model: LlamaForCausalLM, heads: MTPNet | None) -> None:
        super().__init__()
        self.model, self.heads = model, heads

    @property
    def num_heads(self) -> int:
        """n, the bytes predicted at each position (1: next-byte prediction alone)."""
        return 1 + (0 if self.heads is None else self.heads.num_heads)

    def trunk(self, tokens: torch.Tensor) -> tuple[torch.Tensor, tuple, torch.Tensor]:
        """tokens [B, T] -> (the trunk's output [B, T, hidden], rotary embeddings, positions)."""
        body = self.model.model
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = body.embed_tokens(tokens)
        rotary = body.rotary_emb(hidden, positions[None])
        for layer in body.layers[:-1]:
            hidden = layer(hidden, position_embeddings=rotary, position_ids=positions[None])
        return hidden, rotary, positions

    def head_logits(self, k: int, trunk: torch.Tensor, rotary: tuple,
                    positions: torch.Tensor) -> torch.Tensor:
        """Head k's logits at every position [B, T, vocab]: its guess of the byte k places on."""
        body = self.model.model
        if k == 1:
            out = body.layers[-1](trunk, position_embeddings=rotary, position_ids=positions[None])
        else:
            out = self.heads.layers[k - 2](trunk, positions)
        return self.model.lm_head(body.norm(out))

    def loss(self, items: list[Window]) -> tuple[torch.Tensor | None, dict]:
        """The sum of every head's mean cross-entropy over a batch, and metrics in bits per
        token (per head; on held-out batches also head 1's per kind of text). With gradients on,
        the backward runs here, head by head (losses.multi_head_backward): returns None."""
        tokens = torch.stack([w.tokens for w in items])  # [B, T]
        trunk, rotary, positions = self.trunk(tokens)
        metrics: dict[str, float] = {}

        def head_loss(k: int):
            def loss(out: torch.Tensor) -> torch.Tensor:
                logits = self.head_logits(k, out, rotary, positions)[:, :-k].float()
                per_token = torch.nn.functional.cross_entropy(
                    logits.transpose(1, 2), tokens[:, k:], reduction="none")  # [B, T - k]
                metrics[f"bits_head{k}"] = float(per_token.detach().mean()) / LN2
                if k == 1 and not torch.is_grad_enabled():
                    for kind in ("code", "chat"):
                        rows = [i for i, w in enumerate(items) if w.kind == kind]
                        if rows:
                            metrics[f"bits_{kind}"] = float(per_token[rows].detach().mean()) / LN2
                return per_token.mean()
            return loss

        losses = [head_loss(k) for k in range(1, self.num_heads + 1)]
        if torch.is_grad_enabled():
            total, _ = multi_head_backward(trunk, losses)
            return None, {**metrics, "loss": float(total)}
        total = sum(loss(trunk) for loss in losses)
        return total, {**metrics, "loss": float(total)}


@dataclass(frozen=True)
class ByteModelOptions:
    """The byte model's shape and data (training's own settings are BYTE_TRAINING's)."""

    hidden: int = 256
    layers: int = 6  # the model's: L - 1 trunk layers and head 1
    attention_heads: int = 4
    heads: int = 7  # extra heads: n = heads + 1 bytes predicted per position (0: the ablation)
    context: int = 1024  # positions: training windows and the model's max_position_embeddings
    prompts: int = 2000  # training-family prompts the writer answers (one in 20 held out)
    answer_batches: int | None = None  # answer only the first this many batches of 64 of them
    max_new_tokens: int = 200  # the writer's answer length, in its own tokens
    chat_weight: int = 3  # each chat window is drawn this many times as often as a code window
    held_out_windows: int = 24  # of each kind, for the held-out bits per byte during training

    def __post_init__(self) -> None:
        if self.heads < 0 or self.layers < 2:
            raise VerispecError(f"a byte model needs --layers >= 2 (a trunk and head 1) and "
                                f"--heads >= 0, got {self.layers} and {self.heads}")
        if self.hidden < 1 or self.hidden % self.attention_heads or self.context < 16:
            raise VerispecError(f"a byte model needs a width that {self.attention_heads} attention "
                                f"heads divide and --context >= 16, got {self.hidden} and "
                                f"{self.context}")


# What `verispec train bytes` runs by default: 6.6 M bytes seen (half the standard library's
# source, the chat answers about twice), a few hours on two shared CPU cores (docs/bytes.md).
BYTE_TRAINING = TrainConfig(steps=800, lr=2e-3, warmup=100, batch_size=8, checkpoint_every=50,
                            eval_every=100)


def new_byte_model(options: ByteModelOptions) -> ByteLM:
    """A randomly initialised byte model with its extra heads (none where options.heads is 0)."""
    config = byte_config(options.hidden, options.layers, options.attention_heads,
                         context=options.context)
    from transformers import LlamaForCausalLM  # seconds to import: not for `verispec train --help`

    model = LlamaForCausalLM(config)
    heads = None
    if options.heads:
        heads = MTPNet(**head_settings(model, options.heads))
    return ByteLM(model, heads)


def head_settings(model: LlamaForCausalLM, heads: int) -> dict:
    """MTPNet settings for a byte model's extra heads: the width of its layers, half their MLP
    (as verispec.drafters.mtp.mtp_settings), reading the trunk's output after layer L - 1."""
    config = model.config
    return {**mtp_settings(model, heads), "trunk_layer": int(config.num_hidden_layers) - 1}


def held_out_windows(corpus: Corpus, options: ByteModelOptions) -> list[Window]:
    """Held-out windows, code and chat alternating (so any even batch holds as many of each)."""
    code, chat = (corpus.windows(kind, "held_out", options.context)[: options.held_out_windows]
                  for kind in ("code", "chat"))
    count = min(len(code), len(chat))
    if count == 0:
        raise VerispecError("the held-out corpus is too small for one window of each kind")
    return [w for pair in zip(code[:count], chat[:count])
            for w in (Window(pair[0], "code"), Window(pair[1], "chat"))]


@torch.no_grad()
def held_out_bits(model: ByteLM, windows: list[Window], batch_size: int = 8) -> dict[str, float]:
    """Mean bits per token (a token is a byte, or one of the rare specials) of every head, and of
    head 1 (the model itself) per kind of text, over held-out windows, in float32."""
    model.eval()
    totals: dict[str, float] = {}
    batches = [windows[i: i + batch_size] for i in range(0, len(windows), batch_size)]
    for batch in batches:
        for name, value in model.loss(batch)[1].items():
            if name.startswith("bits_"):
                totals[name] = totals.get(name, 0.0) + value / len(batches)
    return totals


def train_byte_model(writer: LoadedModel, out_dir: str | Path, data_dir: str | Path | None = None,
                     options: ByteModelOptions = ByteModelOptions(),
                     config: TrainConfig = BYTE_TRAINING, stdlib: str | Path | None = None,
                     stop_at: int | None = None) -> Path:
    """Write the writer's answers (resumable), train a byte model on them and the standard
    library's source (default: this Python's; resumable), and export out_dir/model (a Hugging
    Face model directory with the byte tokenizer) and, with extra heads, out_dir/mtp (the heads
    as a trained MTP drafter, which `--method mtp` finds when it ships). stop_at: train and export
    only up to this step of config's schedule (trainer.train's until). Returns out_dir."""
    out = Path(out_dir)
    data = Path(data_dir) if data_dir else out / "data"
    write_answers(writer, data, options.prompts, config.seed, options.max_new_tokens,
                  max_batches=options.answer_batches)
    corpus = Corpus.build(data, stdlib)
    windows = {kind: corpus.windows(kind, "train", options.context) for kind in ("code", "chat")}
    train_items = ([Window(w, "code") for w in windows["code"]]
                   + [Window(w, "chat") for w in windows["chat"]] * options.chat_weight)
    eval_items = held_out_windows(corpus, options)
    torch.manual_seed(config.seed)
    module = new_byte_model(options)
    history = train(module, module.loss, train_items, eval_items, config, out / "run",
                    desc=f"byte model, n = {module.num_heads}", until=stop_at)
    training = {"corpus": corpus.sources, "options": asdict(options), "config": asdict(config),
                "step": history[-1]["step"], "train_windows": {k: len(v) for k, v in windows.items()},
                "seconds": history[-1]["seconds"]}
    export_byte_model(module, out, training, eval_items)
    return out


def export_byte_model(module: ByteLM, out: Path, training: dict, eval_items: list[Window]) -> None:
    """out/model: the model in bfloat16 (loaded back in float32, exactly), the byte tokenizer,
    training.json with the held-out bits per token of the exported weights; out/mtp: the extra
    heads as an MTP drafter, with their rank accuracies against the exported model (for static
    trees)."""
    from transformers import GenerationConfig

    model = module.model
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    model.to(torch.bfloat16).save_pretrained(out / MODEL_DIR)
    model.float()  # now the exported weights exactly, as loading gives them
    byte_tokenizer().save_pretrained(out / MODEL_DIR)
    for file in (out / MODEL_DIR).iterdir():  # save_pretrained writes owner-only safetensors
        file.chmod(0o644)
    training = {**training, "held_out_bits": held_out_bits(module, eval_items)}
    (out / MODEL_DIR / "training.json").write_text(json.dumps(training, indent=1) + "\n")
    if module.heads is None:
        return
    settings = head_settings(model, module.heads.num_heads)
    weights = {f"net.{k}": v for k, v in module.heads.state_dict().items()}
    weights["vocab_ids"] = torch.arange(VOCAB_SIZE)
    save_drafter(out / HEADS_DIR, MTPDrafter.kind, model, settings, weights,
                 {"training": training, "rank_accuracy": rank_accuracy(module, eval_items)})


@torch.no_grad()
def rank_accuracy(module: ByteLM, windows: list[Window], ranks: int = 8) -> list[list[float]]:
    """[head][r]: how often extra head k's r-th most probable byte is the model's own greedy
    choice k positions on (over held-out windows): what a static tree is shaped by."""
    module.eval()
    tokens = torch.stack([w.tokens for w in windows])
    trunk, rotary, positions = module.trunk(tokens)
    own = module.head_logits(1, trunk, rotary, positions).argmax(-1)  # [B, T]
    out = []
    for k in range(1, module.heads.num_heads + 1):
        ranked = module.head_logits(k + 1, trunk, rotary, positions)[:, :-k].topk(ranks, -1).indices
        out.append((ranked == own[:, k:, None]).float().mean((0, 1)).tolist())
    return out
