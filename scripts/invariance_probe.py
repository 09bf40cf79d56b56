"""Per-op row invariance on this CPU: does a row's result depend on the shape it was computed in?

For each kernel verispec multiplies with, one row is computed alone (M = 1), then as row 0 of
blocks of M = 2..17 rows, and in every slot of a fixed width of 16; attention is compared over the
same keys exact, and with extra masked keys (a verification block's layout). torch.equal only.
Run: PYTHONPATH=$PWD python3 scripts/invariance_probe.py
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from verispec.lowbit import Int4Groups, Int4Kernel
from verispec.packed import cpu_packs, pack_weight, packed_linear

IN, OUT = 576, 1536


def rows_agree(product, x: torch.Tensor) -> str:
    """Compare row 0 alone against row 0 inside blocks of 2..17 rows, and every slot at width 16."""
    alone = product(x[:1])
    differ = [m for m in range(2, 18) if not torch.equal(product(x[:m])[:1], alone)]
    at16 = product(x[:16])
    slots16 = all(torch.equal(product(torch.cat([x[i:i + 1], x[:15]]))[:1], at16[i:i + 1]) for i in range(16))
    return (f"M=1 vs M=2..17: {'same' if not differ else 'differs at M=' + ','.join(map(str, differ))}; "
            f"fixed width 16, any slot: {'same' if slots16 else 'differs'}")


def main() -> None:
    torch.manual_seed(0)
    weight = torch.randn(OUT, IN) / IN ** 0.5
    x32 = torch.randn(17, IN)
    print("torch", torch.__version__, "threads", torch.get_num_threads())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        w, x = weight.to(dtype), x32.to(dtype)
        print(f"F.linear {dtype}: {rows_agree(functools.partial(nn.functional.linear, weight=w), x)}")
        if cpu_packs(dtype) and dtype != torch.float16:
            packed = pack_weight(w)
            product = functools.partial(packed_linear, packed=packed, bias=None)
            print(f"packed linear {dtype}: {rows_agree(product, x)}")
    kernel = Int4Kernel(Int4Groups.quantize(weight, 32), torch.bfloat16)
    print(f"int4pack_mm (bf16 activations): {rows_agree(kernel.matmul, x32.to(torch.bfloat16))}")
    for dtype in (torch.float32, torch.bfloat16):
        norm = lambda a: nn.functional.rms_norm(a, (IN,), None, 1e-5)  # noqa: E731
        print(f"rms_norm {dtype}: {rows_agree(norm, x32.to(dtype))}")
        q = torch.randn(1, 9, 1, 64, dtype=dtype)
        keys, values = torch.randn(1, 3, 300, 64, dtype=dtype), torch.randn(1, 3, 300, 64, dtype=dtype)
        sdpa = nn.functional.scaled_dot_product_attention
        exact = sdpa(q, keys[:, :, :200], values[:, :, :200], enable_gqa=True)
        mask = torch.zeros(1, 300, dtype=torch.bool)
        mask[:, :200] = True
        masked = sdpa(q, keys, values, attn_mask=mask, enable_gqa=True)
        queries = torch.cat([q, torch.randn(1, 9, 7, 64, dtype=dtype)], 2)
        block = sdpa(queries, keys[:, :, :207], values[:, :, :207],
                     attn_mask=torch.ones(8, 207, dtype=torch.bool).tril(199), enable_gqa=True)[:, :, :1]
        same = {True: "same", False: "differs"}
        print(f"sdpa {dtype}: 200 keys vs 200 + 100 masked: {same[torch.equal(exact, masked)]}; "
              f"one query vs first row of an 8-row causal block: {same[torch.equal(exact, block)]}")


if __name__ == "__main__":
    main()
