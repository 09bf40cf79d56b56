"""Training data: the target's own answers to training prompts (self-distillation), or passages
of a text corpus read as its replies, with its hidden states.

Each shard file holds one generation batch: for every sequence the token ids (prompt + answer),
the prompt length, the target's final hidden state at every position (what every kind reads:
EAGLE's features, and the target's logits for every kind's loss), the hidden state after the
early-exit layer (what a trained exit and EAGLE's --mid-state read; left out of data built with
`exit_states=False`, recorded in meta.json) and, where the data was built with `aux_layers`, the
states after those layers side by side (what EAGLE-3 and the block drafter read).
Logits are not stored: they are `final_hidden @ lm_head.T`, recomputed when a loss needs them.
Shards already written are kept, so an interrupted build resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.core.errors import VerispecError
from verispec.core.files import write_whole
from verispec.core.stopping import StoppingRules
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.early_exit import decoder_layers, default_exit_layer
from verispec.methods import PLAIN, build_engine
from verispec.model.hf_generate import hf_generate_batch
from verispec.model.lean import lean_supported
from verispec.model.loading import LoadedModel
from verispec.request import encode_prompt
from verispec.training.prompts import make_prompts

COMPLETE = "complete"  # marker file written after the last shard


@dataclass(frozen=True)
class Sequence:
    tokens: torch.Tensor  # [T] int64: prompt + answer
    prompt_len: int
    hidden: torch.Tensor  # [T, hidden] float16: final (normed) hidden state per position
    # [T, hidden] float16: hidden state after the first exit_layer layers; None for data built
    # without it (meta.json's "exit_states": false)
    exit_hidden: torch.Tensor | None
    # [T, hidden * len(aux_layers)] float16: Hugging Face hidden_states[L] for each L in the
    # data's aux_layers (meta.json), side by side; None for data built without them
    aux_hidden: torch.Tensor | None = None


@torch.inference_mode()
def answer(target: LoadedModel, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The target's greedy answers (prompt + answer ids, ending at the first EOS), batched.

    Where the target runs on verispec's lean path, through verispec's own batched engine (plain
    decoding, no padding, finished rows leave the batch: faster than Hugging Face's generate(),
    docs/training.md), with the same tokens. Other models use generate().
    """
    if lean_supported(target.model):
        rules = StoppingRules.build(max_new_tokens, sorted(target.eos_token_ids))
        specs = SequenceSpec.batch(prompts, rules)
        return [r.sequence for r in build_engine(target, PLAIN).generate_batch(specs)]
    return [p + new for p, new in zip(prompts, hf_generate_batch(target, prompts, max_new_tokens))]


@torch.inference_mode()
def features(target: LoadedModel, sequences: list[list[int]], exit_layer: int,
             aux_layers: tuple[int, ...] = (), exit_states: bool = True) -> list[Sequence]:
    """Final, exit-layer (unless exit_states is False) and aux-layer hidden states of each
    sequence, from one right-padded forward."""
    model = target.model
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, : len(s)] = torch.tensor(s)
        mask[row, : len(s)] = 1
    out = model.model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                      output_hidden_states=True)
    final, early = out.last_hidden_state, out.hidden_states[exit_layer]
    aux = torch.cat([out.hidden_states[layer] for layer in aux_layers], -1) if aux_layers else None
    return [Sequence(torch.tensor(s), 0, final[row, : len(s)].half().cpu(),
                     early[row, : len(s)].half().cpu() if exit_states else None,
                     None if aux is None else aux[row, : len(s)].half().cpu())
            for row, s in enumerate(sequences)]


