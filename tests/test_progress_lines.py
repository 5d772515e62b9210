"""Progress lines and the end-of-job summary say whose saving they show.

A rank's periodic line shows its own stage's saving (a stage with slack saves more than the
busiest one), so it is labelled as the stage's and never as the job's; at close rank 0 prints
the job's figure and a per-rank table, each line at most 100 columns. The per-rank table's
figures are each rank's own summary's; the job's are the ones `perseus-ext report` computes
from the same run's logs."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from perseus_ext.observability.reporting import analyse, read_logs
from runtime_helpers import run_gloo_job

TESTS = Path(__file__).resolve().parent

RANK_SCRIPT = textwrap.dedent(
    """
    import json, logging, os, sys
    sys.path.insert(0, {tests!r})
    import torch.distributed as dist
    from perseus_ext.planning.schedule import build_schedule
    from perseus_ext.runtime import PerseusRuntime
    from runtime_helpers import make_config, sim_gpu, train

    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    console = os.path.join(out, f"console{{rank}}.txt")
    handler = logging.FileHandler(console)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logging.getLogger("perseus_ext").addHandler(handler)
    logging.getLogger("perseus_ext").setLevel(logging.INFO)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    config = make_config(baseline_fraction=0.25, straggler_check_interval=2, log_interval=10,
                         log_path=os.path.join(out, "log-{{rank}}.jsonl"))
    runtime = PerseusRuntime(config, schedule=build_schedule("1f1b", 2, 4), stage=rank, gpu=sim_gpu(seed=rank))
    train(runtime, 44)
    runtime.close()
    handler.flush()
    with open(os.path.join(out, f"rank{{rank}}.json"), "w") as handle:
        json.dump({{"summary": runtime.summary(), "console": open(console).read()}}, handle)
    """
)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[list[dict], Path]:
    out = tmp_path_factory.mktemp("progress")
    script = out / "rank.py"
    script.write_text(RANK_SCRIPT.format(tests=str(TESTS)))
    return run_gloo_job(str(script), out, 2, timeout_s=240), out


def test_periodic_lines_label_the_saving_as_the_stages(two_ranks):
    results, _ = two_ranks
    console = results[0]["console"]
    lines = [line for line in console.splitlines() if line.startswith("INFO perseus-ext it ")]
    with_saving = [line for line in lines if "saving" in line]
    assert with_saving, console[-3000:]
    for line in with_saving:
        assert "(rank 0: stage 0, pipeline 0); saving of this stage, not the job's (that comes at close): " in line
    # 44 iterations at a probe in 4 deployed ones: a thin interval says how many probes it needs
    assert any("too few probes: " in line and " for ±5%" in line for line in with_saving)


def test_the_job_summary_has_a_per_rank_table_of_each_ranks_own_figures(two_ranks):
    results, out = two_ranks
    console = results[0]["console"]
    start = console.index("INFO perseus-ext: job summary")
    block = console[start + len("INFO "):].splitlines()  # the message, without the log prefix
    summary_lines = [block[0]] + [line for line in block[1:] if line.startswith(" ")]
    assert all(len(line) <= 100 for line in summary_lines), max(summary_lines, key=len)
    assert len(summary_lines) > 8  # rows, not one 600-character line
    job = results[0]["summary"]["job"]
    report = analyse(read_logs([out / "log-0.jsonl", out / "log-1.jsonl"]))["job"]
    assert job["measured"]["all"]["saving"] == pytest.approx(report["measured"]["all"]["saving"], rel=1e-9)
    saving_row = next(line for line in summary_lines if line.lstrip().startswith("saving:"))
    assert f"{100 * job['measured']['all']['saving']:.1f}%" in saving_row
    header = next(k for k, line in enumerate(summary_lines) if line.split()[:3] == ["rank", "pipeline", "stage"])
    rows = [summary_lines[header + 2 + rank].split() for rank in (0, 1)]
    for rank, row in enumerate(rows):
        own = results[rank]["summary"]["measured"]["all"]
        assert row[:4] == [str(rank), "0", str(rank), "44"]
        assert row[4] == f"{100 * own['saving']:.1f}%"
        assert row[5:7] == [f"[{100 * own['saving_low']:.1f},", f"{100 * own['saving_high']:.1f}]"]
        assert row[7] == str(own["probes"])
    assert [entry["rank"] for entry in job["per_rank"]] == [0, 1]
    assert results[1]["summary"]["job"]["per_rank"] == job["per_rank"]  # every rank holds the same table
    assert "job summary" not in results[1]["console"]  # rank 0 alone prints it
