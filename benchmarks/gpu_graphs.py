"""CUDA graphs and perseus-ext's device markers on a real GPU, read-only, in dry-run.

`gpu_check.py` runs this as its `cuda_graphs` section. It answers, on the hardware:

* per_layer -- each transformer block's forward and backward captured on its own
  (`torch.cuda.make_graphed_callables`, as Megatron's per-layer graphs do), the sequencer's hooks
  and device markers around each graphed call, a dry-run controller: do the markers pair with
  computations (every start and end marker reached, in order, each span as long as the
  computation), and is the estimated clock coverage what it is for the same blocks run eagerly,
  side by side (same plan, same controller)? How far does the host run ahead with graphs?
* full_iteration -- a whole forward+backward captured once into one graph, with
  `torch.cuda.Event(enable_timing=True, external=True)` recorded at every computation boundary
  during the capture, then replayed: are those events recorded again at every replay (still
  pending right after the replay's launch; inside the bracket of two ordinary events recorded
  around that launch; per-replay computation times that match the eager ones)? Can another
  stream wait on one (`cudaStreamWaitEvent`)? Can perseus-ext's observer thread wait on them
  (CudaMarker around the captured event, polled with `query`), with the replays launched back to
  back (host ahead: each replay's launch re-records the events) and with the host in step?
* capture_probe -- `torch.cuda.is_current_stream_capturing()` and perseus-ext's own probe
  (`runtime/capture.py`) inside a capture and outside; and whether a thread polling a CUDA
  event's `query()` during a capture (what perseus-ext's worker and observer do) breaks a capture
  in "thread_local" mode, in CUDA's default "global" mode with the poller's own capture mode set
  as perseus-ext's threads set theirs (`measurement/gpu/capture_mode.py`), and in plain "global"
  mode (a real H200 does). Run last: a broken capture must not spoil the other answers.

`--cpu`: there are no CUDA graphs on a CPU; a stand-in graph (replay runs the captured function
again, events are reached when recorded) drives the same code so that it cannot rot. Its answers
say nothing about CUDA and are marked as such.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from gpu_check_support import Machine, backward_through, build_blocks, stats


# ----------------------------------------------------------------------------- graph kits
class CudaGraphs:
    """torch.cuda's graph API."""

    fake = False
    external_unsupported = False

    def __init__(self, machine: Machine) -> None:
        self.torch = machine.torch
        self.cuda = machine.torch.cuda

    def graphed(self, block: Any, sample: Any) -> Any:
        return self.cuda.make_graphed_callables(block, (sample,))

    def capture(self, body: Callable[[], None], warmup: Callable[[], None], mode: str = "thread_local") -> Any:
        """Warm up on a side stream (lazy initialisation must not be captured), then capture."""
        side = self.cuda.Stream()
        side.wait_stream(self.cuda.current_stream())
        with self.cuda.stream(side):
            for _ in range(3):
                warmup()
        self.cuda.current_stream().wait_stream(side)
        graph = self.cuda.CUDAGraph()
        with self.cuda.graph(graph, capture_error_mode=mode):
            body()
        return graph

    def external_event(self, timing: bool) -> Any:
        try:
            return self.cuda.Event(enable_timing=timing, external=True)
        except TypeError:  # a torch without `external`: the answer is then about internal events
            self.external_unsupported = True
            return self.cuda.Event(enable_timing=timing)

    def capturing(self) -> bool:
        return bool(self.cuda.is_current_stream_capturing())

    def waiter_after(self, event: Any) -> Any:
        """An ordinary event recorded on another stream after that stream waits for `event`."""
        stream = self.cuda.Stream()
        stream.wait_event(event)
        waiter = self.cuda.Event(enable_timing=True)
        waiter.record(stream)
        return waiter


class FakeGraph:
    def __init__(self, body: Callable[[], None]) -> None:
        self.body = body

    def replay(self) -> None:
        self.body()


