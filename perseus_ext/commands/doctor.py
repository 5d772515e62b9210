"""`perseus-ext doctor`: what this environment gives perseus-ext, and how to fix what is missing.

Read-only (clocks and power limits are never changed), so it is safe on a shared node. It
reports the installation (autoload hook, framework versions), every GPU NVML sees and which of
them each CUDA device of this process maps to, which path can set clocks here (root, zeusd or
none) and why (and how to grant it), one GPU's measured behaviour (energy counter update period,
the cost of the per-computation clock hook, which power readings it answers: whether a power
swing can be measured on it), and what is known about NVML clock calls and NCCL. Exit code 0:
everything needed for the chosen GPU works; 1: every problem is listed at the end (among them
each fault of a clock control path it tried: a configured zeusd that does not answer or refuses,
whatever the GPU; no path at all for a real GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import site
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from perseus_ext.commands.arguments import add_output_argument, bounded_int, check_writable_file

PACKAGES = ("torch", "deepspeed", "megatron-core", "nvidia-ml-py", "matplotlib", "lowtime")
AUTOLOAD_PTH = "perseus_ext_autoload.pth"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="report GPUs, NVML mapping, permissions and framework versions",
        description="Check the environment perseus-ext runs in (read-only): installation, "
        "framework versions, GPUs and their NVML mapping, which path can set clocks (root, zeusd or "
        "none) and why, and one "
        "GPU's energy counter update period and clock-hook cost.",
    )
    parser.add_argument("--gpu", default=None,
                        help="GPU to measure: 'nvml', 'zeusd' or 'sim:<preset>' (default: $PERSEUS_GPU or nvml)")
    parser.add_argument("--local-rank", type=bounded_int(0, 1023), default=0,
                        help="CUDA device of this process to measure (default: %(default)s)")
    parser.add_argument("--updates", type=bounded_int(2, 1000), default=10,
                        help="energy counter changes to watch for its update period (default: %(default)s)")
    add_output_argument(parser, help="also write the report as JSON to PATH", old=("--json",))
    parser.set_defaults(func=run)


def installation() -> dict[str, Any]:
    """Where perseus-ext is installed, whether its autoload hook is, and framework versions."""
    from importlib import metadata  # here: every command's start-up imports this module

    import perseus_ext
    from perseus_ext.autoload import AUTOLOAD_ENV, autoload_enabled
    from perseus_ext.data import patches_dir

    site_dirs = [*site.getsitepackages(), site.getusersitepackages()]
    hooks = [str(Path(d) / AUTOLOAD_PTH) for d in site_dirs if (Path(d) / AUTOLOAD_PTH).is_file()]
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "perseus_ext": perseus_ext.__version__,
        "location": str(Path(perseus_ext.__file__).parent),
        "python": sys.version.split()[0],
        "autoload_pth": hooks,
        "autoload": f"{AUTOLOAD_ENV}={os.environ.get(AUTOLOAD_ENV, '1')}: "
        + ("DeepSpeed is hooked on import" if autoload_enabled() else
           "DeepSpeed is not hooked; call perseus_ext.adapters.deepspeed.install()"),
        "packages": versions,
        "megatron_lm_patches": str(patches_dir() / "megatron-lm"),
    }


def nvml_devices() -> dict[str, Any]:
    """Every GPU NVML sees, and the NVML device each CUDA device of this process maps to."""
    from perseus_ext.errors import PerseusError
    from perseus_ext.measurement.gpu import nvml as nvml_backend

    try:
        nvml = nvml_backend._load_pynvml()
        nvml_backend._init(nvml)
    except PerseusError as err:
        return {"available": False, "reason": str(err)}
    try:
        devices = []
        index_of = {}
        for handle, uuid, bus_id, name in nvml_backend._all_devices(nvml):
            index = nvml.nvmlDeviceGetIndex(handle)
            index_of[uuid] = index
            devices.append({"nvml_index": index, "name": name, "uuid": uuid, "pci_bus_id": bus_id})
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        cuda_count = len(devices) if visible is None else len(nvml_backend._visible_entries(visible))
        mapping = []
        for ordinal in range(cuda_count):
            try:
                handle = nvml_backend.resolve_cuda_device(nvml, ordinal)
                uuid = nvml_backend._text(nvml.nvmlDeviceGetUUID(handle))
                mapping.append({"cuda": ordinal, "nvml_index": index_of.get(uuid), "uuid": uuid})
            except PerseusError as err:
                mapping.append({"cuda": ordinal, "error": str(err)})
        return {
            "available": True,
            "driver": nvml_backend._text(nvml.nvmlSystemGetDriverVersion()),
            "devices": devices,
            "cuda_visible_devices": visible,
            "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
            "cuda_to_nvml": mapping,
        }
    except nvml.NVMLError as err:
        return {"available": False, "reason": f"NVML could not list GPUs ({err})"}
    finally:
        nvml.nvmlShutdown()


def _zeusd_path() -> tuple[str | None, str | None]:
    """(why zeusd lets this process set clocks, None) or (None, the fault it showed); (None, None)
    when no zeusd is configured. The daemon is asked whatever the GPU backend (a simulated GPU,
    no NVML): a configured daemon that does not answer is a fault either way."""
    from perseus_ext.errors import PerseusError
    from perseus_ext.measurement.gpu.zeusd import check_control
    from perseus_ext.measurement.gpu.zeusd_client import ENV_TOKEN, ZeusdClient, ZeusdEndpoint

    try:
        endpoint = ZeusdEndpoint.from_env()
    except PerseusError as err:
        return None, str(err)
    if endpoint is None:
        return None, None
    client = ZeusdClient(endpoint, os.environ.get(ENV_TOKEN))
    try:
        _, why = check_control(client)
    except PerseusError as err:
        return None, str(err)
    finally:
        client.close()
    return why, None


def permissions(nvml: dict[str, Any]) -> dict[str, Any]:
    """Whether this process may set clocks (None, not "yes", where NVML sees no GPU: root may set
    nothing on a machine without one), and which path can set them here: `root` (CAP_SYS_ADMIN:
    NVML sets them), `zeusd` (a daemon at ZEUSD_SOCK_PATH / ZEUSD_HOST_PORT lets this process, with
    ZEUSD_TOKEN, change them) or `none`, and why; `faults` lists what every path tried showed
    wrong (a configured zeusd that refuses or does not answer). No GPU is touched."""
    from perseus_ext.measurement.gpu.common import PERMISSION_HELP
    from perseus_ext.measurement.gpu.nvml import has_clock_privilege
    from perseus_ext.measurement.gpu.zeusd_client import ENV_HOST_PORT, ENV_SOCK_PATH

    zeusd_why, zeusd_fault = _zeusd_path()
    faults = [f"zeusd: {zeusd_fault}"] if zeusd_fault else []
    if not nvml["available"]:
        report: dict[str, Any] = {"can_set_clocks": None, "how_to_grant": None}
        if zeusd_why is not None:
            return {**report, "path": "zeusd", "why": zeusd_why, "faults": faults}
        return {**report, "path": "none", "why": "NVML sees no GPU here", "faults": faults}
    allowed = has_clock_privilege()
    report = {"can_set_clocks": allowed, "how_to_grant": None if allowed else PERMISSION_HELP, "faults": faults}
    if allowed:
        return {**report, "path": "root", "why": "this process holds CAP_SYS_ADMIN: NVML sets clocks directly"}
    if zeusd_why is not None:
        return {**report, "path": "zeusd", "why": zeusd_why}
    if zeusd_fault is not None:
        return {**report, "path": "none", "why": zeusd_fault}
    return {**report, "path": "none", "why": f"no CAP_SYS_ADMIN, and neither {ENV_SOCK_PATH} nor "
                                             f"{ENV_HOST_PORT} is set (no zeusd to ask)"}


def _sets_real_clocks(spec: str | None) -> bool:
    """Whether the GPU doctor was asked about is a real one (nvml or zeusd, the default), whose
    clocks a job would want to set; a simulated GPU needs no control path."""
    from perseus_ext.config.gpu import ENV_GPU, SimSpec, parse_gpu_spec
    from perseus_ext.errors import PerseusError

    text = spec if spec is not None else os.environ.get(ENV_GPU) or "nvml"
    try:
        return not isinstance(parse_gpu_spec(text), SimSpec)
    except PerseusError:
        return True  # open_gpu reports the bad spec itself; the control path is judged as for nvml


def hook_cost_us(gpu: Any, calls: int = 20000) -> dict[str, float]:
    """Median/p99 cost of the controller's set_clock() on the training thread (dry-run: the
    GPU is not touched)."""
    from perseus_ext.actuation.controller import FrequencyController

    clocks = gpu.supported_sm_clocks()[:8]
    controller = FrequencyController(gpu, dry_run=True, watchdog=False, handle_signals=False)
    costs = []
    try:
        for index in range(calls):
            start = time.perf_counter_ns()
            controller.set_clock(clocks[index % len(clocks)])
            costs.append(time.perf_counter_ns() - start)
    finally:
        controller.close()
    costs.sort()
    return {"median_us": costs[len(costs) // 2] / 1000, "p99_us": costs[int(0.99 * len(costs))] / 1000}


POWER_FIELDS = (("instant", "NVML_FI_DEV_POWER_INSTANT"), ("average", "NVML_FI_DEV_POWER_AVERAGE"))


def power_readings(gpu: Any) -> dict[str, Any]:
    """Which power readings this GPU answers (one read each, read-only) and whether a power
    swing within an iteration can be measured from them (docs/monitoring.md)."""
    from perseus_ext.measurement.gpu.timeline import OwnTimeline

    if isinstance(gpu, OwnTimeline):  # the simulated device knows its power exactly
        return {"swing_measured": True, "source": "simulated device: exact mean power per 1 ms of device time"}
    readings: dict[str, Any] = {"swing_measured": False, "power_usage": "nvmlDeviceGetPowerUsage: averaged over "
                                "1 s on H100, H200 and Ampere other than A100 (NVML's documentation), of unknown "
                                "rate elsewhere: no swing within an iteration is claimed from it"}
    nvml = sys.modules.get("pynvml")
    try:
        handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
    except Exception as err:  # noqa: BLE001 - no NVML handle (zeusd, no pynvml): nothing more to read
        readings["fields"] = f"not read: {err!r}"
        return readings
    for name, constant in POWER_FIELDS:
        field_id = getattr(nvml, constant, None)
        if field_id is None:
            readings[name] = f"{constant}: not in this nvidia-ml-py (older NVML)"
            continue
        try:
            (value,) = nvml.nvmlDeviceGetFieldValues(handle, [field_id])
            readings[name] = (f"{constant}: answers, {value.value.uiVal / 1000:.1f} W now" if value.nvmlReturn == 0
                              else f"{constant}: not supported by this driver (NVML return {value.nvmlReturn})")
        except Exception as err:  # noqa: BLE001 - an older driver: the field is a finding, not a failure
            readings[name] = f"{constant}: not read ({err!r})"
    return readings


# What is known about NVML clock calls and NCCL, printed by doctor and kept in its JSON.
NVML_NCCL_NOTES = (
    "clock changes are NVML calls (nvmlDeviceSetGpuLockedClocks) made by perseus-ext's own worker thread "
    "while the training thread and NCCL's collectives run; the training thread only queues a request "
    "(the clock hook above), and each call's duration is in the run summary (clock_coverage.set_call_ms)",
    "a user's report on NVIDIA's NCCL tracker: changing locked clocks about every 50 ms (20 a second) "
    "delayed NCCL collectives badly, a fixed clock did not; perseus-ext's planner keeps each GPU to at most "
    "perseus.solver.max_clock_changes_per_s changes a second (default 5) and perseus.solver.min_clock_hold_s "
    "(docs/solver.md), and never drops a planned change at run time",
    "power swing: the run summary, perseus-ext report and Prometheus give it where the device has fine power "
    "samples (simulated GPUs); on a real GPU NVML's default reading is averaged (H100, H200) or of unknown "
    "rate, so none is claimed there; "
    "benchmarks/gpu_check.py's power_fields section records which readings a GPU offers and how often they "
    "change (docs/monitoring.md, docs/power.md)",
)


def measure_gpu(spec: str | None, local_rank: int, updates: int) -> dict[str, Any]:
    from perseus_ext.errors import PerseusError
    from perseus_ext.measurement.gpu import open_gpu
    from perseus_ext.measurement.probe import cuda_event_timing, probe_gpu

    try:
        gpu = open_gpu(spec, local_rank=local_rank)
    except PerseusError as err:
        return {"available": False, "reason": str(err)}
    try:
        return {"available": True, **probe_gpu(gpu, updates), "set_clock_hook": hook_cost_us(gpu),
                "cuda_events": cuda_event_timing(), "power_readings": power_readings(gpu)}
    except PerseusError as err:
        return {"available": False, "gpu": gpu.name, "reason": str(err)}
    finally:
        gpu.close()


def _print_report(report: dict[str, Any]) -> list[str]:
    """Print the report for a person; return the problems found."""
    problems = []
    inst = report["installation"]
    print(f"perseus-ext {inst['perseus_ext']} at {inst['location']} (Python {inst['python']})")
    print(f"  autoload hook: {', '.join(inst['autoload_pth']) or 'not installed (.pth missing)'}")
    print(f"  {inst['autoload']}")
    print("  " + ", ".join(f"{name} {version or '-'}" for name, version in inst["packages"].items()))
    print(f"  Megatron-LM patches: {inst['megatron_lm_patches']}")
    nvml = report["nvml"]
    if nvml["available"]:
        print(f"NVML: driver {nvml['driver']}, {len(nvml['devices'])} GPU(s); "
              f"CUDA_VISIBLE_DEVICES={nvml['cuda_visible_devices']}")
        for device in nvml["devices"]:
            print(f"  nvml {device['nvml_index']}: {device['name']} {device['uuid']} {device['pci_bus_id']}")
        for entry in nvml["cuda_to_nvml"]:
            target = entry.get("error") or f"nvml {entry['nvml_index']} ({entry['uuid']})"
            print(f"  cuda {entry['cuda']} -> {target}")
    else:
        print(f"NVML: unavailable: {nvml['reason']}")
    perms = report["permissions"]
    allowed = perms["can_set_clocks"]
    print(f"permission to set clocks: {'no GPU to set' if allowed is None else 'yes' if allowed else 'no'}")
    if perms["how_to_grant"] and perms["path"] != "zeusd":
        print(f"  {perms['how_to_grant']}, or have the operator run zeusd and set ZEUSD_SOCK_PATH")
    print(f"clock control path: {perms['path']}: {perms['why']}"
          + ("; perseus-ext runs in dry-run mode" if perms["path"] == "none" else ""))
    problems += [f"clock control path: {fault}" for fault in perms["faults"]]
    if perms["path"] == "none" and allowed is False and not perms["faults"] and report["real_gpu"]:
        problems.append(f"no path can set clocks on this GPU: {perms['why']} (jobs run in dry-run mode; "
                        f"{perms['how_to_grant']})")
    gpu = report["gpu"]
    if gpu["available"]:
        counter, hook = gpu["energy_counter"], gpu["set_clock_hook"]
        low, high = gpu["supported_sm_clocks"][-1], gpu["supported_sm_clocks"][0]
        print(f"GPU measured: {gpu['gpu']}, SM clocks {low}-{high} MHz, power {gpu['power_w']:.1f} W, "
              f"limit {gpu['power_limit_w']:.0f} W")
        print(f"  energy counter: updates every {counter['update_period_s'] * 1000:.1f} ms "
              f"(p90 {counter['update_period_p90_s'] * 1000:.1f} ms), step {counter['median_step_mj']:.0f} mJ")
        print(f"  clock hook: median {hook['median_us']:.2f} us, p99 {hook['p99_us']:.2f} us per call")
        events = gpu["cuda_events"]
        print("  CUDA events: " + (f"{events['record_cost_us_median']:.1f} us to record" if events["available"]
                                   else events["reason"]))
        power = gpu["power_readings"]
        print("  power swing: " + (f"measured ({power['source']})" if power["swing_measured"] else
                                   "not measured here; " + power["power_usage"]))
        for name, _ in POWER_FIELDS:
            if name in power:
                print(f"    {power[name]}")
    else:
        problems.append(f"no GPU to measure: {gpu['reason']}")
    print("known about NVML calls and NCCL:")
    for note in report["notes"]:
        print("\n".join(textwrap.wrap(note, 100, initial_indent="  - ", subsequent_indent="    ")))
    return problems


def run(args: argparse.Namespace) -> int:
    if args.output:
        check_writable_file(args.output, "--output")
    nvml = nvml_devices()
    report = {
        "installation": installation(),
        "nvml": nvml,
        "permissions": permissions(nvml),
        "gpu": measure_gpu(args.gpu, args.local_rank, args.updates),
        "real_gpu": _sets_real_clocks(args.gpu),
        "notes": list(NVML_NCCL_NOTES),
    }
    problems = _print_report(report)
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.output}")
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if problems else 0
