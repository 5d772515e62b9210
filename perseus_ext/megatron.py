"""Public Megatron entry points: `add_perseus_args` (Megatron-LM `extra_args_provider`),
`install` (one call from a pretraining script) and friends. See docs/megatron.md."""

from perseus_ext.adapters.megatron import (
    MegatronPerseus,
    add_perseus_args,
    chain_extra_args,
    config_from_args,
    install,
)

__all__ = ["MegatronPerseus", "add_perseus_args", "chain_extra_args", "config_from_args", "install"]
