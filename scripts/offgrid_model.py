"""A copy of the built-in model whose weights are not their own 4-bit grid.

The built-in float32 weights are the Q4_1 file's exact dequantization: every group of 32 weights
of a linear layer takes 16 values, so a 4-bit self drafter reproduces the target almost exactly
(α ≈ 0.99), which flatters self-speculation. A real checkpoint sits off that grid: the GGUF was
quantized from bfloat16 weights spread inside each 4-bit cell. This writes a model directory whose
linear weights carry such a rounding error: each weight moved by u·d, u uniform in (-1/2, 1/2) (d:
its group's step), except each group's smallest and largest weight, and weights at the grid's ends
moved inward only, so that the copy quantizes back to exactly the same Q4_1 blocks (checked with
gguf-py's reference quantizer, byte for byte). Embeddings and norms are left as they are.

    python3 scripts/offgrid_model.py runs/offgrid [--seed 0]
    verispec bench --model runs/offgrid ...        # the self methods on an honest target
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
import torch

from verispec.model.loading import load_model

GROUP = 32


def offgrid(weight: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """weight [out, in] on a Q4_1 grid (groups of 32 along `in`) moved off it within each cell."""
    groups = weight.reshape(-1, GROUP).double()  # [blocks, 32]
    low, high = groups.min(-1, keepdim=True).values, groups.max(-1, keepdim=True).values
    step = (high - low) / 15
    level = torch.where(step > 0, (groups - low) / step.clamp_min(1e-30), 0).round()  # 0..15
    u = torch.rand(groups.shape, generator=generator, dtype=torch.float64) - 0.5
    u = torch.where(level == 0, u.abs(), torch.where(level == 15, -u.abs(), u))  # stay inside the grid
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(1, groups.argmin(-1, keepdim=True), True)
    keep.scatter_(1, groups.argmax(-1, keepdim=True), True)
    moved = torch.where(keep, groups, groups + 0.999 * u * step)  # strictly inside half a step
    return moved.reshape(weight.shape).to(weight.dtype)


def same_blocks(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two [out, in] float weights quantize to the same Q4_1 bytes."""
    quantize = gguf.quants.quantize
    kind = gguf.GGMLQuantizationType.Q4_1
    return np.array_equal(quantize(a.float().numpy(), kind), quantize(b.float().numpy(), kind))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    loaded = load_model(args.model)
    generator = torch.Generator().manual_seed(args.seed)
    moved = relative = 0.0
    count = 0
    with torch.no_grad():
        for name, module in loaded.model.named_modules():
            if not isinstance(module, torch.nn.Linear) or name == "lm_head":
                continue
            weight = module.weight
            new = offgrid(weight, generator)
            if not same_blocks(weight, new):
                raise SystemExit(f"{name}: the off-grid copy quantizes to other blocks")
            moved += float((new - weight).abs().mean())
            relative += float((new - weight).norm() / weight.norm())
            count += 1
            weight.copy_(new)
    loaded.model.save_pretrained(args.out)
    loaded.tokenizer.save_pretrained(args.out)
    print(f"{count} linear layers moved off their 4-bit grid (mean |change| {moved / count:.2e}, "
          f"relative {relative / count:.3%}), each quantizing back to the same Q4_1 blocks: {args.out}")


if __name__ == "__main__":
    main()
