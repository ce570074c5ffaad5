"""The one atomic write (draftwise.files): a failed write leaves the old file and no temporary behind."""

from __future__ import annotations

import json
import stat

import pytest

from draftwise.files import atomic_write, draftwise_home, write_json_atomic


def test_atomic_write_replaces_and_a_failure_leaves_the_old_file_and_nothing_else(tmp_path):
    path = tmp_path / "sub" / "costs.json"
    write_json_atomic(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    assert stat.S_IMODE(path.stat().st_mode) == 0o644

    def broken(tmp: str) -> None:
        with open(tmp, "w") as handle:
            handle.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, broken)
    assert json.loads(path.read_text()) == {"a": 1}
    assert sorted(p.name for p in path.parent.iterdir()) == ["costs.json"]


def test_draftwise_home_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path))
    assert draftwise_home() == tmp_path
    monkeypatch.setenv("DRAFTWISE_HOME", "")
    assert draftwise_home().name == "draftwise"
