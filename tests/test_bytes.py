"""The byte model: its tokenizer, exact speculation on bytes, UTF-8 through drafts and streams.

A tiny byte model is trained here in seconds (verispec.training.bytes, its own multi-token heads
included) on a short text full of multi-byte characters, until it recites the text: its greedy
output then holds those characters, its heads' drafts are often accepted, and drafts and stream
chunks end inside characters. The shipped byte model ("bytes") is checked at the end.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distribution import POWER, assert_follows, exact_marginals, runs_for, sample_runs
from verispec.api import generate, stream
from verispec.cli import main
from verispec.core.policies import ConstantK, LoadCap
from verispec.core.stopping import StoppingRules
from verispec.core.tree import TreeSettings
from verispec.core.types import Fate, SamplingParams, Step
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.display import TokenPieces
from verispec.drafters.learned import shipped_drafter
from verispec.drafters.mtp import MTPDrafter
from verispec.drafters.suffix import forget_outputs
from verispec.methods import build_engine
from verispec.model.bytes import BOS, EOS, SPECIALS, VOCAB_SIZE, byte_tokenizer
from verispec.model.loading import PACKAGED_MODELS, load_model
from verispec.options import DraftOptions
from verispec.server.text import TextStream
from verispec.training.bytes import (
    ByteModelOptions,
    Window,
    chat_ids,
    export_byte_model,
    held_out,
    new_byte_model,
    utf8,
)

# Multi-byte characters of every length (2: é ö ß, 3: € ✓ 日本, 4: 😀 🐍), code and prose.
TEXT = ("naïve café: 10 € ✓ — déjà vu 😀\n"
        "def grüße(n):\n    return '日本' * n  # 🐍\n"
        "Straße, Öl, żółw, Ελλάδα, 東京 → ok\n")
NEW = 60


def bytes_of(ids: list[int]) -> bytes:
    return bytes(t for t in ids if t < 256)


def ends_inside_a_character(data: bytes) -> bool:
    """Whether data stops in the middle of a UTF-8 character."""
    try:
        data.decode()
    except UnicodeDecodeError as error:
        return error.reason == "unexpected end of data"
    return False


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A byte model (2 layers, width 32) with 3 extra heads, trained to recite TEXT, exported as
    `verispec train bytes` exports: (LoadedModel, the heads' drafter directory)."""
    # 100 steps: its heads draft what the target keeps (tau 4.0 below; 250 steps, the same, took
    # 2.5 times as long)
    torch.manual_seed(0)
    options = ByteModelOptions(hidden=32, layers=2, attention_heads=2, heads=3, context=256)
    module = new_byte_model(options)
    stream_ = utf8(TEXT * 60)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(100):
            starts = torch.randint(0, len(stream_) - options.context, (8,))
            module.loss([Window(stream_[s: s + options.context], "code") for s in starts])
            optimizer.step()
            optimizer.zero_grad()
    finally:
        torch.set_num_threads(threads)
    out = tmp_path_factory.mktemp("bytes")
    eval_items = [Window(stream_[i * 256: (i + 1) * 256], kind)
                  for i, kind in enumerate(["code", "chat"] * 2)]
    export_byte_model(module, out, {"test": True}, eval_items)
    return load_model(str(out / "model")), out / "mtp"


@pytest.fixture(scope="module")
def prompt(tiny) -> list[int]:
    """Raw text through the byte tokenizer (BOS, then bytes): the text once, then its start."""
    return tiny[0].tokenizer(TEXT + TEXT[:20])["input_ids"]


def test_byte_tokenizer_round_trips_text_and_marks_incomplete_characters():
    tokenizer = byte_tokenizer()
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == [BOS, *TEXT.encode()]
    assert tokenizer(TEXT, add_special_tokens=False)["input_ids"] == list(TEXT.encode())
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    euro = list("€".encode())
    assert tokenizer.decode(euro[:2]) == "\ufffd"  # incomplete: held back by streams
    assert len(tokenizer) == VOCAB_SIZE and tokenizer.eos_token_id == EOS
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hé"}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    assert chat == chat_ids("hé", "", False).tolist()  # the layout the model trains on


