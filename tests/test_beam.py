"""Speculative beam search returns Hugging Face generate(num_beams=B)'s sequences and scores."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from tests.tiny import VOCAB
from verispec.core.stopping import StoppingRules
from verispec.decoding.beam import BeamDecoder, BeamSettings
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import PromptLookupDrafter

NEW = 20
PROMPTS = [[1, 17, 42, 9, 33, 17, 42, 5], [1, 5, 6, 7, 5, 6, 7, 5, 6]]


def hf_beams(model, prompt, settings: BeamSettings, eos):
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, num_beams=settings.num_beams,
                              length_penalty=settings.length_penalty,
                              early_stopping=settings.early_stopping,
                              num_return_sequences=settings.num_return_sequences, eos_token_id=eos,
                              pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    out = model.generate(torch.tensor([prompt]), generation_config=config)
    return [(out.sequences[i, len(prompt):].tolist(), float(out.sequences_scores[i]))
            for i in range(settings.num_return_sequences)]


@pytest.mark.parametrize("beams", [2, 4])
@pytest.mark.parametrize("eos,penalty,early", [(None, 1.0, False), ([9], 0.5, True),
                                               ([9], 2.0, "never")])
def test_speculative_beam_search_matches_hugging_face(target, beams, eos, penalty, early):
    settings = BeamSettings(beams, penalty, early, beams)
    multi = 0
    for name, make in [("plain", None), ("pld", lambda: PromptLookupDrafter(3, 1)),
                       ("self", lambda: ModelDrafter(target, VOCAB))]:
        decoder = BeamDecoder(target, make and make(), make, 4)
        results = decoder.generate(PROMPTS, StoppingRules.build(NEW, eos), settings)  # a batch
        for prompt, mine in zip(PROMPTS, results):
            reference = hf_beams(target, prompt, settings, eos)
            for got, (tokens, score) in zip(mine, reference):
                assert got.token_ids == tokens[: len(got.token_ids)], (name, prompt)
                assert got.score == pytest.approx(score, rel=1e-5), (name, prompt)
            multi += mine[0].stats.multi_step_forwards
    if eos is None:
        assert multi > 0  # speculation advanced the search several steps in one forward
