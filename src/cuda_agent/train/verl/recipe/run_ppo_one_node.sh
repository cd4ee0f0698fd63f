#!/usr/bin/env bash
# PPO on one GPU node with the evaluation service as the reward (ppo_one_node.yaml beside this file):
#
#   bash run_ppo_one_node.sh MODEL TASKS OUT [key=value ...]
#
#   MODEL  the base model (Hugging Face name or folder); TASKS  any task source (`cuda-agent tasks TASKS` lists it);
#   OUT    the run's folder (data, service log, checkpoints); key=value  verl overrides, after the recipe's.
#   SERVICE_GPUS (default 1) of the node's GPUs evaluate (`cuda-agent serve --device cuda`, the last ones); verl
#   trains on the others. PORT (default 8470) is the service's.
#
# Needs: a node with NVIDIA GPUs, `pip install -e '.[verl]'` and vLLM beside verl (verl's rollout server; SGLang
# instead with actor_rollout_ref.rollout.name=sglang), bubblewrap for the service's sandbox.
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 MODEL TASKS OUT [key=value ...]" >&2
    exit 2
fi
MODEL=$1 TASKS=$2 OUT=$(realpath -m "$3"); shift 3
HERE=$(cd "$(dirname "$0")" && pwd)
GPUS=$(nvidia-smi -L | wc -l)
SERVICE_GPUS=${SERVICE_GPUS:-1}
TRAIN_GPUS=$((GPUS - SERVICE_GPUS))
PORT=${PORT:-8470}
if [ "$TRAIN_GPUS" -lt 1 ]; then
    echo "$0: $GPUS GPU(s) here and SERVICE_GPUS=$SERVICE_GPUS: leave verl at least one (set SERVICE_GPUS lower)" >&2
    exit 2
fi
mkdir -p "$OUT"

# 1. The evaluation service on the last SERVICE_GPUS GPUs: one evaluator slot each, timing alone on its GPU.
CUDA_VISIBLE_DEVICES=$(seq -s, "$TRAIN_GPUS" $((GPUS - 1))) \
    cuda-agent serve --device cuda --host 127.0.0.1 --port "$PORT" >"$OUT/service.log" 2>&1 &
SERVICE_PID=$!
trap 'kill "$SERVICE_PID" 2>/dev/null || true' EXIT
export CUDA_AGENT_SERVICE="http://127.0.0.1:$PORT"
for _ in $(seq 120); do
    curl -sf "$CUDA_AGENT_SERVICE/health" >/dev/null && break
    kill -0 "$SERVICE_PID" 2>/dev/null || { echo "$0: the service stopped; see $OUT/service.log" >&2; exit 1; }
    sleep 1
done

# 2. The tasks as verl's rows (single-turn: verl's single_turn_agent samples one reply, compute_score rewards it).
cuda-agent export "$TASKS" --format verl --out "$OUT/data" --service "$CUDA_AGENT_SERVICE"
export CUDA_AGENT_TRAIN_FILES="$OUT/data/train.parquet" CUDA_AGENT_VAL_FILES="${VAL_FILES:-$OUT/data/train.parquet}"
export CUDA_AGENT_ACTOR="$MODEL" CUDA_AGENT_GPUS_TRAIN="$TRAIN_GPUS"

# 3. verl's PPO trainer on the other GPUs; its Ray workers inherit this environment (CUDA_AGENT_SERVICE among it).
CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((TRAIN_GPUS - 1))) \
    python -m verl.trainer.main_ppo --config-path "$HERE" --config-name ppo_one_node \
    trainer.default_local_dir="$OUT/checkpoints" "$@"
