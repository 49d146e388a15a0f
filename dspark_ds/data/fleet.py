"""A fleet of OpenAI-compatible inference servers (SGLang, vLLM, ``transformers serve``) that
answers chat requests for one client process.

    async with Fleet(cfg.server, say=print) as fleet:
        model = await fleet.check(fields)  # ConfigError naming the URL when a server is unfit
        answer = await fleet.chat(body)  # an Answer, or RequestFailed once the retries are spent
        result = await fleet.request("/completions", body, parse)  # any endpoint, any answer

`chat` is what `regenerate` sends; `request` is the same routing and retries for another
endpoint, its answer parsed by the caller (a ValueError from ``parse`` or a `BadAnswer` from
``check`` counts as a failure of that server; ``served.py``'s hidden-state requests use it).

- Routing: each request goes to the server in rotation with the fewest requests in flight.
- A connection failure, a timeout, an HTTP 5xx or an answer that is not an OpenAI chat
  completion takes the server out of rotation. It is probed every ``probe_interval_s``
  (``/health``, then ``/v1/models`` must list the model) and is back once it answers. The
  request is retried on the fleet after a backoff (``retry_backoff_s``, doubled per retry);
  HTTP 408 / 429 are retried without taking the server out; any other 4xx is the request's own
  fault (a prompt too long for the server, say) and fails at once.
- No server in rotation for ``give_up_s``: ``FleetDown``.
- Key-protected servers: every request carries ``Authorization: Bearer`` with the key in the
  environment variable ``api_key_env`` names (``OPENAI_API_KEY``); HTTP 401 / 403 stops the run
  at once (ConfigError naming the server and what to set), keeping every finished row.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from dspark_ds.data.config import FleetConfig
from dspark_ds.errors import ConfigError
from dspark_ds.serve.auth import auth_headers, refused

MAX_BACKOFF_S = 60.0
CHECK_TIMEOUT_S = 30.0  # the start-up checks and the probes wait at most this long


class RequestFailed(Exception):
    """A request that failed on every try; the message names the last server and why."""


class FleetDown(RuntimeError):
    """No server has been in rotation for ``give_up_s``."""


class BadAnswer(Exception):
    """What a request's ``check`` raises for an answer that cannot be used (a missing or damaged
    file, say): retried like a server failure; ``down`` takes the server out of rotation."""

    def __init__(self, reason: str, *, down: bool = False):
        super().__init__(reason)
        self.reason, self.down = reason, down


class _Failure(Exception):
    def __init__(self, reason: str, *, down: bool, retry: bool = True):
        super().__init__(reason)
        self.reason, self.down, self.retry = reason, down, retry


@dataclass
class Answer:
    text: str
    finish_reason: str
    """``stop``, or ``length`` when ``max_tokens`` cut the answer."""
    completion_tokens: int
    """Tokens generated (the server's ``usage``; 0 when it reports none)."""


@dataclass
class Server:
    """One server of the fleet and what it has done so far."""

    base: str
    """``http://host:port/v1``"""
    in_flight: int = 0
    up: bool = True
    sent: int = 0
    answered: int = 0
    errors: int = 0
    outages: int = 0
    tokens: int = 0

    @property
    def root(self) -> str:
        """Where ``/health`` lives: the base URL without its ``/v1``."""
        return self.base.removesuffix("/v1")


def base_url(url: str) -> str:
    """``http://h:30000`` → ``http://h:30000/v1``; a URL with a path is kept as given."""
    url = url.rstrip("/")
    return url + "/v1" if urlsplit(url).path == "" else url


def _brief(raw: bytes | str, limit: int = 160) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    text = " ".join(text.split())
    return text[:limit] + ("..." if len(text) > limit else "") if text else "an empty body"


def _error_detail(raw: bytes) -> str:
    """The message of an error answer (FastAPI's ``detail``, OpenAI's ``error.message``)."""
    try:
        data = json.loads(raw)
        if isinstance(data, dict):
            detail = data.get("detail") or data.get("message") or data.get("error")
            if isinstance(detail, dict):
                detail = detail.get("message") or detail
            if detail:
                return _brief(detail if isinstance(detail, str) else json.dumps(detail))
    except ValueError:
        pass
    return _brief(raw)


def _error_text(err: BaseException) -> str:
    return _brief(str(err) or type(err).__name__)


def parse_completion(raw: bytes) -> Answer:
    """An OpenAI chat completion's first choice; ValueError when ``raw`` is not one."""
    try:
        data = json.loads(raw)
        choice = data["choices"][0]
        content = choice["message"].get("content") or ""
        usage = data.get("usage") or {}
        if not isinstance(content, str) or not isinstance(usage, dict):
            raise TypeError
        return Answer(
            content, str(choice.get("finish_reason")), int(usage.get("completion_tokens") or 0)
        )
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise ValueError(f"not an OpenAI chat completion: {_brief(raw)}") from None


def _model_ids(raw: bytes) -> list[str]:
    """The ids of a ``/v1/models`` answer; ValueError when ``raw`` is not one."""
    try:
        ids = [m["id"] for m in json.loads(raw)["data"]]
        if not all(isinstance(i, str) for i in ids):
            raise TypeError
        return ids
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"not an OpenAI model list: {_brief(raw)}") from None


