import json

import pytest

from tests.tiny import save_tiny, tiny_llama


@pytest.fixture(scope="session")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-target"), seed=0)


@pytest.fixture(scope="session")
def questions(tmp_path_factory):
    """Two Spec-Bench-shaped questions in the tiny tokenizer's words (the bench tests)."""
    path = tmp_path_factory.mktemp("questions") / "questions.jsonl"
    rows = [{"question_id": 1, "category": "writing", "turns": ["w10 w11 w12 w10 w11 w12 w10", "w5"]},
            {"question_id": 2, "category": "qa", "turns": ["w20 w21 w22 w20 w21"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
