"""The DSpark loss (docs/algorithm.md#the-loss) and its metrics (docs/metrics.md).

loss = (α_ce·CE + α_l1·L1 + α_c·BCE) · world_size, where each term's denominator is summed
over every data-parallel rank first. DeepSpeed / DDP average gradients over ranks; the
`· world_size` undoes that average, so one step on N ranks equals one step on one rank over
the same global batch (one weighted mean over every rank's tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark_ds import distributed
from dspark_ds.drafters.common.blocks import DSparkForwardOutput
from dspark_ds.drafters.presets import DSPARK_LOSS

EPS = 1e-6


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


@dataclass
class SlotTerms:
    """The vocabulary-sized part of the loss, reduced to one value per slot [B, A, G].

    The reference path computes them from full logits (differentiable); the chunked path
    (dspark_ds.drafters.dspark.loss_chunked) computes them a few anchors at a time (detached, its
    gradient already applied through `main_loss`).
    """

    ce: torch.Tensor  # cross-entropy of the draft logits vs target_ids
    l1: torch.Tensor | None  # Σ_v |p_d - p_t|; None without aligned target logits
    greedy_hit: torch.Tensor  # bool, argmax(draft) == target_id


@dataclass
class LossPlan:
    """What the loss knows before any logits: weights, global denominators, coefficients.

    `coef_*` multiply the local numerators; they already hold the global denominator and
    the `· world_size` (docs/algorithm.md#the-loss), so the gradient of Σ coef·num is the step's gradient.
    """

    w: torch.Tensor  # [B, A, G] position weights
    valid: torch.Tensor  # [B, A, G] eval_mask as fp32
    den: dict[str, float]  # global den_ce, den_l1, den_conf
    coef_ce: float
    coef_l1: float  # 0 when the L1 term is off (alpha 0, or no supervised slot anywhere)
    coef_conf: float
    use_l1: bool  # the L1 term is computed (alpha > 0)
    has_conf: bool  # the confidence BCE is computed
    alphas: tuple[float, float, float]  # ce, l1, confidence
    world_size: int


def plan_loss(
    eval_mask: torch.Tensor,
    *,
    has_aligned: bool,
    has_confidence: bool,
    loss_decay_gamma: float | None = DSPARK_LOSS.loss_decay_gamma,
    ce_loss_alpha: float = DSPARK_LOSS.ce_loss_alpha,
    l1_loss_alpha: float = DSPARK_LOSS.l1_loss_alpha,
    confidence_head_alpha: float = DSPARK_LOSS.confidence_head_alpha,
) -> LossPlan:
    """Checks the inputs and all-reduces the denominators (one small all_reduce)."""
    world_size = distributed.world_size()
    if l1_loss_alpha > 0 and not has_aligned:
        raise ValueError(
            "l1_loss_alpha > 0 needs aligned_target_logits (pass target_last_hidden_states)"
        )
    has_conf = has_confidence and confidence_head_alpha > 0
    if has_conf and not has_aligned:
        raise ValueError(
            "the confidence head needs aligned_target_logits (pass target_last_hidden_states)"
        )
    w = position_weights(eval_mask, loss_decay_gamma)
    use_l1 = has_aligned and l1_loss_alpha > 0
    total = w.sum()
    den = _all_reduce_named(
        {
            "den_ce": total,
            "den_l1": total if use_l1 else torch.zeros_like(total),
            "den_conf": total if has_conf else torch.zeros_like(total),
        }
    )
    return LossPlan(
        w=w,
        valid=eval_mask.to(torch.float32),
        den=den,
        coef_ce=ce_loss_alpha * world_size / (den["den_ce"] + EPS),
        coef_l1=l1_loss_alpha * world_size / (den["den_l1"] + EPS) if den["den_l1"] > 0 else 0.0,
        coef_conf=confidence_head_alpha * world_size / (den["den_conf"] + EPS) if has_conf else 0.0,
        use_l1=use_l1,
        has_conf=has_conf,
        alphas=(ce_loss_alpha, l1_loss_alpha, confidence_head_alpha),
        world_size=world_size,
    )


def compute_dspark_loss(
    out: DSparkForwardOutput,
    *,
    loss_decay_gamma: float | None = DSPARK_LOSS.loss_decay_gamma,
    ce_loss_alpha: float = DSPARK_LOSS.ce_loss_alpha,
    l1_loss_alpha: float = DSPARK_LOSS.l1_loss_alpha,
    confidence_head_alpha: float = DSPARK_LOSS.confidence_head_alpha,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Returns (loss to backpropagate, metrics). Metrics are global over all ranks."""
    logits = out.draft_logits
    vocab = logits.shape[-1]
    plan = plan_loss(
        out.eval_mask,
        has_aligned=out.aligned_target_logits is not None,
        has_confidence=out.confidence_pred is not None,
        loss_decay_gamma=loss_decay_gamma,
        ce_loss_alpha=ce_loss_alpha,
        l1_loss_alpha=l1_loss_alpha,
        confidence_head_alpha=confidence_head_alpha,
    )
    ce = F.cross_entropy(
        logits.reshape(-1, vocab).float(), out.target_ids.reshape(-1), reduction="none"
    )
    dist_l1 = None
    if out.aligned_target_logits is not None:
        dist_l1 = l1_distance(logits, out.aligned_target_logits)
    with torch.no_grad():
        greedy = logits.argmax(-1) == out.target_ids
    terms = SlotTerms(ce=ce.view_as(plan.w), l1=dist_l1, greedy_hit=greedy)
    return finish_loss(
        plan,
        terms,
        eval_mask=out.eval_mask,
        block_keep_mask=out.block_keep_mask,
        confidence_pred=out.confidence_pred,
    )


def finish_loss(
    plan: LossPlan,
    terms: SlotTerms,
    *,
    eval_mask: torch.Tensor,
    block_keep_mask: torch.Tensor,
    confidence_pred: torch.Tensor | None,
    main_loss: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss and global metrics from per-slot terms.

    `main_loss`: the CE + L1 part, Σ coef·num, when the caller computed it (and its
    gradient) itself; otherwise it is built here from the differentiable `terms`.
    """
    w = plan.w
    num_ce = (terms.ce * w).sum()
    zero = num_ce.new_zeros(())
    num_l1 = zero
    c_star = None
    if terms.l1 is not None:
        c_star = (1.0 - 0.5 * terms.l1).clamp(0.0, 1.0)
        if plan.use_l1:
            num_l1 = (terms.l1 * w).sum()
    if main_loss is None:
        main_loss = plan.coef_ce * num_ce
        if plan.coef_l1 > 0:
            main_loss = main_loss + plan.coef_l1 * num_l1
    num_conf = zero
    loss = main_loss
    if plan.has_conf:
        bce = F.binary_cross_entropy_with_logits(
            confidence_pred.float(), c_star.detach(), reduction="none"
        )
        num_conf = (bce * w).sum()
        loss = loss + plan.coef_conf * num_conf

    # One all_reduce for every metric sum.
    stats = _local_stats(
        terms.greedy_hit,
        eval_mask,
        block_keep_mask,
        confidence_pred,
        w,
        plan.valid,
        c_star,
        plan.has_conf,
    )
    g = dict(plan.den)
    g.update(
        _all_reduce_named(
            {
                "num_ce": num_ce.detach(),
                "num_l1": num_l1.detach(),
                "num_conf": num_conf.detach(),
                **stats,
            }
        )
    )
    ce_alpha, l1_alpha, conf_alpha = plan.alphas
    metrics = _metrics(g, w.shape[-1], plan.has_conf, c_star is not None)
    metrics["loss"] = (
        ce_alpha * metrics["ce_loss"]
        + (l1_alpha * metrics["l1_loss"] if "l1_loss" in metrics else 0.0)
        + (conf_alpha * metrics["confidence_loss"] if plan.has_conf else 0.0)
    )
    return loss, metrics


def _all_reduce_named(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Sums scalar tensors over every rank in one all_reduce; returns Python floats."""
    sums = torch.stack([v.detach().to(torch.float32) for v in values.values()])
    return dict(zip(values, distributed.all_reduce_(sums).tolist()))


@torch.no_grad()
def _local_stats(
    greedy_hit, eval_mask, block_keep_mask, confidence_pred, w, valid, c_star, has_conf
) -> dict[str, torch.Tensor]:
    """Numerators and denominators of every metric on this rank (summed later)."""
    block_size = valid.shape[-1]
    valid_blocks = (block_keep_mask & eval_mask.any(-1)).to(torch.float32)
    greedy = greedy_hit.to(torch.float32) * valid
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
        p = confidence_pred.float().sigmoid()
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
