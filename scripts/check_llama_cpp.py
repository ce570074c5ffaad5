"""Is llama-cpp-python installed the way draftwise needs it? Used by scripts/install_llama_cpp.sh.

    python scripts/check_llama_cpp.py --requirement   # print the pinned requirement (pyproject's `llama` extra)
    python scripts/check_llama_cpp.py                 # exit 0 when installed as pinned and without AMX kernels,
                                                      # else print why on stderr and exit 1

Run it with the interpreter of the environment to check (.venv/bin/python).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
PACKAGE = "llama-cpp-python"


def pinned_requirement(pyproject: Path = PYPROJECT) -> str:
    """The ``llama-cpp-python==X.Y.Z`` line of pyproject.toml's ``llama`` extra.

    Raises:
        ValueError: the extra is missing or does not pin one exact version.
    """
    extras = tomllib.loads(pyproject.read_text())["project"].get("optional-dependencies", {})
    for requirement in extras.get("llama", []):
        name, sep, version = requirement.partition("==")
        if name.strip().lower() == PACKAGE and sep and version.strip():
            return f"{PACKAGE}=={version.strip()}"
    raise ValueError(f"{pyproject}: the `llama` extra must pin {PACKAGE}==<version>")


def problem() -> str | None:
    """Why the installed llama-cpp-python is not usable as is (None when it is)."""
    wanted = pinned_requirement().partition("==")[2]
    try:
        installed = metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return f"{PACKAGE} is not installed"
    if installed != wanted:
        return f"{PACKAGE} {installed} is installed, pyproject.toml pins {wanted}"
    from draftwise.backends.llama_cpp_backend import compiled_cpu_features, has_amx_kernels

    try:
        features = compiled_cpu_features()
    except (ImportError, OSError) as error:
        return f"{PACKAGE} {installed} does not load: {error}"
    if has_amx_kernels(features):
        return f"{PACKAGE} {installed} was compiled with AMX kernels (they can crash with SIGILL)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requirement", action="store_true", help="print the pinned requirement and exit")
    args = parser.parse_args(argv)
    if args.requirement:
        print(pinned_requirement())
        return 0
    reason = problem()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
