"""The config door is cheap and a leaf: validating a full `perseus` section (every sub-section)
imports neither torch nor numpy nor SQLAlchemy and takes a small multiple of importing
pydantic alone; the GPU spec string becomes a typed spec once, there, and the device layer
opens exactly that spec."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perseus_ext.config import NvmlSpec, PerseusConfig, SimPreset, SimSpec, ZeusdSpec, parse_gpu_spec
from perseus_ext.config.gpu import parse_rank_list
from perseus_ext.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

FULL_SECTION = {
    "enabled": True,
    "gpu": "sim:a40?pace=0&slowdown=1.2&slowdown_ranks=1,3",
    "candidate_clocks": [1410, 1200],
    "communication_clock": "min",
    "solver": {"min_grid_points": 300},
    "log_path": "logs/perseus-{rank}.jsonl",
    "summary_path": "logs/summary-{rank}.json",
    "frontier_path": "frontier.json",
    "simulated_workload": {"forward_seconds": 0.01, "backward_seconds": [0.02, 0.03]},
    "prometheus": {"port": 9400, "pushgateway": "http://pushgateway:9091"},
    "policy": {
        "type": "chase", "eta": 0.3, "mode": "power_limit",
        "carbon": {"url": "https://grid.example/ci", "headers": {"k": "v"}, "forecast_horizon_s": 600},
        "power_limit": {"step_w": 50},
        "batch_size": {"store": "postgresql://u:p@db:5432/bso", "job_id": "nightly", "batch_sizes": [8, 16],
                       "default_batch_size": 8, "target_metric": {"name": "loss", "value": 2.0}},
    },
}
HEAVY = ("torch", "numpy", "sqlalchemy", "scipy", "deepspeed", "megatron")

# Fresh interpreters, one after the other: (seconds to import pydantic and build one model,
# seconds to import the door and validate FULL_SECTION); the heavy modules loaded by the latter.
_MEASURE = f"""
import json, sys, time
start = time.perf_counter()
if sys.argv[1] == "pydantic":
    import pydantic
    class Probe(pydantic.BaseModel):
        x: int = 0
    Probe(x=1)
else:
    from perseus_ext.config import PerseusConfig
    PerseusConfig.from_dict(json.loads(sys.argv[2]))
