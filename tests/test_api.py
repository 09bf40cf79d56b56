"""The Python API: Hugging Face-style arguments, streaming, seeded sampling, local directories."""

from __future__ import annotations

import pytest

import verispec
from tests.tiny import plain_greedy, tiny_llama, tiny_tokenizer
from verispec.methods import engine_for_checked

PROMPT = "w10 w11 w12 w10 w11"


def test_generate_with_each_hf_style_method_matches_plain(tiny_dir, target):
    prompt_ids = tiny_tokenizer()(PROMPT)["input_ids"]
    truth = plain_greedy(target, prompt_ids, 20)
    draft = verispec.load_model(str(tiny_dir))
    for kwargs in ({}, {"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 2},
                   {"assistant_early_exit": 1, "num_assistant_tokens": 3},
                   {"assistant_model": draft, "num_assistant_tokens": 5,
                    "num_assistant_tokens_schedule": "heuristic"},
                   {"assistant_model": str(tiny_dir), "assistant_confidence_threshold": 0.5}):
        result = verispec.generate(str(tiny_dir), PROMPT, max_new_tokens=20, eos_token_id=[], **kwargs)
        assert result.token_ids == truth, kwargs
        assert result.text == tiny_tokenizer().decode(truth, skip_special_tokens=True)


def test_default_tree_matches_plain_and_a_bad_tree_is_refused(tiny_dir, target):
    prompt_ids = tiny_tokenizer()(PROMPT)["input_ids"]
    result = verispec.generate(str(tiny_dir), PROMPT, max_new_tokens=20, eos_token_id=[],
                               prompt_lookup_num_tokens=4, tree="default")
    assert result.token_ids == plain_greedy(target, prompt_ids, 20)
    with pytest.raises(verispec.VerispecError, match="TreeSettings"):
        verispec.generate(str(tiny_dir), PROMPT, max_new_tokens=4, prompt_lookup_num_tokens=4,
                          tree="bushy")


def test_plain_pretrained_model_and_token_ids(target):
    result = verispec.generate(target, [1, 5, 6], max_new_tokens=5)
    assert result.token_ids == plain_greedy(target, [1, 5, 6], 5)
    assert result.stats.mean_accepted_tokens == 1.0


def test_seeded_sampling_repeats_exactly(tiny_dir):
    kwargs = dict(max_new_tokens=24, do_sample=True, temperature=0.9, top_k=20, top_p=0.9,
                  eos_token_id=[])
    for method in ({}, {"assistant_model": str(tiny_dir)}, {"prompt_lookup_num_tokens": 3}):
        first = verispec.generate(str(tiny_dir), PROMPT, seed=123, **kwargs, **method)
        second = verispec.generate(str(tiny_dir), PROMPT, seed=123, **kwargs, **method)
        other = verispec.generate(str(tiny_dir), PROMPT, seed=124, **kwargs, **method)
        assert first.token_ids == second.token_ids
        assert first.token_ids != other.token_ids


def test_stream_yields_the_same_text_as_generate(tiny_dir):
    pieces = list(verispec.stream(str(tiny_dir), PROMPT, max_new_tokens=16, eos_token_id=[],
                                  prompt_lookup_num_tokens=4))
    full = verispec.generate(str(tiny_dir), PROMPT, max_new_tokens=16, eos_token_id=[])
    assert len(pieces) > 1 and "".join(pieces) == full.text


def test_hf_style_streamer_receives_prompt_then_blocks(tiny_dir):
    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.tolist())

        def end(self):
            self.ended = True

    recorder = Recorder()
    result = verispec.generate(str(tiny_dir), PROMPT, max_new_tokens=10, eos_token_id=[], streamer=recorder)
    assert recorder.ended
    assert recorder.puts[0] == tiny_tokenizer()(PROMPT)["input_ids"]
    assert sum(recorder.puts[1:], []) == result.token_ids


def test_chat_template_is_applied_on_request(tiny_dir):
    result = verispec.generate(str(tiny_dir), "w9", chat=True, max_new_tokens=3, eos_token_id=[])
    assert result.prompt_ids == tiny_tokenizer()("<user> w9 <assistant>")["input_ids"]


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0, "do_sample": True}, "temperature must be >= 0"),
    ({"temperature": float("nan"), "do_sample": True}, "finite"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"prompt_lookup_num_tokens": -1}, "k must be an integer >= 0"),
    ({"assistant_early_exit": 99}, "exit layer"),
    ({"prompt_lookup_num_tokens": 3, "assistant_early_exit": 1}, "choose one"),
    ({"num_assistant_tokens_schedule": "wild", "prompt_lookup_num_tokens": 3}, "schedule"),
    ({"max_new_tokens": 600}, "exceeds the model's context"),
])
def test_bad_arguments_are_refused_clearly(tiny_dir, kwargs, message):
    with pytest.raises(verispec.VerispecError, match=message):
        verispec.generate(str(tiny_dir), PROMPT, **kwargs)


