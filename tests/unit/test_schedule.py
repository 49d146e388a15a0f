"""The learning-rate schedule, and what a resume that changes the run's length does to it."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_ds.train.schedule import Schedule


def closed_form(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup (k+1)/W, then cosine from 1 to min_ratio over [W, T]."""
    if step < warmup:
        return (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))


@pytest.mark.parametrize("warmup,total,min_ratio", [(0, 6, 0.0), (4, 100, 0.1), (10, 10, 0.0)])
def test_plain_schedule_is_warmup_then_cosine(warmup, total, min_ratio):
    s = Schedule(warmup, total, min_ratio)
    for k in range(total + 2):
        assert s.factor(k) == pytest.approx(closed_form(k, warmup, total, min_ratio))


@pytest.mark.parametrize("at,new_total", [(10, 40), (10, 12), (3, 40), (2, 40), (19, 20)])
def test_a_changed_length_continues_without_a_jump(at, new_total):
    """The issue's case: 20 steps resumed at step 10 with max_steps 40 made the rate jump from
    8.7e-4 to 1.8e-3 (the cosine recomputed over the new length). Now the rate at the resumed
    step is the old one, it only decreases after the warmup, and ends at lr × min_ratio."""
    old = Schedule(warmup_steps=2, total_steps=20, min_ratio=0.05)
    new = old.resized(at, new_total)
    assert new.factor(at) == pytest.approx(old.factor(at))
    after = [new.factor(k) for k in range(max(at, 2), new_total + 1)]
    assert all(b <= a + 1e-12 for a, b in zip(after, after[1:]))
    assert new.factor(new_total) == pytest.approx(0.05)
    assert new.warmup_steps == 2
    # a second change continues from the first one
    again = new.resized(at + 1, new_total + 10)
    assert again.factor(at + 1) == pytest.approx(new.factor(at + 1))
    assert again.factor(new_total + 10) == pytest.approx(0.05)
    assert Schedule.from_dict(again.to_dict()) == again


def test_issue_numbers():
    lr, old = 3e-3, Schedule(0, 20)
    recomputed = Schedule(0, 40)  # what the resumed run used before
    assert lr * old.factor(10) == pytest.approx(1.5e-3)
    assert lr * recomputed.factor(11) > lr * old.factor(10)  # the jump
    assert lr * old.resized(10, 40).factor(11) < lr * old.factor(10)  # gone


def test_lambdalr_state_does_not_bring_the_old_length_back():
    """LambdaLR saves the __dict__ of callable objects: the schedule hands it a plain function,
    so loading a checkpoint's scheduler state keeps the resized schedule."""
    param = torch.nn.Parameter(torch.zeros(1))
    old = Schedule(0, 20)
    opt = torch.optim.SGD([param], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, old.lr_lambda())
    for _ in range(10):
        opt.step()
        sched.step()
    state = sched.state_dict()
    new = old.resized(10, 40)
    opt2 = torch.optim.SGD([param], lr=1.0)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, new.lr_lambda())
    sched2.load_state_dict(state)
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(new.factor(11))
    assert new.factor(11) != pytest.approx(old.factor(11))