def test_byte_tokenizer_loads_as_a_plain_hugging_face_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    byte_tokenizer().save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(TEXT)["input_ids"] == [BOS, *TEXT.encode()]
    assert loaded.convert_ids_to_tokens(sorted(SPECIALS)) == [SPECIALS[i] for i in sorted(SPECIALS)]


def test_stream_pieces_never_split_a_character():
    """Steps cut at every byte boundary, drafts kept, refused and corrected: each piece is whole
    characters, and the pieces add up to the text."""
    tokenizer = byte_tokenizer()
    data = list(TEXT.encode())
    for width in (1, 2, 3, 5):
        pieces, stream_ = TokenPieces(tokenizer), TextStream(tokenizer)
        shown, content = [], []
        for start in range(0, len(data), width):
            block = data[start: start + width]
            fates = [Fate.ACCEPTED] * (len(block) - 1) + [Fate.RECOVERED]
            # a refused lead byte before each correction
            step = Step(tokens=block, fates=fates, rejected=[0xE2], num_drafted=len(block),
                        num_accepted=len(block) - 1)
            shown += pieces.push(step)[0]
            stream_.push(step)
            content.append(stream_.content(final=False))
        content.append(stream_.content(final=True))
        assert all("\ufffd" not in piece for piece in shown + content), width
        assert "".join(shown) == TEXT == "".join(content), width


def test_mtp_heads_of_the_byte_model_are_found_and_read_its_trunk(tiny):
    loaded, heads = tiny
    drafter = MTPDrafter.load(heads, loaded.model)
    assert drafter.hidden_layers == (1,)  # the trunk's output: the state after layer L - 1
    config = json.loads((heads / "drafter.json").read_text())
    assert config["settings"]["trunk_layer"] == 1 and len(config["rank_accuracy"]) == 3


@pytest.mark.parametrize("k", [1, 3, 8])
def test_byte_model_methods_match_plain_decoding(tiny, prompt, k):
    """Greedy: MTP self-speculation (chain and tree), pld, suffix and lookahead give the plain
    decoding's bytes exactly."""
    loaded, heads = tiny
    truth = build_engine(loaded, "ar").generate(SequenceSpec(prompt, StoppingRules.build(NEW))).token_ids
    assert sum(b >= 0x80 for b in bytes_of(truth)) > 10  # multi-byte characters in the output
    cases = {"mtp": DraftOptions(k=k, draft=str(heads)),
             "mtp-tree": DraftOptions(k=k, draft=str(heads), tree=TreeSettings(2, 6)),
             "pld": DraftOptions(k=k), "suffix": DraftOptions(k=k),
             "pld-tree": DraftOptions(k=k, tree=TreeSettings(2, 6)),
             "lookahead": DraftOptions(k=min(k, 3))}
    for name, options in cases.items():
        result = build_engine(loaded, name.removesuffix("-tree"), options).generate(
            SequenceSpec(prompt, StoppingRules.build(NEW)))
        assert result.token_ids == truth, f"{name} at k={k} diverged from plain decoding"


def test_mtp_self_speculation_keeps_drafts_on_bytes(tiny, prompt):
    """The equality above is not only rejections: the heads' drafts are mostly kept."""
    loaded, heads = tiny
    result = build_engine(loaded, "mtp", DraftOptions(draft=str(heads))).generate(
        SequenceSpec(prompt, StoppingRules.build(NEW)))
    assert result.stats.mean_accepted_tokens > 2.0


