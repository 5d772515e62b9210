"""A profiling pass whose blocking-power fit fails: the pipeline's figure comes from the GPUs
whose fit worked, and a profile with no blocking power at all is not saved, so a recurring job's
next run profiles again instead of stopping at the door (DeepSpeed's oldest supported release
caught a second run refusing a side file with `blocking_power_w: 0.0`)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from perseus_ext.errors import ConfigError
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.runtime.comm import Member
from perseus_ext.config import PerseusConfig
from perseus_ext.runtime.profile_store import ProfileStore
from perseus_ext.runtime.profiler import ProfileRow, StageMeasurements
from perseus_ext.runtime.profiling_run import ProfilingRun

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_helpers import make_config  # noqa: E402


def _measured(stage: int, blocking_w: float) -> StageMeasurements:
    rows = tuple(ProfileRow(stage, kind, clock, base_s, base_s * 300.0)
                 for kind, base_s in (("forward", 0.01), ("backward", 0.02)) for clock in (1410, 1050))
    return StageMeasurements(stage, rows, blocking_w, 0.0, (1050, 1410))


def _assemble(blocking_by_rank: list[float], gpus_per_stage: int = 1):
    gathered = [(Member(rank, 0, rank // gpus_per_stage), _measured(rank // gpus_per_stage, watts))
                for rank, watts in enumerate(blocking_by_rank)]
    return ProfilingRun.assemble(gathered, pipeline=0, blocking_override_w=None, gpu_name="A100")


def test_a_gpu_whose_fit_failed_does_not_pull_the_figure_down(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="perseus_ext"):
        measured = _assemble([0.0, 80.0, 82.0, 84.0], gpus_per_stage=2)  # 2 stages x 2 GPUs
    assert measured.blocking_power_per_gpu_w == pytest.approx(82.0)
    assert measured.blocking_power_per_stage_w == pytest.approx(164.0)
    assert "1 of 4 GPU(s) could not estimate the blocking power" in caplog.text
    assert "the others' mean is used" in caplog.text


def test_every_fit_failed_plans_waiting_as_free_and_says_so(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="perseus_ext"):
        measured = _assemble([0.0, 0.0])
    assert measured.blocking_power_per_stage_w == 0.0
    assert "2 of 2 GPU(s)" in caplog.text and "plans as if waiting were free" in caplog.text
    assert "perseus.blocking_power_w" in caplog.text


def test_every_fit_worked_is_the_mean_as_before(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="perseus_ext"):
        measured = _assemble([80.0, 84.0])
    assert measured.blocking_power_per_stage_w == pytest.approx(82.0)
    assert caplog.text == ""


def test_a_profile_without_blocking_power_is_not_saved_and_the_next_run_profiles(tmp_path, caplog) -> None:
    path = tmp_path / "profile.csv"
    schedule = build_schedule("1f1b", 2, 4)
    store = ProfileStore(str(path), gpus_per_stage=1, gpu_name="A100", blocking_power_per_gpu_w=None)
    with caplog.at_level(logging.WARNING, logger="perseus_ext"):
        store.save(_assemble([0.0, 0.0]), schedule)
    assert not path.exists() and not Path(f"{path}.json").exists()
    assert "not saved" in caplog.text and "the next run profiles again" in caplog.text
    # The next run: no saved profile, so the config passes the door and the store has none.
    config = make_config(profile_path=str(path))
    assert ProfileStore.for_job(config, 1, None).load(schedule) is None


def test_a_profile_with_blocking_power_is_saved_and_loads(tmp_path) -> None:
    path = tmp_path / "profile.csv"
    schedule = build_schedule("1f1b", 2, 4)
    ProfileStore(str(path), gpus_per_stage=1, gpu_name="A100", blocking_power_per_gpu_w=None).save(
        _assemble([80.0, 84.0]), schedule)
    config = make_config(profile_path=str(path))
    assert config.saved_blocking_power_w == pytest.approx(82.0)
    loaded = ProfileStore.for_job(config, 1, None).load(schedule)
    assert loaded.blocking_power_per_stage_w == pytest.approx(82.0)


def test_a_side_file_at_0_w_is_still_refused_at_the_door(tmp_path) -> None:
    """What an older release could have written: the door names the file and both fixes."""
    path = tmp_path / "profile.csv"
    ProfileStore(str(path), gpus_per_stage=1, gpu_name="A100", blocking_power_per_gpu_w=None).save(
        _assemble([80.0, 84.0]), build_schedule("1f1b", 2, 4))
    Path(f"{path}.json").write_text('{"blocking_power_w": 0.0, "gpus_per_stage": 1}')
    with pytest.raises(ConfigError, match="blocking_power_w.*greater than 0.*set perseus.blocking_power_w, or delete"):
        PerseusConfig.from_dict({"enabled": True, "gpu": "sim:a100_sxm", "profile_path": str(path)})
