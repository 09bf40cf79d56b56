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
from verispec.core.cores import usable_cores
from verispec.model.cached_model import CachedModel
from verispec.model.loading import LoadedModel
from verispec.model.packed import packed_view
from verispec.profile import cpu_description


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
            # the cores it may use: a container shows its host's CPUs (cpu_count), runs on its quota's
            "cpu_count": os.cpu_count(), "usable_cores": usable_cores(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