def test_drafts_and_stream_chunks_split_characters_and_the_text_stays_whole(tiny, prompt):
    """Committed blocks (one stream chunk each) that end inside a character, drafted ones among
    them; the streamed text never holds a broken character and equals the whole output."""
    loaded, heads = tiny
    for method, options in (("mtp", DraftOptions(draft=str(heads))), ("pld", DraftOptions())):
        result = generate(loaded, TEXT + TEXT[:20], method=method, options=options, max_new_tokens=NEW)
        done, split_drafted = [], 0
        for step in result.steps:
            done += step.tokens
            split_drafted += step.num_drafted > 0 and ends_inside_a_character(bytes_of(done))
        assert split_drafted > 0, method
        chunks = list(stream(loaded, TEXT + TEXT[:20], method=method, options=options,
                             max_new_tokens=NEW))
        assert all("\ufffd" not in chunk for chunk in chunks), method
        # The stream holds back a character the token budget cut (it never completes); the
        # result's text is the tokenizer's decoding, U+FFFD for it, as Hugging Face decodes.
        data = bytes_of(result.token_ids)
        assert "".join(chunks) == data.decode(errors="ignore"), method
        assert result.text == data.decode(errors="replace"), method


@pytest.mark.slow  # 20 s on the AVX2 EPYC (and the next, 14 s each): sampled in the slow checks
@pytest.mark.parametrize("skew", POWER)
def test_mtp_sampling_on_bytes_follows_the_target(tiny, skew):
    """Drafts sampled from the byte heads' warped q (top-k 6, so the exact law of three bytes is
    enumerated; a high temperature, so that the recited text's laws are far from one-hot): drafts
    made, kept and refused, and each position's law the target's."""
    loaded, heads = tiny
    model = loaded.model
    prompt = loaded.tokenizer("Stra")["input_ids"]
    sampling = SamplingParams(do_sample=True, temperature=3.0, top_k=6)

    def make():
        return MTPDrafter.load(heads, model)

    engine = SpeculativeEngine(model, make(), ConstantK(3), spawn=make, load_cap=LoadCap(()))
    exact = exact_marginals(model, prompt, 3, sampling)
    sampled = sample_runs(engine, prompt, 3, sampling, runs_for(exact, skew))
    sampled.check_drafting(positions=2)
    assert_follows(sampled, exact, "byte mtp", skew)


@pytest.mark.slow
@pytest.mark.parametrize("skew", POWER)
@pytest.mark.parametrize("method", ["self-int4-pld", "suffix"])
def test_model_free_and_self_drafts_sample_the_byte_models_law(tiny, prompt, method, skew):
    """The methods that pay on the shipped byte model, sampled: the 4-bit copy behind prompt
    lookup, and suffix, through `build_engine` as the front doors build them, on a prompt whose
    text repeats (so lookups find drafts); drafts made, kept and refused, each of the first three
    bytes' law the target's (top-k 6 enumerates it)."""
    loaded, _ = tiny
    sampling = SamplingParams(do_sample=True, temperature=3.0, top_k=6)
    engine = build_engine(loaded, method, DraftOptions(k=3))
    engine.load_cap = LoadCap(())  # the samples run as one batch: never capped for its size
    exact = exact_marginals(loaded.model, prompt, 3, sampling)
    # each batch from an empty suffix cache: one batch's 500 sampled answers, counted, make the
    # next batches' drafts one byte long (the full-power run's 23 k samples drafted a second
    # byte in its first batch only)
    sampled = sample_runs(engine, prompt, 3, sampling, runs_for(exact, skew),
                          before_batch=lambda: forget_outputs(loaded.model))
    sampled.check_drafting(positions=2)
    assert_follows(sampled, exact, f"byte {method}", skew)


def test_train_bytes_command_writes_a_model_and_its_heads(tmp_path, capsys):
    """`verispec train bytes` end to end on a tiny writer and a tiny model (a few steps)."""
    from tests.tiny import save_tiny

    writer = save_tiny(tmp_path / "writer")
    out = tmp_path / "out"
    args = ["train", "bytes", "--target", str(writer), "--out", str(out), "--steps", "2",
            "--batch-size", "2", "--hidden", "32", "--layers", "2", "--heads", "2", "--context",
            "64", "--prompts", "64", "--max-new-tokens", "4"]
    assert main(args) == 0
    loaded = load_model(str(out / "model"))
    training = json.loads((out / "model" / "training.json").read_text())
    assert training["corpus"]["code_train"]["documents"] > 100
    assert {"bits_head1", "bits_head3", "bits_code", "bits_chat"} <= set(training["held_out_bits"])
    assert MTPDrafter.load(out / "mtp", loaded.model).net.num_heads == 2
    assert training["step"] == 2
    capsys.readouterr()
    assert main([*args, "--text", str(tmp_path / "corpus.txt")]) == 2
    assert "--text: drafter training options" in capsys.readouterr().err