print(json.dumps([time.perf_counter() - start, [m for m in {HEAVY!r} if m in sys.modules]]))
"""


def _measure(which: str, tmp_path: Path) -> tuple[float, list[str]]:
    result = subprocess.run([sys.executable, "-c", _MEASURE, which, json.dumps(FULL_SECTION)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    seconds, heavy = json.loads(result.stdout)
    return seconds, heavy


def test_a_full_section_validates_without_torch_numpy_or_sqlalchemy(tmp_path):
    seconds, heavy = _measure("door", tmp_path)
    assert heavy == [], f"validating a config imported {heavy}"
    assert seconds > 0


def test_the_door_costs_a_small_multiple_of_pydantic_alone(tmp_path):
    """Minimum of 5 fresh interpreters each, side by side, against importing pydantic and
    building one model (the floor of any pydantic door). The door measured 1.3-1.6x that floor;
    a door that imports the package's runtime (numpy, SQLAlchemy, the policies) measured 4.8x.
    2.5x leaves room for a busy machine and still fails if such an import comes back."""
    door, pydantic_alone = [], []
    for _ in range(5):
        door.append(_measure("door", tmp_path)[0])
        pydantic_alone.append(_measure("pydantic", tmp_path)[0])
    assert min(door) < 2.5 * min(pydantic_alone), (door, pydantic_alone)


# --------------------------------------------------------------------------- the GPU spec
def test_the_spec_is_parsed_once_into_typed_options():
    spec = parse_gpu_spec(" sim:h100?pace=false&seed=4&state_dir=/tmp/s&slowdown=1.5&slowdown_ranks=2-3,0 ")
    assert spec == SimSpec(preset=SimPreset.H100, pace=False, seed=4, state_dir="/tmp/s", slowdown=1.5,
                           slowdown_ranks=(0, 2, 3))
    assert spec.slows_rank(3) and not spec.slows_rank(1)
    assert spec.state_file_of(2) == "/tmp/s/sim-gpu-rank2.json"
    assert parse_gpu_spec("sim:a40?state_file=/x/{rank}.json").state_file_of(5) == "/x/5.json"
    assert parse_gpu_spec("nvml") == NvmlSpec()
    assert parse_gpu_spec("zeusd") == ZeusdSpec(reader=NvmlSpec())
    assert parse_gpu_spec("zeusd:sim:a40") == ZeusdSpec(reader=SimSpec(preset=SimPreset.A40))
    assert parse_gpu_spec("sim:") == SimSpec()  # the default preset


@pytest.mark.parametrize("text, message", [
    ("cuda", "is not understood"),
    ("sim:v100", "unknown simulated preset 'v100'"),
    ("sim:a100_sxm?speed=2", "unknown option 'speed'"),
    ("sim:a100_sxm?slowdown=fast", "slowdown='fast' must be a float"),
    ("sim:a100_sxm?pace=maybe", "must be a boolean"),
    ("sim:a100_sxm?queue_depth=1.5", "queue_depth='1.5' must be a int"),
    ("sim:a100_sxm?queue_depth=0", "queue_depth=0: input should be greater than or equal to 1"),
    ("sim:a100_sxm?slowdown_ranks=3-1", "'3-1' is not a valid rank range"),
    ("sim:a100_sxm?pace", "options are not key=value pairs"),
    ("zeusd:zeusd", "zeusd reads through nvml or a simulated GPU"),
])
def test_bad_specs_name_the_typo(text, message):
    with pytest.raises(ConfigError, match=message.replace("?", r"\?").replace("(", r"\(")):
        parse_gpu_spec(text)


SPEC_OPTIONS = st.fixed_dictionaries({}, optional={
    "seed": st.integers(0, 10**6), "slowdown": st.floats(0.1, 10), "pace": st.booleans(),
    "period": st.floats(0, 1), "noise": st.floats(0, 0.5), "privileged": st.booleans(),
    "switch_ms": st.floats(0, 100), "queue_depth": st.integers(1, 8), "transfer_ms": st.floats(0, 5),
    "slowdown_ranks": st.lists(st.integers(0, 64), min_size=1, max_size=4).map(lambda r: tuple(sorted(set(r)))),
    "state_file": st.from_regex(r"[a-z/]{1,12}\{rank\}\.json", fullmatch=True),
})


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.sampled_from(list(SimPreset)), SPEC_OPTIONS, st.booleans())
def test_a_spec_prints_as_the_text_that_parses_back_to_it(preset, options, through_zeusd):
    spec = SimSpec(preset=preset, **options)
    typed = ZeusdSpec(reader=spec) if through_zeusd else spec
    assert parse_gpu_spec(str(typed)) == typed


def test_the_presets_the_door_knows_are_the_simulators():
    from perseus_ext.measurement.gpu.sim import PRESETS

    assert set(PRESETS) == {preset.value for preset in SimPreset}


def test_every_spec_option_has_a_query_reader():
    from perseus_ext.config.gpu import _KINDS

    assert set(_KINDS) == set(SimSpec.model_fields) - {"backend", "preset"}


def test_rank_lists():
    assert parse_rank_list("") is None
    assert parse_rank_list("0-2, 5") == (0, 1, 2, 5)
    with pytest.raises(ConfigError, match="not a rank"):
        parse_rank_list("x")


def test_the_config_hands_the_device_layer_the_spec_it_parsed(monkeypatch):
    from perseus_ext.measurement.gpu import open_gpu
    from perseus_ext.measurement.gpu.sim import SimulatedGPU

    monkeypatch.setenv("PERSEUS_GPU", "sim:h100?pace=0&slowdown=1.5&slowdown_ranks=3&seed=10")
    config = PerseusConfig.from_dict({})  # the key is null: env PERSEUS_GPU, read at the door
    assert config.gpu is None and config.gpu_spec.preset is SimPreset.H100
    monkeypatch.setenv("PERSEUS_GPU", "nvml")  # later changes do not reach this config
    straggler = open_gpu(config.gpu_spec, rank=3)
    normal = open_gpu(config.gpu_spec, rank=1)
    assert isinstance(straggler, SimulatedGPU) and straggler.preset.key == "h100"
    assert (straggler.slowdown, normal.slowdown) == (1.5, 1.0)
    assert (straggler.seed, normal.seed) == (13, 11)
    with pytest.raises(ConfigError, match="perseus.gpu is null, so env PERSEUS_GPU names the GPU"):
        monkeypatch.setenv("PERSEUS_GPU", "sim:a41")
        PerseusConfig.from_dict({})
