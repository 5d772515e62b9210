"""The one device API every GPU-touching part of perseus-ext goes through, and its typed errors.

Planning never sees a GPU; the runtime, profiler, controller and emulator only see `GPU`. Keeping
the interface this small is what lets the simulated GPU stand in for a real one on CPU machines.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from perseus_ext.errors import ConfigError, PerseusError
from perseus_ext.measurement.gpu.restore_spec import RestoreSpec

SIMULATED_HINT = (
    "to run without a GPU use the simulated backend, e.g. PERSEUS_GPU=sim:a100_sxm "
    "(presets: a100_sxm, a40, h100)"
)


class GPUError(PerseusError, RuntimeError):
    """A device call failed; the message says which call and what to do about it."""


class GPUUnavailableError(GPUError):
    """No NVML library, no driver or no GPU visible to this process."""


class GPUPermissionError(GPUError):
    """The process may read the GPU but lacks the privilege to change its clocks or power limit."""


class GPUNotSupportedError(GPUError):
    """The device cannot do what was asked (a MIG slice, or no locked-clock support)."""


class StrictControlError(ConfigError, GPUPermissionError):
    """`"strict": true` and this process cannot set clocks: the job stops at start-up instead of
    running in dry-run. A ConfigError (the job's configuration asks for what this node cannot
    give) and a GPUPermissionError (what is missing is the right to change clocks)."""


@dataclass(frozen=True)
class DeviceAddress:
    """Where a GPU sits, for a process that numbers GPUs its own way (zeusd) to find it.

    pci_bus_id is normalised to lspci -D's form, `dddd:bb:dd.f` (lowercase hex); nvml_index is
    the device's NVML index, which CUDA_VISIBLE_DEVICES does not renumber."""

    pci_bus_id: str | None
    nvml_index: int | None


def normalise_pci_bus_id(text: str) -> str:
    """`00000000:01:00.0` (NVML) or `0000:01:00.0` (lspci -D, zeusd) as `0000:01:00.0`; raises
    ValueError on anything else."""
    domain, bus, rest = text.strip().split(":")
    device, function = rest.split(".")
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{int(function, 16):x}"


@dataclass(frozen=True)
class PowerFloor:
    """From `start_s` to `end_s` seconds of device time after an anchor, the device draws at
    least its idle power + `above_idle_w` (`GPU.hold_power_floor`): a waiting device draws
    exactly that, a computing one its own power when that is higher."""

    start_s: float
    end_s: float
    above_idle_w: float

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) for v in (self.start_s, self.end_s, self.above_idle_w)) \
                or not (0 <= self.start_s <= self.end_s) or self.above_idle_w < 0:
            raise GPUError(f"PowerFloor({self.start_s!r}, {self.end_s!r}, {self.above_idle_w!r}): it needs "
                           "0 <= start_s <= end_s seconds and above_idle_w >= 0 watts, all finite")


PERMISSION_HELP = (
    "changing GPU clocks or power limits needs the SYS_ADMIN capability: run as root, start the "
    "container with `docker run --cap-add SYS_ADMIN ...`, or grant it to the interpreter with "
    "`sudo setcap cap_sys_admin+ep $(readlink -f $(which python))`"
)