class FakeGraphs:
    """--cpu: a graph that runs its function again at each replay; nothing is captured."""

    fake = True
    external_unsupported = False

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self._capturing = False

    def graphed(self, block: Any, sample: Any) -> Any:
        return block

    def capture(self, body: Callable[[], None], warmup: Callable[[], None], mode: str = "thread_local") -> Any:
        warmup()
        self._capturing = True
        try:
            body()
        finally:
            self._capturing = False
        return FakeGraph(body)

    def external_event(self, timing: bool) -> Any:
        return self.machine.cuda.Event(enable_timing=timing)

    def capturing(self) -> bool:
        return self._capturing

    def waiter_after(self, event: Any) -> Any:
        waiter = self.machine.cuda.Event(enable_timing=True)
        waiter.record()
        return waiter


# ----------------------------------------------------------------------------- per-layer graphs
def hooked_iterations(machine: Machine, gpu: Any, blocks: Any, forwards: list[Any], data: Any, iterations: int,
                      deadline: float) -> dict[str, Any]:
    """Iterations of forward+backward, one computation per block, between the sequencer's hooks,
    with a dry-run controller and a plan alternating two clocks every two computations."""
    torch = machine.torch
    from perseus_ext.actuation.controller import FrequencyController
    from perseus_ext.actuation.sequencer import ClockSequencer
    from perseus_ext.measurement.coverage import estimate_coverage
    from perseus_ext.measurement.gpu import gpu_switch_latency

    latency = gpu_switch_latency(gpu)
    clocks = gpu.supported_sm_clocks()
    computations = 2 * len(blocks)
    plan = tuple((clocks[0], clocks[len(clocks) // 3])[(k // 2) % 2] for k in range(computations))
    controller = FrequencyController(gpu, dry_run=True, watchdog=False, handle_signals=False)
    sequencer = ClockSequencer(controller, machine.timeline(), latency=latency)
    traces, hook_us, durations = [], [], None

    def hooked(launches: list[float], launch: Callable[[], Any]) -> Any:
        t0 = time.perf_counter_ns()
        sequencer.computation_started()
        t1 = time.perf_counter_ns()
        launches.append(t1 / 1e9)
        result = launch()
        t2 = time.perf_counter_ns()
        sequencer.computation_finished()
        hook_us.append((t1 - t0 + time.perf_counter_ns() - t2) / 1000.0)
        return result

    try:
        for iteration in range(iterations):
            if time.perf_counter() > deadline:
                break
            controller.observe(sequencer.start_iteration(iteration, plan, durations), iteration)
            launches: list[float] = []
            inputs, outputs, current = [], [], data
            for forward in forwards:
                current = current.detach().requires_grad_(True)
                out = hooked(launches, lambda: forward(current))
                inputs.append(current)
                outputs.append(out)
                current = out
            grad = torch.ones_like(outputs[-1])
            for index in reversed(range(len(outputs))):
                grad = hooked(launches, lambda: backward_through(machine, blocks[index], outputs[index],
                                                                 inputs[index], grad))
            for block in blocks:
                block.zero_grad(set_to_none=True)
            traces.append((sequencer.trace, launches))
            if iteration == 1:
                machine.synchronize()
                durations = tuple(end - begin for begin, end, _ in sequencer.trace.device_spans())
        machine.synchronize()
        controller.flush(10)
        changes = [(c.issued_s, c.mhz) for c in controller.drain_changes()]
    finally:
        controller.close()
    paired = in_order = 0
    spans_all, compute_ms, lead_ms = [], [], []
    for trace, launches in traces[2:]:
        spans = trace.device_spans()
        if spans is None or len(spans) != computations:
            continue
        paired += 1
        ends = [end for _, end, _ in spans]
        starts = [begin for begin, _, _ in spans]
        in_order += all(b <= e for b, e, _ in spans) and all(e <= s + 1e-6 for e, s in zip(ends, starts[1:]))
        spans_all.extend(spans)
        compute_ms.extend(1000.0 * (end - begin) for begin, end, _ in spans)
        lead_ms.extend(1000.0 * (begin - launched) for (begin, _, _), launched in zip(spans, launches))
    tally = estimate_coverage(spans_all, changes, latency, None, default_clock_mhz=clocks[0])
    return {"iterations": len(traces), "iterations_counted": max(0, len(traces) - 2),
            "iterations_all_markers_paired": paired, "iterations_markers_in_order": in_order,
            "computation_ms": stats(compute_ms), "host_lead_ms": stats(lead_ms), "hook_us": stats(hook_us),
            "clock_changes": len(changes), "estimated_coverage": tally.coverage}


def per_layer_graphs(machine: Machine, kit: Any, gpu: Any, args: Any, deadline: float) -> dict[str, Any]:
    torch = machine.torch
    blocks = build_blocks(machine, args.layers, args.hidden)
    data = torch.randn(args.batch, args.sequence, args.hidden, device=machine.device, dtype=machine.dtype)
    half = max(time.perf_counter(), (time.perf_counter() + deadline) / 2)
    eager = hooked_iterations(machine, gpu, blocks, list(blocks), data, args.graph_iterations, half)
    began = time.perf_counter()
    graphed = []
    for block in blocks:  # make_graphed_callables patches the module: the eager run came first
        sample = torch.randn(args.batch, args.sequence, args.hidden, device=machine.device, dtype=machine.dtype,
                             requires_grad=True)
        graphed.append(kit.graphed(block, sample))
    capture_s = time.perf_counter() - began
    with_graphs = hooked_iterations(machine, gpu, blocks, graphed, data, args.graph_iterations, deadline)
    return {"eager": eager, "graphed": with_graphs, "capture_s": round(capture_s, 3),
            "coverage_graphed_minus_eager": (None if None in (eager["estimated_coverage"], with_graphs["estimated_coverage"])
                                             else round(with_graphs["estimated_coverage"] - eager["estimated_coverage"], 4))}


# ----------------------------------------------------------------------------- full-iteration graph
def _iteration_body(machine: Machine, blocks: Any, data: Any, record: Callable[[int], None]) -> None:
    """Forward then backward through every block (input and weight gradients), calling
    `record(k)` at each computation boundary (k = 0 before the first, k after computation k)."""
    torch = machine.torch
    record(0)
    inputs, outputs, current = [], [], data
    for block in blocks:
        current = current.detach().requires_grad_(True)
        out = block(current)
        inputs.append(current)
        outputs.append(out)
        current = out
        record(len(outputs))
    grad = torch.ones_like(outputs[-1])
    for index in reversed(range(len(outputs))):
        grad = backward_through(machine, blocks[index], outputs[index], inputs[index], grad)
        record(2 * len(outputs) - index)


def full_iteration_graph(machine: Machine, kit: Any, gpu: Any, args: Any, deadline: float,
                         eager_ms: float | None) -> dict[str, Any]:
    torch = machine.torch
    blocks = build_blocks(machine, args.layers, args.hidden)
    data = torch.randn(args.batch, args.sequence, args.hidden, device=machine.device, dtype=machine.dtype)
    computations = 2 * len(blocks)
    inside: dict[str, Any] = {}
    figures: dict[str, Any] = {"inside_capture": inside, "events": f"{computations + 1} external events, one per "
                               "computation boundary, recorded during capture"}

    def zero() -> None:
        for block in blocks:
            block.zero_grad(set_to_none=True)

    def warmup() -> None:
        _iteration_body(machine, blocks, data, lambda k: None)
        zero()

    graph, events = None, []
    for timing in (True, False):  # timing events first; without timing, the query answers remain
        events = [kit.external_event(timing) for _ in range(computations + 1)]

        def body() -> None:
            inside["torch_is_current_stream_capturing"] = kit.capturing()
            _iteration_body(machine, blocks, data, lambda k: events[k].record())

        began = time.perf_counter()
        zero()
        try:
            graph = kit.capture(body, warmup)
            figures.update(capture_s=round(time.perf_counter() - began, 3), timing_events=timing)
            break
        except Exception as err:  # noqa: BLE001 - the answer, then the fallback
            figures[f"capture_error_timing_{timing}"] = repr(err)[:400]
            machine.synchronize()
    figures["external_kwarg_unsupported"] = kit.external_unsupported
    if graph is None:
        return figures
    timed = figures["timing_events"]
    Event = machine.cuda.Event

    def replay_once() -> tuple[Any, Any, list[bool], Any]:
        """Bracketed replay; whether the first and last captured events are pending right after
        the launch (they are when the launch records them again: the replay takes ms)."""
        before = Event(enable_timing=True)
        before.record()
        graph.replay()
        pending = [not events[0].query(), not events[-1].query()]
        waiter = kit.waiter_after(events[len(blocks)])  # another stream waits for the end of forward
        after = Event(enable_timing=True)
        after.record()
        return before, after, pending, waiter

    # 1. Host in step: pending right after the launch, the host waiting on each event in turn
    # (query polled from this thread), per-replay device times, the replay's bracket, a stream wait.
    replays, pending_first, pending_last, inside_bracket, waits_honoured = 0, 0, 0, 0, 0
    per_replay_ms, computation_ms, waiter_ms, host_span_ms, host_gaps_ms, wait_timeouts = [], [], [], [], [], 0
    elapsed_error = None
    while replays < args.graph_replays and time.perf_counter() < deadline:
        before, after, pending, waiter = replay_once()
        noticed = []
        for event in events:
            limit = time.perf_counter() + 2.0
            while not event.query() and time.perf_counter() < limit:
                time.sleep(0.00005)
            noticed.append(time.perf_counter())
            wait_timeouts += noticed[-1] >= limit
        after.synchronize()
        machine.synchronize()
        replays += 1
        pending_first += pending[0]
        pending_last += pending[1]
        host_span_ms.append(1000.0 * (noticed[-1] - noticed[0]))
        host_gaps_ms.extend(1000.0 * (b - a) for a, b in zip(noticed, noticed[1:]))
        if timed and elapsed_error is None:
            try:
                computation_ms.extend(events[k].elapsed_time(events[k + 1]) for k in range(computations))
                per_replay_ms.append(events[0].elapsed_time(events[-1]))
                inside_bracket += before.elapsed_time(events[0]) >= 0 and events[-1].elapsed_time(after) >= 0
                mid_to_waiter = events[len(blocks)].elapsed_time(waiter)
                waiter_ms.append(mid_to_waiter)
                waits_honoured += mid_to_waiter >= 0 and waiter.elapsed_time(events[-1]) > 0
            except Exception as err:  # noqa: BLE001 - the answer is that it does not work
                elapsed_error = repr(err)[:400]
    figures["in_step"] = {
        "replays": replays, "pending_right_after_launch": {"first_event": pending_first, "last_event": pending_last},
        "host_query_wait_span_ms": stats(host_span_ms), "host_query_wait_gaps_ms": stats(host_gaps_ms),
        "host_query_wait_timeouts": wait_timeouts,
        "inside_own_replay_bracket": inside_bracket, "stream_wait_honoured": waits_honoured,
        "elapsed_time_error": elapsed_error, "replay_ms": stats(per_replay_ms), "computation_ms": stats(computation_ms),
        "stream_waiter_after_forward_end_ms": stats(waiter_ms),
    }
    figures["eager_computation_ms_median"] = eager_ms
    if eager_ms and computation_ms:
        figures["graph_over_eager_computation"] = round(stats(computation_ms)["median"] / eager_ms, 3)
    if timed and elapsed_error is None:
        figures.update(observer_on_captured_markers(machine, gpu, args, deadline, events, replay_once))
    else:
        figures["observer"] = "skipped: the captured events give no elapsed times"
    return figures


def observer_on_captured_markers(machine: Machine, gpu: Any, args: Any, deadline: float, events: list[Any],
                                 replay_once: Callable[[], tuple[Any, Any, list[bool], Any]]) -> dict[str, Any]:
    """perseus-ext's observer (a controller thread polling `query`) waiting on CudaMarkers around
    the captured events, and dry-run clock changes tied to them: with the host in step (flushed
    before the next replay) and with replays back to back (the host ahead: the next launch
    records the events again). The timeline anchors at each replay's opening bracket event, an
    ordinary one: a captured event must never be an anchor (a later replay moves it)."""
    from perseus_ext.actuation.controller import FrequencyController
    from perseus_ext.measurement.gpu.cuda_timeline import CudaMarker

    computations = len(events) - 1
    controller = FrequencyController(gpu, dry_run=True, watchdog=False, handle_signals=False)
    timeline = machine.timeline()
    clocks = gpu.supported_sm_clocks()
    figures: dict[str, Any] = {}

    def wrap(event: Any) -> CudaMarker:
        """A marker around an event already recorded (a captured one: by the replay's launch),
        numbered in the timeline's record order; a fresh one per replay."""
        return CudaMarker(timeline, event, next(timeline._sequence))

    try:
        for mode in ("observer_in_step", "observer_back_to_back"):
            count, flushed = 0, True
            while count < args.graph_replays and time.perf_counter() < deadline:
                before, after, _, _ = replay_once()
                # markers in the order their events were recorded (the timeline's record order)
                opening = wrap(before)
                captured = [wrap(event) for event in events]
                closing = wrap(after)
                timeline.anchor_at(opening)
                controller.observe(opening, None)
                for k, marker in enumerate(captured):
                    controller.observe(marker, (opening, closing))
                    if 0 < k < computations:
                        controller.set_clock(clocks[(k // 2) % 2 * (len(clocks) // 3)], at=marker)
                controller.reset(at=captured[-1])
                controller.observe(closing, None)
                count += 1
                if mode == "observer_in_step":
                    machine.synchronize()
                    if not controller.flush(5):
                        flushed = False
                        break
            machine.synchronize()
            flushed = controller.flush(10) and flushed
            own, notice_ms, seen = 0, [], 0
            for observation in controller.observations():
                if observation.tag is None:
                    continue
                seen += 1
                opening, closing = observation.tag
                notice_ms.append(1000.0 * (observation.noticed_s - observation.device_time_s))
                t0, t1 = opening.device_time_s(), closing.device_time_s()
                if t0 is not None and t1 is not None and t0 - 1e-6 <= observation.device_time_s <= t1 + 1e-6:
                    own += 1
            figures[mode] = {"replays": count, "markers_observed": seen, "flushed": flushed,
                             "observed_in_own_replay": own, "notice_delay_ms": stats(notice_ms),
                             "dry_run_changes_so_far": controller.dry_run_count,
                             "clock_changes_issued": len(controller.drain_changes()),
                             "stale_skipped_so_far": controller.stale_skipped}
    finally:
        controller.close()
    figures["controller_errors"] = controller.error_count
    return figures


# ----------------------------------------------------------------------------- capture probes
def capture_probe(machine: Machine, kit: Any, args: Any, deadline: float) -> dict[str, Any]:
    from perseus_ext.runtime.capture import capture_probe as perseus_probe

    torch = machine.torch
    probe = perseus_probe()
    block = build_blocks(machine, 1, min(args.hidden, 1024))[0]
    data = torch.randn(args.batch, min(args.sequence, 256), min(args.hidden, 1024), device=machine.device,
                       dtype=machine.dtype)
    seen: dict[str, Any] = {"outside": {"torch": kit.capturing(), "perseus_probe": probe()}}

    def body() -> None:
        seen["inside"] = {"torch": kit.capturing(), "perseus_probe": probe()}
        with torch.no_grad():
            block(data)

    def warmup() -> None:
        with torch.no_grad():
            block(data)

    kit.capture(body, warmup)
    seen["after"] = {"torch": kit.capturing(), "perseus_probe": probe()}
    if kit.fake:
        seen["polling_during_capture"] = "not on CPU (no CUDA graphs)"
        return seen
    # A thread polling CUDA events during the capture, as perseus-ext's worker and observer do.
    results = {}
    from perseus_ext.measurement.gpu.capture_mode import ignore_other_threads_captures

    # "global" breaks when another thread queries (run 2); with the poller's own mode set as
    # perseus-ext's threads set theirs, it must hold. Plain global last: it breaks on purpose.
    for name, mode in (("thread_local", "thread_local"), ("global_poller_as_perseus", "global"), ("global", "global")):
        if time.perf_counter() > deadline:
            break
        done = torch.cuda.Event()
        done.record()
        torch.cuda.synchronize()
        stop, polls, errors, mode_set = threading.Event(), [0], [], []

        def poll() -> None:
            if name == "global_poller_as_perseus":
                mode_set.append(ignore_other_threads_captures())
            while not stop.is_set():
                try:
                    done.query()
                    polls[0] += 1
                except Exception as err:  # noqa: BLE001
                    errors.append(repr(err))
                time.sleep(0.0002)

        thread = threading.Thread(target=poll, daemon=True)

        def polled_body() -> None:
            thread.start()
            time.sleep(0.02)  # the poller queries while the capture is open
            with torch.no_grad():
                for _ in range(4):
                    block(data)
            time.sleep(0.02)

        outcome: dict[str, Any] = {}
        try:
            graph = kit.capture(polled_body, warmup, mode=mode)
            graph.replay()
            torch.cuda.synchronize()
            outcome["capture_ok"] = True
        except Exception as err:  # noqa: BLE001 - the answer
            outcome.update(capture_ok=False, capture_error=repr(err)[:300])
        finally:
            stop.set()
            thread.join(2)
        outcome.update(capture_mode=mode, queries_during=polls[0], query_errors=len(errors),
                       first_query_error=errors[0][:300] if errors else None)
        if mode_set:
            outcome["poller_thread_mode_set"] = mode_set[0]
        results[name] = outcome
    seen["polling_during_capture"] = results
    return seen


def section_cuda_graphs(machine: Machine, gpu: Any, args: Any, deadline: float) -> dict[str, Any]:
    """The three parts, each in its own try/except and share of the time."""
    kit = FakeGraphs(machine) if machine.cpu else CudaGraphs(machine)
    figures: dict[str, Any] = {"mode": "cpu stand-in (no CUDA graphs: answers say nothing about CUDA)" if kit.fake
                               else "cuda", "model": f"{args.layers} blocks, hidden {args.hidden}, batch {args.batch} "
                               f"x sequence {args.sequence}"}
    start = time.perf_counter()
    parts: list[tuple[str, float, Callable[[float], dict[str, Any]]]] = [
        ("per_layer", 0.45, lambda d: per_layer_graphs(machine, kit, gpu, args, d)),
        ("full_iteration", 0.4, lambda d: full_iteration_graph(
            machine, kit, gpu, args, d, ((figures.get("per_layer") or {}).get("eager") or {})
            .get("computation_ms", {}).get("median"))),
        ("capture_probe", 0.15, lambda d: capture_probe(machine, kit, args, d)),
    ]
    total = max(0.0, deadline - start)
    for name, share, part in parts:
        began = time.perf_counter()
        try:
            figures[name] = part(min(deadline, began + share * total))
        except Exception as err:  # noqa: BLE001 - one part's failure must not lose the others
            import traceback

            figures[name] = {"error": repr(err)[:500], "traceback": traceback.format_exc(limit=8)}
        figures[name]["part_s"] = round(time.perf_counter() - began, 2)
        try:
            machine.synchronize()
        except Exception as err:  # noqa: BLE001 - e.g. after a capture broken on purpose
            figures[name]["synchronize_after"] = repr(err)[:300]
    failed = [name for name, _, _ in parts if "error" in figures[name]]
    if failed:  # the section then counts as failed (exit code 1); the other parts' answers stay
        figures["error"] = f"parts failed: {failed}"
    return figures
