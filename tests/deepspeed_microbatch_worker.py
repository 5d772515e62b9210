"""One rank of a 2-stage DeepSpeed pipeline job whose micro batch size doubles mid-run (launched
by tests/test_deepspeed_engines.py under torchrun over gloo, simulated A100s).

    deepspeed_microbatch_worker.py CONFIG.json OUT_DIR CHANGE_ITERATION ITERATIONS

Before CHANGE_ITERATION every rank calls `engine.set_train_micro_batch_size(2 x size)` and
`engine.reset_activation_shape()` (DeepSpeed's pipeline needs it for the new activation shape),
and feeds batches of the new size. The simulated GPU's slowdown doubles at the same time: the
simulated workload is set per microbatch, so this is how twice the samples per microbatch cost
twice the device time. Writes `rank<r>.json`: the frontier's fastest-plan time just before the
change and at the end, and the micro batch size DeepSpeed reports at the end.
"""

import json
import sys
from pathlib import Path

import torch

import deepspeed
from deepspeed.pipe import PipelineModule

from perseus_ext.adapters.deepspeed import install

install()

WIDTH = 32


def batches(size: int, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, WIDTH, generator=generator), torch.randn(size, WIDTH, generator=generator))
            for _ in range(count)]


def main() -> None:
    config_path, out_dir, change_at, iterations = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    layers = [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(4)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss())
    config = json.loads(Path(config_path).read_text())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    size = engine.train_micro_batch_size_per_gpu()
    iterator = iter(deepspeed.utils.RepeatingLoader(batches(size, 16, seed=0)))
    fastest_before_s = None
    for iteration in range(iterations):
        if iteration == change_at:
            fastest_before_s = engine.perseus.frontier.fastest.time if engine.perseus.frontier else None
            engine.set_train_micro_batch_size(2 * size)
            engine.reset_activation_shape()
            engine.perseus.gpu.slowdown = 2.0
            iterator = iter(deepspeed.utils.RepeatingLoader(batches(2 * size, 16, seed=1)))
        engine.train_batch(iterator)
    frontier = engine.perseus.frontier
    result = {"fastest_before_s": fastest_before_s,
              "fastest_after_s": frontier.fastest.time if frontier is not None else None,
              "micro_batch_size": engine.train_micro_batch_size_per_gpu()}
    engine.destroy()
    (out_dir / f"rank{engine.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
