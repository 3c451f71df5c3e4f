#!/usr/bin/env bash
# Several nodes: the first AITLRT_SERVE_NODES node(s) run vLLM behind aitlrt-serve (one srun step), the others
# train (one srun step, one `accelerate launch` per node, machine rank = the task's SLURM_PROCID). The policy
# reaches vLLM as safetensors in --weight_sync_dir, which must be on a filesystem every node sees.
#
#   sbatch --nodes=3 jobs/slurm_multi_node.sh configs/qwen_coder_7b_zero3.yaml [train flags ...]
#   bash jobs/slurm_multi_node.sh --dry-run configs/qwen_coder_7b_zero3.yaml   # print the commands only
#
# Submit from the repository root. Knobs, besides those of jobs/lib.sh (README, "Running on GPUs and SLURM
# clusters"):
#   AITLRT_CONFIG              training config (or the first argument)              required
#   AITLRT_SERVE_NODES         nodes for vLLM; with 2+, vLLM data parallel across them  1
#   AITLRT_VLLM_TP, AITLRT_VLLM_DP   TP x DP = serving GPUs; TP within a node       jobs/vllm_layout.py
#   AITLRT_GPU_MEMORY_GIB      one GPU's memory, to check the weights fit vLLM's layout   nvidia-smi
#   AITLRT_ACCELERATE_CONFIG   accelerate config file                                configs/accelerate/multi_node.yaml
#   AITLRT_VLLM_RPC_PORT       vLLM's data-parallel RPC port (2+ serve nodes)        40000 + job id % 10000
#
#SBATCH --job-name=aitlrt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
ROOT=${AITLRT_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
[ -f "$ROOT/jobs/lib.sh" ] || ROOT=${SLURM_SUBMIT_DIR:-$PWD}  # sbatch runs a spooled copy of this script
# shellcheck source=jobs/lib.sh
source "$ROOT/jobs/lib.sh"

parse_common_args "$@"
parse_train_args "${ARGS[@]}"
ACCELERATE_CONFIG=${AITLRT_ACCELERATE_CONFIG:-$ROOT/configs/accelerate/multi_node.yaml}
[ -f "$ACCELERATE_CONFIG" ] || die "accelerate config not found: $ACCELERATE_CONFIG"

job_nodes
N_SERVE=${AITLRT_SERVE_NODES:-1}
[[ $N_SERVE =~ ^[1-9][0-9]*$ ]] || die "AITLRT_SERVE_NODES must be a positive integer, got '$N_SERVE'"
((N_SERVE < ${#NODES[@]})) || die "AITLRT_SERVE_NODES=$N_SERVE leaves no node for training (the job has ${#NODES[@]}: ${NODES[*]})"
SERVE_NODES=("${NODES[@]:0:N_SERVE}")
TRAIN_NODES=("${NODES[@]:N_SERVE}")
HEAD=${SERVE_NODES[0]}
GPUS=$(gpus_per_node)

setup_project_dir
maybe_setup
container_wrap
OUTPUT_DIR=$(config_value output_dir trainer_output)
SYNC_DIR=${AITLRT_WEIGHT_SYNC_DIR:-$AITLRT_PROJECT_DIR/sync/$JOB_ID}
MODEL=${AITLRT_MODEL:-$(config_value model_name_or_path bundled)}
PORT=$(serve_port)
URL=http://$HEAD:$PORT
bypass_proxy "$HEAD" 127.0.0.1 localhost
CONCURRENCY=$(rollout_concurrency "$GPUS")
serve_sampling_args
vllm_layout $((N_SERVE * GPUS)) "$GPUS" "$MODEL" "${SERVE_EXTRA[@]}"
LOCAL_DP=$((GPUS / VLLM_TP))   # vLLM engines per serve node
resume_args "$OUTPUT_DIR"
install_traps
use_api_key "$OUTPUT_DIR/serve/api_key"  # 0.0.0.0: every route takes a key
dry_run || mkdir -p "$SYNC_DIR"
log "nodes: vLLM on ${SERVE_NODES[*]} (TP $VLLM_TP x DP $VLLM_DP), training on ${TRAIN_NODES[*]} ($GPUS GPUs each); $CONCURRENCY agents per rank"

# One step per role on its own nodes; a step gets every GPU of the job on its nodes. --overlap: the batch
# script itself runs on the first node.
step() {
  local nodes=("$@")
  STEP=(srun --nodes="${#nodes[@]}" --ntasks="${#nodes[@]}" --ntasks-per-node=1
    --nodelist="$(IFS=,; echo "${nodes[*]}")" --overlap --kill-on-bad-exit=1 "${WRAP[@]}")
}

DP_ARGS=()
if ((N_SERVE > 1)); then
  [ "$MODEL" != bundled ] || die "serving on several nodes needs a Hub id or a model folder, not 'bundled'"
  RPC_PORT=${AITLRT_VLLM_RPC_PORT:-$((40000 + $(job_number) % 10000))}
  DP_ARGS=(--data-parallel-size "$VLLM_DP" --data-parallel-size-local "$LOCAL_DP"
    --data-parallel-address "$HEAD" --data-parallel-rpc-port "$RPC_PORT")
elif ((VLLM_DP > 1)); then
  DP_ARGS=(--data-parallel-size "$VLLM_DP")
fi

step "$HEAD"
spawn "${STEP[@]}" "$(bin aitlrt-serve)" --model "$MODEL" --host 0.0.0.0 --port "$PORT" \
  --run-dir "$OUTPUT_DIR/serve" "${SAMPLING_ARGS[@]}" --tensor-parallel-size "$VLLM_TP" "${DP_ARGS[@]}" \
  "${SERVE_EXTRA[@]}"
SERVERS=("$LAST_PID")
if ((N_SERVE > 1)); then
  # The other serve nodes run headless vLLM engines that join the head's data-parallel group; each builds
  # its own engine config, hence the same model flags (aitlrt-serve adds --logprobs-mode on the head).
  step "${SERVE_NODES[@]:1}"
  # shellcheck disable=SC2016  # expanded by the task's shell, on its node
  spawn "${STEP[@]}" bash -c 'exec "${@:2}" --data-parallel-start-rank $(((SLURM_PROCID + 1) * $1))' bash \
    "$LOCAL_DP" "$(bin vllm)" serve "$MODEL" --headless --tensor-parallel-size "$VLLM_TP" "${DP_ARGS[@]}" \
    --logprobs-mode processed_logprobs "${SERVE_EXTRA[@]}"
  SERVERS+=("$LAST_PID")
fi
wait_healthy "$URL" "${SERVERS[0]}"

step "${TRAIN_NODES[@]}"
# shellcheck disable=SC2016  # expanded by the task's shell, on its node
spawn "${STEP[@]}" bash -c 'exec "$1" launch --machine_rank "$SLURM_PROCID" "${@:2}"' bash "$(bin accelerate)" \
  --config_file "$ACCELERATE_CONFIG" --num_processes $((${#TRAIN_NODES[@]} * GPUS)) \
  --num_machines "${#TRAIN_NODES[@]}" --main_process_ip "${TRAIN_NODES[0]}" \
  --main_process_port "$(main_process_port)" "$(train_script)" --config "$CONFIG" --serve "$URL" \
  --weight_sync_dir "$SYNC_DIR" --rollout_concurrency "$CONCURRENCY" "${RESUME_ARGS[@]}" "${TRAIN_ARGS[@]}"
supervise training "$LAST_PID" "${SERVERS[@]}"
