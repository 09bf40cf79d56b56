"""The machine a bench runs on: its CPU, the process's memory, and what one target forward
costs by the number of tokens it scores."""

from __future__ import annotations

import os
import platform
import statistics
import threading
from pathlib import Path

import torch

from verispec.bench.records import ForwardTimings
from verispec.core.cores import usable_cores
from verispec.model.cached_model import CachedModel
from verispec.model.loading import LoadedModel
from verispec.model.packed import packed_view
from verispec.profile import cpu_description, forward_times


def measure_forward(target: LoadedModel, context: list[int], sizes=(1, 2, 4, 8, 16),
                    repeats: int = 7) -> ForwardTimings:
    """Median time of one target forward over n new tokens with the context cached, as the engine
    runs it (its own pass, prepacked weights where they apply) and, for comparison, through the
    model's own linear layers as Hugging Face generate() runs it: each variant alone, after a
    warm-up round, on the text going on, as the cost profile times it (profile.forward_times).
    (Timed forward by forward in turn with the other variant, each after a dequantized copy of the
    4-bit head that `vocab_size` used to make, the built-in 4-bit target's one-token forward read
    4.6 ms where decoding ran 3.5.)"""
    variants = {"by_tokens": CachedModel(target.model, pack=True)}
    if packed_view(target.model) is not target.model:  # else both would be the same measurement
        variants["unpacked_by_tokens"] = CachedModel(target.model, pack=False)
    cached = len(context)
    text = torch.tensor(context * (2 + max(sizes) // cached))  # [context + what goes on]
    medians = {}
    for key, lm in variants.items():
        lm.forward(text[:cached].to(lm.device))
        times = forward_times(lm, text, cached, sizes, repeats)
        medians[key] = {str(n): statistics.median(times[n]) for n in sizes}
        lm.reset()
    return ForwardTimings(medians["by_tokens"], medians.get("unpacked_by_tokens"),
                          variants["by_tokens"].lean is not None, cached)


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
