"""`train.optimizer: muon`: which weights Muon takes, its groups against torch's own Muon and
AdamW (a naive two-optimizer reference), and the DeepSpeed config it makes."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_ds.config import DeepSpeedConfig, TrainConfig
from dspark_ds.engine.checkpoint import optimizer_layout
from dspark_ds.engine.config import build_ds_config
from dspark_ds.engine.optimizer import build_muon, lr_scale, muon_split
from dspark_ds.errors import ConfigError

from helpers.drafters import tiny_drafter


def _ds_config(stage: str = "zero2", optimizer: str = "muon", **train) -> dict:
    run = TrainConfig(global_batch_size=2, optimizer=optimizer, **train)
    return build_ds_config(
        DeepSpeedConfig(config=stage), run, micro_batch_size=1, world_size=2, use_gpu=False
    )


def test_muon_takes_the_draft_matrices_and_adamw_the_rest():
    model = tiny_drafter()
    muon, adamw = (dict(part) for part in muon_split(model))
    assert set(muon) == {
        n
        for n, _ in model.named_parameters()
        if n.startswith("layers.") and n.endswith("proj.weight")
    } | {"fc.weight"}
    # norms, the confidence head's [1, H + r] row and bias, the Markov head's [V, r] factors
    assert {"norm.weight", "confidence_head.proj.weight", "markov_head.markov_w1.weight"} <= set(
        adamw
    )
    assert "markov_head.markov_w2.weight" in adamw
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"embed_tokens.weight", "lm_head.weight"} and not frozen & (
        set(muon) | set(adamw)
    )


def test_lr_scale_turns_deepspeeds_step_into_torchs_match_rms_adamw():
    # DeepSpeed scales its orthogonalised update by √max(1, rows / cols); torch's
    # match_rms_adamw by 0.2 √max(rows, cols)
    for rows, cols in ((32, 32), (64, 32), (32, 96), (16, 32)):
        deepspeed_scale = math.sqrt(max(1.0, rows / cols))
        assert lr_scale(rows, cols) * deepspeed_scale == pytest.approx(
            0.2 * math.sqrt(max(rows, cols))
        )


def test_one_step_equals_torchs_muon_and_adamw():
    """Our groups in DeepSpeed's MuonWithAuxAdam against the naive reference: torch.optim.Muon
    (match_rms_adamw) on the matrices and torch.optim.AdamW on the rest, the same gradients,
    two steps. torch runs Newton-Schulz in bf16, DeepSpeed in fp32 on a CPU: close, not equal;
    a wrong lr scale or weight decay is off by a factor."""
    ds_config = _ds_config(lr=3e-3, weight_decay=0.01, muon_weight_decay=0.1)
    mine, ref = tiny_drafter(seed=1), tiny_drafter(seed=1)
    optimizer = build_muon(mine, ds_config)
    muon, adamw = muon_split(ref)
    reference = [
        torch.optim.Muon(
            [p for _, p in muon],
            lr=3e-3,
            weight_decay=0.1,
            momentum=0.95,
            adjust_lr_fn="match_rms_adamw",
        ),
        torch.optim.AdamW([p for _, p in adamw], lr=3e-3, weight_decay=0.01, eps=1e-8),
    ]
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        for (_, a), (_, b) in zip(mine.named_parameters(), ref.named_parameters()):
            if a.requires_grad:
                a.grad = torch.randn(a.shape, generator=g)
                b.grad = a.grad.clone()
        optimizer.step()
        for opt in reference:
            opt.step()
    for (name, a), (_, b) in zip(mine.named_parameters(), ref.named_parameters()):
        got, want = a.detach() - before[name], b.detach() - before[name]
        if not b.requires_grad:
            assert torch.equal(got, want)
            continue
        rel = (got - want).norm() / want.norm()
        assert rel < (3e-2 if name in dict(muon) else 1e-5), (name, float(rel))


def test_the_deepspeed_config_names_muon_and_what_it_needs():
    cfg = _ds_config(lr=2e-3, muon_lr=1e-2, muon_momentum=0.9, max_grad_norm=1.0)
    assert cfg["optimizer"]["type"] == "Muon"
    params = cfg["optimizer"]["params"]
    assert (params["lr"], params["muon_lr"], params["momentum"]) == (2e-3, 1e-2, 0.9)
    assert params["muon_weight_decay"] == 0.1 and "torch_adam" not in params
    # ZeRO-1/2/3 would take the clipping norm over the orthogonalised updates
    assert cfg["gradient_clipping"] == 0.0
    assert _ds_config("zero0")["gradient_clipping"] == 1.0
    assert _ds_config("zero3")["zero_optimization"]["reduce_scatter"] is False
    assert _ds_config("zero2", muon_lr=None, lr=5e-4)["optimizer"]["params"]["muon_lr"] == 5e-4
    # an offloaded optimizer: DeepSpeed must take our client Muon (its CPU Adam inside)
    assert _ds_config("zero3_offload_cpu")["zero_force_ds_cpu_optimizer"] is False
    assert "zero_force_ds_cpu_optimizer" not in _ds_config("zero3")


def test_bad_muon_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"train.muon_momentum: must be in \[0, 1\)"):
        TrainConfig(muon_momentum=1.0).validate()
    with pytest.raises(ConfigError, match="train.muon_lr: must be > 0"):
        TrainConfig(muon_lr=0.0).validate()
    own = tmp_path / "muon.json"
    own.write_text('{"optimizer": {"type": "Muon", "params": {}}, "zero_optimization": {}}')
    with pytest.raises(ConfigError, match="optimizer.type is Muon but train.optimizer is 'adamw'"):
        _ds_config(str(own), optimizer="adamw")


def test_a_checkpoint_of_one_optimizer_is_not_resumed_by_the_other():
    adamw = _ds_config(optimizer="adamw")
    layouts = optimizer_layout(_ds_config()), optimizer_layout(adamw)
    assert layouts[0]["optimizer"] == "Muon" and layouts[1]["optimizer"] == "AdamW"
    # a checkpoint written before the optimizer was recorded: its config names AdamW
    assert optimizer_layout({"optimizer": {"type": "AdamW"}})["optimizer"] == "AdamW"
