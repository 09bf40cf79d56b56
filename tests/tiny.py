"""Tiny models and tokenizers the tests build themselves (no downloads, seconds on a CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from verispec.drafters.vocab import byte_level_alphabet
from verispec.model.loading import LoadedModel
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


# The lean families (verispec.model.lean.FAMILIES) as tiny models: windows of 6 positions where
# the family has sliding windows, so that sequences of a few dozen tokens cross them.
WINDOW = 6
FAMILY_NAMES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")


def tiny_family(name: str, seed: int = 0, layers: int = 3, vocab: int = VOCAB,
                hidden: int = 32, head_dim: int = 8) -> PreTrainedModel:
    """A random float32 model of a lean family (FAMILY_NAMES): Mistral with a model-wide window,
    Qwen2 with q/k/v biases and windows on layers 1.., Qwen3 with per-head q/k norms and
    windows on layers 2.., Gemma 3 with its sandwich norms, GeGLU, scaled embeddings, a tied head
    and local layers (window, rotary base 10k) around a global one (base 1M). Norm weights and
    biases are random too (Hugging Face starts them at 1, 0 or Gemma's 0), so the tests see them.
    head_dim: 8 by default; 16 or more where the row kernels' attention must run (rows.HEAD_DIMS).
    """
    if name == "llama":
        return tiny_llama(seed, layers, vocab, hidden)
    torch.manual_seed(seed)
    shape = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, head_dim=head_dim,
                 num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    if name == "mistral":
        model = MistralForCausalLM(MistralConfig(**shape, sliding_window=WINDOW))
    elif name == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True, sliding_window=WINDOW,
                                             max_window_layers=1))
    elif name == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**shape, use_sliding_window=True, sliding_window=WINDOW,
                                             max_window_layers=2))
    elif name == "gemma3":
        kinds = ["sliding_attention" if i % 3 != 1 else "full_attention" for i in range(layers)]
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **shape, sliding_window=WINDOW, query_pre_attn_scalar=8, layer_types=kinds,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
    else:
        raise ValueError(f"no tiny family {name!r}; choose from {FAMILY_NAMES}")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return sharpened(model.eval())


def tiny_foreign(seed: int = 0, layers: int = 3) -> Olmo2ForCausalLM:
    """A random float32 OLMo 2, a family verispec.model.lean does not run: it goes through its
    own Hugging Face forward (the path every other architecture takes)."""
    torch.manual_seed(seed)
    config = Olmo2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=None,
                         pad_token_id=0)
    return sharpened(Olmo2ForCausalLM(config).eval())


def tiny_tokenizer(vocab: int = VOCAB, prefix: str = "w") -> PreTrainedTokenizerFast:
    """Word-level tokenizer: '<pad>', '<bos>', '<eos>', then words w3, w4, ... (or another prefix)."""
    words = {token: i for i, token in enumerate(SPECIALS)}
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


def tiny_loaded(seed: int = 0, layers: int = 3) -> LoadedModel:
    """The tiny Llama with its tokenizer, as verispec loads a target."""
    return LoadedModel(tiny_llama(seed=seed, layers=layers), tiny_tokenizer(), "tiny")


def assert_resumed_as_one_run(resumed: Path, whole: Path, steps: int) -> None:
    """The run directories' histories (a run stopped with --stop-at, then resumed; one run
    uninterrupted) hold the same steps on the same learning rates: the same schedule."""
    first, second = (json.loads((run / "history.json").read_text()) for run in (resumed, whole))
    assert [h["step"] for h in first] == [h["step"] for h in second] == list(range(1, steps + 1))
    assert [h["lr"] for h in first] == [h["lr"] for h in second]


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


SPECIALS = ("<pad>", "<bos>", "<eos>", "<user>", "<assistant>")


def named(specials: tuple[str, ...], first: str) -> dict[str, str]:
    """The tokenizer's named special tokens: `first` (its pad or unknown token), then its start
    and end of text, as far as `specials` goes."""
    return dict(zip((first, "bos_token", "eos_token"), specials))


def word_tokenizer(words: list[str], specials: tuple[str, ...] = SPECIALS) -> PreTrainedTokenizerFast:
    """Word-level, with SentencePiece's convention for spaces: a word after a space is its own
    token, spelled with ▁ ('ab cd' -> ['ab', '▁cd']); ids: the specials, then `words` in order.
    A word it lacks reads as <pad> (the first special), so it spells no text."""
    vocab = {token: i for i, token in enumerate([*specials, *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="never")
    backend.add_special_tokens(list(specials))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **named(specials, "pad_token"))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def char_tokenizer(text: str, specials: tuple[str, ...] = ("<unk>", "<s>", "</s>"),
                   merges: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """Character-level, byte-level in GPT-2's way (a space is Ġ, 'é' two tokens, Ã and ©): one
    token per byte of the characters in `text`, then one per merged pair in `merges` (each two
    characters, e.g. ' a': the token Ġa); ids: the specials first."""
    alphabet = {b: c for c, b in byte_level_alphabet().items()}
    spell = lambda s: "".join(alphabet[b] for b in s.encode())  # noqa: E731
    units = list(dict.fromkeys(spell(c) for c in text))
    units = list(dict.fromkeys(u for unit in units for u in unit))  # one token per byte
    pairs = [(spell(m[0]), spell(m[1])) for m in merges]
    vocab = {token: i for i, token in enumerate([*specials, *units, *(a + b for a, b in pairs)])}
    backend = Tokenizer(models.BPE(vocab, pairs))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **named(specials, "unk_token"))


def piece_tokenizer(words: list[str], text: str = " abcd", fallback: str = "",
                    specials: tuple[str, ...] = ("<unk>", "<s>", "</s>"), dummy_prefix: bool = False
                    ) -> PreTrainedTokenizerFast:
    """SentencePiece's kind (Gemma's, Llama's): BPE over the characters of `text` (a space is ▁)
    merged into `words` (each spelled with ▁ for a space), the UTF-8 bytes of the characters in
    `fallback` as byte tokens <0xNN> for the characters the pieces lack; with `dummy_prefix`,
    encoding puts a ▁ before the text (Llama 2's)."""
    chars = list(dict.fromkeys(text.replace(" ", "\u2581")))
    merges: list[tuple[str, str]] = []
    for word in words:
        for end in range(2, len(word) + 1):
            pair = (word[: end - 1], word[end - 1])
            if pair not in merges:
                merges.append(pair)
    byte_tokens = [f"<0x{b:02X}>" for b in dict.fromkeys(fallback.encode())]
    tokens = [*specials, *chars, *byte_tokens, *(a + b for a, b in merges)]
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(dict.fromkeys(tokens))}, merges,
                                   unk_token=specials[0], byte_fallback=True))
    scheme = "first" if dummy_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    backend.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(tokenizer_object=backend, **named(specials, "unk_token"))
