"""When llama.cpp tests may skip: only when llama-cpp-python is absent and ``DRAFTWISE_REQUIRE_LLAMA_CPP`` is unset.

``scripts/test.sh`` (and so CI) installs llama-cpp-python and exports ``DRAFTWISE_REQUIRE_LLAMA_CPP=1``: the
llama.cpp tests then run, and fail (import errors, plus ``test_llama_cpp_is_installed_when_required``) if the
package went missing, instead of skipping silently.
"""

from __future__ import annotations

import os

import pytest

from draftwise.backends.llama_cpp_backend import llama_cpp_available

#: Environment variable that turns "llama-cpp-python is missing" from a skip into failures.
REQUIRE_ENV = "DRAFTWISE_REQUIRE_LLAMA_CPP"


def llama_cpp_required() -> bool:
    """True when the environment asks for the llama.cpp tests to run (any value but empty or ``0``)."""
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


#: Marks tests that need llama-cpp-python: skipped without it, unless :data:`REQUIRE_ENV` is set.
needs_llama_cpp = pytest.mark.skipif(
    not llama_cpp_available() and not llama_cpp_required(),
    reason=f"llama-cpp-python is not installed (scripts/install_llama_cpp.sh; {REQUIRE_ENV}=1 makes this a failure)",
)
