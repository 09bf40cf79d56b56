"""Tiny models and tokenizers the tests build themselves (no downloads, seconds on a CPU)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from verispec.training.recipes import RecipeOptions

VOCAB = 64
EOS = 2
# How the tests train a drafter of every kind for the tiny target (tests/conftest.py, tiny_trained)
TINY_RECIPE = RecipeOptions(vocab=48, heads=3, exit_layer=1, draft_layers=1)
CHAT_TEMPLATE = "{% for m in messages %}<user> {{ m['content'] }} {% endfor %}<assistant>"


def tiny_llama(seed: int = 0, layers: int = 3, vocab: int = VOCAB, hidden: int = 32) -> LlamaForCausalLM:
    """A random float32 Llama; seeds give different (but deterministic) models.

    It has no EOS of its own (its tokenizer names one), so references never stop early.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=None,
                         pad_token_id=0)
    return sharpened(LlamaForCausalLM(config).eval())


def sharpened(model: torch.nn.Module) -> torch.nn.Module:
    """Larger weights than the default init make the distributions less flat (fewer near-ties)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4)
    return model


def tiny_qwen3(seed: int = 0, layers: int = 3) -> Qwen3ForCausalLM:
    """A random float32 Qwen3: its per-head q/k norms keep it off verispec.target.lean, so it runs
    through its own Hugging Face forward (the path every other architecture takes)."""
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=8,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=None,
                         pad_token_id=0)
    return sharpened(Qwen3ForCausalLM(config).eval())


def tiny_tokenizer(vocab: int = VOCAB, prefix: str = "w") -> PreTrainedTokenizerFast:
    """Word-level tokenizer: '<pad>', '<bos>', '<eos>', then words w3, w4, ... (or another prefix)."""
    words = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<user>": 3, "<assistant>": 4}
    words |= {f"{prefix}{i}": i for i in range(len(words), vocab)}
    backend = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny(directory: Path, seed: int = 0, layers: int = 3, prefix: str = "w") -> Path:
    """A local Hugging Face model directory (model + tokenizer), as a user would bring."""
    tiny_llama(seed, layers).save_pretrained(directory)
    tiny_tokenizer(prefix=prefix).save_pretrained(directory)
    return directory


def plain_greedy(model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference: Hugging Face generate(), greedy, with no EOS so it never stops early."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt):].tolist()


def tiny_bpe_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer over the text 'w' and digits, which a grammar engine
    (verispec.core.grammar) can read: the five special tokens, then 'w', '0'..'9', then merges
    'w1'..'w9' and 'w10', 'w11', ... up to the vocabulary's size. Any text of 'w's and digits
    tokenizes; e.g. 'w10w3' -> ['w10', 'w3'].
    """
    specials = ["<pad>", "<bos>", "<eos>", "<user>", "<assistant>"]
    pieces = ["w", *"0123456789"]
    merges = [("w", d) for d in "123456789"]
    tens = [(f"w{i // 10}", str(i % 10)) for i in range(10, 10 + vocab - len(specials) - len(pieces) - 9)]
    ids = {token: i for i, token in enumerate(specials + pieces + [a + b for a, b in merges + tens])}
    backend = Tokenizer(models.BPE(ids, merges + tens))
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>")
