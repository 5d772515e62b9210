"""Megatron's `--log-energy` and perseus-ext's energy figures, on the same run.

megatron-core's `EnergyMonitor` (what Megatron-LM's `--log-energy` logs) reads each rank's whole
device energy counter through NVML between two `lap()`s and sums it over the ranks with an
all-reduce on a CUDA tensor. Here it reads the same simulated GPUs perseus-ext's ranks run on:
its `pynvml` functions are pointed at each rank's simulated counter, and what CPU torch lacks
(CUDA tensors, a process group for the in-process ranks) is stood in for by tests/megatron_shims.py
only. perseus-ext's per-iteration energies (each rank's counter from its iteration's start marker to
its end marker, as the device reached them), summed over ranks and iterations, must equal
Megatron's figure over those iterations within 1 %; the rest is the time between iterations, which
perseus-ext does not charge to any iteration (docs/monitoring.md)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is the optional 'megatron' extra")

from megatron.core import energy_monitor  # noqa: E402

from megatron_hooked import hooked_ranks, perseus_hooks  # noqa: E402
from megatron_shims import cuda_factories_on_cpu, run_megatron_schedule  # noqa: E402

STAGES, MICROBATCHES, ITERATIONS = 2, 16, 6


class ThreadRanksAllReduce:
    """`dist.all_reduce(SUM)` among the in-process rank threads: each adds its tensor, all wait,
    each reads the sum (what NCCL does across processes)."""

    def __init__(self, ranks: int) -> None:
        self._barrier = threading.Barrier(ranks, timeout=30)
        self._lock = threading.Lock()
        self._parts: list = []
        self._total = None

    def __call__(self, tensor, op=None, group=None):
        with self._lock:
            self._parts.append(tensor.clone())
        if self._barrier.wait() == 0:
            self._total = sum(self._parts[1:], self._parts[0])
            self._parts = []
        self._barrier.wait()
        tensor.copy_(self._total)
        self._barrier.wait()


def megatron_monitors(monkeypatch, gpus: list) -> list:
    """One megatron-core EnergyMonitor per rank, its NVML reads pointed at that rank's GPU."""
    handles = {}
    monkeypatch.setattr(energy_monitor, "has_nvml", True)
    monkeypatch.setattr(energy_monitor, "nvmlInit", lambda: None, raising=False)
    monkeypatch.setattr(energy_monitor, "nvmlShutdown", lambda: None, raising=False)
    monkeypatch.setattr(energy_monitor, "NVMLError", RuntimeError, raising=False)
    monkeypatch.setattr(energy_monitor, "nvmlDeviceGetTotalEnergyConsumption",
                        lambda handle: handles[handle].energy_mj(), raising=False)
    monitors = []
    for rank, gpu in enumerate(gpus):
        handles[rank] = gpu
        monitor = energy_monitor.EnergyMonitor()
        monitor._handle = rank  # what setup() gets from nvmlDeviceGetHandleByIndex(current_device())
        monitors.append(monitor)
    monkeypatch.setattr(energy_monitor.dist, "all_reduce", ThreadRanksAllReduce(len(gpus)))
    return monitors


def lap_on_every_rank(monitors: list) -> list[float]:
    """Every rank calls lap() at once (it all-reduces); each gets the job's joules."""
    laps = [None] * len(monitors)

    def lap(rank: int) -> None:
        with cuda_factories_on_cpu():  # torch.tensor(..., device="cuda") on the CPU
            laps[rank] = monitors[rank].lap()

    threads = [threading.Thread(target=lap, args=(rank,)) for rank in range(len(monitors))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(lap is not None for lap in laps)
    return laps


def test_megatron_log_energy_and_perseus_energies_agree(tmp_path, monkeypatch):
    ranks = hooked_ranks(tmp_path, STAGES, MICROBATCHES)
    monitors = megatron_monitors(monkeypatch, [rank.gpu for rank in ranks])
    with perseus_hooks(ranks):
        run_megatron_schedule(STAGES, MICROBATCHES, timeout_s=60)  # a first iteration, outside both windows
        for monitor in monitors:
            monitor.resume()  # Megatron-LM starts its monitor before the training loop
        for _ in range(ITERATIONS):
            run_megatron_schedule(STAGES, MICROBATCHES, timeout_s=60)
    for rank in ranks:
        rank.runtime.controller.flush(5.0)  # the device finishes the last iteration's work
    megatron_j = lap_on_every_rank(monitors)
    assert len(set(megatron_j)) == 1  # the all-reduced job figure, the same on every rank
    perseus_j = 0.0
    for rank in ranks:
        rank.runtime.close()  # writes the records still in flight
        records = [r for r in rank.runtime.history if r.iteration >= 1]
        assert [r.iteration for r in records] == list(range(1, ITERATIONS + 1))
        perseus_j += sum(r.energy_j for r in records)
    assert perseus_j > 0
    # perseus-ext charges a subset of the same counter's span (summed record by record, so the
    # two sums may differ in the last bits when the subset is the whole span)
    assert perseus_j <= megatron_j[0] * (1 + 1e-12)
    assert perseus_j == pytest.approx(megatron_j[0], rel=0.01), (perseus_j, megatron_j[0])


def test_perseus_figures_join_megatrons_iteration_line_when_asked():
    """`install(..., iteration_log=True)` wraps Megatron-LM's line printer: its iteration line gets
    this rank's figures over the iterations recorded since the previous line; other messages
    pass unchanged. (Megatron-LM's training module is not installed here: nothing is wrapped.)"""
    from types import SimpleNamespace

    from perseus_ext.adapters.megatron_log import IterationLineAppender, wrap_iteration_lines
    from perseus_ext.runtime import Phase

    history: list = []
    printed: list[str] = []
    appender = IterationLineAppender(printed.append, lambda: history)
    history += [SimpleNamespace(energy_j=100.0, time_s=0.30, phase=Phase.DEPLOYED),
                SimpleNamespace(energy_j=110.0, time_s=0.32, phase=Phase.DEPLOYED)]
    line = (" [2026-01-01 10:00:00] iteration       10/     100 | consumed samples:          640 | "
            "elapsed time per iteration (ms): 310.2 | energy per GPU (J/iter/GPU): 108.1 | power per GPU (W/GPU): 348.5 |")
    appender(line)
    appender("saving checkpoint at iteration 10")
    appender(line)  # nothing recorded since the previous line
    assert printed[0] == line + (" perseus energy this GPU (J/iter): 105.0 | perseus time (s/iter): 0.310 |"
                                 " perseus phase: deployed |")
    assert printed[1] == "saving checkpoint at iteration 10"
    assert printed[2].endswith(" perseus energy this GPU (J/iter): n/a | perseus time (s/iter): n/a |"
                               " perseus phase: n/a |")
    assert wrap_iteration_lines(lambda: history) is None  # megatron.training is Megatron-LM's, not installed
