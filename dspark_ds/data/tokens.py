"""Tokenised samples (``input_ids`` + ``loss_mask``) in memory or on disk, and ``prepare``.

On disk (``dspark-ds prepare``): ``<dir>/tokens.safetensors`` with flat ``input_ids`` (int32),
``loss_mask`` (uint8) and ``offsets`` (int64, N+1) — sample ``i`` is ``[offsets[i],
offsets[i+1])`` — and ``<dir>/meta.json`` (tokenizer, template settings, counts, pad id,
fingerprint). Samples are read lazily through safetensors' memory map.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import safetensors
import torch
from safetensors import safe_open
from tqdm import tqdm

from dspark_ds.data.chat import ChatTokenizer, load_tokenizer
from dspark_ds.data.config import DataConfig, PrepareConfig
from dspark_ds.data.formats import ReadStats, read_conversations
from dspark_ds.distributed import print0, rank_and_world
from dspark_ds.errors import ConfigError
from dspark_ds.files import check_model_path, first_line, save_safetensors

TOKENS_FILE = "tokens.safetensors"
META_FILE = "meta.json"


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write via a temporary file + rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class TokenStore:
    """N variable-length samples as flat arrays + offsets (in memory or memory-mapped)."""

    def __init__(
        self,
        input_ids: torch.Tensor | None,
        loss_mask: torch.Tensor | None,
        offsets: torch.Tensor,
        meta: dict,
        path: str | None = None,
    ):
        self._ids, self._mask, self.offsets, self.meta, self.path = (
            input_ids,
            loss_mask,
            offsets,
            meta,
            path,
        )
        self._file = None
        self.lengths = (offsets[1:] - offsets[:-1]).tolist()

    @classmethod
    def from_samples(cls, samples: list[tuple[list[int], list[int]]], meta: dict) -> TokenStore:
        lengths = torch.tensor([len(ids) for ids, _ in samples], dtype=torch.int64)
        offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        ids = torch.tensor([t for s, _ in samples for t in s], dtype=torch.int32)
        mask = torch.tensor([t for _, m in samples for t in m], dtype=torch.uint8)
        meta = dict(meta, num_samples=len(samples), num_tokens=int(offsets[-1]))
        meta["fingerprint"] = fingerprint(ids, mask, offsets)
        return cls(ids, mask, offsets, meta)

    @classmethod
    def load(cls, directory: str | Path) -> TokenStore:
        directory = Path(directory)
        meta_path = directory / META_FILE
        if not meta_path.exists():
            raise ConfigError(
                f"data.paths: {directory} is not a prepared data set (no {META_FILE}); "
                "run `dspark-ds prepare` first"
            )
        try:
            meta = json.loads(meta_path.read_text())
            with safe_open(str(directory / TOKENS_FILE), framework="pt") as f:
                offsets = f.get_tensor("offsets")
        except (OSError, ValueError, safetensors.SafetensorError) as err:
            raise ConfigError(
                f"data.paths: the prepared data set {directory} is damaged ({err}); run "
                "`dspark-ds prepare` again"
            ) from None
        return cls(None, None, offsets, meta, path=str(directory / TOKENS_FILE))

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_safetensors(
            {"input_ids": self._ids, "loss_mask": self._mask, "offsets": self.offsets},
            directory / TOKENS_FILE,
        )
        atomic_write_text(directory / META_FILE, json.dumps(self.meta, indent=2))

    def __len__(self) -> int:
        return len(self.lengths)

    def token_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, loss_mask) of every sample, flat (read whole from the file when mapped)."""
        if self._ids is not None:
            return self._ids, self._mask
        with safe_open(self.path, framework="pt") as f:
            return f.get_tensor("input_ids"), f.get_tensor("loss_mask")

    def __getstate__(self):  # NOTE: safetensors handles do not survive fork/pickle; reopen.
        return {**self.__dict__, "_file": None}

    def __getitem__(self, i: int) -> dict:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        if self._ids is not None:
            ids, mask = self._ids[a:b], self._mask[a:b]
        else:
            if self._file is None:
                self._file = safe_open(self.path, framework="pt")
            ids = self._file.get_slice("input_ids")[a:b]
            mask = self._file.get_slice("loss_mask")[a:b]
        return {"sample_id": i, "input_ids": ids.long(), "loss_mask": mask.long()}


