"""The DSpark loss (docs/algorithm.md#the-loss) and its metrics (docs/metrics.md).

loss = (α_ce·CE + α_l1·L1 + Σ_t α_t·D_t + α_c·BCE) · world_size, where each term's denominator is summed
over every data-parallel rank first (D_t: the distribution terms of `model.loss_terms`,
drafters/common/divergences.py). DeepSpeed / DDP average gradients over ranks; the
`· world_size` undoes that average, so one step on N ranks equals one step on one rank over
the same global batch (one weighted mean over every rank's tokens).

`dspark_loss(out, ...)` returns a `StepOutput`: the loss and this rank's metric sums, on the
device, with one all_reduce (the denominators) and no read back to the host: what a training
step runs. `compute_dspark_loss(out, ...)` is the same loss with the metrics summed over the
ranks and read as floats (`dspark_metrics`): the straight-line reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dspark_ds import distributed
from dspark_ds.drafters.common.divergences import (
    dpace_weights,
    slot_divergences,
    static_position_weights,
)
from dspark_ds.drafters.dspark.blocks import DSparkForwardOutput
from dspark_ds.drafters.dspark.config import DSPARK_LOSS, LossWeights
from dspark_ds.drafters.kind import StepOutput, ratio

EPS = 1e-6


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
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # the distribution terms


@dataclass
class LossPlan:
    """What the loss knows before any logits: weights, denominators, coefficients.

    `coef_*` multiply the local numerators; they already hold the global denominator and
    the `· world_size` (docs/algorithm.md#the-loss), so the gradient of Σ coef·num is the step's
    gradient. Every tensor here stays on the device.
    """

    w: torch.Tensor  # [B, A, G] position weights
    valid: torch.Tensor  # [B, A, G] eval_mask as fp32
    local_den: dict[str, torch.Tensor]  # this rank's den_ce, den_l1, den_conf, den_terms
    coef_ce: torch.Tensor  # 0-d fp32
    coef_l1: torch.Tensor  # 0 when the L1 term is off (alpha 0, or no supervised slot anywhere)
    coef_conf: torch.Tensor
    use_l1: bool  # the L1 term is computed (alpha > 0)
    has_conf: bool  # the confidence BCE is computed
    coef_terms: dict[str, torch.Tensor] = field(default_factory=dict)  # per distribution term
    lk_eta: float = 3.0
    dpace_alpha: float | None = None  # D-PACE's smoothing when the schedule is "dpace"
    in_vocab: torch.Tensor | None = None  # [B, A, G] bool: the label is in the draft vocabulary

    def main_weights(self, ce: torch.Tensor) -> torch.Tensor:
        """The weights of L1 and the distribution terms: `w`, or D-PACE's of the (detached)
        per-slot CE, blocks on the last dimension (a label outside the draft vocabulary counts
        as never accepted: exp(-CE) = 0). The confidence BCE keeps `w`."""
        if self.dpace_alpha is None:
            return self.w
        ce = ce.view_as(self.valid)
        if self.in_vocab is not None:
            ce = torch.where(self.in_vocab, ce.detach(), torch.full_like(ce, float("inf")))
        return dpace_weights(ce, self.valid, self.dpace_alpha)

    def ce_weights(self, main: torch.Tensor) -> torch.Tensor:
        """The CE's weights from `main_weights`: 0 where the label is outside the draft
        vocabulary (the draft cannot name it)."""
        return main if self.in_vocab is None else main * self.in_vocab.to(main.dtype)


def plan_loss(
    eval_mask: torch.Tensor,
    weights: LossWeights = DSPARK_LOSS,
    *,
    has_aligned: bool,
    has_confidence: bool,
    over_ranks: bool = True,
    in_vocab: torch.Tensor | None = None,
) -> LossPlan:
    """Checks the inputs and sums the denominators over every rank (one small all_reduce;
    `over_ranks=False`: this rank's own, for a loss nothing is back-propagated through).

    `in_vocab` (a reduced draft vocabulary, drafters/common/vocab.py): a slot whose label is
    outside it has no CE term (the draft cannot name it; its L1, distribution and confidence
    terms stay, over the draft vocabulary) and counts as a greedy miss."""
    world_size = distributed.world_size() if over_ranks else 1
    if weights.l1_loss_alpha > 0 and not has_aligned:
        raise ValueError(
            "l1_loss_alpha > 0 needs aligned_target_logits (pass target_last_hidden_states)"
        )
    if weights.loss_terms and not has_aligned:
        raise ValueError(
            f"loss_terms {dict(weights.loss_terms)} need aligned_target_logits (pass "
            "target_last_hidden_states)"
        )
    has_conf = has_confidence and weights.confidence_head_alpha > 0
    if has_conf and not has_aligned:
        raise ValueError(
            "the confidence head needs aligned_target_logits (pass target_last_hidden_states)"
        )
    w = static_position_weights(
        eval_mask,
        weights.loss_schedule,
        decay_gamma=weights.loss_decay_gamma,
        decay_ratio=weights.loss_decay_ratio,
    )
    use_l1 = has_aligned and weights.l1_loss_alpha > 0
    # D-PACE's weights depend on the logits: its terms are averaged over the supervised slots
    base = eval_mask.to(torch.float32) if weights.dpace else w
    total = base.sum()
    # the CE's: the slots whose label the draft vocabulary holds; L1 and the terms keep them all
    den_ce = total if in_vocab is None else (base * in_vocab.to(base.dtype)).sum()
    zero = torch.zeros_like(total)
    den_conf = w.sum() if has_conf else zero
    local = torch.stack([den_ce, total if use_l1 else zero, den_conf, total])
    den = distributed.all_reduce_(local.clone()) if over_ranks else local
    coef_l1 = _coef(weights.l1_loss_alpha, world_size, den[1])
    return LossPlan(
        w=w,
        valid=eval_mask.to(torch.float32),
        local_den=dict(zip(("den_ce", "den_l1", "den_conf", "den_terms"), local.unbind())),
        coef_ce=_coef(weights.ce_loss_alpha, world_size, den[0]),
        coef_l1=torch.where(den[1] > 0, coef_l1, torch.zeros_like(coef_l1)),
        coef_conf=_coef(weights.confidence_head_alpha, world_size, den[2]) if has_conf else zero,
        use_l1=use_l1,
        has_conf=has_conf,
        coef_terms={n: _coef(a, world_size, den[3]) for n, a in weights.loss_terms},
        lk_eta=weights.lk_eta,
        dpace_alpha=weights.dpace_alpha if weights.dpace else None,
        in_vocab=in_vocab,
    )


def _coef(alpha: float, world_size: int, den: torch.Tensor) -> torch.Tensor:
    """alpha · world_size / (den + EPS) as a 0-d fp32 tensor.

    NOTE: computed in fp64 and rounded once, as the same expression on Python floats would be:
    a loss computed with the coefficient on the device equals one computed with it on the host.
    """
    num = torch.full_like(den, alpha * world_size, dtype=torch.float64)
    return (num / (den.double() + EPS)).float()


def compute_dspark_loss(
    out: DSparkForwardOutput,
    *,
    loss_decay_gamma: float | None = DSPARK_LOSS.loss_decay_gamma,
    ce_loss_alpha: float = DSPARK_LOSS.ce_loss_alpha,
    l1_loss_alpha: float = DSPARK_LOSS.l1_loss_alpha,
    confidence_head_alpha: float = DSPARK_LOSS.confidence_head_alpha,
    **options,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Returns (loss to backpropagate, metrics). Metrics are global over all ranks. `options`:
    LossWeights' other fields (loss_terms, lk_eta, loss_schedule, ...)."""
    weights = LossWeights(
        loss_decay_gamma, ce_loss_alpha, l1_loss_alpha, confidence_head_alpha, **options
    )
    step = dspark_loss(out, weights)
    return step.loss, dspark_metrics(step.global_sums(), weights)


def dspark_loss(
    out: DSparkForwardOutput, weights: LossWeights = DSPARK_LOSS, *, over_ranks: bool = True
) -> StepOutput:
    """The loss of full logits and this rank's metric sums, on the device."""
    logits = out.draft_logits
    vocab = logits.shape[-1]
    plan = plan_loss(
        out.eval_mask,
        weights,
        has_aligned=out.aligned_target_logits is not None,
        has_confidence=out.confidence_pred is not None,
        over_ranks=over_ranks,
        in_vocab=out.label_in_vocab,
    )
    ce = F.cross_entropy(
        logits.reshape(-1, vocab).float(), out.target_ids.reshape(-1), reduction="none"
    )
    dist_l1 = None
    extra = {}
    if out.aligned_target_logits is not None:
        dist_l1 = l1_distance(logits, out.aligned_target_logits)
        if plan.coef_terms:
            extra = slot_divergences(
                logits, out.aligned_target_logits, plan.coef_terms, lk_eta=plan.lk_eta
            )
    with torch.no_grad():
        greedy = logits.argmax(-1) == out.target_ids
    terms = SlotTerms(ce=ce.view_as(plan.w), l1=dist_l1, greedy_hit=greedy, extra=extra)
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
) -> StepOutput:
    """Loss and this rank's metric sums from per-slot terms.

    `main_loss`: the CE + L1 + distribution-terms part, Σ coef·num, when the caller computed it
    (and its gradient) itself; otherwise it is built here from the differentiable `terms`.
    """
    w = plan.w
    w_main = plan.main_weights(terms.ce)
    num_ce = (terms.ce * plan.ce_weights(w_main)).sum()
    zero = num_ce.new_zeros(())
    num_l1 = zero
    c_star = None
    if terms.l1 is not None:
        c_star = (1.0 - 0.5 * terms.l1).clamp(0.0, 1.0)
        if plan.use_l1:
            num_l1 = (terms.l1 * w_main).sum()
    num_terms = {f"num_{n}": (terms.extra[n] * w_main).sum() for n in plan.coef_terms}
    if main_loss is None:
        main_loss = plan.coef_ce * num_ce
        if plan.use_l1:
            main_loss = main_loss + plan.coef_l1 * num_l1
        for name, coef in plan.coef_terms.items():
            main_loss = main_loss + coef * num_terms[f"num_{name}"]
    num_conf = zero
    loss = main_loss
    if plan.has_conf:
        bce = F.binary_cross_entropy_with_logits(
            confidence_pred.float(), c_star.detach(), reduction="none"
        )
        num_conf = (bce * w).sum()
        loss = loss + plan.coef_conf * num_conf

    hit = terms.greedy_hit if plan.in_vocab is None else terms.greedy_hit & plan.in_vocab
    stats = _local_stats(
        hit,
        eval_mask,
        block_keep_mask,
        confidence_pred,
        w,
        plan.valid,
        c_star,
        plan.has_conf,
    )
    sums = {**plan.local_den, "num_ce": num_ce, "num_l1": num_l1, "num_conf": num_conf, **stats}
    sums.update({k: v.detach() for k, v in num_terms.items()})
    return StepOutput.of(loss, sums)


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


def dspark_metrics(g: dict[str, float], weights: LossWeights) -> dict[str, float]:
    """The metrics (docs/metrics.md) of `dspark_loss`'s sums, summed over the ranks."""
    block_size = sum(1 for k in g if k.startswith("count@"))
    has_target = "tau_probabilistic" in g
    has_conf = "conf_abs" in g
    m = {
        "ce_loss": ratio(g["num_ce"], g["den_ce"]),
        "tau_greedy": ratio(g["tau_greedy"], g["blocks"]),
        "supervised_tokens": g["slots"],
    }
    for j in range(block_size):
        m[f"greedy_accept@{j}"] = ratio(g[f"greedy@{j}"], g[f"count@{j}"])
    if has_target:
        m["tau_probabilistic"] = ratio(g["tau_probabilistic"], g["blocks"])
        for j in range(block_size):
            m[f"accept_rate@{j}"] = ratio(g[f"accept@{j}"], g[f"count@{j}"])
    if g["den_l1"] > 0:
        m["l1_loss"] = ratio(g["num_l1"], g["den_l1"])
    if has_conf:
        m["confidence_loss"] = ratio(g["num_conf"], g["den_conf"])
        m["confidence_abs_error"] = ratio(g["conf_abs"], g["den_conf"])
        m["confidence_bias"] = ratio(g["conf_bias"], g["den_conf"])
        m["confidence_cumprod_bias"] = ratio(g["conf_cumprod_bias"], g["den_conf"])
    for name, _ in weights.loss_terms:  # each on the supervised slots' (the CE's without a
        m[f"{name}_loss"] = ratio(g[f"num_{name}"], g["den_terms"])  # draft vocabulary)
    m["loss"] = (
        weights.ce_loss_alpha * m["ce_loss"]
        + (weights.l1_loss_alpha * m["l1_loss"] if "l1_loss" in m else 0.0)
        + (weights.confidence_head_alpha * m["confidence_loss"] if has_conf else 0.0)
        + sum(alpha * m[f"{name}_loss"] for name, alpha in weights.loss_terms)
    )
    return m
