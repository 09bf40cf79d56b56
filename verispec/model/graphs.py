"""Static shapes and CUDA graphs for the lean forward on a GPU.

A 135M model's step on a GPU is launch-bound: hundreds of small kernels, each waiting on Python.
On a GPU every forward of an invariant lean decoder after its prompt therefore runs as fixed-shape
passes (verispec.model.lean.static_forward): exactly FIXED_ROWS query rows (a block's rows,
zero-padded), attending over the decoder's whole key buffer (a fixed capacity) through a mask, keys
and values written into that buffer by index. Every row of every pass meets the same kernels at the
same shapes, whatever block, tree or batch it came in (the batch invariance, by construction), and
since nothing in a pass depends on a Python number that changes between steps, the pass is captured
once per decoder as a CUDA graph and replayed: a few launches a step instead of hundreds.

`VERISPEC_CUDA_GRAPHS=off` runs the same passes eagerly (the same kernels, for comparison); stats
name which ran (`CachedModel.kernel`). Figures: docs/invariance.md, CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from verispec.core.errors import VerispecError

# The most keys a decoder on a GPU caches (its buffer's fixed capacity, a scratch slot aside):
# every pass attends over all of them, masked, so the capacity is part of each row's arithmetic.
STATIC_KEYS = 4096


# Attention kernels a GPU may use for SDPA outside fixed-shape passes: cuDNN's is left out, since it
# builds an execution plan for every new shape (milliseconds each), and a growing cache is a new
# shape at every step (a drafter's layer drafted ~4x slower than the target decoded through it on
# an H200: docs/invariance.md, CUDA).
GPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options) -> torch.Tensor:
    """nn.functional.scaled_dot_product_attention, on a GPU without cuDNN's kernel (GPU_BACKENDS).
    An additive float mask is a fixed-shape pass's over its whole key buffer (verispec.drafters
    .graphed; every other caller masks with bools): that goes through `pass_attention`."""
    mask = options.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        return pass_attention(q, k, v, mask, options.get("scale") or q.shape[-1] ** -0.5)
    if q.device.type != "cuda":
        return nn.functional.scaled_dot_product_attention(q, k, v, **options)
    with sdpa_kernel(GPU_BACKENDS):
        return nn.functional.scaled_dot_product_attention(q, k, v, **options)


def pass_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Attention of a fixed-shape pass's rows over a whole key buffer, as three plain products: the
    scores in float32, the additive mask, a softmax, the weighted sum. Every shape is fixed, so a
    row meets the same kernels whatever came with it; on an H200 SDPA's masked kernel (cuDNN) took
    ~68 us a layer for SmolLM2's 32 rows over 4160 keys. q: [1, heads, rows, head_dim]; keys,
    values: [1, kv_heads, capacity, head_dim]; bias: [rows, capacity] (0 or -inf) -> [1, heads,
    rows, head_dim]."""
    _, heads, rows, dim = q.shape
    kv = keys.shape[1]
    group = heads // kv  # query heads per key head, in Hugging Face's order (head h reads h // group)
    scores = torch.matmul(q.reshape(1, kv, group * rows, dim).float(), keys.float().transpose(-1, -2))
    scores = scores.view(1, kv, group, rows, -1).mul_(scale).add_(bias)  # [1, kv, group, rows, capacity]
    weights = scores.softmax(-1).to(values.dtype).view(1, kv, group * rows, -1)
    return torch.matmul(weights, values).view(1, heads, rows, dim)


def graphs_enabled(device: torch.device) -> bool:
    """Whether passes on `device` are captured as CUDA graphs (on a GPU, unless switched off)."""
    return device.type == "cuda" and os.environ.get("VERISPEC_CUDA_GRAPHS", "on").lower() != "off"


class StaticPasses:
    """One decoder's fixed-shape pass inputs (static buffers the captured graphs read) and its
    graphs, one per key (a target's set of captured hidden layers, say).

    The key buffer has `capacity` slots; the last is scratch: padding rows write their keys there
    and attend only to it, and no real row ever sees it."""

    def __init__(self, rows: int, capacity: int, windows: set[int | None], dtype: torch.dtype,
                 device: torch.device, graphs: bool) -> None:
        self.rows = rows
        self.capacity = capacity
        self.graphs = graphs
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)  # [rows]
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)  # [rows]
        self.slots = torch.full((rows,), capacity - 1, dtype=torch.long, device=device)  # [rows]
        # window (None: all keys) -> [rows, capacity] bool, True = the row attends to that slot
        self.masks = {window: torch.zeros(rows, capacity, dtype=torch.bool, device=device)
                      for window in windows | {None}}
        # the same as additive biases in the activations' dtype (0 or -inf), as attention reads them
        self.biases = {window: torch.zeros(rows, capacity, dtype=dtype, device=device)
                       for window in self.masks}
        self.slot_positions = torch.arange(capacity, device=device)  # [capacity]
        self.captured: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.failure: str | None = None  # why capturing failed, where it did (passes then run eagerly)

    @property
    def room(self) -> int:
        """How many tokens the decoder can cache."""
        return self.capacity - 1

    @torch.inference_mode()
    def load(self, past: int, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
             first: int, block_positions: torch.Tensor) -> None:
        """Fill the buffers for rows first .. first + m of a block of n tokens after `past` cached
        ones: tokens, positions [m]; visible [m, past + n] bool (what each row sees, as the
        block's mask says); block_positions [n] (every row's position, for sliding windows)."""
        m, n = tokens.shape[0], block_positions.shape[0]
        if past + n > self.room:
            raise VerispecError(f"the sequence ({past + n} tokens) outgrows the GPU decoder's cache of "
                                f"{self.room} tokens (graphs.STATIC_KEYS)", field="max_new_tokens")
        self.tokens.zero_()
        self.tokens[:m] = tokens
        self.positions.zero_()
        self.positions[:m] = positions
        self.slots.fill_(self.capacity - 1)
        self.slots[:m] = torch.arange(past + first, past + first + m, device=self.slots.device)
        whole = self.masks[None]
        whole.zero_()
        whole[:m, : past + n] = visible
        whole[m:, -1] = True
        windowed = [w for w in self.masks if w is not None]
        if windowed:
            keys = self.slot_positions.clone()
            keys[past: past + n] = block_positions
            for window in windowed:
                torch.logical_and(whole, keys[None] > self.positions[:, None] - window,
                                  out=self.masks[window])
        for window, mask in self.masks.items():
            self.biases[window].zero_().masked_fill_(~mask, float("-inf"))

    def run(self, key: tuple, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """forward() over the loaded buffers: [rows, width], replayed from a CUDA graph captured at
        the first call with this `key` (the target's captured layers, say) where graphs are on.
        The result is the graph's output buffer: copy what must outlive the next pass."""
        if not self.graphs:
            return forward()
        if key not in self.captured:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                forward()  # warm-up outside the capture: kernel choices and workspaces settle
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    output = forward()
            except RuntimeError as error:  # an op that cannot be captured: run eagerly, say why
                self.graphs = False
                self.failure = f"capture failed: {str(error).splitlines()[0][:160]}"
                return forward()
            self.captured[key] = (graph, output)
        graph, output = self.captured[key]
        graph.replay()
        return output
