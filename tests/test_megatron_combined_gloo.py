"""combined_1f1b end to end: 2 pipeline ranks over gloo, megatron-core's real schedules, perseus-ext
installed as a script installs it (tests/megatron_combined_worker.py says what runs and what is a
CPU stand-in). The job profiles, solves and deploys per unit; the measured saving (against the
run's own baseline probes, with its interval) is held to the saving of its side-by-side twin at
default clocks on the same simulated GPUs.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is the optional 'megatron' extra")

from runtime_helpers import run_gloo_job

from perseus_ext.observability.run_figures import DEPLOYED, Sample, job_samples, measured_counterfactual

WORKER = Path(__file__).resolve().parent / "megatron_combined_worker.py"
MAX_CLOCK_MHZ = 1410


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[dict]:
    return run_gloo_job(str(WORKER), tmp_path_factory.mktemp("combined_gloo"), world_size=2, timeout_s=420)


@pytest.mark.distributed
def test_the_job_profiles_solves_and_deploys_one_clock_per_combined_unit(job):
    for stage, rank in enumerate(job):
        run = rank["optimize"]
        summary = run["summary"]
        assert summary["fallback_reason"] is None and summary["final_phase"] == "deployed"
        assert run["megatron_schedule"]["kind"] == "combined_1f1b"
        assert summary["profiling_iterations"] >= 2 and summary["frontier"]["plans"] >= 2
        # the units the adapter reported in an iteration are the stage's planned order, combined ones included
        combined = [unit for unit in run["order"] if unit.startswith("(")]
        assert combined and [unit for unit in run["reported"] if unit.startswith("(")] == combined
        assert len(run["reported"]) == len(run["order"])
        # the deployed plan (slowed for the announced straggler) sets clocks below the max on combined units
        clocks = dict(zip(run["order"], run["plan_clocks"]))
        assert any(clocks[unit] < MAX_CLOCK_MHZ for unit in combined), clocks
        coverage = summary["clock_coverage"]
        assert coverage["exact"] >= 0.8 and coverage["estimated"] >= 0.8, coverage
        assert summary["silent_hooks"]["episodes"] == []  # the guard never had to step in
        twin = rank["observe"]["summary"]
        assert twin["fallback_reason"] is None and twin["final_phase"] == "observing"


@pytest.mark.distributed
def test_the_measured_saving_agrees_with_the_side_by_side_twin(job):
    def samples(run: str) -> list[Sample]:
        return job_samples([[Sample(**s) for s in rank[run]["samples"]] for rank in job])

    perseus, twin = samples("optimize"), {s.iteration: s for s in samples("observe")}
    planned = [s for s in perseus if s.label == DEPLOYED and s.iteration in twin]
    assert len(planned) >= 10
    twin_saving = 1 - (statistics.fmean(s.energy_j for s in planned)
                       / statistics.fmean(twin[s.iteration].energy_j for s in planned))
    measured = measured_counterfactual(perseus, confidence=0.999)["all"]
    assert measured is not None and measured["probes"] >= 4
    assert measured["saving_low"] <= twin_saving <= measured["saving_high"], (measured, twin_saving)
    assert twin_saving > 0.03, twin_saving  # slowed for the straggler, the plan saves energy
    job_figure = job[0]["optimize"]["summary"]["job"]
    assert job_figure["final_phase"] == "deployed" and job_figure["clock_coverage"] >= 0.8
    print(json.dumps({  # the figures docs/megatron.md quotes (pytest -s)
        "twin_saving": twin_saving, "measured_saving": measured["saving"],
        "interval_99.9": [measured["saving_low"], measured["saving_high"]],
        "job_saving_95": [job_figure["measured"]["all"]["saving_low"], job_figure["measured"]["all"]["saving_high"]],
        "time_change": measured["time_change"], "clock_coverage": job_figure["clock_coverage"],
        "solve_s": job[0]["optimize"]["solve_s"], "plans": job[0]["optimize"]["summary"]["frontier"]["plans"],
        "plan_clocks": {stage: dict(zip(rank["optimize"]["order"], rank["optimize"]["plan_clocks"]))
                        for stage, rank in enumerate(job)}}))
