#!/usr/bin/env bash
# Serving only, for evaluation: aitlrt-serve with vLLM on the job's GPUs (one node), reachable from other nodes.
# Prints the URL once vLLM is healthy (also written to RUN_DIR/url) and serves until the job ends or is cancelled.
#
#   sbatch jobs/slurm_serve.sh --model Qwen/Qwen2.5-Coder-7B-Instruct --max-tokens 1024   # aitlrt-serve flags
#   AITLRT_API_KEY=$(cat RUN_DIR/api_key) aitlrt eval --proxy http://NODE:PORT --checkpoint served --tasks tasks.jsonl
#   bash jobs/slurm_serve.sh --dry-run --model bundled                                    # print the commands only
#
# Knobs, besides those of jobs/lib.sh (README, "Running on GPUs and SLURM clusters"):
#   AITLRT_MODEL               model to serve (or pass --model)                   aitlrt-serve's default, bundled
#   AITLRT_VLLM_TP, AITLRT_VLLM_DP   TP x DP = the job's GPUs                      jobs/vllm_layout.py
#   AITLRT_GPU_MEMORY_GIB      one GPU's memory, to check the weights fit vLLM's layout   nvidia-smi
#
#SBATCH --job-name=aitlrt-serve
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --mem=64G
#SBATCH --time=08:00:00
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
ROOT=${AITLRT_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
[ -f "$ROOT/jobs/lib.sh" ] || ROOT=${SLURM_SUBMIT_DIR:-$PWD}  # sbatch runs a spooled copy of this script
# shellcheck source=jobs/lib.sh
source "$ROOT/jobs/lib.sh"

parse_common_args "$@"
[ "${SLURM_NNODES:-1}" = 1 ] || die "this script serves from one node, the job has $SLURM_NNODES"
GPUS=$(gpus_per_node)
MODEL_ARGS=()
[ -z "${AITLRT_MODEL:-}" ] || MODEL_ARGS=(--model "$AITLRT_MODEL")
MODEL=${AITLRT_MODEL:-bundled}   # the model whose shape sets vLLM's layout: the last --model wins
for ((i = 0; i < ${#ARGS[@]}; i++)); do
  case ${ARGS[i]} in
    --model) MODEL=${ARGS[i + 1]:-$MODEL} ;;
    --model=*) MODEL=${ARGS[i]#*=} ;;
  esac
done

setup_project_dir
maybe_setup
container_wrap
vllm_layout "$GPUS" "$GPUS" "$MODEL" "${ARGS[@]}"
DP_ARGS=()
((VLLM_DP == 1)) || DP_ARGS=(--data-parallel-size "$VLLM_DP")
PORT=$(serve_port)
URL=http://$(hostname):$PORT
RUN_DIR=$AITLRT_PROJECT_DIR/serve/$JOB_ID
install_traps
use_api_key "$RUN_DIR/api_key"  # 0.0.0.0: every route takes a key

spawn "${WRAP[@]}" "$(bin aitlrt-serve)" "${MODEL_ARGS[@]}" --host 0.0.0.0 --port "$PORT" --run-dir "$RUN_DIR" \
  --tensor-parallel-size "$VLLM_TP" "${DP_ARGS[@]}" "${ARGS[@]}"
SERVE_PID=$LAST_PID
wait_healthy "$URL" "$SERVE_PID"
dry_run || echo "$URL" >"$RUN_DIR/url"
log "serving at $URL (vLLM TP $VLLM_TP x DP $VLLM_DP on $GPUS GPU(s)); admin key in $RUN_DIR/api_key; e.g." \
  "AITLRT_API_KEY=\$(cat $RUN_DIR/api_key) aitlrt eval --proxy $URL --checkpoint served --tasks FILE"
supervise aitlrt-serve "$SERVE_PID"
