"""The log step's throughput figures (`system/step_s`, `system/tflops_per_gpu`, `system/mfu`)
against the drafter kind's FLOP count written out for Qwen3-8B's published widths."""

from __future__ import annotations

import json

import pytest
import torch

from dspark_ds.config import TrainRunConfig, parse
from dspark_ds.drafters.common.blocks import SAMPLER_STATS
from dspark_ds.drafters.common.memory import StepShape
from dspark_ds.drafters.kind import StepOutput
from dspark_ds.drafters.registry import get_kind
from dspark_ds.tracking.mlflow import Tracker
from dspark_ds.train.flops import WindowFlops, peak_flops
from dspark_ds.train.metrics import LOG_FILE, MetricsLogger

RECIPE = "dspark_ds/recipes/dspark_qwen3_8b.yaml"
# Qwen3-8B's published config (tune/inventory.py KNOWN_TARGETS): 36 layers, H 4096, F 12288,
# 32 query / 8 key-value heads of 128
H, F, LAYERS, HEADS, KV, D, V = 4096, 12288, 36, 32, 8, 128, 151936
LAYER_PARAMS = H * HEADS * D + 2 * H * KV * D + HEADS * D * H + 3 * H * F + 2 * H + 2 * D


def reference_flops(tokens: float, anchors: float, stage: int) -> float:
    """One sequence: the kind's count on a StepShape written out by hand (5 draft layers,
    5 taps, γ 7, Markov rank 256), plus the online target's forward: 2 FLOPs per weight and
    token over its decoder layers and the causal QK^T + PV."""
    from dspark_ds.drafters.dspark.memory import DSparkShape
    from dspark_ds.drafters.perf import PerfConfig

    shape = StepShape(batch=1, seq_len=tokens, hidden=H, intermediate=F, vocab=V, heads=HEADS,
                      kv_heads=KV, head_dim=D, draft_layers=5, taps=5,
                      drafter=DSparkShape(num_anchors=anchors, block_size=7, markov_rank=256))  # fmt: skip
    drafter = sum(get_kind("dspark").step_flops(shape, PerfConfig(), "cuda", stage).values())
    target = 2 * tokens * LAYERS * LAYER_PARAMS + 4 * (tokens**2 / 2) * HEADS * D * LAYERS
    return drafter + target


@pytest.fixture(scope="module")
def run_cfg() -> TrainRunConfig:
    return parse(TrainRunConfig, ["--config", RECIPE], prog="dspark-ds train")


def logger_for(tmp_path, flops, peak: float | None, world: int = 1) -> MetricsLogger:
    tracker = Tracker.for_rank(1, enabled=False, uri="", experiment=None, run_name="r",
                               run_dir=str(tmp_path), artifact_location="")  # fmt: skip
    return MetricsLogger(tmp_path, tracker, rank=0, log_every=2, total_steps=4,
                         progress_bar=False, device=torch.device("cpu"),
                         to_metrics=lambda sums: {"loss": sums["loss"]}, flops=flops,
                         peak_flops=peak, world=world)  # fmt: skip


def micro_batch(lengths: list[int], anchors: list[int]):
    """A padded batch of rows of `lengths` real tokens, and sampler sums of `anchors` kept
    blocks per row (what a DSpark step hands the logger)."""
    S = max(lengths)
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    sums = torch.zeros(len(SAMPLER_STATS) + 1, dtype=torch.float64)
    sums[SAMPLER_STATS.index("sampled_anchors_abs")] = sum(anchors)
    sums[-1] = len(lengths)
    return {"attention_mask": mask, "input_ids": torch.zeros_like(mask)}, sums


def test_model_flops_per_gpu_are_the_kinds_count_over_the_window_time(tmp_path, run_cfg, capsys):
    flops = WindowFlops(run_cfg, "cuda", zero_stage=2)
    # the kind's count through the run's own config equals the one written out by hand
    assert flops.per_sequence(4096, 512) == pytest.approx(reference_flops(4096, 512, 2), rel=1e-12)
    logger = logger_for(tmp_path, flops, peak=989e12)
    logger.start(0)
    logger.t0 -= 2.0  # the window began two seconds ago
    out = StepOutput.of(torch.tensor(1.0), {"loss": torch.tensor(1.0)})
    # a window of 2 steps: 3 sequences of 4096, 2048 and 3072 tokens with 512, 300, 412 blocks
    for lengths, anchors in (([4096, 2048], [512, 300]), ([3072], [412])):
        batch, sums = micro_batch(lengths, anchors)
        logger.add_micro_batch(batch)
        logger.add_sampler_sums(sums)
    logger.log_step(1, [out], None, lr=1e-4, epoch=0, grad_norm=lambda: 1.0, counters={})
    logger.log_step(2, [out], None, lr=1e-4, epoch=0, grad_norm=lambda: 1.0, counters={})
    logger.close()
    row = json.loads((tmp_path / LOG_FILE).read_text().splitlines()[-1])
    elapsed = 2 * row["system/step_s"]  # the window's wall time, 2 steps
    assert 2.0 <= elapsed < 3.0
    # model FLOPs at the window's mean sequence (3 072 tokens, 408 blocks) × its 3 sequences
    expected = 3 * reference_flops(3072, 408, 2) / elapsed
    assert row["system/tflops_per_gpu"] * 1e12 == pytest.approx(expected, rel=1e-9)
    assert row["system/mfu"] == pytest.approx(expected / 989e12, rel=1e-9)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"{row['system/tflops_per_gpu']:.3g} TFLOP/s per GPU (MFU " in line, line


def test_no_peak_means_no_mfu_and_the_world_shares_the_flops(tmp_path, run_cfg):
    flops = WindowFlops(run_cfg, "cuda", zero_stage=3)  # ZeRO-3: the recompute loss's 2nd pass
    logger = logger_for(tmp_path, flops, peak=None, world=4)
    logger.start(0)
    batch, sums = micro_batch([4096], [512])
    logger.add_micro_batch(batch)
    logger.add_sampler_sums(sums)
    out = StepOutput.of(torch.tensor(1.0), {"loss": torch.tensor(1.0)})
    logger.log_step(1, [out], None, lr=1e-4, epoch=0, grad_norm=lambda: None, counters={})
    logger.log_step(2, [out], None, lr=1e-4, epoch=0, grad_norm=lambda: None, counters={})
    logger.close()
    row = json.loads((tmp_path / LOG_FILE).read_text().splitlines()[-1])
    assert "system/mfu" not in row
    elapsed = 2 * row["system/step_s"]
    expected = reference_flops(4096, 512, 3) / 4 / elapsed
    assert reference_flops(4096, 512, 3) > reference_flops(4096, 512, 2)
    assert row["system/tflops_per_gpu"] * 1e12 == pytest.approx(expected, rel=1e-9)


def test_the_peak_is_the_flag_or_a_known_gpus_under_bf16():
    cpu = torch.device("cpu")
    assert peak_flops(312.0, "fp32", cpu) == 312e12
    assert peak_flops(None, "bf16", cpu) is None
    from dspark_ds.tune.cluster import device_peak_flops

    assert device_peak_flops("NVIDIA H200") == device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert device_peak_flops("NVIDIA H100 PCIe") is None
