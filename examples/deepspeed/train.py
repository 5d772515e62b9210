"""A plain DeepSpeed pipeline-parallel training script; perseus-ext is enabled from ds_config.json.

    torchrun --nproc_per_node 2 examples/deepspeed/train.py --deepspeed_config examples/deepspeed/ds_config.json

The only perseus-specific line is `install()`, which a site-wide `.pth` hook (autoload) can do
instead. `"gpu": "sim:a100_sxm"` simulates A100s so this runs on a CPU-only machine; on real GPUs
set `"gpu": "nvml"` and drop `"simulated_workload"`.
"""

import argparse
import json

import torch

import deepspeed
from deepspeed.pipe import PipelineModule

from perseus_ext.adapters.deepspeed import install

install()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=-1)  # set by the deepspeed launcher
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    torch.manual_seed(1234)
    width = 32
    layers = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(4)]
    model = PipelineModule(layers=layers, num_stages=args.stages, loss_fn=torch.nn.MSELoss())
    with open(args.deepspeed_config) as fh:
        config = json.load(fh)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, width, generator=generator), torch.randn(4, width, generator=generator))
               for _ in range(16)]
    data = deepspeed.utils.RepeatingLoader(batches)
    iterator = iter(data)
    for iteration in range(args.iterations):
        loss = engine.train_batch(iterator)
        if engine.global_rank == 0 and iteration % 10 == 0:
            print(f"iteration {iteration}: loss {loss.item():.6f}")
    engine.destroy()  # restores clocks and logs perseus-ext's summary


if __name__ == "__main__":
    main()
