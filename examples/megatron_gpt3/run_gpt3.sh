#!/usr/bin/env bash
# Launch GPT-3 pretraining (pretrain_gpt3.py) on a GPU cluster with torchrun, with or without
# Perseus. One invocation per node; every node runs the same command.
#
#   SIZE=6.7b NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 ./run_gpt3.sh --perseus
#   SIZE=1.3b ./run_gpt3.sh                       # single node, Perseus off (baseline)
#   SIZE=tiny ./run_gpt3.sh --perseus             # tiny model, 2 GPUs, smoke test
#
# Sizes follow GPT-3 (Brown et al. 2020) with Megatron's usual layouts; the data-parallel size is
# whatever GPUs remain: DP = NNODES * GPUS_PER_NODE / (TP * PP).
#
#   SIZE   layers hidden heads  TP  PP  VP  GPUs/pipeline
#   1.3b       24   2048    16   1   4   -    4
#   2.7b       32   2560    32   1   4   -    4
#   6.7b       32   4096    32   2   4   -    8
#   13b        40   5120    40   2   8   -   16
#   175b       96  12288    96   8  16   -  128
#
# Set VP=<chunks per stage> to use the interleaved schedule (layers/PP must divide by VP).
# Extra arguments go to pretrain_gpt3.py (e.g. --perseus --perseus-config perseus.json).
set -euo pipefail

SIZE=${SIZE:-1.3b}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
MICRO_BATCH=${MICRO_BATCH:-1}
TRAIN_ITERS=${TRAIN_ITERS:-200}

case "$SIZE" in
  1.3b) TP=1; PP=4;  GBS_PER_DP=${GBS_PER_DP:-32} ;;
  2.7b) TP=1; PP=4;  GBS_PER_DP=${GBS_PER_DP:-32} ;;
  6.7b) TP=2; PP=4;  GBS_PER_DP=${GBS_PER_DP:-32} ;;
  13b)  TP=2; PP=8;  GBS_PER_DP=${GBS_PER_DP:-64} ;;
  175b) TP=8; PP=16; GBS_PER_DP=${GBS_PER_DP:-96} ;;
  tiny) TP=1; PP=2;  GBS_PER_DP=${GBS_PER_DP:-8}; GPUS_PER_NODE=${TINY_GPUS:-2} ;;
  *) echo "unknown SIZE=$SIZE (1.3b, 2.7b, 6.7b, 13b, 175b, tiny)" >&2; exit 2 ;;
esac
TP=${TP_OVERRIDE:-$TP}
PP=${PP_OVERRIDE:-$PP}

WORLD=$((NNODES * GPUS_PER_NODE))
if (( WORLD % (TP * PP) )); then
  echo "NNODES*GPUS_PER_NODE=$WORLD is not a multiple of TP*PP=$((TP * PP)) for SIZE=$SIZE" >&2
  exit 2
fi
DP=$((WORLD / (TP * PP)))
GLOBAL_BATCH=$((GBS_PER_DP * DP * MICRO_BATCH))
SEQ=2048
[[ "$SIZE" == tiny ]] && SEQ=128

VP_ARGS=()
if [[ -n "${VP:-}" ]]; then
  VP_ARGS=(--virtual-pipeline-model-parallel-size "$VP")
fi

HERE=$(cd "$(dirname "$0")" && pwd)
echo "GPT-3 $SIZE: TP=$TP PP=$PP DP=$DP ${VP:+VP=$VP }global batch $GLOBAL_BATCH on $WORLD GPUs"
exec torchrun \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  "$HERE/pretrain_gpt3.py" \
  --model "$SIZE" --seq-length "$SEQ" --bf16 \
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" "${VP_ARGS[@]}" \
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" \
  --train-iters "$TRAIN_ITERS" \
  "$@"
