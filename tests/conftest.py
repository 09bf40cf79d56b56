import json
import os
import shutil
import tempfile
import weakref

import pytest
import torch

from tests.tiny import TINY_RECIPE, save_tiny, tiny_llama
from verispec import profile
from verispec.core.cores import affinity, cgroup_quota, usable_cores


def pytest_configure(config) -> None:
    """Cost profiles measured during the suite (of its throwaway tiny models, and of the built-in
    model under test code) go to a folder of the run's own, inherited by the CLI subprocesses, and
    leave nothing in the user's cache; they are measured briefly."""
    if "VERISPEC_PROFILE_DIR" not in os.environ:
        config._verispec_profiles = tempfile.mkdtemp(prefix="verispec-profiles-")
        os.environ["VERISPEC_PROFILE_DIR"] = config._verispec_profiles
    # Measured briefly: tests check what a command does, never its speed (the profile's own tests
    # set these themselves); a full profile of the built-in model took 29 s of test_demo_runs.
    profile.REPEATS, profile.ANSWER_TOKENS = 1, 8
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        # `make test` runs one pytest-xdist worker per core: each on its share of the cores (one
        # thread on two cores), as are the CLI commands it starts, or the workers' threads contend
        # and the suite runs several times slower. The tiny models gain nothing from a second
        # thread; that a forward's bits do not depend on the thread count is a test of its own.
        # The cores are those a CPU quota allows, where a container has one (its host's are all
        # visible there).
        threads = max(1, usable_cores() // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_report_header(config) -> str:
    """The cores the run may use, heading its output (CI's machine is seen only through it)."""
    quota = cgroup_quota()
    return (f"cores: {usable_cores()} usable ({len(affinity())} CPUs visible, CPU quota "
            f"{'none' if quota is None else f'{quota[0]:g} cores'}); torch threads {torch.get_num_threads()}")


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: a worker per core this process may use (a CPU quota's, in a container)."""
    return usable_cores()


def pytest_unconfigure(config) -> None:
    folder = getattr(config, "_verispec_profiles", None)
    if folder:
        os.environ.pop("VERISPEC_PROFILE_DIR", None)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def full_precision_drafting(monkeypatch):
    """Drafters' products at their weights' own precision (as training computes them, and as vLLM
    runs an exported drafter) instead of in 8 bits: for tests of the function a drafter computes.
    The 8-bit products have their own test (test_learned_drafters)."""
    from verispec.drafters import learned

    monkeypatch.setattr(learned, "draft_in_8_bits", lambda module: False)
    monkeypatch.setattr(learned, "_HEADS", weakref.WeakKeyDictionary())  # heads made in 8 bits


@pytest.fixture(scope="session")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-target"), seed=0)


@pytest.fixture(scope="session")
def tiny_data(tiny_dir, tmp_path_factory):
    """Self-distillation data of the tiny target (exit layer 1; aux layers (0, 1, 2): the engines'
    default (2, N // 2, N - 3) for its 3 layers)."""
    from verispec.model.loading import load_model
    from verispec.training.data import build_dataset

    return build_dataset(load_model(str(tiny_dir)), tmp_path_factory.mktemp("data"), num_prompts=12,
                         max_new_tokens=16, batch_size=4, exit_layer=1, aux_layers=(0, 1, 2))


@pytest.fixture(scope="session")
def tiny_trained(tiny_dir, tiny_data, tmp_path_factory):
    """A drafter of every trained kind for the tiny target (a few steps each): kind -> directory."""
    from verispec.model.loading import load_model
    from verispec.training.recipes import KINDS, train_drafter
    from verispec.training.trainer import TrainConfig

    loaded = load_model(str(tiny_dir))
    config = TrainConfig(steps=4, warmup=1, batch_size=4, eval_every=1, checkpoint_every=2)
    return {kind: train_drafter(kind, loaded, [tiny_data], tmp_path_factory.mktemp(kind), config,
                                TINY_RECIPE)
            for kind in KINDS}


@pytest.fixture(scope="session")
def questions(tmp_path_factory):
    """Two Spec-Bench-shaped questions in the tiny tokenizer's words (the bench tests)."""
    path = tmp_path_factory.mktemp("questions") / "questions.jsonl"
    rows = [{"question_id": 1, "category": "writing", "turns": ["w10 w11 w12 w10 w11 w12 w10", "w5"]},
            {"question_id": 2, "category": "qa", "turns": ["w20 w21 w22 w20 w21"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
