"""One generic training loop for every drafter: AdamW, warm-up + cosine schedule, resumable.

A recipe supplies the module and a loss function of a batch; the loop owns the rest: progress
bar, a checkpoint every few steps and at most every SAVE_SECONDS (the run resumes from it after an
interruption), a held-out evaluation, and the loss curve as a PNG beside the checkpoint.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.core.errors import VerispecError
from verispec.core.files import write_whole

# A checkpoint (and the loss plot) every checkpoint_every steps, but at most once this many
# seconds: on a GPU a hundred steps take seconds, and saving the optimiser's state and drawing
# the plot each time would cost a sizeable share of them.
SAVE_SECONDS = 30.0

# How much the held-out agreement must rise over a run's last third for more steps to be
# worth it, and how far the training batches' agreement must rise meanwhile before a flat
# held-out figure reads as memorising: both a few times the held-out figure's noise (about 0.01
# between reruns, docs/training.md).
STILL_LEARNING = 0.01
MEMORISING = 0.03
TRAINING_SPAN = 250  # the training batches' steps averaged beside an evaluation (at most)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1500
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    batch_size: int = 8
    max_len: int = 384
    checkpoint_every: int = 100
    eval_every: int = 250
    seed: int = 0
    # bfloat16 autocast for the matrix products; None: where it is fast (bf16_is_fast; the
    # measurements: docs/training.md).
    bf16: bool | None = None


def bf16_is_fast(device_type: str) -> bool:
    """True on CUDA and on CPUs with native bfloat16 instructions (AVX512-BF16 or AMX), where
    bfloat16 autocast speeds training up; elsewhere bfloat16 is emulated and slower than float32."""
    if device_type != "cpu":
        return device_type == "cuda"
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_flags() -> set[str]:
    """The words of /proc/cpuinfo (empty where there is none): the CPU's feature flags among them."""
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(module: torch.nn.Module, loss_fn: Callable[[list], tuple[torch.Tensor | None, dict]],
          train_items: list, eval_items: list, config: TrainConfig, work_dir: Path,
          desc: str = "training", until: int | None = None) -> list[dict]:
    """Minimise loss_fn(batch) over random batches of train_items; returns the history.

    loss_fn returns (loss to minimise, metrics to log), or (None, metrics) where it has run the
    backward pass itself (MTP's head-by-head order, see losses.multi_head_backward). Resumes from
    work_dir/checkpoint.pt. until: stop after this step (checkpointed there), on the schedule of
    config.steps: what a run interrupted at that step holds.
    """
    last = config.steps if until is None else until
    if not 1 <= last <= config.steps:
        raise VerispecError(f"until must lie in 1..{config.steps} (the run's steps), got {until}")
    work_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = work_dir / "checkpoint.pt"
    params = [p for p in module.parameters() if p.requires_grad]
    device_type = params[0].device.type
    bf16 = bf16_is_fast(device_type) if config.bf16 is None else config.bf16
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    history: list[dict] = []
    step = 0
    seconds = 0.0  # spent by earlier sessions of this run (resumed)
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        if state["config"] != asdict(config):
            raise ValueError(f"{checkpoint} was made with other settings; remove it to start over")
        module.load_state_dict(state["module"])
        optimizer.load_state_dict(state["optimizer"])
        history, step = state["history"], state["step"]
        if step > last:
            raise VerispecError(f"{checkpoint} is at step {step}, past {last}: it cannot stop there")
        seconds = history[-1].get("seconds", 0.0) if history else 0.0
    rng = random.Random(config.seed * 1_000_003 + step)
    torch.manual_seed(config.seed * 1_000_003 + step)

    def save() -> None:
        state = {"module": module.state_dict(), "optimizer": optimizer.state_dict(),
                 "history": history, "step": step, "config": asdict(config)}
        write_whole(checkpoint, lambda partial: torch.save(state, partial))

    def evaluate() -> dict:
        module.eval()
        totals: dict[str, float] = {}
        batches = [eval_items[i: i + config.batch_size]
                   for i in range(0, len(eval_items), config.batch_size)]
        with torch.no_grad():
            for batch in batches:
                with torch.autocast(device_type, torch.bfloat16, enabled=bf16):
                    metrics = loss_fn(batch)[1]
                for name, value in metrics.items():
                    totals[name] = totals.get(name, 0.0) + value / len(batches)
        module.train()
        return {f"eval_{name}": value for name, value in totals.items()}

    module.train()
    started = time.perf_counter() - seconds
    saved_at = time.perf_counter()
    bar = tqdm(total=config.steps, initial=step, desc=desc, unit="step")
    while step < last:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, config)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type, torch.bfloat16, enabled=bf16):
            loss, metrics = loss_fn(rng.sample(train_items, min(config.batch_size, len(train_items))))
        if loss is not None:  # None: loss_fn has accumulated the gradients itself
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        record = {"step": step, "lr": learning_rate(step - 1, config), **metrics}
        if eval_items and (step % config.eval_every == 0 or step in (last, config.steps)):
            record.update(evaluate())
        record["seconds"] = time.perf_counter() - started
        history.append(record)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}")
        due = step % config.checkpoint_every == 0 and time.perf_counter() - saved_at >= SAVE_SECONDS
        if due or step in (last, config.steps):
            save()
            plot_history(history, work_dir / "loss.png", desc)
            saved_at = time.perf_counter()
    bar.close()
    (work_dir / "history.json").write_text(json.dumps(history))
    return history


