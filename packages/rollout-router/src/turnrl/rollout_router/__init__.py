"""turnrl-rollout-router: inference engines as servers, token-in/token-out clients and routing."""

from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.engine import EngineLogprobsError, EngineServer, EngineSpec
from turnrl.rollout_router.protocol import (
    DrainTimeoutError,
    EngineError,
    EngineRequestError,
    EngineUnavailableError,
    Generation,
    NoEngineAvailableError,
    PartialGenerationError,
    SamplingParams,
)
from turnrl.rollout_router.router import Router, RouterConfig

__version__ = "0.1.0"

__all__ = [
    "DrainTimeoutError",
    "EngineClient",
    "EngineError",
    "EngineLogprobsError",
    "EngineRequestError",
    "EngineServer",
    "EngineSpec",
    "EngineUnavailableError",
    "Generation",
    "NoEngineAvailableError",
    "PartialGenerationError",
    "Router",
    "RouterConfig",
    "SamplingParams",
]
