"""A GGUF file's tensors, read from its header alone (names, types, shapes, and their bytes mapped
from the file), for the loaders that take a file's blocks as they are (verispec.model.lowbit,
verispec.model.gguf_blocks)."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from verispec.core.errors import VerispecError


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: its name, type, shape (GGUF order: columns first) and bytes."""

    name: str
    qtype: str  # GGMLQuantizationType name: Q4_K, F32, ...
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 [rows, bytes per row], read-only (the file mapped)


# GGUF metadata value types with a fixed size, by type id (8: string, 9: array).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_tensors(path: Path) -> tuple[str, dict[str, TensorInfo]]:
    """The file's architecture and its tensors by GGUF name, read from the header alone.

    gguf-py's GGUFReader parses every metadata value into numpy views, slow for a large
    vocabulary (docs/families.md); this skips the values it does not need (the format:
    github.com/ggml-org/ggml/blob/master/docs/gguf.md)."""
    with path.open("rb") as file:
        view = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    if view[:4] != b"GGUF":
        raise VerispecError(f"{path} is not a GGUF file")
    _, tensors, fields = struct.unpack_from("<IQQ", view, 4)
    position = 24

    def string() -> str:
        nonlocal position
        (length,) = struct.unpack_from("<Q", view, position)
        position += 8 + length
        return bytes(view[position - length: position]).decode("utf-8", "replace")

    def skip(kind: int) -> object:
        nonlocal position
        if kind == 8:
            return string()
        if kind == 9:
            item, count = struct.unpack_from("<IQ", view, position)
            position += 12
            if item in _FIXED:
                position += _FIXED[item] * count
            else:
                for _ in range(count):
                    skip(item)
            return None
        value = view[position: position + _FIXED[kind]]
        position += _FIXED[kind]
        return int.from_bytes(value, "little") if kind in (4, 10) else None

    meta = {}
    for _ in range(fields):
        key = string()
        (kind,) = struct.unpack_from("<I", view, position)
        position += 4
        meta[key] = skip(kind)
    infos = []
    for _ in range(tensors):
        name = string()
        (dims,) = struct.unpack_from("<I", view, position)
        shape = struct.unpack_from(f"<{dims}Q", view, position + 4)
        kind, offset = struct.unpack_from("<IQ", view, position + 4 + 8 * dims)
        position += 4 + 8 * dims + 12
        infos.append((name, GGMLQuantizationType(kind).name, tuple(int(n) for n in shape), offset))
    alignment = int(meta.get("general.alignment") or 32)
    start = -(-position // alignment) * alignment
    found = {}
    for name, qtype, shape, offset in infos:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        rows = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        width = shape[0] // block * size
        data = np.frombuffer(view, dtype=np.uint8, count=rows * width, offset=start + offset)
        found[name] = TensorInfo(name, qtype, shape, data.reshape(rows, width))
    return str(meta.get("general.architecture") or ""), found
