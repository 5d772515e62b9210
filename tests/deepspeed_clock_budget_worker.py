"""One rank of a 2-stage DeepSpeed pipeline job planned within a clock-change budget (launched by
tests/test_clock_budget_deepspeed.py under torchrun over gloo, simulated A100s).

    deepspeed_clock_budget_worker.py CONFIG.json OUT_DIR ITERATIONS MICROBATCHES

Every locked clock the runtime sets on this rank's simulated GPU is logged with the device's own
time when it is set (`SimulatedGPU.set_locked_sm_clocks` wrapped in this process: test support,
nothing of perseus-ext changes), and every iteration's phase with the device time at its end.
Writes `clocks<rank>.json`: {"changes": [[device_s, mhz], ...], "iterations": [[phase,
device_s], ...]}.
"""

import json
import sys
from pathlib import Path

import torch

import deepspeed
from deepspeed.pipe import PipelineModule

from perseus_ext.adapters.deepspeed import install
from perseus_ext.measurement.gpu.sim import SimulatedGPU

install()

WIDTH = 16
changes: list[tuple[float, int]] = []
_set_locked = SimulatedGPU.set_locked_sm_clocks


def logged_set_locked(self: SimulatedGPU, mhz: int) -> None:
    changes.append((self.device.now(), int(mhz)))
    _set_locked(self, mhz)


SimulatedGPU.set_locked_sm_clocks = logged_set_locked


def main() -> None:
    config_path, out_dir = sys.argv[1], Path(sys.argv[2])
    iterations, microbatches = int(sys.argv[3]), int(sys.argv[4])
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    layers = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(4)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss())
    config = json.loads(Path(config_path).read_text())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randn(1, WIDTH, generator=generator), torch.randn(1, WIDTH, generator=generator))
            for _ in range(microbatches)]
    iterator = iter(deepspeed.utils.RepeatingLoader(data))
    ends = []
    for _ in range(iterations):
        engine.train_batch(iterator)
        gpu = engine.perseus.gpu
        gpu.device.synchronize()
        ends.append((engine.perseus.phase.value, gpu.device.now()))
    rank = engine.global_rank
    engine.destroy()
    (out_dir / f"clocks{rank}.json").write_text(json.dumps({"changes": changes, "iterations": ends}))


if __name__ == "__main__":
    main()
