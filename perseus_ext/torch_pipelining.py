"""Public torch.distributed.pipelining entry point: `enable(schedule, config)` on every rank
before the schedule's first `step()`. See docs/torch-pipelining.md."""

from perseus_ext.adapters.torch_pipelining import TorchPipeliningPerseus, enable, read_config
from perseus_ext.adapters.torch_pipelining_actions import SUPPORTED_CLASSES

__all__ = ["SUPPORTED_CLASSES", "TorchPipeliningPerseus", "enable", "read_config"]
