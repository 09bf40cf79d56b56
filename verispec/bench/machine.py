"""The machine a bench runs on: its CPU, the process's memory, and what one target forward
costs by the number of tokens it scores."""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time
from pathlib import Path

import torch

from verispec.bench.records import ForwardTimings
from verispec.model.cached_model import CachedModel
from verispec.model.loading import LoadedModel
from verispec.model.packed import packed_view


def measure_forward(target: LoadedModel, context: list[int], sizes=(1, 2, 4, 8, 16),
                    repeats: int = 7) -> ForwardTimings:
    """Median time of one target forward over n new tokens with the context cached, as the engine
    runs it (prepacked weights where they apply) and, for comparison, through the model's own
    linear layers as Hugging Face generate() runs it. The two are timed in turn, forward by
    forward, so that the machine's drifts in speed fall on both alike."""
    variants = {"by_tokens": CachedModel(target.model, pack=True)}
    if packed_view(target.model) is not target.model:  # else both would be the same measurement
        variants["unpacked_by_tokens"] = CachedModel(target.model, pack=False)
    for lm in variants.values():
        lm.forward(torch.tensor(context, device=lm.device))
    times: dict[str, dict[int, list[float]]] = {key: {n: [] for n in sizes} for key in variants}
    generator = torch.Generator().manual_seed(0)
    for _ in range(repeats):
        for n in sizes:
            tokens = torch.randint(0, target.vocab_size, (n,), generator=generator)
            for key, lm in variants.items():
                started = time.perf_counter()
                lm.forward(tokens.to(lm.device))
                if lm.device.type == "cuda":
                    torch.cuda.synchronize()  # GPU work is asynchronous: time it to the end
                times[key][n].append(time.perf_counter() - started)
                lm.rewind(len(context))
    medians = {key: {str(n): statistics.median(times[key][n]) for n in sizes} for key in variants}
    return ForwardTimings(medians["by_tokens"], medians.get("unpacked_by_tokens"),
                          variants["by_tokens"].lean is not None, len(context))


# CPU features that decide which kernels are fast (bfloat16 and integer paths).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def cpu_description(text: str | None = None) -> str:
    """The CPU's model name, family and model numbers and its relevant flags, from
    /proc/cpuinfo's `text` (read here by default; Linux), else the architecture. A cloud VM's
    model name may say only "AMD EPYC"; the numbers are what its CPUID reports (a hypervisor may
    present an older model than the host's: what a row costs is measured, `verispec profile`)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if ":" in line:
            key, value = line.split(":", 1)
            fields.setdefault(key.strip(), value.strip())  # the first processor's
    flags = set(fields.get("flags", "").split())
    have = [flag for flag in CPU_FLAGS if flag in flags]
    name = fields.get("model name", platform.machine())
    if fields.get("cpu family", "").isdigit() and fields.get("model", "").isdigit():
        name += f" [family {fields['cpu family']} model {fields['model']}]"
    return f"{name} ({', '.join(have) or 'no AVX2'})"


def resident_mib() -> float:
    """This process's resident memory now, in MiB (Linux; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakResident:
    """The most resident memory seen while the block runs (a thread samples every 5 ms)."""

    def __enter__(self) -> PeakResident:
        self.peak = resident_mib()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, resident_mib())

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, resident_mib())


def machine_info(device: str) -> dict:
    import transformers  # seconds to import: not for `verispec bench --help`

    info = {"platform": platform.platform(), "processor": cpu_description(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
