"""The Eagle3 training loss: per-step soft cross-entropy against the target, decayed over steps.

    loss = world_size · Σ_k decay^k · Σ_{b,t} m_k · CE(p_t[t + k + 1], p_d,k[t]) / D_k

`p_t[i] = softmax(lm_head(target_last_hidden_states[i]))` is the target's own distribution for
token i + 1 (the one step k at position t predicts when i = t + k + 1), `m_k = eval_mask[..., k]`
and `D_k` its sum over every data-parallel rank. As for DSpark (docs/algorithm.md#the-loss) the `· world_size`
cancels DeepSpeed's gradient averaging, so a step is one global token-weighted mean per TTT step.

With `loss_terms` ({name: α}, drafters/common/divergences.py), each step's loss adds
Σ_t α_t·D_t(p_t, p_d,k) to the soft CE, on the same weights and denominators; the metric
`<name>_loss` is Σ_k decay^k·(its mean at step k), as `loss` is of the `ploss_k`.

NOTE: the reference normalizes each step by the LOCAL B·S instead (a per-sequence mean at micro
batch 1). We use the same global token mean as the DSpark loss so that the three drafters are
trained with one weighting; `step_loss_decay` and the soft targets match the reference.

Metrics (global over ranks), named like the DSpark ones so MLflow plots line up:
`ploss_{k}`, `loss`, `accept_rate@k` (1 - TV), `greedy_accept@k` (argmax = data token),
`accuracy@k` (argmax = target argmax), `tau_probabilistic`, `tau_greedy` (1 + expected
accepted prefix, averaged over anchors with >= 1 valid step), `supervised_tokens`.

Two paths with the same loss, gradients and metric sums: `eagle3_loss` on full [B, S, T, V]
logits (the reference, tested against a naive loop; `compute_eagle3_loss` reads its metrics as
floats), and `chunked_eagle3_loss`,
which never holds more than `chunk_rows` rows of vocabulary-sized tensors: per chunk the
gradient of the soft CE w.r.t. the logits is closed-form (softmax(draft) - p_t) and is pushed
through the frozen lm_head at once, so only an [N, H] gradient survives the forward.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dspark_ds import distributed
from dspark_ds.drafters.common.divergences import (
    LK_ETA,
    divergences_and_grad,
    divergences_of_log_probs,
    parse_terms,
)
from dspark_ds.drafters.eagle3.config import LOSS_IMPLEMENTATIONS, STEP_LOSS_DECAY
from dspark_ds.drafters.eagle3.model import Eagle3ForwardOutput, Eagle3Hidden
from dspark_ds.drafters.kind import StepOutput, bare, ratio
from dspark_ds.errors import ConfigError

EPS = 1e-6


def loss_impl_for(impl: str, zero3: bool) -> str:
    """perf.loss_impl -> the path a step takes: "auto" -> "chunked", or "reference" (full
    logits) under ZeRO-3; "recompute" (a DSpark form) and "chunked" under ZeRO-3 are refused.

    NOTE: the chunked loss calls the lm_head outside the engine's forward; under ZeRO-3 that
    leaves the gathered lm_head marked active, so there the full logits are the only path.
    """
    if impl not in LOSS_IMPLEMENTATIONS:
        raise ConfigError(
            f"perf.loss_impl: {impl!r} is not available for eagle3 drafters; choose one of "
            f"{LOSS_IMPLEMENTATIONS}"
        )
    if impl == "auto":
        return "reference" if zero3 else "chunked"
    if impl == "chunked" and zero3:
        raise ConfigError(
            "perf.loss_impl: chunked is not available for eagle3 drafters under ZeRO-3 (its "
            "lm_head calls run outside the engine's forward); use auto or reference"
        )
    return impl


def target_probs_for_step(target_probs: torch.Tensor, step: int) -> torch.Tensor:
    """[B, S, V] -> [B, S, V]: row t holds target_probs[t + step + 1] (zeros past the end)."""
    shift = step + 1
    pad = target_probs.new_zeros(
        (target_probs.shape[0], min(shift, target_probs.shape[1]), target_probs.shape[2])
    )
    return torch.cat([target_probs[:, shift:], pad], dim=1)


def compute_eagle3_loss(
    out: Eagle3ForwardOutput,
    *,
    step_loss_decay: float = STEP_LOSS_DECAY,
    loss_terms: Any = (),
    lk_eta: float = LK_ETA,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Returns (loss to backpropagate, metrics) from full logits. Needs `out.target_logits`."""
    step = eagle3_loss(out, step_loss_decay=step_loss_decay, loss_terms=loss_terms, lk_eta=lk_eta)
    return step.loss, eagle3_metrics(step.global_sums(), step_loss_decay, loss_terms)


