"""Verification of a draft proposal against the target: the lossless part of speculative decoding.

Both decoding loops verify through `verify_rows` (batch 1 is one row). Legend: R rows, M drafts
verified per row (row r is judged on its first m_r <= M only), V vocabulary.

T = 0 is greedy: a draft token is kept while it equals the target's argmax, and the target's
argmax at the first mismatch (or after the last draft) is the next token.

T > 0 is rejection sampling (Leviathan et al. 2023; docs/algorithm.md#inference): draft token
d_k, sampled from p_d, is kept with probability min(1, p_t(d_k) / p_d(d_k)); at the first
rejection the next token is drawn from norm(max(0, p_t - p_d)); if every draft token is kept, a
bonus token is drawn from p_t at the position after the last draft. The committed tokens then
have exactly the target's distribution, whatever the drafter proposes. p_d is the drafter's
softmax at the draft temperature (the request's unless the eval config sets another); at draft
temperature 0 the drafts are the drafter's argmax and p_d is one-hot on each (vLLM's default
`draft_sample_method: greedy`): kept with probability p_t(d_k), the residual is p_t without d_k.
"""

from __future__ import annotations

import torch

from dspark_ds.drafters.common.sampling import sample_from_logits
from dspark_ds.eval.rounds import draft_temperature_of

# Below this residual mass the residual is numerically empty: p_t == p_d up to rounding, so a
# rejection had (almost) zero probability and p_t itself is the right distribution.
_RESIDUAL_EPS = 1e-8


def logits_to_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax at `temperature` in fp32 (temperature must be > 0)."""
    if temperature <= 0.0:
        raise ValueError(f"temperature must be > 0 to form probabilities, got {temperature}")
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_token(
    logits_V: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> int:
    """The target's next token: argmax at T = 0, a sample from softmax(logits / T) otherwise
    (the rule a drafter samples by, too)."""
    return int(sample_from_logits(logits_V, temperature, generator))


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """[..., V]: norm(max(0, p_t - p_d)), what the next token is drawn from after a rejection;
    p_t where that is (numerically) empty."""
    residual = torch.clamp(target_probs - draft_probs, min=0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    empty = mass <= _RESIDUAL_EPS
    return torch.where(empty, target_probs, residual / mass.clamp_min(_RESIDUAL_EPS))


def verify_greedy_rows(
    drafts_RM: torch.Tensor, num_R: torch.Tensor, target_logits_RM1V: torch.Tensor
) -> tuple[list[int], list[int]]:
    """Greedy verification: (accepted drafts per row, next token per row).

    `target_logits_RM1V[r, k]` is the target's prediction for the token after verify input k,
    i.e. it judges draft k (0-based), and row r's entry m_r gives its bonus token.
    """
    argmax_RM1 = target_logits_RM1V.argmax(dim=-1)
    M = drafts_RM.shape[1]
    slots = torch.arange(M, device=drafts_RM.device)
    ok_RM = (drafts_RM == argmax_RM1[:, :M]) & (slots.unsqueeze(0) < num_R.unsqueeze(1))
    accepted_R = ok_RM.long().cumprod(dim=1).sum(dim=1)
    next_R = argmax_RM1.gather(1, accepted_R.unsqueeze(1)).squeeze(1)
    return accepted_R.tolist(), next_R.tolist()


def verify_sampled_rows(
    drafts_RM: torch.Tensor,
    num_R: torch.Tensor,
    draft_probs_RMV: torch.Tensor | None,
    target_probs_RM1V: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[list[int], list[int]]:
    """Rejection-sampling verification: (accepted drafts per row, next token per row).

    `draft_probs_RMV[r, k]` must be the exact distribution draft k of row r was sampled from
    (None when M = 0), and `target_probs_RM1V` the target's at the same temperature.
    """
    rows, M = drafts_RM.shape
    device = target_probs_RM1V.device
    if M:
        index = drafts_RM.unsqueeze(-1)
        p_target = target_probs_RM1V[:, :M].gather(-1, index).squeeze(-1)
        p_draft = draft_probs_RMV.gather(-1, index).squeeze(-1)
        # NOTE: a sampled draft token has p_draft > 0; the clamp only guards division by a
        # denormal. One uniform per slot, drawn up front, keeps the RNG stream independent of
        # where the first rejection happens.
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
        residual = residual_distribution(next_probs, draft_probs_RMV[rows_R, slot])
        next_probs = torch.where(rejected.unsqueeze(1), residual, next_probs)
    next_R = torch.multinomial(next_probs, 1, generator=generator).squeeze(1)
    return accepted_R.tolist(), next_R.tolist()


def draft_probs(
    drafts_RM: torch.Tensor, draft_logits_RMV: torch.Tensor, draft_temperature: float
) -> torch.Tensor:
    """[R, M, V] the distribution each draft was drawn from: softmax(logits / T_d), or one-hot
    on the draft itself when T_d = 0 (greedy drafting: its argmax, a certain proposal)."""
    if draft_temperature > 0.0:
        return logits_to_probs(draft_logits_RMV, draft_temperature)
    onehot = torch.zeros(draft_logits_RMV.shape, dtype=torch.float32, device=drafts_RM.device)
    return onehot.scatter_(-1, drafts_RM.unsqueeze(-1), 1.0)


def verify_rows(
    drafts_RM: torch.Tensor,
    num_R: torch.Tensor,
    target_logits_RM1V: torch.Tensor,
    draft_logits_RMV: torch.Tensor | None,
    temperature: float,
    generator: torch.Generator | None,
    draft_temperature: float | None = None,
) -> tuple[list[int], list[int]]:
    """The verdict of a round, the rule chosen by the temperature: (accepted drafts per row,
    next token per row). `draft_logits_RMV` (None when M = 0) are what the drafts were drawn
    from, at `draft_temperature` (None: `temperature`; 0: greedy drafts); they matter only at
    T > 0."""
    if temperature == 0.0:
        return verify_greedy_rows(drafts_RM, num_R, target_logits_RM1V)
    t_draft = draft_temperature_of(temperature, draft_temperature)
    return verify_sampled_rows(
        drafts_RM,
        num_R,
        draft_probs(drafts_RM, draft_logits_RMV, t_draft) if draft_logits_RMV is not None else None,
        logits_to_probs(target_logits_RM1V, temperature),
        generator,
    )


# ---- one row (the rules above on R = 1) --------------------------------------------------------


def verify_greedy(draft_tokens_M: torch.Tensor, target_logits_M1V: torch.Tensor) -> tuple[int, int]:
    """Greedy verification of one row: (number of accepted draft tokens, next token)."""
    num = torch.tensor([draft_tokens_M.numel()], device=draft_tokens_M.device)
    accepted, nxt = verify_greedy_rows(draft_tokens_M.view(1, -1), num, target_logits_M1V[None])
    return accepted[0], nxt[0]


def verify_sampled(
    draft_tokens_M: torch.Tensor,
    draft_probs_MV: torch.Tensor,
    target_probs_M1V: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Rejection-sampling verification of one row: (number of accepted draft tokens, next
    token); `draft_probs_MV[k]` is the distribution draft k was sampled from."""
    num = draft_tokens_M.numel()
    accepted, nxt = verify_sampled_rows(
        draft_tokens_M.view(1, -1),
        torch.tensor([num], device=draft_tokens_M.device),
        draft_probs_MV[None] if num else None,
        target_probs_M1V[None],
        generator,
    )
    return accepted[0], nxt[0]