def fingerprint(ids: torch.Tensor, mask: torch.Tensor, offsets: torch.Tensor) -> str:
    """sha256 over the tokens, masks and boundaries (identifies a data set in cache manifests)."""
    h = hashlib.sha256()
    for t in (offsets.to(torch.int64), ids.to(torch.int32), mask.to(torch.uint8)):
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def tokenize_conversations(
    cfg: DataConfig, tokenizer_path: str, progress: bool = True
) -> tuple[TokenStore, dict]:
    """Read + normalise + tokenise ``cfg.paths`` → (TokenStore, counts)."""
    for i, path in enumerate(cfg.paths):  # before the tokenizer, which may come from the hub
        if Path(path).is_file() and Path(path).stat().st_size == 0:
            raise ConfigError(f"data.paths[{i}]: {path} is empty")
        if not Path(path).exists():
            raise ConfigError(f"data.paths[{i}]: file {path} does not exist")
    try:
        tok = load_tokenizer(tokenizer_path)
    except OSError as err:
        raise ConfigError(
            f"data.tokenizer: cannot load a tokenizer from {tokenizer_path!r} ({first_line(err)})"
        ) from None
    chat = ChatTokenizer(
        tok, cfg.max_length, cfg.enable_thinking, cfg.system_prompt, chat_format=cfg.chat_format
    )
    stats = ReadStats()
    samples, too_short, truncated = [], 0, 0
    rows = read_conversations(cfg.paths, cfg.skip_bad_rows, stats)
    for row in tqdm(rows, desc="tokenize", unit="row", disable=not progress, mininterval=1.0):
        ids, mask = chat(row.messages, row.source)
        full_len = len(ids)
        if sum(mask) < cfg.min_loss_tokens:
            too_short += 1
            continue
        truncated += full_len >= cfg.max_length
        samples.append((ids, mask))
    if not samples:
        hint = " (prompts-only rows need `dspark-ds regenerate` first)" if too_short else ""
        raise ConfigError(
            f"data.paths: no usable sample in {', '.join(map(str, cfg.paths))}: {stats.rows} "
            f"rows read, {too_short} with fewer than data.min_loss_tokens={cfg.min_loss_tokens} "
            f"assistant tokens within data.max_length={cfg.max_length}{hint}"
        )
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    meta = {
        "format": "dspark-ds-tokens",
        "version": 1,
        "tokenizer": tokenizer_path,
        "max_length": cfg.max_length,
        "enable_thinking": cfg.enable_thinking,
        "system_prompt": cfg.system_prompt,
        "chat_format": cfg.chat_format,
        "generation_markers": chat.use_markers,
        "pad_token_id": int(pad_id if pad_id is not None else 0),
        "vocab_size": len(tok),
        "sources": [str(p) for p in cfg.paths],
    }
    counts = {
        "rows": stats.rows,
        "bad_rows": stats.bad,
        "skipped_few_loss_tokens": too_short,
        "truncated": int(truncated),
        "samples": len(samples),
    }
    if stats.errors:
        counts["first_errors"] = stats.errors
    return TokenStore.from_samples(samples, meta), counts


def load_samples(cfg: DataConfig, tokenizer_path: str | None = None) -> TokenStore:
    """``cfg.paths`` as a TokenStore: a prepared directory is memory-mapped, jsonl is tokenised."""
    if len(cfg.paths) == 1 and Path(cfg.paths[0]).is_dir():
        return TokenStore.load(cfg.paths[0])
    if not cfg.paths:
        raise ConfigError("data.paths is empty: give chat jsonl files or a prepared directory")
    tok = cfg.tokenizer or tokenizer_path
    if not tok:
        raise ConfigError("data.tokenizer (or target.path) is required to tokenise jsonl input")
    check_model_path(cfg.tokenizer, "data.tokenizer")
    store, _ = tokenize_conversations(cfg, tok, progress=rank_and_world()[0] == 0)
    return store


def prepare(cfg: PrepareConfig) -> dict:
    """``dspark-ds prepare``: write ``cfg.output_dir`` and return the counts."""
    if not cfg.output_dir:
        raise ConfigError("output_dir is required")
    if not cfg.data.tokenizer:
        raise ConfigError("data.tokenizer is required (the target's tokenizer path or hub id)")
    check_model_path(cfg.data.tokenizer, "data.tokenizer")
    store, counts = tokenize_conversations(cfg.data, cfg.data.tokenizer)
    store.meta["counts"] = counts
    store.save(cfg.output_dir)
    print0(
        f"[prepare] {counts['samples']} samples, {store.meta['num_tokens']} tokens -> "
        f"{cfg.output_dir} (bad rows skipped: {counts['bad_rows']}, too few assistant "
        f"tokens: {counts['skipped_few_loss_tokens']}, truncated: {counts['truncated']})"
    )
    return counts
