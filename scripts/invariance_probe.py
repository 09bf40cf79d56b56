"""Per-op row invariance on this machine: does a row's result depend on the shape it was computed in?

For each kernel verispec multiplies with, one row is computed alone (M = 1), then as row 0 of
blocks of M = 2..17 rows, and in every slot of a fixed width (16 on the CPU, lean.FIXED_ROWS
elsewhere); attention is compared over the same keys exact, and with extra masked keys (a
verification block's layout). With --model, the built-in model end to end: blocks of 2..17 tokens
after 10 one-token steps against the one-token logits, through Hugging Face's forward and the lean
forward with the invariance on and off. torch.equal only.
Run: PYTHONPATH=$PWD python3 scripts/invariance_probe.py [--device cuda] [--model]
"""

from __future__ import annotations

import argparse
import functools

import torch
from torch import nn

from verispec.model.cached_model import CachedModel
from verispec.model.lean import FIXED_ROWS, LeanDecoder, LeanWeights
from verispec.model.loading import DEFAULT_MODEL, load_model
from verispec.model.lowbit import Int4Groups, Int4Kernel
from verispec.model.packed import cpu_packs, pack_weight, packed_linear

IN, OUT = 576, 1536
# The built-in model's products off the CPU (fused q/k/v, o, gate/up, down, head): in -> out.
MODEL_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))
SAME = {True: "same", False: "differs"}


def rows_agree(product, x: torch.Tensor, width: int = 16) -> str:
    """Compare row 0 alone against row 0 inside blocks of 2..17 rows, and every slot at `width`."""
    alone = product(x[:1])
    differ = [m for m in range(2, 18) if not torch.equal(product(x[:m])[:1], alone)]
    full = product(x[:width])
    slots = all(torch.equal(product(torch.cat([x[i:i + 1], x[width: 2 * width - 1]]))[:1], full[i:i + 1])
                for i in range(width))
    return (f"M=1 vs M=2..17: {'same' if not differ else 'differs at M=' + ','.join(map(str, differ))}; "
            f"fixed width {width}, any slot: {SAME[slots]}")


