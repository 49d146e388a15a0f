"""The API key of a key-protected OpenAI-compatible server (`vllm serve --api-key`, SGLang's
`--api-key`): read from the environment variable a config names, sent as OpenAI clients send
it (`Authorization: Bearer <key>`), never stored (configs and MLflow hold the variable's name
only) and named, not shown, when a server refuses it."""

from __future__ import annotations

import os

from dspark_ds.errors import ConfigError

DEFAULT_KEY_ENV = "OPENAI_API_KEY"


def auth_headers(key_env: str | None) -> dict[str, str]:
    """The request headers for a server whose key is in `$key_env` (none when it is unset)."""
    key = os.environ.get(key_env or "", "")
    return {"Authorization": f"Bearer {key}"} if key else {}


def refused(where: str, request: str, status: int, key_env: str | None, option: str) -> ConfigError:
    """The one line for an HTTP 401 / 403 answer: which server, and what to set."""
    var = key_env or DEFAULT_KEY_ENV
    if os.environ.get(var):
        what = f"the key in ${var} was refused; set ${var} to the key the server was started with"
    else:
        what = f"it wants an API key: set ${var} to it (or name another variable with {option})"
    return ConfigError(f"{where}: {request} answered HTTP {status} ({what})")
