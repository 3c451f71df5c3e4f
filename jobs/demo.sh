#!/usr/bin/env bash
# The main job on the embedded defaults: set up (idempotent), then a real, short agent-in-the-loop GRPO run on CPU
# (bundled SmolLM2-135M on vLLM CPU behind aitlrt-serve, real Aider agents, tasks generated offline from a PyPI
# sdist). Extra arguments override the config, e.g. `bash jobs/demo.sh --max_steps 4`.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${AITLRT_VENV:-$ROOT/.venv}
bash "$ROOT/jobs/setup.sh"
cd "$ROOT"
"$VENV/bin/python" aitlrt/train.py --config configs/cpu_demo.yaml "$@"
