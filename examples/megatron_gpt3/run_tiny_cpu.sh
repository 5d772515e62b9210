#!/usr/bin/env bash
# The tiny GPT on CPU: 2 processes over gloo (PP=2), one simulated A100 each, with --perseus.
# megatron-core calls torch.cuda in a few places; cpu_shims.py (next to this script, not part of
# the package) redirects those to the CPU and then runs pretrain_gpt3.py.
#
#   ./run_tiny_cpu.sh                          # Perseus on
#   ./run_tiny_cpu.sh --perseus-mode observe   # default clocks, measured (the baseline)
#   VP=2 ./run_tiny_cpu.sh                     # interleaved schedule, 2 virtual stages
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
VP_ARGS=()
[[ -n "${VP:-}" ]] && VP_ARGS=(--virtual-pipeline-model-parallel-size "$VP")
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
exec python3 -m torch.distributed.run --nproc-per-node "${NPROC:-2}" \
  "$HERE/cpu_shims.py" "$HERE/pretrain_gpt3.py" \
  --model tiny --seq-length 32 --vocab-size 128 --micro-batch-size 1 \
  --pipeline-model-parallel-size 2 "${VP_ARGS[@]}" --global-batch-size "${GLOBAL_BATCH:-4}" \
  --train-iters "${TRAIN_ITERS:-16}" \
  --perseus --perseus-config "$HERE/perseus_tiny_cpu.json" "$@"
