"""The runtime's model check: pipeline 0's leader compares the deployed plan's modelled time with
its computations' device span (first computation's start to last one's end) and warns once when
they disagree by more than `MODEL_DISAGREEMENT`, naming the profile as the likely cause.

The oracle is the simulated GPU's own model: a profile written from it describes the job (no
warning, although the host waits before the first computation of every iteration, which is no
computation's time), and one written for computations a third as long does not (a warning that
states about +200 %)."""

from __future__ import annotations

import logging

import pytest
from runtime_helpers import BACKWARD_S, FORWARD_S, make_config, model_profile, sim_gpu

from perseus_ext.observability.phase import Phase
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.runtime import PerseusRuntime

LEAD_S = 0.02  # the host's work before the first computation (data loading), every iteration


def run(tmp_path, caplog, profile_scale: float) -> tuple[PerseusRuntime, str]:
    caplog.set_level(logging.WARNING, logger="perseus_ext")
    gpu = sim_gpu()
    profile = model_profile(tmp_path / "profile.csv", gpu, profile_scale * FORWARD_S, profile_scale * BACKWARD_S)
    runtime = PerseusRuntime(make_config(profile_path=profile, blocking_power_w=gpu.preset.idle_power_w,
                                         straggler_check_interval=2),
                             schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=gpu)
    for _ in range(16):
        runtime.iteration_start()
        gpu.wait(LEAD_S)
        for computation in runtime.order:
            runtime.before_computation(computation.kind, computation.microbatch)
            runtime.after_computation(computation.kind, computation.microbatch)
        runtime.mark_compute_end()
        gpu.wait(0.005)
        runtime.iteration_end()
    runtime.close()
    return runtime, caplog.text


def test_a_profile_of_this_job_passes_the_model_check_although_the_host_leads_each_iteration(tmp_path, caplog):
    runtime, log = run(tmp_path, caplog, 1.0)
    assert runtime.phase is Phase.DEPLOYED
    deployed = [r for r in runtime.history if r.phase is Phase.DEPLOYED and r.first_computation_s is not None]
    assert len(deployed) >= 6
    # Each record knows the lead (less than the host's 20 ms where the device still ran the
    # iteration before meanwhile), and the span after it is the model's time.
    leads = sorted(r.first_computation_s for r in deployed)
    assert leads[len(leads) // 2] >= LEAD_S / 2, leads
    planned = runtime.frontier.plans[0].time
    spans = sorted(r.compute_s - r.first_computation_s for r in deployed)
    assert spans[len(spans) // 2] == pytest.approx(planned, rel=0.03), (spans, planned)
    assert "the frontier models" not in log


def test_a_profile_of_other_work_gets_one_warning_naming_the_profile(tmp_path, caplog):
    _, log = run(tmp_path, caplog, 1 / 3)
    assert log.count("the frontier models the deployed plan's computations") == 1, log
    assert "perseus.profile_path" in log and "(+2" in log, log  # three times the modelled span
