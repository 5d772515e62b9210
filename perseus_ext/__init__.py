"""perseus-ext: energy-bloat removal for pipeline-parallel training.

Layers (imports only flow downwards):
- `planning`: profiles, schedule DAGs, energy model, frontier solver (numpy/scipy, no torch).
- `measurement`: GPU backends (NVML, simulated) and measurement windows.
- `actuation`: the off-thread frequency controller.
- `runtime`: the framework-agnostic lifecycle (profile -> solve -> deploy -> straggler policy).
- `adapters`: thin DeepSpeed and Megatron integrations.
"""

__version__ = "0.1.0"
