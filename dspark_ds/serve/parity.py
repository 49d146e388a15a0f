"""The engine parity check of `dspark-ds eval --engine.url` (docs/serving.md#parity).

The evaluation decodes each benchmark prompt with our speculative decoding, rounds counted as
vLLM's scheduler counts them (`budget_accounting: engine`), and sends the same prompt token ids
to the server, one request at a time. The server's speculative-decoding counters before and
after (`/metrics`) give its drafts, draft tokens and accepted tokens per position for exactly
those prompts; ours come from the same rounds of our decoding. At T = 0 both sides then see the
same target tokens, so any gap is the drafter running differently in the engine: its layout,
tapped layers, mask token, vocabulary map (`drafters/serving.py` names what to look at for the
drafter's format). Outputs that differ mean the target itself runs differently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dspark_ds.serve.client import EngineClient, SpecCounters


def our_counters(stats_list) -> SpecCounters:
    """What vLLM's counters would read for our rounds (`DecodeStats.verified_per_round`)."""
    out = SpecCounters()
    per_pos: list[int] = []
    for stats in stats_list:
        for proposed, accepted in stats.verified_per_round:
            if proposed == 0:
                continue
            out.drafts += 1
            out.draft_tokens += proposed
            out.accepted += accepted
            per_pos += [0] * (accepted - len(per_pos))
            for k in range(accepted):
                per_pos[k] += 1
    out.accepted_per_pos = per_pos
    return out


@dataclass
class EngineRun:
    """The server's side of one evaluation."""

    client: EngineClient
    before: SpecCounters
    outputs: list[list[int]] = field(default_factory=list)

    @classmethod
    def start(cls, cfg) -> EngineRun:
        client = EngineClient(cfg.engine)
        client.check()
        return cls(client, client.counters())

    def decode(self, prompts: list[list[int]], *, max_tokens: int, temperature: float, stops):
        for prompt in prompts:
            self.outputs.append(
                self.client.complete(
                    prompt, max_tokens=max_tokens, temperature=temperature, stop_token_ids=stops
                )
            )

    def spent(self) -> SpecCounters:
        return self.client.counters() - self.before


@dataclass
class Parity:
    engine: SpecCounters
    ours: SpecCounters
    prompts: int
    outputs_differ: int
    tolerance: float
    gaps: list[str]
    look_at: list[str]

    @property
    def ok(self) -> bool:
        return not self.gaps

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "engine": self.engine.as_dict(),
            "ours": self.ours.as_dict(),
            "prompts": self.prompts,
            "outputs_differ": self.outputs_differ,
            "tolerance": self.tolerance,
            "gaps": self.gaps,
            "look_at": self.look_at,
        }

    def metrics(self) -> dict[str, float]:
        out = {"engine/parity_ok": float(self.ok), "engine/outputs_differ": self.outputs_differ}
        for side, c in (("engine", self.engine), ("ours", self.ours)):
            out[f"{side}/tau"] = c.tau
            out[f"{side}/num_drafts"] = c.drafts
            out[f"{side}/num_draft_tokens"] = c.draft_tokens
            out[f"{side}/num_accepted_tokens"] = c.accepted
            for k, n in enumerate(c.accepted_per_pos):
                out[f"{side}/accepted@{k}"] = n
        return {k: float(v) for k, v in out.items() if not math.isnan(float(v))}


def _rate(counts: list[int], k: int, drafts: int) -> float:
    return (counts[k] if k < len(counts) else 0) / drafts if drafts else 0.0


def compare(
    engine: SpecCounters,
    ours: SpecCounters,
    *,
    prompts: int,
    outputs_differ: int,
    tolerance: float,
    suspects: list[str],
) -> Parity:
    """Gaps beyond `tolerance` (relative τ, absolute acceptance share per position); at
    tolerance 0 every count must be equal."""
    gaps = []
    if outputs_differ:
        gaps.append(
            f"the engine's output differs from ours on {outputs_differ} of {prompts} prompts"
        )
    if tolerance == 0:
        for name in ("drafts", "draft_tokens", "accepted"):
            if getattr(engine, name) != getattr(ours, name):
                gaps.append(f"{name}: engine {getattr(engine, name)}, ours {getattr(ours, name)}")
        width = max(len(engine.accepted_per_pos), len(ours.accepted_per_pos))
        pad = lambda c: c + [0] * (width - len(c))  # noqa: E731
        if pad(engine.accepted_per_pos) != pad(ours.accepted_per_pos):
            gaps.append(
                f"accepted per position: engine {pad(engine.accepted_per_pos)}, ours "
                f"{pad(ours.accepted_per_pos)}"
            )
    else:
        if not math.isclose(engine.tau, ours.tau, rel_tol=tolerance):
            gaps.append(f"τ: engine {engine.tau:.3f}, ours {ours.tau:.3f}")
        width = max(len(engine.accepted_per_pos), len(ours.accepted_per_pos))
        for k in range(width):
            e = _rate(engine.accepted_per_pos, k, engine.drafts)
            o = _rate(ours.accepted_per_pos, k, ours.drafts)
            if abs(e - o) > tolerance:
                gaps.append(f"acceptance at position {k}: engine {e:.3f}, ours {o:.3f}")
    look_at = []
    if gaps:
        if outputs_differ:
            look_at.append(
                "the target: the engine's greedy output is not the target's (the served model "
                "and its dtype, the stop tokens; the prompts go as our token ids, so a chat "
                "template applied by the server to chat requests must be the one evaluated)"
            )
        if engine.drafts and ours.drafts:
            per_round = (engine.draft_tokens / engine.drafts, ours.draft_tokens / ours.drafts)
            if round(per_round[0]) != round(per_round[1]):
                look_at.append(
                    f"num_speculative_tokens: the engine drafts {per_round[0]:.1f} tokens a "
                    f"round, the drafter {per_round[1]:.1f}"
                )
        look_at += suspects
    return Parity(engine, ours, prompts, outputs_differ, tolerance, gaps, look_at)


def format_parity(p: Parity) -> str:
    width = max(len(p.engine.accepted_per_pos), len(p.ours.accepted_per_pos))
    head = ["side", "drafts", "draft_tokens", "accepted", "tau"] + [
        f"accepted@{k}" for k in range(width)
    ]
    rows = []
    for side, c in (("engine", p.engine), ("ours", p.ours)):
        per = c.accepted_per_pos + [0] * (width - len(c.accepted_per_pos))
        rows.append([side, c.drafts, c.draft_tokens, c.accepted, f"{c.tau:.3f}", *per])
    cols = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(str(v).rjust(w) for v, w in zip(r, cols)) for r in [head, *rows]]
    verdict = "PASS" if p.ok else "FAIL"
    lines.append(
        f"engine parity ({p.prompts} prompts, tolerance {p.tolerance:g}): {verdict}"
        + ("" if p.ok else "; " + "; ".join(p.gaps))
    )
    if not p.ok and p.look_at:
        lines.append("look at: " + " | ".join(p.look_at))
    return "\n".join(lines)
