"""A GPU whose clock and power-limit writes go through zeusd, for jobs that are not root.

Reads come from a reading backend (NVML on real GPUs, which needs no privilege; a simulated GPU
in tests), writes from zeusd's documented endpoints (`/gpu/set_gpu_locked_clocks`,
`/gpu/reset_gpu_locked_clocks`, `/gpu/set_power_limit`, with `gpu_ids` and `block=true`).

Which zeusd GPU is ours: zeusd numbers GPUs by NVML index on its side of the node, not by this
process's CUDA ordinal (CUDA_VISIBLE_DEVICES renumbers; CUDA may order fastest-first). The
reading backend already resolved the CUDA device to one physical GPU by UUID / PCI bus id; its PCI
bus id is matched against `/discover`'s `pci_address` (zeusd after 0.5), else its NVML index is
zeusd's index (zeusd 0.5 and older list `0..nvmlDeviceGetCount()` in NVML order). Never the rank.

A daemon that is unusable at start-up (not there, refusing, wrong token, no `gpu-control`) does
not fail opening: `can_set_clocks()` is False and `control_help()` says why, so the controller
runs in dry-run with that message, or stops the job with `"strict": true`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from perseus_ext.measurement.gpu.common import GPU, GPUError, DeviceAddress, check_clock, normalise_pci_bus_id
from perseus_ext.measurement.gpu.restore_spec import NVMLRestoreSpec, SimRestoreSpec, ZeusdRestoreSpec
from perseus_ext.measurement.gpu.zeusd_client import (
    CONTROL_SCOPE,
    ENV_TOKEN,
    TOKEN_HELP,
    ZeusdAuthError,
    ZeusdCapabilityError,
    ZeusdClient,
    ZeusdDiscovery,
    ZeusdEndpoint,
    ZeusdError,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ZeusdReport:
    """The zeusd path's figures for the run summary: where, whether it could be used, what the
    writes cost and how many failed."""

    endpoint: str
    gpu_id: int | None
    control_fault: str | None  # why zeusd could not be used at start-up (None: it could)
    start_round_trip_ms: float  # the GET /time round trip added to the planned switching latency
    writes: int
    failures: int
    last_error: str | None
    round_trip_ms_median: float | None
    round_trip_ms_p99: float | None


class ZeusdGPU(GPU):
    """`reader`'s GPU, with every clock and power-limit change made by zeusd (module doc)."""

    def __init__(self, reader: GPU, endpoint: ZeusdEndpoint, *, token: str | None = None,
                 gpu_id: int | None = None, client: ZeusdClient | None = None) -> None:
        """gpu_id None: find this GPU among the daemon's and check the daemon lets us control it
        (start-up); an int: trust it (the watchdog re-opening a GPU the trainer already found)."""
        self.reader = reader
        self.endpoint = endpoint
        self.name = reader.name
        self.uuid = reader.uuid
        self.client = client or ZeusdClient(endpoint, token if token is not None else os.environ.get(ENV_TOKEN))
        self.gpu_id = gpu_id
        self.round_trip_s = 0.0
        self.control_fault: str | None = None
        if gpu_id is None:
            try:
                self.gpu_id = self._connect()
                self.round_trip_s = self.client.round_trip_s()
            except GPUError as err:  # zeusd's fault, or the reader could not say where its GPU sits
                self.gpu_id = None
                self.control_fault = str(err)

    def _connect(self) -> int:
        """Check zeusd lets this process change this GPU; its index on the daemon."""
        discovery, _ = check_control(self.client)
        return self._find(discovery)

    def _find(self, discovery: ZeusdDiscovery) -> int:
        where = self.endpoint.describe()
        address = self.reader.address()
        listed = [gpu for gpu in discovery.gpus if gpu.pci_address]
        if listed and address.pci_bus_id is not None:
            for gpu in listed:
                if _same_bus(gpu.pci_address, address.pci_bus_id):
                    return gpu.id
            raise ZeusdCapabilityError(
                f"{where} does not serve {self.name} at PCI {address.pci_bus_id} (it serves "
                f"{', '.join(f'{g.id}: {g.pci_address}' for g in listed)}); the daemon runs on another node "
                "or sees other GPUs (container device list)")
        if address.nvml_index is not None:  # zeusd <= 0.5: its index is the NVML index
            if address.nvml_index < len(discovery.gpus):
                return discovery.gpus[address.nvml_index].id
            raise ZeusdCapabilityError(
                f"{where} serves {len(discovery.gpus)} GPU(s); {self.name} is NVML GPU {address.nvml_index}")
        raise ZeusdCapabilityError(f"{where}: {self.name} has neither a PCI bus id nor an NVML index to "
                                   "match against the daemon's GPUs")

    # ----------------------------------------------------------------- writes: zeusd
    def set_locked_sm_clocks(self, mhz: int) -> None:
        mhz = check_clock(self, mhz, self.supported_sm_clocks())
        self._write("set_gpu_locked_clocks", f"lock SM clocks to {mhz} MHz", min_clock_mhz=mhz, max_clock_mhz=mhz)

    def reset_locked_sm_clocks(self) -> None:
        self._write("reset_gpu_locked_clocks", "reset locked SM clocks")

    def set_power_limit_w(self, watts: float) -> None:
        low, high = self.power_limit_range_w()
        if not low <= watts <= high:
            raise GPUError(f"{self.name}: power limit {watts} W is outside the supported range {low:g}-{high:g} W")
        self._write("set_power_limit", f"set the power limit to {watts:g} W", power_limit_mw=int(round(watts * 1000)))

    def _write(self, path: str, what: str, **params: int) -> None:
        if self.gpu_id is None:
            raise ZeusdError(f"{self.name}: cannot {what} through zeusd: {self.control_fault}")
        self.client.write(path, self.gpu_id, what, **params)
        self.reader.follow_external_change()

    def can_set_clocks(self) -> bool:
        return self.control_fault is None

    def control_help(self) -> str:
        return self.control_fault or f"{self.endpoint.describe()} sets this GPU's clocks"

    # ----------------------------------------------------------------- reads: the reading backend
    def supported_sm_clocks(self) -> list[int]:
        return self.reader.supported_sm_clocks()

    def locked_sm_clock(self) -> int | None:
        return self.reader.locked_sm_clock()

    def energy_mj(self) -> int:
        return self.reader.energy_mj()

    def power_w(self) -> float:
        return self.reader.power_w()

    def sm_clock(self) -> int:
        return self.reader.sm_clock()

    def power_limit_w(self) -> float:
        return self.reader.power_limit_w()

    def power_limit_range_w(self) -> tuple[float, float]:
        return self.reader.power_limit_range_w()

    def default_power_limit_w(self) -> float:
        return self.reader.default_power_limit_w()

    def address(self) -> DeviceAddress:
        return self.reader.address()

    def timestamp(self) -> float:
        return self.reader.timestamp()

    def wait(self, seconds: float) -> None:
        self.reader.wait(seconds)

    # ----------------------------------------------------------------- lifecycle
    def restore_spec(self) -> ZeusdRestoreSpec | None:
        """The watchdog restores through the same daemon; its token comes from the inherited
        ZEUSD_TOKEN, never from this spec (a command line anyone on the node can read)."""
        reader_spec = self.reader.restore_spec()
        if self.gpu_id is None or not isinstance(reader_spec, (SimRestoreSpec, NVMLRestoreSpec)):
            return None  # no reader another process can re-open (a daemon never reads through a daemon)
        return ZeusdRestoreSpec(gpu_id=self.gpu_id, reader=reader_spec, socket_path=self.endpoint.socket_path,
                                host_port=self.endpoint.host_port)

    def report(self) -> ZeusdReport:
        """The zeusd path's figures for the run summary."""
        return ZeusdReport(endpoint=self.endpoint.describe(), gpu_id=self.gpu_id, control_fault=self.control_fault,
                           start_round_trip_ms=1000 * self.round_trip_s, **self.client.stats_summary())

    def close(self) -> None:
        self.client.close()
        self.reader.close()

    def __repr__(self) -> str:
        return f"ZeusdGPU({self.reader!r}, {self.endpoint.describe()}, gpu_id={self.gpu_id})"


