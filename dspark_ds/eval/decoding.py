"""The speculative decoding loop (batch 1; docs/algorithm.md#inference), and plain target
decoding to compare with.

One round: the drafter proposes up to γ tokens (its kind's `propose` step: DSpark drafts
`[x_start, MASK × (γ-1)]` in one forward and samples it through the Markov head, Eagle3 drafts
a chain; its KV cache holds only verified context), the confidence head may cut the proposal,
the target verifies `[x_start, d_1..d_m]` in one forward, and the accepted prefix plus one
target token (correction or bonus) is committed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dspark_ds.drafters.common.rounds import DraftRound
from dspark_ds.drafters.registry import spec_of
from dspark_ds.eval import verify
from dspark_ds.eval.calibration import confidence_temperatures
from dspark_ds.eval.target_step import TargetDecoder, check_drafter_matches_target


@dataclass
class DecodeStats:
    """Per-generation counters; one entry per verification round in the `*_per_round` lists."""

    target_forwards: int = 0
    """Target forwards, the prefill included (= rounds + 1)."""
    prompt_tokens: int = 0
    new_tokens: int = 0
    """Tokens generated (after stop-token and max_new_tokens trimming)."""
    proposed_per_round: list[int] = field(default_factory=list)
    """Draft tokens the target verified (after confidence truncation, budget and stop token)."""
    accepted_per_round: list[int] = field(default_factory=list)
    """Draft tokens accepted by verification."""
    committed_per_round: list[int] = field(default_factory=list)
    """Tokens appended by the round: accepted drafts + the correction / bonus token."""
    confidence_logits_per_round: list[list[float]] = field(default_factory=list)
    """Raw confidence logits of the verified slots (empty lists without a confidence head)."""
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    prefill_time_s: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.committed_per_round)

    @property
    def tau(self) -> float:
        """Tokens per verifying target forward, bonus included (τ, the paper's Table 1)."""
        return sum(self.committed_per_round) / max(self.rounds, 1)


def _sync(device: torch.device) -> None:
    # NOTE: CUDA kernels run asynchronously; without a sync the draft / verify split is fiction.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_args(input_ids: torch.Tensor, max_new_tokens: int, temperature: float, threshold: float):
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [1, prompt_len>0], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"confidence_threshold must be in [0, 1], got {threshold}")


def _first_stop(tokens: list[int], stop_token_ids: set[int]) -> int | None:
    for i, token in enumerate(tokens):
        if token in stop_token_ids:
            return i
    return None


def _confident_prefix(
    conf_logits_G: torch.Tensor, temps_G: torch.Tensor | None, threshold: float
) -> int:
    """Slots before the first one whose (temperature-scaled) confidence is below the threshold."""
    probs_G = torch.sigmoid(conf_logits_G / temps_G if temps_G is not None else conf_logits_G)
    below = torch.nonzero(probs_G < threshold)
    return int(below[0].item()) if below.numel() else conf_logits_G.numel()


def _verify_round(
    decoder: TargetDecoder,
    x_start_1: torch.Tensor,
    drafts_M: torch.Tensor,
    draft_logits_MV: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
    stops: set[int],
):
    """The target's forward on `[x_start, d_1..d_M]` and the lossless acceptance. Returns
    (proposed, accepted, committed tokens, the target step): an accepted stop token ends the
    round there, as if the slots after it had never been proposed."""
    step = decoder.forward(torch.cat([x_start_1, drafts_M]).unsqueeze(0))
    if temperature == 0.0:
        num_accepted, next_token = verify.verify_greedy(drafts_M, step.logits_LV)
    else:
        num_accepted, next_token = verify.verify_sampled(
            drafts_M,
            verify.logits_to_probs(draft_logits_MV, temperature),
            verify.logits_to_probs(step.logits_LV, temperature),
            generator,
        )
    num_proposed = drafts_M.shape[0]
    committed = drafts_M[:num_accepted].tolist() + [next_token]
    stop_at = _first_stop(committed, stops)
    if stop_at is not None and stop_at < num_accepted:
        num_proposed = num_accepted = stop_at + 1
        committed = committed[: stop_at + 1]
    return num_proposed, num_accepted, committed, step


