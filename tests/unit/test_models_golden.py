"""The reference implementation's checkpoint and outputs reproduce (tests/golden)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from dspark_ds.drafters.dspark.loss import compute_dspark_loss

from helpers.golden import check_golden, golden_forward, run_golden


def test_qwen3_golden_reproduces(golden_dir):
    check_golden(golden_dir / "qwen3_vanilla")


def test_golden_loss_backward_is_finite(golden_dir):
    model, _ = run_golden(golden_dir / "qwen3_vanilla")
    inputs = load_file(str(golden_dir / "qwen3_vanilla" / "inputs.safetensors"))
    model.train()
    out = golden_forward(model, inputs)
    loss, _ = compute_dspark_loss(out)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in grads and "lm_head.weight" not in grads
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["fc.weight"].abs().sum() > 0
