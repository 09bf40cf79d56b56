"""The README runs (issue 41, item 1): its Python blocks execute, in order, on the built-in model,
and each of its `verispec` command lines runs (the server's parses), all with a few new tokens, so
an example can never drift from the code again. The bench and training commands run marked slow.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

import verispec
from verispec.cli import build_parser, main
from verispec.methods import METHODS, PLAIN

README = Path(__file__).resolve().parent.parent / "README.md"
NEW_TOKENS = 3  # every example's generation budget here
QUESTION = {"question_id": 1, "category": "writing", "turns": ["Name a colour."]}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def blocks(language: str) -> list[str]:
    """The README's fenced blocks of `language`, in order."""
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)


def commands() -> list[str]:
    """Every `verispec ...` command line of the README's bash blocks (continuations joined,
    comments cut)."""
    found = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("verispec "):
                found.append(" ".join(line.split()))
    return found


def test_the_readme_has_examples_to_run():
    assert len(blocks("python")) >= 2 and len(commands()) >= 10


def test_the_python_blocks_run(monkeypatch):
    """Each block in one namespace, as a reader pastes them; `original_code` is the text the
    README leaves to the reader; generation is capped at NEW_TOKENS."""
    for name in ("generate", "stream"):
        function = getattr(verispec, name)

        def capped(*args, _function=function, **kwargs):
            kwargs["max_new_tokens"] = min(kwargs.get("max_new_tokens", NEW_TOKENS), NEW_TOKENS)
            return _function(*args, **kwargs)
        monkeypatch.setattr(verispec, name, capped)
    namespace = {"original_code": "def add(a, b):\n    return a + b\n"}
    for block in blocks("python"):
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - the README's own code
    assert namespace["result"].stats.new_tokens <= NEW_TOKENS


# Commands run as written plus a budget; those that take minutes are slow; the server only parses
# (it serves until stopped: tests/test_serve*.py run it).
SLOW = ("verispec bench", "verispec train")


def case(command: str):
    marks = [pytest.mark.slow] if command.startswith(SLOW) else []
    return pytest.param(command, marks=marks, id=command[:70])


@pytest.mark.parametrize("command", [case(c) for c in commands()])
def test_every_command_runs(command, tmp_path, monkeypatch, capsys):
    args = shlex.split(command)[1:]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "person.json").write_text(json.dumps(PERSON))
    (tmp_path / "questions.jsonl").write_text(json.dumps(QUESTION) + "\n")
    if "--questions" in args:  # the published runs' Spec-Bench file is not in the repository
        args[args.index("--questions") + 1] = "questions.jsonl"
    if args[0] == "serve":
        build_parser().parse_args(args)
        return
    if "llama.cpp" in command:
        pytest.importorskip("llama_cpp", reason="the llamacpp extra")
    budget = {"generate": {"--max-new-tokens": NEW_TOKENS}, "demo": {"--max-new-tokens": NEW_TOKENS},
              "bench": {"--max-new-tokens": NEW_TOKENS, "--warmup": 0, "--out": "bench-out"},
              "train": {"--steps": 1, "--prompts": 2, "--max-new-tokens": 8}, "export": {}}[args[0]]
    for flag, value in budget.items():  # the command's own value replaced, else the flag added
        if flag in args:
            args[args.index(flag) + 1] = str(value)
        else:
            args += [flag, str(value)]
    code = main(args)
    assert code == 0, capsys.readouterr().err


def test_the_readmes_method_count_is_the_registrys():
    count = int(re.search(r"verispec runs (\d+) speculation methods", README.read_text()).group(1))
    assert count == len([name for name in METHODS if name != PLAIN]), "README's method count"