def cpu_products(weight: torch.Tensor, x32: torch.Tensor) -> None:
    """F.linear, oneDNN prepacked and the 4-bit kernel, 576 -> 1536."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        w, x = weight.to(dtype), x32.to(dtype)
        print(f"F.linear {dtype}: {rows_agree(functools.partial(nn.functional.linear, weight=w), x)}")
        if cpu_packs(dtype) and dtype != torch.float16:
            product = functools.partial(packed_linear, packed=pack_weight(w), bias=None)
            print(f"packed linear {dtype}: {rows_agree(product, x)}")
    kernel = Int4Kernel(Int4Groups.quantize(weight, 32), torch.bfloat16)
    print(f"int4pack_mm (bf16 activations): {rows_agree(kernel.matmul, x32.to(torch.bfloat16))}")


def device_products(device: torch.device) -> None:
    """F.linear (cuBLAS) at the built-in model's shapes, float32 with and without TF32."""
    x32 = torch.randn(2 * FIXED_ROWS, 1536, device=device)
    for dtype, tf32 in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False),
                        (torch.float16, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for fan_in, fan_out in MODEL_SHAPES:
            w = (torch.randn(fan_out, fan_in, device=device) / fan_in ** 0.5).to(dtype)
            product = functools.partial(nn.functional.linear, weight=w)
            print(f"F.linear {dtype}{' TF32' if tf32 else ''} {fan_in} -> {fan_out}: "
                  f"{rows_agree(product, x32[:, :fan_in].to(dtype), FIXED_ROWS)}")
    torch.backends.cuda.matmul.allow_tf32 = False


def norms_and_attention(device: torch.device, width: int) -> None:
    """rms_norm, Llama's RMSNorm module, and SDPA over one query's keys in the layouts verispec uses."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x32 = torch.randn(2 * width, IN, device=device)
    sdpa = nn.functional.scaled_dot_product_attention
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        norm = lambda a: nn.functional.rms_norm(a, (IN,), None, 1e-5)  # noqa: E731
        print(f"rms_norm {dtype}: {rows_agree(norm, x32.to(dtype), width)}")
        module = LlamaRMSNorm(IN).to(device, dtype)
        print(f"LlamaRMSNorm {dtype}: {rows_agree(module, x32.to(dtype), width)}")
        q = torch.randn(1, 9, 1, 64, dtype=dtype, device=device)
        buffer = torch.randn(2, 1, 3, 512, 64, dtype=dtype, device=device)  # a KV cache's buffers
        keys, values = buffer[0, :, :, :300], buffer[1, :, :, :300]
        exact = sdpa(q, keys[:, :, :200], values[:, :, :200], enable_gqa=True)
        gathered = sdpa(q, keys[:, :, :200].contiguous(), values[:, :, :200].contiguous(), enable_gqa=True)
        mask = torch.zeros(1, 300, dtype=torch.bool, device=device)
        mask[:, :200] = True
        masked = sdpa(q, keys, values, attn_mask=mask, enable_gqa=True)
        queries = torch.cat([q, torch.randn(1, 9, 7, 64, dtype=dtype, device=device)], 2)
        block = sdpa(queries, keys[:, :, :207], values[:, :, :207], enable_gqa=True,
                     attn_mask=torch.ones(8, 207, dtype=torch.bool, device=device).tril(199))[:, :, :1]
        row = sdpa(queries[:, :, :1], keys[:, :, :200], values[:, :, :200], enable_gqa=True)
        print(f"sdpa {dtype}: 200 keys vs 200 + 100 masked: {SAME[torch.equal(exact, masked)]}; "
              f"one query vs first row of an 8-row causal block: {SAME[torch.equal(exact, block)]}; "
              f"cache slice vs gathered copy: {SAME[torch.equal(exact, gathered)]}; "
              f"a block's row 0 alone (row attention): {SAME[torch.equal(exact, row)]}")


def differing_blocks(step, block, rewind, tokens: torch.Tensor, prefix: int = 10) -> list[int]:
    """Block lengths 2..17 after `prefix` one-token steps whose logits differ from one-token steps.
    step/block: tokens [n] -> logits [n, vocab]; rewind(length)."""
    reference = torch.cat([step(tokens[i: i + 1]) for i in range(len(tokens))])
    rewind(prefix)
    differing = []
    for n in range(2, 18):
        if not torch.equal(block(tokens[prefix: prefix + n]), reference[prefix: prefix + n]):
            differing.append(n)
        rewind(prefix)
    return differing


@torch.inference_mode()
def end_to_end(device: torch.device) -> None:
    """The built-in model: Hugging Face's forward, and the lean forward with invariance on and off."""
    tokens = torch.randint(3, 5000, (27,), generator=torch.Generator().manual_seed(0)).to(device)
    for dtype in ("float32", "bfloat16", "float16"):
        model = load_model(DEFAULT_MODEL, dtype, str(device)).model
        hf = CachedModel(model, pack=False, pad_to_multiple=1)
        print(f"builtin {dtype} Hugging Face forward ({hf.invariance}): blocks differing "
              f"{differing_blocks(hf.forward, hf.forward, hf.rewind, tokens)}", flush=True)
        if device.type == "cpu" and dtype == "float16":
            continue  # oneDNN packs no float16 here: no lean float16 target on the CPU
        weights = LeanWeights.of(model)
        for invariant in (True, False):
            lean = LeanDecoder(weights, device, invariant)
            forward = lambda t, lean=lean: lean.logits(lean.forward(t))  # noqa: E731
            print(f"builtin {dtype} lean, invariance {'on' if invariant else 'off'}: blocks differing "
                  f"{differing_blocks(forward, forward, lean.rewind, tokens)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", action="store_true", help="also the built-in model end to end")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    print("torch", torch.__version__, "threads", torch.get_num_threads(),
          torch.cuda.get_device_name(device) if device.type == "cuda" else "")
    if device.type == "cpu":
        cpu_products(torch.randn(OUT, IN) / IN ** 0.5, torch.randn(32, IN))
    else:
        device_products(device)
    norms_and_attention(device, 16 if device.type == "cpu" else FIXED_ROWS)
    if args.model:
        end_to_end(device)


if __name__ == "__main__":
    main()