def test_a_keyword_generate_does_not_take_is_a_type_error_naming_it(target):
    """The speculation keywords arrive as **kwargs (verispec.api.Speculation): a misspelt one is
    still refused as Python refuses an unknown keyword, not ignored."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'prompt_lookup_tokens'"):
        verispec.generate(target, [5, 6], prompt_lookup_tokens=3)
    assert verispec.api.Speculation(prompt_lookup_num_tokens=3).chosen_method() == "pld"


def test_empty_prompt_and_unknown_model_are_refused(tiny_dir, tmp_path):
    with pytest.raises(verispec.VerispecError, match="empty"):
        verispec.generate(str(tiny_dir), "   ")
    with pytest.raises(verispec.VerispecError, match="empty"):
        verispec.generate(str(tiny_dir), [])
    with pytest.raises(verispec.VerispecError, match="outside the vocabulary"):
        verispec.generate(str(tiny_dir), [1, 5, 640])
    with pytest.raises(verispec.VerispecError, match="unknown model"):
        verispec.generate(str(tmp_path / "nowhere"), "w5")


def test_a_lone_surrogate_in_the_text_is_refused_by_name(tiny_dir):
    """Python strings may hold what UTF-8 cannot (JSON's "\\ud800"): a VerispecError naming it,
    raw or through the chat template, not the tokenizer's TypeError."""
    for chat in (False, True):
        with pytest.raises(verispec.VerispecError, match="lone surrogate"):
            verispec.generate(str(tiny_dir), "w5 \ud800 w6", chat=chat, max_new_tokens=2)


def test_draft_with_another_vocabulary_unreadable_as_text_is_refused(tiny_dir, tmp_path):
    """A draft model with another vocabulary drafts through its text (docs/cross-tokenizer.md);
    the tiny tokenizer joins words with spaces on decoding, so its tokens are not text pieces
    and the pair is refused, naming why (tests/test_cross_tokenizer.py drafts across readable
    ones)."""
    other = tmp_path / "other-vocab"
    tiny_llama(seed=1).save_pretrained(other)
    tiny_tokenizer(prefix="x").save_pretrained(other)
    with pytest.raises(verispec.VerispecError, match="cannot read the target's tokenizer's tokens as text"):
        verispec.generate(str(tiny_dir), PROMPT, assistant_model=str(other))
    smaller = tmp_path / "smaller-vocab"
    tiny_llama(seed=1, vocab=48).save_pretrained(smaller)
    tiny_tokenizer(vocab=48).save_pretrained(smaller)
    with pytest.raises(verispec.VerispecError, match="its decoder: none"):
        verispec.generate(str(tiny_dir), PROMPT, assistant_model=str(smaller))


def test_a_batch_of_prompts_gives_each_prompts_own_answer(tiny_dir, target):
    """Lists of texts or of ids decode together; each result is that prompt's alone."""
    texts = [PROMPT, "w20 w21", "w5 w6 w7 w5 w6 w7 w5"]
    ids = [tiny_tokenizer()(t)["input_ids"] for t in texts]
    truth = [plain_greedy(target, p, 12) for p in ids]
    for inputs in (texts, ids):
        for kwargs in ({}, {"prompt_lookup_num_tokens": 3}, {"method": "self-int4-pld"}):
            results = verispec.generate(str(tiny_dir), inputs, max_new_tokens=12, eos_token_id=[],
                                        **kwargs)
            assert [r.token_ids for r in results] == truth, kwargs
            assert results[1].text == tiny_tokenizer().decode(truth[1], skip_special_tokens=True)


def test_a_beam_request_builds_its_engine_once(tiny_dir, monkeypatch):
    """build_request checks a beam request without building a drafter; run builds the method's
    engine once and refuses there a drafter that cannot draft for beam search, naming the method."""
    built = []

    def counted(target, method, options):
        built.append(method)
        return engine_for_checked(target, method, options)

    monkeypatch.setattr(verispec.request, "engine_for_checked", counted)
    verispec.generate(str(tiny_dir), PROMPT, method="pld", num_beams=2, max_new_tokens=4)
    assert built == ["pld"]
    with pytest.raises(verispec.VerispecError, match="'lookahead' cannot draft for beam search") as refused:
        verispec.generate(str(tiny_dir), PROMPT, method="lookahead", num_beams=2, max_new_tokens=4)
    assert refused.value.field == "method" and built == ["pld", "lookahead"]


def test_num_return_sequences_draws_seeded_samples(tiny_dir):
    kwargs = {"max_new_tokens": 10, "do_sample": True, "seed": 3, "num_return_sequences": 4,
              "prompt_lookup_num_tokens": 3}
    first = verispec.generate(str(tiny_dir), PROMPT, **kwargs)
    again = verispec.generate(str(tiny_dir), PROMPT, **kwargs)
    assert len(first) == 4 and [r.token_ids for r in first] == [r.token_ids for r in again]
    assert len({tuple(r.token_ids) for r in first}) > 1
    with pytest.raises(verispec.VerispecError, match="num_return_sequences"):
        verispec.generate(str(tiny_dir), PROMPT, num_return_sequences=0)
    with pytest.raises(verispec.VerispecError, match="streamer"):
        verispec.generate(str(tiny_dir), [PROMPT, PROMPT], streamer=object())
    with pytest.raises(verispec.VerispecError, match="all text or all lists"):
        verispec.generate(str(tiny_dir), [PROMPT, 5])


def test_stop_strings_end_each_row_of_a_batch_where_they_end_it_alone(tiny_dir):
    texts = [PROMPT, "w20 w21", "w5 w6 w7 w5 w6 w7 w5"]
    alone = [verispec.generate(str(tiny_dir), t, max_new_tokens=16, eos_token_id=[]) for t in texts]
    stops = [a.text.split()[3] for a in alone]  # a word each row reaches at its own step
    kwargs = {"max_new_tokens": 16, "eos_token_id": [], "stop_strings": stops,
              "prompt_lookup_num_tokens": 3}
    truth = [verispec.generate(str(tiny_dir), t, **kwargs).token_ids for t in texts]
    assert len({len(t) for t in truth}) > 1 and all(len(t) < 16 for t in truth)
    assert [r.token_ids for r in verispec.generate(str(tiny_dir), texts, **kwargs)] == truth
