"""Fault injection on the files a job reads and writes: every corrupt saved profile or sidecar is
a ConfigError naming `perseus.profile_path` when the runtime is built, and a summary that cannot
be written never makes close() (or DeepSpeed's destroy()) raise."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perseus_ext.errors import ConfigError
from perseus_ext.planning.schedule import build_schedule
from perseus_ext.runtime import PerseusRuntime

from runtime_helpers import make_config, sim_gpu  # noqa: E402

SIM_NAME = "NVIDIA A100-SXM4-80GB (simulated)"


def _csv_text() -> str:
    rows = ["stage,instruction,frequency,time,energy"]
    for mhz in (1410, 1200, 1005):
        scale = 1410 / mhz
        rows += [f"0,forward,{mhz},{0.004 * scale:.6f},{1.6 / scale ** 0.5:.6f}",
                 f"0,backward,{mhz},{0.008 * scale:.6f},{3.2 / scale ** 0.5:.6f}"]
    return "\n".join(rows) + "\n"


def _sidecar(**fields) -> str:
    return json.dumps({"blocking_power_w": 83.64, "gpus_per_stage": 1, "gpu": SIM_NAME, **fields})


def _build(directory: Path, csv: str | bytes, sidecar: str | bytes | None) -> PerseusRuntime:
    path = directory / "profile.csv"
    path.write_bytes(csv.encode() if isinstance(csv, str) else csv)
    side = Path(f"{path}.json")
    if sidecar is None:
        side.unlink(missing_ok=True)
    else:
        side.write_bytes(sidecar.encode() if isinstance(sidecar, str) else sidecar)
    config = make_config(profile_path=str(path))
    return PerseusRuntime(config, schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=sim_gpu())


def test_the_intact_profile_is_accepted(tmp_path):
    runtime = _build(tmp_path, _csv_text(), _sidecar())
    assert runtime.saved_profile is not None
    runtime.close()


CORRUPT = {
    "binary csv": (b"\x00\xff\xfe\x89PNG\r\n\x1a\n" * 20, _sidecar(), "profile_path"),
    "truncated csv": (_csv_text()[:-30], _sidecar(), "profile_path"),
    "csv without a column": ("stage,instruction,frequency,time\n0,forward,1410,0.004\n", _sidecar(), "profile_path"),
    "binary sidecar": (_csv_text(), b"\x00\xff\xfe\x80\x81", "profile_path"),
    "truncated sidecar": (_csv_text(), _sidecar()[:25], "profile_path"),
    "sidecar not an object": (_csv_text(), "[83.64]", "profile_path"),
    "sidecar without blocking power": (_csv_text(), json.dumps({"gpus_per_stage": 1, "gpu": SIM_NAME}),
                                       "blocking_power_w"),
    "non-numeric blocking power": (_csv_text(), _sidecar(blocking_power_w="lots"), "blocking_power_w"),
    "deeply nested sidecar": (_csv_text(), '{"blocking_power_w": 83.64, "x": ' + "[" * 5000 + "]" * 5000 + "}",
                              "nests deeper than 16 levels"),  # was RecursionError
    "infinite blocking power": (_csv_text(), _sidecar().replace("83.64", "1e999"), "profile_path"),
    "another GPU model": (_csv_text(), _sidecar(gpu="NVIDIA H100 80GB HBM3"), "was measured on NVIDIA H100"),
    "other tensor parallelism": (_csv_text(), _sidecar(gpus_per_stage=4), "4 GPU(s) per stage"),
    "wrong stage count": (_csv_text().replace("\n0,", "\n1,"), _sidecar(), "profile_path"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_a_corrupt_saved_profile_fails_at_initialize_with_a_config_error(case, tmp_path):
    csv, sidecar, message = CORRUPT[case]
    with pytest.raises(ConfigError) as error:
        _build(tmp_path, csv, sidecar)
    assert message in str(error.value)
    assert "perseus.profile_path" in str(error.value) or "perseus.blocking_power_w" in str(error.value)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(["csv", "sidecar"]), cut=st.floats(0.0, 1.0),
       noise=st.binary(max_size=24), at=st.floats(0.0, 1.0))
def test_fuzzed_saved_files_are_accepted_or_rejected_cleanly(tmp_path, target, cut, noise, at):
    """Truncate either file anywhere and splice random bytes in: the runtime is built, or a
    ConfigError says what is wrong -- never another exception."""
    original = (_csv_text() if target == "csv" else _sidecar()).encode()
    kept = original[: int(len(original) * cut)]
    position = int(len(kept) * at)
    damaged = kept[:position] + noise + kept[position:]
    csv, sidecar = (damaged, _sidecar()) if target == "csv" else (_csv_text(), damaged)
    try:
        runtime = _build(tmp_path, csv, sidecar)
    except ConfigError as err:
        assert "perseus." in str(err)
    else:
        runtime.close()


# --------------------------------------------------------------------------- summary that cannot be written
def test_a_summary_path_that_cannot_be_written_fails_at_initialize(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="perseus.summary_path"):
        make_config(summary_path=str(blocker / "summary-{rank}.json"))


def _break_directory(directory: Path) -> None:
    """The summary's directory vanishes mid-run and a file takes its name (a full or remounted
    disk behaves alike): nothing checked at initialize can foresee it."""
    for child in directory.iterdir():
        child.unlink()
    directory.rmdir()
    directory.write_text("")


def test_a_summary_that_cannot_be_written_at_close_never_makes_close_raise(tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    gpu = sim_gpu()
    runtime = PerseusRuntime(make_config(summary_path=str(out / "summary-{rank}.json")),
                             schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=gpu)
    _break_directory(out)
    with caplog.at_level(logging.ERROR):
        runtime.close()
    assert "cannot write the summary" in caplog.text and gpu.locked_clock is None


def test_deepspeed_destroy_still_runs_when_the_summary_cannot_be_written(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from perseus_ext.adapters.deepspeed import attach

    out = tmp_path / "out"
    out.mkdir()
    engine = object.__new__(type("Engine", (PipelineEngine,), {}))  # hooks only, no model
    destroyed = []
    engine.__dict__.update(
        grid=SimpleNamespace(get_data_parallel_group=lambda: None, get_pipe_parallel_group=lambda: None),
        num_stages=1, micro_batches=4, stage_id=0, local_rank=0, _exec_schedule=lambda schedule: None,
        destroy=lambda: destroyed.append(True), perseus=None, _parameters={}, _buffers={}, _modules={},
        train_micro_batch_size_per_gpu=lambda: 1,
    )
    monkeypatch.setenv("PERSEUS_GPU", "sim:a100_sxm?pace=0")
    runtime = attach(engine, make_config(summary_path=str(out / "summary.json")))
    _break_directory(out)
    engine.destroy()
    assert destroyed == [True] and runtime._closed
