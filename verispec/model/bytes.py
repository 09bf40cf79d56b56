"""Byte-level models: the byte tokenizer and the shape of verispec's byte model.

A byte model reads and writes UTF-8 bytes: token ids 0..255 are the bytes themselves, followed by
a few special tokens (SPECIALS). The tokenizer is a plain Hugging Face fast tokenizer (a
`tokenizer.json` any `AutoTokenizer` loads, no custom code): byte-level pre-tokenization with no
merges, so every byte is one token and every text round-trips. Decoding bytes that end inside a
multi-byte character gives U+FFFD for the incomplete tail, which verispec's streaming
(verispec.display.TokenPieces) holds back until the character completes: no stream ever splits
a character.

The byte model itself is a `LlamaForCausalLM` (it runs on verispec's lean path and caches like any
target); `byte_config` is its shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:
    from transformers import LlamaConfig, PreTrainedTokenizerFast

BYTES = 256
PAD, BOS, EOS, USER, ASSISTANT = range(BYTES, BYTES + 5)  # the special tokens' ids
# 272 ids in all, the rest reserved (never in the data): a multiple of 16, as the packed int4
# kernels want every linear layer's width (self-int4 drafts for the byte model too).
VOCAB_SIZE = 272
SPECIALS = {PAD: "<|pad|>", BOS: "<|bos|>", EOS: "<|eos|>", USER: "<|user|>",
            ASSISTANT: "<|assistant|>",
            **{i: f"<|reserved{i - ASSISTANT - 1}|>" for i in range(ASSISTANT + 1, VOCAB_SIZE)}}
# One user turn, then the assistant's: the layout of the chat data the byte model trains on
# (verispec.training.bytes.chat_ids).
CHAT_TEMPLATE = ("<|bos|>{% for m in messages %}{% if m['role'] == 'user' %}<|user|>"
                 "{{ m['content'] }}{% elif m['role'] == 'assistant' %}<|assistant|>"
                 "{{ m['content'] }}<|eos|>{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """The byte tokenizer: text -> [BOS] + its UTF-8 bytes (add_special_tokens=False: the bytes
    alone); ids -> text, U+FFFD standing for bytes that are not (yet) a whole character.

    >>> byte_tokenizer()("é")["input_ids"]
    [257, 195, 169]
    """
    from transformers import PreTrainedTokenizerFast  # seconds: not for `verispec train --help`
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()  # byte -> the printable character byte-level BPE names it by
    backend = Tokenizer(models.BPE({chars[b]: b for b in range(BYTES)}, [], ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([SPECIALS[i] for i in sorted(SPECIALS)])
    backend.post_processor = processors.TemplateProcessing(
        single=f"{SPECIALS[BOS]} $A", pair=f"{SPECIALS[BOS]} $A $B",
        special_tokens=[(SPECIALS[BOS], BOS)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=SPECIALS[PAD],
                                        bos_token=SPECIALS[BOS], eos_token=SPECIALS[EOS])
    tokenizer.chat_template = chat_template
    return tokenizer


def byte_config(hidden: int = 256, layers: int = 6, attention_heads: int = 4,
                intermediate: int | None = None, context: int = 1024) -> LlamaConfig:
    """A Llama-shaped byte model: vocabulary VOCAB_SIZE, `context` positions, SwiGLU MLP of
    `intermediate` (default 3 * hidden), untied input and output embeddings."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=hidden, num_hidden_layers=layers,
                       num_attention_heads=attention_heads, num_key_value_heads=attention_heads,
                       intermediate_size=intermediate or 3 * hidden,
                       max_position_embeddings=context, rope_theta=10000.0,
                       bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                       tie_word_embeddings=False)