@pytest.mark.slow  # 17 s: the default suite keeps the train command's own test above
def test_train_bytes_stops_at_a_step_of_its_schedule_and_resumes_past_it(tmp_path, capsys):
    """--stop-at exports what an interrupted run reached, on the --steps schedule; the command
    without it resumes from there and ends where one uninterrupted run ends, on the same learning
    rates."""
    from tests.tiny import assert_resumed_as_one_run, save_tiny

    writer = save_tiny(tmp_path / "writer")
    base = ["train", "bytes", "--target", str(writer), "--data", str(tmp_path / "data"), "--steps",
            "4", "--batch-size", "2", "--hidden", "32", "--layers", "2", "--heads", "1",
            "--context", "64", "--prompts", "64", "--max-new-tokens", "4"]
    assert main([*base, "--out", str(tmp_path / "a"), "--stop-at", "2"]) == 0
    assert json.loads((tmp_path / "a" / "model" / "training.json").read_text())["step"] == 2
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    assert main([*base, "--out", str(tmp_path / "b")]) == 0
    assert_resumed_as_one_run(tmp_path / "a" / "run", tmp_path / "b" / "run", 4)
    assert json.loads((tmp_path / "a" / "model" / "training.json").read_text())["step"] == 4
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "a"), "--stop-at", "3"]) == 2  # past it already
    assert "past 3" in capsys.readouterr().err
    assert main([*base, "--out", str(tmp_path / "c"), "--stop-at", "5"]) == 2
    assert "--stop-at" in capsys.readouterr().err


def test_held_out_split_is_by_name_and_never_holds_out_quoted_modules():
    assert not held_out("json/decoder.py") and not held_out("textwrap.py")
    names = [f"module{i}.py" for i in range(400)]
    assert 5 < sum(map(held_out, names)) < 40  # about one in 20


@pytest.mark.skipif(not (PACKAGED_MODELS["bytes"] / "config.json").is_file(),
                    reason="the byte model is not in this checkout")
def test_shipped_byte_model_runs_its_own_heads_exactly():
    """`--model bytes` loads, `mtp` finds its shipped heads, and they speculate exactly."""
    loaded = load_model("bytes")
    assert shipped_drafter(loaded.model, MTPDrafter.kind) is not None
    prompt = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a string."}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    truth = build_engine(loaded, "ar").generate(SequenceSpec(prompt, StoppingRules.build(96))).token_ids
    for method in ("mtp", "pld", "suffix"):
        result = build_engine(loaded, method).generate(SequenceSpec(prompt, StoppingRules.build(96)))
        assert result.token_ids == truth, method


def test_server_streams_the_byte_model_in_whole_characters(tiny):
    """`verispec serve` with the byte model: streamed chunks are whole characters and add up to
    the answer it gives unstreamed, which is `generate`'s (up to a character cut by the budget)."""
    from openai import OpenAI

    from tests.serving import LiveServer
    from verispec.server import create_app

    loaded, heads = tiny
    app = create_app(loaded, ["mtp", "pld", "ar"], options=DraftOptions(draft=str(heads)))
    text = TEXT + TEXT[:20]
    with LiveServer(app) as server:
        openai = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
        for method in ("mtp", "pld"):
            body = {"model": "bytes", "prompt": text, "max_tokens": NEW, "temperature": 0,
                    "extra_body": {"method": method}}
            whole = openai.completions.create(**body).choices[0].text
            chunks = [c.choices[0].text for c in openai.completions.create(stream=True, **body)]
            assert len(chunks) > 3 and all("\ufffd" not in chunk for chunk in chunks), method
            assert "".join(chunks) == whole, method
            expected = generate(loaded, text, method=method, max_new_tokens=NEW,
                                options=DraftOptions(draft=str(heads)))
            assert whole == bytes_of(expected.token_ids).decode(errors="ignore"), method
