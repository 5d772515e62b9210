"""The gradient sync (torch's REDUCE_GRAD action) as a planned node of the torch pipelining graph.

torch.distributed.pipelining runs `PipelineStage.perform_reduce_grad` once per model chunk after
the chunk's last gradient work (the FSDP post-backward, i.e. the data-parallel reduce, and the
gradient scaling). perseus-ext plans it like any action: the job below (the example's training,
two data-parallel replicas of a two-stage interleaved pipeline, 4 ranks over gloo, simulated
A100s with a configured sync duration) must plan a graph holding the syncs where torch runs
them, profile a row for them, deploy, and give each sync a clock of the deployed plan.
"""

from __future__ import annotations

import pytest
from test_torch_pipelining import FAST, MICROBATCHES, _launch

from perseus_ext.config import PerseusConfig
from perseus_ext.errors import ConfigError
from perseus_ext.planning.profile import load_profile

pytestmark = [pytest.mark.distributed]

SYNC_SECONDS = [0.006, 0.004]  # per pipeline stage, at the max clock
CLOCKS = FAST["candidate_clocks"]


def _reduce_positions_by_torch_rule(order: list[str]) -> dict[str, int]:
    """Where torch puts each chunk's sync, by its documented rule (`_add_reduce_grad`: right
    after the chunk's last backward-like action), from the action names alone: chunk suffix
    ("" or "c1") -> the position the sync must have."""
    last_backward: dict[str, int] = {}
    for position, action in enumerate(order):
        if action[0] in "BW":
            name = action.split("@")[0]
            last_backward[name[name.index("c"):] if "c" in name else ""] = position
    return {chunk: position + 1 for chunk, position in last_backward.items()}


def test_two_replicas_plan_profile_and_clock_their_gradient_syncs(tmp_path):
    profile_path = tmp_path / "profile.csv"
    workload = {**FAST["simulated_workload"], "reduce_grad_seconds": SYNC_SECONDS}
    done, results = _launch(tmp_path, "ScheduleInterleaved1F1B", ranks=4, iterations=14,
                            extra=("--data-parallel", "2"),
                            perseus={"simulated_workload": workload, "profile_path": str(profile_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted((r["summary"]["pipeline"], r["summary"]["stage"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for result in results:
        summary, seen = result["summary"], result["summary"]["torch_pipelining"]
        assert summary["final_phase"] == "deployed", summary["fallback_reason"]
        assert summary["fallback_reason"] is None and result["clocks_restored"] is True
        # The runtime plans the whole graph: this rank's order is the graph's, syncs included,
        # one per model chunk, each where torch's rule puts it.
        order = result["planned_order"]
        assert order == result["graph_orders"][summary["stage"]]
        syncs = {action.split("@")[0][1:]: position for position, action in enumerate(order) if action[0] == "R"}
        assert syncs == _reduce_positions_by_torch_rule(order) and set(syncs) == {"", "c1"}
        assert syncs["c1"] < syncs[""] < len(order)  # interleaved: chunk 1's backwards end first
        # Every action of the last step, the syncs included, ran under the runtime's hooks, and
        # each sync carries a clock of the deployed plan.
        assert seen["hooked_actions"] == seen["actions"] == len(order) == 4 * MICROBATCHES + 2
        clocks = result["planned_clocks"]
        assert len(clocks) == len(order)
        assert all(clocks[position] in CLOCKS for position in syncs.values())
    # Pipeline 0's profile has a sync row per stage, measured: at least the configured work at
    # the max clock, and the work slows with the clock like any computation's.
    profile = load_profile(profile_path)
    for stage, seconds in enumerate(SYNC_SECONDS):
        points = profile[stage, "reduce_grad"]
        assert len(points) >= 2
        assert points.times[0] >= 0.9 * seconds
        assert points.times[-1] > points.times[0]


def test_the_sync_seconds_key_is_typed_and_named_in_errors():
    base = {"enabled": True, "gpu": "sim:a100_sxm"}
    workload = {"forward_seconds": 0.01, "backward_seconds": 0.02}
    config = PerseusConfig.from_dict({**base, "simulated_workload": workload})
    assert config.simulated_workload.reduce_grad_seconds == (0.0,)
    config = PerseusConfig.from_dict({**base, "simulated_workload": {**workload, "reduce_grad_seconds": [0, 0.003]}})
    assert config.simulated_workload.seconds(1, "reduce_grad") == 0.003
    for bad in (-0.001, "fast", [], True, 7200, [0.001, float("nan")]):
        with pytest.raises(ConfigError, match=r"perseus\.simulated_workload\.reduce_grad_seconds"):
            PerseusConfig.from_dict({**base, "simulated_workload": {**workload, "reduce_grad_seconds": bad}})
    config = PerseusConfig.from_dict({**base, "simulated_workload": {**workload, "reduce_grad_seconds": [0.1, 0.2, 0.3]}})
    with pytest.raises(ConfigError, match=r"reduce_grad_seconds has 3 entries but the pipeline has 2 stages"):
        config.simulated_workload.check_stages(2)
