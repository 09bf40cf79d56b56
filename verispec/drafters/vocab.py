"""Two tokenizers over the same text: what each token stands for, in bytes, and the bridge between
a draft model's vocabulary and the target's (verispec.drafters.cross drafts across it).

Every token is read as the bytes it adds to a text, so that the two vocabularies meet on text,
not on token spellings: GPT-2's byte-level alphabet (Ġ for a space, Ċ for a newline, a multi-byte
character split over several tokens) and SentencePiece's (▁ for a space, <0xNN> byte fallback)
both come down to bytes, and a token of one vocabulary is the same as a token of the other exactly
when their bytes are equal. Special tokens stand for no text; the bridge maps them by name.
"""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass

import torch

from verispec.core.errors import VerispecError

SPACE = "\u2581"  # SentencePiece's space
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: the character that stands for each byte.

    Bytes that print as themselves (! to ~, ¡ to ¬, ® to ÿ) are their own character; the other 68
    (controls, the space, ...) take the characters from U+0100 on, in byte order: the space is Ġ.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in printable]
    alphabet |= {chr(256 + i): b for i, b in enumerate(others)}
    return alphabet


def _decoder_kinds(tokenizer) -> list[str]:
    """The types of the tokenizer's decoders, in order ([] without one)."""
    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    steps = decoder.get("decoders", [decoder]) if decoder else []
    kinds = []
    for step in steps:
        if step.get("type") == "Replace" and step.get("pattern", {}).get("String") == SPACE:
            kinds.append("Metaspace")  # ▁ -> space, as SentencePiece's own decoder does
        else:
            kinds.append(step.get("type", ""))
    return kinds


@dataclass(frozen=True, eq=False)
class TokenText:
    """One tokenizer's view of text: the bytes each id adds to a text, and text back to ids.

    pieces[i] is None for a special token (it stands for no text) and for ids past the
    tokenizer's (a model's padded rows). `prefix_space`: encoding puts a space before the text
    (SentencePiece's dummy prefix), so only text that starts with a space encodes exactly.
    """

    tokenizer: object
    pieces: list[bytes | None]  # [width]
    specials: dict[int, str]  # special id -> its name ("<eos>")
    prefix_space: bool

    @staticmethod
    def of(tokenizer, width: int, name: str = "the tokenizer") -> TokenText:
        """Read a fast Hugging Face tokenizer whose ids are byte-level or SentencePiece pieces
        (a clear error for others: WordPiece's ##, or words joined by spaces on decoding)."""
        if tokenizer is None or not hasattr(tokenizer, "backend_tokenizer"):
            raise VerispecError(f"{name} is not a fast Hugging Face tokenizer: a drafter with another "
                                "tokenizer reads each token's text through one")
        kinds = _decoder_kinds(tokenizer)
        byte_level = "ByteLevel" in kinds
        if not byte_level and "Metaspace" not in kinds:
            raise VerispecError(
                f"cannot read {name}'s tokens as text (its decoder: {', '.join(kinds) or 'none'}): a "
                "drafter with another tokenizer needs byte-level (GPT-2 style) or SentencePiece tokens")
        alphabet = byte_level_alphabet()
        added = tokenizer.added_tokens_decoder  # id -> AddedToken
        pieces: list[bytes | None] = [None] * width
        specials: dict[int, str] = {}
        for token, i in tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True).items():
            if i >= width:
                continue
            if i in added:  # added tokens are literal text, or special
                if added[i].special:
                    specials[i] = added[i].content
                else:
                    pieces[i] = added[i].content.encode()
            elif byte_level:
                pieces[i] = bytes(alphabet[c] for c in token) if all(c in alphabet for c in token) else None
            else:
                fallback = BYTE_FALLBACK.fullmatch(token) if token.startswith("<0x") else None
                pieces[i] = (bytes([int(fallback.group(1), 16)]) if fallback
                             else token.replace(SPACE, " ").encode())
        # A piece without a space tells whether encoding puts one before a text (a vocabulary
        # whose every piece starts with a space is probed with one, and puts none).
        texts = sorted((p for p in pieces if p and p.isascii() and p.strip() == p.lstrip()), key=len)
        probe = next((p for p in texts if p.strip() == p), texts[0] if texts else b"a")
        ids = tokenizer(probe.decode(), add_special_tokens=False)["input_ids"]
        spelled = b"".join(pieces[i] or b"" for i in ids if i < width)
        if spelled not in (probe, b" " + probe):
            raise VerispecError(f"{name} encodes {probe.decode()!r} as {spelled!r}: its text does not "
                                "come back from its tokens, which a drafter with another tokenizer needs")
        return TokenText(tokenizer, pieces, specials, spelled != probe)

    def text(self, ids: list[int]) -> bytes:
        """The bytes these (non-special) ids spell."""
        return b"".join(self.pieces[i] or b"" for i in ids)

    def encode(self, text: str) -> tuple[list[int], list[int]] | None:
        """The ids of `text` and the byte offset (into text) where each ends, if they spell
        exactly `text`; None where they cannot (a special token's name in it, a character the
        vocabulary lacks, no leading space where the tokenizer adds one)."""
        if not text:
            return [], []
        source = text
        if self.prefix_space:
            if not text.startswith(" "):
                return None
            source = text[1:]
        ids = self.tokenizer(source, add_special_tokens=False)["input_ids"] if source else []
        ends, end = [], 0
        for i in ids:
            piece = self.pieces[i] if 0 <= i < len(self.pieces) else None
            if piece is None:
                return None
            end += len(piece)
            ends.append(end)
        if self.text(ids) != text.encode():
            return None
        return ids, ends

    def ids_for(self, text: str) -> list[int]:
        """Ids for text the drafter is to read: exact where the tokenizer can spell it, else its
        plain encoding (a missing character becomes its unknown token: read, never drafted)."""
        exact = self.encode(text)
        if exact is not None:
            return exact[0]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def canonical(self) -> dict[bytes, int]:
        """Each text a token spells -> the id that spells it. Where several do (a byte-fallback
        <0x41> beside A), the one the tokenizer itself chooses for that text."""
        found: dict[bytes, list[int]] = {}
        for i, piece in enumerate(self.pieces):
            if piece:
                found.setdefault(piece, []).append(i)
        chosen = {}
        for piece, ids in found.items():
            if len(ids) > 1:
                exact = self.encode(piece.decode(errors="replace"))
                own = exact[0] if exact is not None and len(exact[0]) == 1 and exact[0][0] in ids else None
                chosen[piece] = ids[0] if own is None else own[0]
            else:
                chosen[piece] = ids[0]
        return chosen


