"""Small file helpers every component shares: checksums, safetensors files with the normal file
mode, strict JSON of floats, and telling a local path from a Hugging Face hub id.

No torch.distributed here: the drafters' architecture files import this module too.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

from dspark_ds.errors import ConfigError


def sha256_file(path: str | Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """safetensors' `save_file`, atomically (temp file + rename) and with the mode any other
    file gets (0666 & ~umask).

    NOTE: `safetensors.torch.save_file` creates its file with mode 0600, so a drafter or token
    store written by one user cannot be read by a serving or training job of another."""
    # lazy: safetensors.torch imports torch (1 s); files.py is standard library
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=metadata)
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)


def json_safe(x):
    """`x` (nested dicts, lists and tuples) with each NaN or infinite float as None: strict JSON,
    which any reader loads (`json.dumps` would write NaN / Infinity)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


def looks_local(path: str) -> bool:
    """Whether `path` can only mean a local file or directory, not a hub id ("org/name").

    Local-looking: an absolute path; one starting with `./`, `../` or `~`; `.` or `..`; one
    with more than one `/` (hub ids have at most one) or ending in `/`; or `a/b` where `a` is
    an existing local directory. Anything else (`Qwen/Qwen3-8B`, `gpt2`) may be a hub id."""
    p = str(path)
    if p in (".", "..") or p.startswith(("/", "./", "../", "~")):
        return True
    if p.count("/") > 1 or p.endswith("/"):
        return True
    head, sep, _ = p.partition("/")
    return bool(sep) and Path(head).is_dir()


def check_model_path(path: str | None, option: str) -> None:
    """Refuse at once (ConfigError naming `option`) a local-looking path that does not exist,
    instead of letting transformers ask the hub for it (~25 s of retries offline)."""
    if path and looks_local(path) and not Path(path).expanduser().exists():
        raise ConfigError(
            f"{option}: {path} does not exist (a local path; a hub id looks like org/name)"
        )


def check_exists(path: str | Path, option: str, what: str = "file") -> None:
    """ConfigError naming `option` when `path` does not exist."""
    if not Path(path).expanduser().exists():
        raise ConfigError(f"{option}: {what} {path} does not exist")


def first_line(err: BaseException) -> str:
    """The first non-empty line of an error's message (transformers' hub errors run to five)."""
    return next((line.strip() for line in str(err).splitlines() if line.strip()), repr(err))


def write_between_markers(path: Path, begin: str, end: str, text: str, header: str = "") -> None:
    """Puts `text` between the lines `begin` and `end` of the Markdown file `path`, keeping the
    rest; a file without both markers (or none) gets `header`, then the marked block appended."""
    old = path.read_text() if path.is_file() else ""
    block = f"{begin}\n{text}\n{end}"
    if begin in old and end in old:
        before, rest = old.split(begin, 1)
        new = before + block + rest.split(end, 1)[1]
    else:
        new = (old or header) + ("\n" if old or header else "") + block + "\n"
    path.write_text(new)
