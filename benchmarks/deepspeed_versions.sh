#!/usr/bin/env bash
# The DeepSpeed adapter's tests against other DeepSpeed releases, each in a venv of its own.
#
#   bash benchmarks/deepspeed_versions.sh [oldest|newest|X.Y.Z ...]    (default: oldest newest)
#
# oldest = the floor of the `deepspeed` extra in pyproject.toml, newest = the newest release on
# the package index. Each venv (DS_VENV_ROOT, default /tmp/perseus-ds-venvs) gets torch 2.13.0
# first (pip keeps the CPU build), then DeepSpeed built without build isolation (DeepSpeed ships
# only sdists whose setup.py imports torch; an isolated build would fetch a torch of its own),
# then this checkout with the deepspeed, test and postgres extras, which leaves both in place.
# A venv that already holds the asked DeepSpeed is reused. Exits non-zero when a test fails.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENV_ROOT=${DS_VENV_ROOT:-/tmp/perseus-ds-venvs}
TORCH_VERSION=2.13.0
TESTS=(tests/test_deepspeed*.py tests/test_recurring_deepspeed.py
       "tests/test_schedule_frameworks.py::test_one_f_one_b_matches_deepspeed_train_schedule")

floor=$(sed -n 's/.*"deepspeed>=\([0-9.]*\)".*/\1/p' pyproject.toml)
[[ -n $floor ]] || { echo "no deepspeed>=X floor in pyproject.toml" >&2; exit 2; }

run_version() {
    local wanted=$1 spec venv installed
    case $wanted in
        oldest) spec="deepspeed==$floor"; venv="$VENV_ROOT/deepspeed-$floor" ;;
        newest) spec="deepspeed"; venv="$VENV_ROOT/deepspeed-newest" ;;
        *) spec="deepspeed==$wanted"; venv="$VENV_ROOT/deepspeed-$wanted" ;;
    esac
    if [[ ! -x $venv/bin/python ]]; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q torch=="$TORCH_VERSION" setuptools wheel
    fi
    [[ $wanted == newest ]] && upgrade=--upgrade || upgrade=
    "$venv/bin/pip" install -q $upgrade --no-build-isolation "$spec"
    "$venv/bin/pip" install -q -e "$REPO[deepspeed,test,postgres]"
    installed=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("deepspeed"), m.version("torch"))')
    # DeepSpeed JIT-builds its CPU ops (shm comm) into a cache shared by every venv unless told
    # otherwise; another version's build there fails to load (missing functions).
    export TORCH_EXTENSIONS_DIR="$venv/torch_extensions"
    echo "== DeepSpeed ${installed% *} (torch ${installed#* }, asked: $wanted) in $venv"
    "$venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
}

mkdir -p "$VENV_ROOT"
for wanted in "${@:-oldest newest}"; do
    for one in $wanted; do run_version "$one"; done
done
