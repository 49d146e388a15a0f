"""A synchronous client of one OpenAI-compatible vLLM server, for `dspark-ds eval --engine.url`:
the model it serves, greedy completions of token-id prompts, and its speculative-decoding
counters (`/metrics`, Prometheus text).

    client = EngineClient(cfg.engine)
    client.check()                          # ConfigError naming the URL when it is unfit
    before = client.counters()              # SpecCounters
    tokens = client.complete(prompt_ids, max_tokens=256, temperature=0.0, stop_token_ids=[2])
    spent = client.counters() - before
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from dspark_ds.errors import ConfigError
from dspark_ds.serve.auth import DEFAULT_KEY_ENV, auth_headers, refused

# vLLM's counter names (a Prometheus counter is exposed with a `_total` suffix)
_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_POSITION = re.compile(r'position="(\d+)"')


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (summed over its engines)."""

    drafts: int = 0
    """Draft rounds (one per request and verification step with drafts)."""
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """Rounds whose k-th draft was accepted (with every one before it)."""

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        width = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine = self.accepted_per_pos + [0] * (width - len(self.accepted_per_pos))
        theirs = other.accepted_per_pos + [0] * (width - len(other.accepted_per_pos))
        return SpecCounters(
            self.drafts - other.drafts,
            self.draft_tokens - other.draft_tokens,
            self.accepted - other.accepted,
            [a - b for a, b in zip(mine, theirs)],
        )

    @property
    def tau(self) -> float:
        """Tokens per verification step: the accepted drafts and the target's own token."""
        return 1.0 + self.accepted / self.drafts if self.drafts else float("nan")

    def as_dict(self) -> dict:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted": self.accepted,
            "accepted_per_pos": list(self.accepted_per_pos),
            "tau": self.tau,
        }


def parse_counters(text: str) -> SpecCounters | None:
    """The counters in a `/metrics` page; None when it has none (no speculative decoding)."""
    out = SpecCounters()
    per_pos: dict[int, float] = {}
    seen = False
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1).removesuffix("_total"), m.group(2) or "", m.group(3)
        if name in _COUNTERS:
            seen = True
            attr = _COUNTERS[name]
            setattr(out, attr, getattr(out, attr) + int(float(value)))
        elif name == _PER_POSITION:
            pos = _POSITION.search(labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0) + float(value)
    if not seen:
        return None
    out.accepted_per_pos = [int(per_pos.get(k, 0)) for k in range(max(per_pos, default=-1) + 1)]
    return out


class EngineClient:
    """One server (an `EngineConfig`: url, model, api_key_env, timeout_s)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.root = cfg.url.rstrip("/").removesuffix("/v1")
        self.model: str | None = cfg.model
        self.key_env = cfg.api_key_env or DEFAULT_KEY_ENV

    def _request(self, method: str, path: str, body: dict | None = None) -> bytes:
        where = f"engine.url {self.root}"
        data = None if body is None else json.dumps(body).encode()
        headers = {**auth_headers(self.key_env), "Content-Type": "application/json"}
        req = urllib.request.Request(self.root + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
                return resp.read()
        except urllib.error.HTTPError as err:
            if err.code in (401, 403):
                raise refused(
                    where, f"{method} {path}", err.code, self.key_env, "engine.api_key_env"
                ) from None
            detail = " ".join(err.read().decode("utf-8", "replace").split())[:200]
            raise ConfigError(
                f"{where}: {method} {path} answered HTTP {err.code} ({detail})"
            ) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise ConfigError(f"{where}: unreachable ({reason})") from None

    def check(self) -> str:
        """The server lists the model (`engine.model`, else its only one) and reports vLLM's
        speculative-decoding counters. Returns the model."""
        raw = self._request("GET", "/v1/models")
        try:
            ids = [m["id"] for m in json.loads(raw)["data"]]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(
                f"engine.url {self.root}: GET /v1/models is not an OpenAI model list"
            ) from None
        if self.model is None:
            if len(ids) != 1:
                raise ConfigError(
                    f"engine.url {self.root}: serves {len(ids)} models ({', '.join(ids[:5])});"
                    " choose one with --engine.model"
                )
            self.model = ids[0]
        elif self.model not in ids:
            raise ConfigError(
                f"engine.url {self.root}: serves {', '.join(ids[:5]) or 'no model'}, not "
                f"{self.model!r}"
            )
        if self.counters() is None:
            raise ConfigError(
                f"engine.url {self.root}: /metrics has no vllm:spec_decode_* counters (a vLLM "
                "server started with --speculative-config, and without --disable-log-stats?)"
            )
        return self.model

    def counters(self) -> SpecCounters | None:
        return parse_counters(self._request("GET", "/metrics").decode("utf-8", "replace"))

    def complete(
        self, prompt_ids: list[int], *, max_tokens: int, temperature: float, stop_token_ids
    ) -> list[int]:
        """The server's completion of a token-id prompt, as token ids (vLLM's
        `return_token_ids`)."""
        body = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "max_tokens": int(max_tokens),
            "temperature": float(temperature),
            "stop_token_ids": list(stop_token_ids),
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        raw = self._request("POST", "/v1/completions", body)
        try:
            choice = json.loads(raw)["choices"][0]
            return [int(t) for t in choice["token_ids"]]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ConfigError(
                f"engine.url {self.root}: POST /v1/completions returned no token_ids (a vLLM "
                "server answers them with return_token_ids)"
            ) from None
