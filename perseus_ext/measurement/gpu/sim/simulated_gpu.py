"""A simulated GPU that behaves like the published A100/A40 profiles, for CPU-only machines.

Why it exists: the whole stack (profiler, controller, straggler handling, demo, emulator) must be
runnable and testable without a GPU, and measurement code must be exercised against the *real*
limitations of NVML and CUDA: a coarse, noisy energy counter, clock changes that land milliseconds
after the call, and work that runs asynchronously after the host launched it.

Physics (per preset, fitted to `examples/profiles`, see `docs/device.md`):

* time at clock f:  t(f) = t_max * ((1 - m) * f_max / f + m)    m = memory-bound fraction
* power at clock f: P(f) = P_max * (s + (1 - s) * x * V(x)^2),  x = f / f_max,
  V(x) = max(V_min, x)   (dynamic power ~ f V^2; voltage stops falling below V_min * f_max)

so energy = P * t has its minimum well below the max clock, where the voltage floor is reached.
While no computation runs, the GPU draws its idle/blocking power (the paper's blocking power).

Timeline: work runs on the GPU's asynchronous device (`device.py`), launched through its
`DeviceTimeline`; `run()` is launch + synchronize. With `pace=True` (default) the device lives on
the wall clock; with `pace=False` it keeps a virtual clock that only waiting on it advances, which
makes tests fast and exactly reproducible.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
import uuid as uuid_lib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from perseus_ext.measurement.gpu.common import (
    GPU,
    DeviceAddress,
    PowerFloor,
    GPUError,
    GPUPermissionError,
    PERMISSION_HELP,
    check_clock,
)
from perseus_ext.measurement.gpu.restore_spec import SimRestoreSpec
from perseus_ext.measurement.gpu.sim.board import DEFAULT_TRANSFER_S, Board
from perseus_ext.measurement.gpu.sim.device import SimDevice, SimMarker
from perseus_ext.measurement.gpu.sim.presets import PRESETS, find_preset
from perseus_ext.measurement.gpu.sim.stream import SimulatedTimeline
from perseus_ext.measurement.gpu.timeline import DeviceMarker, OwnTimeline, SwitchLatency


class SimulatedGPU(GPU, OwnTimeline):
    """A GPU whose time, power and energy counter follow a preset's curves (see module doc)."""

    PRESETS = PRESETS

    def __init__(
        self,
        preset: str = "a100_sxm",
        *,
        seed: int = 0,
        slowdown: float = 1.0,
        pace: bool = True,
        state_file: str | os.PathLike[str] | None = None,
        energy_update_period_s: float = 0.1,
        energy_noise: float = 0.02,
        privileged: bool = True,
        rank: int = 0,
        switch_s: float | None = None,
        transition_s: float | None = None,
        call_s: float | None = None,
        queue_depth: int = 2,
        transfer_s: float = DEFAULT_TRANSFER_S,
    ) -> None:
        """switch_s / transition_s: clock-change latency (None: the preset's; 0: instant);
        call_s: how long a clock set/reset call blocks its caller, as NVML's does (paced GPUs;
        None: the preset's, 0);
        queue_depth: unfinished computations the host may launch before a launch blocks;
        transfer_s: hand-over latency added to every cross-rank dependency."""
        self.preset = find_preset(preset)
        if energy_update_period_s <= 0:
            raise GPUError(
                f"energy_update_period_s={energy_update_period_s}; it must be > 0 seconds"
            )
        if energy_noise < 0:
            raise GPUError(f"energy_noise={energy_noise}; it must be >= 0 (relative std per update)")
        if transfer_s < 0:
            raise GPUError(f"transfer_s={transfer_s}; it must be >= 0 seconds")
        default = self.preset.switch_latency
        try:
            self.switch_latency = SwitchLatency(
                default.switch_s if switch_s is None else switch_s,
                default.transition_s if transition_s is None else transition_s,
                default.call_s if call_s is None else call_s,
            )
        except ValueError as exc:
            raise GPUError(f"simulated GPU clock-change latency: {exc}") from None
        self.name = self.preset.name
        self.uuid = "GPU-" + str(uuid_lib.uuid5(uuid_lib.NAMESPACE_OID, f"{preset}/{seed}/{rank}"))
        self.seed = seed
        self.rank = rank
        self.pace = pace
        self.privileged = privileged
        self.energy_update_period_s = energy_update_period_s
        self.energy_noise = energy_noise
        self.transfer_s = transfer_s
        self.state_file = Path(state_file) if state_file is not None else None
        self.slowdown = slowdown
        self.clock_history: list[int | None] = []  # every applied lock (None = reset), in order
        self.run_counts: dict[str, int] = {}  # launched computations per label
        self._clocks = self.preset.supported_clocks()
        self._faults: dict[str, tuple[BaseException, int | None]] = {}
        self._locked_clock: int | None = None
        self._power_limit_w = self.preset.default_power_limit_w
        if self.state_file is not None and self.state_file.exists():
            self._load_state()  # hardware state that outlived its process: in place from the start
        self.device = SimDevice(
            self.preset, latency=self.switch_latency, pace=pace, queue_depth=queue_depth,
            energy_update_period_s=energy_update_period_s, energy_noise=energy_noise,
            rng=random.Random(seed), initial_clock_mhz=self._locked_clock,
            initial_cap_mhz=self._power_cap_mhz(),
        )
        self._stream = SimulatedTimeline(self.device, kind_counts=self.run_counts,
                                         slowdown=lambda: self._slowdown)

    # ----------------------------------------------------------------- runtime knobs
    @property
    def slowdown(self) -> float:
        """Straggler factor applied to computations launched from now on."""
        return self._slowdown

    @slowdown.setter
    def slowdown(self, value: float) -> None:
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise GPUError(f"slowdown={value!r}; it must be a finite number > 0 (1.0 = normal speed)")
        self._slowdown = float(value)

    def inject_fault(
        self, call: str, error: BaseException | None = None, times: int | None = 1
    ) -> None:
        """Make the next `times` calls of method `call` raise `error` (None: every call)."""
        if not callable(getattr(self, call, None)):
            raise GPUError(f"inject_fault: SimulatedGPU has no method {call!r}")
        self._faults[call] = (error or GPUError(f"injected fault in {call}"), times)

    def _maybe_fail(self, call: str) -> None:
        fault = self._faults.get(call)
        if fault is None:
            return
        error, times = fault
        if times is not None:
            if times <= 1:
                del self._faults[call]
            else:
                self._faults[call] = (error, times - 1)
        raise error

    # ----------------------------------------------------------------- work and energy
    def open_timeline(
        self, *, job_id: str | None = None, rank: int | None = None, peer_timeout_s: float | None = None
    ) -> SimulatedTimeline:
        """This GPU's compute stream; with a job_id (paced GPUs), joined to that job's
        cross-rank board so launches can wait for and publish keys of other ranks, each wait
        bounded by `peer_timeout_s` (the job's control_timeout_s; None: unbounded)."""
        if job_id is None or not self.pace:
            return self._stream
        if self.device.board is not None:
            raise GPUError(
                f"{self.name}: a timeline on board {self.device.board.job_id!r} is open; close it "
                "before opening another"
            )
        board = Board(job_id, self.rank if rank is None else rank, transfer_s=self.transfer_s)
        return SimulatedTimeline(self.device, kind_counts=self.run_counts,
                                 slowdown=lambda: self._slowdown, board=board, peer_timeout_s=peer_timeout_s)

    def run(self, seconds_at_max_clock: float, kind: str = "forward") -> float:
        """Launch a computation that takes `seconds_at_max_clock` at the max clock and wait for
        it (launch + synchronize). Returns its device duration at the clocks it met, times the
        slowdown; paced, that much wall time has passed on the device when it returns."""
        self.run_counts[kind] = self.run_counts.get(kind, 0) + 1
        work = self.device.launch(seconds_at_max_clock, slowdown=self._slowdown)
        self.device.wait_for(work)
        return work.end - work.start

    def expected(self, seconds_at_max_clock: float, mhz: int | None = None) -> tuple[float, float]:
        """Exact (seconds, joules) of a computation held at `mhz` (default: the current clock)."""
        clock = self.device.effective_clock() if mhz is None else mhz
        duration = seconds_at_max_clock * self.preset.time_factor(clock) * self._slowdown
        return duration, duration * self.preset.compute_power_w(clock)

    def supports_power_floor(self) -> bool:
        """The simulated device draws a stated power exactly (its power is a model)."""
        return True

    def hold_power_floor(self, anchor: DeviceMarker, floors: Sequence[PowerFloor], hold_until_work_s: float = 0.0) -> None:
        """Hold the floors after `anchor` (a marker of this GPU's timeline) on the device, as
        the ABC says; its power, power log and energy counter include them."""
        self._maybe_fail("hold_power_floor")
        if not isinstance(anchor, SimMarker):
            raise GPUError(f"{self.name}: hold_power_floor needs a marker of this GPU's own timeline, "
                           f"not {type(anchor).__name__}")
        self.device.hold_power_floor(anchor, floors, hold_until_work_s)

    @property
    def true_energy_j(self) -> float:
        """Exact integrated energy since creation (what a perfect counter would show)."""
        return self.device.true_energy_j()

    def timestamp(self) -> float:
        return self.device.now()

    def wait(self, seconds: float) -> None:
        self.device.idle(seconds)

    # ----------------------------------------------------------------- GPU API
    def supported_sm_clocks(self) -> list[int]:
        self._maybe_fail("supported_sm_clocks")
        return list(self._clocks)

    def set_locked_sm_clocks(self, mhz: int) -> None:
        """Lock the clock; it lands on the device after the switching latency and ramp."""
        self._call()
        with self.device.cond:
            self._maybe_fail("set_locked_sm_clocks")
            self._check_privilege("lock SM clocks")
            self._locked_clock = check_clock(self, mhz, self._clocks)
            self.device.request_clock(self._locked_clock)
            self.clock_history.append(self._locked_clock)
            self._save_state()

    def reset_locked_sm_clocks(self) -> None:
        self._call()
        with self.device.cond:
            self._maybe_fail("reset_locked_sm_clocks")
            self._check_privilege("reset locked SM clocks")
            self._locked_clock = None
            self.device.request_clock(self.preset.max_clock_mhz)
            self.clock_history.append(None)
            self._save_state()

    def _call(self) -> None:
        """A clock call blocks its caller for `call_s` before it takes effect (paced GPUs)."""
        if self.pace and self.switch_latency.call_s > 0:
            time.sleep(self.switch_latency.call_s)

    @property
    def locked_clock(self) -> int | None:
        """The requested locked SM clock, None when the driver picks (it may not have landed)."""
        return self._locked_clock

    def locked_sm_clock(self) -> int | None:
        """The lock as the hardware holds it: re-read from the state file, which another
        process (another job, or this one's watchdog) may have changed."""
        self._maybe_fail("locked_sm_clock")
        if self.state_file is not None and self.state_file.exists():
            return read_state_file(self.state_file).get("locked_sm_clock")
        return self._locked_clock

    def energy_mj(self) -> int:
        self._maybe_fail("energy_mj")
        return int(self.device.counter_j() * 1000.0)

    def power_w(self) -> float:
        self._maybe_fail("power_w")
        return self.device.power_w()

    def sm_clock(self) -> int:
        """The clock the device runs at now (a requested change shows once it has landed)."""
        self._maybe_fail("sm_clock")
        return int(round(self.device.effective_clock()))

    def power_limit_w(self) -> float:
        self._maybe_fail("power_limit_w")
        return self._power_limit_w

    def power_limit_range_w(self) -> tuple[float, float]:
        return self.preset.power_limit_range_w

    def default_power_limit_w(self) -> float:
        return self.preset.default_power_limit_w

    def set_power_limit_w(self, watts: float) -> None:
        """Set the power limit; the clock it allows applies immediately (capping is fast)."""
        with self.device.cond:
            self._maybe_fail("set_power_limit_w")
            self._check_privilege("set the power limit")
            low, high = self.preset.power_limit_range_w
            if not low <= watts <= high:
                raise GPUError(
                    f"{self.name}: power limit {watts} W is outside the supported range "
                    f"{low:g}-{high:g} W"
                )
            self._power_limit_w = float(watts)
            self.device.set_power_cap(self._power_cap_mhz())
            self._save_state()

    def can_set_clocks(self) -> bool:
        self._maybe_fail("can_set_clocks")
        return self.privileged

    def address(self) -> DeviceAddress:
        """A simulated node numbers its GPUs by rank: NVML index = rank, bus = rank + 1."""
        bus = self.rank + 1
        return DeviceAddress(f"{bus >> 8:04x}:{bus & 0xFF:02x}:00.0", self.rank)

    def follow_external_change(self) -> None:
        """Put in force what another process (a daemon setting clocks for this one) wrote to the
        persisted state, as hardware would: a changed lock is requested on the device now and
        lands after the switching latency; a changed power limit caps at once."""
        if self.state_file is None or not self.state_file.exists():
            return
        state = read_state_file(self.state_file)
        with self.device.cond:
            locked = state.get("locked_sm_clock")
            if locked != self._locked_clock:
                self._locked_clock = locked
                self.device.request_clock(self.preset.max_clock_mhz if locked is None else locked)
                self.clock_history.append(locked)
            power_limit_w = float(state.get("power_limit_w", self.preset.default_power_limit_w))
            if power_limit_w != self._power_limit_w:
                self._power_limit_w = power_limit_w
                self.device.set_power_cap(self._power_cap_mhz())

    def restore_spec(self) -> SimRestoreSpec | None:
        if self.state_file is None:
            return None  # the state dies with this process: nothing to restore from outside
        return SimRestoreSpec(preset=self.preset.key, state_file=str(self.state_file))

    def _power_cap_mhz(self) -> int:
        return self.preset.throttled_clock(self.preset.max_clock_mhz, self._power_limit_w)

    def _check_privilege(self, action: str) -> None:
        if not self.privileged:
            raise GPUPermissionError(f"{self.name}: no permission to {action}; {PERMISSION_HELP}")

    # ----------------------------------------------------------------- persisted state
    def _save_state(self) -> None:
        """Persist clock/power-limit state like hardware does, so other processes can see it."""
        if self.state_file is None:
            return
        state = {
            "preset": self.preset.key,
            "uuid": self.uuid,
            "locked_sm_clock": self._locked_clock,
            "power_limit_w": self._power_limit_w,
            "default_power_limit_w": self.preset.default_power_limit_w,
        }
        tmp = self.state_file.with_name(f".{self.state_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_file)

    def _load_state(self) -> None:
        state = read_state_file(self.state_file)
        if state.get("preset") != self.preset.key:
            raise GPUError(
                f"{self.state_file}: holds the state of a {state.get('preset')!r} GPU, not "
                f"{self.preset.key!r}; use another state_file or delete it"
            )
        self._locked_clock = state.get("locked_sm_clock")
        self._power_limit_w = float(state.get("power_limit_w", self.preset.default_power_limit_w))


def read_state_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a simulated GPU's persisted clock/power-limit state."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise GPUError(f"{path}: cannot read simulated GPU state ({exc})") from exc
