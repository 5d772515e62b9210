"""Zeus' global power-limit mode on the simulated GPU.

The simulated A100 throttles its clock to fit the power limit, so every limit has an exact
(time, energy) per iteration; the optimizer must find the limit a brute force over those
exact numbers calls cost-optimal, restore the default limit, and survive GPU failures.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from perseus_ext.config.policy import PolicySection
from perseus_ext.errors import ConfigError
from perseus_ext.measurement.gpu import GPUError
from perseus_ext.measurement.gpu.sim import SimulatedGPU
from perseus_ext.policies import (
    CallbackCarbonSignal,
    CarbonCost,
    PowerLimitOptimizer,
    ZeusCost,
)
from perseus_ext.policies.factories import build_power_limit_optimizer
from perseus_ext.policies.power_limit import candidate_limits

WORK_S = 2.0  # one iteration's computation at the max clock
IDLE_S = 0.3  # data loading etc. at idle power (counts in time and energy)


def exact_iteration(gpu: SimulatedGPU, limit_w: float) -> tuple[float, float]:
    """(seconds, joules) of one iteration at `limit_w`, straight from the preset's curves."""
    preset = gpu.preset
    clock = preset.throttled_clock(preset.max_clock_mhz, limit_w)
    busy = WORK_S * preset.time_factor(clock)
    return busy + IDLE_S, busy * preset.compute_power_w(clock) + IDLE_S * preset.idle_power_w


def brute_force_limit(gpu: SimulatedGPU, eta: float, max_power_w: float) -> float:
    def cost(limit: float) -> tuple[float, float]:
        t, e = exact_iteration(gpu, limit)
        return (eta * e + (1 - eta) * max_power_w * t, -limit)

    low, high = gpu.power_limit_range_w()
    return min(candidate_limits(low, high, 25.0), key=cost)


def train(gpu: SimulatedGPU, optimizer: PowerLimitOptimizer, iterations: int) -> list[float | None]:
    """Run iterations on the simulated GPU, measuring energy with its (coarse, noisy) counter."""
    limits = []
    for _ in range(iterations):
        start_t, start_mj = gpu.timestamp(), gpu.energy_mj()
        gpu.run(WORK_S, "forward")
        gpu.wait(IDLE_S)
        limits.append(
            optimizer.on_iteration_end(
                gpu.timestamp() - start_t, (gpu.energy_mj() - start_mj) / 1000
            )
        )
    return limits


def profiling_iterations(optimizer: PowerLimitOptimizer, candidates: int) -> int:
    return candidates * (optimizer.warmup_iters + optimizer.profile_iters)


@pytest.mark.parametrize("eta", [0.0, 0.3, 0.5, 0.8, 1.0])
def test_finds_the_cost_optimal_limit_exactly_without_noise(eta: float) -> None:
    gpu = SimulatedGPU(
        "a100_sxm", seed=1, pace=False, energy_noise=0.0, energy_update_period_s=0.01
    )
    max_power = gpu.power_limit_range_w()[1]
    optimizer = PowerLimitOptimizer(gpu, ZeusCost(eta, max_power), warmup_iters=1, profile_iters=3)
    candidates = len(candidate_limits(100.0, 500.0, 25.0))
    assert candidates == 17
    limits = train(gpu, optimizer, profiling_iterations(optimizer, candidates) + 5)
    best = brute_force_limit(gpu, eta, max_power)
    assert not optimizer.profiling
    assert limits[-1] == best == gpu.power_limit_w()
    assert [m.limit_w for m in optimizer.measurements] == candidate_limits(100.0, 500.0, 25.0)
    if eta == 0.0:
        assert best == 500.0  # no slowdown: the top limits tie and the higher one wins
    optimizer.close()
    assert gpu.power_limit_w() == gpu.default_power_limit_w()


def test_noisy_counter_still_lands_within_one_percent_of_the_optimum() -> None:
    gpu = SimulatedGPU("a100_sxm", seed=3, pace=False)  # default 2% counter noise, 100 ms updates
    eta, max_power = 0.8, 500.0
    with PowerLimitOptimizer(gpu, ZeusCost(eta, max_power)) as optimizer:
        train(gpu, optimizer, profiling_iterations(optimizer, 17) + 1)
        chosen = optimizer.limit_w

        def cost(limit: float) -> float:
            t, e = exact_iteration(gpu, limit)
            return eta * e + (1 - eta) * max_power * t

        assert cost(chosen) <= 1.01 * cost(brute_force_limit(gpu, eta, max_power))
    assert gpu.power_limit_w() == 500.0  # restored on leaving the with-block


def test_profiling_sequence_warmup_and_steps() -> None:
    gpu = SimulatedGPU("a100_sxm", pace=False, energy_noise=0.0)
    optimizer = PowerLimitOptimizer(
        gpu, ZeusCost(1.0, 500.0), warmup_iters=2, profile_iters=3, step_w=100.0
    )
    assert optimizer.limit_w == 500.0  # profiling starts at the max limit
    limits = train(gpu, optimizer, 5 * 5)
    # 5 iterations per limit (2 discarded + 3 measured), 500 -> 100 W in 100 W steps.
    assert limits[:4] == [500.0] * 4 and limits[4] == 400.0
    assert [m.limit_w for m in optimizer.measurements] == [500.0, 400.0, 300.0, 200.0, 100.0]
    measured = optimizer.measurements[1]
    expected_t, expected_e = exact_iteration(gpu, 400.0)
    assert measured.time_s == pytest.approx(expected_t) and measured.energy_j == pytest.approx(
        expected_e, rel=0.02
    )
    optimizer.close()


