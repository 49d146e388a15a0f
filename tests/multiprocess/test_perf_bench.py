"""The training-step benchmark runs end to end on a tiny shape and reports every field."""

from __future__ import annotations

import json

import pytest

from dspark_ds.cli import main
from dspark_ds.perf.bench_variant import (
    _rss_bytes,
    reset_peak_memory,
    resident_bytes,
    step_flops,
    step_shape,
)
from dspark_ds.perf.train_bench import TrainBenchConfig, parse_variant


@pytest.mark.slow  # a subprocess per variant
def test_bench_tiny_shape_writes_one_object_per_variant(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--hidden_size=32", "--num_attention_heads=4", "--num_key_value_heads=2"]
    argv += ["--intermediate_size=64", "--num_target_layers=2", "--vocab_size=128", "--seq_len=48"]
    argv += ["--sizes.dspark.num_anchors=6", "--sizes.dspark.block_size=4"]
    argv += ["--sizes.dspark.markov_rank=8", "--repeats=1"]
    argv += ["--variants=[dense/reference, blockwise/chunked]"]
    argv += ["--loss_chunk_anchors=2", f"--json={out}"]
    argv += [f"--tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    assert main(["bench", *argv]) == 0
    results = json.loads(out.read_text())
    assert [r["variant"] for r in results] == ["dense/reference", "blockwise/chunked"]
    for r in results:
        for key in ("step_time_s", "peak_memory_bytes", "tokens_per_s", "achieved_flops_ratio"):
            assert r[key] > 0, key
        # peak = resident + working + the process before the model
        resident = r["weights_bytes"] + r["grads_bytes"] + r["optimizer_state_bytes"]
        assert r["resident_bytes"] == resident and r["grads_bytes"] > 0
        assert r["working_memory_bytes"] == (
            r["peak_memory_bytes"] - r["baseline_memory_bytes"] - resident
        )
        assert (r["matmul_dtype"], r["matmul_size"]) == ("float32", 2048)
    assert results[0]["step_time_vs_reference"] == 1.0
    assert results[1]["step_time_vs_reference"] == pytest.approx(
        results[1]["step_time_s"] / results[0]["step_time_s"]
    )
    assert "work/ref" in capsys.readouterr().out
    # Same weights, batch and anchors: both paths report the same first-step loss.
    assert results[0]["loss_first_step"] == pytest.approx(results[1]["loss_first_step"], rel=1e-5)
    # in MLflow: a bench run with a child per variant, holding that variant's figures
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("dspark-ds").experiment_id])
    assert {r.data.tags["kind"] for r in runs} == {"bench"}
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    children = {r.data.tags["variant"]: r for r in runs if r is not parent}
    assert set(children) == {"dense/reference", "blockwise/chunked"}
    for r in results:
        child = children[r["variant"]]
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.metrics["step_time_s"] == pytest.approx(r["step_time_s"])


def test_the_bench_runs_what_the_kind_says():
    from dspark_ds.drafters.presets import DrafterSizes, preset
    from dspark_ds.drafters.registry import get_kind

    default, eagle3 = TrainBenchConfig(), TrainBenchConfig(drafter="eagle3")
    # each kind's own variants by default, its reference first
    assert default.variants == list(get_kind("dspark").capabilities.bench_variants)
    assert eagle3.variants == ["dense/reference", "dense/chunked"]
    assert eagle3.reference_variant == "dense/reference"
    with pytest.raises(ValueError, match="variants: 'blockwise/chunked'"):
        TrainBenchConfig(drafter="eagle3", variants=["blockwise/chunked"])
    # the drafter: the preset, sized by its kind's block of the bench's sizes as the demo sizes
    # it (the defaults: the preset's 512 anchors)
    assert eagle3.model == preset("eagle3", num_draft_layers=1, ttt_length=7)
    assert default.model == preset("dspark", num_draft_layers=2, markov_rank=64, num_anchors=512)
    sizes = DrafterSizes.with_block("dflash", num_anchors=64, block_size=4)
    dflash = TrainBenchConfig(drafter="dflash", sizes=sizes).model
    assert dflash == preset(
        "dflash", num_draft_layers=2, num_anchors=64, block_size=4, sample_from_anchor=True
    )
    with pytest.raises(ValueError, match="sizes.eagle3: no num_anchors"):
        DrafterSizes.with_block("eagle3", num_anchors=64)
    with pytest.raises(ValueError, match="sizes.eagle3.ttt_length"):
        TrainBenchConfig(drafter="eagle3", sizes=DrafterSizes.with_block("eagle3", ttt_length=0))
    # its FLOPs: the kind's count of the variant's paths (dense attention computes the masked
    # pairs too); the bench's shape is the kind's
    assert step_flops(default, "dense/reference") > step_flops(default, "blockwise/reference")
    assert step_shape(eagle3).drafter == get_kind("eagle3").cost.step_part(eagle3.model)


def test_bad_variant_names_the_option():
    for bad in ("sparse/reference", "dense/reference/jit", "dense"):
        with pytest.raises(ValueError, match="variants"):
            TrainBenchConfig(variants=[bad])
    assert parse_variant("flex/chunked/layers") == ("flex", "chunked", "layers")
    assert parse_variant("flex/chunked") == ("flex", "chunked", "off")
    with pytest.raises(ValueError, match="loss_chunk_anchors"):
        TrainBenchConfig(loss_chunk_anchors="many")


def test_device_defaults():
    cpu, gpu = TrainBenchConfig(), TrainBenchConfig(device="cuda")
    assert (cpu.chunk_anchors, cpu.matmul_n) == (32, 2048)
    assert (gpu.chunk_anchors, gpu.matmul_n) == (256, 8192)


def test_resident_bytes_counts_weights_grads_and_adam_state():
    import torch

    from helpers.drafters import random_batch, tiny_drafter

    model = tiny_drafter()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    out = model(**random_batch(model), generator=torch.Generator().manual_seed(0))
    (out.draft_logits.square().mean() + out.confidence_pred.mean()).backward()
    opt.step()
    got = resident_bytes(model, opt)
    n_all = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    n_train = sum(p.numel() for p in trainable)
    assert got["weights_bytes"] == 4 * n_all
    assert got["grads_bytes"] == 4 * n_train
    # exp_avg + exp_avg_sq per parameter, plus its fp32 step counter
    assert got["optimizer_state_bytes"] == 4 * 2 * n_train + 4 * len(trainable)


def test_the_cpu_peak_starts_over_after_the_build():
    """A bf16 bench builds its drafter in fp32 and casts it: the step's peak RSS must not be
    the build's (VmHWM is reset after it, as CUDA's peak statistics are)."""
    import torch

    big = torch.ones(64 * 2**20)  # 256 MiB, written: resident until freed
    del big
    before = _rss_bytes("VmHWM")
    reset_peak_memory(cuda=False)
    after = _rss_bytes("VmHWM")
    assert after < before - 200 * 2**20
    assert after <= _rss_bytes("VmRSS") + 16 * 2**20
