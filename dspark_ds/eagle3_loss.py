"""The Eagle3 training loss: per-step soft cross-entropy against the target, decayed over steps.

    loss = world_size · Σ_k decay^k · Σ_{b,t} m_k · CE(p_t[t + k + 1], p_d,k[t]) / D_k

`p_t[i] = softmax(lm_head(target_last_hidden_states[i]))` is the target's own distribution for
token i + 1 (the one step k at position t predicts when i = t + k + 1), `m_k = eval_mask[..., k]`
and `D_k` its sum over every data-parallel rank. As for DSpark (spec §8) the `· world_size`
cancels DeepSpeed's gradient averaging, so a step is one global token-weighted mean per TTT step.

NOTE: the reference normalizes each step by the LOCAL B·S instead (a per-sequence mean at micro
batch 1). We use the same global token mean as the DSpark loss so that the three drafters are
trained with one weighting; `step_loss_decay` and the soft targets match the reference.

Metrics (global over ranks), named like the DSpark ones so MLflow plots line up:
`ploss_{k}`, `loss`, `accept_rate@k` (1 - TV), `greedy_accept@k` (argmax = data token),
`accuracy@k` (argmax = target argmax), `tau_probabilistic`, `tau_greedy` (1 + expected
accepted prefix, averaged over anchors with >= 1 valid step), `supervised_tokens`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dspark_ds.models.eagle3 import Eagle3ForwardOutput

EPS = 1e-6


def _world() -> tuple[int, object | None]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.group.WORLD
    return 1, None


def target_probs_for_step(target_probs: torch.Tensor, step: int) -> torch.Tensor:
    """[B, S, V] -> [B, S, V]: row t holds target_probs[t + step + 1] (zeros past the end)."""
    shift = step + 1
    pad = target_probs.new_zeros(
        (target_probs.shape[0], min(shift, target_probs.shape[1]), target_probs.shape[2])
    )
    return torch.cat([target_probs[:, shift:], pad], dim=1)


def compute_eagle3_loss(
    out: Eagle3ForwardOutput, *, step_loss_decay: float = 0.8
) -> tuple[torch.Tensor, dict[str, float]]:
    """Returns (loss to backpropagate, metrics). Needs `out.target_logits`."""
    if out.target_logits is None:
        raise ValueError(
            "target_logits: the Eagle3 loss is a soft cross-entropy against the target; pass "
            "target_last_hidden_states to the forward"
        )
    if not step_loss_decay > 0:
        raise ValueError(f"step_loss_decay: must be > 0, got {step_loss_decay!r}")
    world_size, group = _world()
    steps = out.draft_logits.shape[2]
    mask = out.eval_mask.to(torch.float32)  # [B, S, T]
    with torch.no_grad():
        target_probs = torch.softmax(out.target_logits.float(), dim=-1)

    nums: list[torch.Tensor] = []
    stats: dict[str, torch.Tensor] = {}
    accept_steps, greedy_steps = [], []
    for k in range(steps):
        p_t = target_probs_for_step(target_probs, k)
        log_p_d = torch.log_softmax(out.draft_logits[:, :, k].float(), dim=-1)
        ce = -(p_t * log_p_d).sum(-1)  # [B, S]
        m = mask[..., k]
        nums.append((ce * m).sum())
        with torch.no_grad():
            c_star = (1.0 - 0.5 * (log_p_d.exp() - p_t).abs().sum(-1)).clamp(0.0, 1.0) * m
            draft_arg = log_p_d.argmax(-1)
            greedy = (draft_arg == out.target_ids[..., k]).float() * m
            matches = (draft_arg == p_t.argmax(-1)).float() * m
            stats[f"den@{k}"] = m.sum()
            stats[f"accept@{k}"] = c_star.sum()
            stats[f"greedy@{k}"] = greedy.sum()
            stats[f"match@{k}"] = matches.sum()
            accept_steps.append(c_star)
            greedy_steps.append(greedy)

    with torch.no_grad():
        anchors = mask[..., 0]  # an anchor counts when its first step is valid
        accepted = torch.stack(accept_steps, dim=-1).cumprod(-1).sum(-1)
        greedy_prefix = torch.stack(greedy_steps, dim=-1).cumprod(-1).sum(-1)
        stats["anchors"] = anchors.sum()
        stats["tau_probabilistic"] = ((1.0 + accepted) * anchors).sum()
        stats["tau_greedy"] = ((1.0 + greedy_prefix) * anchors).sum()
        stats["slots"] = mask.sum()
        for k in range(steps):
            stats[f"num@{k}"] = nums[k].detach()

    # One all_reduce for every denominator and metric sum.
    sums = torch.stack(list(stats.values()))
    if world_size > 1:
        sums = sums.clone()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    g = dict(zip(stats.keys(), sums.tolist()))

    loss = out.draft_logits.new_zeros((), dtype=torch.float32)
    for k in range(steps):
        loss = loss + (float(step_loss_decay) ** k) * nums[k] / (g[f"den@{k}"] + EPS)
    loss = loss * world_size
    return loss, _metrics(g, steps, float(step_loss_decay))


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def _metrics(g: dict[str, float], steps: int, decay: float) -> dict[str, float]:
    m: dict[str, float] = {
        "tau_probabilistic": _ratio(g["tau_probabilistic"], g["anchors"]),
        "tau_greedy": _ratio(g["tau_greedy"], g["anchors"]),
        "supervised_tokens": g["slots"],
    }
    total = 0.0
    for k in range(steps):
        den = g[f"den@{k}"]
        ploss = _ratio(g[f"num@{k}"], den)
        m[f"ploss_{k}"] = ploss
        m[f"accept_rate@{k}"] = _ratio(g[f"accept@{k}"], den)
        m[f"greedy_accept@{k}"] = _ratio(g[f"greedy@{k}"], den)
        m[f"accuracy@{k}"] = _ratio(g[f"match@{k}"], den)
        if den > 0:
            total += decay**k * ploss
    m["loss"] = total
    return m
