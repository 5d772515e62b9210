#!/usr/bin/env bash
# The tiny GPT on CPU: 2 processes over gloo (PP=2), one simulated A100 each, with --perseus.
# megatron-core calls torch.cuda in a few places; cpu_shims.py (next to this script, not part of
# the package) redirects those to the CPU and then runs pretrain_gpt3.py.
#
#   ./run_tiny_cpu.sh                          # Perseus on
#   ./run_tiny_cpu.sh --perseus-mode observe   # default clocks, measured (the baseline)
#   VP=2 ./run_tiny_cpu.sh                     # interleaved schedule, 2 virtual stages
#
# Python: $PYTHON if set, else the .venv README's set-up commands create at the checkout's root,
# else the active environment's python3.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c "import torch, megatron.core" 2>/dev/null; then
    echo "run_tiny_cpu.sh: $PYTHON cannot import torch and megatron-core; run README's set-up command" \
         "(it creates $ROOT/.venv), or set PYTHON=/path/to/python of an environment that has them" >&2
    exit 2
fi
VP_ARGS=()
[[ -n "${VP:-}" ]] && VP_ARGS=(--virtual-pipeline-model-parallel-size "$VP")
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
exec "$PYTHON" -m torch.distributed.run --nproc-per-node "${NPROC:-2}" \
  "$HERE/cpu_shims.py" "$HERE/pretrain_gpt3.py" \
  --model tiny --seq-length 32 --vocab-size 128 --micro-batch-size 1 \
  --pipeline-model-parallel-size 2 "${VP_ARGS[@]}" --global-batch-size "${GLOBAL_BATCH:-4}" \
  --train-iters "${TRAIN_ITERS:-16}" \
  --perseus --perseus-config "$HERE/perseus_tiny_cpu.json" "$@"
