"""The gateway's HTTP service: episodes of agent sessions in front of a token engine.

``POST /episodes`` opens a group of sessions at once; each is reached at
``/sessions/{id}/v1/...`` or at ``/v1/...`` with its key (``Authorization: Bearer`` or
``x-api-key``), speaking OpenAI chat completions, the Responses API or Anthropic Messages
(JSON or server-sent events). Every call goes through the session's
:class:`~turnrl.tool_envs.gateway.ledger.SessionLedger`: the prompt is the chain's ids plus
the rendered new tail, the engine's ids are recorded as sampled, and the answer is the
ledger's message. The engine call is not streamed: a stream is the finished message sent as
events, so ids always come from the final engine ``Generation``, never from chunks.
Rendering and tokenising (the ledger's ``prepare`` and ``record``) run one at a time per
session (its lock, taken in arrival order): for large requests and generations in worker
threads, off the event loop; small ones inline, where a thread hand-off costs more than the
work (docs/benchmarks/gateway.md).

A retried request (``x-stainless-retry-count`` > 0 with the body of an earlier call) gets
that call's answer, never a second turn. A lost call (engine failure, an answer the client
never received) fails the session with the reason; the export shows it, and a failed
session must not be trained on. Rewards: ``POST /sessions/{id}/reward``; the trajectories
leave by ``GET /episodes/{id}/export`` (``DELETE /episodes/{id}`` then frees the episode).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from turnrl.tool_envs.chat import ChatTokenizer
from turnrl.tool_envs.gateway import protocols
from turnrl.tool_envs.gateway.ledger import ContextOverflowError, Prepared, SessionLedger
from turnrl.tool_envs.gateway.protocols import Answer, Api, ChatRequest, RequestError
from turnrl.tool_envs.protocol import Generation, Message, SamplingParams, TokenEngine

log = logging.getLogger(__name__)

RETRY_HEADER = "x-stainless-retry-count"
_ID_PREFIX: dict[Api, str] = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}
_NO_RETRY = {"x-should-retry": "false"}  # the openai / anthropic SDKs then do not retry
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class CallLostError(RuntimeError):
    """The engine call of a request failed; its session is failed."""


@dataclass
class Call:
    """One answered agent call."""

    id: str
    chain: int
    api: Api
    delivered: bool = False
    """The client received the whole answer (itself or on a retry)."""


@dataclass
class Session:
    """One agent conversation (possibly several chains) and its outcome."""

    id: str
    key: str
    episode: str
    ledger: SessionLedger
    status: str = "active"
    """``active``, ``finished`` or ``failed``."""
    reason: str | None = None
    reward: float | None = None
    call_rewards: dict[str, float] = field(default_factory=dict)
    calls: dict[str, Call] = field(default_factory=dict)
    answers: dict[str, asyncio.Future[Answer]] = field(default_factory=dict)
    """The generation of each request body (by digest), for retries."""
    histories: dict[str, list[Message]] = field(default_factory=dict)
    """Responses API conversations by response id (``previous_response_id``)."""
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while the ledger works (FIFO: a session's requests are prepared in arrival order)."""

    def fail(self, reason: str) -> None:
        if self.status != "failed":
            self.status, self.reason = "failed", reason
            log.warning("gateway session %s failed: %s", self.id, reason)

    @property
    def busy(self) -> bool:
        """A request is being answered, or a generation (maybe of a gone request) runs."""
        return self.in_flight > 0 or not all(a.done() for a in self.answers.values())

    async def settle(self) -> None:
        """Wait until no generation runs and no request is being answered."""
        while self.busy:
            pending = [a for a in self.answers.values() if not a.done()]
            if pending:
                await asyncio.wait(pending)
            if self.in_flight:
                await self.idle.wait()

    def outcome(self) -> tuple[str, str | None]:
        """Status and reason, counting an undelivered answer as a lost call."""
        if self.status != "failed" and not self.busy:
            lost = [c.id for c in self.calls.values() if not c.delivered]
            if lost:
                return "failed", f"call {lost[0]} was generated but never delivered (client gone)"
        return self.status, self.reason