def _terms(loss_terms: Any) -> tuple[tuple[str, float], ...]:
    """((name, α), ...) of a term spec (a mapping, or such pairs)."""
    return parse_terms(dict(loss_terms)) if loss_terms else ()


def _log_probs_for_step(target_logp: torch.Tensor, step: int) -> torch.Tensor:
    """`target_probs_for_step` of log-probabilities: past the end, uniform rows (finite; those
    rows are never supervised)."""
    shift = step + 1
    fill = -math.log(target_logp.shape[-1])
    pad = torch.full_like(target_logp[:, : min(shift, target_logp.shape[1])], fill)
    return torch.cat([target_logp[:, shift:], pad], dim=1)


def eagle3_loss(
    out: Eagle3ForwardOutput,
    *,
    step_loss_decay: float = STEP_LOSS_DECAY,
    over_ranks: bool = True,
    loss_terms: Any = (),
    lk_eta: float = LK_ETA,
) -> StepOutput:
    """The loss of full logits and this rank's metric sums, on the device (one all_reduce: the
    denominators; `over_ranks=False`: this rank's own, for a loss nothing is back-propagated
    through)."""
    if out.target_logits is None:
        raise ValueError(
            "target_logits: the Eagle3 loss is a soft cross-entropy against the target; pass "
            "target_last_hidden_states to the forward"
        )
    _check_decay(step_loss_decay)
    terms = _terms(loss_terms)
    world_size = distributed.world_size() if over_ranks else 1
    steps = out.draft_logits.shape[2]
    mask = out.eval_mask.to(torch.float32)  # [B, S, T]
    with torch.no_grad():
        target_logp = torch.log_softmax(out.target_logits.float(), dim=-1)
        target_probs = target_logp.exp()

    ce_steps, slots, extra_steps = [], [], []
    for k in range(steps):
        p_t = target_probs_for_step(target_probs, k)
        log_p_d = torch.log_softmax(out.draft_logits[:, :, k].float(), dim=-1)
        ce_steps.append(-(p_t * log_p_d).sum(-1))  # [B, S]
        if terms:
            log_p_t = _log_probs_for_step(target_logp, k)
            extra_steps.append(
                divergences_of_log_probs(log_p_d, log_p_t, dict(terms), lk_eta=lk_eta)
            )
        with torch.no_grad():
            slots.append(_slot_terms(log_p_d, p_t, out.target_ids[..., k]))
    ce = torch.stack(ce_steps, dim=-1)  # [B, S, T], differentiable
    extra = {n: torch.stack([e[n] for e in extra_steps], dim=-1) for n, _ in terms}
    c_star, greedy, match = (torch.stack(t, dim=-1) for t in zip(*slots))
    detached = {n: v.detach() for n, v in extra.items()}
    stats = _local_stats(mask, ce.detach(), c_star, greedy, match, detached)
    dens = torch.stack([stats[f"den@{k}"] for k in range(steps)])
    if over_ranks:
        dens = distributed.all_reduce_(dens)
    # NOTE: den + EPS in fp64, rounded once: the same divisor as on Python floats
    dens = (dens.double() + EPS).float()

    loss = out.draft_logits.new_zeros((), dtype=torch.float32)
    for k in range(steps):
        per_slot = ce[..., k] + sum(alpha * extra[n][..., k] for n, alpha in terms)
        num = (per_slot * mask[..., k]).sum()
        loss = loss + (float(step_loss_decay) ** k) * num / dens[k]
    return StepOutput.of(loss * world_size, stats)


