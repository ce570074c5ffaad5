#!/usr/bin/env bash
# Run the test suite (sets up .venv first if needed, llama.cpp included). Tests use ../shared/models/stories260K
# and small in-memory models; tests needing a pulled model skip when it is absent. The llama.cpp tests must run:
# DRAFTWISE_REQUIRE_LLAMA_CPP=1 turns a missing llama-cpp-python into failures. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export DRAFTWISE_REQUIRE_LLAMA_CPP="${DRAFTWISE_REQUIRE_LLAMA_CPP:-1}"
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then  # pytest: no tests collected
  echo "no tests collected"
  rc=0
fi
exit "$rc"
