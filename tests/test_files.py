"""core.files: a file is replaced whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verispec.core.files import write_json, write_whole


def test_a_write_that_fails_halfway_leaves_the_old_file_and_no_partial(tmp_path: Path) -> None:
    path = tmp_path / "choice.json"
    write_json(path, {"label": "first"})

    def half_then_fail(partial: Path) -> None:
        partial.write_text('{"label": "sec')  # half a record, then the writer dies
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_whole(path, half_then_fail)
    assert json.loads(path.read_text()) == {"label": "first"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["choice.json"]


def test_a_whole_write_replaces_the_file_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    write_json(path, {"forward": [1.0]})
    write_json(path, {"forward": [2.0, 3.0]}, indent=None)
    assert json.loads(path.read_text()) == {"forward": [2.0, 3.0]}
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]
