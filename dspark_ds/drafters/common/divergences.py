"""The distribution terms of the loss and the per-position weight schedules: pure per-slot math
that every kind's loss uses (docs/algorithm.md#distribution-terms-and-position-schedules).

A distribution term compares the draft's distribution q = softmax(draft logits) with the target's
p = softmax(aligned target logits), one value per slot (fp32, whatever the logits' dtype, on the
logits' device):

    kl   KL(p ‖ q) = Σ_v p (log p − log q)          forward KL, mass-covering
    rkl  KL(q ‖ p) = Σ_v q (log q − log p)          reverse KL, mode-seeking
    jsd  ½ KL(p ‖ m) + ½ KL(q ‖ m), m = (p + q)/2    bounded by log 2
    tv   1 − α, α = Σ_v min(p, q)                   α: the rejection-sampling acceptance
    nla  −log max(α, NLA_EPS)                       its gradient is that of tv over α
    lk   λ·kl + (1 − λ)·tv, λ = exp(−η·sg(α))        KL while α is small, TV once it grows

A schedule gives each slot j of a block (the last dimension) its weight:

    exp        exp(−j / γ_decay)                        (no decay when γ_decay is None or <= 0)
    geometric  r ** j
    dpace      Σ_{k >= j} Π_{i <= k} s_i over the block's supervised slots, where
               s_i = (1 − a)·exp(−CE_i) + a (the smoothed confidence, detached); 0 where unsupervised

D-PACE's weight of slot j is the derivative of the block's expected accepted length
Σ_k Π_{i<=k} s_i with respect to log s_j: a slot counts as much as the accepted tokens that need it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping

import torch

from dspark_ds.errors import ConfigError

TERMS = ("kl", "rkl", "jsd", "tv", "nla", "lk")
"""The distribution terms (`model.loss_terms` keys), in the order the loss adds them."""
SCHEDULES = ("exp", "geometric", "dpace")
"""The per-position weight schedules (`model.loss_schedule`)."""
NLA_EPS = 1e-5
"""nla's floor on the overlap α (−log α stays finite at α = 0)."""
LK_ETA = 3.0
"""lk's default η."""
DPACE_ALPHA = 0.5
"""D-PACE's default smoothing a."""


# ---- options -----------------------------------------------------------------------------------
def parse_terms(spec: Mapping[str, float] | str | None, option: str = "model.loss_terms"):
    """A term spec → ((name, weight), ...) in `TERMS` order, weights > 0 only.

    `spec`: a mapping name → weight, a JSON object of the same, or one name (weight 1). An unknown
    name, or a weight that is not a number >= 0, is a ConfigError naming `option`."""
    if spec is None:
        return ()
    if isinstance(spec, str):
        text = spec.strip()
        if not text:
            return ()
        spec = json.loads(text) if text.startswith("{") else {text: 1.0}
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{option}: expected a mapping term → weight, got {spec!r}")
    for name, weight in spec.items():
        if name not in TERMS:
            raise ConfigError(f"{option}: unknown term {name!r}; choose from {', '.join(TERMS)}")
        ok = isinstance(weight, (int, float)) and not isinstance(weight, bool)
        if not ok or not weight >= 0 or math.isinf(weight):
            raise ConfigError(
                f"{option}: the weight of {name!r} must be a number >= 0, got {weight!r}"
            )
    return tuple((n, float(spec[n])) for n in TERMS if n in spec and spec[n] > 0)


def check_schedule(name: str, option: str = "model.loss_schedule") -> str:
    """`name` when it is a schedule; else a ConfigError naming `option` and the choices."""
    if name not in SCHEDULES:
        raise ConfigError(
            f"{option}: unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}"
        )
    return name


# ---- per-slot terms ----------------------------------------------------------------------------
def slot_divergences(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    names: Iterable[str],
    *,
    lk_eta: float = LK_ETA,
) -> dict[str, torch.Tensor]:
    """{name: per-slot value [...]} of the terms `names` between softmax(draft_logits) and
    softmax(target_logits) ([..., V] each, any float dtype), fp32, differentiable in both."""
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    log_p = torch.log_softmax(target_logits.float(), dim=-1)
    return divergences_of_log_probs(log_q, log_p, names, lk_eta=lk_eta)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """Σ_v a (log a − log b), 0·(anything) = 0 where a is 0 (a −inf logit: a masked token).

    NOTE: the difference is masked before the product, so no NaN reaches the gradient either."""
    a = log_a.exp()
    diff = torch.where(a > 0, log_a - log_b, torch.zeros_like(a))
    return (a * diff).sum(-1)