def test_failing_gpu_calls_are_skipped_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    gpu = SimulatedGPU("a100_sxm", pace=False, energy_noise=0.0)
    optimizer = PowerLimitOptimizer(
        gpu, ZeusCost(1.0, 500.0), warmup_iters=0, profile_iters=1, step_w=100.0
    )
    gpu.inject_fault("set_power_limit_w", GPUError("NVML: insufficient permissions"), times=1)
    train(gpu, optimizer, 10)  # 400 W fails to set: profiled limits skip it
    assert [m.limit_w for m in optimizer.measurements] == [500.0, 300.0, 200.0, 100.0]
    assert "setting power limit 400 W failed" in caplog.text
    gpu.inject_fault("set_power_limit_w", GPUError("GPU fell off the bus"), times=1)
    optimizer.close()  # logged, not raised
    assert "restoring the default power limit failed" in caplog.text


def test_explicit_limits_and_bad_limits() -> None:
    gpu = SimulatedGPU("a100_sxm", pace=False)
    optimizer = PowerLimitOptimizer(gpu, ZeusCost(0.5, 500.0), limits_w=[300, 500, 400])
    assert optimizer.limit_w == 500.0
    optimizer.close()
    with pytest.raises(
        ConfigError,
        match=r"limits_w must be a non-empty list within the GPU's range \[100, 500\] W",
    ):
        PowerLimitOptimizer(gpu, ZeusCost(0.5, 500.0), limits_w=[50])


def test_all_reduce_aggregates_ranks() -> None:
    """A fake collective for two identical ranks: energy doubles, time and the choice stay."""
    gpu = SimulatedGPU("a100_sxm", pace=False, energy_noise=0.0, energy_update_period_s=0.01)
    calls = []

    def two_ranks(values):
        calls.append(list(values))
        return [2 * v for v in values]

    optimizer = PowerLimitOptimizer(
        gpu, ZeusCost(0.5, 500.0), warmup_iters=0, profile_iters=2, all_reduce=two_ranks
    )
    train(gpu, optimizer, 34)
    assert len(calls) == 17 and all(c[2] == 1.0 for c in calls)
    first = optimizer.measurements[0]
    t, e = exact_iteration(gpu, 500.0)
    assert (
        first.num_gpus == 2
        and first.time_s == pytest.approx(t)
        and first.energy_j == pytest.approx(2 * e, rel=0.01)
    )
    assert optimizer.limit_w == brute_force_limit(gpu, 0.5, 500.0)
    optimizer.close()


def test_carbon_cost_moves_the_limit_both_ways() -> None:
    gpu = SimulatedGPU("a100_sxm", pace=False, energy_noise=0.0, energy_update_period_s=0.01)
    intensity = {"value": 400.0}
    clock = {"now": 0.0}
    cost = CarbonCost(
        0.8,
        500.0,
        CallbackCarbonSignal(lambda now: intensity["value"]),
        max_carbon=400.0,
        period_s=60.0,
        clock=lambda: clock["now"],
    )
    optimizer = PowerLimitOptimizer(gpu, cost, warmup_iters=0, profile_iters=1)
    train(gpu, optimizer, 17)
    dirty = optimizer.limit_w
    assert dirty == brute_force_limit(gpu, 0.8, 500.0)  # at MaxCarbon Chase is Zeus
    intensity["value"] = 5.0
    clock["now"] += 61
    clean = train(gpu, optimizer, 1)[-1]
    assert clean is not None and clean > dirty and clean == 500.0
    intensity["value"] = 400.0
    clock["now"] += 61
    assert train(gpu, optimizer, 1)[-1] == dirty
    optimizer.close()


def test_config_builds_optimizer_with_gpu_max_power() -> None:
    gpu = SimulatedGPU("a40", pace=False)
    config = PolicySection.parse(
        {
            "type": "zeus",
            "eta": 0.5,
            "mode": "power_limit",
            "power_limit": {"step_w": 50, "warmup_iters": 1, "profile_iters": 2},
        }
    )
    optimizer = build_power_limit_optimizer(config, gpu)
    assert optimizer.cost.max_power_w == 300.0  # the A40's max limit
    assert optimizer.warmup_iters == 1 and optimizer.profile_iters == 2
    optimizer.close()


def _rank_main(rank: int, world: int, init_file: str, result_file: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)

    def all_reduce(values):
        tensor = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(tensor)
        return tensor.tolist()

    gpu = SimulatedGPU("a100_sxm", seed=rank, pace=False)  # different noise per rank
    optimizer = PowerLimitOptimizer(
        gpu, ZeusCost(0.8, 500.0), warmup_iters=1, profile_iters=2, all_reduce=all_reduce
    )
    train(gpu, optimizer, 17 * 3 + 2)
    Path(result_file).write_text(f"{optimizer.limit_w} {optimizer.measurements[0].num_gpus}")
    optimizer.close()
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.slow
def test_ranks_agree_over_torch_distributed(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    world = 2
    procs = [
        context.Process(
            target=_rank_main, args=(r, world, str(tmp_path / "init"), str(tmp_path / f"r{r}"))
        )
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    results = {(tmp_path / f"r{r}").read_text() for r in range(world)}
    assert len(results) == 1  # both ranks deployed the same limit
    limit, num_gpus = results.pop().split()
    assert int(num_gpus) == world and float(limit) in candidate_limits(100.0, 500.0, 25.0)
