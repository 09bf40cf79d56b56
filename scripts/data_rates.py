"""The data engine's rates: reply tokens per second of each mode on a target, and what 1 M and
10 M tokens would take at that rate.

Builds --tokens reply tokens (plus the held-out split) with each mode into a fresh directory under
--work, times the build (the source's reading timed apart and left out of the rate), and prints
one line per mode. Run it on an idle machine for figures worth reporting:

    pip install 'verispec[sharegpt]'
    python scripts/data_rates.py --source sharegpt --tokens 20000 --work /tmp/rates
    python scripts/data_rates.py --source sharegpt --tokens 20000 --work /tmp/rates --dtype bfloat16
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from verispec.drafters.eagle3 import default_aux_layers
from verispec.model.loading import DEFAULT_MODEL, PRECISIONS, load_model
from verispec.training.data_engine import HELD_OUT, MODES, build_data, shard_tokens
from verispec.training.sources import read_source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32", choices=list(PRECISIONS))
    parser.add_argument("--source", default="sharegpt")
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--work", required=True, help="scratch directory (emptied per mode)")
    args = parser.parse_args()
    target = load_model(args.target, args.dtype)
    aux = default_aux_layers(target.model.config.get_text_config(decoder=True).num_hidden_layers)
    started = time.perf_counter()
    read_source(args.source)
    reading = time.perf_counter() - started
    print(f"reading the source {args.source}: {reading:.1f} s (once per build, not in the rates)")
    for mode in args.modes:
        out = Path(args.work) / mode
        shutil.rmtree(out, ignore_errors=True)
        started = time.perf_counter()
        build_data(target, out, args.source, mode, args.tokens, aux_layers=aux)
        seconds = time.perf_counter() - started - reading
        made = sum(shard_tokens(out).values()) + sum(shard_tokens(out / HELD_OUT).values())
        rate = made / seconds
        size = sum(p.stat().st_size for p in out.rglob("shard-*.pt"))
        print(f"{mode:8s} {args.dtype}: {made} reply tokens in {seconds:.0f} s = {rate:.0f} tokens/s; "
              f"1 M tokens {1e6 / rate / 3600:.1f} h, 10 M {1e7 / rate / 3600:.1f} h; "
              f"disk {size / made / 1024:.1f} KiB per reply token", flush=True)


if __name__ == "__main__":
    main()
