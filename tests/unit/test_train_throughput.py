"""The log step's throughput figures (`system/step_s`, `system/tflops_per_gpu`, `system/mfu`)
against the drafter kind's FLOP count written out for Qwen3-8B's published widths."""

from __future__ import annotations

import json

import pytest
import torch

from dspark_ds.config import TrainRunConfig, parse
from dspark_ds.cost.devices import peak_flops
from dspark_ds.cost.flops import WindowFlops
from dspark_ds.drafters.common.memory import StepShape, Widths
from dspark_ds.drafters.kind import SAMPLER_STATS, StepOutput
from dspark_ds.drafters.registry import get_kind
from dspark_ds.train.metrics import LOG_FILE, MetricsLogger

from helpers.metrics import metrics_logger

RECIPE = "dspark_ds/recipes/dspark_qwen3_8b.yaml"
# Qwen3-8B's published config (cost/inventory.py KNOWN_TARGETS): 36 layers, H 4096, F 12288,
# 32 query / 8 key-value heads of 128
H, F, LAYERS, HEADS, KV, D, V = 4096, 12288, 36, 32, 8, 128, 151936
LAYER_PARAMS = H * HEADS * D + 2 * H * KV * D + HEADS * D * H + 3 * H * F + 2 * H + 2 * D


def reference_flops(tokens: float, anchors: float, stage: int) -> float:
    """One sequence: the kind's count on a StepShape written out by hand (5 draft layers,
    5 taps, γ 7, Markov rank 256), plus the online target's forward: 2 FLOPs per weight and
    token over its decoder layers and the causal QK^T + PV."""
    from dspark_ds.drafters.dspark.memory import DSparkShape
    from dspark_ds.drafters.perf import PerfConfig

    widths = Widths(H, F, V, HEADS, KV, D, draft_layers=5, taps=5)
    shape = StepShape.of(widths, 1, tokens, DSparkShape(anchors, block_size=7, markov_rank=256))
    drafter = sum(get_kind("dspark").cost.step_flops(shape, PerfConfig(), "cuda", stage).values())
    target = 2 * tokens * LAYERS * LAYER_PARAMS + 4 * (tokens**2 / 2) * HEADS * D * LAYERS
    return drafter + target


@pytest.fixture(scope="module")
def run_cfg() -> TrainRunConfig:
    return parse(TrainRunConfig, ["--config", RECIPE], prog="dspark-ds train")


def logger_for(tmp_path, flops, peak: float | None, world: int = 1) -> MetricsLogger:
    return metrics_logger(tmp_path, log_every=2, total_steps=4, world=world, flops=flops, peak=peak)


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
    from dspark_ds.cost.devices import device_peak_flops

    assert device_peak_flops("NVIDIA H200") == device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert device_peak_flops("NVIDIA H100 PCIe") is None


def test_a_gemma4_run_counts_its_full_attention_drafter_and_its_sliding_layers(tmp_path):
    """Gemma4's per-layer config fields (which newer transformers refuse to read globally):
    the drafter counted at the full-attention head shape it is built with, the target's
    sliding-window layers at the (query, key) pairs their window leaves."""
    from transformers import AutoModelForCausalLM, Gemma4Config

    from dspark_ds.cost.inventory import inventory
    from dspark_ds.drafters.dspark.memory import DSparkShape
    from dspark_ds.drafters.perf import PerfConfig

    from helpers.gemma4 import tiny_gemma4_text

    config = Gemma4Config(text_config=tiny_gemma4_text())
    config.save_pretrained(tmp_path)
    argv = ["--config", "dspark_ds/recipes/dspark_gemma4_12b.yaml", "--target.path", str(tmp_path)]
    argv += ["--target.layer_ids", "[0, 1, 2]"]
    run_cfg = parse(TrainRunConfig, argv, prog="dspark-ds train")
    inv = inventory(run_cfg)
    assert (inv.heads, inv.kv_heads, inv.head_dim) == (4, 1, 16)  # global_head_dim, K = V
    # sliding layers: 4 heads of 8 over a window of 8; full layers: 4 heads of 16
    assert inv.target_attention == ((32, 8), (64, None), (32, 8), (64, None))
    with torch.device("meta"):
        layers = AutoModelForCausalLM.from_config(config).get_decoder().layers
    layer_params = sum(p.numel() for p in layers.parameters())
    T, anchors = 64, 8
    model = run_cfg.model
    widths = Widths(32, 64, inv.vocab, 4, 1, 16, model.num_draft_layers, taps=3)
    part = DSparkShape(anchors, block_size=model.block_size, markov_rank=model.markov_rank)
    shape = StepShape.of(widths, 1, T, part)
    drafter = sum(get_kind("dspark").cost.step_flops(shape, PerfConfig(), "cuda", 3).values())
    sliding_pairs, full_pairs = 8 * T - 8 * 8 / 2, T * T / 2
    target = 2 * T * layer_params + 4 * 2 * (32 * sliding_pairs + 64 * full_pairs)
    flops = WindowFlops(run_cfg, "cuda", zero_stage=3)
    assert flops.per_sequence(T, anchors) == pytest.approx(drafter + target, rel=1e-12)


