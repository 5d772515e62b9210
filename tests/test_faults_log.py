"""The log's failures are the log's: a full disk under perseus.log_path stops the log, said once
naming the key and the file, and the optimisation goes on."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from runtime_helpers import make_config, sim_gpu, train

from perseus_ext.planning.schedule import build_schedule
from perseus_ext.runtime import PerseusRuntime
from perseus_ext.observability.phase import Phase

TESTS = Path(__file__).resolve().parent
ENV = dict(os.environ, OMP_NUM_THREADS="1",
           PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")]))


def test_a_full_disk_stops_the_log_not_the_optimisation(tmp_path, caplog):
    """/dev/full: every write fails with ENOSPC (before: 'lifecycle step failed: OSError(28, ...)'
    naming neither key nor file, default clocks for the rest of the run, and a job summary
    blaming the control plane)."""
    caplog.set_level(logging.INFO, logger="perseus_ext")
    config = make_config(log_path="/dev/full", summary_path=str(tmp_path / "summary-{rank}.json"))
    gpu = sim_gpu()
    runtime = PerseusRuntime(config, schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=gpu)
    train(runtime, 30)
    assert runtime.phase is Phase.DEPLOYED and runtime.fallback_reason is None
    assert not runtime.control_plane_failed
    runtime.close()
    assert gpu.locked_clock is None
    failures = [r.getMessage() for r in caplog.records if "perseus.log_path" in r.getMessage()]
    assert len(failures) == 1, failures
    assert "cannot write to perseus.log_path /dev/full: No space left on device; the log stops here" in failures[0]
    assert runtime.summary()["final_phase"] == "deployed" and len(runtime.recorder.history) == 30


def test_a_log_that_cannot_be_opened_is_said_once_and_recording_goes_on(tmp_path):
    from perseus_ext.measurement.gpu.timeline import SwitchLatency
    from perseus_ext.runtime.recorder import RunRecorder

    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the log's directory should be: no one can create it
    recorder = RunRecorder(None, rank=3, pipeline=0, stage=3, latency=SwitchLatency(0.0, 0.0),
                           log_path=str(blocker / "log-{rank}.jsonl"), log_interval=0)
    assert recorder.log_failure.startswith(f"cannot open perseus.log_path {blocker / 'log-3.jsonl'}: ")
    assert "the log stops here, clocks are still planned" in recorder.log_failure


INTERRUPTED_TRAINER = textwrap.dedent(
    """
    import sys
    from perseus_ext.planning.schedule import build_schedule
    from perseus_ext.runtime import PerseusRuntime
    from runtime_helpers import make_config, sim_gpu, train

    config = make_config(summary_path=sys.argv[1], log_path=sys.argv[2], clock_stride=1)
    runtime = PerseusRuntime(config, schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=sim_gpu())
    for _ in range(10_000):
        train(runtime, 1)
        if runtime.phase.value == "profiling":
            print("profiling", flush=True)
    """
)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_run_writes_its_summary_and_says_the_clocks_were_restored(tmp_path, signum):
    """SIGTERM (or Ctrl-C) during profiling: the clocks were restored but there was no summary
    and no line saying the run was interrupted."""
    summary = tmp_path / "summary-{rank}.json"
    # A suite started in the background by a shell inherits SIGINT ignored: the trainer must not.
    trainer = subprocess.Popen([sys.executable, "-c", INTERRUPTED_TRAINER, str(summary), str(tmp_path / "log.jsonl")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert trainer.stdout.readline().strip() == "profiling", trainer.stderr.read()[-3000:]
        trainer.send_signal(signum)
        _, err = trainer.communicate(timeout=60)
    finally:
        trainer.kill()
    assert trainer.returncode != 0
    written = json.loads((tmp_path / "summary-0.json").read_text())
    assert written["interrupted"]["signal"] == signal.Signals(signum).name
    assert written["interrupted"]["phase"] == "profiling" and written["interrupted"]["clocks_restored"] is True
    assert f"rank 0 interrupted by {signal.Signals(signum).name} at iteration" in err
    assert "(profiling); GPU clocks restored to the default; summary in" in err
