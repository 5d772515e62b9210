"""A plain DeepSpeed pipeline-parallel training script; perseus-ext is enabled from ds_config.json.

    torchrun --nproc_per_node 2 examples/deepspeed/train.py --deepspeed_config examples/deepspeed/ds_config.json

`--stages 0` trains the same layers without a pipeline (a plain DeepSpeed engine, data-parallel
over all ranks), where perseus-ext runs its observe and power-limit modes;
`--set-train-batch-size ITERATION SIZE` calls `engine.set_train_batch_size(SIZE)` before that
iteration (perseus-ext re-plans for the new number of microbatches).

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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages; 0 = no pipeline")
    parser.add_argument("--set-train-batch-size", type=int, nargs=2, metavar=("ITERATION", "SIZE"))
    parser.add_argument("--local_rank", type=int, default=-1)  # set by the deepspeed launcher
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    torch.manual_seed(1234)
    width = 32
    layers = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(4)]
    loss_fn = torch.nn.MSELoss()
    if args.stages:
        model = PipelineModule(layers=layers, num_stages=args.stages, loss_fn=loss_fn)
    else:
        model = torch.nn.Sequential(*layers)
    with open(args.deepspeed_config) as fh:
        config = json.load(fh)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, width, generator=generator), torch.randn(4, width, generator=generator))
               for _ in range(16)]
    data = deepspeed.utils.RepeatingLoader(batches)
    iterator = iter(data)
    for iteration in range(args.iterations):
        if args.set_train_batch_size and iteration == args.set_train_batch_size[0]:
            engine.set_train_batch_size(args.set_train_batch_size[1])
        if args.stages:
            loss = engine.train_batch(iterator)
        else:
            for _ in range(engine.gradient_accumulation_steps()):
                inputs, targets = next(iterator)
                loss = loss_fn(engine(inputs), targets)
                engine.backward(loss)
                engine.step()
        if engine.global_rank == 0 and iteration % 10 == 0:
            print(f"iteration {iteration}: loss {loss.item():.6f}")
    engine.destroy()  # restores clocks and logs perseus-ext's summary
    # torch's documented shutdown: a gloo group left to interpreter exit can abort the process.
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
