"""Beam search through `verispec.generate(num_beams=B)` and `verispec generate --num-beams`, on the
built-in model: the sequences and scores of Hugging Face's `generate(num_beams=B)` of the same
target, with speculation advancing the search several steps per target pass."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GenerationConfig

import verispec
from tests.test_beam import finished
from verispec.cli import main
from verispec.core.errors import VerispecError
from verispec.model.loading import DEFAULT_MODEL, load
from verispec.request import encode_prompt

NEW = 16
PROMPTS = ["Answer in one word: what colour is the sky on a clear day?",
           "Repeat after me: the cat sat on the mat, the cat sat on the mat."]


@pytest.fixture(scope="module")
def target():
    return load(DEFAULT_MODEL)


def hf_beams(target, prompt_ids: list[int], beams: int, penalty: float,
             early) -> list[tuple[list[int], float]]:
    """Hugging Face's beam search of the same target: (new tokens, score) of each of B sequences."""
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, num_beams=beams,
                              length_penalty=penalty, early_stopping=early, num_return_sequences=beams,
                              eos_token_id=sorted(target.eos_token_ids),
                              pad_token_id=target.tokenizer.pad_token_id,
                              return_dict_in_generate=True, output_scores=True)
    out = target.model.generate(torch.tensor([prompt_ids]), generation_config=config)
    return [(finished(out.sequences[i, len(prompt_ids):].tolist(), sorted(target.eos_token_ids)),
             float(out.sequences_scores[i])) for i in range(beams)]


# Under slow, for the default suite's 10 minutes (29 s a case on the AVX2 EPYC): tests/test_beam.py
# checks every early-stopping mode against Hugging Face on tiny models.
@pytest.mark.parametrize(("beams", "penalty", "early"),
                         [pytest.param(2, 1.0, False, marks=pytest.mark.slow),
                          pytest.param(4, 0.5, True, marks=pytest.mark.slow),
                          pytest.param(4, 2.0, "never", marks=pytest.mark.slow)])
def test_generate_with_beams_is_hugging_face_beam_search(target, beams, penalty, early):
    """Both prompts as one batch, for plain beam search and two drafters; the first prompt's
    answer ends with EOS inside the budget, so finished beams and the length penalty count."""
    ids = [encode_prompt(target, text, chat=True) for text in PROMPTS]
    references = [hf_beams(target, p, beams, penalty, early) for p in ids]
    assert any(target.tokenizer.eos_token_id in tokens for tokens, _ in references[0])  # EOS exercised
    multi = 0
    for method in ("ar", "pld", "self-int4"):
        results = verispec.generate(target, PROMPTS, chat=True, method=method, max_new_tokens=NEW,
                                    num_beams=beams, length_penalty=penalty, early_stopping=early,
                                    num_return_sequences=beams)
        assert len(results) == 2 * beams
        for index, reference in enumerate(references):
            mine = results[index * beams: (index + 1) * beams]
            # whole sequences, in the same order, with the same scores
            assert [got.token_ids for got in mine] == [tokens for tokens, _ in reference], (method, index)
            assert [got.score for got in mine] == pytest.approx([score for _, score in reference],
                                                                rel=1e-4, abs=1e-4), (method, index)
        multi += sum(r.stats.multi_step_forwards for r in results) if method != "ar" else 0
    assert multi > 0  # the drafts advanced the search several steps in one target pass


def test_one_prompt_one_sequence_and_bad_requests(target):
    best = verispec.generate(target, PROMPTS[1], chat=True, method="pld", max_new_tokens=NEW,
                             num_beams=2)
    assert isinstance(best, verispec.decoding.beam.BeamResult) and best.text
    with pytest.raises(VerispecError, match="deterministic"):
        verispec.generate(target, PROMPTS[1], num_beams=2, do_sample=True, temperature=0.7)
    with pytest.raises(VerispecError, match="'lookahead' cannot draft for beam search"):
        verispec.generate(target, PROMPTS[1], num_beams=2, method="lookahead")
    with pytest.raises(VerispecError, match="num_return_sequences"):
        verispec.generate(target, PROMPTS[1], num_beams=2, num_return_sequences=3)


def test_generate_command_takes_num_beams(capsys):
    main(["generate", "--method", "pld", "--num-beams", "2", "--num-return-sequences", "2",
          "--max-new-tokens", "8", "--json", "--prompt", PROMPTS[1]])
    out = json.loads(capsys.readouterr().out)
    assert len(out["sequences"]) == 2 and out["sequences"][0]["score"] >= out["sequences"][1]["score"]
