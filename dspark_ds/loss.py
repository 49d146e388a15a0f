"""The DSpark loss (spec §8) and its metrics (spec §9).

loss = (α_ce·CE + α_l1·L1 + α_c·BCE) · world_size, where each term's denominator is summed
over every data-parallel rank first. DeepSpeed / DDP average gradients over ranks; the
`· world_size` undoes that average, so one step on N ranks equals one step on one rank over
the same global batch (one weighted mean over every rank's tokens).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dspark_ds.models.common import DSparkForwardOutput

EPS = 1e-6


def _world() -> tuple[int, object | None]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.group.WORLD
    return 1, None


def position_weights(eval_mask: torch.Tensor, loss_decay_gamma: float | None) -> torch.Tensor:
    """w_j = eval_mask · exp(-j / γ_decay); no decay when γ_decay is None or <= 0."""
    w = eval_mask.to(torch.float32)
    if loss_decay_gamma is not None and loss_decay_gamma > 0:
        j = torch.arange(w.shape[-1], device=w.device, dtype=torch.float32)
        w = w * torch.exp(-j / float(loss_decay_gamma))
    return w


def accept_rate(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """c* = clamp(1 - TV(p_d, p_t), 0, 1): the exact rejection-sampling acceptance, fp32."""
    return (1.0 - 0.5 * l1_distance(draft_logits, target_logits)).clamp(0.0, 1.0)


def l1_distance(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Σ_v |softmax(draft) - softmax(target)| (= 2·TV), fp32, over the last dim."""
    return (
        (torch.softmax(draft_logits.float(), -1) - torch.softmax(target_logits.float(), -1))
        .abs()
        .sum(-1)
    )


def compute_dspark_loss(
    out: DSparkForwardOutput,
    *,
    loss_decay_gamma: float | None = 4.0,
    ce_loss_alpha: float = 0.1,
    l1_loss_alpha: float = 0.9,
    confidence_head_alpha: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Returns (loss to backpropagate, metrics). Metrics are global over all ranks."""
    world_size, group = _world()
    logits = out.draft_logits
    block_size, vocab = logits.shape[-2:]
    w = position_weights(out.eval_mask, loss_decay_gamma)
    valid = out.eval_mask.to(torch.float32)
    aligned = out.aligned_target_logits
    if l1_loss_alpha > 0 and aligned is None:
        raise ValueError(
            "l1_loss_alpha > 0 needs aligned_target_logits (pass target_last_hidden_states)"
        )
    has_conf = out.confidence_pred is not None and confidence_head_alpha > 0
    if has_conf and aligned is None:
        raise ValueError(
            "the confidence head needs aligned_target_logits (pass target_last_hidden_states)"
        )

    ce = F.cross_entropy(
        logits.reshape(-1, vocab).float(), out.target_ids.reshape(-1), reduction="none"
    )
    num_ce = (ce.view_as(w) * w).sum()
    zero = num_ce.new_zeros(())
    num_l1, den_l1 = zero, zero
    c_star = None
    if aligned is not None:
        dist_l1 = l1_distance(logits, aligned)
        c_star = (1.0 - 0.5 * dist_l1).clamp(0.0, 1.0)
        if l1_loss_alpha > 0:
            num_l1, den_l1 = (dist_l1 * w).sum(), w.sum()
    num_conf, den_conf = zero, zero
    if has_conf:
        bce = F.binary_cross_entropy_with_logits(
            out.confidence_pred.float(), c_star.detach(), reduction="none"
        )
        num_conf, den_conf = (bce * w).sum(), w.sum()

    # One all_reduce for every denominator and every metric sum.
    stats = _local_stats(out, w, valid, c_star, has_conf)
    den_names = ["den_ce", "den_l1", "den_conf"]
    sums = torch.stack(
        [
            w.sum(),
            den_l1.detach(),
            den_conf.detach(),
            num_ce.detach(),
            num_l1.detach(),
            num_conf.detach(),
            *stats.values(),
        ]
    )
    if world_size > 1:
        sums = sums.clone()
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    names = den_names + ["num_ce", "num_l1", "num_conf", *stats.keys()]
    g = dict(zip(names, sums.tolist()))

    loss = ce_loss_alpha * num_ce / (g["den_ce"] + EPS)
    if g["den_l1"] > 0:
        loss = loss + l1_loss_alpha * num_l1 / (g["den_l1"] + EPS)
    if has_conf:
        loss = loss + confidence_head_alpha * num_conf / (g["den_conf"] + EPS)
    loss = loss * world_size

    metrics = _metrics(g, block_size, has_conf, c_star is not None)
    metrics["loss"] = (
        ce_loss_alpha * metrics["ce_loss"]
        + (l1_loss_alpha * metrics["l1_loss"] if "l1_loss" in metrics else 0.0)
        + (confidence_head_alpha * metrics["confidence_loss"] if has_conf else 0.0)
    )
    return loss, metrics


@torch.no_grad()
def _local_stats(out, w, valid, c_star, has_conf) -> dict[str, torch.Tensor]:
    """Numerators and denominators of every metric on this rank (summed later)."""
    block_size = valid.shape[-1]
    valid_blocks = (out.block_keep_mask & out.eval_mask.any(-1)).to(torch.float32)
    greedy = (out.draft_logits.argmax(-1) == out.target_ids).to(torch.float32) * valid
    s = {
        "blocks": valid_blocks.sum(),
        "tau_greedy": ((1.0 + greedy.cumprod(-1).sum(-1)) * valid_blocks).sum(),
        "slots": valid.sum(),
    }
    for j in range(block_size):
        s[f"count@{j}"] = valid[..., j].sum()
        s[f"greedy@{j}"] = greedy[..., j].sum()
    if c_star is not None:
        accepted = c_star * valid
        s["tau_probabilistic"] = ((1.0 + accepted.cumprod(-1).sum(-1)) * valid_blocks).sum()
        for j in range(block_size):
            s[f"accept@{j}"] = accepted[..., j].sum()
    if has_conf:
        p = out.confidence_pred.float().sigmoid()
        err = p - c_star
        s["conf_abs"] = (err.abs() * w).sum()
        s["conf_bias"] = (err * w).sum()
        prefix_err = (p * valid).cumprod(-1) - (c_star * valid).cumprod(-1)
        s["conf_cumprod_bias"] = (prefix_err * w).sum()
    return s


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def _metrics(
    g: dict[str, float], block_size: int, has_conf: bool, has_target: bool
) -> dict[str, float]:
    m = {
        "ce_loss": _ratio(g["num_ce"], g["den_ce"]),
        "tau_greedy": _ratio(g["tau_greedy"], g["blocks"]),
        "supervised_tokens": g["slots"],
    }
    for j in range(block_size):
        m[f"greedy_accept@{j}"] = _ratio(g[f"greedy@{j}"], g[f"count@{j}"])
    if has_target:
        m["tau_probabilistic"] = _ratio(g["tau_probabilistic"], g["blocks"])
        for j in range(block_size):
            m[f"accept_rate@{j}"] = _ratio(g[f"accept@{j}"], g[f"count@{j}"])
    if g["den_l1"] > 0:
        m["l1_loss"] = _ratio(g["num_l1"], g["den_l1"])
    if has_conf:
        m["confidence_loss"] = _ratio(g["num_conf"], g["den_conf"])
        m["confidence_abs_error"] = _ratio(g["conf_abs"], g["den_conf"])
        m["confidence_bias"] = _ratio(g["conf_bias"], g["den_conf"])
        m["confidence_cumprod_bias"] = _ratio(g["conf_cumprod_bias"], g["den_conf"])
    return m
