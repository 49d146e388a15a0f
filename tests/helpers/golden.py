"""Reproduce a golden folder (tests/golden/*) with our drafter and compare with the reference."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dspark_ds.drafters import load_draft_model
from dspark_ds.drafters.dspark.loss import compute_dspark_loss


def golden_forward(model, inputs: dict):
    """The drafter's training forward on a golden folder's inputs (its anchors and keep mask)."""
    return model(
        inputs["input_ids"],
        inputs["target_hidden_states"],
        inputs["loss_mask"],
        inputs["target_last_hidden_states"],
        anchor_positions=inputs["anchor_positions"],
        block_keep_mask=inputs["block_keep_mask"],
    )


def run_golden(folder):
    model = load_draft_model(folder / "draft", dtype=torch.float32)
    inputs = load_file(str(folder / "inputs.safetensors"))
    with torch.no_grad():
        out = golden_forward(model, inputs)
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
