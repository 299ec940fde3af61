"""atomic_write.py: the file is replaced whole or not at all, and no temporary file is left behind."""

from __future__ import annotations

import json
import os

import pytest

from areal_async.atomic_write import write_json_atomic, write_lines_atomic, write_text_atomic


def test_replaces_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.jsonl"
    path.write_text("old\n")
    write_lines_atomic(str(path), ["a\n", "b\n"])
    assert path.read_text() == "a\nb\n"
    write_text_atomic(str(path), "c\n")
    assert path.read_text() == "c\n"
    write_json_atomic(str(tmp_path / "x.json"), {"k": 1}, indent=2)
    assert json.loads((tmp_path / "x.json").read_text()) == {"k": 1}
    assert sorted(os.listdir(tmp_path)) == ["state.jsonl", "x.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "state.jsonl"
    path.write_text("old\n")

    def lines():
        yield "new\n"
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_lines_atomic(str(path), lines())
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["state.jsonl"]
    with pytest.raises(TypeError):  # not serialisable: nothing is opened
        write_json_atomic(str(path), {"k": object()})
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["state.jsonl"]
