"""The cost profile of a target on this machine: its forward over 1..17 rows with a fixed context
cached, its prefill rate, and what each candidate drafter costs per proposal and per drafted
token (with the acceptance it reached), all in seconds, measured once (medians of few repeats;
about 13 seconds for the built-in model in float32 on 2 cores, most of it the drafters' runs, 3.5
of them EAGLE's, whose few tokens a step take many target forwards) and
cached as JSON under $VERISPEC_PROFILE_DIR if set, else
$XDG_CACHE_HOME/verispec/profiles/ (default ~/.cache), keyed by the CPU (model
name and flags, and the instruction sets torch and oneDNN are held to), torch's version, the
target's fingerprint (name, weight format, a hash of its weights' shapes and leading values) and
the kernel its products run on: any change measures again. One process measures a key at a time
(a file lock beside the cached file); another wanting it waits and reads it.

`auto` (verispec.drafters.auto) decides by it; `verispec profile` prints and draws it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from verispec.core.cores import OthersLoad
from verispec.core.files import held, write_json, write_whole
from verispec.core.stopping import StoppingRules
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.auto import CostProfile, DrafterCost
from verispec.drafters.base import Drafter
from verispec.drafters.learned import CONFIG_FILE
from verispec.model.cached_model import CachedModel, forward_rows
from verispec.model.kernels.rows import instruction_limits
from verispec.model.loading import LoadedModel
from verispec.model.packed import linear_fingerprint

CONTEXT = 300  # tokens cached while the forward is timed
MAX_ROWS = 17  # the widest forward timed: a 16-token draft and the token before it
REPEATS = 3  # timings per row count after a warm-up round (the median is kept)
# Drafters are timed answering these requests (through the model's chat template where it has one,
# else continuing them raw), ANSWER_TOKENS new tokens each at most, an answer ending at the model's
# end of text; their acceptance in the best answer is the profile's prior. Real answers of three
# kinds (instructions, code, a rewrite that copies): continuing one text raw, most of the run was
# what the built-in model wrote past its end of text after 14 tokens, a loop or an answer by a
# near-tie, and a kernel with other roundings moved EAGLE's prior from 0.42 to 0.25 and suffix's
# from 0.82 to 0.39 (docs/tuning.md, "A prior that hinges on one continuation").
REQUESTS = (
    "Write a short guide for a new gardener. Explain when to plant tomatoes, how often to water "
    "them, which soil they like, and how to keep pests away without chemicals.",
    "Write a Python function that counts how often each word appears in a text file, and explain "
    "how it works.",
    "Rewrite this paragraph in plain words for a child, keeping every fact: The river rises in "
    "the northern hills and flows south for two hundred kilometres. Farmers along its banks grow "
    "rice and beans, and in spring the water floods their fields, which makes the soil rich.",
)
# The pooled acceptance also chooses auto's one self format, and an answer of 24 tokens was too short:
# two refusals decided it (Gemma 3 held to AVX2 got the slower format: docs/tuning.md).
ANSWER_TOKENS = 48
VERSION = 7  # of the file's layout and the way it is measured: a new one measures again
# A profile whose forward timings disagree between repeats by more than this (CostProfile.noise)
# was measured on a busy machine: its forward is timed again, up to ATTEMPTS times, and if it never
# agrees the profile is not cached (a test run beside a training run once cached T(8) = 14.8 T(1),
# and `auto` chose by it for good). Only the forward is timed again: the drafters' runs are most
# of a profile's time (the built-in model in float32 on 2 cores, under cProfile: 14.7 s of 20.3).
NOISY = 0.25
# The package's folders whose source runs a forward or a draft (profile_key's "code").
CODE = ("model", "drafters")
ATTEMPTS = 3
STEADY_FLOOR = 0.002  # seconds: a forward faster than this (a tiny model's) is not judged
# A steady load (another job keeping the cores busy throughout) times steadily and slowly, which
# the repeats cannot see: a profile is not cached either where other processes kept more than
# this many cores busy on average, beyond those this process's threads leave spare, while it was
# measured (verispec.core.cores: /proc/stat, or the cgroup's CPU time under a quota, less this
# process's own CPU time; hypervisor steal counts).
CROWDED = 0.25

# model -> {(its linear weights' fingerprint, threads, drafters): profile}
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cache_dir() -> Path:
    """Where profiles are cached: $VERISPEC_PROFILE_DIR (the test suite points it at a temporary
    folder, so its throwaway models leave nothing behind), else under the user's cache."""
    if os.environ.get("VERISPEC_PROFILE_DIR"):
        return Path(os.environ["VERISPEC_PROFILE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "verispec" / "profiles"


# CPU features that decide which kernels are fast (bfloat16 and integer paths).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def cpuinfo_fields(text: str | None = None) -> dict[str, str] | None:
    """The first processor's fields of /proc/cpuinfo (its `text`, read here by default); None
    where there is none to read (not Linux)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if ":" in line:
            key, value = line.split(":", 1)
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_identity() -> dict[str, str]:
    """The CPU's model name and a digest of all its flags (Linux), else the architecture, and the
    instruction sets torch and oneDNN are held to (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA: the
    same CPU held to AVX2 is another machine for costs)."""
    isa = instruction_limits()
    fields = cpuinfo_fields()
    if fields is None:
        return {"model": platform.processor() or platform.machine(), "flags": "", **isa}
    flags = " ".join(sorted(fields.get("flags", "").split()))
    return {"model": fields.get("model name", platform.machine()),
            "flags": hashlib.sha256(flags.encode()).hexdigest()[:16], **isa}


def cpu_description(text: str | None = None) -> str:
    """The CPU's model name, family and model numbers and its relevant flags (from
    /proc/cpuinfo's `text`, cpuinfo_fields), else the architecture. A cloud VM's model name may
    say only "AMD EPYC"; the numbers are what its CPUID reports (a hypervisor may present an
    older model than the host's: what a row costs is measured, the profile)."""
    fields = cpuinfo_fields(text)
    if fields is None:
        return platform.processor() or platform.machine()
    have = [flag for flag in CPU_FLAGS if flag in set(fields.get("flags", "").split())]
    name = fields.get("model name", platform.machine())
    if fields.get("cpu family", "").isdigit() and fields.get("model", "").isdigit():
        name += f" [family {fields['cpu family']} model {fields['model']}]"
    return f"{name} ({', '.join(have) or 'no AVX2'})"


def weights_digest(model: torch.nn.Module) -> str:
    """A hash of every parameter's name, shape, dtype and first 256 values: a different
    checkpoint or format of the same model gives another (seconds of hashing are not spent on
    reading every weight)."""
    digest = hashlib.sha256()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        head = tensor.detach().reshape(-1)[:256].float().cpu()
        digest.update(head.numpy().tobytes())
    return digest.hexdigest()[:16]


def code_digest(root: Path = Path(__file__).parent) -> str:
    """A digest of the source that runs a forward or a draft (CODE under the package `root`),
    with the shipped drafters' drafter.json (each export records its training, so a re-shipped
    drafter's changes): a profile measured before an edit to either (a faster kernel, norm or
    drafter, a retrained EAGLE whose acceptance differs) is measured again."""
    digest = hashlib.sha256()
    for folder in CODE:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in (".py", ".cpp") or path.name == CONFIG_FILE:
                digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def profile_key(target: LoadedModel, lm: CachedModel, drafters: list[str]) -> dict:
    """Everything the profile's figures depend on."""
    return {"version": VERSION, "cpu": cpu_identity(), "torch": torch.__version__, "code": code_digest(),
            "threads": torch.get_num_threads(), "target": target.name, "format": lm.precision,
            "weights": weights_digest(target.model), "kernel": lm.kernel, "path": lm.path,
            "drafters": sorted(drafters)}


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def cost_profile(target: LoadedModel, drafters: dict[str, Callable[[], Drafter]],
                 limits: dict[str, int], refresh: bool = False) -> CostProfile:
    """The profile of `target` with these candidate drafters (name -> a builder; each timed
    drafting up to limits[name]): this process's, else the cached file's, else measured now and
    cached (always measured with `refresh`)."""
    # Within a process only the weights (and the threads) can change: no key is built on a hit.
    memo = _MEMO.setdefault(target.model, {})
    seen = (linear_fingerprint(target.model), torch.get_num_threads(), tuple(sorted(drafters)))
    if seen in memo and not refresh:
        return memo[seen]
    lm = CachedModel(target.model)
    key = profile_key(target, lm, list(drafters))
    path = cache_dir() / f"{_digest(key)}.json"
    profile = None if refresh else read_profile(path, key)
    if profile is None:
        # One process measures a key at a time: another one measuring it (a second server started
        # beside the first, a test worker) is waited for and its cached profile read, instead of
        # two measuring at once, each timing the other's load.
        with held(path.with_suffix(".lock"),
                  "verispec: another process is measuring this cost profile; waiting for it"):
            profile = None if refresh else read_profile(path, key)
            if profile is None:
                profile = _measure_and_cache(target, lm, drafters, limits, path, key)
    memo[seen] = profile
    return profile


def _measure_and_cache(target: LoadedModel, lm: CachedModel, drafters: dict[str, Callable[[], Drafter]],
                       limits: dict[str, int], path: Path, key: dict) -> CostProfile:
    """Measure the profile; cache it at `path` unless a busy machine showed while it was measured."""
    with OthersLoad() as others:
        profile = measure(target, lm, drafters, limits)
    if not steady(profile):
        why = f"timings varied by {100 * profile.noise:.0f}% between repeats (a busy machine?)"
    elif crowded(others, profile):
        why = f"other processes kept {others.cores:.1f} cores busy while it was measured"
    else:
        why = None
        write_profile(path, key, profile)
    if why:
        print(f"verispec: the cost profile's {why}: used for this process, not cached; "
              "`verispec profile --refresh` on an idle machine measures it again", file=sys.stderr)
    return profile


def steady(timed: CostProfile | ForwardCost) -> bool:
    """Whether the forward timings agreed well enough between repeats to be this machine's (a
    tiny model's sub-millisecond forwards are not judged: their jitter is large and nothing but
    tests runs them)."""
    return timed.noise <= NOISY or timed.forward[0] < STEADY_FLOOR


def crowded(others: OthersLoad, timed: CostProfile) -> bool:
    """Whether other processes took cores this process's threads needed while `timed` was
    measured (more than CROWDED beyond the spare ones); a tiny model's is not judged (steady)."""
    return timed.forward[0] >= STEADY_FLOOR and others.took(torch.get_num_threads(), CROWDED)


def read_profile(path: Path, key: dict) -> CostProfile | None:
    """The profile cached at `path` if it was measured under `key` (None: absent, unreadable or
    another key)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != key:
        return None
    figures = data["profile"]
    return CostProfile(tuple(figures["forward"]), figures["context"], figures["prefill_rate"],
                       {name: DrafterCost(**cost) for name, cost in figures["drafters"].items()},
                       figures.get("noise", 0.0))


def write_profile(path: Path, key: dict, profile: CostProfile) -> None:
    """Cache `profile`, written whole (core.files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"key": key, "profile": asdict(profile)})


@dataclass(frozen=True)
class ForwardCost:
    """The target's part of a profile: seconds of a forward over 1..MAX_ROWS rows with `context`
    tokens cached, the prefill rate, and how much the repeats varied."""

    forward: tuple[float, ...]
    context: int
    prefill_rate: float
    noise: float


def measure(target: LoadedModel, lm: CachedModel, drafters: dict[str, Callable[[], Drafter]],
            limits: dict[str, int]) -> CostProfile:
    """Time the target's forward by rows and prefill (again while the repeats disagree, up to
    ATTEMPTS times: a second or two each), then each drafter once in a short generation (most of
    the time: a busy machine shows in the forward's repeats, and is not cached)."""
    prompts = _prompts(target, torch.Generator().manual_seed(0))
    # At a terminal, a bar: a first command waits on this (13-18 s for the built-in model).
    with tqdm(total=1 + len(drafters), desc=f"verispec: measuring {target.name}'s cost profile once",
              unit="part", file=sys.stderr, disable=None, leave=False) as bar:
        for _ in range(ATTEMPTS):
            timed = time_forward(target, lm, prompts[0])
            if steady(timed):
                break
        bar.update()
        costs = {}
        for name, build in drafters.items():
            bar.set_postfix_str(name)
            costs[name] = drafter_cost(target, build(), limits[name], prompts)
            bar.update()
    return CostProfile(timed.forward, timed.context, timed.prefill_rate, costs, timed.noise)


def time_forward(target: LoadedModel, lm: CachedModel, prompt: list[int]) -> ForwardCost:
    """The target's forward over 1..MAX_ROWS rows (medians of REPEATS) and its prefill rate."""
    cached = max(1, min(CONTEXT, target.context_length - MAX_ROWS))  # a short-context model's most
    # Text going on, through the engine's own pass, after a warm-up round: timed on random tokens
    # through CachedModel.forward without one, the figures read 20-45% above the engine's own
    # passes and grew too slowly with the rows (docs/tuning.md, "auto").
    text = torch.tensor(prompt * (1 + (cached + MAX_ROWS) // len(prompt)), device=lm.device)
    context = text[:cached]
    lm.reset()
    lm.forward(context[:64])  # warm-up
    lm.reset()
    started = time.perf_counter()
    lm.forward(context)
    prefill_rate = cached / (time.perf_counter() - started)
    times = forward_times(lm, text, cached, range(1, MAX_ROWS + 1), REPEATS)
    lm.reset()
    forward = non_decreasing([statistics.median(times[rows]) for rows in times])
    noise = statistics.median((max(t) - min(t)) / statistics.median(t) for t in times.values())
    return ForwardCost(forward, cached, prefill_rate, noise)


def forward_times(lm: CachedModel, text: torch.Tensor, cached: int, sizes: Iterable[int],
                  rounds: int) -> dict[int, list[float]]:
    """Seconds of the engine's pass over each of `sizes` rows of the text going on (text [cached
    + the most rows], its first `cached` tokens in lm's cache), `rounds` times each, after an
    untimed round that warms every shape up; the cache is left holding `cached` tokens."""
    times: dict[int, list[float]] = {rows: [] for rows in sizes}
    for repeat in range(1 + rounds):
        for rows in times:
            block = text[cached:cached + rows].to(lm.device)
            started = time.perf_counter()
            forward_rows([lm], [block], [None])  # the engine's pass (under inference mode)
            if lm.device.type == "cuda":
                torch.cuda.synchronize()  # GPU work is asynchronous: time it to the end
            if repeat:
                times[rows].append(time.perf_counter() - started)
            lm.rewind(cached)
    return times


def non_decreasing(values: list[float]) -> tuple[float, ...]:
    """The least-squares non-decreasing fit of `values` (pool adjacent violators): a forward over
    more rows does more work, so a dip in the medians is the machine's noise, and auto would
    choose its k by it (a float32 profile with T(9) 5% under T(8) held auto's self-drafter to 8
    tokens a step where 10 paid, 4% slower; docs/tuning.md).

    >>> non_decreasing([1.0, 3.0, 2.0, 4.0])
    (1.0, 2.5, 2.5, 4.0)
    """
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return tuple(total / count for total, count in blocks for _ in range(int(count)))


def _prompts(target: LoadedModel, generator: torch.Generator) -> list[list[int]]:
    """REQUESTS in the target's tokens (one prompt of random tokens for a model without a
    tokenizer, or whose tokenizer makes little of them), each within the context an answer leaves."""
    def encoded(text: str) -> list[int]:
        if target.has_chat_template:
            return target.chat_ids([{"role": "user", "content": text}])
        return list(target.tokenizer(text)["input_ids"])

    room = target.context_length - ANSWER_TOKENS - MAX_ROWS  # a draft is at most MAX_ROWS - 1 long
    prompts = [] if target.tokenizer is None else [encoded(text)[-room:] for text in REQUESTS]
    if any(len(ids) < 8 for ids in prompts) or not prompts:
        prompts = [torch.randint(0, target.vocab_size, (48,), generator=generator).tolist()[-room:]]
    return prompts


class _Alternating:
    """A draft-length policy alternating between two lengths, so that a fit separates the cost of
    a proposal from the cost of a drafted token."""

    def __init__(self, short: int, long: int) -> None:
        self.lengths, self.count = (short, long), 0

    def next_k(self) -> int:
        return self.lengths[self.count % 2]

    def update(self, num_drafted: int, num_accepted: int) -> None:
        self.count += 1


def drafter_cost(target: LoadedModel, drafter: Drafter, limit: int, prompts: list[list[int]]) -> DrafterCost:
    """A drafter's seconds per proposal and per drafted token (least squares over the steps of
    short greedy answers to `prompts`, drafting 1 and `limit` tokens in turn) and its per-token
    acceptance (accepted tokens over accepted tokens plus refusals) in the answer where it was
    highest, of those where it drafted at least 4 steps (None: in none). The best answer's and not
    all of them pooled: auto corrects a prior set too high within a few steps, where the drafter is
    chosen and refused, but not one set too low, where it is never chosen (on the bfloat16
    target EAGLE kept 0.35 / 0.42 / 0.18 of REQUESTS' answers, 0.45-0.5 on held-out prompts, and
    priced by all three pooled it drafted 17 of 1024 tokens there: docs/tuning.md). The pooled
    acceptance of those answers is kept too, for a choice made once and never revisited (auto's
    self format: verispec.methods)."""
    engine = SpeculativeEngine(target.model, drafter, _Alternating(1, limit))
    engine.generate(SequenceSpec(prompts[0], StoppingRules.build(4)))  # warm-up
    stopping = StoppingRules.build(ANSWER_TOKENS, target.eos_token_ids)
    # each answer's last step has no room to draft (a cap) or ended the answer (the end of text)
    answers = [engine.generate(SequenceSpec(prompt, stopping)).steps[:-1] for prompt in prompts]
    per_step, per_token = _fit([(step.num_drafted, step.draft_seconds)
                                for steps in answers for step in steps])
    counts = []  # (kept, refused) of each answer that drafted enough to tell
    for steps in answers:
        drafting = [step for step in steps if step.num_drafted]
        kept = sum(step.num_accepted for step in drafting)
        refused = sum(step.num_accepted < step.num_drafted for step in drafting)
        if len(drafting) >= 4 and kept + refused:
            counts.append((kept, refused))
    if not counts:
        return DrafterCost(per_step, per_token)
    kept, refused = (sum(column) for column in zip(*counts))
    return DrafterCost(per_step, per_token, max(k / (k + r) for k, r in counts), kept / (kept + refused))


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) >= 0 with seconds ~ a + b * tokens, least squares; b = 0 where every step drafted
    alike (a lookup drafting nothing, say).

    >>> [round(v, 6) for v in _fit([(1, 0.003), (4, 0.009), (1, 0.003), (4, 0.009)])]
    [0.001, 0.002]
    """
    xs, ys = [float(x) for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return statistics.median(ys), 0.0
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread)
    return max(0.0, mean_y - slope * mean_x), slope


def profile_table(profile: CostProfile) -> str:
    """The profile as text: the forward by rows (ms, and in one-row forwards), the prefill rate,
    each drafter's cost and measured acceptance."""
    one = profile.forward[0]
    lines = [f"target forward, {profile.context} tokens cached (ms; x one row):",
             "  " + "  ".join(f"{rows}: {seconds * 1e3:.1f} ({seconds / one:.2f}x)"
                              for rows, seconds in enumerate(profile.forward, 1)
                              if rows in (1, 2, 4, 8, 12, 16, 17)),
             f"prefill: {profile.prefill_rate:.0f} tokens/s; the forward's repeats varied by "
             f"{100 * profile.noise:.0f}% (median over row counts)",
             "drafter      ms/proposal  ms/token  acceptance: best answer  pooled"]
    for name, cost in profile.drafters.items():
        best, pooled = ("-" if rate is None else f"{rate:.3f}" for rate in (cost.acceptance, cost.pooled))
        lines.append(f"{name:<12} {cost.per_step * 1e3:11.2f} {cost.per_token * 1e3:9.2f}"
                     f"  {best:>23} {pooled:>7}")
    return "\n".join(lines)


def plot_profile(profile: CostProfile, path: Path, title: str) -> Path:
    """Draw the forward's cost by rows, with each drafter's k-token step (k drafts + the k + 1
    row forward) beside it, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.2))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    rows = list(range(1, len(profile.forward) + 1))
    axes.plot(rows, [s * 1e3 for s in profile.forward], marker="o", label="target forward")
    for name, cost in profile.drafters.items():
        steps = [profile.forward_seconds(k + 1) + cost.seconds(k) for k in range(1, len(rows))]
        axes.plot(rows[1:], [s * 1e3 for s in steps], linestyle="--", label=f"{name}: a k-token step")
    axes.set_xlabel("rows scored (a k-token draft: k + 1)")
    axes.set_ylabel("milliseconds")
    axes.set_ylim(bottom=0)
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8)
    figure.tight_layout()
    write_whole(path, lambda partial: figure.savefig(partial, format="png"))
    return path