def build_dataset(target: LoadedModel, out_dir: str | Path, num_prompts: int = 1000,
                  max_new_tokens: int = 160, batch_size: int = 64, seed: int = 0,
                  exit_layer: int | None = None, max_batches: int | None = None,
                  aux_layers: tuple[int, ...] = ()) -> Path:
    """Write shards of self-distillation data for `target` into out_dir (resumable).

    aux_layers: also store the states after these layers (Hugging Face hidden_states[L]), for
    EAGLE-3 drafters; recorded in meta.json only when given, so older data stays valid.

    max_batches: stop after this many shards (of num_prompts / batch_size, in their fixed random
    order) and call the data complete: a smaller dataset that is still a mix of every prompt kind.
    Called again with more, it adds the missing shards; shards already written are kept.
    """
    out, exit_layer = start_directory(target, out_dir, exit_layer, {
        "num_prompts": num_prompts, "max_new_tokens": max_new_tokens, "seed": seed}, aux_layers)
    prompts = [encode_prompt(target, p, chat=None) for p in make_prompts(num_prompts, seed)]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # less padding per batch
    batches = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    # Shards are written in random order, so a partly built dataset already mixes every kind of
    # prompt (sorted, the long passage prompts would all come last).
    random.Random(seed).shuffle(batches)
    if max_batches is not None:
        batches = batches[:max_batches]
    for index, batch in enumerate(tqdm(batches, desc="self-distillation data", unit="batch")):
        shard = out / f"shard-{index:05d}.pt"
        if shard.exists():
            continue
        chosen = [prompts[i] for i in batch]
        sequences = answer(target, chosen, max_new_tokens)
        write_shard(shard, features(target, sequences, exit_layer, aux_layers),
                     [len(p) for p in chosen])
    (out / COMPLETE).touch()
    return out


def start_directory(target: LoadedModel, out_dir: str | Path, exit_layer: int | None,
           settings: dict, aux_layers: tuple[int, ...] = (),
           exit_states: bool = True) -> tuple[Path, int]:
    """Check the target and the exit layer, and create out_dir with its meta.json, refusing a
    directory that holds data built with other settings (shards already there are kept).
    aux_layers and exit_states=False are recorded only where given, so older data stays valid."""
    if target.tokenizer is None:
        raise VerispecError(f"{target.name} has no tokenizer: training data is text")
    exit_layer = default_exit_layer(target.model) if exit_layer is None else exit_layer
    layers = len(decoder_layers(target.model))
    if not 1 <= exit_layer < layers:
        raise VerispecError(f"exit layer {exit_layer} is outside the target's layers")
    if list(aux_layers) != sorted(set(aux_layers)) or any(not 0 <= a < layers for a in aux_layers):
        raise VerispecError(f"aux layers must increase within 0..{layers - 1}, got {list(aux_layers)}")
    out = Path(out_dir)
    meta = {"target": target.name, **settings, "exit_layer": exit_layer,
            "hidden_size": target.model.config.hidden_size,
            "dtype": str(target.model.dtype).removeprefix("torch.")}
    if aux_layers:
        meta["aux_layers"] = list(aux_layers)
    if not exit_states:
        meta["exit_states"] = False
    claim_directory(out, "meta.json", meta, "data built")
    return out, exit_layer


def claim_directory(out: Path, name: str, meta: dict, what: str) -> None:
    """Create `out` with `meta` in its file `name`, refusing a directory whose file says other
    settings (what was written there under the same settings is kept, to resume)."""
    meta_file = out / name
    if meta_file.exists() and json.loads(meta_file.read_text()) != meta:
        raise VerispecError(f"{out} holds {what} with other settings ({meta_file}); use another directory")
    out.mkdir(parents=True, exist_ok=True)
    meta_file.write_text(json.dumps(meta, indent=1))


def write_shard(shard: Path, records: list[Sequence], prompt_lens: list[int]) -> None:
    payload = [{"tokens": r.tokens.to(torch.int32), "prompt_len": n, "hidden": r.hidden,
                **({} if r.exit_hidden is None else {"exit_hidden": r.exit_hidden}),
                **({} if r.aux_hidden is None else {"aux_hidden": r.aux_hidden})}
               for r, n in zip(records, prompt_lens)]
    write_whole(shard, lambda partial: torch.save(payload, partial))


# Requests a corpus passage answers: the target reads the passage as its own reply, as it reads
# the answers it writes. {title} is the document's title, where it has one.
TITLED_REQUESTS = ["Tell me about {title}.", "Write an encyclopedia article about {title}.",
                   "What should I know about {title}?"]
UNTITLED_REQUESTS = ["Write a short article.", "Write a news report.", "Tell me what happened."]