@dataclass
class Episode:
    id: str
    metadata: dict[str, Any]
    sessions: list[Session]


class Gateway:
    """The OpenAI- and Anthropic-compatible gateway over one token engine (or router).

    Args:
        engine: Generates from token ids; ``session_id`` keeps a session on one engine.
        tokenizer: The served model's tokenizer and chat template.
        sampling: The run's sampling; a request may only lower ``max_tokens``.
        max_context_tokens: Prompt plus generation budget (None: unbounded).
        model_name: The model id ``/v1/models`` lists and answers carry.
        base_url: The URL sessions are reached at (None: the ``POST /episodes`` request's).
        render_threads: Worker threads that render and tokenise (0: all on the event loop).
        inline_bytes: Requests with smaller bodies, and generations of fewer than a quarter
            as many tokens, are rendered on the event loop (0: all in the threads).
        max_body_bytes: Larger request bodies get HTTP 413.
    """

    def __init__(
        self,
        engine: TokenEngine,
        tokenizer: ChatTokenizer,
        sampling: SamplingParams,
        *,
        max_context_tokens: int | None = None,
        model_name: str = "turnrl",
        base_url: str | None = None,
        render_threads: int = 4,
        inline_bytes: int = 16 * 1024,
        max_body_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        if render_threads < 0:
            raise ValueError(f"render_threads must be >= 0, got {render_threads}")
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.sampling = sampling
        if not sampling.stop_token_ids:
            self.sampling = replace(sampling, stop_token_ids=tokenizer.stop_token_ids)
        self.max_context_tokens, self.base_url = max_context_tokens, base_url
        self.episodes: dict[str, Episode] = {}
        self.sessions: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}
        self.render_threads, self.max_body_bytes = render_threads, max_body_bytes
        self.inline_bytes = inline_bytes
        self._pool: ThreadPoolExecutor | None = None

    def app(self) -> web.Application:
        """The aiohttp application (its cleanup stops the render threads)."""
        app = web.Application(client_max_size=self.max_body_bytes)
        if self.render_threads:
            self._pool = ThreadPoolExecutor(self.render_threads, "gateway-render")
            app.on_cleanup.append(self._stop_pool)
        add = app.router
        add.add_post("/episodes", self._open_episode)
        add.add_get("/episodes/{episode}", self._episode_status)
        add.add_get("/episodes/{episode}/export", self._export)
        add.add_delete("/episodes/{episode}", self._close_episode)
        add.add_post("/sessions/{session}/reward", self._reward)
        add.add_post("/sessions/{session}/finish", self._finish)
        for prefix in ("/sessions/{session}/v1", "/v1"):
            add.add_post(f"{prefix}/chat/completions", self._call_handler("chat"))
            add.add_post(f"{prefix}/responses", self._call_handler("responses"))
            add.add_post(f"{prefix}/messages", self._call_handler("messages"))
            add.add_get(f"{prefix}/models", self._models)
        return app

    async def _stop_pool(self, _: web.Application) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def _locked(self, session: Session, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` with the session's ledger to itself; in a render thread when the
        work (``size``, in body bytes) is large."""
        async with session.lock:
            if self._pool is None or size < self.inline_bytes:
                return fn(*args)
            future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
            try:
                return await asyncio.shield(future)
            except asyncio.CancelledError:
                await asyncio.wait([future])  # the ledger is busy until the thread is done
                raise

    # -- episodes ----------------------------------------------------------------------------

    async def _open_episode(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await _json(request)
            size, metadata = body.get("group_size", 1), body.get("metadata") or {}
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise RequestError("group_size must be a positive integer", field="group_size")
            if not isinstance(metadata, dict):
                raise RequestError("metadata must be an object", field="metadata")
        except RequestError as exc:
            return _error(None, exc)
        episode = Episode(uuid.uuid4().hex, metadata, [])
        for _ in range(size):
            ledger = SessionLedger(self.tokenizer, max_context_tokens=self.max_context_tokens)
            key = f"sk-turnrl-{secrets.token_urlsafe(24)}"
            episode.sessions.append(Session(uuid.uuid4().hex, key, episode.id, ledger))
        self.episodes[episode.id] = episode
        for session in episode.sessions:
            self.sessions[session.id] = session
            self._by_key[session.key] = session
        base = self.base_url or str(request.url.origin())
        sessions = [
            {
                "id": s.id,
                "key": s.key,
                "base_url": f"{base}/sessions/{s.id}/v1",
                "anthropic_base_url": f"{base}/sessions/{s.id}",
            }
            for s in episode.sessions
        ]
        return web.json_response({"episode": episode.id, "sessions": sessions})

    def _episode(self, request: web.Request) -> Episode:
        episode = self.episodes.get(request.match_info["episode"])
        if episode is None:
            raise RequestError("unknown episode", field="episode", status=404)
        return episode

    async def _episode_status(self, request: web.Request) -> web.StreamResponse:
        try:
            episode = self._episode(request)
        except RequestError as exc:
            return _error(None, exc)
        sessions = []
        for s in episode.sessions:
            status, reason = s.outcome()
            sessions.append(
                {
                    "id": s.id,
                    "status": status,
                    "reason": reason,
                    "calls": len(s.calls),
                    "busy": s.busy,
                    "reward": s.reward,
                }
            )
        done = all(s["status"] != "active" for s in sessions)
        body = {"episode": episode.id, "metadata": episode.metadata, "done": done}
        return web.json_response({**body, "sessions": sessions})

    async def _export(self, request: web.Request) -> web.StreamResponse:
        try:
            episode = self._episode(request)
        except RequestError as exc:
            return _error(None, exc)
        for s in episode.sessions:
            await s.settle()
        sessions = []
        for s in episode.sessions:
            async with s.lock:
                rows = s.ledger.rows()
            status, reason = s.outcome()
            calls = [
                {"id": c.id, "chain": c.chain, "api": c.api, "delivered": c.delivered}
                for c in s.calls.values()
            ]
            sessions.append(
                {
                    "id": s.id,
                    "status": status,
                    "reason": reason,
                    "reward": s.reward,
                    "call_rewards": dict(s.call_rewards),
                    "calls": calls,
                    "rows": rows,
                }
            )
        body = {"episode": episode.id, "metadata": episode.metadata, "sessions": sessions}
        return web.json_response(body)

    async def _close_episode(self, request: web.Request) -> web.StreamResponse:
        """Forget an episode (after its export): its sessions' routes answer 404 from now."""
        try:
            episode = self._episode(request)
        except RequestError as exc:
            return _error(None, exc)
        del self.episodes[episode.id]
        for session in episode.sessions:
            self.sessions.pop(session.id, None)
            self._by_key.pop(session.key, None)
        return web.json_response({"episode": episode.id, "closed": True})

    def _named_session(self, request: web.Request) -> Session:
        session = self.sessions.get(request.match_info["session"])
        if session is None:
            raise RequestError("unknown session", field="session", status=404)
        return session

    async def _reward(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._named_session(request)
            body = await _json(request)
            reward, call = _reward_value(body.get("reward")), body.get("call")
            if call is None:
                session.reward = reward
            elif call in session.calls:
                session.call_rewards[call] = reward
            else:
                raise RequestError(f"unknown call {call!r}", field="call", status=404)
        except RequestError as exc:
            return _error(None, exc)
        return web.json_response({"session": session.id, "reward": reward, "call": call})

    async def _finish(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._named_session(request)
            body = await _json(request) if request.can_read_body else {}
            if body.get("reward") is not None:
                session.reward = _reward_value(body["reward"])
        except RequestError as exc:
            return _error(None, exc)
        if session.status == "active":
            session.status = "finished"
        status, reason = session.outcome()
        return web.json_response({"session": session.id, "status": status, "reason": reason})

    # -- agent calls ---------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.StreamResponse:
        name = self.model_name
        model = {"id": name, "object": "model", "created": 0, "owned_by": "turnrl"}
        model |= {"type": "model", "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
        listing = {"object": "list", "data": [model], "has_more": False}
        return web.json_response({**listing, "first_id": name, "last_id": name})

    def _call_handler(self, api: Api) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                return await self._call(request, api)
            except RequestError as exc:
                return _error(api, exc)

        return handle

    async def _call(self, request: web.Request, api: Api) -> web.StreamResponse:
        session = self._calling_session(request)
        body, size = await _sized_json(request)
        if session.status != "active":
            why = f": {session.reason}" if session.reason else ""
            raise RequestError(f"session is {session.status}{why}", status=409)
        req = protocols.parse_request(api, body)
        digest = hashlib.sha256(json.dumps([api, body], sort_keys=True).encode()).hexdigest()
        retried = _retry_count(request) > 0
        answer = session.answers.get(digest) if retried else None
        if answer is None:
            messages = self._history(session, req)
            answer = asyncio.ensure_future(self._answer(session, req, messages, size))
            answer.add_done_callback(_consume)
            session.answers[digest] = answer
        session.in_flight += 1
        session.idle.clear()
        try:
            try:
                result = await asyncio.shield(answer)
            except CallLostError as exc:
                return _error(api, RequestError(str(exc), status=502))
            except RequestError:  # a bad request is not remembered as an answer
                if session.answers.get(digest) is answer:
                    del session.answers[digest]
                raise
            response, delivered = await _send(request, req, result)
            if delivered:
                session.calls[result.id].delivered = True
            return response
        finally:
            session.in_flight -= 1
            if session.in_flight == 0:
                session.idle.set()

    def _calling_session(self, request: web.Request) -> Session:
        if "session" in request.match_info:
            return self._named_session(request)
        auth = request.headers.get("Authorization", "")
        key = auth.removeprefix("Bearer ").strip() if auth else request.headers.get("x-api-key")
        if not key:
            raise RequestError("no API key: send the session key as a bearer token", status=401)
        session = self._by_key.get(key)
        if session is None:
            raise RequestError("invalid API key (not a session key of this gateway)", status=401)
        return session

    def _history(self, session: Session, req: ChatRequest) -> list[Message]:
        if req.previous_response_id is None:
            return req.messages
        stored = session.histories.get(req.previous_response_id)
        if stored is None:
            field = "previous_response_id"
            raise RequestError(f"unknown {field} {req.previous_response_id!r}", field=field)
        new = req.messages
        if new and new[0]["role"] == "system" and stored[0]["role"] == "system":
            stored, new = [new[0], *stored[1:]], new[1:]
        return [*stored, *new]

    async def _answer(
        self, session: Session, req: ChatRequest, messages: list[Message], size: int
    ) -> Answer:
        prepared = await self._prepare(session, req, messages, size)
        return await self._generate(session, req, prepared, messages)

    async def _prepare(
        self, session: Session, req: ChatRequest, messages: list[Message], size: int
    ) -> Prepared:
        try:
            prepared: Prepared = await self._locked(
                session, size, session.ledger.prepare, messages, req.tools
            )
        except ContextOverflowError as exc:
            raise RequestError(str(exc), field="messages", status=413) from exc
        except ValueError as exc:
            raise RequestError(str(exc), field="messages") from exc
        if prepared.fork_reason:
            log.info("session %s: chain %d (%s)", session.id, prepared.chain, prepared.fork_reason)
        return prepared

    async def _generate(
        self, session: Session, req: ChatRequest, prepared: Prepared, messages: list[Message]
    ) -> Answer:
        cap = min(self.sampling.max_tokens, req.max_tokens or self.sampling.max_tokens)
        if self.max_context_tokens is not None:
            cap = min(cap, max(1, self.max_context_tokens - len(prepared.prompt_ids)))
        sampling = replace(self.sampling, max_tokens=cap)
        try:
            generation = await self.engine.generate(
                list(prepared.prompt_ids), sampling, session_id=session.id
            )
        except Exception as exc:  # the router has re-run what it could: the call is lost
            session.fail(f"engine call lost: {exc!r}")
            raise CallLostError(f"engine call failed: {exc}") from exc
        if generation.finish_reason == "abort":
            session.fail("engine call lost: the generation was aborted")
            raise CallLostError("the engine aborted the generation")
        ids = generation.token_ids
        size = 4 * len(generation.token_ids)
        message, token_logprobs = await self._locked(
            session, size, self._record, session.ledger, prepared, generation, req.logprobs
        )
        call = Call(f"{_ID_PREFIX[req.api]}{uuid.uuid4().hex}", prepared.chain, req.api)
        session.calls[call.id] = call
        if req.api == "responses" and req.store:
            session.histories[call.id] = [*messages, message]
        return Answer(
            id=call.id,
            created=int(time.time()),
            model=self.model_name,
            message=message,
            finish_reason=generation.finish_reason,
            prompt_tokens=len(prepared.prompt_ids),
            completion_tokens=len(ids),
            token_logprobs=token_logprobs,
        )

    def _record(
        self, ledger: SessionLedger, prepared: Prepared, generation: Generation, logprobs: bool
    ) -> tuple[Message, list[tuple[str, float]] | None]:
        """The ledger's record of a generation, and its per-token logprobs when asked for."""
        ids, lps = generation.token_ids, generation.logprobs
        finish, stop = generation.finish_reason, generation.stop_reason
        versions = generation.versions or None
        message = ledger.record(prepared, ids, lps, versions, finish, stop_reason=stop)
        if not logprobs:
            return message, None
        return message, [(self.tokenizer.decode([t]), lp) for t, lp in zip(ids, lps, strict=True)]


def _consume(future: asyncio.Future[Answer]) -> None:
    """Retrieve a generation's exception (its request may be gone)."""
    if not future.cancelled():
        future.exception()


async def _json(request: web.Request) -> dict[str, Any]:
    return (await _sized_json(request))[0]


async def _sized_json(request: web.Request) -> tuple[dict[str, Any], int]:
    """The body as a JSON object, and its size in bytes."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        limit = request.app._client_max_size
        raise RequestError(f"the request body is over {limit} bytes", status=413) from exc
    try:
        body = json.loads(raw) if raw else {}
    except (ValueError, UnicodeDecodeError) as exc:
        kind = request.content_type
        raise RequestError(f"malformed JSON body (Content-Type {kind}): {exc}") from exc
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body, len(raw)


def _reward_value(value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise RequestError("reward must be a number", field="reward")
    return float(value)


def _retry_count(request: web.Request) -> int:
    try:
        return int(request.headers.get(RETRY_HEADER, "0"))
    except ValueError:
        return 0


def _error(api: Api | None, exc: RequestError) -> web.Response:
    body = protocols.error_body(api, exc.status, str(exc), exc.field)
    return web.json_response(body, status=exc.status, headers=_NO_RETRY)


def _frames(req: ChatRequest, answer: Answer) -> Iterable[bytes]:
    if req.api == "chat":
        for chunk in protocols.chat_chunks(answer, req.include_usage):
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"
        return
    events = protocols.response_events if req.api == "responses" else protocols.anthropic_events
    for name, data in events(answer):
        yield f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


async def _send(
    request: web.Request, req: ChatRequest, answer: Answer
) -> tuple[web.StreamResponse, bool]:
    """Write the answer; the flag says whether the client received all of it."""
    response: web.StreamResponse
    if req.stream:
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        response = web.StreamResponse(headers=headers)
    elif req.api == "chat":
        response = web.json_response(protocols.chat_completion(answer))
    elif req.api == "responses":
        response = web.json_response(protocols.response_object(answer))
    else:
        response = web.json_response(protocols.anthropic_message(answer))
    if request.transport is None or request.transport.is_closing():
        return response, False
    try:
        await response.prepare(request)
        if req.stream:
            for frame in _frames(req, answer):
                await response.write(frame)
        await response.write_eof()
    except ConnectionError:  # the client went away while we wrote (aiohttp: a reset error)
        return response, False
    return response, True
