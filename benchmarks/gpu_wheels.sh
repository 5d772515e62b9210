#!/bin/sh
# Wheels for running perseus-ext on the lent GPU machine (docs/device.md, "Real-GPU check"),
# whose image has only torch, numpy, scipy, nvidia-ml-py, httpx and pytest on Python 3.12 and no
# network. Downloads every other package perseus-ext imports, pinned to the versions the test
# suite runs with, into <repo>/.whl (ignored by git; keep it under 40 MiB):
#
#     sh benchmarks/gpu_wheels.sh            # on a machine with network
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl   # on the GPU machine
set -eu
cd "$(dirname "$0")/.."
DEST=.whl
PYTHON=${PYTHON:-python3}
mkdir -p "$DEST"
binary() {  # compiled wheels for CPython 3.12 on x86-64 Linux
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DEST" "$@"
}
pure() {  # pure-Python wheels
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform any -d "$DEST" "$@"
}
binary pydantic-core==2.50.5 orjson==3.13.0 highspy==1.16.0 sqlalchemy==2.1.9
pure pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
    networkx==3.6.1 tqdm==4.70.1
ls -l "$DEST"
total_kib=$(du -sk "$DEST" | cut -f1)
echo "$DEST: ${total_kib} KiB"
if [ "$total_kib" -gt 40960 ]; then
    echo "$DEST is over 40 MiB" >&2
    exit 1
fi
