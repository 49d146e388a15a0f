"""Batched speculative decoding: several prompts in flight, each with its own acceptance.

The rows share one target KV cache and one drafter cache, left-padded (eval/padded.py). One
round for R rows:

1. draft: the drafter kind's `propose` for every row against its cached context
   (the step batch 1 uses: DSpark / DFlash one block per row, Eagle3 a chain of γ steps);
2. choose each row's proposal length m_r: γ, the static confidence threshold, or the paper's
   hardware-aware prefix scheduler (eval/policy.py), then the budget;
3. verify [x_start, d_1 .. d_M] (M = max m_r; a shorter row's extra drafts are computed and
   discarded) in one target forward, greedy or by rejection sampling, row by row (verify.py);
4. commit each row's accepted drafts and target token (rounds.settle); the drafter's cache
   takes the M + 1 verified columns (the kind's `extend`), and both caches keep x_start and the
   accepted drafts of each row (`PaddedCaches.trim`), so they keep one layout.

Finished rows leave the batch and queued prompts take their place (each prefilled alone, then
left-padded into the batch), so the batch stays full until the queue is empty.

A target whose cache cannot hold rows at different positions (DeepSeek-V4) keeps one target
cache per row and runs its forwards row by row (eval/row_caches.py): the same rounds, the same
verdicts, R target forwards a round.

The target alone is the same loop with no drafter (m_r = 0): `dspark-ds eval --batch_size N`
compares the two at the same batch size, on the same machine, in the same run.

Shape legend: R rows in flight, M verified drafts, V vocab, n*H tapped features.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dspark_ds.drafters.common.rounds import DraftRound, Proposal, VerifiedContext
from dspark_ds.drafters.registry import kind_of
from dspark_ds.eval import verify
from dspark_ds.eval.calibration import confidence_temperatures
from dspark_ds.eval.padded import PaddedCaches, new_caches, target_forward
from dspark_ds.eval.policy import POLICIES, SPS, VerifyPolicy
from dspark_ds.eval.recurrent import rollback_state
from dspark_ds.eval.rounds import (
    Budget,
    DecodeStats,
    draft_budget,
    draft_temperature_of,
    run_settings,
    settle,
    sync,
)
from dspark_ds.eval.target_step import check_drafter_matches_target


@dataclass
class _Request:
    index: int
    prompt_1P: torch.Tensor
    stats: DecodeStats
    new_tokens: list[int] = field(default_factory=list)


@dataclass
class BatchedResult:
    """One prompt's output and counters (times are the batch's, shared out among its rows)."""

    index: int
    output_ids: torch.Tensor
    stats: DecodeStats


def _check_options(batch_size: int, policy: str, drafter, sps: SPS | None) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if policy not in POLICIES:
        raise ValueError(f"policy must be full | threshold | scheduler, got {policy!r}")
    if policy != "full" and (
        drafter is None or not kind_of(drafter).decode.has_confidence(drafter.config)
    ):
        raise ValueError(f"policy {policy!r} needs a drafter with a confidence head")
    if policy == "scheduler" and sps is None:
        raise ValueError("policy 'scheduler' needs the sps cost table")


class BatchedDecoder:
    """Decodes a queue of prompts with up to `batch_size` in flight; see the module docstring.

    `drafter` None decodes with the target alone (the throughput baseline).
    `policy`: "full" (γ drafts), "threshold" (cut at the first confidence below
    `confidence_threshold`) or "scheduler" (Algorithm 1 with the `sps` cost table).
    """

    def __init__(
        self,
        target,
        drafter,
        *,
        batch_size: int,
        max_new_tokens: int,
        temperature: float = 0.0,
        policy: str = "full",
        confidence_threshold: float = 0.0,
        sps: SPS | None = None,
        generator: torch.Generator | None = None,
        stop_token_ids: list[int] | None = None,
        budget_accounting: str = "exact",
        draft_temperature: float | None = None,
    ):
        _check_options(batch_size, policy, drafter, sps)
        self.budget = Budget(max_new_tokens, budget_accounting)
        self.device = next(target.parameters()).device
        self.target, self.drafter, self.kind = target, drafter, None
        self.block_size, self.layer_ids, temps_G = 0, [], None
        if drafter is not None:
            check_drafter_matches_target(target, drafter)
            self.kind = kind_of(drafter)
            self.block_size = self.kind.decode.tokens_per_round(drafter.config)
            self.layer_ids = [int(i) for i in drafter.config.target_layer_ids]
            temps_G = confidence_temperatures(drafter.config, self.block_size, device=self.device)
        self.policy = VerifyPolicy(policy, confidence_threshold, temps_G, sps)
        self.batch_size = batch_size
        self.temperature, self.generator = temperature, generator
        self.draft_temperature = draft_temperature_of(temperature, draft_temperature)
        self.stops = {int(t) for t in (stop_token_ids or [])}
        # the target alone keeps every column it verifies: nothing to roll back
        self.states = rollback_state(target) if drafter is not None else None

    def run(self, prompts: list[torch.Tensor]) -> list[BatchedResult]:
        """Decode every prompt [1, P]; results in prompt order."""
        queue = [
            _Request(i, p, DecodeStats(prompt_tokens=int(p.shape[1])))
            for i, p in enumerate(prompts)
        ]
        queue.reverse()
        done: list[_Request] = []
        active: list[_Request] = []
        caches = self._new_caches()
        with torch.inference_mode():
            while active or queue:
                self._admit(queue, active, done, caches)
                if active:
                    self._round(active, caches)
                    self._retire(active, done, caches)
        return [self._result(req) for req in sorted(done, key=lambda r: r.index)]

    # -- rows entering and leaving the batch -----------------------------------------------------
    def _new_caches(self) -> PaddedCaches:
        draft = self.drafter.new_cache() if self.drafter is not None else None
        return new_caches(self.target, draft, self.states)

    def _admit(self, queue: list[_Request], active, done, caches: PaddedCaches) -> None:
        """Prefill queued prompts into the free places of the batch."""
        while queue and len(active) < self.batch_size:
            req = queue.pop()
            entered = self._prefill(req)
            if entered is None:
                done.append(req)
            else:
                caches.add(entered)
                active.append(req)

    def _prefill(self, req: _Request) -> PaddedCaches | None:
        """Target forward over the prompt alone and the first token; the drafter's cache takes
        the prompt. Returns the row's caches, or None when the first token ends the request."""
        t0 = time.perf_counter()
        prompt = req.prompt_1P.to(self.device)
        length = prompt.shape[1]
        caches = self._new_caches()
        caches.pad = torch.zeros(1, dtype=torch.long, device=self.device)
        # NOTE: logits of the last position only: [P, V] fp32 logits of a long prompt are GBs.
        logits, feats = target_forward(self.target, caches, prompt, self.layer_ids, 1)
        req.stats.target_forwards += 1
        req.new_tokens.append(verify.sample_token(logits[0, -1], self.temperature, self.generator))
        caches.trim(torch.full((1,), length, device=self.device), length)
        if self.drafter is not None:
            first = torch.tensor([req.new_tokens], device=self.device, dtype=prompt.dtype)
            self.kind.decode.extend(
                self.drafter,
                VerifiedContext(
                    feats,
                    torch.arange(length, device=self.device).unsqueeze(0),
                    caches.draft_cache,
                    next_ids=torch.cat([prompt[:, 1:], first], dim=1),
                ),
            )
        sync(self.device)
        req.stats.prefill_time_s += time.perf_counter() - t0
        return caches if self.budget.running(req.new_tokens, self.stops) else None

    def _retire(self, active: list[_Request], done, caches: PaddedCaches) -> None:
        """Finished rows leave the batch."""
        keep = [i for i, r in enumerate(active) if self.budget.running(r.new_tokens, self.stops)]
        if len(keep) < len(active):
            done += [r for i, r in enumerate(active) if i not in keep]
            active[:] = [active[i] for i in keep]
            caches.select(keep)

    def _result(self, req: _Request) -> BatchedResult:
        tokens = self.budget.output(req.new_tokens, self.stops)
        req.stats.new_tokens = len(tokens)
        tail = torch.tensor([tokens], dtype=req.prompt_1P.dtype)
        return BatchedResult(req.index, torch.cat([req.prompt_1P.cpu(), tail], 1), req.stats)

    # -- one round -------------------------------------------------------------------------------
    def _round(self, active: list[_Request], caches: PaddedCaches) -> None:
        rows = len(active)
        t0 = time.perf_counter()
        x_start = torch.tensor([r.new_tokens[-1] for r in active], device=self.device)
        rooms = [self.budget.room(r.new_tokens) for r in active]
        proposal = self._draft(active, caches, x_start, draft_budget(self.block_size, rooms))
        lengths = self.policy.lengths(proposal, rooms) if proposal is not None else [0] * rows
        M = max(lengths)
        verify_ids = x_start.unsqueeze(1)
        if M > 0:
            verify_ids = torch.cat([verify_ids, proposal.tokens[:, :M]], dim=1)
        sync(self.device)
        t1 = time.perf_counter()
        starts = caches.starts()
        logits, feats = target_forward(self.target, caches, verify_ids, self.layer_ids)
        accepted, next_tokens = verify.verify_rows(
            verify_ids[:, 1:],
            torch.tensor(lengths, device=self.device),
            logits,
            proposal.logits[:, :M] if M > 0 else None,
            self.temperature,
            self.generator,
            draft_temperature=self.draft_temperature,
        )
        keep_R = self._commit(active, proposal, verify_ids[:, 1:], lengths, accepted, next_tokens)
        if self.drafter is not None:
            self._extend(caches, feats, starts, verify_ids, next_tokens, keep_R)
        caches.trim(keep_R, M + 1)
        sync(self.device)
        t2 = time.perf_counter()
        for req in active:  # the batch's time, shared out among its rows
            req.stats.draft_time_s += (t1 - t0) / rows
            req.stats.verify_time_s += (t2 - t1) / rows

    def _draft(self, active: list[_Request], caches: PaddedCaches, x_start, budget: int):
        """Every row's proposal (None without a drafter)."""
        if self.drafter is None:
            return None
        return self.kind.decode.propose(
            self.drafter,
            DraftRound(
                x_start=x_start,
                starts=caches.starts(),
                cache=caches.draft_cache,
                key_mask=caches.key_mask(),
                budget=budget,
                temperature=self.draft_temperature,
                generator=self.generator,
                stop_token_ids=self.stops,
            ),
        )

    def _commit(self, active, proposal: Proposal | None, drafts_RM, lengths, accepted, next_tokens):
        """Each row's verified round into its tokens and counters; returns [R] how many of the
        M + 1 verified columns each row keeps (x_start and its accepted drafts)."""
        M = drafts_RM.shape[1]
        drafted = drafts_RM.tolist()
        conf = None if proposal is None else proposal.confidence_logits
        conf = conf.tolist() if conf is not None else [[]] * len(active)
        keep = []
        for i, req in enumerate(active):
            verdict = settle(drafted[i], lengths[i], accepted[i], next_tokens[i], self.stops)
            req.new_tokens.extend(verdict.committed)
            req.stats.record(verdict, conf[i][: verdict.proposed])
            keep.append(min(verdict.accepted, M) + 1)
        return torch.tensor(keep, device=self.device)

    def _extend(self, caches: PaddedCaches, feats, starts, verify_ids, next_tokens, keep_R):
        """The drafter's cache takes the M + 1 verified columns of every row (the caller trims
        the rejected ones off both caches)."""
        rows, appended = verify_ids.shape
        # position i pairs its features with the token that follows it: the next verify input,
        # and at each row's last kept position the target's token
        next_ids = torch.cat([verify_ids[:, 1:], verify_ids[:, :1]], dim=1).clone()
        next_ids[torch.arange(rows, device=self.device), keep_R - 1] = torch.tensor(
            next_tokens, device=self.device, dtype=next_ids.dtype
        )
        key_mask = caches.key_mask()
        self.kind.decode.extend(
            self.drafter,
            VerifiedContext(
                feats,
                starts.unsqueeze(1) + torch.arange(appended, device=self.device),
                caches.draft_cache,
                next_ids=next_ids,
                key_mask=torch.cat([key_mask, key_mask.new_ones(rows, appended)], dim=1),
                num_kept=keep_R,
            ),
        )


