"""How often each target token is supervised in the training data: what a reduced draft vocabulary
(`model.draft_vocab_size`, drafters/common/vocab.py) keeps the N most frequent of.

Counted once, over the tokens whose loss_mask is 1 (what the drafter learns to predict, as
speculators counts them), and stored beside the data: `token_counts.safetensors` in the prepared
data directory or the cache directory (the run directory for data tokenised on the fly or
synthetic data, or when the data's directory is read-only), keyed by the data's fingerprint and
the vocabulary size; a later run on the same data reads it. Rank 0 reads or counts, then sends
the counts to every rank (one broadcast): every rank drafts over the same vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dspark_ds import distributed
from dspark_ds.data.cache import TargetCache
from dspark_ds.data.tokens import TokenStore
from dspark_ds.files import save_safetensors

COUNTS_FILE = "token_counts.safetensors"


def _store_chunks(store: TokenStore) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    yield store.token_arrays()


def _cache_chunks(cache: TargetCache) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for shard in cache.manifest["shards"]:
        with safe_open(str(cache.cache_dir / shard["file"]), framework="pt") as f:
            yield f.get_tensor("input_ids"), f.get_tensor("loss_mask")


def _sample_chunks(source) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for i in range(source.num_samples):
        s = source.sample(i)
        yield s["input_ids"], s["loss_mask"]


def where_and_chunks(source, run_dir: Path) -> tuple[Path, str, Iterator]:
    """(the directory the counts go in, the data's fingerprint, its (ids, mask) chunks) of a
    training batch source (the data loader's, or synthetic data's)."""
    samples = getattr(source, "samples", None)
    cache = getattr(source, "cache", None)
    if samples is not None:
        where = Path(samples.path).parent if samples.path else run_dir
        return where, str(samples.meta.get("fingerprint")), _store_chunks(samples)
    if cache is not None:
        return cache.cache_dir, str(cache.meta.get("fingerprint")), _cache_chunks(cache)
    if hasattr(source, "sample"):  # synthetic: deterministic per seed and sample id
        key = f"synthetic-{source.seed}-{source.num_samples}-{source.seq_len}"
        return run_dir, key, _sample_chunks(source)
    raise TypeError(f"no tokens to count in a {type(source).__name__}")


def count_tokens(chunks, vocab_size: int) -> torch.Tensor:
    """int64 [V]: how often each token id is supervised (loss_mask 1) in the chunks."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in chunks:
        kept = ids.to(torch.int64)[mask.to(torch.bool)]
        counts += torch.bincount(kept, minlength=vocab_size)[:vocab_size]
    return counts


def _read(path: Path, fingerprint: str, vocab_size: int) -> torch.Tensor | None:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("fingerprint") != fingerprint or meta.get("vocab_size") != str(vocab_size):
                return None
            return f.get_tensor("counts")
    except (OSError, SafetensorError):
        return None


def _counts_on_rank0(source, vocab_size: int, run_dir: Path) -> torch.Tensor:
    where, fingerprint, chunks = where_and_chunks(source, run_dir)
    for directory in dict.fromkeys((where, run_dir)):
        found = _read(directory / COUNTS_FILE, fingerprint, vocab_size)
        if found is not None:
            distributed.print0(f"[train] token counts of the data: {directory / COUNTS_FILE}")
            return found
    counts = count_tokens(chunks, vocab_size)
    meta = {"fingerprint": fingerprint, "vocab_size": str(vocab_size)}
    for directory in dict.fromkeys((where, run_dir)):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            save_safetensors({"counts": counts}, directory / COUNTS_FILE, metadata=meta)
        except OSError:
            continue  # a read-only data directory: the run directory then
        distributed.print0(f"[train] counted the data's tokens into {directory / COUNTS_FILE}")
        break
    return counts


def token_counts(source, vocab_size: int, run_dir: str | Path) -> torch.Tensor:
    """Collective: the data's token counts on every rank (read or counted on rank 0)."""
    counts = None
    if distributed.rank_and_world()[0] == 0:
        counts = _counts_on_rank0(source, vocab_size, Path(run_dir))
    return distributed.broadcast_object(counts, src=0)