def read_documents(path: str | Path) -> list[dict]:
    """Documents of a text corpus: a .jsonl file of {"text", optional "title"} objects, or any
    other text file with one document per non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise VerispecError(f"no corpus file at {path}")
    lines = list(enumerate(path.read_text(encoding="utf-8").splitlines(), 1))
    lines = [(number, line) for number, line in lines if line.strip()]
    if not lines:
        raise VerispecError(f"{path} holds no documents")
    if path.suffix != ".jsonl":
        return [{"title": "", "text": line.strip()} for _, line in lines]
    docs = []
    for number, line in lines:
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as e:
            raise VerispecError(f"{path}:{number} is not JSON ({e.msg})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
            raise VerispecError(f'{path}:{number} has no "text" string')
        docs.append({"title": str(doc.get("title") or ""), "text": doc["text"]})
    return docs


def text_sequences(target: LoadedModel, docs: list[dict], chunk_tokens: int,
                   seed: int = 0) -> list[tuple[list[int], int]]:
    """(ids, prompt length) per corpus chunk: each document cut into chunk_tokens pieces, each
    piece the reply to a chat request (a seeded choice of the requests above)."""
    rng = random.Random(seed)
    out = []
    for doc in docs:
        ids = target.tokenizer(doc["text"], add_special_tokens=False)["input_ids"]
        requests = TITLED_REQUESTS if doc["title"] else UNTITLED_REQUESTS
        for start in range(0, len(ids), chunk_tokens):
            piece = ids[start: start + chunk_tokens]
            if len(piece) < 32:
                continue
            prompt = encode_prompt(target, rng.choice(requests).format(title=doc["title"]), chat=None)
            out.append((prompt + piece, len(prompt)))
    return out


def build_text_dataset(target: LoadedModel, corpus: str | Path, out_dir: str | Path,
                       chunk_tokens: int = 320, batch_size: int = 16, seed: int = 0,
                       exit_layer: int | None = None, aux_layers: tuple[int, ...] = ()) -> Path:
    """Write shards of the target's hidden states over a text corpus into out_dir (resumable).

    Teacher forcing: one forward pass per batch of passages, no generation, so a corpus gives
    several times more training positions per hour than self-distillation (EAGLE trains on fixed
    text too). The passages are real prose the template prompts lack.
    """
    docs = read_documents(corpus)
    digest = hashlib.sha256(Path(corpus).read_bytes()).hexdigest()[:16]
    settings = {"corpus": Path(corpus).name, "corpus_sha256": digest,
                "chunk_tokens": chunk_tokens, "seed": seed}
    out, exit_layer = start_directory(target, out_dir, exit_layer, settings, aux_layers)
    chunks = text_sequences(target, docs, chunk_tokens, seed)
    random.Random(seed).shuffle(chunks)
    batches = [chunks[i: i + batch_size] for i in range(0, len(chunks), batch_size)]
    for index, batch in enumerate(tqdm(batches, desc="corpus hidden states", unit="batch")):
        shard = out / f"shard-{index:05d}.pt"
        if not shard.exists():
            write_shard(shard, features(target, [ids for ids, _ in batch], exit_layer, aux_layers),
                         [n for _, n in batch])
    (out / COMPLETE).touch()
    return out


def is_complete(data_dir: str | Path, batches: int | None = None) -> bool:
    """True once build_dataset has written every shard it was asked for, and at least `batches`
    of them (a larger --data-batches than a directory was built with adds the missing ones)."""
    data = Path(data_dir)
    return (data / COMPLETE).is_file() and (batches is None
                                            or len(list(data.glob("shard-*.pt"))) >= batches)


def load_dataset(data_dir: str | Path) -> tuple[dict, list[Sequence]]:
    """The metadata and every sequence of a dataset directory (the shards memory-mapped)."""
    data = Path(data_dir)
    shards = sorted(data.glob("shard-*.pt"))
    if not (data / "meta.json").is_file() or not shards:
        raise VerispecError(f"{data} holds no training data (build it with `verispec train ... "
                            "--data DIR`, which writes it first)")
    # Memory-mapped: the states stay on disk until a batch reads them (data larger than memory
    # trains; the page cache keeps what is read often).
    sequences = [Sequence(r["tokens"].long(), r["prompt_len"], r["hidden"], r.get("exit_hidden"),
                          r.get("aux_hidden")) for shard in shards for r in torch.load(shard, mmap=True)]
    return json.loads((data / "meta.json").read_text()), sequences