def batched_generate(target, drafter, prompts: list[torch.Tensor], **kwargs) -> list[BatchedResult]:
    """`BatchedDecoder(target, drafter, **kwargs).run(prompts)`."""
    return BatchedDecoder(target, drafter, **kwargs).run(prompts)


# ---- `dspark-ds eval --batch_size N` -------------------------------------------------------------


@dataclass
class PromptRun:
    """One prompt under one decoding mode: its counters (with its share of the batch's time)."""

    stats: DecodeStats

    @property
    def time_s(self) -> float:
        s = self.stats
        return s.prefill_time_s + s.draft_time_s + s.verify_time_s


def decode_prompts(
    cfg, target, drafter, prompts: list[torch.Tensor], seed: int, stops: list[int], sps: SPS | None
) -> tuple[list[DecodeStats], list[PromptRun], dict[str, list[PromptRun]]]:
    """A benchmark's prompts under `cfg` (an EvalConfig) at `cfg.batch_size`: the drafter with
    the configured policy, the target alone, and (with `cfg.scheduler.compare`) full-γ,
    static-threshold and scheduler runs. Each mode gets its own generator seeded with `seed`."""
    device = next(target.parameters()).device

    def run(model, policy: str, threshold: float = 0.0) -> list[BatchedResult]:
        return batched_generate(
            target,
            model,
            prompts,
            batch_size=cfg.batch_size,
            policy=policy,
            confidence_threshold=threshold,
            sps=sps,
            budget_accounting=cfg.budget_accounting,
            draft_temperature=cfg.draft_temperature,
            **run_settings(cfg, stops, device, seed),
        )

    if cfg.scheduler.enabled:
        policy, threshold = "scheduler", 0.0
    elif cfg.confidence_threshold > 0.0:
        policy, threshold = "threshold", cfg.confidence_threshold
    else:
        policy, threshold = "full", 0.0
    main = [r.stats for r in run(drafter, policy, threshold)]
    baseline = [PromptRun(r.stats) for r in run(None, "full")]
    policies: dict[str, list[PromptRun]] = {}
    if cfg.scheduler.compare:
        policies["full"] = [PromptRun(r.stats) for r in run(drafter, "full")]
        policies["threshold"] = [
            PromptRun(r.stats) for r in run(drafter, "threshold", cfg.scheduler.compare_threshold)
        ]
        policies["scheduler"] = [PromptRun(r.stats) for r in run(drafter, "scheduler")]
    return main, baseline, policies


def policy_summary(runs: list[PromptRun], baseline_tokens_per_s: float | None) -> dict:
    """Throughput of one policy over a benchmark's prompts, and its speedup over the target."""
    tokens = sum(r.stats.new_tokens for r in runs)
    seconds = sum(r.time_s for r in runs)
    rounds = sum(r.stats.rounds for r in runs)
    tokens_per_s = tokens / seconds if seconds > 0 else float("nan")
    return {
        "tokens_per_s": tokens_per_s,
        "speedup": tokens_per_s / baseline_tokens_per_s if baseline_tokens_per_s else None,
        "tau": sum(sum(r.stats.committed_per_round) for r in runs) / rounds if rounds else None,
        "drafts_verified_per_round": (
            sum(sum(r.stats.proposed_per_round) for r in runs) / rounds if rounds else None
        ),
    }