def divergences_of_log_probs(
    log_q: torch.Tensor, log_p: torch.Tensor, names: Iterable[str], *, lk_eta: float = LK_ETA
) -> dict[str, torch.Tensor]:
    """`slot_divergences` from fp32 log-probabilities (draft log q, target log p)."""
    names = tuple(names)
    unknown = [n for n in names if n not in TERMS]
    if unknown:
        raise ValueError(f"loss terms: unknown {unknown}; choose from {', '.join(TERMS)}")
    out: dict[str, torch.Tensor] = {}
    overlap = None
    if {"tv", "nla", "lk"} & set(names):
        overlap = torch.minimum(log_q, log_p).exp().sum(-1)  # α = Σ min(p, q)
    if {"kl", "lk"} & set(names):
        kl = _kl(log_p, log_q)
    for name in names:
        if name == "kl":
            out[name] = kl
        elif name == "rkl":
            out[name] = _kl(log_q, log_p)
        elif name == "jsd":
            # NOTE: a token both give −inf (masked) would make logaddexp's gradient NaN; its
            # log m is never used (p = q = 0 there), so it is computed from 0s instead
            both = torch.isneginf(log_p) & torch.isneginf(log_q)
            zero = torch.zeros_like(log_p)
            log_m = torch.logaddexp(
                torch.where(both, zero, log_p), torch.where(both, zero, log_q)
            ) - math.log(2.0)
            out[name] = 0.5 * (_kl(log_p, log_m) + _kl(log_q, log_m))
        elif name == "tv":
            out[name] = 1.0 - overlap
        elif name == "nla":
            out[name] = -torch.log(overlap.clamp_min(NLA_EPS))
        else:  # lk
            lam = torch.exp(-float(lk_eta) * overlap.detach())
            out[name] = lam * kl + (1.0 - lam) * (1.0 - overlap)
    return out


# ---- per-position weights ----------------------------------------------------------------------
def static_position_weights(
    valid: torch.Tensor, schedule: str, *, decay_gamma: float | None, decay_ratio: float
) -> torch.Tensor:
    """valid · (the schedule's weight of slot j), slot j the last dimension, fp32. "dpace" depends
    on the logits (`dpace_weights`); here it gives the "exp" weights (what the confidence head's
    loss keeps under it)."""
    w = valid.to(torch.float32)
    j = torch.arange(w.shape[-1], device=w.device, dtype=torch.float32)
    if schedule == "geometric":
        return w * float(decay_ratio) ** j
    check_schedule(schedule)
    if decay_gamma is not None and decay_gamma > 0:
        w = w * torch.exp(-j / float(decay_gamma))
    return w


@torch.no_grad()
def dpace_weights(ce: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights [..., G] from the per-slot cross-entropy (detached) and the supervised
    slots: suffix sums of the prefix products of s = (1 − alpha)·exp(−ce) + alpha, unsupervised
    slots counted as s = 1 and weighted 0."""
    mask = valid.to(torch.float32)
    smooth = (1.0 - float(alpha)) * torch.exp(-ce.detach().float()) + float(alpha)
    smooth = torch.where(mask > 0, smooth, torch.ones_like(smooth))
    prefix = torch.cumprod(smooth, dim=-1) * mask
    return prefix.flip(-1).cumsum(-1).flip(-1) * mask


def divergences_and_grad(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    names: Iterable[str],
    *,
    lk_eta: float = LK_ETA,
    row_coefs: Mapping[str, torch.Tensor] | None = None,
    target_grad: bool = False,
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None]:
    """For a loss that applies its own gradients (the chunked paths): the terms' per-row values
    (detached) of [N, V] logits and, given `row_coefs` ({name: [N]}), the gradient of
    Σ_t Σ_n row_coefs[t][n]·term_t[n] with respect to the draft logits (fp32), and to the target
    logits when `target_grad` (None otherwise)."""
    names = tuple(names)
    want = row_coefs is not None
    x = draft_logits.detach().float().requires_grad_(want)
    t = target_logits.detach().float().requires_grad_(want and target_grad)
    grad_draft = grad_target = None
    with torch.set_grad_enabled(want):
        values = slot_divergences(x, t, names, lk_eta=lk_eta)
        if want:
            total = sum((row_coefs[n] * values[n]).sum() for n in names)
    if want:
        grads = torch.autograd.grad(total, (x, t) if target_grad else (x,))
        grad_draft = grads[0]
        grad_target = grads[1] if target_grad else None
    return {n: v.detach() for n, v in values.items()}, grad_draft, grad_target
