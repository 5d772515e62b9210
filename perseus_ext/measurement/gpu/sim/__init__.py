"""The simulated GPU, for CPU-only machines: loaded only when a GPU spec asks for ``sim:<preset>``.

`SimulatedGPU` (`simulated_gpu.py`) is a `GPU` whose time, power and energy counter follow a
preset's curves (`presets.py`); its work runs on an asynchronous in-order device (`device.py`,
which logs the power it draws: `power_log.py`, and holds the power floors it is asked to:
`power_floor.py`) through a compute stream (`stream.py`) that waits
for other ranks' results on a cross-rank board (`board.py`); `workload.py` launches a simulated
job's computations onto that stream. Outside this package only the GPU door (`open_gpu`,
`open_restore_target`) and the runtime's pacer choice import it, inside the function a `sim:` spec
or a `simulated_workload` reaches (pyproject.toml's import contract), so a job on real GPUs never
loads it.
"""

from __future__ import annotations

from perseus_ext.measurement.gpu.sim.board import DEFAULT_TRANSFER_S
from perseus_ext.measurement.gpu.sim.presets import PRESETS, Preset, find_preset
from perseus_ext.measurement.gpu.sim.simulated_gpu import SimulatedGPU, read_state_file

__all__ = ["DEFAULT_TRANSFER_S", "PRESETS", "Preset", "SimulatedGPU", "find_preset", "read_state_file"]
