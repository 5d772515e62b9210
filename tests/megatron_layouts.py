"""Tests-only launcher: several parallel layouts' runs of a Megatron script in one torchrun job.

    torchrun ... tests/megatron_layouts.py RUNS.json examples/megatron_gpt3/pretrain_gpt3.py

Like `megatron_cpu.py --runs` (megatron-core on CPU, the script's `main(argv)` once per entry in
the same processes, a misplanned order or CPU CUDA graphs on request), but each entry names its
`group`, and a new group starts on a fresh model-parallel state: the script initializes it from
that run's own flags (pipeline and virtual-pipeline sizes), so layouts that need the same number
of processes pay megatron's import and the process group's start-up once between them.

Before a group's first run every rank flushes its output, waits for the others, then writes
`GROUP_MARKER + group` as a line to stdout and to stderr: all of a group's output lies between
the first of its markers and the first of the next group's, on either stream.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "megatron_gpt3"
GROUP_MARKER = "=== megatron test group: "


def split_output(text: str, groups: list[str]) -> dict[str, str]:
    """Each group's lines of one stream of the job's output (see the module docstring)."""
    lines = text.splitlines(keepends=True)
    starts = []
    for group in groups:
        found = [i for i, line in enumerate(lines) if line == GROUP_MARKER + group + "\n"]
        assert found, f"no output of layout {group}"
        starts.append(found[0])
    assert starts == sorted(starts), "groups ran in the order given"
    ends = starts[1:] + [len(lines)]
    return {group: "".join(lines[start:end]) for group, start, end in zip(groups, starts, ends)}


def _start_group(group: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        dist.barrier()  # every rank's output of the previous group is written
        parallel_state.destroy_model_parallel()  # the next run initializes its own layout
    for stream in (sys.stdout, sys.stderr):
        stream.write(GROUP_MARKER + group + "\n")
        stream.flush()


def run_groups(script: str, runs_file: str) -> None:
    from megatron_cpu import run_one

    with open(runs_file, encoding="utf-8") as handle:
        runs = json.load(handle)
    module = runpy.run_path(script, run_name="megatron_cpu_script")
    group = None
    for run in runs:
        if run["group"] != group:
            group = run["group"]
            _start_group(group)
        run_one(module, run)
    sys.stdout.flush()
    sys.stderr.flush()
    module["shutdown"]()


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit("usage: megatron_layouts.py RUNS.json SCRIPT")
    runs_file, script = sys.argv[1], sys.argv[2]
    sys.path.insert(0, str(EXAMPLE))
    import cpu_shims

    cpu_shims.install()
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    run_groups(script, runs_file)


if __name__ == "__main__":
    main()
