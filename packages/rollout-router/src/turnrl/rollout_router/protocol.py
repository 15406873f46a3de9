"""Records shared by the engine client and the routers: sampling settings, generations, errors.

The one definition of the engine records: ``turnrl.tool_envs.protocol`` re-exports
:class:`SamplingParams` and :class:`Generation`, so an
:class:`~turnrl.rollout_router.client.EngineClient` or a
:class:`~turnrl.rollout_router.router.Router` is a ``TokenEngine`` of the environments.
This package never imports ``turnrl.tool_envs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

FinishReason = Literal["stop", "length", "abort"]
UpdateMode = Literal["drain", "abort-resume", "keep"]
UPDATE_MODES: tuple[str, ...] = get_args(UpdateMode)
"""What generations in flight do at a weight update (``Router.begin_weight_update``)."""
UNKNOWN_VERSION = -1
"""The weight version of a token sampled before any version was announced."""


@dataclass
class SamplingParams:
    """Sampling settings for one generation call."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 for all."""
    max_tokens: int = 512
    """Most tokens to generate in this call."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; the engine stops after producing one (not included in the output ids)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Stop token ids (e.g. ``<|im_end|>``); included in the output ids when produced."""
    seed: int | None = None
    """Per-request seed, for reproducible sampling."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks and abort tests)."""
    allowed_token_ids: list[int] = field(default_factory=list)
    """Sample only among these token ids (empty: the whole vocabulary)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids):
            raise ValueError("allowed_token_ids must be non-negative integers")


def sampling_to_vllm(sampling: SamplingParams) -> dict[str, Any]:
    """vLLM ``sampling_params`` JSON; only the sampled token's logprob is requested."""
    out: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_tokens": sampling.max_tokens,
        "logprobs": 0,
        "ignore_eos": sampling.ignore_eos,
        "skip_special_tokens": False,
    }
    if sampling.stop:
        out["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        out["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        out["seed"] = sampling.seed
    if sampling.allowed_token_ids:
        out["allowed_token_ids"] = list(sampling.allowed_token_ids)
    return out


@dataclass
class Generation:
    """What an engine returns for one token-in/token-out call."""

    token_ids: list[int]
    """Generated token ids, exactly as the engine produced them."""
    logprobs: list[float]
    """Log-probability of each generated token under the sampling distribution."""
    finish_reason: FinishReason
    """``stop`` (stop token/string), ``length`` (max_tokens reached) or ``abort``."""
    stop_reason: str | int | None = None
    """For ``stop``: the stop string matched (str) or stop token id (int); None if unknown
    (vLLM reports None when the end-of-sequence token stopped it)."""
    engine: str = ""
    """URL of the engine that produced it."""
    request_id: str = ""
    """The client-side request id (the engine sees it with vLLM's prefix)."""
    versions: list[int] = field(default_factory=list)
    """The weight version each token was sampled with, aligned with ``token_ids``
    (:data:`UNKNOWN_VERSION` before any was announced); two versions after a resume."""
    resumes: int = 0
    """Times a weight update aborted it and it went on with the rest of its budget."""


class EngineError(RuntimeError):
    """An engine call failed."""


class EngineUnavailableError(EngineError):
    """The engine could not be reached, or failed before producing any token.

    Safe to retry on another engine: nothing was generated.
    """


class EngineRequestError(EngineError):
    """The engine rejected the request (HTTP 4xx): retrying elsewhere would fail too."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status
        """HTTP status the engine answered."""


class PartialGenerationError(EngineError):
    """The engine failed after producing tokens; they are kept here, never retried."""

    def __init__(self, message: str, partial: Generation | None) -> None:
        super().__init__(message)
        self.partial = partial
        """The tokens and logprobs received before the failure (None: bytes already relayed)."""


class DrainTimeoutError(EngineError):
    """Aborted requests did not finish within the bounded wait."""

    def __init__(self, message: str, pending: list[str]) -> None:
        super().__init__(message)
        self.pending = pending
        """Client-side ids of the requests still in flight."""


class NoEngineAvailableError(EngineError):
    """No engine can take the request (all removed, unhealthy or circuit-open)."""
