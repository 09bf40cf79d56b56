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
    return [(finished(out.sequences[i, len(prompt):].tolist(), eos), float(out.sequences_scores[i]))
            for i in range(settings.num_return_sequences)]


def finished(tokens: list[int], eos: list[int] | None) -> list[int]:
    """A returned beam as generated: Hugging Face pads a beam that ended early after its EOS."""
    end = next((i + 1 for i, token in enumerate(tokens) if eos and token in eos), len(tokens))
    return tokens[:end]


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
        assert len(results) == len(PROMPTS)
        for prompt, mine in zip(PROMPTS, results):
            reference = hf_beams(target, prompt, settings, eos)
            # whole sequences, as many as asked for, in the same order, with the same scores
            assert [got.token_ids for got in mine] == [tokens for tokens, _ in reference], (name, prompt)
            assert [got.score for got in mine] == pytest.approx([score for _, score in reference], rel=1e-5)
            multi += mine[0].stats.multi_step_forwards
    if eos is not None and penalty < 1:  # short beams win: some ended at EOS before the budget,
        # so finished beams (Hugging Face's padded after EOS) were compared too
        assert any(len(tokens) < NEW for prompt in PROMPTS
                   for tokens, _ in hf_beams(target, prompt, settings, eos))
    if eos is None:
        assert multi > 0  # speculation advanced the search several steps in one forward