def check_control(client: ZeusdClient) -> tuple[ZeusdDiscovery, str]:
    """Whether `client`'s daemon lets this process change GPU clocks: its discovery and a line
    saying why it does; raises ZeusdError naming what is missing (daemon, group, token, scope)."""
    discovery = client.discover()
    where = client.endpoint.describe()
    if CONTROL_SCOPE not in discovery.enabled_api_groups:
        raise ZeusdCapabilityError(
            f"{where} was started without the '{CONTROL_SCOPE}' API group (enabled: "
            f"{', '.join(sorted(discovery.enabled_api_groups)) or 'none'}); the operator must restart it "
            f"with `zeusd serve --enable {CONTROL_SCOPE},gpu-read ...`")
    if not discovery.auth_required:
        return discovery, f"{where} serves {len(discovery.gpus)} GPU(s) with '{CONTROL_SCOPE}' enabled, no token needed"
    if client.token is None:
        raise ZeusdAuthError(f"{where} requires a token and {ENV_TOKEN} is not set; {TOKEN_HELP}")
    user, scopes = client.whoami()
    if CONTROL_SCOPE not in scopes:
        raise ZeusdAuthError(f"{where}: the token of user '{user}' has scopes [{', '.join(sorted(scopes))}], "
                             f"not '{CONTROL_SCOPE}'; {TOKEN_HELP}")
    return discovery, (f"{where} serves {len(discovery.gpus)} GPU(s) with '{CONTROL_SCOPE}' enabled; the token of "
                       f"user '{user}' ({ENV_TOKEN}) has scope '{CONTROL_SCOPE}'")


def _same_bus(listed: str, ours: str) -> bool:
    try:
        return normalise_pci_bus_id(listed) == ours
    except ValueError:
        logger.debug("zeusd listed an unreadable PCI address %r", listed)
        return False
