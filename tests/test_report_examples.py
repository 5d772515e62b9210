"""`perseus-ext report` has something to read: both shipped example configs write the logs it
reads, to a folder it reads whole; and the demo's default output folder is ignored by git."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from perseus_ext.cli import build_parser
from perseus_ext.observability.log_files import LOG_SUFFIX
from perseus_ext.runtime import PerseusConfig

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "examples/deepspeed/ds_config.json": lambda data: data["perseus"],
    "examples/megatron_gpt3/perseus.json": lambda data: {"enabled": True, **data},
    "examples/megatron_gpt3/perseus_tiny_cpu.json": lambda data: {"enabled": True, **data},
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_config_writes_one_log_per_rank_into_one_folder(name):
    section = EXAMPLES[name](json.loads((REPO / name).read_text()))
    log_path = PerseusConfig.from_dict(section).log_path
    assert log_path is not None and "{rank}" in Path(log_path).name and log_path.endswith(LOG_SUFFIX)
    assert "{rank}" not in str(Path(log_path).parent)  # every rank's log in one folder: `report DIR`


def test_the_demos_default_output_is_ignored_by_git():
    args = build_parser(["demo"]).parse_args(["demo"])
    written = Path(args.output) / "timeline.png"
    assert not Path(args.output).is_absolute()  # relative to where it runs: the checkout, for README's command
    done = subprocess.run(["git", "check-ignore", "--no-index", "-q", str(written)], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 0, f"{written} is not ignored: {done.stderr}"
