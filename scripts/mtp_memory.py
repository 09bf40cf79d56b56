"""Peak memory of one MTP training backward: head by head (Gloeckle et al. 2024) or all at once.

Runs the MTP recipe's head losses (verispec.training.kinds.mtp.head_losses) for the
built-in model (hidden 576, its final norm and LM head) on BATCH random trunk outputs of LENGTH
positions, through verispec.training.losses.multi_head_backward in each order, each order in a
fresh process. The peak is the process's resident high-water mark (VmHWM, reset through
/proc/self/clear_refs just before the backward) minus its resident size then; glibc's mmap
threshold is set to 64 KiB so that freed tensors go back to the system and the resident size
follows the live tensors. Also prints the seconds each order took.

    python scripts/mtp_memory.py --heads 4 --batch 8 --length 384 --vocab 8192
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

import verispec
from verispec.training.data import Sequence
from verispec.training.kinds import mtp
from verispec.training.losses import multi_head_backward
from verispec.training.recipes import recipe_for
from verispec.training.shell import RecipeOptions, collate


def resident_kib(field: str) -> int:
    """VmRSS or VmHWM of this process, in KiB."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(args: argparse.Namespace, sequential: bool) -> tuple[float, float]:
    """(peak MiB above the resident size before the backward, seconds) of one backward."""
    target = verispec.load("smollm2-135m-instruct")
    hidden = target.model.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    sequences = [Sequence(torch.randint(target.vocab_size, (args.length,), generator=generator), 0,
                          torch.randn(args.length, hidden, generator=generator).half(),
                          torch.zeros(args.length, hidden, dtype=torch.float16))
                 for _ in range(args.batch)]
    recipe = recipe_for("mtp", target, {"exit_layer": 15}, sequences,
                    RecipeOptions(vocab=args.vocab, heads=args.heads))
    batch = collate(sequences, args.length)
    losses, _ = mtp.head_losses(recipe, batch)
    trunk_out = batch.hidden.requires_grad_()  # as a trainable trunk's output would
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before = resident_kib("VmRSS")
    started = time.perf_counter()
    multi_head_backward(trunk_out, losses, sequential)
    seconds = time.perf_counter() - started
    return (resident_kib("VmHWM") - before) / 1024, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=8192, help="reduced vocabulary of the logits")
    parser.add_argument("--order", choices=["sequential", "naive"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.order:  # the child process: one measurement
        print(*measure(args, args.order == "sequential"))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    print(f"MTP backward, {args.heads} heads, batch {args.batch} x {args.length} positions, "
          f"vocabulary {args.vocab}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    for order in ("naive", "sequential"):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--order", order],
                             env=env, check=True, capture_output=True, text=True).stdout.split()
        peak, seconds = float(out[-2]), float(out[-1])
        print(f"{order:>10}: peak {peak:7.0f} MiB above the start of the backward, {seconds:5.1f} s")


if __name__ == "__main__":
    main()
