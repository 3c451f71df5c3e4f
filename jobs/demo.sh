#!/usr/bin/env bash
# The main job on the embedded defaults: set up (idempotent), then run the demo. Extra arguments go to `aitlrt demo`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${AITLRT_VENV:-$ROOT/.venv}
bash "$ROOT/jobs/setup.sh"
cd "$ROOT"
"$VENV/bin/aitlrt" demo "$@"
