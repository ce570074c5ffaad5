"""The test session never writes into the user's draftwise cache (issue 21 D): ``DRAFTWISE_HOME`` is a temporary
directory for the whole session (tests/conftest.py), every cache directory draftwise computes resolves under it,
and pulled models are still read from the user's real models directory."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from conftest import USER_DRAFTWISE_HOME, USER_MODELS_DIR, pulled_model_path, session_draftwise_home
from draftwise.backends.kernels import kernel_cache_dir
from draftwise.speculation.calibration import calibration_dir
from draftwise.frspec import token_map_cache_dir
from draftwise.models.loading import dequantized_cache_dir
from draftwise.files import draftwise_home
from draftwise.models.pull import MODEL_REGISTRY, models_dir


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def test_the_session_home_is_a_temporary_directory_not_the_users():
    home = draftwise_home()
    assert os.environ["DRAFTWISE_HOME"] == str(home)
    assert home == session_draftwise_home() and home.is_dir()
    assert _inside(home, Path(tempfile.gettempdir())), home
    for real in (USER_DRAFTWISE_HOME, Path.home() / ".cache" / "draftwise"):
        assert not _inside(home, real) and not _inside(real, home), (home, real)


def test_every_cache_directory_resolves_under_the_session_home():
    home = session_draftwise_home()
    caches = {"calibration": calibration_dir(), "kernels": kernel_cache_dir(), "dequantized": dequantized_cache_dir(),
              "token_maps": token_map_cache_dir(), "models": models_dir()}
    for name, path in caches.items():
        assert path == home / name, (name, path)
        assert not _inside(path, USER_DRAFTWISE_HOME), (name, path)


def test_pulled_models_are_read_from_the_users_models_directory():
    assert USER_MODELS_DIR == USER_DRAFTWISE_HOME / "models"
    for name, source in MODEL_REGISTRY.items():
        assert pulled_model_path(name) == USER_MODELS_DIR / source.filename


def test_subprocesses_inherit_the_session_home():
    """``draftwise serve`` and the scripts run by tests in subprocesses write their caches there too."""
    code = "from draftwise.speculation.calibration import calibration_dir; print(calibration_dir())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout.strip()
    assert Path(out) == session_draftwise_home() / "calibration"
