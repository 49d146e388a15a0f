"""Verification of a draft proposal against the target: the lossless part of speculative decoding.

Legend: M = number of proposed draft tokens, V = vocabulary size.

T = 0 is greedy: a draft token is kept while it equals the target's argmax, and the target's
argmax at the first mismatch (or after the last draft) is the next token.

T > 0 is rejection sampling (Leviathan et al. 2023; docs/algorithm.md#inference): draft token d_k, sampled from
p_d, is kept with probability min(1, p_t(d_k) / p_d(d_k)); at the first rejection the next token
is drawn from norm(max(0, p_t - p_d)); if every draft token is kept, a bonus token is drawn from
p_t at the position after the last draft. The committed tokens then have exactly the target's
distribution, whatever the drafter proposes.
"""

from __future__ import annotations

import torch

# Below this residual mass the residual is numerically empty: p_t == p_d up to rounding, so a
# rejection had (almost) zero probability and p_t itself is the right distribution.
_RESIDUAL_EPS = 1e-8


def logits_to_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax at `temperature` in fp32 (temperature must be > 0)."""
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0 to form probabilities, got {temperature}")
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_from_probs(probs_V: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from a 1-D probability vector."""
    return int(torch.multinomial(probs_V, 1, generator=generator).item())


def sample_token(
    logits_V: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> int:
    """The target's next token: argmax at T = 0, a sample from softmax(logits / T) otherwise."""
    if temperature == 0.0:
        return int(torch.argmax(logits_V).item())
    return sample_from_probs(logits_to_probs(logits_V, temperature), generator)


def residual_distribution(
    target_probs_V: torch.Tensor, draft_probs_V: torch.Tensor
) -> torch.Tensor:
    """norm(max(0, p_t - p_d)): what the next token is drawn from after a rejection."""
    residual = torch.clamp(target_probs_V - draft_probs_V, min=0.0)
    mass = residual.sum()
    if float(mass) <= _RESIDUAL_EPS:
        return target_probs_V
    return residual / mass


def verify_greedy(draft_tokens_M: torch.Tensor, target_logits_M1V: torch.Tensor) -> tuple[int, int]:
    """Greedy verification. Returns (number of accepted draft tokens, next token).

    `target_logits_M1V[k]` is the target's prediction for the token after verify input k, i.e.
    row k judges draft token k (0-based) and row M gives the bonus token.
    """
    num_drafts = draft_tokens_M.numel()
    target_argmax_M1 = torch.argmax(target_logits_M1V, dim=-1)
    matches_M = draft_tokens_M == target_argmax_M1[:num_drafts]
    num_accepted = int(torch.cumprod(matches_M.long(), dim=0).sum().item()) if num_drafts else 0
    return num_accepted, int(target_argmax_M1[num_accepted].item())


def verify_sampled(
    draft_tokens_M: torch.Tensor,
    draft_probs_MV: torch.Tensor,
    target_probs_M1V: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Rejection-sampling verification. Returns (number of accepted draft tokens, next token).

    `draft_probs_MV[k]` must be the exact distribution draft token k was sampled from, and
    `target_probs_M1V` the target's distributions at the same temperature (M + 1 rows).
    """
    num_drafts = draft_tokens_M.numel()
    if num_drafts:
        index_M1 = draft_tokens_M.view(-1, 1)
        p_target_M = target_probs_M1V[:num_drafts].gather(-1, index_M1).squeeze(-1)
        p_draft_M = draft_probs_MV.gather(-1, index_M1).squeeze(-1)
        # NOTE: a sampled draft token has p_draft > 0; the clamp only guards division by a
        # denormal. One uniform per position, drawn up front, keeps the RNG stream independent of
        # where the first rejection happens.
        accept_prob_M = torch.clamp(p_target_M / p_draft_M.clamp_min(1e-20), max=1.0)
        uniform_M = torch.rand(num_drafts, generator=generator, device=accept_prob_M.device)
        accepted_M = uniform_M < accept_prob_M
        num_accepted = int(torch.cumprod(accepted_M.long(), dim=0).sum().item())
    else:
        num_accepted = 0
    if num_accepted < num_drafts:
        next_probs_V = residual_distribution(
            target_probs_M1V[num_accepted], draft_probs_MV[num_accepted]
        )
    else:
        next_probs_V = target_probs_M1V[num_drafts]
    return num_accepted, sample_from_probs(next_probs_V, generator)


# ---- several rows at once (eval/batched.py) ------------------------------------------------------
# Legend: R rows, M drafts verified per row (row r is judged on its first m_r <= M only).


def verify_greedy_batch(
    drafts_RM: torch.Tensor, num_R: torch.Tensor, target_logits_RM1V: torch.Tensor
) -> tuple[list[int], list[int]]:
    """Greedy verification of R rows: (accepted per row, next token per row)."""
    argmax_RM1 = target_logits_RM1V.argmax(dim=-1)
    M = drafts_RM.shape[1]
    slots = torch.arange(M, device=drafts_RM.device)
    ok_RM = (drafts_RM == argmax_RM1[:, :M]) & (slots.unsqueeze(0) < num_R.unsqueeze(1))
    accepted_R = ok_RM.long().cumprod(dim=1).sum(dim=1)
    next_R = argmax_RM1.gather(1, accepted_R.unsqueeze(1)).squeeze(1)
    return accepted_R.tolist(), next_R.tolist()


def residual_distributions(target_probs_RV: torch.Tensor, draft_probs_RV: torch.Tensor):
    """Row-wise `residual_distribution`: norm(max(0, p_t - p_d)), p_t where that is empty."""
    residual = torch.clamp(target_probs_RV - draft_probs_RV, min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    empty = mass <= _RESIDUAL_EPS
    return torch.where(empty, target_probs_RV, residual / mass.clamp_min(_RESIDUAL_EPS))


def verify_sampled_batch(
    drafts_RM: torch.Tensor,
    num_R: torch.Tensor,
    draft_probs_RMV: torch.Tensor | None,
    target_probs_RM1V: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[list[int], list[int]]:
    """Rejection sampling of R rows at once (the rule of `verify_sampled`, row by row)."""
    rows, M = drafts_RM.shape
    device = target_probs_RM1V.device
    if M:
        index = drafts_RM.unsqueeze(-1)
        p_target = target_probs_RM1V[:, :M].gather(-1, index).squeeze(-1)
        p_draft = draft_probs_RMV.gather(-1, index).squeeze(-1)
        accept_prob = torch.clamp(p_target / p_draft.clamp_min(1e-20), max=1.0)
        uniform = torch.rand(rows, M, generator=generator, device=device)
        slots = torch.arange(M, device=device).unsqueeze(0)
        ok = (uniform < accept_prob) & (slots < num_R.unsqueeze(1))
        accepted_R = ok.long().cumprod(dim=1).sum(dim=1)
    else:
        accepted_R = torch.zeros(rows, dtype=torch.long, device=device)
    rows_R = torch.arange(rows, device=device)
    next_probs = target_probs_RM1V[rows_R, accepted_R]
    rejected = accepted_R < num_R
    if bool(rejected.any()):
        slot = accepted_R.clamp(max=max(M - 1, 0))
        residual = residual_distributions(next_probs, draft_probs_RMV[rows_R, slot])
        next_probs = torch.where(rejected.unsqueeze(1), residual, next_probs)
    next_R = torch.multinomial(next_probs, 1, generator=generator).squeeze(1)
    return accepted_R.tolist(), next_R.tolist()
