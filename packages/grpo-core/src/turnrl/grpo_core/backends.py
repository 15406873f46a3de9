"""Which trainer a config builds: ``MegatronEngine`` for a ``MegatronEngineConfig`` (the
megatron backend, megatron-core installed), else the torch FSDP2 ``TorchEngine``. Above
both, so that neither imports the other."""

from __future__ import annotations

from turnrl.grpo_core.megatron.engine import MegatronEngine, MegatronEngineConfig
from turnrl.grpo_core.training.torch_engine import TorchEngine, TorchEngineConfig
from turnrl.grpo_core.training.trainer import Trainer


def make_engine(config: TorchEngineConfig) -> Trainer:
    """The train engine ``config`` asks for, on this rank."""
    if isinstance(config, MegatronEngineConfig):
        return MegatronEngine(config)
    return TorchEngine(config)
