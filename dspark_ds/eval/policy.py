"""How many of a proposal's drafts each row sends to verification.

- "full": every draft the drafter proposes;
- "threshold": up to the first slot whose confidence (after the drafter's STS temperatures,
  when its config has them) is below a static threshold;
- "scheduler": the paper's hardware-aware prefix scheduler (its Algorithm 1) over the rows in
  flight, with a steps-per-second table of the target profiled on this machine.

Then the new-token budget caps each row (rounds.Budget.room). Both decoding loops use
`VerifyPolicy.lengths`; batch 1 offers "full" and "threshold".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from dspark_ds.drafters.common.rounds import Proposal
from dspark_ds.eval.padded import new_caches, target_forward
from dspark_ds.eval.rounds import sync

POLICIES = ("full", "threshold", "scheduler")

# steps per second of a target forward over R rows of L tokens each
SPS = Callable[[int, int], float]


def confident_prefix(probs_RG: torch.Tensor, threshold: float) -> list[int]:
    """Per row, the slots before the first one whose confidence is below `threshold`."""
    G = probs_RG.shape[1]
    slots = torch.arange(G, device=probs_RG.device).expand_as(probs_RG)
    below = probs_RG < threshold
    return torch.where(below, slots, torch.full_like(slots, G)).amin(dim=1).tolist()


def schedule_prefixes(confidences: list[list[float]], sps: SPS) -> list[int]:
    """Verification lengths ℓ_r for R rows from their per-slot confidences c_{r,1..γ}.

    Prefix survival a_{r,j} = Π_{i≤j} c_{r,i}. Candidates (r, j) are admitted in descending
    a_{r,j} (ties: the earlier slot first, so a row's prefix grows in order) while the expected
    throughput Θ = (R + Σ admitted a) · SPS(R, L) rises, L = 1 + max ℓ_r being the tokens per row
    of the (padded) verification forward. The search stops at the first candidate that does not
    raise Θ: no decision ever looks at a later candidate, which keeps decoding lossless.
    """
    rows = len(confidences)
    candidates = []
    for r, conf in enumerate(confidences):
        survival = 1.0
        for j, c in enumerate(conf, start=1):
            survival *= c
            if survival > 0.0:
                candidates.append((-survival, j, r))
    candidates.sort()
    lengths, chosen = [0] * rows, [0] * rows
    expected, longest = float(rows), 1
    best = expected * sps(rows, 1)
    for neg_survival, j, r in candidates:
        lengths[r] = j
        longest = max(longest, j + 1)
        expected -= neg_survival
        theta = expected * sps(rows, longest)
        if theta <= best:
            break
        best, chosen = theta, list(lengths)
    return chosen


@dataclass(frozen=True)
class VerifyPolicy:
    """One of `POLICIES` with what it needs."""

    name: str = "full"
    threshold: float = 0.0
    """The static confidence threshold ("threshold")."""
    temps_G: torch.Tensor | None = None
    """The drafter's STS temperatures, applied to the confidence logits first."""
    sps: SPS | None = None
    """The cost table ("scheduler")."""

    def lengths(self, proposal: Proposal, rooms: list[int | None]) -> list[int]:
        """Drafts each row verifies: its proposal, cut by the policy (when the drafter has a
        confidence head) and by its room in the budget (None: no cap)."""
        lengths = list(proposal.lengths)
        conf_RG = proposal.confidence_logits
        if self.name != "full" and conf_RG is not None:
            if self.temps_G is not None:
                conf_RG = conf_RG / self.temps_G.to(conf_RG.dtype)
            probs_RG = torch.sigmoid(conf_RG)
            if self.name == "threshold":
                cut = confident_prefix(probs_RG, self.threshold)
            else:
                cut = schedule_prefixes(probs_RG.tolist(), self.sps)
            lengths = [min(m, c) for m, c in zip(lengths, cut)]
        return [m if room is None else max(0, min(m, room)) for m, room in zip(lengths, rooms)]


@torch.inference_mode()
def profile_sps(
    target,
    *,
    max_rows: int,
    max_tokens: int,
    context_tokens: int,
    layer_ids: list[int],
    repeats: int = 3,
    progress: bool = False,
) -> dict[tuple[int, int], float]:
    """Steps per second of one verification forward over R rows x L tokens, R ≤ max_rows,
    L ≤ max_tokens, each row with `context_tokens` cached positions: the cost table of the
    scheduler, measured once on this machine (median of `repeats` after one warm-up)."""
    device = next(target.parameters()).device
    vocab = int(target.get_output_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    table = {}
    bar = tqdm(total=max_rows * max_tokens, desc="profile SPS", disable=not progress)
    for rows in range(1, max_rows + 1):
        caches = new_caches(target, None, rows=rows)
        caches.pad = torch.zeros(rows, dtype=torch.long, device=device)
        context = torch.randint(0, vocab, (rows, context_tokens), generator=gen).to(device)
        target_forward(target, caches, context, layer_ids, logits_to_keep=1)
        caches.trim(torch.full((rows,), context_tokens, device=device), context_tokens)
        for length in range(1, max_tokens + 1):
            ids = torch.randint(0, vocab, (rows, length), generator=gen).to(device)
            times = []
            for rep in range(repeats + 1):
                sync(device)
                t0 = time.perf_counter()
                target_forward(target, caches, ids, layer_ids)
                sync(device)
                if rep:
                    times.append(time.perf_counter() - t0)
                caches.trim(torch.zeros(rows, dtype=torch.long, device=device), length)
            table[(rows, length)] = 1.0 / sorted(times)[len(times) // 2]
            bar.update(1)
    bar.close()
    return table
