"""The configuration room: every option of perseus-ext defined once, validated at the door.

- `perseus.py`: `PerseusConfig`, the `"perseus"` section (DeepSpeed key, Megatron flags);
- `policy.py`: `PolicySection`, its `policy` sub-section, one frozen model per sub-section;
- `sections.py`: the simulated workload, the Prometheus exporter, a saved profile's side file;
- `gpu.py`: the GPU spec string as a typed `GpuSpec` (parsed once; the device layer opens it);
- `rules.py`: the pydantic machinery: one rule and example per field, one ConfigError line per mistake;
- `key_table.py`: the documentation's key table, generated from the model.

The room is a leaf: it imports only `perseus_ext.errors` and `perseus_ext.inputs` (and, for a
`solver` key, the solver's plain option dataclass), never torch, numpy or a database driver,
so validating a config is cheap. What builds objects from a config lives with those objects
(`perseus_ext.policies.factories`, `perseus_ext.measurement.gpu.open_gpu`).
"""

from perseus_ext.config.gpu import GpuSpec, NvmlSpec, SimPreset, SimSpec, ZeusdSpec, parse_gpu_spec
from perseus_ext.config.perseus import Mode, PerseusConfig
from perseus_ext.config.policy import PolicyMode, PolicySection, PolicyType
from perseus_ext.config.sections import PREFIX, PrometheusConfig, ProfileSidecar, SimulatedWorkload

__all__ = [
    "PREFIX",
    "GpuSpec",
    "Mode",
    "NvmlSpec",
    "PerseusConfig",
    "PolicyMode",
    "PolicySection",
    "PolicyType",
    "PrometheusConfig",
    "ProfileSidecar",
    "SimPreset",
    "SimSpec",
    "SimulatedWorkload",
    "ZeusdSpec",
    "parse_gpu_spec",
]
