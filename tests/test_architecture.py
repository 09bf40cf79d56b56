"""The package's shape: no import cycles, the engine below the registry, a method added in one
place reaching generate, the command line and the bench, and options= honoured field by field."""

from __future__ import annotations

import ast
import json
import re
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

import verispec
from verispec import api
from verispec.bench.runner import BenchConfig, run_bench
from verispec.cli import main
from verispec.core.errors import VerispecError
from verispec.core.tree import TreeSettings
from verispec.core.types import Proposal
from verispec.drafters.base import Drafter, DraftRequest
from verispec.methods import METHODS, Method, methods_table
from verispec.options import DraftOptions
from verispec.training.shell import RecipeOptions

PACKAGE = Path(verispec.__file__).parent
README = PACKAGE.parent / "README.md"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """verispec module -> the verispec modules it imports (at any depth of its code); importing
    a.b.c also runs the packages a and a.b."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("verispec"):
                found = [f"{node.module}.{a.name}" for a in node.names
                         if f"{node.module}.{a.name}" in modules]
                targets.update(found or [node.module])
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("verispec"))
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        closed = set()
        for target in targets:  # a module's packages run first (its own are running already)
            parts = target.split(".")
            closed.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
        graph[name] = {t for t in closed - own if t in modules}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "verispec.methods" in graph and graph["verispec.decoding.engine"]  # the graph was read
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = import_graph()
    graph["verispec.decoding.engine"] = graph["verispec.decoding.engine"] | {"verispec.methods"}
    assert find_cycle(graph) is not None


MAX_FUNCTION_LINES = 100


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """Functions (nested ones and methods too) longer than `limit` lines, from `def` to their
    last line: name at its line -> length."""
    return {f"{node.name} (line {node.lineno})": node.end_lineno - node.lineno + 1
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit}


def test_no_function_in_the_package_is_over_100_lines():
    found = {f"{path.relative_to(PACKAGE.parent)}: {name}": length
             for path in sorted(PACKAGE.rglob("*.py"))
             for name, length in long_functions(path.read_text()).items()}
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"


def test_the_length_check_finds_a_planted_long_function():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    source = f"class A:\n    def outer(self):\n        def inner():\n{body.replace('    ', '            ')}"
    assert set(long_functions(source)) == {"outer (line 2)", "inner (line 3)"}
    assert not long_functions(f"def short():\n{body[:-len(body.splitlines()[-1]) - 1]}")


def test_the_engine_sits_below_the_registry_and_the_drafters():
    below = reachable(import_graph(), "verispec.decoding.engine")
    assert "verispec.methods" not in below and "verispec.options" not in below
    # the contract, and the caller's predicted output (a sequence's, not a method's drafter)
    allowed = {"verispec.drafters.base", "verispec.drafters.prediction"}
    assert not any(m.startswith("verispec.drafters.") and m not in allowed for m in below)
    assert not any(m.startswith(("verispec.bench", "verispec.cli", "verispec.server")) for m in below)


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def layout() -> list[tuple[str, dict[str, list[str]]]]:
    """docs/architecture.md's layer table: per layer, each folder's (or the package's) modules, as
    module names ("verispec.core.types"), in the table's order (core first)."""
    layers = []
    for line in ARCHITECTURE.read_text().split("## Layout", 1)[1].split("\n## ", 1)[0].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("layer", "---"):
            continue
        folders = re.findall(r"`(verispec/[a-z_/]*)`", cells[1])
        groups = cells[2].split(";") if len(folders) > 1 else [cells[2]]
        found: dict[str, list[str]] = {}
        for folder, group in zip(folders, groups):
            names = group.split(":", 1)[-1]
            package = folder.strip("/").replace("/", ".")
            found[package] = [f"{package}.{name.strip()}" for name in names.split(",") if name.strip()]
        layers.append((cells[0], found))
    return layers


def layer_of(module: str, layers: list[tuple[str, dict[str, list[str]]]]) -> int | None:
    """The index of the layer holding `module` (a module of a listed one counts as it)."""
    for index, (_, found) in enumerate(layers):
        for modules in found.values():
            if any(module == m or module.startswith(m + ".") for m in modules):
                return index
    return None


def test_the_layout_in_the_docs_lists_every_module_and_only_those():
    listed = {m for _, found in layout() for modules in found.values() for m in modules}
    files = {module_name(p) for p in PACKAGE.rglob("*.py")
             if p.name not in ("__init__.py", "__main__.py")}
    assert len(layout()) >= 8 and "verispec.decoding.engine" in listed  # the table was read
    assert files - listed == set(), "modules missing from docs/architecture.md's layout"
    assert listed - files == set(), "docs/architecture.md lists modules that do not exist"


def layer_breaches(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a module to a module of a later (higher) layer of the table."""
    layers = layout()
    breaches = []
    for module, targets in graph.items():
        own = layer_of(module, layers)
        for target in targets:
            other = layer_of(target, layers)
            if own is not None and other is not None and other > own:
                breaches.append(f"{module} ({layers[own][0]}) imports {target} ({layers[other][0]})")
    return breaches


def test_each_layer_imports_only_from_itself_and_the_layers_below():
    graph = import_graph()
    assert layer_breaches(graph) == []
    graph["verispec.core.types"] = graph["verispec.core.types"] | {"verispec.model.loading"}
    assert layer_breaches(graph), "a planted upward import went unseen"


def test_no_module_outside_the_registry_names_a_method():
    """Method names as string constants belong to verispec/methods.py alone (docstrings and
    help prose aside: only whole-string constants count). A trained drafter's module names its
    own kind once, as the class attribute `kind`. Names that are also DraftOptions or
    RecipeOptions fields ("draft"; "block", a block drafter's block size), OpenAI request fields
    ("suffix") or other settings' values ("auto": --color) cannot be told apart and are not
    checked."""
    unchecked = ({f.name for f in fields(DraftOptions)} | {f.name for f in fields(RecipeOptions)}
                 | {"suffix", "auto"})
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "methods.py" and path.parent == PACKAGE:
            continue
        tree = ast.parse(path.read_text())
        own_kind = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    and [getattr(t, "id", None) for t in node.targets] == ["kind"]
                    and path.parent.name == "drafters"}
        for node in ast.walk(tree):
            if id(node) in own_kind:
                continue
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in METHODS
                    and node.value not in unchecked):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}")
    assert not offenders, "method names listed outside verispec/methods.py:\n" + "\n".join(offenders)


class EchoDrafter(Drafter):
    """A toy drafter: proposes the last token again, k times (one-hot q)."""

    def reset(self) -> None:
        pass

    def propose(self, request: DraftRequest) -> Proposal:
        return Proposal(torch.full((request.k,), request.tokens[-1], dtype=torch.long))

    def commit(self, num_accepted: int) -> None:
        pass


@pytest.fixture
def toy_method(monkeypatch):
    """A method registered in one place: the registry. Nothing else is touched."""
    built = []

    def build(target, options):
        built.append(options)
        return EchoDrafter()

    toy = Method("toy-echo", "repeats the last token", 3, build, "never: a test's method")
    monkeypatch.setitem(METHODS, toy.name, toy)
    return built


def test_a_method_registered_once_runs_through_generate_the_cli_and_the_bench(
        toy_method, target, tiny_dir, tmp_path, capsys):
    plain = verispec.generate(target, [5, 6, 7], max_new_tokens=12)
    fast = verispec.generate(target, [5, 6, 7], max_new_tokens=12, method="toy-echo",
                             options=DraftOptions(k=2))
    assert fast.token_ids == plain.token_ids
    assert sum(fast.stats.drafted_by_position) > 0 and toy_method[-1].k == 2

    assert main(["generate", "--model", str(tiny_dir), "--method", "toy-echo", "--prompt", "w5 w6",
                 "--raw", "--max-new-tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["new_tokens"] == 8

    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["w5 w6 w5"]}) + "\n")
    results = run_bench(BenchConfig(model=str(tiny_dir), out=tmp_path / "out", questions=questions,
                                    methods=["toy-echo"], max_new_tokens=8, warmup=0), progress=False)
    runs = [r for r in results.runs if r.method == "toy-echo"]
    assert runs and all(r.identical_to_baseline for r in runs)


def every_field_set() -> DraftOptions:
    """DraftOptions with every field away from its default."""
    changed = {"k": 3, "model_k": 1, "schedule": "heuristic", "confidence_threshold": 0.25,
               "draft": "some/dir", "exit_layer": 1, "max_ngram": 5, "min_ngram": 1,
               "tree": TreeSettings(2, 3),
               "acceptance": "typical", "group": 64, "skip_layers": (1,), "lookahead_window": 3,
               "lookahead_ngram": 4, "lookahead_guesses": 3, "lookahead_pool_context": False,
               "suffix_factor": 2.0, "suffix_min_prob": 0.2, "suffix_cache_tokens": 1000}
    assert set(changed) == {f.name for f in fields(DraftOptions)}, "a new field: give it a value here"
    options = DraftOptions(**changed)
    assert all(getattr(options, f.name) != f.default for f in fields(DraftOptions))
    return options


def test_generate_keeps_every_field_of_options(target):
    options = every_field_set()
    _, request = api.prepare(target, [5, 6], method="pld", options=options, max_new_tokens=4)
    assert (request.method, request.options) == ("pld", options)
    # Hugging Face-style keywords that agree with options, or set what options leaves alone, apply.
    _, request = api.prepare(target, [5, 6], method="pld", options=replace(options, k=None),
                             num_assistant_tokens=6, tree=TreeSettings(2, 3), max_new_tokens=4)
    assert request.options == replace(options, k=6)


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "pld", "options": DraftOptions(k=3), "num_assistant_tokens": 5}, "k given twice"),
    ({"method": "pld", "options": DraftOptions(acceptance="typical"), "acceptance": "exact"},
     "acceptance given twice"),
    ({"prompt_lookup_num_tokens": 4, "num_assistant_tokens": 5}, "k given twice"),
    ({"options": DraftOptions(k=3)}, "give method= too"),
    ({"method": "pld", "prompt_lookup_num_tokens": 4}, "choose one speculation method"),
])
def test_conflicting_arguments_are_a_clear_error(target, kwargs, message):
    with pytest.raises(VerispecError, match=message):
        api.prepare(target, [5, 6], max_new_tokens=4, **kwargs)


def test_every_drafting_option_has_one_flag_in_each_command(capsys):
    for command in ("generate", "demo", "bench", "serve"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        for f in fields(DraftOptions):
            assert "--" + f.name.replace("_", "-") in text, (command, f.name)


def test_the_readme_method_table_is_the_registrys():
    assert methods_table() in README.read_text(), (
        "README's method table differs from the registry: paste methods_table() "
        "(python -c 'from verispec.methods import methods_table; print(methods_table())')")


def test_the_readme_is_short_and_its_quickstart_is_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) < 200
    quickstart = re.search(r"## Quickstart.*?```bash\n(.*?)```", text, re.S).group(1)
    assert len([line for line in quickstart.splitlines() if line.strip()]) == 2


def test_every_planted_bug_still_finds_its_code_and_its_guard() -> None:
    """`make mutate` (CI) refuses to run when a mutant's search text or guarding test has moved;
    checking that here fails the suite at the change that moved it, not an hour later in CI."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "scripts/mutate.py", "--check"], cwd=PACKAGE.parent,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "each search text found once" in done.stdout