@pytest.mark.parametrize("S,window", [(64, 8), (64, None), (8, 16)])
def test_attention_pairs_are_the_masks_area(S, window):
    """The causal (sliding-window) mask's entries, counted naively, against the closed form
    (which counts the diagonal as half, as the full causal S²/2 does)."""
    from dspark_ds.cost.flops import attention_pairs

    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    mask = (j <= i) & ((i - j < window) if window else True)
    diagonal = S if window is None or S <= window else window
    assert attention_pairs(S, window) == pytest.approx(mask.sum().item() - diagonal / 2)


def gemma4_run(tmp_path, **text) -> TrainRunConfig:
    """The Gemma4 recipe on a tiny Gemma4 config (config.json only) saved in `tmp_path`."""
    from transformers import Gemma4Config

    from helpers.gemma4 import tiny_gemma4_text

    Gemma4Config(text_config=tiny_gemma4_text(**text)).save_pretrained(tmp_path)
    argv = ["--config", "dspark_ds/recipes/dspark_gemma4_12b.yaml", "--target.path", str(tmp_path)]
    argv += ["--target.layer_ids", "[0, 1, 2]"]
    return parse(TrainRunConfig, argv, prog="dspark-ds tune")


def test_the_calibration_reference_shape_reads_a_gemma4_config(tmp_path):
    """tune --cluster.calibrate: the compute rates' shape from the config's global head fields
    (a plain read of Gemma4's per-layer head_dim trips transformers' guard)."""
    from dspark_ds.tune.calibrate_compute import reference_shape

    run_cfg = gemma4_run(
        tmp_path,
        hidden_size=256,
        intermediate_size=1024,
        num_attention_heads=6,
        head_dim=64,
        global_head_dim=128,
        vocab_size=16000,
    )
    shape = reference_shape(run_cfg, "cpu")
    assert {k: shape[k] for k in ("hidden", "intermediate", "heads", "head_dim", "vocab")} == dict(
        hidden=256, intermediate=1024, heads=6, head_dim=64, vocab=16000
    )


def test_a_gemma4_calibration_copy_runs_under_a_bf16_engine(tmp_path):
    """The calibration's engine window: DeepSpeed's bf16 casts the drafter's parameters and
    keeps its fp32 buffers (the copy is built in fp32). Gemma4's `layer_scalar` must not turn
    the residual stream fp32 (the next layer's q_proj would then see bf16 weights)."""
    from dspark_ds.tune.workload import NarrowCopies

    step = NarrowCopies(gemma4_run(tmp_path), (0,), "cpu").steps[0][0]
    model = step.make()
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    assert model.layers[0].layer_scalar.dtype == torch.float32
    loss = step.loss(model)
    loss.backward()
    assert torch.isfinite(loss)


def test_the_calibration_copies_are_built_in_the_runs_dtype(tmp_path, monkeypatch):
    """The engine windows build their drafter from the host work's copies: in the run's bf16
    (an fp32 copy under a bf16 ZeRO-3 engine with offloaded parameters kept fp32 weights)."""
    from dspark_ds.tune import calibrate_host
    from dspark_ds.tune.workload import NarrowCopies

    run_cfg = gemma4_run(tmp_path)
    copies = NarrowCopies(run_cfg, (0,), "cpu", dtype=torch.bfloat16)
    step = copies.steps[0][0]
    assert {p.dtype for p in step.make().parameters()} == {torch.bfloat16}
    assert step.batch["target_hidden_states"].dtype == torch.bfloat16
    assert {p.dtype for p in copies.target.make().parameters()} == {torch.bfloat16}

    class Built(Exception):
        pass

    def made(*args, **kwargs):  # HostWork's copies, before their timings
        raise Built(args[4] if len(args) > 4 else kwargs.get("dtype"))

    monkeypatch.setattr(calibrate_host, "NarrowCopies", made)
    with pytest.raises(Built) as built:
        calibrate_host.HostWork(run_cfg, (0,), torch.device("cpu"), torch.bfloat16)
    assert built.value.args[0] == torch.bfloat16
