#!/usr/bin/env bash
# Run the test suite (sets up .venv first if needed). Tests use ../shared/models/stories260K and small
# in-memory models; tests needing a pulled model skip when it is absent. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then  # pytest: no tests collected
  echo "no tests collected"
  rc=0
fi
exit "$rc"
