"""`train.muon_shard_ns` on 2 gloo ranks: the ZeRO-0 Muon step whose Newton-Schulz work is
split over the ranks against DeepSpeed's own step on every rank (the reference), on the same
weights and gradients. The trainer-level twin (2 ranks through `dspark-ds train`, export and
resume): tests/multiprocess/test_trainer_distributed.py."""

from __future__ import annotations

import pytest
import torch

from dspark_ds.engine.optimizer import build_muon, ns_owners

from helpers.dist import run_distributed
from helpers.drafters import tiny_drafter

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 3
PARAMS = {
    "lr": 1e-2,
    "betas": [0.9, 0.999],
    "eps": 1e-8,
    "weight_decay": 0.01,
    "muon_lr": 2e-2,
    "momentum": 0.95,
    "muon_weight_decay": 0.1,
}


def _optimizer(shard: bool):
    torch.manual_seed(0)
    model = tiny_drafter()
    config = {
        "optimizer": {"params": {**PARAMS, "muon_shard_ns": shard}},
        "zero_optimization": {"stage": 0},
    }
    return model, build_muon(model, config)


def _steps(model, optimizer) -> None:
    """STEPS steps on gradients every rank draws alike (as ZeRO-0's all-reduce leaves them)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        for p in trained:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
        optimizer.zero_grad()


def _worker(rank: int, world: int) -> None:
    from deepspeed.runtime.zero.muon import muon_optimizer

    reference, ref_opt = _optimizer(shard=False)
    sharded, opt = _optimizer(shard=True)
    assert type(ref_opt) is muon_optimizer.MuonWithAuxAdam
    assert type(opt).__name__ == "NSShardedMuonWithAuxAdam"
    _steps(reference, ref_opt)

    calls = []
    original = muon_optimizer.muon_update

    def counted(grad, *args, **kwargs):
        calls.append(tuple(grad.shape))
        return original(grad, *args, **kwargs)

    muon_optimizer.muon_update = counted
    try:
        _steps(sharded, opt)
    finally:
        muon_optimizer.muon_update = original

    for (name, a), b in zip(reference.named_parameters(), sharded.parameters()):
        assert torch.equal(a, b), f"rank {rank}: {name} differs from the unsharded step"
    matrices = [p for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    ref_matrices = [p for g in ref_opt.param_groups if g["use_muon"] for p in g["params"]]
    for a, b in zip(ref_matrices, matrices):  # every rank holds every momentum (checkpoints)
        assert torch.equal(ref_opt.state[a]["momentum_buffer"], opt.state[b]["momentum_buffer"])
    owners = ns_owners([tuple(p.shape) for p in matrices], world)
    mine = [tuple(p.shape) for p, o in zip(matrices, owners) if o == rank]
    assert 0 < len(mine) < len(matrices)
    assert sorted(calls) == sorted(mine * STEPS), f"rank {rank} computed others' updates"


def test_sharded_newton_schulz_is_the_same_step_for_half_the_work():
    run_distributed(_worker, world_size=2)


def test_owners_balance_the_work_the_same_on_every_rank():
    shapes = [(32, 32), (16, 32), (96, 32), (32, 96), (16, 32), (32, 32)]
    owners = ns_owners(shapes, 2)
    assert owners == ns_owners(list(shapes), 2)
    assert set(owners) == {0, 1}
    assert ns_owners(shapes, 1) == [0] * len(shapes)
    # the two 32 x 96 matrices (the costliest) go to different ranks
    assert owners[2] != owners[3]
