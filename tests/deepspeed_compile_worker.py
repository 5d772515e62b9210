"""One rank of a 2-stage DeepSpeed pipeline job whose stage modules are `torch.compile`d
(inductor on the CPU), launched by tests/test_torch_compile.py under torchrun over gloo with a
simulated A100 per rank.

    deepspeed_compile_worker.py CONFIG.json OUT_DIR ITERATIONS

Every block of the PipelineModule is an eager `TracedBlock` around a compiled Linear+Tanh: its
forward appends "forward" to the rank's event list when the compiled forward has returned, and a
post-accumulate-grad hook on the compiled block's weight appends "backward" when the compiled
backward has produced that weight's gradient. perseus-ext's hooks (the runtime's
`before_computation` / `after_computation`, which the adapter calls around each ForwardPass and
BackwardPass) append ("before"|"after", kind, microbatch). Writes `rank<r>.json`: the events, the
order the plan expects per iteration, the runtime's phase and fallback reason, and dynamo's
counters (graphs compiled, graph breaks).
"""

import json
import sys
from pathlib import Path

import torch

import deepspeed
from deepspeed.pipe import PipelineModule

from perseus_ext.adapters.deepspeed import install

install()

WIDTH = 8
EVENTS: list = []


class TracedBlock(torch.nn.Module):
    """A compiled Linear+Tanh; records when its compiled forward and backward ran."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
        self.block[0].weight.register_post_accumulate_grad_hook(lambda _: EVENTS.append("backward"))
        self.compiled = torch.compile(self.block, backend="inductor", dynamic=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.compiled(x)
        EVENTS.append("forward")
        return out


def spy(method, what: str):
    def record(kind, microbatch, *args, **kwargs):
        EVENTS.append((what, str(getattr(kind, "value", kind)), microbatch))
        return method(kind, microbatch, *args, **kwargs)
    return record


def main() -> None:
    config_path, out_dir, iterations = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    model = PipelineModule(layers=[TracedBlock() for _ in range(4)], num_stages=2, loss_fn=torch.nn.MSELoss())
    config = json.loads(Path(config_path).read_text())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    runtime = engine.perseus
    runtime.before_computation = spy(runtime.before_computation, "before")
    runtime.after_computation = spy(runtime.after_computation, "after")
    size = engine.train_micro_batch_size_per_gpu()
    generator = torch.Generator().manual_seed(0)
    data = [(torch.randn(size, WIDTH, generator=generator), torch.randn(size, WIDTH, generator=generator))
            for _ in range(8)]
    iterator = iter(deepspeed.utils.RepeatingLoader(data))
    for _ in range(iterations):
        engine.train_batch(iterator)
    from torch._dynamo.utils import counters

    result = {
        "events": EVENTS,
        "order": [[c.kind.value, c.microbatch] for c in runtime.order],
        "phase": runtime.phase.value,
        "fallback": runtime.fallback_reason,
        "blocks": len(list(engine.module.forward_funcs)),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }
    engine.destroy()
    (out_dir / f"rank{engine.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
