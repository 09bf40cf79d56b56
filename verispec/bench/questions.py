"""Benchmark questions: the Spec-Bench file format, its six tasks, and a small built-in set.

The built-in prompts (prompts.jsonl, two per task) were written for verispec so that
`verispec bench` runs out of the box; Spec-Bench's own questions (Apache-2.0) are read from a file
the user passes with --questions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from verispec.core.errors import VerispecError

BUILTIN_QUESTIONS = Path(__file__).with_name("prompts.jsonl")
# Spec-Bench groups its categories into six tasks.
TASK_OF_CATEGORY = {
    **{c: "mt_bench" for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction",
                               "stem", "humanities")},
    **{t: t for t in ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")},
}
TASKS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class Question:
    question_id: int
    task: str
    prompt: str  # the first turn; later turns of multi-turn questions are not run


def load_questions(path: Path | None = None, tasks: list[str] | None = None,
                   limit_per_task: int | None = None) -> list[Question]:
    """Read a Spec-Bench-format file (one JSON object a line), keep chosen tasks, the first N of each."""
    path = BUILTIN_QUESTIONS if path is None else Path(path)
    if not path.is_file():
        raise VerispecError(f"question file {path} does not exist")
    questions: list[Question] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            category, turns = item["category"], item["turns"]
            prompt = turns[0]
            questions.append(Question(int(item["question_id"]), TASK_OF_CATEGORY.get(category, category),
                                      prompt))
        except (ValueError, KeyError, IndexError, TypeError) as error:
            raise VerispecError(f"{path}:{number}: not a Spec-Bench question "
                                f"({{question_id, category, turns}}): {error}") from error
    if tasks:
        unknown = set(tasks) - {q.task for q in questions}
        if unknown:
            raise VerispecError(f"no questions for task(s) {', '.join(sorted(unknown))} in {path}")
        questions = [q for q in questions if q.task in tasks]
    if limit_per_task is not None:
        if limit_per_task < 1:
            raise VerispecError(f"--limit-per-task must be >= 1, got {limit_per_task}")
        seen: dict[str, int] = {}
        kept = []
        for q in questions:
            seen[q.task] = seen.get(q.task, 0) + 1
            if seen[q.task] <= limit_per_task:
                kept.append(q)
        questions = kept
    if not questions:
        raise VerispecError(f"no questions selected from {path}")
    return questions