class Fleet:
    """The servers of ``cfg.urls`` behind one ``chat`` call (module docstring). An async context
    manager: it owns the HTTP session and the probes of servers out of rotation."""

    def __init__(
        self,
        cfg: FleetConfig,
        say: Callable[[str], None] = print,
        label: str = "regenerate",
        option: str = "server",
    ):
        self.cfg = cfg
        self.say = say
        self.label, self.option = label, option
        self.servers = [Server(base_url(u)) for u in cfg.urls]
        self.model: str | None = cfg.model
        self.last_error = ""
        self._session: aiohttp.ClientSession | None = None
        self._probes: set[asyncio.Task] = set()
        self._some_up: asyncio.Event | None = None
        self._none_up_since: float | None = None

    async def __aenter__(self) -> Fleet:
        # NOTE: aiohttp's connector allows 100 connections by default, which would cap the
        # concurrency silently; `concurrency` already bounds what is in flight.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), headers=auth_headers(self.cfg.api_key_env)
        )
        self._some_up = asyncio.Event()
        self._some_up.set()
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self._probes:
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
        await self._session.close()

    # ---- start-up checks ------------------------------------------------------------------
    async def check(self, fields: dict) -> str:
        """Every server reachable, listing the model (`check_models`) and answering a one-token
        chat request with the run's ``fields`` as an OpenAI server does. Returns the model;
        ConfigError naming the first unfit URL."""
        model = await self.check_models()
        answers = await asyncio.gather(
            *(self._first_answer(i, s, fields) for i, s in enumerate(self.servers)),
            return_exceptions=True,
        )
        for result in answers:
            if isinstance(result, BaseException):
                raise result
        return model

    async def check_models(self) -> str:
        """Every server reachable and listing the model (``cfg.model``, else the only one the
        first server lists); returns it, or ConfigError naming the first unfit URL."""
        listed = await asyncio.gather(
            *(self._listed_models(i, s) for i, s in enumerate(self.servers)),
            return_exceptions=True,
        )
        for result in listed:
            if isinstance(result, BaseException):
                raise result
        if self.model is None:
            if len(listed[0]) != 1:
                raise ConfigError(
                    f"{self.where(0)}: lists {len(listed[0])} models "
                    f"({', '.join(listed[0][:5])}); choose one with --{self.option}.model"
                )
            self.model = listed[0][0]
        for i, ids in enumerate(listed):
            if self.model not in ids:
                raise ConfigError(
                    f"{self.where(i)}: serves {', '.join(ids[:5]) or 'no model'}, not "
                    f"{self.model!r}"
                )
        return self.model

    def where(self, i: int) -> str:
        """``server.urls[1] http://h2:30000/v1``: the option and the server, for messages."""
        return f"{self.option}.urls[{i}] {self.servers[i].base}"

    async def _listed_models(self, i: int, server: Server) -> list[str]:
        where = self.where(i)
        try:
            async with self._session.get(f"{server.base}/models", timeout=self._check_timeout) as r:
                raw, status = await r.read(), r.status
        except (asyncio.TimeoutError, TimeoutError):
            raise ConfigError(f"{where}: no answer within {CHECK_TIMEOUT_S:g} s") from None
        except aiohttp.ClientError as err:
            raise ConfigError(f"{where}: unreachable ({_error_text(err)})") from None
        if status in (401, 403):
            raise refused(
                where, "GET /models", status, self.cfg.api_key_env, f"{self.option}.api_key_env"
            )
        if status != 200:
            raise ConfigError(
                f"{where}: GET /models answered HTTP {status} ({_error_detail(raw)}); not an "
                "OpenAI-compatible server"
            )
        try:
            return _model_ids(raw)
        except ValueError as err:
            raise ConfigError(f"{where}: GET /models: {err}") from None

    async def _first_answer(self, i: int, server: Server, fields: dict) -> None:
        body = {**fields, "model": self.model, "max_tokens": 1}
        body["messages"] = [{"role": "user", "content": "Hello"}]
        try:
            await self.post(
                server,
                "/chat/completions",
                body,
                parse_completion,
                timeout_s=max(self.cfg.timeout_s, CHECK_TIMEOUT_S),
            )
        except _Failure as f:
            raise ConfigError(
                f"{self.where(i)}: a one-token chat request failed: {f.reason}"
            ) from None

    @property
    def _check_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=min(self.cfg.timeout_s, CHECK_TIMEOUT_S))

    # ---- requests ---------------------------------------------------------------------------
    async def chat(self, body: dict) -> Answer:
        """POST ``body`` (plus the model) to ``/chat/completions`` of the least busy server in
        rotation, retried as the module docstring says."""
        answer, server = await self.request("/chat/completions", body, parse_completion)
        server.tokens += answer.completion_tokens
        return answer

    async def request(
        self,
        path: str,
        body: dict,
        parse: Callable[[bytes], object],
        check: Callable[[object, Server], Awaitable[object]] | None = None,
    ):
        """POST ``body`` (plus the model) to ``path`` of the least busy server in rotation;
        ``parse`` reads the answer (a ValueError: the server is taken out of rotation) and the
        optional ``check(result, server)`` uses it (a `BadAnswer`: that try failed). Retried as
        the module docstring says; returns (what ``check`` returned, else the parsed answer; the
        server that answered)."""
        body = {**body, "model": self.model}
        failures = 0
        while True:
            server = await self._acquire()
            failure = None
            try:
                result = await self.post(server, path, body, parse, timeout_s=self.cfg.timeout_s)
                if check is not None:
                    result = await check(result, server)
            except _Failure as f:
                failure = f
            except BadAnswer as bad:
                failure = _Failure(bad.reason, down=bad.down)
            finally:
                server.in_flight -= 1
            if failure is None:
                server.answered += 1
                return result, server
            server.errors += 1
            self.last_error = reason = f"{server.base}: {failure.reason}"
            if failure.down:
                self._take_down(server, reason)
            if not failure.retry or failures >= self.cfg.max_retries:
                tries = f"{failures + 1} tr{'y' if failures == 0 else 'ies'}"
                raise RequestFailed(f"{reason} ({tries})")
            failures += 1
            await asyncio.sleep(min(MAX_BACKOFF_S, self.cfg.retry_backoff_s * 2 ** (failures - 1)))

    async def _acquire(self) -> Server:
        """The server in rotation with the fewest requests in flight, counted as busy; waits while
        none is in rotation, at most ``give_up_s`` since the last one went out."""
        while True:
            up = [s for s in self.servers if s.up]
            if up:
                server = min(up, key=lambda s: (s.in_flight, s.sent))
                server.in_flight += 1
                server.sent += 1
                return server
            left = self.cfg.give_up_s - (time.monotonic() - self._none_up_since)
            if left <= 0:
                raise FleetDown(
                    f"no server has been in rotation for {self.cfg.give_up_s:g} s ({self.option}."
                    f"give_up_s); the last error: {self.last_error}"
                )
            try:
                await asyncio.wait_for(self._some_up.wait(), timeout=left)
            except (asyncio.TimeoutError, TimeoutError):
                pass

    async def post(
        self,
        server: Server,
        path: str,
        body: dict,
        parse: Callable[[bytes], object],
        timeout_s: float,
    ):
        """One POST of ``body`` to ``server``'s ``path``, its answer through ``parse``; a
        `_Failure` saying whether to take the server out and whether to retry."""
        try:
            async with self._session.post(
                f"{server.base}{path}", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                raw, status = await resp.read(), resp.status
        except (asyncio.TimeoutError, TimeoutError):
            raise _Failure(f"no answer within {timeout_s:g} s", down=True) from None
        except aiohttp.ClientError as err:
            raise _Failure(f"request failed ({_error_text(err)})", down=True) from None
        if status in (401, 403):  # no retry helps: the run stops, keeping what it finished
            raise refused(
                server.base,
                f"POST {path}",
                status,
                self.cfg.api_key_env,
                f"{self.option}.api_key_env",
            )
        if status in (408, 429):
            raise _Failure(f"HTTP {status} ({_error_detail(raw)})", down=False)
        if status >= 500:
            raise _Failure(f"HTTP {status} ({_error_detail(raw)})", down=True)
        if status >= 400:
            raise _Failure(f"HTTP {status} ({_error_detail(raw)})", down=False, retry=False)
        try:
            return parse(raw)
        except ValueError as err:
            raise _Failure(str(err), down=True) from None

    # ---- rotation ---------------------------------------------------------------------------
    def _take_down(self, server: Server, reason: str) -> None:
        if not server.up:
            return
        server.up = False
        server.outages += 1
        self.say(f"[{self.label}] out of rotation: {reason}")
        if not any(s.up for s in self.servers):
            self._some_up.clear()
            self._none_up_since = time.monotonic()
        task = asyncio.create_task(self._probe_until_up(server))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe_until_up(self, server: Server) -> None:
        while True:
            await asyncio.sleep(self.cfg.probe_interval_s)
            if await self._healthy(server):
                server.up = True
                self._some_up.set()
                self._none_up_since = None
                self.say(f"[{self.label}] back in rotation: {server.base}")
                return

    async def _healthy(self, server: Server) -> bool:
        """``/health`` answers 200 (or does not exist) and ``/v1/models`` lists the model."""
        try:
            async with self._session.get(f"{server.root}/health", timeout=self._check_timeout) as r:
                if r.status not in (200, 404):
                    return False
            async with self._session.get(f"{server.base}/models", timeout=self._check_timeout) as r:
                return r.status == 200 and self.model in _model_ids(await r.read())
        except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError, ValueError):
            return False
