"""What every trained drafter shares: its directory format, the target check, a reduced LM head.

A trained drafter is a directory with `drafter.json` (kind, hyper-parameters, the identity of
the target it was trained for) and `weights.safetensors` (its own weights only: the target's
embedding and LM head are borrowed at load time, never copied). Loading checks the target's
fingerprint, so a drafter trained for another model is refused instead of silently drafting
nonsense.
"""

from __future__ import annotations

import functools
import hashlib
import json
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save
from torch import nn

from verispec.core.errors import VerispecError
from verispec.model.kernels import rows
from verispec.model.lowbit import Int8Groups, RowsInt8Kernel
from verispec.model.packed import (
    can_pack,
    pack_weight,
    packed_linear,
    packed_view,
    per_model,
    per_target,
    replace_linears,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CONFIG_FILE = "drafter.json"
WEIGHTS_FILE = "weights.safetensors"
# Drafters trained by verispec for its built-in target ship here, one directory per kind
# (see the README for the commands that reproduce them).
SHIPPED = Path(__file__).parent / "trained"


def target_identity(target: PreTrainedModel) -> dict:
    """Architecture sizes plus a hash of a sample of the input embedding.

    The hash is taken over bfloat16-rounded values, so the same model loaded in float32 or
    bfloat16 has the same identity.
    """
    config = target.config.get_text_config(decoder=True)
    embedding = target.get_input_embeddings().weight.detach()
    rows = embedding[:: max(1, embedding.shape[0] // 256), :64]
    sample = rows.to(device="cpu", dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    return {"architecture": type(target).__name__, "vocab_size": int(embedding.shape[0]),
            "hidden_size": int(config.hidden_size),
            "num_layers": int(config.num_hidden_layers),
            "fingerprint": hashlib.sha1(sample).hexdigest()[:16]}


def weights_digest(directory: Path) -> str:
    """The first 16 hex digits of the SHA-256 of a drafter directory's weights: which trained
    weights a figure measured with them belongs to (verispec.methods.SHAPES_MEASURED_WITH)."""
    return hashlib.sha256((Path(directory) / WEIGHTS_FILE).read_bytes()).hexdigest()[:16]


def shipped_drafter(target: PreTrainedModel, kind: str) -> Path | None:
    """The shipped drafter of `kind` trained for this target, if there is one."""
    identity = None
    for config_file in sorted(SHIPPED.glob(f"*/*/{CONFIG_FILE}")):
        config = drafter_config(config_file.parent)
        if config.get("kind") != kind:
            continue
        identity = identity or target_identity(target)
        if config.get("target") == identity:
            return config_file.parent
    return None


def is_drafter_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path,
                      metadata: dict[str, str] | None = None) -> None:
    """A safetensors file with the permissions of any file this process writes: safetensors'
    save_file creates owner-only files (0600), which an engine running as another user (a
    container, say) cannot read."""
    path.write_bytes(save(tensors, metadata=metadata))


def save_drafter(out_dir: str | Path, kind: str, target: PreTrainedModel, settings: dict,
                 weights: dict[str, torch.Tensor], extra: dict | None = None) -> Path:
    """Write drafter.json and float16 weights (integer tensors kept as they are)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: (t.detach().to("cpu", torch.float16) if t.is_floating_point()
                      else t.detach().cpu()).contiguous() for name, t in weights.items()}
    write_safetensors(tensors, out / WEIGHTS_FILE)
    config = {"kind": kind, "target": target_identity(target), "settings": settings, **(extra or {})}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return out


def drafter_config(path: str | Path) -> dict:
    """drafter.json of a trained drafter directory (no weights read, no target check)."""
    return json.loads((Path(path) / CONFIG_FILE).read_text())


def load_drafter(path: str | Path, target: PreTrainedModel,
                 kind: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """drafter.json and weights of a trained drafter, after checking it was made for `target`."""
    directory = Path(path)
    if not is_drafter_dir(directory):
        raise VerispecError(f"{directory} is not a trained verispec drafter (no {CONFIG_FILE})")
    config = drafter_config(directory)
    if kind is not None and config.get("kind") != kind:
        raise VerispecError(f"{directory} holds a {config.get('kind')!r} drafter, not {kind!r}")
    expected, found = config.get("target", {}), target_identity(target)
    if expected != found:
        differing = [k for k in found if expected.get(k) != found[k]]
        raise VerispecError(
            f"the drafter in {directory} was trained for another target "
            f"({', '.join(f'{k}: {expected.get(k)} there, {found[k]} here' for k in differing)})")
    weights = load_file(directory / WEIGHTS_FILE)
    return config, weights


def drafter_files(path: str | Path) -> tuple[str, tuple[int, ...]] | None:
    """A trained drafter directory and its files' version (each one's inode, size and times): what
    drafters built from it share (packed.per_target) until a file is written again. None where
    a file is missing (load_drafter says what is wrong)."""
    directory = Path(path).resolve()
    stamps = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / name).is_file():
            return None
        stat = (directory / name).stat()
        stamps += [stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
    return str(directory), tuple(stamps)


def load_net(path: str | Path, target: PreTrainedModel, kind: str, net_class: Callable[..., nn.Module]
             ) -> tuple[nn.Module, dict, dict[str, torch.Tensor]]:
    """A trained drafter's network, built from its settings with its `net.` weights loaded, and
    its config and weights (for what else the drafter keeps there, e.g. vocab_ids). Read once per
    file and target (drafters only read the network: they share it, and its drafting view)."""
    def read() -> tuple[nn.Module, dict, dict[str, torch.Tensor]]:
        config, weights = load_drafter(path, target, kind)
        net = net_class(**config["settings"])
        net.load_state_dict({k.removeprefix("net."): v for k, v in weights.items() if k.startswith("net.")})
        return net, config, weights

    files = drafter_files(path)
    if files is None:
        return read()
    directory, version = files
    return per_target(target, ("net", kind, net_class, directory), read, version)


# A drafter's arithmetic is not the target's: it changes which tokens are drafted, never which are
# kept. On CPU its products run in 8-bit groups through the row kernels, which read about a quarter
# of float32's bytes: a one-token drafter pass is bound by reading its weights (EAGLE on the 4-bit
# target: 6.3 -> 3.0 ms a drafting step; held-out acceptance within 0.005 tau of float32's, where
# 4-bit groups lost 0.04: docs/training.md, "Drafting in 8 bits").
DRAFT_GROUP = 32


def draft_in_8_bits(module: nn.Module) -> bool:
    """Whether a drafter's products run in 8-bit groups here: on CPU, in float32 or bfloat16,
    where the row kernels run."""
    parameter = next(module.parameters(), None)
    return (parameter is not None and parameter.device.type == "cpu"
            and parameter.dtype in (torch.float32, torch.bfloat16) and rows.available())


def draft_kernel(weight: torch.Tensor) -> RowsInt8Kernel | None:
    """weight [out, in] in 8-bit groups for the row kernels, or None where its shape does not fit
    them."""
    if not rows.fits(*weight.shape) or weight.shape[1] % DRAFT_GROUP:
        return None
    return RowsInt8Kernel(Int8Groups.quantize(weight.detach(), DRAFT_GROUP))


class Int8Linear(nn.Module):
    """nn.Linear for drafting: its weight in 8-bit groups through the row kernels. Keeps the
    original weight and bias (shared, not copied) for code that reads them."""

    def __init__(self, linear: nn.Linear, kernel: RowsInt8Kernel) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        out = self.kernel(x)
        return out if self.bias is None else out + self.bias.detach().to(out.dtype)


_DRAFT_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _in_8_bits(linear: nn.Linear) -> nn.Module:
    """A linear layer in 8 bits where it fits the row kernels, else prepacked for oneDNN."""
    kernel = draft_kernel(linear.weight)
    return Int8Linear(linear, kernel) if kernel is not None else packed_view(linear)


def drafting_view(net: nn.Module) -> nn.Module:
    """A drafter's network as it drafts: its linear layers in 8 bits where `draft_in_8_bits`,
    else prepacked where the CPU packs them (packed_view), else `net` itself. A view: `net`
    (which training updates) is untouched, and a changed weight makes a new view."""
    if not draft_in_8_bits(net):
        return packed_view(net)
    return per_model(_DRAFT_VIEWS, net, functools.partial(replace_linears, replace=_in_8_bits))


_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {vocab ids: ReducedHead}


class ReducedHead:
    """The target's LM head restricted to a fixed set of token ids (a frequency-ranked vocabulary).

    A drafter scores only these tokens, a fraction of the full head's cost. Tokens outside the set
    are never drafted, which costs acceptance, never exactness (greedy verification keeps only the
    target's tokens; under sampling, q is exactly the distribution the draft was drawn from, zero
    outside the set).
    """

    @classmethod
    def of(cls, target: PreTrainedModel, vocab_ids: torch.Tensor) -> ReducedHead:
        """The head for these ids, made once per target and shared (it is read-only): every
        drafter of a batch, and every way of speculating a server holds, would otherwise keep
        its own copy of these rows of the LM head (and their packed copy), ~56 MB on SmolLM2."""
        heads = _HEADS.setdefault(target, {})
        key = vocab_ids.cpu().numpy().tobytes()
        if key not in heads:
            heads[key] = cls(target, vocab_ids)
        return heads[key]

    def __init__(self, target: PreTrainedModel, vocab_ids: torch.Tensor) -> None:
        # vocab_ids: [reduced] int64, ids into the target's vocabulary
        head = target.get_output_embeddings().weight.detach()  # [vocab, hidden]
        self.vocab_size = int(head.shape[0])
        self.vocab_ids = vocab_ids.to(head.device)
        self.weight_t = head[self.vocab_ids].t().contiguous()  # [hidden, reduced]
        # For drafting on CPU: 8-bit groups through the row kernels (see DRAFT_GROUP), else
        # prepacked for oneDNN (several times faster over a few rows: docs/performance.md).
        self.kernel = draft_kernel(self.weight_t.t()) if draft_in_8_bits(target) else None
        self.packed = (pack_weight(self.weight_t.t()) if self.kernel is None and can_pack(target)
                       else None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> reduced logits [..., reduced] (float32 from the 8-bit kernel).
        For drafting: neither the 8-bit nor the packed product has a gradient (training reads
        weight_t instead)."""
        if self.kernel is not None:
            return self.kernel.product(hidden)
        if self.packed is not None:
            return packed_linear(hidden, self.packed, None)
        return hidden @ self.weight_t

    def full(self, reduced_logits: torch.Tensor) -> torch.Tensor:
        """[..., reduced] -> [..., vocab] with -inf outside the reduced set."""
        out = reduced_logits.new_full((*reduced_logits.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.vocab_ids, reduced_logits)


def frequent_tokens(sequences: list[torch.Tensor], vocab_size: int, count: int,
                    always: set[int] = frozenset()) -> torch.Tensor:
    """The `count` most frequent ids in sequences (each [T]), plus `always`; sorted [count] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for tokens in sequences:
        counts += torch.bincount(tokens, minlength=vocab_size)[:vocab_size]
    for t in always:
        counts[t] = counts.max() + 1
    count = min(count, vocab_size)
    return counts.topk(count).indices.sort().values
