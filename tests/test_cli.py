"""The command line: one-line errors for bad input, --json output, --help everywhere."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.tiny import tiny_llama
from verispec.cli import COMMANDS, demo, main
from verispec.core import cores


def test_generate_json_has_every_field(tiny_dir, capsys):
    code = main(["generate", "--model", str(tiny_dir), "--method", "pld", "--k", "4",
                 "--prompt", "w10 w11 w10 w11", "--max-new-tokens", "12", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", "stats"}
    assert set(out["stats"]) == {"new_tokens", "target_forwards", "mean_accepted_tokens",
                                 "acceptance_by_position", "draft_seconds", "verify_seconds",
                                 "tokens_per_second", "accepted_prediction_tokens",
                                 "rejected_prediction_tokens", "forced_tokens", "foreign_tokens",
                                 "boundary_lost", "choices", "invariance", "dtype", "kernel", "path"}
    stats = out["stats"]
    assert stats["path"] == "lean (llama)" and stats["invariance"] == "row-attention"
    assert stats["new_tokens"] == len(out["token_ids"]) <= 12
    assert stats["mean_accepted_tokens"] == pytest.approx(stats["new_tokens"] / stats["target_forwards"])


def test_generate_colours_tokens_by_fate(tiny_dir, capsys):
    code = main(["generate", "--model", str(tiny_dir), "--method", "early-exit", "--exit-layer", "1",
                 "--prompt", "w10 w11", "--max-new-tokens", "16", "--color", "always"])
    out = capsys.readouterr().out
    assert code == 0
    assert "\033[32m" in out or "\033[34m" in out  # accepted drafts or corrections are painted
    assert "tau" in out and "acceptance by draft position" in out


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "w5", "--temperature", "-1"], "temperature must be >= 0"),
    (["--prompt", "w5", "--temperature", "nan"], "finite"),
    (["--prompt", "w5", "--temperature", "1", "--top-p", "0"], "top_p"),
    (["--prompt", "w5", "--temperature", "1", "--top-p", "1.1"], "top_p"),
    (["--prompt", "w5", "--top-k", "-1"], "top_k"),
    (["--prompt", "w5", "--method", "pld", "--k", "-1"], "k must be an integer >= 0"),
    (["--prompt", "w5", "--method", "pld", "--model-k", "0"], "model_k must be an integer >= 1"),
    (["--prompt", "w5", "--method", "draft"], "needs a draft model"),
    (["--prompt", "w5", "--max-new-tokens", "1000"], "exceeds the model's context"),
    (["--prompt", " ".join(["w5"] * 600)], "exceeds the model's context"),
])
def test_bad_generate_input_is_one_line_error(tiny_dir, capsys, args, message):
    code = main(["generate", "--model", str(tiny_dir), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_unknown_or_unusable_models_are_one_line_errors(tmp_path, capsys):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("not a model")
    fake_gguf = tmp_path / "fake.gguf"
    fake_gguf.write_bytes(b"not a gguf file")
    for model, message in [(str(tmp_path / "missing"), "unknown model"),
                           (str(junk), "not a causal LM"),
                           (str(fake_gguf), "not a GGUF causal LM")]:
        code = main(["generate", "--model", model, "--prompt", "hi"])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, err


def test_draft_vocabulary_unreadable_as_text_is_one_line_error(tiny_dir, tmp_path, capsys):
    """Another vocabulary whose tokens are not text pieces (words joined by spaces): refused."""
    from tests.tiny import tiny_tokenizer

    other = tmp_path / "other"
    tiny_llama(seed=2).save_pretrained(other)
    tiny_tokenizer(prefix="z").save_pretrained(other)
    code = main(["generate", "--model", str(tiny_dir), "--method", "draft", "--draft", str(other),
                 "--prompt", "w5"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot read the target's tokenizer's tokens as text" in err


def test_an_address_that_cannot_be_served_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """`verispec serve` on a port in use, out of range, or with a negative drain: a one-line error
    and exit 2, with no model loaded (the model given does not exist: loading it would fail
    otherwise), not uvicorn's traceback after the load."""
    import socket

    from verispec.cli import serve as serve_cli

    monkeypatch.setattr(serve_cli, "load_model", lambda *args: pytest.fail("the model was loaded"))
    missing = str(tmp_path / "missing")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code = main(["serve", "--model", missing, "--port", str(port)])
        err = capsys.readouterr().err
        assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err, err
    with socket.create_server(("::1", 0), family=socket.AF_INET6) as taken:  # an IPv6 host is checked as one
        port = taken.getsockname()[1]
        assert main(["serve", "--model", missing, "--host", "::1", "--port", str(port)]) == 2
        assert f"cannot listen on ::1:{port}: Address already in use" in capsys.readouterr().err
    for args, message in [(["--port", "65536"], "a port is 0..65535"),
                          (["--drain-seconds", "-1"], "drain seconds must be a finite number >= 0")]:
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "--model", missing, *args])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("command", [["bench", "--questions", "q.jsonl"], ["train", "eagle"],
                                     ["train", "data"], ["export", "--format", "vllm"]])
