"""The training-step benchmark runs end to end on a tiny shape and reports every field."""

from __future__ import annotations

import json

import pytest

from dspark_ds.cli import main
from dspark_ds.perf.bench import TrainBenchConfig, step_flops


def test_bench_tiny_shape_writes_one_object_per_variant(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = [
        "--hidden_size=32", "--num_attention_heads=4", "--num_key_value_heads=2",
        "--intermediate_size=64", "--num_target_layers=2", "--vocab_size=128", "--seq_len=48",
        "--num_anchors=6", "--block_size=4", "--markov_rank=8", "--repeats=1",
        "--variants=[dense/reference, blockwise/chunked]", "--loss_chunk_anchors=2",
        f"--json={out}",
    ]  # fmt: skip
    assert main(["bench", *argv]) == 0
    results = json.loads(out.read_text())
    assert [r["variant"] for r in results] == ["dense/reference", "blockwise/chunked"]
    for r in results:
        for key in ("step_time_s", "peak_memory_bytes", "tokens_per_s", "achieved_flops_ratio"):
            assert r[key] > 0, key
    # Same weights, batch and anchors: both paths report the same first-step loss.
    assert results[0]["loss_first_step"] == pytest.approx(results[1]["loss_first_step"], rel=1e-5)
    assert "blockwise/chunked" in capsys.readouterr().out


def test_flop_count_scales_with_visible_pairs_only():
    import torch

    cfg = TrainBenchConfig(seq_len=64, num_anchors=2, vocab_size=100)
    keep = torch.ones(1, 2, dtype=torch.bool)
    near = step_flops(cfg, torch.tensor([[0, 1]]), keep)
    far = step_flops(cfg, torch.tensor([[50, 60]]), keep)
    # 109 more context keys per slot, 7 slots, 4 heads x 64 dims, QK + PV, fwd + bwd.
    assert far - near == pytest.approx(cfg.num_draft_layers * 4 * 109 * 7 * 64 * 4 * 3)


def test_bad_variant_names_the_option():
    with pytest.raises(ValueError, match="variants"):
        TrainBenchConfig(variants=["sparse/reference"])
