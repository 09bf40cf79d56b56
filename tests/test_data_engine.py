"""The data engine (verispec.training.data_engine, sources): each mode on a tiny target, sized by
tokens with a held-out split, a killed build that resumes where it stopped, cut and malformed
sources, shards that stay on disk, and training that evaluates on the held-out split."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

import verispec.training.data_engine as engine_module
from tests.tiny import save_tiny
from verispec.cli import main
from verispec.core.errors import VerispecError
from verispec.model.loading import load_model
from verispec.training import sources
from verispec.training.data import answer, features, load_dataset
from verispec.training.data_engine import HELD_OUT, build_data, shard_tokens, split_exchanges
from verispec.training.prompts import make_prompts
from verispec.training.recipes import train_drafter
from verispec.training.shell import RecipeOptions
from verispec.training.sources import exchanges_of, json_array_records, read_jsonl
from verispec.training.trainer import TrainConfig

AUX = (0, 1, 2)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(str(save_tiny(tmp_path_factory.mktemp("target"), seed=0)))


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randint(5, 63)}" for _ in range(n))  # words the tokenizer knows


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """60 prompt/reply records in the tiny tokenizer's words."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "chats.jsonl"
    rows = [{"prompt": words(rng, rng.randint(2, 6)), "reply": words(rng, rng.randint(8, 20))}
            for _ in range(60)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build(loaded, out, corpus, mode, tokens=200, **kw):
    return build_data(loaded, out, str(corpus), mode, tokens, held_out=0.1, batch_size=4,
                      max_new_tokens=12, exit_layer=1, **{"aux_layers": AUX, **kw})


def reply_tokens(directory) -> int:
    return sum(shard_tokens(directory).values())


@pytest.mark.parametrize("mode", ["self", "teacher"])
def test_each_mode_builds_the_tokens_asked_for_and_a_disjoint_held_out_split(loaded, corpus, tmp_path, mode):
    out = build(loaded, tmp_path / "d", corpus, mode)
    train_tokens, held_tokens = reply_tokens(out), reply_tokens(out / HELD_OUT)
    assert 200 <= train_tokens < 200 + 4 * 20  # stops within one shard past the budget
    assert 20 <= held_tokens < 20 + 4 * 20
    _, train_seqs = load_dataset(out)
    _, held_seqs = load_dataset(out / HELD_OUT)
    prompts = {tuple(s.tokens[: s.prompt_len].tolist()) for s in train_seqs}
    assert not prompts & {tuple(s.tokens[: s.prompt_len].tolist()) for s in held_seqs}
    assert all(s.aux_hidden.shape[-1] == 3 * loaded.model.config.hidden_size for s in train_seqs)
    first = train_seqs[:4]
    ids = [s.tokens.tolist() for s in first]
    if mode == "self":  # the target's own greedy answers to the prompts
        assert ids == answer(loaded, [s[: f.prompt_len] for s, f in zip(ids, first)], 12)
    else:  # the source's replies, verbatim after the prompt (cut at max_new_tokens)
        replies = [json.loads(line)["reply"] for line in corpus.read_text().splitlines()]
        for s in first:
            reply = loaded.tokenizer.decode(s.tokens[s.prompt_len:])
            assert 0 < len(s.tokens) - s.prompt_len <= 12
            assert any(r.startswith(reply) for r in replies)
    expected = features(loaded, ids, 1, AUX)
    for s, e in zip(first, expected):
        assert torch.equal(s.hidden, e.hidden) and torch.equal(s.aux_hidden, e.aux_hidden)


def test_a_killed_build_resumes_where_it_stopped(loaded, corpus, tmp_path, monkeypatch):
    reference = build(loaded, tmp_path / "ref", corpus, "self")
    real, calls = engine_module.write_shard, []

    def dies_on_the_third(shard, records, prompt_lens):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(shard.name)
        real(shard, records, prompt_lens)

    monkeypatch.setattr(engine_module, "write_shard", dies_on_the_third)
    out = tmp_path / "d"
    with pytest.raises(KeyboardInterrupt):
        build(loaded, out, corpus, "self")
    monkeypatch.setattr(engine_module, "write_shard", real)
    written = {p: p.stat().st_mtime_ns for p in out.rglob("shard-*.pt")}
    assert len(written) == 2 and not (out / "complete").exists()  # killed mid-way
    built = []
    monkeypatch.setattr(engine_module, "write_shard",
                        lambda shard, *rest: (built.append(shard), real(shard, *rest)))
    build(loaded, out, corpus, "self")
    assert built and not set(built) & written.keys()  # continued: nothing written twice
    assert {p: p.stat().st_mtime_ns for p in written} == written
    for directory in (HELD_OUT, "."):
        got, want = load_dataset(out / directory)[1], load_dataset(reference / directory)[1]
        assert [s.tokens.tolist() for s in got] == [s.tokens.tolist() for s in want]
    built.clear()
    build(loaded, out, corpus, "self")  # complete: nothing rebuilt
    assert not built
    before = set(out.rglob("shard-*.pt"))
    build(loaded, out, corpus, "self", tokens=400)  # more tokens: shards added, none rewritten
    assert built and reply_tokens(out) >= 400 and not set(built) & before


def test_training_batches_are_cut_from_length_sorted_windows(loaded, corpus):
    """Each window's exchanges, sorted by length, make its batches (less padding), in a seeded
    order; the same exchanges as the seeded order's, none lost or doubled."""
    exchanges = read_jsonl(corpus)
    plain = list(engine_module._batches(loaded, exchanges, "teacher", 4, 12, 512))
    windowed = list(engine_module._batches(loaded, exchanges, "teacher", 4, 12, 512, window=3, seed=5))
    assert sorted(map(sorted, plain)) != sorted(map(sorted, windowed))  # other batches...
    assert sorted(p for b in plain for p in b) == sorted(p for b in windowed for p in b)  # ...same pairs

    def width(batch):
        return max(len(p) + len(r) for p, r in batch)

    assert sum(map(width, windowed)) < sum(map(width, plain))
    for start in range(0, len(windowed), 3):  # a window's batches hold disjoint length ranges
        spans = sorted((min(len(p) + len(r) for p, r in b), width(b)) for b in windowed[start: start + 3])
        assert all(low[1] <= high[0] for low, high in zip(spans, spans[1:]))
    orders = [[width(b) for b in windowed[:3]],
              [width(b) for b in engine_module._batches(loaded, exchanges, "teacher", 4, 12, 512,
                                                         window=3, seed=6)][:3]]
    assert orders[0] != sorted(orders[0]) or orders[1] != sorted(orders[1])  # not shortest first
    assert windowed == list(engine_module._batches(loaded, exchanges, "teacher", 4, 12, 512,
                                                   window=3, seed=5))  # resumable: seeded


def test_teacher_forcing_needs_replies_and_other_settings_need_another_directory(loaded, corpus, tmp_path):
    with pytest.raises(VerispecError, match="teacher forcing reads the source's replies"):
        build_data(loaded, tmp_path / "t", "templates", "teacher", 10, exit_layer=1)
    build(loaded, tmp_path / "d", corpus, "teacher", tokens=20)
    with pytest.raises(VerispecError, match="other settings"):
        build(loaded, tmp_path / "d", corpus, "self", tokens=20)


def test_a_cut_json_array_stops_at_the_last_whole_record_and_says_so(capsys):
    records = [{"id": i, "conversations": [{"from": "human", "value": f"q{i}"},
                                           {"from": "gpt", "value": f"a{i}"}]} for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text[: text.index('"id": 4') + 12]
    assert json_array_records(cut, "file.json") == records[:4]
    assert "read its 4 whole records" in capsys.readouterr().err
    assert json_array_records(text, "file.json") == records
    broken = text.replace('"id": 2', '"id": 2,,', 1)
    with pytest.raises(VerispecError, match=r"file.json:\d+ is not JSON"):
        json_array_records(broken, "file.json")
    assert [(x.prompt, x.reply) for x in exchanges_of(records[0])] == [("q0", "a0")]


def test_a_cut_jsonl_file_stops_at_its_last_whole_line_and_a_bad_line_is_named(tmp_path, capsys):
    path = tmp_path / "c.jsonl"
    rows = [json.dumps({"prompt": f"p{i}", "reply": f"r{i}"}) for i in range(3)]
    path.write_text("\n".join(rows) + "\n" + rows[0][:10])
    assert [x.prompt for x in read_jsonl(path)] == ["p0", "p1", "p2"]
    assert "c.jsonl:4 is cut short: read the 3 whole records" in capsys.readouterr().err
    path.write_text(rows[0] + "\n{oops\n" + rows[1] + "\n")
    with pytest.raises(VerispecError, match=r"c.jsonl:2 is not JSON"):
        read_jsonl(path)
    path.write_text(json.dumps({"other": 1}) + "\n")
    with pytest.raises(VerispecError, match=r"c.jsonl:1 holds no exchange"):
        read_jsonl(path)
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n"
                    + json.dumps({"title": "T", "text": "body"}) + "\n")
    assert [(x.prompt, x.reply) for x in read_jsonl(path)] == [("hi", "hello"),
                                                               ("Tell me about T.", "body")]


def test_shards_are_read_as_memory_maps(loaded, corpus, tmp_path):
    """Training data stays on disk (data larger than memory trains): load_dataset's states are
    views of file-backed storage, not copies in memory."""
    out = build(loaded, tmp_path / "d", corpus, "teacher", tokens=40)
    _, sequences = load_dataset(out)
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        pytest.skip("no /proc/self/maps to read the mappings from")
    mapped = []  # (start, end) of every mapping of a shard file
    for line in maps.read_text().splitlines():
        if line.endswith(".pt") and str(out) in line:
            start, end = (int(a, 16) for a in line.split()[0].split("-"))
            mapped.append((start, end))
    pointers = [s.hidden.data_ptr() for s in sequences] + [s.aux_hidden.data_ptr() for s in sequences]
    assert all(any(start <= ptr < end for start, end in mapped) for ptr in pointers)


def test_training_on_engine_data_evaluates_on_its_held_out_split(loaded, corpus, tmp_path):
    data = build(loaded, tmp_path / "d", corpus, "teacher", tokens=120)
    config = TrainConfig(steps=2, warmup=1, batch_size=4, eval_every=2, checkpoint_every=2)
    saved = train_drafter("eagle3", loaded, [data], tmp_path / "e3", config, RecipeOptions(vocab=48))
    drafter = json.loads((saved / "drafter.json").read_text())
    assert drafter["training"]["sequences"] == len(load_dataset(data)[1])
    assert "eval_top1_step1" in drafter["training"]["final_eval"]


def test_a_training_size_cuts_the_first_directory_and_keeps_the_mixed_ones_whole(loaded, corpus, tmp_path):
    """max_tokens (a training curve's size) takes the leading sequences of the first directory
    holding that many reply tokens; the directories mixed in beside it train in full."""
    data = build(loaded, tmp_path / "d", corpus, "teacher", tokens=120)
    mixed = build(loaded, tmp_path / "m", corpus, "self", tokens=40)
    first, whole = load_dataset(data)[1], load_dataset(mixed)[1]
    config = TrainConfig(steps=1, warmup=1, batch_size=4, eval_every=1, checkpoint_every=1)
    saved = train_drafter("eagle", loaded, [data, mixed], tmp_path / "e", config, max_tokens=30)
    kept = json.loads((saved / "drafter.json").read_text())["training"]["sequences"]
    leading = next(n for n in range(1, len(first) + 1)
                   if sum(len(s.tokens) - s.prompt_len for s in first[:n]) >= 30)
    assert leading < len(first) and kept == leading + len(whole)


def test_train_data_command_and_its_errors(tiny_dir, corpus, tmp_path, capsys):
    out = tmp_path / "cmd"
    assert main(["train", "data", "--target", str(tiny_dir), "--out", str(out), "--source",
                 str(corpus), "--mode", "teacher", "--tokens", "30", "--exit-layer", "1"]) == 0
    assert reply_tokens(out) >= 30 and reply_tokens(out / HELD_OUT) >= 1
    assert main(["train", "data", "--target", str(tiny_dir), "--out", str(out), "--source",
                 str(tmp_path / "missing.jsonl")]) == 2
    assert "neither 'sharegpt', 'templates', a file nor a data directory" in capsys.readouterr().err
    assert main(["train", "data", "--out", str(tmp_path / "y"), "--source", str(corpus),
                 "--steps", "9", "--stop-at", "30"]) == 2  # nothing is trained: said, not ignored
    assert "--steps, --stop-at: training options" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()
    assert main(["train", "eagle", "--out", str(tmp_path / "x"), "--tokens", "5"]) == 2
    assert "give --source" in capsys.readouterr().err
    assert main(["train", "eagle", "--out", str(tmp_path / "x"), "--heads", "2"]) == 2
    assert "--heads: not an option of the eagle drafter" in capsys.readouterr().err


def test_data_for_some_kinds_stores_only_the_states_they_read(tiny_dir, loaded, corpus, tmp_path, capsys):
    """--for eagle stores the final states alone (no exit-layer, no aux-layer states), in both
    splits; eagle trains on it, and a kind that reads the states left out is refused by name."""
    lean, full = tmp_path / "lean", tmp_path / "full"
    for out, more in ((lean, ["--for", "eagle,medusa"]), (full, [])):
        assert main(["train", "data", "--target", str(tiny_dir), "--out", str(out), "--source",
                     str(corpus), "--mode", "teacher", "--tokens", "60", "--exit-layer", "1",
                     *more]) == 0
    for directory in (lean, lean / HELD_OUT):
        meta, sequences = load_dataset(directory)
        assert meta["exit_states"] is False and "aux_layers" not in meta
        assert all(s.exit_hidden is None and s.aux_hidden is None for s in sequences)
        records = torch.load(next(directory.glob("shard-*.pt")), mmap=True)
        assert set(records[0]) == {"tokens", "prompt_len", "hidden"}
    # the same tokens and final states as data for every kind, which holds the other states too
    lean_seqs, full_seqs = load_dataset(lean)[1], load_dataset(full)[1]
    assert [s.tokens.tolist() for s in lean_seqs] == [s.tokens.tolist() for s in full_seqs]
    assert all(torch.equal(a.hidden, b.hidden) for a, b in zip(lean_seqs, full_seqs))
    assert all(s.exit_hidden is not None and s.aux_hidden is not None for s in full_seqs)
    config = TrainConfig(steps=1, warmup=1, batch_size=4, eval_every=1, checkpoint_every=1)
    assert (train_drafter("eagle", loaded, [lean], tmp_path / "e", config) / "drafter.json").is_file()
    for kind, options, needs in (("early-exit", RecipeOptions(), "after its exit layer"),
                                 ("eagle", RecipeOptions(mid_state=True), "after its exit layer"),
                                 ("eagle3", RecipeOptions(vocab=48), "after its aux layers")):
        with pytest.raises(VerispecError, match=needs):
            train_drafter(kind, loaded, [lean], tmp_path / kind, config, options)
    # early-exit's data keeps the exit-layer states, and leaves out the aux layers'
    assert main(["train", "data", "--target", str(tiny_dir), "--out", str(tmp_path / "exit"),
                 "--source", str(corpus), "--mode", "teacher", "--tokens", "20", "--exit-layer",
                 "1", "--for", "early-exit"]) == 0
    meta, sequences = load_dataset(tmp_path / "exit")
    assert "exit_states" not in meta and "aux_layers" not in meta
    assert all(s.exit_hidden is not None and s.aux_hidden is None for s in sequences)
    # inside `verispec train KIND`: EAGLE with --mid-state keeps the exit-layer states it reads
    assert main(["train", "eagle", "--target", str(tiny_dir), "--out", str(tmp_path / "mid"),
                 "--source", str(corpus), "--mode", "teacher", "--tokens", "20", "--for", "eagle",
                 "--mid-state", "--steps", "1"]) == 0
    meta, sequences = load_dataset(tmp_path / "mid" / "data")
    assert "exit_states" not in meta and "aux_layers" not in meta
    assert all(s.exit_hidden is not None for s in sequences)
    for args, said in ((["train", "data", "--source", str(corpus), "--for", "eagle,nope"],
                        "--for 'eagle,nope': name kinds from"),
                       (["train", "eagle", "--for", "eagle"], "--for chooses the states"),
                       (["train", "medusa", "--source", str(corpus), "--for", "eagle",
                         "--target", str(tiny_dir)], "the data is for other kinds than medusa")):
        assert main([*args, "--out", str(tmp_path / "refused")]) == 2
        assert said in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_a_data_directory_is_restated_with_the_states_another_kind_reads(loaded, corpus, tmp_path):
    """The target's own answers built --for eagle (final states alone) read again as a source:
    each split from the source's split, the same sequences in the same shards, now with the aux
    states EAGLE-3 reads, equal to a build that stored them from the start; resumable, and
    refused in self mode or for another target, with nothing written."""
    lean = build(loaded, tmp_path / "lean", corpus, "self", aux_layers=(), exit_states=False)
    whole = build(loaded, tmp_path / "whole", corpus, "self")  # the same answers, every state
    out = tmp_path / "restated"
    assert build_data(loaded, out, str(lean), "teacher", 200, held_out=0.1, exit_layer=1,
                      aux_layers=AUX, exit_states=False) == out
    for split in (".", HELD_OUT):
        got, want = load_dataset(out / split)[1], load_dataset(whole / split)[1]
        assert [s.tokens.tolist() for s in got] == [s.tokens.tolist() for s in want]
        assert [s.prompt_len for s in got] == [s.prompt_len for s in want]
        assert all(torch.equal(a.hidden, b.hidden) and torch.equal(a.aux_hidden, b.aux_hidden)
                   and a.exit_hidden is None for a, b in zip(got, want))
        assert sorted(p.name for p in (out / split).glob("shard-*.pt")) == \
            sorted(p.name for p in (lean / split).glob("shard-*.pt"))
    assert load_dataset(out)[0]["source_meta"] == json.loads((lean / "meta.json").read_text())
    shard = out / "shard-00001.pt"  # a killed restate: the missing shard is made again, alone
    kept = {p: p.stat().st_mtime_ns for p in out.glob("shard-*.pt") if p != shard}
    shard.unlink()
    (out / "complete").unlink()
    build_data(loaded, out, str(lean), "teacher", 200, held_out=0.1, exit_layer=1,
               aux_layers=AUX, exit_states=False)
    assert shard.is_file() and {p: p.stat().st_mtime_ns for p in kept} == kept
    other = dataclasses.replace(loaded, name="another-model")
    for model, mode, said in ((loaded, "self", "its sequences are read as they are"),
                              (other, "teacher", "its token ids are another model's")):
        with pytest.raises(VerispecError, match=said):
            build_data(model, tmp_path / "refused", str(lean), mode, 200, exit_layer=1)
    assert not (tmp_path / "refused").exists()
    # the command line: --source DIR --mode teacher --for eagle3
    assert main(["train", "data", "--target", loaded.name, "--out", str(tmp_path / "cmd"),
                 "--source", str(lean), "--mode", "teacher", "--tokens", "40", "--exit-layer", "1",
                 "--for", "eagle3"]) == 0
    meta, sequences = load_dataset(tmp_path / "cmd")
    assert meta["aux_layers"] and all(s.aux_hidden is not None for s in sequences)


def test_a_conversation_is_held_out_whole(tmp_path):
    """Every exchange of a held-out conversation is held out: no turn of it trains."""
    path = tmp_path / "c.jsonl"
    turns = [{"from": f, "value": f"{f}{i}"} for i in range(4) for f in ("human", "gpt")]
    path.write_text("".join(json.dumps({"conversations": [dict(t, value=t["value"] + f"-{n}")
                                                          for t in turns]}) + "\n" for n in range(30)))
    exchanges = read_jsonl(path)
    assert len(exchanges) == 120 and {x.record for x in exchanges} == set(range(30))
    assert all(x.prompt.endswith(f"-{x.record}") for x in exchanges)
    held, train = split_exchanges(exchanges, 0.1, seed=0)
    assert len({x.record for x in held}) == 3 and len(held) + len(train) == 120
    assert not {x.record for x in held} & {x.record for x in train}


def test_unseen_templated_prompts_are_none_of_the_training_seeds(monkeypatch):
    """A seed's own prompts repeat seed 0's (the families that run out); the held-out prompts a
    trained drafter is measured on are the seed's that seed 0's templated source does not hold,
    and a seed that cannot give enough of them is an error, not a shorter set."""
    trained = set(make_prompts(sources.TEMPLATE_PROMPTS, 0))
    assert sources.trained_prompts() == trained
    assert sum(p in trained for p in make_prompts(20, 785)) >= 10  # why the filter exists
    unseen = sources.unseen_prompts(20, 785)
    assert len(set(unseen)) == 20 and not trained & set(unseen)
    assert set(unseen) <= set(make_prompts(sources.UNSEEN_DRAW * 20, 785))
    assert unseen == sources.unseen_prompts(20, 785)
    monkeypatch.setattr(sources, "UNSEEN_DRAW", 1)  # 20 drawn, fewer than 20 of them unseen
    with pytest.raises(VerispecError, match="templated prompts unseen in training"):
        sources.unseen_prompts(20, 785)
