"""What both decoding loops (decoding.py at batch 1, batched.py with rows in flight) share about
a verification round: the new-token budget, what a verified round commits, and the counters;
and what every run of an eval config is given (`run_settings`).

A round: the drafter proposes (its kind's `propose`, drafters/common/rounds.py), a policy
picks how many drafts each row verifies (policy.py), one target forward verifies them
(verify.py), and `settle` turns the verdict into committed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark_ds.drafters.common.rounds import first_stop

BUDGET_ACCOUNTINGS = ("exact", "reference", "engine")


def run_settings(cfg, stops: list[int], device: torch.device, seed: int) -> dict:
    """The keywords every decoding run of an eval config `cfg` shares: its new-token budget,
    temperature and stop tokens, and a generator of the run's own seeded with `seed` (each run
    draws the same stream)."""
    return dict(
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        generator=torch.Generator(device=device).manual_seed(seed),
        stop_token_ids=stops,
    )


def draft_temperature_of(temperature: float, draft_temperature: float | None) -> float:
    """The temperature a drafter samples its drafts at: the request's (None), or its own (0 =
    greedy drafts, verified as one-hot proposals). At T = 0 every draft is the argmax."""
    if draft_temperature is not None and draft_temperature < 0:
        raise ValueError(f"draft_temperature must be >= 0 or None, got {draft_temperature}")
    if temperature == 0.0 or draft_temperature is None:
        return temperature
    return float(draft_temperature)


def sync(device: torch.device) -> None:
    # NOTE: CUDA kernels run asynchronously; without a sync the draft / verify split is fiction.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Verdict:
    """One row's verified round."""

    proposed: int
    """Drafts the target verified."""
    accepted: int
    """Drafts it accepted."""
    committed: list[int]
    """The tokens the round appends: the accepted drafts and the target's correction / bonus."""
    verified: tuple[int, int] | None = None
    """(proposed, accepted) as verification counted them, before a stop token cut the round
    (what an inference engine's counters count); None: the same as `proposed`, `accepted`."""


def settle(drafts: list[int], proposed: int, accepted: int, next_token: int, stops) -> Verdict:
    """What a round commits. An accepted stop token ends the round there, as if the slots
    after it had never been proposed."""
    committed = drafts[:accepted] + [next_token]
    stop = first_stop(committed, stops)
    verified = None
    if stop is not None and stop < accepted:
        verified = (proposed, accepted)
        proposed = accepted = stop + 1
        committed = committed[: stop + 1]
    return Verdict(proposed, accepted, committed, verified)


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
    verified_per_round: list[tuple[int, int]] = field(default_factory=list)
    """(proposed, accepted) as verification counted them, before a stop token cut the round:
    what vLLM's speculative-decoding counters count (docs/serving.md#parity)."""
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

    def record(self, verdict: Verdict, confidence_logits: list[float]) -> None:
        """Count one verifying forward and its round."""
        self.target_forwards += 1
        self.proposed_per_round.append(verdict.proposed)
        self.accepted_per_round.append(verdict.accepted)
        self.committed_per_round.append(len(verdict.committed))
        self.confidence_logits_per_round.append(confidence_logits)
        self.verified_per_round.append(verdict.verified or (verdict.proposed, verdict.accepted))


@dataclass(frozen=True)
class Budget:
    """A prompt's new-token budget and how rounds count against it.

    "exact" never verifies past `max_new_tokens`. "reference" (DeepSpec's evaluation) never
    cuts a proposal for the budget and runs rounds until the output is longer than the budget,
    then trims it: every round, the last one's overshoot included, counts in τ. "engine" (vLLM's
    scheduler) never cuts a proposal either and runs rounds while the output is shorter than the
    budget, then trims it.
    """

    max_new_tokens: int
    accounting: str = "exact"

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.accounting not in BUDGET_ACCOUNTINGS:
            raise ValueError(
                f"budget_accounting must be exact | reference | engine, got {self.accounting!r}"
            )

    def running(self, tokens: list[int], stops: set[int]) -> bool:
        """Whether another round follows the `tokens` generated so far."""
        if tokens[-1] in stops:
            return False
        return len(tokens) < self.max_new_tokens + (self.accounting == "reference")

    def room(self, tokens: list[int]) -> int | None:
        """The most drafts the next round may verify (None: no cap). Exact: a round commits at
        most m + 1 tokens, so m stays below what is left."""
        if self.accounting == "exact":
            return self.max_new_tokens - len(tokens) - 1
        return None

    def output(self, tokens: list[int], stops: set[int]) -> list[int]:
        """The generated tokens, up to the first stop token and the budget."""
        stop = first_stop(tokens, stops)
        if stop is not None:
            tokens = tokens[: stop + 1]
        return tokens[: self.max_new_tokens]


def draft_budget(block_size: int, rooms: list[int | None]) -> int:
    """How many drafts a round asks for (`DraftRound.budget`): γ, or fewer when no row can
    verify more; at least one."""
    if any(room is None for room in rooms):
        return block_size
    return max(1, min(block_size, max(rooms)))
