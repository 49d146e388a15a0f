"""Read chat jsonl in the common layouts and normalise every row to OpenAI ``messages``.

Accepted rows (one JSON object per line):

- ``{"messages": [{"role": "user", "content": "..."}, ...]}`` (OpenAI; content may be a list of
  ``{"type": "text", "text": ...}`` parts);
- ``{"conversations": [{"from": "human", "value": "..."}, ...]}`` (ShareGPT; ``role``/``content``
  entries are accepted too);
- ``{"turns": ["first user turn", "second user turn", ...]}`` (prompts only, as in the
  speculative-decoding benchmarks; answers come from ``regenerate``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dspark_ds.errors import ConfigError

_ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
}


class DataError(ConfigError):
    """A malformed input row; the message starts with ``file:line``."""


@dataclass
class Row:
    """One normalised conversation and where it came from."""

    messages: list[dict]
    source: str
    """``file:line`` (1-based line)."""
    index: int
    """Position among the good rows of all files, in reading order (the sample id)."""


@dataclass
class ReadStats:
    rows: int = 0
    bad: int = 0
    errors: list[str] = field(default_factory=list)
    """The first few bad-row messages (all are counted)."""


def _content(value, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        texts = []
        for part in value:
            if (
                isinstance(part, dict)
                and part.get("type", "text") == "text"
                and isinstance(part.get("text"), str)
            ):
                texts.append(part["text"])
            else:
                raise DataError(f"{where}: only text content parts are supported, got {part!r:.80}")
        return "".join(texts)
    raise DataError(f"{where}: message content must be a string, got {type(value).__name__}")


def normalise_row(obj, where: str) -> list[dict]:
    """One decoded jsonl object → ``[{"role", "content"}, ...]``; DataError naming ``where``."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj or "conversations" in obj:
        key = "messages" if "messages" in obj else "conversations"
        raw = obj[key]
        if not isinstance(raw, list) or not raw:
            raise DataError(f"{where}: '{key}' must be a non-empty list")
        messages = []
        for j, m in enumerate(raw):
            if not isinstance(m, dict):
                raise DataError(f"{where}: {key}[{j}] must be an object")
            role = m.get("role", m.get("from"))
            content = m.get("content", m.get("value"))
            if role is None or content is None:
                raise DataError(f"{where}: {key}[{j}] needs role/content (or from/value)")
            norm = _ROLE_ALIASES.get(str(role).lower())
            if norm is None:
                raise DataError(f"{where}: {key}[{j}] has unknown role {role!r}")
            messages.append({"role": norm, "content": _content(content, f"{where}: {key}[{j}]")})
    elif "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise DataError(f"{where}: 'turns' must be a non-empty list of strings")
        messages = [{"role": "user", "content": t} for t in turns]
    else:
        raise DataError(
            f"{where}: no 'messages', 'conversations' or 'turns' field (keys: {sorted(obj)[:8]})"
        )
    for j, m in enumerate(messages):
        if m["role"] == "system" and j != 0:
            raise DataError(f"{where}: a system message is only allowed first (message {j})")
    body = messages[1:] if messages[0]["role"] == "system" else messages
    if not body or body[0]["role"] != "user":
        raise DataError(f"{where}: the conversation must start with a user turn")
    for a, b in zip(body, body[1:]):
        if a["role"] == b["role"] == "assistant":
            raise DataError(f"{where}: two assistant turns in a row")
    return messages


def read_conversations(
    paths: list[str], skip_bad_rows: bool = False, stats: ReadStats | None = None
) -> Iterator[Row]:
    """Yield normalised rows of ``paths`` in order; bad rows (malformed JSON or layout, bytes
    that are not UTF-8) raise or are counted in ``stats``. A missing file, or files that hold no
    row at all, raise DataError naming ``data.paths``."""
    stats = stats if stats is not None else ReadStats()
    for path in paths:
        if not Path(path).is_file():
            what = "is a directory, not a jsonl file" if Path(path).is_dir() else "does not exist"
            raise DataError(f"data.paths: {path} {what}")
    index = 0
    for path in paths:
        # NOTE: bytes, decoded line by line: a stray non-UTF-8 byte is one bad row, not a
        # UnicodeDecodeError somewhere in the file.
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if lineno == 1:
                    raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark
                if not raw.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise DataError(
                            f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte "
                            f"{e.start + 1} of the line)"
                        ) from None
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(
                            f"{where}: invalid JSON ({e.msg} at column {e.colno})"
                        ) from None
                    messages = normalise_row(obj, where)
                except DataError as e:
                    if not skip_bad_rows:
                        raise
                    stats.bad += 1
                    if len(stats.errors) < 10:
                        stats.errors.append(str(e))
                    continue
                stats.rows += 1
                yield Row(messages, where, index)
                index += 1
    if stats.rows == 0 and stats.bad == 0:
        raise DataError(f"data.paths: {', '.join(map(str, paths))} holds no rows (empty)")
    if stats.rows == 0:
        raise DataError(
            f"data.paths: all {stats.bad} rows of {', '.join(map(str, paths))} are malformed "
            f"(first: {stats.errors[0]})"
        )
