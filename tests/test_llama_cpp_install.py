"""How llama-cpp-python is installed (issue 15): present when CI requires it, the pinned version, no AMX kernels.

A plain ``pip install llama-cpp-python`` compiles llama.cpp with ``-march=native``, which turns its AMX kernels
on for CPUs that report AMX; there they crashed with SIGILL. ``scripts/install_llama_cpp.sh`` (run by
``scripts/setup.sh``) compiles without them.
"""

from __future__ import annotations

import importlib.util
import platform
import re
import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from draftwise.backends.llama_cpp_backend import (
    compiled_cpu_features,
    has_amx_kernels,
    llama_cpp_available,
    parse_system_info,
)
from llama_cpp_gate import REQUIRE_ENV, llama_cpp_required, needs_llama_cpp

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"


def load_check_script():
    """scripts/check_llama_cpp.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("check_llama_cpp", SCRIPTS / "check_llama_cpp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# llama_print_system_info as a plain `pip install` build would report it on an AMX CPU: this build's line
# (scripts/install_llama_cpp.sh, AVX-512 CPU) plus the AMX_INT8 entry ggml-cpu adds when its AMX kernels are in.
AMX_BUILD_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
                  "AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | "
                  "OPENMP = 1 | REPACK = 1 | ")


def test_system_info_is_parsed_into_features():
    features = parse_system_info(AMX_BUILD_INFO)
    assert features["SSE3"] == "1" and features["AVX512_BF16"] == "1" and features["REPACK"] == "1"
    assert features["AMX_INT8"] == "1"
    assert parse_system_info("") == {}


def test_amx_kernels_are_detected():
    assert has_amx_kernels(parse_system_info(AMX_BUILD_INFO))
    assert not has_amx_kernels(parse_system_info(AMX_BUILD_INFO.replace("AMX_INT8 = 1 | ", "")))
    assert not has_amx_kernels({"AMX_INT8": "0", "AVX512": "1"})


def test_llama_cpp_is_installed_when_required():
    if not llama_cpp_required():
        pytest.skip(f"{REQUIRE_ENV} is not set (scripts/test.sh sets it)")
    assert llama_cpp_available(), (f"{REQUIRE_ENV} is set but llama-cpp-python is missing: scripts/setup.sh "
                                   "should have built it (scripts/install_llama_cpp.sh)")


@needs_llama_cpp
def test_installed_build_has_no_amx_kernels():
    features = compiled_cpu_features()
    assert features, "llama.cpp reported no CPU features"
    assert not has_amx_kernels(features), f"llama.cpp was compiled with AMX kernels: {features}"


@needs_llama_cpp
def test_installed_version_is_the_pinned_one():
    pinned = load_check_script().pinned_requirement()
    assert pinned == f"llama-cpp-python=={metadata.version('llama-cpp-python')}"


def test_pin_is_read_from_the_llama_extra(tmp_path):
    check = load_check_script()
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(textwrap.dedent("""
        [project]
        name = "x"
        [project.optional-dependencies]
        test = ["pytest"]
        llama = ["llama-cpp-python==1.2.3"]
    """))
    assert check.pinned_requirement(pyproject) == "llama-cpp-python==1.2.3"
    pyproject.write_text('[project]\nname = "x"\n[project.optional-dependencies]\nllama = ["llama-cpp-python>=1"]\n')
    with pytest.raises(ValueError, match="must pin"):
        check.pinned_requirement(pyproject)


def test_check_script_rejects_a_build_with_amx_kernels(monkeypatch):
    import draftwise.backends.llama_cpp_backend as backend

    check = load_check_script()
    pinned_version = check.pinned_requirement().partition("==")[2]
    monkeypatch.setattr(check.metadata, "version", lambda name: pinned_version)
    monkeypatch.setattr(backend, "compiled_cpu_features", lambda: parse_system_info(AMX_BUILD_INFO))
    assert "AMX" in check.problem()
    monkeypatch.setattr(check.metadata, "version", lambda name: "0.0.1")
    assert "pins" in check.problem()


@needs_llama_cpp
def test_loading_an_amx_build_warns(monkeypatch, caplog):
    import draftwise.backends.llama_cpp_backend as backend

    current = backend._llama()  # kept alive: its log callback must outlive the swap below
    monkeypatch.setattr(backend, "compiled_cpu_features", lambda: parse_system_info(AMX_BUILD_INFO))
    backend._llama.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=backend.__name__):
            backend._llama()
        assert "AMX kernels" in caplog.text and "scripts/install_llama_cpp.sh" in caplog.text
    finally:
        backend._llama.cache_clear()
        monkeypatch.undo()
        backend._llama()
        del current


@needs_llama_cpp
def test_check_script_accepts_the_installed_build():
    result = subprocess.run([sys.executable, str(SCRIPTS / "check_llama_cpp.py")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


def amx_macros(flags: list[str]) -> list[str]:
    """The ``__AMX*__`` macros GCC defines for ``flags`` (preprocessing an empty C file)."""
    result = subprocess.run(["gcc", *flags, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True,
                            check=True, timeout=60)
    return [line.split()[1] for line in result.stdout.splitlines() if line.startswith("#define __AMX")]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("gcc") is None,
                    reason="needs gcc on x86-64")
def test_install_flags_keep_amx_out_even_on_an_amx_cpu():
    """The build compiles with -march=native, which turns AMX on for CPUs that report it. The script's explicit
    -mno-amx-* flags must win although CMake puts them before -march: checked here with -march=sapphirerapids
    (an AMX CPU) standing in for -march=native on such a machine."""
    script = (SCRIPTS / "install_llama_cpp.sh").read_text()
    flags = re.search(r'amx_off="([^"]+)"', script).group(1).split()
    assert 'CFLAGS="${CFLAGS:-} $amx_off"' in script and 'CXXFLAGS="${CXXFLAGS:-} $amx_off"' in script
    assert "__AMX_INT8__" in amx_macros(["-march=sapphirerapids"])  # the control: AMX is on without the flags
    assert amx_macros([*flags, "-march=sapphirerapids"]) == []
    assert amx_macros(["-march=sapphirerapids", *flags]) == []
