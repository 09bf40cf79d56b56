"""The data engine: training data for a target from a source's prompts, sized in tokens, with a
held-out split beside it (`verispec train data`, or `--source` in `verispec train KIND`).

Two modes. self: the target writes its own answers to the source's prompts (self-distillation:
batched greedy generation on the target as loaded, then one forward for its states). teacher:
the source's own replies are read as the target's (teacher forcing: one forward per batch of
passages, no generation; several times faster, but the replies are not the target's). A source
that is itself a data directory is read in teacher mode as it is, shard for shard and split for
split: the target's own answers, written once, restated with the states another kind reads.

OUT holds the training shards (the layout of verispec.training.data: they stream from disk as
memory maps, so data larger than memory trains) and OUT/held-out the held-out split, drawn from
prompts the training shards never see. A shard is one batch of a fixed, seeded order of the
source's exchanges: a killed build resumes at the first missing shard, and a larger --tokens
adds shards to a finished one. The training split's batches are cut from windows of SORT_WINDOW
batches sorted by length (a right-padded forward pays for its longest row: ShareGPT's lengths
padded 37% away in seeded order), in a seeded order within each window, so any prefix of the
shards still mixes long and short exchanges; the held-out split keeps the seeded order.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.core.errors import VerispecError
from verispec.core.files import write_json
from verispec.model.loading import LoadedModel
from verispec.request import encode_prompt
from verispec.training.data import (
    COMPLETE,
    Sequence,
    answer,
    features,
    start_directory,
    write_shard,
)
from verispec.training.sources import Exchange, read_source, source_id

MODES = ("self", "teacher")
HELD_OUT = "held-out"  # the held-out split's directory inside the data directory
SORT_WINDOW = 16  # batches whose exchanges are sorted by length together (the training split)


def build_data(target: LoadedModel, out_dir: str | Path, source: str, mode: str = "self",
               tokens: int = 1_000_000, held_out: float = 0.02, batch_size: int = 16,
               max_new_tokens: int = 256, max_prompt_tokens: int = 512, seed: int = 0,
               exit_layer: int | None = None, aux_layers: tuple[int, ...] = (),
               exit_states: bool = True) -> Path:
    """Write `tokens` reply tokens of training data from `source` into out_dir and about
    held_out * tokens into out_dir/held-out, from a held_out fraction of the source's records
    (whole conversations) the training shards never see (resumable; returns out_dir).
    aux_layers and exit_states choose the states stored beside the final one (verispec.training.
    data): EAGLE reads the final state alone, a fifth of what all of them take on disk."""
    if mode not in MODES:
        raise VerispecError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    if tokens < 1 or batch_size < 1 or max_new_tokens < 1 or max_prompt_tokens < 1:
        raise VerispecError("--tokens, the batch size, --max-new-tokens and the prompt limit must be >= 1")
    if not 0 < held_out < 0.5:
        raise VerispecError(f"--held-out must lie in (0, 0.5), got {held_out}")
    budgets = {HELD_OUT: max(1, int(tokens * held_out)), "train": tokens}
    if (Path(source) / "meta.json").is_file():
        return _restate(target, Path(out_dir), Path(source), mode, budgets, held_out, exit_layer,
                        aux_layers, exit_states)
    settings = {"source": source_id(source), "mode": mode, "held_out": held_out,
                "batch_size": batch_size, "max_new_tokens": max_new_tokens,
                "max_prompt_tokens": max_prompt_tokens, "seed": seed, "sort_window": SORT_WINDOW}
    out = Path(out_dir)
    if (out / "meta.json").is_file():  # data with other settings is refused before any work
        start_directory(target, out, exit_layer, settings, aux_layers, exit_states)
        if all(_reached(d, budgets[split]) for split, d in ((HELD_OUT, out / HELD_OUT), ("train", out))):
            return out
    exchanges = read_source(source, seed)
    if mode == "teacher" and any(x.reply is None for x in exchanges):
        raise VerispecError(f"teacher forcing reads the source's replies; {source} has none "
                            "(use --mode self: the target answers its prompts)")
    splits = dict(zip((HELD_OUT, "train"), split_exchanges(exchanges, held_out, seed)))
    batches = {split: _batches(target, splits[split], mode, batch_size, max_new_tokens,
                               max_prompt_tokens, SORT_WINDOW if split == "train" else 1, seed)
               for split in splits}
    return _write_splits(target, out, settings, batches, budgets, mode, max_new_tokens,
                         exit_layer, aux_layers, exit_states, f"{mode} data")


def _write_splits(target: LoadedModel, out: Path, settings: dict, batches: dict[str, Iterator],
                  budgets: dict[str, int], mode: str, max_new_tokens: int, exit_layer: int | None,
                  aux_layers: tuple[int, ...], exit_states: bool, desc: str) -> Path:
    """Claim out and out/held-out for `settings` (refusing other settings), then fill each
    split from its batches up to its budget, with the states asked for."""
    out, exit_layer = start_directory(target, out, exit_layer, settings, aux_layers, exit_states)
    start_directory(target, out / HELD_OUT, exit_layer, settings, aux_layers, exit_states)
    for split, directory in ((HELD_OUT, out / HELD_OUT), ("train", out)):
        _fill(target, directory, batches[split], budgets[split], mode, max_new_tokens,
              lambda sequences: features(target, sequences, exit_layer, aux_layers, exit_states),
              f"{desc} ({split})")
    return out


def _restate(target: LoadedModel, out: Path, source: Path, mode: str, budgets: dict[str, int],
             held_out: float, exit_layer: int | None, aux_layers: tuple[int, ...],
             exit_states: bool) -> Path:
    """Teacher forcing over another data directory's sequences (prompt and reply token ids, as
    they are): the states asked for, from one forward per source shard, no generation. So the
    answers the target wrote once (self mode, the slow part) serve a kind that reads other
    states (EAGLE-3's aux layers from data built --for eagle). Each split is read from the
    source's split of the same name, its shards in order: held out stays held out."""
    if mode != "teacher":
        raise VerispecError(f"--source {source} is a data directory: its sequences are read as they "
                            "are, the target writes nothing (--mode teacher)")
    meta = json.loads((source / "meta.json").read_text())
    if meta.get("target") != target.name:
        raise VerispecError(f"{source} holds data for {meta.get('target')!r}, not {target.name!r}: "
                            "its token ids are another model's")
    if not (source / HELD_OUT / "meta.json").is_file():
        raise VerispecError(f"{source} has no held-out split ({source / HELD_OUT}): not the data "
                            "engine's data")
    settings = {"source": f"data directory {source.name}", "source_meta": meta, "mode": mode,
                "held_out": held_out}
    batches = {split: ([(r["tokens"][: r["prompt_len"]].tolist(), r["tokens"][r["prompt_len"]:].tolist())
                        for r in torch.load(shard, mmap=True)] for shard in sorted(read.glob("shard-*.pt")))
               for split, read in ((HELD_OUT, source / HELD_OUT), ("train", source))}
    return _write_splits(target, out, settings, batches, budgets, mode, 0, exit_layer, aux_layers,
                         exit_states, f"{mode} data from {source.name}")


def split_exchanges(exchanges: list[Exchange], held_out: float,
                    seed: int) -> tuple[list[Exchange], list[Exchange]]:
    """(held-out, training) exchanges, each in a seeded random order: a held_out fraction of the
    source's records (at least one) held out whole, so no turn of a held-out conversation trains."""
    rng = random.Random(seed)
    records = sorted({x.record for x in exchanges})
    rng.shuffle(records)
    held = set(records[: max(1, round(len(records) * held_out))])
    shuffled = exchanges[:]
    rng.shuffle(shuffled)
    return [x for x in shuffled if x.record in held], [x for x in shuffled if x.record not in held]


def _batches(target: LoadedModel, exchanges: list[Exchange], mode: str, batch_size: int,
             max_new_tokens: int, max_prompt_tokens: int, window: int = 1,
             seed: int = 0) -> Iterator[list[tuple[list[int], list[int]]]]:
    """Batches of (prompt ids, reply ids) (reply ids [] in self mode): each `window` batches'
    worth of the exchanges, in their order, sorted by length and cut into batches, which come in
    a seeded order (window 1: the exchanges' own order). Prompts over max_prompt_tokens are left
    out."""
    rng = random.Random(seed)
    pending: list[tuple[list[int], list[int]]] = []
    for x in exchanges:
        prompt = encode_prompt(target, x.prompt, chat=None)
        reply = [] if mode == "self" else target.tokenizer(
            x.reply, add_special_tokens=False)["input_ids"][:max_new_tokens]
        if len(prompt) > max_prompt_tokens or (mode == "teacher" and not reply):
            continue
        pending.append((prompt, reply))
        if len(pending) == window * batch_size:
            yield from _cut(pending, batch_size, window, rng)
            pending = []
    if pending:
        yield from _cut(pending, batch_size, window, rng)


def _cut(pairs: list[tuple[list[int], list[int]]], batch_size: int, window: int,
         rng: random.Random) -> list[list[tuple[list[int], list[int]]]]:
    """One window's pairs as batches: sorted by length (a stable sort: ties keep their order),
    then the batches shuffled by rng (window 1: the one batch as it came)."""
    if window == 1:
        return [pairs]
    ordered = sorted(pairs, key=lambda pair: len(pair[0]) + len(pair[1]))
    batches = [ordered[i: i + batch_size] for i in range(0, len(ordered), batch_size)]
    rng.shuffle(batches)
    return batches


def _fill(target: LoadedModel, directory: Path, batches: Iterator, budget: int, mode: str,
          max_new_tokens: int, states: Callable[[list[list[int]]], list[Sequence]],
          desc: str) -> None:
    """Write shards into directory until they hold `budget` reply tokens (shards already there
    count and are kept), then mark it complete. states: the stored states of a batch's
    sequences."""
    if _reached(directory, budget):
        return
    done = shard_tokens(directory)
    reached = sum(done.values())
    bar = tqdm(total=budget, initial=min(reached, budget), desc=desc, unit="tok", unit_scale=True)
    exhausted = True
    for index, batch in enumerate(batches):
        if index in done:
            continue
        if reached >= budget:
            exhausted = False
            break
        prompts = [prompt for prompt, _ in batch]
        sequences = (answer(target, prompts, max_new_tokens) if mode == "self"
                     else [prompt + reply for prompt, reply in batch])
        write_shard(directory / f"shard-{index:05d}.pt", states(sequences), [len(p) for p in prompts])
        made = sum(len(s) - len(p) for s, p in zip(sequences, prompts))
        reached += made
        bar.update(min(made, budget - bar.n))
    bar.close()
    if exhausted and reached < budget:
        print(f"verispec: the source ran out at {reached} tokens of the {budget} asked for "
              f"({directory})", file=sys.stderr)
    write_json(directory / COMPLETE, {"tokens": reached, "exhausted": exhausted}, indent=None)


def _reached(directory: Path, budget: int) -> bool:
    """True where directory's build finished with `budget` tokens, or ran its source dry."""
    marker = directory / COMPLETE
    if not marker.is_file():
        return False
    state = json.loads(marker.read_text() or "{}")
    return state.get("exhausted", False) or state.get("tokens", 0) >= budget


def shard_tokens(directory: Path) -> dict[int, int]:
    """Shard index -> the reply tokens it holds, for the shards in directory (memory-mapped:
    only the token ids are read)."""
    found = {}
    for shard in sorted(directory.glob("shard-*.pt")):
        records = torch.load(shard, mmap=True)
        found[int(shard.stem.removeprefix("shard-"))] = sum(len(r["tokens"]) - r["prompt_len"]
                                                            for r in records)
    return found
