"""The data's token counts a draft vocabulary is chosen from (data/vocab_counts.py): counted once
on rank 0, stored beside the data, read back by a later run, the same on every rank."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dspark_ds.data import vocab_counts
from dspark_ds.data.tokens import TokenStore
from dspark_ds.data.vocab_counts import COUNTS_FILE, token_counts

from helpers.dist import run_distributed

V = 50


def _store(seed: int) -> TokenStore:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in (7, 12, 5):
        ids = torch.randint(0, V, (n,), generator=g).tolist()
        mask = [0, 0] + [1] * (n - 2)
        samples.append((ids, mask))
    return TokenStore.from_samples(samples, {"pad_token_id": 0})


def _naive(store: TokenStore) -> list[int]:
    counts = [0] * V
    for i in range(len(store)):
        s = store[i]
        for t, m in zip(s["input_ids"].tolist(), s["loss_mask"].tolist()):
            counts[t] += m
    return counts


def test_counted_once_stored_beside_the_data_and_read_back(tmp_path, monkeypatch):
    data = tmp_path / "prepared"
    _store(0).save(data)
    store = TokenStore.load(data)
    source = SimpleNamespace(samples=store, cache=None)
    counts = token_counts(source, V, tmp_path / "run")
    assert counts.tolist() == _naive(store)
    assert (data / COUNTS_FILE).is_file() and not (tmp_path / "run" / COUNTS_FILE).exists()

    def no_count(chunks, vocab_size):
        raise AssertionError("counted again")

    monkeypatch.setattr(vocab_counts, "count_tokens", no_count)
    assert token_counts(source, V, tmp_path / "run").tolist() == counts.tolist()
    # other data (another fingerprint) or another vocabulary size is counted again
    with pytest.raises(AssertionError, match="counted again"):
        token_counts(source, V + 1, tmp_path / "run")


def test_a_read_only_data_directory_keeps_them_in_the_run_directory(tmp_path, monkeypatch):
    data = tmp_path / "prepared"
    _store(1).save(data)
    save = vocab_counts.save_safetensors

    def read_only(tensors, path, metadata=None):
        if Path(path).parent == data:
            raise PermissionError(13, "Permission denied", str(path))
        save(tensors, path, metadata)

    monkeypatch.setattr(vocab_counts, "save_safetensors", read_only)
    source = SimpleNamespace(samples=TokenStore.load(data), cache=None)
    counts = token_counts(source, V, tmp_path / "run")
    assert (tmp_path / "run" / COUNTS_FILE).is_file() and not (data / COUNTS_FILE).exists()
    assert counts.tolist() == _naive(TokenStore.load(data))
    # and a later run finds them there
    monkeypatch.setattr(vocab_counts, "count_tokens", None)
    assert token_counts(source, V, tmp_path / "run").tolist() == counts.tolist()


def _ranks(rank: int, world: int, run_dir: str) -> None:
    # each rank holds different data: only rank 0's is counted, and every rank gets its counts
    store = _store(rank)
    got = token_counts(SimpleNamespace(samples=store, cache=None), V, Path(run_dir))
    assert got.tolist() == _naive(_store(0)), rank
    torch.save(got, Path(run_dir) / f"rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.distributed
def test_rank_zero_counts_and_every_rank_gets_the_same(tmp_path):
    run_distributed(_ranks, world_size=2, args=(str(tmp_path),))
    files = sorted(tmp_path.glob(COUNTS_FILE))
    assert [f.name for f in files] == [COUNTS_FILE]  # written once, by rank 0
    assert torch.equal(torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt"))
