# Shared by the SLURM jobscripts (sourced, bash >= 4.4): logging, dry-run, project caches, node resources,
# hostname expansion, the aitlrt-serve health wait, child supervision, signals, requeue and resume.
# The caller sets ROOT (the repository) before sourcing.
# shellcheck shell=bash
# shellcheck disable=SC2034  # the globals set here (ARGS, NODES, WRAP, ...) are the sourcing script's

AITLRT_DRY_RUN=${AITLRT_DRY_RUN:-0}
CHILDREN=()   # pids of the background commands started with `spawn`
ARGS=()       # the script's arguments without --dry-run

log() { printf '[aitlrt-job] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }
dry_run() { [ "$AITLRT_DRY_RUN" = 1 ]; }

# --dry-run anywhere among the arguments; the others are left in ARGS.
parse_common_args() {
  local a
  for a in "$@"; do
    if [ "$a" = --dry-run ]; then AITLRT_DRY_RUN=1; else ARGS+=("$a"); fi
  done
}

# One command as a line of shell: words that need it are single-quoted.
quote_cmd() {
  local w out=()
  for w in "$@"; do
    if [[ $w =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=("$w"); else out+=("'${w//\'/\'\\\'\'}'"); fi
  done
  printf '%s\n' "${out[*]}"
}

show() { printf '+ %s\n' "$(quote_cmd "$@")"; }

# Run in the foreground (printed first; only printed in dry-run).
run() {
  show "$@"
  dry_run || "$@"
}

# Start in the background and remember the pid (in LAST_PID) for supervision and teardown.
spawn() {
  show "$@"
  LAST_PID=
  dry_run && return 0
  "$@" &
  LAST_PID=$!
  CHILDREN+=("$LAST_PID")
}

# Sleep that a trapped signal interrupts at once (a foreground sleep would delay the trap).
pause() {
  sleep "$1" &
  wait "$!" || true
}

export_var() {
  show export "$1=$2"
  export "$1=$2"
}

# ---- the project directory: every cache lives under it, not under $HOME ----------------------------------
setup_project_dir() {
  local dir=${AITLRT_PROJECT_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/.aitlrt}
  [[ $dir = /* ]] || dir=$PWD/$dir
  export_var AITLRT_PROJECT_DIR "$dir"
  export_var AITLRT_HOME "$dir/home"                # models, repos, test venvs (aitlrt/common/paths.py)
  # Per-rollout workspaces and Aider worker homes: node-local disk, not the shared filesystem.
  export_var AITLRT_SCRATCH "${AITLRT_SCRATCH:-${TMPDIR:-/tmp}/aitlrt-$JOB_ID}"
  export_var HF_HOME "$dir/hf"
  export_var PIP_CACHE_DIR "$dir/cache/pip"
  export_var UV_CACHE_DIR "$dir/cache/uv"
  export_var TRITON_CACHE_DIR "$dir/cache/triton"
  export_var XDG_CACHE_HOME "$dir/cache"            # vLLM, torch and flashinfer caches among others
  export_var WANDB_DIR "$dir/wandb"
  # In a container the image's own Aider and mini-swe-agent venvs are used.
  [ -n "${AITLRT_CONTAINER:-}" ] || export_var AITLRT_AIDER_VENV "$dir/aider-venv"
  [ -n "${AITLRT_CONTAINER:-}" ] || export_var AITLRT_MINISWE_VENV "$dir/miniswe-venv"
  dry_run || mkdir -p "$AITLRT_HOME" "$HF_HOME" "$XDG_CACHE_HOME" "$WANDB_DIR"
}

# Traffic to our own servers must not go through an HTTP proxy set for the outside world (curl and httpx
# honour no_proxy): HOSTS are added to it when a proxy is set.
bypass_proxy() {
  local h list=${no_proxy:-${NO_PROXY:-}}
  [ -n "${http_proxy:-}${HTTP_PROXY:-}${all_proxy:-}${ALL_PROXY:-}" ] || return 0
  for h in "$@"; do [[ ",$list," == *",$h,"* ]] || list=${list:+$list,}$h; done
  export_var no_proxy "$list"
  export_var NO_PROXY "$list"
}

# ---- the job ---------------------------------------------------------------------------------------------
JOB_ID=${SLURM_JOB_ID:-local}
job_number() { local n=${JOB_ID//[!0-9]/}; echo $((10#${n:-0})); }
# Ports derived from the job id, so two jobs sharing a node do not collide.
serve_port() { echo "${AITLRT_SERVE_PORT:-$((20000 + $(job_number) % 10000))}"; }
main_process_port() { echo "${AITLRT_MAIN_PORT:-$((30000 + $(job_number) % 10000))}"; }

# "node[01-03],gpu7" -> one hostname per line: scontrol when present, else expanded here.
expand_hostlist() {
  if command -v scontrol >/dev/null 2>&1; then
    scontrol show hostnames "$1"
  else
    expand_hostlist_bash "$1"
  fi
}

expand_hostlist_bash() {
  local list=$1 item="" c i depth=0
  for ((i = 0; i < ${#list}; i++)); do
    c=${list:i:1}
    case $c in
      '[') depth=$((depth + 1)) ;;
      ']') depth=$((depth - 1)) ;;
    esac
    if [ "$c" = , ] && [ "$depth" -eq 0 ]; then
      expand_host "$item" || return 1
      item=""
    else
      item+=$c
    fi
  done
  [ "$depth" -eq 0 ] || { log "bad host list: $list"; return 1; }
  expand_host "$item"
}

# One item: prefix[ranges]rest, ranges like 01-03,7; the rest may hold more brackets.
expand_host() {
  local item=$1 prefix rest ranges range lo hi n parts
  [ -n "$item" ] || return 0
  if [[ $item != *'['* ]]; then
    [[ $item != *']'* ]] || { log "bad host name: $item"; return 1; }
    printf '%s\n' "$item"
    return 0
  fi
  prefix=${item%%'['*}
  rest=${item#*'['}
  [[ $rest == *']'* ]] || { log "bad host range: $item"; return 1; }
  ranges=${rest%%']'*}
  rest=${rest#*']'}
  IFS=, read -ra parts <<<"$ranges"
  for range in "${parts[@]}"; do
    lo=${range%-*}
    hi=${range#*-}
    [[ $lo =~ ^[0-9]+$ && $hi =~ ^[0-9]+$ ]] || { log "bad host range: $item"; return 1; }
    for ((n = 10#$lo; n <= 10#$hi; n++)); do
      expand_host "$prefix$(printf '%0*d' "${#lo}" "$n")$rest" || return 1
    done
  done
}

job_nodes() {
  local list=${SLURM_JOB_NODELIST:-$(hostname)} out
  out=$(expand_hostlist "$list") && [ -n "$out" ] || die "cannot expand SLURM_JOB_NODELIST=$list"
  mapfile -t NODES <<<"$out"
}

# ---- resources of one node -------------------------------------------------------------------------------
gpus_per_node() {
  local n=${AITLRT_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
  if [ -z "$n" ] && [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    local list
    IFS=, read -ra list <<<"$CUDA_VISIBLE_DEVICES"
    n=${#list[@]}
  fi
  if [ -z "$n" ] && command -v nvidia-smi >/dev/null 2>&1; then n=$(nvidia-smi -L | grep -c '^GPU' || true); fi
  if ! [[ $n =~ ^[1-9][0-9]*$ ]]; then die "cannot tell how many GPUs this node has: set AITLRT_GPUS_PER_NODE"; fi
  echo "$n"
}

cpus_per_node() { echo "${SLURM_CPUS_ON_NODE:-$(nproc)}"; }

# Memory available to the job on one node, in MiB.
mem_per_node_mib() {
  if [ -n "${SLURM_MEM_PER_NODE:-}" ]; then
    echo "$SLURM_MEM_PER_NODE"
  elif [ -n "${SLURM_MEM_PER_CPU:-}" ]; then
    echo $((SLURM_MEM_PER_CPU * $(cpus_per_node)))
  else
    awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo
  fi
}

# Agents one node can run at once: a core each (2 kept for the trainer and the server) and 1 GiB each
# (an Aider worker is ~270 MB, plus the test run that grades it); AITLRT_AGENTS_PER_NODE overrides.
agents_per_node() {
  local by_cpu by_mem n
  if [ -n "${AITLRT_AGENTS_PER_NODE:-}" ]; then
    n=$AITLRT_AGENTS_PER_NODE
  else
    by_cpu=$(($(cpus_per_node) - 2))
    by_mem=$(($(mem_per_node_mib) / 1024))
    n=$((by_cpu < by_mem ? by_cpu : by_mem))
  fi
  echo $((n > 1 ? n : 1))
}

# --rollout_concurrency for each of RANKS training processes on a node.
rollout_concurrency() {
  local n=$(($(agents_per_node) / $1))
  echo $((n > 1 ? n : 1))
}

# ---- the training config ---------------------------------------------------------------------------------
# CONFIG and TRAIN_ARGS from AITLRT_CONFIG or the first argument, and the arguments after it.
parse_train_args() {
  CONFIG=${AITLRT_CONFIG:-}
  TRAIN_ARGS=("$@")
  if [ -z "$CONFIG" ] && [ $# -gt 0 ] && [[ $1 != --* ]]; then
    CONFIG=$1
    TRAIN_ARGS=("${@:2}")
  fi
  [ -n "$CONFIG" ] || die "no training config: set AITLRT_CONFIG or pass it first (e.g. configs/qwen_coder_7b_zero3.yaml)"
  [ -f "$CONFIG" ] || die "training config not found: $CONFIG"
}

# KEY DEFAULT: the last --KEY among TRAIN_ARGS, else the config's top-level "KEY: value", else DEFAULT.
config_value() {
  local key=$1 value="" found=0 i
  for ((i = 0; i < ${#TRAIN_ARGS[@]}; i++)); do
    case ${TRAIN_ARGS[i]} in
      "--$key") value=${TRAIN_ARGS[i + 1]:-} found=1 ;;
      "--$key="*) value=${TRAIN_ARGS[i]#*=} found=1 ;;
    esac
  done
  if [ "$found" = 0 ]; then
    value=$(sed -n "s/^$key:[[:space:]]*//p" "$CONFIG" | tail -n 1)
    value=${value%%[[:space:]]#*}
    value=${value%"${value##*[![:space:]]}"}
    if [[ $value =~ ^\"(.*)\"$ || $value =~ ^\'(.*)\'$ ]]; then value=${BASH_REMATCH[1]}; fi
    [ -n "$value" ] || value=$2
  fi
  printf '%s\n' "$value"
}

has_train_arg() {
  local a
  for a in "${TRAIN_ARGS[@]}"; do [[ $a == "--$1" || $a == "--$1="* ]] && return 0; done
  return 1
}

# The newest complete checkpoint-N (one with a non-empty trainer_state.json) in DIR, or nothing (only logged:
# aitlrt/train.py resolves `--resume_from_checkpoint true` itself, also passing over a state that does not parse).
latest_checkpoint() {
  local dir=$1 best="" bestn=-1 c n
  for c in "$dir"/checkpoint-*; do
    n=${c##*-}
    [[ $n =~ ^[0-9]+$ ]] && [ -s "$c/trainer_state.json" ] || continue
    if ((10#$n > bestn)); then bestn=$((10#$n)) best=$c; fi
  done
  if [ -n "$best" ]; then printf '%s\n' "$best"; fi
}

# --resume_from_checkpoint true (train.py: the newest complete checkpoint in output_dir DIR when the trainer
# starts, else a fresh start), unless the train args name one or AITLRT_RESUME=0. A requeued job thus continues
# from what the previous run saved; the checkpoint found now is only logged.
resume_args() {
  local ckpt
  RESUME_ARGS=()
  if [ "${AITLRT_RESUME:-1}" != 1 ] || has_train_arg resume_from_checkpoint; then return 0; fi
  RESUME_ARGS=(--resume_from_checkpoint true)
  ckpt=$(latest_checkpoint "$1")
  if [ -n "$ckpt" ]; then log "resuming from $ckpt (the newest complete checkpoint in $1)"; fi
}

# The sampling the trainer computes its losses with, forced on every call by aitlrt-serve (as train.py
# does for a managed server), and the config's serve_args unless AITLRT_SERVE_ARGS is set.
serve_sampling_args() {
  local top_k
  top_k=$(config_value top_k 0)
  [ "$top_k" != 0 ] || top_k=-1
  SAMPLING_ARGS=(
    --temperature "$(config_value temperature 1.0)"
    --top-p "$(config_value top_p 1.0)"
    --top-k "$top_k"
    --max-tokens "$(config_value max_completion_length 512)"
  )
  read -ra SERVE_EXTRA <<<"${AITLRT_SERVE_ARGS-$(config_value serve_args "")}"
}

# ---- commands: the venv's or the container's -------------------------------------------------------------
VENV=${AITLRT_VENV:-$ROOT/.venv}

# Sets WRAP: how every command is run (apptainer exec ... IMAGE in container mode, else nothing).
container_wrap() {
  WRAP=()
  [ -n "${AITLRT_CONTAINER:-}" ] || return 0
  [ -f "$AITLRT_CONTAINER" ] || dry_run || die "container image not found: $AITLRT_CONTAINER"
  local binds=() extra=() b seen=","
  IFS=, read -ra extra <<<"${AITLRT_CONTAINER_BINDS:-}"
  for b in "$AITLRT_PROJECT_DIR" "$ROOT" "$PWD" "${extra[@]}"; do
    if [ -z "$b" ] || [[ $seen == *",$b,"* ]]; then continue; fi
    binds+=("$b")
    seen+="$b,"
  done
  WRAP=("${AITLRT_APPTAINER:-apptainer}" exec --nv --bind "$(IFS=,; echo "${binds[*]}")" --pwd "$PWD" "$AITLRT_CONTAINER")
}

# The path of a command of the stack: on PATH in the image, else in the venv.
bin() {
  if [ -n "${AITLRT_CONTAINER:-}" ]; then echo "$1"; else echo "$VENV/bin/$1"; fi
}

# The training entry point: the image's copy in container mode (it matches the image's packages).
train_script() {
  if [ -n "${AITLRT_CONTAINER:-}" ]; then echo /opt/aitlrt/src/aitlrt/train.py; else echo "$ROOT/aitlrt/train.py"; fi
}

# The idempotent setup (seconds when up to date) outside containers; AITLRT_SETUP=0 skips it.
maybe_setup() {
  if [ -n "${AITLRT_CONTAINER:-}" ] || [ "${AITLRT_SETUP:-1}" != 1 ]; then return 0; fi
  run bash "$ROOT/jobs/setup.sh"
}

# vLLM's VLLM_TP x VLLM_DP over GPUS serving GPUs, NODE_GPUS of them per node (TP stays within a node), for MODEL
# served with SERVE_ARGS: AITLRT_VLLM_TP and/or AITLRT_VLLM_DP (the missing one derived), else chosen from the
# model's heads, KV heads and size by jobs/vllm_layout.py (its docstring has the rule), which logs why; the weights
# must fit AITLRT_GPU_MEMORY_GIB per GPU (default: nvidia-smi's; unknown: not checked).
vllm_layout() {
  local gpus=$1 node_gpus=$2 model=$3 out py=$VENV/bin/python
  shift 3
  [ -x "$py" ] || py=python3   # container mode: the host's (standard library only)
  out=$("$py" "$ROOT/jobs/vllm_layout.py" --model "$model" --gpus "$gpus" --gpus-per-node "$node_gpus" \
    --tp "${AITLRT_VLLM_TP:-}" --dp "${AITLRT_VLLM_DP:-}" -- "$@") || exit 2   # it printed the error
  read -r VLLM_TP VLLM_DP <<<"$out"
}

# ---- supervision, signals, requeue -----------------------------------------------------------------------
# ---- the admin key of aitlrt-serve (docs/serving.md#keys) ---------------------------------------------------
# Exports AITLRT_API_KEY for every step from here on (aitlrt-serve and the trainer read it from their environment,
# so that no command line shows it; the trainer takes it out of its own before any agent starts): the key in FILE
# (a requeued job keeps its key), else a new one written there (mode 600), unless AITLRT_API_KEY is set already.
use_api_key() {
  local file=$1
  if [ -n "${AITLRT_API_KEY:-}" ]; then
    log "admin key of aitlrt-serve: \$AITLRT_API_KEY"
  elif dry_run; then
    log "would read the admin key of aitlrt-serve from $file, or write a new one there"
    AITLRT_API_KEY=dry-run
  else
    mkdir -p "$(dirname "$file")"
    [ -s "$file" ] || (umask 077 && od -An -vtx1 -N32 /dev/urandom | tr -d ' \n' >"$file")
    AITLRT_API_KEY=$(<"$file")
    log "admin key of aitlrt-serve: $file"
  fi
  export AITLRT_API_KEY
}

# Until GET URL/health answers 200: fails if PID dies first or after AITLRT_SERVE_TIMEOUT seconds.
wait_healthy() {
  local url=$1 pid=$2 timeout=${AITLRT_SERVE_TIMEOUT:-1800} start=$SECONDS next=$SECONDS
  if dry_run; then
    log "would wait up to ${timeout}s for $url/health"
    return 0
  fi
  command -v curl >/dev/null 2>&1 || die "curl is needed to wait for aitlrt-serve"
  until curl -sf -o /dev/null --max-time 5 --noproxy "*" "$url/health"; do
    kill -0 "$pid" 2>/dev/null || die "aitlrt-serve exited before it became healthy (its output is above; vLLM's log: RUN_DIR/vllm.log)"
    ((SECONDS - start < timeout)) || die "aitlrt-serve not healthy after ${timeout}s (AITLRT_SERVE_TIMEOUT)"
    if ((SECONDS >= next)); then
      log "waiting for aitlrt-serve and vLLM at $url ($((SECONDS - start))s of ${timeout}s)"
      next=$((SECONDS + 30))
    fi
    pause 1
  done
  log "aitlrt-serve healthy at $url after $((SECONDS - start))s"
}

# Until the pid MAIN (named WHAT) exits, returning its status; any other pid exiting first fails the job.
supervise() {
  local what=$1 main=$2 pid rc=0
  shift 2
  dry_run && return 0
  while kill -0 "$main" 2>/dev/null; do
    for pid in "$@"; do
      kill -0 "$pid" 2>/dev/null || die "a server process ($pid) exited before $what; see its output above"
    done
    wait -n || true   # until a child exits, or a trapped signal arrives
  done
  wait "$main" || rc=$?
  log "$what exited with status $rc"
  return "$rc"
}

# SIGTERM to every child (srun forwards it to its tasks, aitlrt-serve stops vLLM, accelerate its ranks),
# SIGKILL after AITLRT_STOP_GRACE seconds.
stop_children() {
  local pid deadline=$((SECONDS + ${AITLRT_STOP_GRACE:-60}))
  for pid in "${CHILDREN[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${CHILDREN[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  CHILDREN=()
}

on_signal() {
  log "got SIG$1: stopping"
  stop_children
  exit "$2"
}

# SIGUSR1 (#SBATCH --signal=B:USR1@120): the time limit is near. Stop training (it resumes from its last saved
# checkpoint) and requeue the job, at most AITLRT_MAX_REQUEUES times.
on_usr1() {
  log "time limit near (SIGUSR1): stopping training"
  stop_children
  if [ -z "${SLURM_JOB_ID:-}" ]; then
    log "not under SLURM: not requeueing"
  elif ((${SLURM_RESTART_COUNT:-0} >= ${AITLRT_MAX_REQUEUES:-20})); then
    log "requeued ${SLURM_RESTART_COUNT} times already (AITLRT_MAX_REQUEUES): not requeueing"
  else
    run scontrol requeue "$SLURM_JOB_ID"
  fi
  exit 0
}

install_traps() {
  trap 'on_signal TERM 143' TERM
  trap 'on_signal INT 130' INT
  trap on_usr1 USR1
  trap stop_children EXIT
}