def training_mean(history: list[dict], step: int, name: str, span: int) -> float | None:
    """The metric `name` averaged over the training batches of the `span` steps up to `step`."""
    values = [h[name] for h in history if step - span < h["step"] <= step and name in h]
    return sum(values) / len(values) if values else None


def position_one(keys: set[str]) -> str | None:
    """The held-out agreement at the first draft position over answer positions (its name
    without "eval_"), where the keys hold one."""
    names = sorted(k for k in keys if k.startswith("eval_top1") and k.endswith("_answer"))
    return names[0].removeprefix("eval_") if names else None


def fit(history: list[dict]) -> dict | None:
    """Whether more steps or more data would help, read off the held-out agreement at position 1
    (answer positions) against the training batches' over the run's last third: "steps" while
    held-out still rises (by STILL_LEARNING), "data" where it has stopped while training batches
    keep rising (by MEMORISING: the drafter memorises its data), else "neither" (the drafter
    has stopped learning either way). None without three evaluations or an agreement metric."""
    evals = [h for h in history if any(k.startswith("eval_") for k in h)]
    name = position_one({k for h in evals for k in h})
    if len(evals) < 3 or name is None:
        return None
    last = evals[-1]
    since = min(evals[:-1], key=lambda h: abs(h["step"] - 2 * last["step"] / 3))
    span = max(1, min(TRAINING_SPAN, since["step"]))
    trained = [training_mean(history, h["step"], name, span) for h in (since, last)]
    if None in trained:
        return None
    held_gain = last[f"eval_{name}"] - since[f"eval_{name}"]
    trained_gain = trained[1] - trained[0]
    verdict = ("steps" if held_gain >= STILL_LEARNING
               else "data" if trained_gain >= MEMORISING else "neither")
    return {"metric": name, "since_step": since["step"], "step": last["step"],
            "held_out": last[f"eval_{name}"], "training": trained[1],
            "held_out_gain": held_gain, "training_gain": trained_gain, "verdict": verdict}


def describe_fit(report: dict) -> str:
    """One line for a user: what the last third of the run says about more steps or more data."""
    head = (f"held-out {report['metric']} {report['held_out']:.3f} (training batches "
            f"{report['training']:.3f}); from step {report['since_step']} to {report['step']} held-out "
            f"{report['held_out_gain']:+.3f}, training {report['training_gain']:+.3f}: ")
    return head + {
        "steps": "still learning, so more --steps should help",
        "data": "the drafter memorises this data; more data (--tokens) will help more than more --steps",
        "neither": "neither figure is rising; more --steps alone will not help",
    }[report["verdict"]]


def plot_history(history: list[dict], path: Path, title: str) -> None:
    """Training loss (smoothed) and held-out metrics against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    losses = [h["loss"] for h in history]
    window = max(1, len(losses) // 50)
    smooth = [sum(losses[max(0, i - window + 1): i + 1]) / len(losses[max(0, i - window + 1): i + 1])
              for i in range(len(losses))]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(steps, losses, color="0.8", label="loss per step")
    left.plot(steps, smooth, color="C0", label=f"mean of {window} steps")
    left.set_xlabel("step")
    left.set_ylabel("training loss")
    left.set_yscale("log")
    left.legend()
    evals = [h for h in history if any(k.startswith("eval_") for k in h)]
    # A drafter's agreement with its target, else (a model trained from scratch) its bits.
    agreement = any(k.startswith("eval_top1") for h in evals for k in h)
    prefix = "eval_top1" if agreement else "eval_bits"
    first = position_one({k for h in evals for k in h})
    for name in sorted({k for h in evals for k in h if k.startswith(prefix)}):
        line, = right.plot([h["step"] for h in evals], [h[name] for h in evals], marker="o",
                           linestyle="--" if name.endswith("_answer") else "-",  # answers only
                           label=name.removeprefix("eval_"))
        if name == f"eval_{first}":  # a gap between the two: the drafter memorises its data
            span = max(1, min(TRAINING_SPAN, evals[0]["step"]))
            trained = [(h["step"], training_mean(history, h["step"], first, span)) for h in evals]
            trained = [(s, v) for s, v in trained if v is not None]
            right.plot([s for s, _ in trained], [v for _, v in trained], color=line.get_color(),
                       alpha=0.4, linestyle=line.get_linestyle(), label=f"{first} (training batches)")
    right.set_xlabel("step")
    if agreement:
        right.set_ylabel("top-1 agreement with the target (held-out)")
        right.set_ylim(0, 1)
    else:
        right.set_ylabel("held-out bits per token")
    if evals:
        right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
