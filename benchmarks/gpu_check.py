"""The real-GPU check: what only hardware can show about perseus-ext's actuation path, read-only.

    python benchmarks/gpu_check.py --json gpu_check.json        # on one H100/H200, ~3 minutes
    python benchmarks/gpu_check.py --cpu --json /tmp/check.json # fakes, in the test suite

It NEVER changes clocks, power limits or any other GPU setting: before anything else runs, every
pynvml write (nvmlDeviceSet*, nvmlDeviceReset*, nvmlDeviceClear*, ...) is replaced with a function
that raises (`gpu_check_support.install_nvml_guard`), and perseus-ext runs in dry-run. Each section
runs in its own try/except with its own time budget, and the JSON is rewritten after each one, so
a crash or a timeout still leaves the figures measured before it. Sections:

* nvml_reads      latency of the NVML reads perseus-ext makes (energy counter, power, SM clock);
* energy_counter  the energy counter's update period and step;
* event_timing    CUDA-event elapsed-time precision: the smallest step it reports, its float32
                  quantisation far from the reference, and the device clock's rate against the host's;
* actuation       real transformer blocks, forward and a real backward (weight gradients too), with
                  the runtime's sequencer and a dry-run controller: the hook alone on the training
                  thread (event record + queued request; median, p99), how far the host leads the
                  device, the worker's notice delay, and the estimated clock coverage of a plan
                  alternating two clocks;
* end_to_end      perseus-ext's runtime end to end in dry-run: two pipeline stages' computations
                  (1F1B, 4 microbatches) in one process, a saved profile, the solve, deployed
                  iterations, and the coverage the runtime estimates;
* waiting_power   what the GPU draws while it waits (a CUDA context and nothing queued; spin
                  kernels, as NCCL's wait for a peer) and while it computes, at the driver's clocks;
* power_fields    (gpu_power_fields.py) which NVML power readings the GPU answers (power usage, the
                  instantaneous and averaged field values, the driver's sample buffer, the energy
                  counter) and how often each changes, polled for ~2 s: what a power swing can be
                  measured from on this GPU;
* cuda_graphs     (gpu_graphs.py) per-layer graphs with the hooks and markers around each graphed
                  block, against the same blocks eagerly; a full-iteration graph with external
                  CUDA events captured at every computation boundary (re-recorded at each replay?
                  can another stream and perseus-ext's observer wait on them?); the capture probe,
                  and whether polling events from a thread breaks a capture.

Needs torch with CUDA, nvidia-ml-py, and perseus-ext's own dependencies (wheels:
benchmarks/gpu_wheels.sh). The whole run stops itself after --budget-s seconds.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import platform
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from gpu_actuation import measure_actuation  # noqa: E402
from gpu_graphs import section_cuda_graphs  # noqa: E402
from gpu_power_fields import section_power_fields  # noqa: E402
from gpu_check_support import (  # noqa: E402
    Budget,
    GuardError,
    Machine,
    Report,
    build_blocks,
    guard_drill,
    install_fake_nvml,
    install_nvml_guard,
    print_table,
    run_section,
    stats,
)

logger = logging.getLogger("gpu_check")


# ----------------------------------------------------------------------------- sections
def section_environment(machine: Machine, gpu: Any, nvml: Any) -> dict[str, Any]:
    torch = machine.torch
    figures: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda_runtime": getattr(torch.version, "cuda", None), "mode": "cpu (fakes)" if machine.cpu else "gpu",
        "gpu": gpu.name, "uuid": gpu.uuid,
    }
    try:
        version = nvml.nvmlSystemGetDriverVersion()
        figures["driver"] = version.decode() if isinstance(version, bytes) else version
    except Exception as err:  # noqa: BLE001 - informative only
        figures["driver"] = f"unknown ({err!r})"
    if not machine.cpu:
        figures["cuda_device"] = torch.cuda.get_device_name()
    clocks = gpu.supported_sm_clocks()
    figures.update(supported_sm_clocks_mhz=[clocks[0], clocks[-1]], supported_sm_clock_count=len(clocks),
                   sm_clock_mhz=gpu.sm_clock(), power_w=gpu.power_w(), power_limit_w=gpu.power_limit_w(),
                   can_set_clocks=gpu.can_set_clocks())
    return figures


def section_nvml_reads(gpu: Any, deadline: float, samples: int) -> dict[str, Any]:
    reads = {"energy_mj": gpu.energy_mj, "power_w": gpu.power_w, "sm_clock": gpu.sm_clock}
    figures = {}
    for name, read in reads.items():
        costs = []
        for _ in range(samples):
            if time.perf_counter() > deadline:
                break
            began = time.perf_counter_ns()
            read()
            costs.append((time.perf_counter_ns() - began) / 1000.0)
        figures[f"{name}_read_us"] = stats(costs)
    return figures


def section_energy_counter(gpu: Any, deadline: float, updates: int) -> dict[str, Any]:
    """Counter changes watched by polling every 0.5 ms (as `calibrate_counter` does), bounded."""
    import numpy as np

    change_times, steps = [], []
    previous = gpu.energy_mj()
    while len(change_times) < updates + 1 and time.perf_counter() < deadline:
        time.sleep(0.0005)
        value = gpu.energy_mj()
        if value != previous:
            change_times.append(time.perf_counter())
            steps.append(value - previous)
            previous = value
    periods_ms = [1000.0 * p for p in np.diff(change_times)]
    return {"update_period_ms": stats(periods_ms), "step_mj": stats([float(s) for s in steps[1:]]),
            "updates_seen": max(0, len(change_times) - 1)}


def section_event_timing(machine: Machine, deadline: float) -> dict[str, Any]:
    """Smallest elapsed-time step, float32 quantisation far from a reference, device/host rate."""
    import numpy as np

    cuda = machine.cuda
    empty_ms = []
    while len(empty_ms) < 500 and time.perf_counter() < deadline:
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        start.record()
        end.record()
        end.synchronize()
        empty_ms.append(start.elapsed_time(end))
    distinct = np.unique(np.asarray(empty_ms, dtype=np.float64))
    steps = np.diff(distinct)
    figures: dict[str, Any] = {
        "empty_interval_us": stats([1000.0 * v for v in empty_ms]),
        "smallest_step_us": round(1000.0 * float(steps[steps > 0].min()), 4) if (steps > 0).any() else None,
        # elapsed_time is a float32 of milliseconds: its resolution at a distance from the reference
        "float32_quantum_ms_after_1_day": float(np.spacing(np.float32(86_400_000.0))),
        "float32_quantum_ms_after_7_days": float(np.spacing(np.float32(7 * 86_400_000.0))),
    }
    # Device clock rate vs the host's perf_counter: two synchronised events ~1.5 s apart.
    span_s = min(1.5, max(0.0, (deadline - time.perf_counter()) / 2 - 0.1))
    if span_s > 0.2:
        first, last = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        first.record()
        first.synchronize()
        host_first = time.perf_counter()
        time.sleep(span_s)
        last.record()
        last.synchronize()
        host_last = time.perf_counter()
        device_s = first.elapsed_time(last) / 1000.0
        host_s = host_last - host_first
        figures.update(rate_window_s=round(host_s, 3),
                       device_minus_host_ppm=round(1e6 * (device_s - host_s) / host_s, 1),
                       note_rate="includes the two synchronisations' jitter (~10 us each: ~15 ppm at 1.5 s)")
    return figures


def section_waiting_power(machine: Machine, gpu: Any, deadline: float) -> dict[str, Any]:
    """What a GPU draws while it waits, at the clocks the driver picks (read-only): with a CUDA
    context and nothing queued; inside back-to-back spin kernels (`torch.cuda._sleep`), which
    wait the way NCCL's kernels wait for a peer at a gradient sync; and, for scale, bf16
    matmuls. The solver charges a GPU that finishes early this blocking power. Each phase
    keeps ~50 ms chunks of work queued, first for `settle_s` unmeasured (the driver's power
    reading averages over about a second: runs 5-7 saw the previous section's ~690 W in the
    first idle samples), then samples power and SM clock every 50 ms and takes the mean power
    from the energy counter over the phase (~100 ms updates: good to a few %)."""
    torch = machine.torch
    phase_s, settle_s = (0.3, 0.0) if machine.cpu else (2.5, 1.0)
    matrix = None if machine.cpu else torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def chunk(kind: str) -> None:  # ~50 ms of device work
        if machine.cpu or kind == "idle_with_context":
            return
        if kind == "spin_wait":
            torch.cuda._sleep(100_000_000)  # cycles: ~50 ms at ~2 GHz
        else:
            for _ in range(40):  # ~1.2 ms per 8192^3 bf16 matmul on an H100
                torch.mm(matrix, matrix)

    figures: dict[str, Any] = {}
    for kind in ("idle_with_context", "spin_wait", "compute"):
        if time.perf_counter() + settle_s + phase_s + 1.0 > deadline:
            figures[kind] = {"skipped": "out of time"}
            continue
        try:
            figures[kind] = _waiting_phase(machine, gpu, kind, chunk, phase_s, settle_s)
        except Exception as err:  # a phase that fails (torch.cuda._sleep is private) keeps the others
            figures[kind] = {"error": repr(err)[:300]}
    return figures


def _waiting_phase(
    machine: Machine, gpu: Any, kind: str, chunk: Any, phase_s: float, settle_s: float = 0.0
) -> dict[str, Any]:
    """One phase of `section_waiting_power`: `chunk(kind)` queues ~50 ms of device work; the
    work runs `settle_s` before anything is measured."""
    machine.synchronize()
    queued: list[Any] = []

    def keep_queued() -> None:  # the device never runs dry, the host stays ~3 chunks ahead
        nonlocal queued
        queued = [event for event in queued if not event.query()]
        while len(queued) < 3:
            chunk(kind)
            queued.append(machine.cuda.Event())
            queued[-1].record()
        time.sleep(0.05)

    settled = time.perf_counter() + settle_s
    while time.perf_counter() < settled:
        keep_queued()
    energy_start, started = gpu.energy_mj(), time.perf_counter()
    powers, clocks = [], []
    while time.perf_counter() - started < phase_s:
        keep_queued()
        powers.append(gpu.power_w())
        clocks.append(float(gpu.sm_clock()))
    machine.synchronize()
    elapsed = time.perf_counter() - started
    return {"power_w": stats(powers), "sm_clock_mhz": stats(clocks), "seconds": round(elapsed, 3),
            "mean_power_w_from_counter": round((gpu.energy_mj() - energy_start) / 1000.0 / elapsed, 1)}


def _modelled_profile(path: str, gpu: Any, stage_times: list[tuple[float, float]]) -> float:
    """A saved profile for the runtime (dry-run cannot profile: clocks never change). Times at
    the max clock are the ones measured on this device; other clocks are modelled (70 % of the
    time scales with 1/f) and so is power (static + dynamic ~ f^2.5). Returns the blocking power."""
    from perseus_ext.planning.profile import Profile

    clocks = gpu.supported_sm_clocks()
    top = clocks[0]
    limit_w = gpu.power_limit_w() or 700.0
    busy_w, static_w = 0.8 * limit_w, 0.25 * limit_w
    rows = []
    for stage, (forward_s, backward_s) in enumerate(stage_times):
        for kind, seconds in (("forward", forward_s), ("backward", backward_s)):
            for clock in clocks[: max(2, len(clocks) * 2 // 3)][::6]:
                ratio = clock / top
                time_s = seconds * (0.3 + 0.7 / ratio)
                power_w = static_w + (busy_w - static_w) * ratio ** 2.5
                rows.append({"stage": stage, "instruction": kind, "frequency": clock,
                             "time": time_s, "energy": power_w * time_s})
    Profile.from_rows(rows).save(path)
    return 0.15 * limit_w


def _pipeline_order(schedule: Any) -> list[tuple[int, Any]]:
    """One device-serial order of both stages' computations that respects the pipeline's
    dependencies (F(s, m) after F(s-1, m); B(s, m) after B(s+1, m))."""
    from perseus_ext.planning.schedule import Kind

    orders = [list(order) for order in schedule.orders]
    done: set[tuple[int, int, Kind]] = set()
    position = [0] * len(orders)
    result = []
    last = len(orders) - 1
    while any(position[s] < len(orders[s]) for s in range(len(orders))):
        progressed = False
        for stage, order in enumerate(orders):
            while position[stage] < len(order):
                computation = order[position[stage]]
                m, kind = computation.microbatch, computation.kind
                ready = ((kind is Kind.FORWARD and (stage == 0 or (stage - 1, m, kind) in done))
                         or (kind is Kind.BACKWARD and (stage == last or (stage + 1, m, kind) in done)))
                if not ready:
                    break
                result.append((stage, computation))
                done.add((stage, m, kind))
                position[stage] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule's orders deadlock")
    return result


def section_end_to_end(machine: Machine, gpu: Any, args: argparse.Namespace, deadline: float,
                       workdir: str) -> dict[str, Any]:
    torch = machine.torch
    from perseus_ext.planning.schedule import Kind, build_schedule
    from perseus_ext.runtime import PerseusConfig, PerseusRuntime

    stages, microbatches = 2, 4
    schedule = build_schedule("1f1b", stages, microbatches)
    # Stage 1 heavier (3:1): stage 0 then has slack the planner fills with lower clocks.
    light = max(1, args.layers // 4)
    models = [build_blocks(machine, light, args.hidden), build_blocks(machine, max(1, args.layers - light), args.hidden)]
    # Twice the actuation section's batch: computations of several ms, as pipeline stages run.
    batches = [torch.randn(2 * args.batch, args.sequence, args.hidden, device=machine.device, dtype=machine.dtype)
               for _ in range(microbatches)]

    def run_iteration(runtimes: list[Any] | None) -> None:
        inputs: dict[tuple[int, int], Any] = {}
        outputs: dict[tuple[int, int], Any] = {}
        grads: dict[tuple[int, int], Any] = {}
        active = [runtime for runtime in runtimes or () if runtime is not None]
        for runtime in active:
            runtime.iteration_start()
        for stage, computation in order:
            runtime = runtimes[stage] if runtimes else None
            m = computation.microbatch
            if runtime is not None:
                runtime.before_computation(computation.kind, m)
            if computation.kind is Kind.FORWARD:
                source = batches[m] if stage == 0 else outputs[(stage - 1, m)]
                x = source.detach().requires_grad_(True)
                out = x
                for block in models[stage]:
                    out = block(out)
                inputs[(stage, m)], outputs[(stage, m)] = x, out
            else:
                grad = grads.get((stage + 1, m))
                grad = torch.ones_like(outputs[(stage, m)]) if grad is None else grad
                params = [p for p in models[stage].parameters()]
                torch.autograd.backward(outputs[(stage, m)], grad, inputs=[inputs[(stage, m)], *params])
                grads[(stage, m)] = inputs[(stage, m)].grad
            if runtime is not None:
                runtime.after_computation(computation.kind, m)
        for runtime in active:
            runtime.mark_compute_end()
        for model in models:  # the optimizer step, at the default clock
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-1e-6)
                        p.grad = None
        for runtime in active:
            runtime.iteration_end()

    order = _pipeline_order(schedule)
    # Each stage's forward and backward time at the default clock, measured with events.
    run_iteration(None)
    machine.synchronize()
    stage_times = []
    for stage in range(stages):
        x = batches[0].detach().requires_grad_(True)
        start, middle, end = (machine.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        out = x
        for block in models[stage]:
            out = block(out)
        middle.record()
        torch.autograd.backward(out, torch.ones_like(out), inputs=[x, *models[stage].parameters()])
        end.record()
        end.synchronize()
        stage_times.append((max(1e-4, start.elapsed_time(middle) / 1000.0), max(1e-4, middle.elapsed_time(end) / 1000.0)))
        for p in models[stage].parameters():
            p.grad = None
    profile_path = os.path.join(workdir, "profile.csv")
    blocking_w = _modelled_profile(profile_path, gpu, stage_times)
    config = PerseusConfig.from_dict({
        "enabled": True, "dry_run": True, "warmup_iterations": 1, "profile_path": profile_path,
        "blocking_power_w": blocking_w, "solve_in_background": False, "baseline_fraction": 0,
        "straggler_check_interval": 1000, "log_interval": 0,
    })
    # Stage 0's runtime is the pipeline's leader: it solves the two-stage frontier and deploys its
    # own clocks. A stage-1 runtime needs its leader across a process group (a second process);
    # here stage 1's computations run on the same device between stage 0's, as its receives.
    runtimes = [PerseusRuntime(config, schedule=schedule, stage=0, gpu=gpu), None]
    iterations = 0
    phases = []
    try:
        while iterations < args.e2e_iterations and time.perf_counter() < deadline:
            run_iteration(runtimes)
            phase = runtimes[0].phase.value
            if phases and phases[-1][0] == phase:
                phases[-1][1] += 1
            else:
                phases.append([phase, 1])
            iterations += 1
        machine.synchronize()
        summaries = []
        runtimes[0].controller.flush(10)
    finally:
        runtimes[0].close()
    for stage, runtime in enumerate(runtimes[:1]):
        summary = runtime.summary()
        coverage = summary.get("clock_coverage", {})
        deployed = [r for r in runtime.recorder.history if r.setting.plan is not None]
        summaries.append({
            "stage": stage, "final_phase": summary.get("final_phase"),
            "dry_run": runtime.controller.dry_run, "dry_run_changes": runtime.controller.dry_run_count,
            "deployed_iterations": len(deployed),
            "estimated_coverage": coverage.get("estimated"),
            "first_clocks_issued_mhz": list(runtime.controller.dry_run_log[:12]),
            "iteration_s": stats([r.time_s for r in deployed if getattr(r, "time_s", None) is not None], 5),
        })
    return {
        "schedule": "1f1b, 2 stages (1:3 blocks) x 4 microbatches, both stages' computations in this one process; "
                    "stage 0 runs perseus-ext's runtime (stage 1's computations are its waits)",
        "stage_times_ms_at_default_clock": [[round(1000 * f, 3), round(1000 * b, 3)] for f, b in stage_times],
        "profile": "times at the max clock measured here; other clocks modelled (dry-run cannot profile)",
        "iterations": iterations, "phases": ", ".join(f"{phase} x{count}" for phase, count in phases),
        "stages": summaries,
    }


# ----------------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> int:
    from perseus_ext.commands.arguments import bounded_float, bounded_int  # the CLI's flag types
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--output", "--json", dest="json", help="write the figures here (rewritten after every section)")
    parser.add_argument("--cpu", action="store_true", help="fakes instead of a GPU (the test suite runs this)")
    parser.add_argument("--budget-s", type=bounded_float(0.0, 1e9, inclusive_min=False), default=210.0, help="the whole run's time budget")
    parser.add_argument("--layers", type=bounded_int(1, 10**9), default=None)
    parser.add_argument("--hidden", type=bounded_int(1, 10**9), default=None)
    parser.add_argument("--sequence", type=bounded_int(1, 10**9), default=None)
    parser.add_argument("--batch", type=bounded_int(1, 10**9), default=None)
    parser.add_argument("--iterations", type=bounded_int(1, 10**9), default=40, help="actuation: iterations with the host ahead")
    parser.add_argument("--quiet-iterations", type=bounded_int(0, 10**9), default=10,
                        help="actuation: iterations with the host ahead and no controller threads")
    parser.add_argument("--records-only-iterations", type=bounded_int(0, 10**9), default=10,
                        help="actuation: iterations with the host ahead and plain event records in the hooks' place")
    parser.add_argument("--in-step-iterations", type=bounded_int(0, 10**9), default=10,
                        help="actuation: iterations synchronised at their end (the launch queue never fills)")
    parser.add_argument("--e2e-iterations", type=bounded_int(1, 10**9), default=30)
    parser.add_argument("--graph-iterations", type=bounded_int(1, 10**9), default=12,
                        help="cuda_graphs: hooked iterations per-layer, eager and graphed")
    parser.add_argument("--graph-replays", type=bounded_int(1, 10**9), default=20, help="cuda_graphs: replays of the full-iteration graph")
    args = parser.parse_args(argv)
    defaults = dict(layers=4, hidden=64, sequence=16, batch=2) if args.cpu else \
        dict(layers=4, hidden=4096, sequence=1024, batch=4)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    report = Report(args.json)
    budget = Budget(args.budget_s)
    # A hang must not eat the device's time: dump the stacks and end the process past the budget.
    faulthandler.dump_traceback_later(args.budget_s + 20, exit=False)
    stopper = threading.Timer(args.budget_s + 40, lambda: (report.set("aborted", "over budget"), os._exit(3)))
    stopper.daemon = True
    stopper.start()

    # 1. The guard, before perseus-ext or anything else can touch NVML.
    if args.cpu:
        nvml = install_fake_nvml()
    else:
        import pynvml as nvml
    attempts: list[str] = []
    replaced = install_nvml_guard(nvml, attempts)
    try:
        nvml.nvmlDeviceSetGpuLockedClocks(None, 1, 1)
        guard_blocks = False
    except GuardError:
        guard_blocks = True
    attempts.clear()
    report.set("guard", {"replaced": len(replaced), "blocks_set_gpu_locked_clocks": guard_blocks,
                         "names": replaced})
    if not guard_blocks:
        print("gpu_check: the NVML write guard does not hold; refusing to run", file=sys.stderr)
        return 2

    import torch  # noqa: F401 - after the guard

    machine = Machine(args.cpu)
    if not args.cpu and not torch.cuda.is_available():
        report.set("error", "torch sees no CUDA device")
        print("gpu_check: torch sees no CUDA device (use --cpu for the fake run)", file=sys.stderr)
        return 2
    if not args.cpu:
        torch.cuda.init()
    from perseus_ext.measurement.gpu import open_gpu

    gpu = open_gpu("nvml")
    if args.cpu:  # the drill: a live controller's clock writes on the fake GPU end at the guard
        report.set("guard_drill", guard_drill(gpu, nvml, attempts))
        attempts.clear()
    run_section(report, "environment", budget, 10, lambda d: section_environment(machine, gpu, nvml))
    run_section(report, "nvml_reads", budget, 10, lambda d: section_nvml_reads(gpu, d, 300))
    run_section(report, "energy_counter", budget, 8, lambda d: section_energy_counter(gpu, d, 30))
    run_section(report, "event_timing", budget, 8, lambda d: section_event_timing(machine, d))
    run_section(report, "actuation", budget, 50, lambda d: measure_actuation(
        machine, gpu, layers=args.layers, hidden=args.hidden, sequence=args.sequence, batch=args.batch,
        iterations=args.iterations, in_step_iterations=args.in_step_iterations,
        quiet_iterations=args.quiet_iterations, records_only_iterations=args.records_only_iterations, deadline=d))
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as workdir:
        run_section(report, "end_to_end", budget, 80,
                    lambda d: section_end_to_end(machine, gpu, args, d, workdir))
    run_section(report, "waiting_power", budget, 12, lambda d: section_waiting_power(machine, gpu, d))
    run_section(report, "power_fields", budget, 5, lambda d: section_power_fields(nvml, gpu.uuid, d))
    # Last: a capture broken on purpose (a thread polling events during a global-mode capture)
    # must not spoil the sections before it.
    run_section(report, "cuda_graphs", budget, 60, lambda d: section_cuda_graphs(machine, gpu, args, d))
    report.set("guard_attempts", list(attempts))  # writes perseus-ext tried (must be empty in dry-run)
    report.set("finished_utc", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    faulthandler.cancel_dump_traceback_later()
    stopper.cancel()
    print_table(report)
    if attempts:
        print(f"gpu_check: NVML writes were attempted and blocked: {attempts}", file=sys.stderr)
        return 1
    failed = [name for name, figures in report.data["sections"].items() if "error" in figures]
    if failed:
        print(f"gpu_check: sections failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