@torch.inference_mode()
def speculative_generate(
    target,
    drafter,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    confidence_threshold: float = 0.0,
    generator: torch.Generator | None = None,
    stop_token_ids: list[int] | None = None,
    budget_accounting: str = "exact",
) -> tuple[torch.Tensor, DecodeStats]:
    """Lossless speculative decoding of one prompt.

    Returns `(output_ids [1, prompt + new], stats)`. At temperature 0 the output equals greedy
    decoding of `target`; at T > 0 it has the distribution of sampling from `target` at T.
    `confidence_threshold` > 0 cuts each proposal at the first slot whose confidence
    (after the drafter's sequential temperature scaling, when its config has one) is below it.
    `budget_accounting`: "exact" never verifies past `max_new_tokens`; "reference" (DeepSpec's
    evaluation) never cuts a proposal for the budget and runs rounds until the output is longer
    than the budget, then trims it: every round, the last one's overshoot included, counts in τ.
    """
    _check_args(input_ids, max_new_tokens, temperature, confidence_threshold)
    if budget_accounting not in ("exact", "reference"):
        raise ValueError(f"budget_accounting must be exact | reference, got {budget_accounting!r}")
    exact = budget_accounting == "exact"
    check_drafter_matches_target(target, drafter)
    cfg = drafter.config
    block_size = int(cfg.block_size)
    device = input_ids.device
    temps_G = confidence_temperatures(cfg, device=device)
    stops = set(int(t) for t in (stop_token_ids or []))
    prompt_len = input_ids.shape[1]
    stats = DecodeStats(prompt_tokens=prompt_len)

    t0 = time.perf_counter()
    decoder = TargetDecoder(target, list(cfg.target_layer_ids))
    step = decoder.forward(input_ids, logits_to_keep=1)
    stats.target_forwards += 1
    new_tokens = [verify.sample_token(step.logits_LV[-1], temperature, generator)]
    context_1CnH = step.features_LnH  # features of positions [drafter cache, start)
    draft_cache = drafter.new_cache()
    _sync(device)
    stats.prefill_time_s = time.perf_counter() - t0

    propose = spec_of(drafter).propose
    while new_tokens[-1] not in stops and len(new_tokens) < max_new_tokens + (not exact):
        start = prompt_len + len(new_tokens) - 1  # position of x_start, the last committed token
        # Exact: the round commits at most num_proposed + 1 tokens, so never verify past the budget.
        room = max_new_tokens - len(new_tokens) - 1 if exact else block_size
        t0 = time.perf_counter()
        tail = torch.tensor([new_tokens], dtype=input_ids.dtype, device=device)
        proposal = propose(
            drafter,
            DraftRound(
                committed_ids=torch.cat([input_ids, tail], dim=1),
                context_features=context_1CnH,
                cache=draft_cache,
                budget=max(1, min(block_size, room)),
                temperature=temperature,
                generator=generator,
                stop_token_ids=stops,
            ),
        )
        drafts_1G, draft_logits_1GV = proposal.tokens, proposal.logits
        conf_1G = proposal.confidence_logits
        num_proposed = drafts_1G.shape[1]  # Eagle3 may stop early at a stop token
        if conf_1G is not None and confidence_threshold > 0.0:
            num_proposed = _confident_prefix(conf_1G[0], temps_G, confidence_threshold)
        num_proposed = min(num_proposed, room)
        drafts_M = drafts_1G[0, :num_proposed]
        _sync(device)
        stats.draft_time_s += time.perf_counter() - t0

        t0 = time.perf_counter()
        num_proposed, num_accepted, committed, step = _verify_round(
            decoder, tail[0, -1:], drafts_M, draft_logits_1GV[0, :num_proposed], temperature,
            generator, stops,
        )  # fmt: skip
        stats.target_forwards += 1
        decoder.keep(start + num_accepted + 1)  # x_start and the accepted drafts stay cached
        context_1CnH = step.features_LnH[:, : num_accepted + 1]
        new_tokens.extend(committed)
        _sync(device)
        stats.verify_time_s += time.perf_counter() - t0

        stats.proposed_per_round.append(num_proposed)
        stats.accepted_per_round.append(num_accepted)
        stats.committed_per_round.append(len(committed))
        stats.confidence_logits_per_round.append(
            conf_1G[0, :num_proposed].tolist() if conf_1G is not None else []
        )

    stop_at = _first_stop(new_tokens, stops)
    if stop_at is not None:
        new_tokens = new_tokens[: stop_at + 1]
    new_tokens = new_tokens[:max_new_tokens]
    stats.new_tokens = len(new_tokens)
    tail = torch.tensor([new_tokens], dtype=input_ids.dtype, device=device)
    return torch.cat([input_ids, tail], dim=1), stats


@torch.inference_mode()
def target_generate(
    target,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    stop_token_ids: list[int] | None = None,
) -> torch.Tensor:
    """Plain autoregressive decoding of the target (the baseline speculative decoding must match)."""
    _check_args(input_ids, max_new_tokens, temperature, 0.0)
    stops = set(int(t) for t in (stop_token_ids or []))
    decoder = TargetDecoder(target, [])
    step_ids = input_ids
    new_tokens: list[int] = []
    while len(new_tokens) < max_new_tokens and (not new_tokens or new_tokens[-1] not in stops):
        logits_V = decoder.forward(step_ids, logits_to_keep=1).logits_LV[-1]
        decoder.keep(decoder.num_cached)  # trims sliding-window layers back to their window
        new_tokens.append(verify.sample_token(logits_V, temperature, generator))
        step_ids = torch.tensor([[new_tokens[-1]]], dtype=input_ids.dtype, device=input_ids.device)
    tail = torch.tensor([new_tokens], dtype=input_ids.dtype, device=input_ids.device)
    return torch.cat([input_ids, tail], dim=1)
