#!/usr/bin/env bash
# Set up (idempotent), then the linter, the type checker and the whole test suite. Extra arguments go to pytest
# (the fast loop without servers: `.venv/bin/python -m pytest tests/unit`).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${AITLRT_VENV:-$ROOT/.venv}
bash "$ROOT/jobs/setup.sh"
cd "$ROOT"
"$VENV/bin/ruff" check .
"$VENV/bin/mypy"
"$VENV/bin/python" -m pytest "$@"