def valid_prefix(data: bytes) -> tuple[str, int]:
    """`data` as text up to an incomplete character at its end (a byte-level token may end inside
    a character, whose rest is still to come), and the length of that text in bytes. Bytes that
    are not UTF-8 at all are read as U+FFFD.

    >>> valid_prefix("né".encode()[:2])
    ('n', 1)
    """
    try:
        return data.decode(), len(data)
    except UnicodeDecodeError as error:
        if error.reason == "unexpected end of data":
            return data[: error.start].decode(errors="replace"), error.start
        return data.decode(errors="replace"), len(data)


@dataclass(frozen=True, eq=False)
class Bridge:
    """A draft vocabulary and the target's over the same text.

    shared_draft[j] and shared_target[j] spell the same bytes (or are the two models' ends of
    text): the tokens both vocabularies share, in which the drafter samples under token-level
    intersection. special_to_draft: what the draft reads for a target special token (the
    draft's special of the same name, the draft's own start of text for the target's, else
    nothing); special_to_target: the target's id for a draft special of the same name, the
    target's end of text for the draft's.
    """

    target: TokenText
    draft: TokenText
    target_eos: tuple[int, ...]
    draft_eos: frozenset[int]
    shared_draft: torch.Tensor  # [m] int64
    shared_target: torch.Tensor  # [m] int64
    special_to_draft: dict[int, list[int]]
    special_to_target: dict[int, int]

    @staticmethod
    def build(target: TokenText, draft: TokenText, target_eos: list[int], draft_eos: list[int]) -> Bridge:
        draft_names = {name: i for i, name in draft.specials.items()}
        target_names = {name: i for i, name in target.specials.items()}
        draft_bos = getattr(draft.tokenizer, "bos_token_id", None)
        adds_bos = draft_bos is not None and draft.tokenizer("a")["input_ids"][:1] == [draft_bos]
        target_bos = getattr(target.tokenizer, "bos_token_id", None)
        to_draft: dict[int, list[int]] = {}
        for i, name in target.specials.items():
            if name in draft_names:
                to_draft[i] = [draft_names[name]]
            elif i == target_bos and adds_bos:
                to_draft[i] = [draft_bos]
            elif i in target_eos and draft_eos:
                to_draft[i] = [min(draft_eos)]
            else:
                to_draft[i] = []
        ends = {i: min(target_eos) for i in draft_eos} if target_eos else {}
        to_target = ends | {i: target_names[name] for i, name in draft.specials.items()
                            if name in target_names and i not in ends}
        target_ids = target.canonical()
        pairs = sorted((d, target_ids[piece]) for piece, d in draft.canonical().items()
                       if piece in target_ids)
        pairs += sorted(to_target.items())
        shared_draft = torch.tensor([d for d, _ in pairs], dtype=torch.int64)
        shared_target = torch.tensor([t for _, t in pairs], dtype=torch.int64)
        return Bridge(target, draft, tuple(sorted(target_eos)), frozenset(draft_eos), shared_draft,
                      shared_target, to_draft, to_target)


# Reading a 262,144-token vocabulary takes seconds: one bridge per pair of tokenizers (and widths).
_BRIDGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def bridge(target_tokenizer, draft_tokenizer, target_width: int, draft_width: int,
           target_eos: set[int], draft_eos: set[int]) -> Bridge:
    """The bridge between two tokenizers, built once per pair."""
    per_target = _BRIDGES.setdefault(target_tokenizer, weakref.WeakKeyDictionary())
    built = per_target.setdefault(draft_tokenizer, {})
    key = (target_width, draft_width, tuple(sorted(target_eos)), tuple(sorted(draft_eos)))
    if key not in built:
        built[key] = Bridge.build(TokenText.of(target_tokenizer, target_width, "the target's tokenizer"),
                                  TokenText.of(draft_tokenizer, draft_width, "the draft's tokenizer"),
                                  sorted(target_eos), sorted(draft_eos))
    return built[key]
