"""The reference implementation's checkpoint and outputs reproduce (../shared/golden)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dspark_ds.loss import compute_dspark_loss
from dspark_ds.models import load_draft_model


def run_golden(folder):
    model = load_draft_model(folder / "draft", dtype=torch.float32)
    inputs = load_file(str(folder / "inputs.safetensors"))
    with torch.no_grad():
        out = model(
            inputs["input_ids"],
            inputs["target_hidden_states"],
            inputs["loss_mask"],
            inputs["target_last_hidden_states"],
            anchor_positions=inputs["anchor_positions"],
            block_keep_mask=inputs["block_keep_mask"],
        )
    return model, out


def check_golden(folder):
    _, out = run_golden(folder)
    ref = load_file(str(folder / "outputs.safetensors"))
    expected = json.loads((folder / "expected.json").read_text())
    keep = ref["block_keep_mask"]
    assert not keep.all(), "the golden batch should exercise dummy blocks"
    assert torch.equal(out.block_keep_mask, keep)
    assert torch.equal(out.eval_mask, ref["eval_mask"])
    assert torch.equal(out.target_ids[keep], ref["target_ids"][keep])
    for name in ("draft_logits", "confidence_pred", "aligned_target_logits"):
        ours = getattr(out, name)
        assert torch.isfinite(ours).all(), f"{name} has non-finite values (dummy blocks?)"
        torch.testing.assert_close(ours[keep], ref[name][keep], atol=1e-4, rtol=0, msg=name)
    loss, metrics = compute_dspark_loss(out, **expected["loss_args"])
    assert loss.item() == pytest.approx(expected["loss"], rel=1e-5)
    for name, value in expected["metrics"].items():
        assert metrics[name] == pytest.approx(value, rel=1e-5), name
    assert 1.0 <= metrics["tau_greedy"] <= 1.0 + out.draft_logits.shape[2]


def test_qwen3_golden_reproduces(golden_dir):
    check_golden(golden_dir / "qwen3_vanilla")


def test_golden_loss_backward_is_finite(golden_dir):
    model, _ = run_golden(golden_dir / "qwen3_vanilla")
    inputs = load_file(str(golden_dir / "qwen3_vanilla" / "inputs.safetensors"))
    model.train()
    out = model(
        inputs["input_ids"],
        inputs["target_hidden_states"],
        inputs["loss_mask"],
        inputs["target_last_hidden_states"],
        anchor_positions=inputs["anchor_positions"],
        block_keep_mask=inputs["block_keep_mask"],
    )
    loss, _ = compute_dspark_loss(out)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in grads and "lm_head.weight" not in grads
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["fc.weight"].abs().sum() > 0
