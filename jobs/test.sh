#!/usr/bin/env bash
# Set up (idempotent) and run the linter and the whole test suite. Extra arguments go to pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${AITLRT_VENV:-$ROOT/.venv}
bash "$ROOT/jobs/setup.sh"
cd "$ROOT"
"$VENV/bin/ruff" check .
"$VENV/bin/python" -m pytest "$@"
