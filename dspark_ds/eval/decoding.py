"""The speculative decoding loop at batch 1 (docs/algorithm.md#inference), and plain target
decoding to compare with.

One round: the drafter's cache takes the positions verified last round and the drafter proposes
up to γ tokens (its kind's `decode.extend` and `decode.propose`, the same the batched loop
uses: DSpark drafts `[x_start, MASK × (γ-1)]` in one forward and samples it through the Markov
head, Eagle3 drafts a chain), the confidence threshold and the budget may cut the proposal, the
target verifies `[x_start, d_1..d_m]` in one forward, and the accepted prefix plus one target
token (correction or bonus) is committed (eval/rounds.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dspark_ds.drafters.common.cache import DraftKVCache
from dspark_ds.drafters.common.rounds import DraftRound, Proposal, VerifiedContext
from dspark_ds.drafters.registry import kind_of
from dspark_ds.eval import verify
from dspark_ds.eval.calibration import confidence_temperatures
from dspark_ds.eval.policy import VerifyPolicy
from dspark_ds.eval.rounds import (
    Budget,
    DecodeStats,
    Verdict,
    draft_budget,
    draft_temperature_of,
    settle,
    sync,
)
from dspark_ds.eval.target_step import TargetDecoder, check_drafter_matches_target


def _check_args(input_ids: torch.Tensor, max_new_tokens: int, temperature: float, threshold: float):
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [1, prompt_len>0], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"confidence_threshold must be in [0, 1], got {threshold}")


@dataclass
class _Row:
    """The prompt being decoded."""

    prompt_1P: torch.Tensor
    new_tokens: list[int]
    decoder: TargetDecoder
    """The target and its cache."""
    cache: DraftKVCache
    """The drafter's cache: every verified position before `pending`'s."""
    pending_1LnH: torch.Tensor
    """The target's features of the positions verified since the last round."""

    @property
    def start(self) -> int:
        """Position of x_start, the last committed token."""
        return self.prompt_1P.shape[1] + len(self.new_tokens) - 1

    def committed_ids(self) -> torch.Tensor:
        """[1, start + 1] every committed token."""
        tail = torch.tensor([self.new_tokens], dtype=self.prompt_1P.dtype, device=self.device)
        return torch.cat([self.prompt_1P, tail], dim=1)

    @property
    def device(self) -> torch.device:
        return self.prompt_1P.device