def test_an_output_directory_that_cannot_be_made_is_refused_before_any_work(tmp_path, capsys, command):
    """--out under a file, or a file itself: a usage error naming it as the flags are read (before
    a model loads, questions are read or anything is measured), and nothing made."""
    (tmp_path / "file").write_text("")
    for out, message in [(tmp_path / "file" / "out", "cannot make"), (tmp_path / "file", "is a file")]:
        with pytest.raises(SystemExit) as exit_info:
            main([*command, "--out", str(out)])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert [path.name for path in tmp_path.iterdir()] == ["file"]


def test_unknown_method_is_refused(tiny_dir):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(tiny_dir), "--method", "magic", "--prompt", "w5"])
    assert exit_info.value.code == 2


def test_help_runs_as_a_program():
    """`python -m verispec.cli --help` in a process of its own (the entry point, imports and all)."""
    out = subprocess.run([sys.executable, "-m", "verispec.cli", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert out.startswith("usage: verispec")


@pytest.mark.parametrize("command", ["generate", "demo", "bench", "serve", "train", "export", "profile"])
def test_help_on_every_command(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: verispec {command}")


@pytest.mark.parametrize("tree", [["3x8"], []])  # [] : --tree alone, pld's default tree
def test_generate_shows_each_steps_tree_with_the_accepted_path(tiny_dir, capsys, tree):
    code = main(["generate", "--model", str(tiny_dir), "--method", "pld", "--k", "4", "--tree", *tree,
                 "--show-tree", "--prompt", "w5 w6 w7 w5 w6 w8 w5 w6 w9 w5 w6", "--raw",
                 "--max-new-tokens", "12", "--color", "never"])
    out = capsys.readouterr().out
    assert code == 0 and "(root)" in out and "draft nodes, depth" in out


@pytest.mark.parametrize("args, message", [
    (["--method", "pld", "--tree", "0x4"], "TOPKxNODES"),
    (["--method", "pld", "--tree", "four"], "TOPKxNODES"),
    (["--method", "ar", "--tree", "2x4"], "chains only"),
    (["--method", "ar", "--tree"], "chains only"),
    (["--method", "early-exit", "--tree"], "no measured default tree"),
    (["--method", "pld", "--acceptance", "fast"], "unknown acceptance rule 'fast'"),
])
def test_bad_tree_or_acceptance_is_refused(tiny_dir, capsys, args, message):
    try:
        code = main(["generate", "--model", str(tiny_dir), "--prompt", "w5", *args])
    except SystemExit as exit:  # argparse refuses bad values itself
        code = exit.code
    assert code == 2 and message in capsys.readouterr().err


def test_lossy_acceptance_rules_are_labelled_lossy_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "typical: Medusa's typical acceptance, LOSSY" in help_text
    assert "tv:X (e.g. tv:0.1): keep a draft token outright where draft and target are within total " \
           "variation X, LOSSY" in help_text


def test_a_model_without_a_chat_template_takes_the_prompt_raw(tmp_path, capsys):
    """A base model (no chat template) needs no --raw; with a template the prompt goes through it."""
    from tests.tiny import save_tiny

    directory = save_tiny(tmp_path / "base")
    config = directory / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings.pop("chat_template", None)
    config.write_text(json.dumps(settings))
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    args = ["generate", "--model", str(directory), "--prompt", "w5 w6", "--max-new-tokens", "4", "--json"]
    assert main(args) == 0
    base = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*args, "--raw"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == base


def test_the_top_level_help_lists_every_command_without_importing_torch():
    """`verispec --help` answers at once: neither it nor `import verispec` imports torch (seconds);
    each command is listed with its summary, and every public name still resolves on first use."""
    probe = ("import sys, verispec, verispec.cli\n"
             "try:\n    verispec.cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    *shown, imported = done.stdout.strip().splitlines()
    assert imported == "False"
    from verispec.cli import COMMANDS, build_parser
    for name, summary in COMMANDS.items():
        assert any(line.split()[:1] == [name] for line in shown), name
        full = next(a for a in build_parser(name)._subparsers._group_actions).choices[name]
        assert full.format_help().count("--") > 1 and summary.split()[0] in " ".join(shown)
    import verispec
    assert sorted(verispec.__all__) == sorted(verispec._EXPORTS)
    assert all(getattr(verispec, name) is not None for name in verispec.__all__)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_commands_help_does_not_import_transformers(command: str) -> None:
    """`verispec generate --help` (and a typo in an option) answers without transformers, which
    takes seconds to import: it is imported where a model is loaded, type hints import it only
    for the type checker. (It was 6 s on this project's 2-core VM, 4.6 s of it imports.)"""
    probe = ("import sys, verispec.cli\n"
             f"try:\n    verispec.cli.main([{command!r}, '--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')[:3])\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_demo_says_when_other_processes_took_its_cores(tiny_dir, monkeypatch, capsys):
    """The demo's speedup comes with a word where other processes kept the cores busy while it
    decoded (every core, here, by a stand-in for the count), and without one where none did."""
    for busy, said in ((None, False), (1.0, True)):
        class Loaded(cores.OthersLoad):
            share = busy

            def __exit__(self, *exc: object) -> None:
                self.cores = None if self.share is None else self.share * self.capacity

        monkeypatch.setattr(demo, "OthersLoad", Loaded)
        assert main(["demo", "--model", str(tiny_dir), "--method", "pld", "--max-new-tokens", "4",
                     "--color", "never"]) == 0
        out = capsys.readouterr().out
        assert "speedup of pld" in out and ("a busy machine" in out) == said