def chunked_eagle3_loss(
    model,
    feats: Eagle3Hidden,
    *,
    step_loss_decay: float = STEP_LOSS_DECAY,
    chunk_rows: int = 1024,
    over_ranks: bool = True,
    loss_terms: Any = (),
    lk_eta: float = LK_ETA,
) -> StepOutput:
    """The same loss and metric sums as `eagle3_loss(model(...))` from `forward_hidden`, with
    O(chunk_rows x V) vocabulary memory. Only valid (b, t, k) rows are projected."""
    if feats.target_last_hidden_states is None:
        raise ValueError(
            "target_last_hidden_states: the Eagle3 loss is a soft cross-entropy against the "
            "target; pass it to the forward"
        )
    _check_decay(step_loss_decay)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows: must be >= 1, got {chunk_rows}")
    if model.lm_head.weight.requires_grad:
        raise ValueError("lm_head: the chunked Eagle3 loss needs the shared lm_head frozen")
    world_size = distributed.world_size() if over_ranks else 1
    bsz, seq, steps, _ = feats.hidden.shape
    mask = feats.eval_mask.to(torch.float32)
    # The denominators depend on the mask only: reduce them before any logits exist.
    dens = mask.sum(dim=(0, 1))
    if over_ranks:
        dens = distributed.all_reduce_(dens.clone())
    decay = float(step_loss_decay) ** torch.arange(steps, dtype=torch.float32, device=dens.device)
    coef = decay * world_size / (dens + EPS)

    b_idx, t_idx, k_idx = feats.eval_mask.nonzero(as_tuple=True)
    rows = model.norm(feats.hidden[b_idx, t_idx, k_idx])  # [N, H]; norm is per row
    # Valid rows have label t + k + 2 < S, so the target's row t + k + 1 exists.
    target_rows = feats.target_last_hidden_states[b_idx, t_idx + k_idx + 1]
    terms = _terms(loss_terms)
    loss, ce, c_star, greedy, match, extra = _SoftCEChunks.apply(
        model,
        rows,
        target_rows,
        feats.target_ids[b_idx, t_idx, k_idx],
        coef[k_idx],
        chunk_rows,
        (terms, lk_eta),
    )

    def scatter(values: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(bsz, seq, steps, dtype=torch.float32, device=mask.device)
        full[b_idx, t_idx, k_idx] = values
        return full

    extra = {n: scatter(extra[:, i]) for i, (n, _) in enumerate(terms)}
    stats = _local_stats(mask, scatter(ce), scatter(c_star), scatter(greedy), scatter(match), extra)
    return StepOutput.of(loss, stats)


def forward_loss(
    model,
    batch,
    *,
    step_loss_decay: float = STEP_LOSS_DECAY,
    impl: str = "auto",
    chunk_rows: int = 1024,
    over_ranks: bool = True,
    loss_terms: Any = (),
    lk_eta: float = LK_ETA,
) -> StepOutput:
    """One micro-batch: the unrolled forward, then its loss through `impl`: "reference" (full
    logits) or "chunked" / "auto" (vocabulary work `chunk_rows` rows at a time).

    `model` is what runs the forward (a DeepSpeed engine, whose `.module` is the drafter, or the
    drafter itself); the chunked loss reads the drafter's heads.
    """
    inputs = {
        "input_ids": batch["input_ids"],
        "target_hidden_states": batch["target_hidden_states"],
        "loss_mask": batch["loss_mask"],
        "target_last_hidden_states": batch.get("target_last_hidden_states"),
    }
    terms = dict(loss_terms=loss_terms, lk_eta=lk_eta)
    if impl == "reference":
        return eagle3_loss(
            model(**inputs), step_loss_decay=step_loss_decay, over_ranks=over_ranks, **terms
        )
    if impl not in ("auto", "chunked"):
        raise ValueError(f"impl: expected auto | reference | chunked, got {impl!r}")
    feats = model(**inputs, return_hidden=True)
    return chunked_eagle3_loss(
        bare(model),
        feats,
        step_loss_decay=step_loss_decay,
        chunk_rows=chunk_rows,
        over_ranks=over_ranks,
        **terms,
    )


def eagle3_forward_and_loss(
    model, batch, *, step_loss_decay: float = STEP_LOSS_DECAY, **path: Any
) -> tuple[torch.Tensor, dict[str, float]]:
    """`forward_loss` with the metrics summed over the ranks and read as floats, as
    `compute_eagle3_loss(model(...))` returns them. `path`: its `impl`, `chunk_rows`,
    `loss_terms` and `lk_eta`."""
    out = forward_loss(model, batch, step_loss_decay=step_loss_decay, **path)
    metrics = eagle3_metrics(out.global_sums(), step_loss_decay, path.get("loss_terms", ()))
    return out.loss, metrics


class _SoftCEChunks(torch.autograd.Function):
    """Forward: per-row soft CE and metrics, and d(Σ coef·ce)/d rows chunk by chunk; backward
    only replays the stored [N, H] gradient."""

    @staticmethod
    def forward(ctx, model, rows, target_rows, target_ids, row_coef, chunk_rows, terms_eta):
        terms, lk_eta = terms_eta
        n = rows.shape[0]
        grad = torch.zeros_like(rows)
        ce = torch.zeros(n, dtype=torch.float32, device=rows.device)
        c_star, greedy, match = torch.zeros_like(ce), torch.zeros_like(ce), torch.zeros_like(ce)
        extra = torch.zeros(n, len(terms), dtype=torch.float32, device=rows.device)
        for lo in range(0, n, chunk_rows):
            sl = slice(lo, min(lo + chunk_rows, n))
            x = rows[sl].detach().requires_grad_(True)
            with torch.enable_grad():
                logits = model.head_logits(x).float()
            with torch.no_grad():
                target_logits = model.target_logits(target_rows[sl]).float()
                p_t = torch.softmax(target_logits, dim=-1)
                log_p_d = torch.log_softmax(logits.detach(), dim=-1)
                ce[sl] = -(p_t * log_p_d).sum(-1)
                c_star[sl], greedy[sl], match[sl] = _slot_terms(log_p_d, p_t, target_ids[sl])
                # d/dz of -Σ p_t log softmax(z) is softmax(z) - p_t (p_t sums to 1).
                g_logits = (log_p_d.exp() - p_t) * row_coef[sl].unsqueeze(-1)
            if terms:
                values, g_terms, _ = divergences_and_grad(
                    logits.detach(),
                    target_logits,
                    dict(terms),
                    lk_eta=lk_eta,
                    row_coefs={name: alpha * row_coef[sl] for name, alpha in terms},
                )
                extra[sl] = torch.stack([values[name] for name, _ in terms], dim=-1)
                g_logits = g_logits + g_terms
            (grad[sl],) = torch.autograd.grad(logits, x, g_logits)
        ctx.grad = grad
        per_row = ce
        for i, (_, alpha) in enumerate(terms):
            per_row = per_row + alpha * extra[:, i]
        loss = (per_row * row_coef).sum()
        ctx.mark_non_differentiable(ce, c_star, greedy, match, extra)
        return loss, ce, c_star, greedy, match, extra

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        grad, ctx.grad = ctx.grad, None
        if grad is None:
            raise RuntimeError("chunked Eagle3 loss: backward called twice")
        return None, grad * grad_loss.to(grad.dtype), None, None, None, None, None


def _check_decay(step_loss_decay: float) -> None:
    if not step_loss_decay > 0:
        raise ValueError(f"step_loss_decay: must be > 0, got {step_loss_decay!r}")


@torch.no_grad()
def _slot_terms(log_p_d: torch.Tensor, p_t: torch.Tensor, target_ids: torch.Tensor):
    """(accept rate 1 - TV, argmax == data token, argmax == target argmax), fp32, per row."""
    c_star = (1.0 - 0.5 * (log_p_d.exp() - p_t).abs().sum(-1)).clamp(0.0, 1.0)
    draft_arg = log_p_d.argmax(-1)
    return c_star, (draft_arg == target_ids).float(), (draft_arg == p_t.argmax(-1)).float()


@torch.no_grad()
def _local_stats(mask, ce, c_star, greedy, match, extra=None) -> dict[str, torch.Tensor]:
    """Every metric's numerator and denominator on this rank ([B, S, T] inputs; `extra`: the
    distribution terms by name)."""
    steps = mask.shape[-1]
    c_star, greedy, match, ce = c_star * mask, greedy * mask, match * mask, ce * mask
    anchors = mask[..., 0]  # an anchor counts when its first step is valid
    s = {
        "anchors": anchors.sum(),
        "tau_probabilistic": ((1.0 + c_star.cumprod(-1).sum(-1)) * anchors).sum(),
        "tau_greedy": ((1.0 + greedy.cumprod(-1).sum(-1)) * anchors).sum(),
        "slots": mask.sum(),
    }
    for k in range(steps):
        s[f"den@{k}"] = mask[..., k].sum()
        s[f"num@{k}"] = ce[..., k].sum()
        s[f"accept@{k}"] = c_star[..., k].sum()
        s[f"greedy@{k}"] = greedy[..., k].sum()
        s[f"match@{k}"] = match[..., k].sum()
        for name, value in (extra or {}).items():
            s[f"num_{name}@{k}"] = (value[..., k] * mask[..., k]).sum()
    return s


def eagle3_metrics(
    g: dict[str, float], step_loss_decay: float, loss_terms: Any = ()
) -> dict[str, float]:
    """The metrics (module docstring) of `eagle3_loss`'s sums, summed over the ranks."""
    steps = sum(1 for k in g if k.startswith("den@"))
    decay = float(step_loss_decay)
    m: dict[str, float] = {
        "tau_probabilistic": ratio(g["tau_probabilistic"], g["anchors"]),
        "tau_greedy": ratio(g["tau_greedy"], g["anchors"]),
        "supervised_tokens": g["slots"],
    }
    total = 0.0
    for k in range(steps):
        den = g[f"den@{k}"]
        ploss = ratio(g[f"num@{k}"], den)
        m[f"ploss_{k}"] = ploss
        m[f"accept_rate@{k}"] = ratio(g[f"accept@{k}"], den)
        m[f"greedy_accept@{k}"] = ratio(g[f"greedy@{k}"], den)
        m[f"accuracy@{k}"] = ratio(g[f"match@{k}"], den)
        if den > 0:
            total += decay**k * ploss
    for name, alpha in _terms(loss_terms):
        m[f"{name}_loss"] = sum(
            decay**k * ratio(g[f"num_{name}@{k}"], g[f"den@{k}"])
            for k in range(steps)
            if g[f"den@{k}"] > 0
        )
        total += alpha * m[f"{name}_loss"]
    m["loss"] = total
    return m