class _OneRowDecoder:
    """`speculative_generate`'s loop; see the module docstring."""

    def __init__(
        self,
        target,
        drafter,
        *,
        budget: Budget,
        policy: VerifyPolicy,
        temperature: float,
        generator: torch.Generator | None,
        stops: set[int],
        draft_temperature: float | None = None,
    ):
        self.target, self.drafter, self.kind = target, drafter, kind_of(drafter)
        self.budget, self.policy, self.stops = budget, policy, stops
        self.temperature, self.generator = temperature, generator
        self.draft_temperature = draft_temperature_of(temperature, draft_temperature)
        self.block_size = self.kind.decode.tokens_per_round(drafter.config)

    def run(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, DecodeStats]:
        stats = DecodeStats(prompt_tokens=input_ids.shape[1])
        row = self._prefill(input_ids, stats)
        while self.budget.running(row.new_tokens, self.stops):
            t0 = time.perf_counter()
            proposal, num_proposed = self._draft(row)
            sync(row.device)
            t1 = time.perf_counter()
            verdict = self._verify(row, proposal, num_proposed)
            sync(row.device)
            stats.draft_time_s += t1 - t0
            stats.verify_time_s += time.perf_counter() - t1
            conf = proposal.confidence_logits
            stats.record(verdict, conf[0, : verdict.proposed].tolist() if conf is not None else [])
        tokens = self.budget.output(row.new_tokens, self.stops)
        stats.new_tokens = len(tokens)
        tail = torch.tensor([tokens], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, tail], dim=1), stats

    def _prefill(self, input_ids: torch.Tensor, stats: DecodeStats) -> _Row:
        """The target's forward over the prompt and the first token; the drafter's cache takes
        the prompt in the first round."""
        t0 = time.perf_counter()
        decoder = TargetDecoder(self.target, list(self.drafter.config.target_layer_ids))
        step = decoder.forward(input_ids, logits_to_keep=1)
        stats.target_forwards += 1
        first = verify.sample_token(step.logits_LV[-1], self.temperature, self.generator)
        row = _Row(input_ids, [first], decoder, self.drafter.new_cache(), step.features_LnH)
        sync(input_ids.device)
        stats.prefill_time_s = time.perf_counter() - t0
        return row

    def _draft(self, row: _Row) -> tuple[Proposal, int]:
        """The drafter's cache takes the pending context, then proposes; returns the proposal
        and how many of its drafts the target verifies."""
        committed = row.committed_ids()
        start, cached = row.start, row.cache.seq_length
        positions = torch.arange(cached, start, device=row.device).unsqueeze(0)
        self.kind.decode.extend(
            self.drafter,
            VerifiedContext(
                row.pending_1LnH, positions, row.cache, next_ids=committed[:, cached + 1 :]
            ),
        )
        rooms = [self.budget.room(row.new_tokens)]
        proposal = self.kind.decode.propose(
            self.drafter,
            DraftRound(
                x_start=committed[:, -1],
                starts=torch.tensor([start], device=row.device),
                cache=row.cache,
                budget=draft_budget(self.block_size, rooms),
                temperature=self.draft_temperature,
                generator=self.generator,
                stop_token_ids=self.stops,
            ),
        )
        return proposal, self.policy.lengths(proposal, rooms)[0]

    def _verify(self, row: _Row, proposal: Proposal, num_proposed: int) -> Verdict:
        """The target's forward on `[x_start, d_1..d_m]`, the lossless verdict, and the target's
        cache rolled back to the kept positions; commits the round's tokens."""
        drafts_1M = proposal.tokens[:, :num_proposed]
        x_start = row.committed_ids()[:, -1:]
        step = row.decoder.forward(torch.cat([x_start, drafts_1M], dim=1))
        accepted, next_token = verify.verify_rows(
            drafts_1M,
            torch.tensor([num_proposed], device=row.device),
            step.logits_LV[None],
            proposal.logits[:, :num_proposed],
            self.temperature,
            self.generator,
            draft_temperature=self.draft_temperature,
        )
        verdict = settle(
            drafts_1M[0].tolist(), num_proposed, accepted[0], next_token[0], self.stops
        )
        row.decoder.keep(row.start + verdict.accepted + 1)  # x_start and the accepted drafts
        row.pending_1LnH = step.features_LnH[:, : verdict.accepted + 1]
        row.new_tokens.extend(verdict.committed)
        return verdict


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
    draft_temperature: float | None = None,
) -> tuple[torch.Tensor, DecodeStats]:
    """Lossless speculative decoding of one prompt.

    Returns `(output_ids [1, prompt + new], stats)`. At temperature 0 the output equals greedy
    decoding of `target`; at T > 0 it has the distribution of sampling from `target` at T.
    `confidence_threshold` > 0 cuts each proposal at the first slot whose confidence
    (after the drafter's sequential temperature scaling, when its config has one) is below it.
    `budget_accounting`: "exact" never verifies past `max_new_tokens`; "reference" (DeepSpec's
    evaluation) never cuts a proposal for the budget and runs rounds until the output is longer
    than the budget, then trims it: every round, the last one's overshoot included, counts in τ.
    `draft_temperature`: what the drafter samples its drafts at (`draft_temperature_of`).
    """
    _check_args(input_ids, max_new_tokens, temperature, confidence_threshold)
    budget = Budget(max_new_tokens, budget_accounting)
    check_drafter_matches_target(target, drafter)
    policy = VerifyPolicy(
        "threshold" if confidence_threshold > 0.0 else "full",
        threshold=confidence_threshold,
        temps_G=confidence_temperatures(
            drafter.config,
            kind_of(drafter).decode.tokens_per_round(drafter.config),
            device=input_ids.device,
        ),
    )
    return _OneRowDecoder(
        target,
        drafter,
        budget=budget,
        policy=policy,
        temperature=temperature,
        generator=generator,
        stops={int(t) for t in (stop_token_ids or [])},
        draft_temperature=draft_temperature,
    ).run(input_ids)


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
    decoder = TargetDecoder(target, [], rollback=False)
    step_ids = input_ids
    new_tokens: list[int] = []
    while len(new_tokens) < max_new_tokens and (not new_tokens or new_tokens[-1] not in stops):
        logits_V = decoder.forward(step_ids, logits_to_keep=1).logits_LV[-1]
        decoder.keep(decoder.num_cached)  # trims sliding-window layers back to their window
        new_tokens.append(verify.sample_token(logits_V, temperature, generator))
        step_ids = torch.tensor([[new_tokens[-1]]], dtype=input_ids.dtype, device=input_ids.device)
    tail = torch.tensor([new_tokens], dtype=input_ids.dtype, device=input_ids.device)
    return torch.cat([input_ids, tail], dim=1)