class GPU(abc.ABC):
    """One physical GPU as perseus-ext uses it: SM clocks, energy counter, power limit.

    All clocks are SM clocks in MHz, energies are NVML-style cumulative millijoules (coarse,
    updated every few tens of milliseconds), powers are watts.
    """

    name: str
    uuid: str

    @abc.abstractmethod
    def supported_sm_clocks(self) -> list[int]:
        """SM clocks the GPU can be locked to at its maximum memory clock, highest first."""

    def max_sm_clock(self) -> int:
        return self.supported_sm_clocks()[0]

    @abc.abstractmethod
    def set_locked_sm_clocks(self, mhz: int) -> None:
        """Lock the SM clock to exactly `mhz` (min = max = mhz)."""

    @abc.abstractmethod
    def reset_locked_sm_clocks(self) -> None:
        """Let the GPU pick its clock again (the driver default, normally boosting to max)."""

    def locked_sm_clock(self) -> int | None:
        """The SM clock the GPU is locked to now, None when unlocked, whoever set it. Lets the
        watchdog undo only a lock its job made; a backend that cannot read it back raises."""
        raise GPUNotSupportedError(f"{self.name}: the locked SM clock cannot be read back")

    @abc.abstractmethod
    def energy_mj(self) -> int:
        """Cumulative energy counter in millijoules since an arbitrary origin."""

    @abc.abstractmethod
    def power_w(self) -> float:
        """Instant (driver-averaged) power draw."""

    @abc.abstractmethod
    def sm_clock(self) -> int:
        """Current SM clock."""

    @abc.abstractmethod
    def power_limit_w(self) -> float:
        """Current enforced power limit."""

    @abc.abstractmethod
    def power_limit_range_w(self) -> tuple[float, float]:
        """Lowest and highest power limit the driver accepts."""

    @abc.abstractmethod
    def default_power_limit_w(self) -> float:
        """The power limit the GPU boots with."""

    @abc.abstractmethod
    def set_power_limit_w(self, watts: float) -> None:
        """Set the power limit (the knob Zeus-style power-limit policies turn)."""

    def reset_power_limit(self) -> None:
        self.set_power_limit_w(self.default_power_limit_w())

    @abc.abstractmethod
    def can_set_clocks(self) -> bool:
        """Whether this process may change clocks/power limit; probes without touching them."""

    def control_help(self) -> str:
        """Why this process may not set clocks and how to fix it, for when can_set_clocks() is
        False (a daemon-backed GPU names the daemon's fault instead of the missing privilege)."""
        return PERMISSION_HELP

    def address(self) -> DeviceAddress:
        """PCI bus id and NVML index of this GPU (None where the backend has none)."""
        return DeviceAddress(None, None)

    def supports_power_floor(self) -> bool:
        """Whether the device can be made to draw a stated power exactly while it waits, as a
        swing-capped plan's filler asks (`hold_power_floor`). Only the simulated GPU can: a real
        GPU's power under dummy work depends on its clock, temperature and the work itself, so
        no backend promises a stated number of watts, and the planner plans clock-only there."""
        return False

    def hold_power_floor(self, anchor: object, floors: Sequence[PowerFloor], hold_until_work_s: float = 0.0) -> None:
        """Fill one wait: hold each floor from `anchor`'s device time + its start to + its end,
        once the device reaches `anchor` (a `timeline.DeviceMarker` of this GPU's timeline; not
        named here, as the timeline module imports this one), and end them all when
        the device starts work launched after `anchor` (the wait is over); the latest-ending
        floor holds on while the device still waits, at most `hold_until_work_s` past its end
        (a wait longer than planned stays filled, a long pause does not burn). Never blocks the
        caller on the device: the device anchors the floors on its own progress."""
        raise GPUNotSupportedError(f"{self.name}: cannot be made to draw a stated power "
                                   "(supports_power_floor() is False); plan without a filler")

    def follow_external_change(self) -> None:
        """Another process (zeusd, on this process's behalf) has just changed this GPU's clock or
        power limit. Hardware needs nothing; a simulated GPU re-reads its persisted state."""

    def restore_spec(self) -> RestoreSpec | None:
        """How another process can re-open this GPU to restore its clocks (the SIGKILL watchdog).

        None means no other process can reach this device's state, so no watchdog is needed.
        """
        return None

    def timestamp(self) -> float:
        """Seconds on the clock this device's work runs on (wall clock for real GPUs)."""
        return time.perf_counter()

    def wait(self, seconds: float) -> None:
        """Let `seconds` pass on this device's clock with the GPU idle."""
        if seconds > 0:
            time.sleep(seconds)

    def close(self) -> None:
        """Release library handles; the GPU's clocks are left as they are."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, uuid={self.uuid!r})"


def check_clock(gpu: GPU, mhz: int, supported: list[int]) -> int:
    """Validate a requested clock against the supported list, naming the fix when it is wrong."""
    if isinstance(mhz, bool) or int(mhz) != mhz:
        raise GPUError(f"SM clock {mhz!r} is not an integer number of MHz")
    mhz = int(mhz)
    if mhz not in supported:
        nearest = min(supported, key=lambda clock: abs(clock - mhz))
        raise GPUNotSupportedError(
            f"{gpu.name}: SM clock {mhz} MHz is not supported (supported: {supported[-1]}-"
            f"{supported[0]} MHz, nearest {nearest}); use a profile measured on this GPU model"
        )
    return mhz
