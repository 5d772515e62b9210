"""The simulator (`perseus_ext.measurement.gpu.sim`) is loaded only when a simulated GPU is asked
for: importing the device layer, or running a job on `gpu: nvml`, never imports it. Each case runs
in a fresh interpreter, which reports the simulator modules it ended up with; a job that asks for
`sim:` shows the report would see them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIMULATOR = "perseus_ext.measurement.gpu.sim"

_JOB = f"""
import json, sys
which = sys.argv[1]
if which == "device layer":
    import perseus_ext.measurement.gpu
else:
    from perseus_ext.planning.schedule import build_schedule
    from perseus_ext.runtime import PerseusConfig, PerseusRuntime
    config = PerseusConfig.from_dict({{"enabled": True, "gpu": which, "warmup_iterations": 1, "log_interval": 0,
                                      "solve_in_background": False}})
    runtime = PerseusRuntime(config, schedule=build_schedule("1f1b", 1, 2), stage=0)
    for _ in range(3):
        runtime.iteration_start()
        for computation in runtime.order:
            runtime.before_computation(computation.kind, computation.microbatch)
            runtime.after_computation(computation.kind, computation.microbatch)
        runtime.mark_compute_end()
        runtime.iteration_end()
    runtime.close()
print(json.dumps(sorted(m for m in sys.modules if m == {SIMULATOR!r} or m.startswith({SIMULATOR + "."!r}))))
"""


def _simulator_modules_after(which: str, tmp_path: Path) -> list[str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PERSEUS_", "ZEUSD_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, "-c", _JOB, which], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_the_device_layer_loads_no_simulator(tmp_path):
    assert _simulator_modules_after("device layer", tmp_path) == []


def test_a_job_on_nvml_loads_no_simulator(tmp_path):
    assert _simulator_modules_after("nvml", tmp_path) == []


def test_a_job_on_a_simulated_gpu_loads_it(tmp_path):
    loaded = _simulator_modules_after("sim:a100_sxm?pace=0", tmp_path)
    assert f"{SIMULATOR}.simulated_gpu" in loaded and f"{SIMULATOR}.device" in loaded
