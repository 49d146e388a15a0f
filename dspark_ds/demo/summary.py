"""The demo's result: per seed and its spread, as summary.json, a table, and one MLflow run.

summary.json:

    seeds, temperatures       what ran
    per_seed[seed][kind]      "train" (steps, losses, anchors) and one eval row per temperature
                              ("T0", "T1": τ, speedup, tokens/s, acceptance by position, ...)
    spread[kind][T]           min / mean / max over the seeds of τ and speedup
    ratios[name][T]           a preset over another (the pairs its claims name, drafters/presets.py),
                              τ and speedup: per seed, min, max
    supervision               what each drafter is trained on (the basis of the comparison)
    checks                    the demo's claims, and whether each holds in every seed
    stage_seconds             wall time per stage; stage_cpu_seconds: CPU time (every rank)
    total_seconds, target, ranks, config, mlflow
"""

from __future__ import annotations

import math
import shutil
from dataclasses import asdict
from pathlib import Path

from dspark_ds.config import flatten
from dspark_ds.demo.config import DemoConfig
from dspark_ds.drafters.presets import PRESETS, preset
from dspark_ds.drafters.registry import get_kind
from dspark_ds.files import json_safe
from dspark_ds.tracking.mlflow import Tracker
from dspark_ds.tracking.store import default_artifact_location

METRICS = ("tau", "speedup")
RATIO_METRICS = (*METRICS, "acceptance")
"""What the ratios compare: τ, speedup, and the acceptance by position, whose ratio is the
smallest over the positions both drafters reached (≥ 1: ahead or level at every position)."""
# The paper's claims (`Preset.claims`): (ratio, temperature, at least), each required in every
# seed; and the (numerator, denominator) pairs of the ratios reported per seed.
CLAIMS = tuple(
    (f"{c.metric}_{name}_over_{c.over}", c.temperature, c.at_least, c.first_position_note)
    for name, p in PRESETS.items()
    for c in p.claims
)
PAIRS = tuple(dict.fromkeys((name, c.over) for name, p in PRESETS.items() for c in p.claims))


def _label(name: str) -> str:
    return PRESETS[name].label


def temp_key(t: float) -> str:
    return f"T{t:g}"


def _spread(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None
    return {"min": min(values), "mean": sum(values) / len(values), "max": max(values)}


def _ratio_name(metric: str, a: str, b: str) -> str:
    return f"{metric}_{a}_over_{b}"


def _orders(cfg: DemoConfig) -> str:
    """How the drafters' orders of the data differ, if they do ("" when one order for all)."""
    shuffled = [_label(k) for k in cfg.drafters if cfg.length_grouping(k) == 1]
    if not shuffled or len(shuffled) == len(cfg.drafters):
        return ""
    return f" ({', '.join(shuffled)} in a random order of it, the others grouped by length)"


def _tuned(cfg: DemoConfig) -> str:
    """The drafters that train with other optimizer settings than the budget's ("" if none)."""
    tuned = [
        f"{_label(k)} with " + ", ".join(f"{f} {v:g}" for f, v in fields.items())
        for k in cfg.drafters
        if (fields := cfg.train_fields(k))
    ]
    return "".join(f"; {t}" for t in tuned)


def supervision(cfg: DemoConfig, per_seed: dict) -> dict:
    """What every drafter is trained on: the basis of the comparison, with the measured share of
    valid positions the anchor sampler covered (the kinds that train on anchor blocks)."""
    b = cfg.budget
    out: dict = {
        "budget": f"{b.max_steps} steps x {b.global_batch_size} sequences, lr {b.lr:g}, "
        f"the same data for every drafter{_orders(cfg)}{_tuned(cfg)}",
    }
    for kind in cfg.drafters:
        trains = [per_seed[s][kind].get("train", {}) for s in per_seed if kind in per_seed[s]]
        sizes = cfg.drafter.block(kind)
        g = sizes.draft_length
        if not get_kind(preset(kind).kind).capabilities.anchor_blocks:  # every position, unrolled
            out[kind] = {"positions": "every supervised position", "depth": g}
            continue
        shares = [t["anchored_share_of_valid"] for t in trains if "anchored_share_of_valid" in t]
        out[kind] = {
            "positions": "every valid position"
            if sizes.num_anchors is None
            else f"{sizes.num_anchors} sampled anchors per sequence",
            "depth": g,
            "num_anchors": [t.get("num_anchors") for t in trains],
            "anchored_share_of_valid": min(shares) if shares else None,
            "valid_anchors_per_sequence": _spread(
                [
                    t["valid_anchors_per_sequence"]
                    for t in trains
                    if "valid_anchors_per_sequence" in t
                ]
            ),
        }
    return out


def _ratios(cfg: DemoConfig, per_seed: dict, temps: list[str]) -> dict:
    """ratios[<metric>_<a>_over_<b>][T]: per seed, min, mean, max (pairs both drafters ran)."""
    ratios: dict = {}
    for a, b in PAIRS:
        if a not in cfg.drafters or b not in cfg.drafters:
            continue
        for m in RATIO_METRICS:
            per_t = {}
            for t in temps:
                each = {}
                for s, seed_results in per_seed.items():
                    value = _ratio_of(
                        m, seed_results.get(a, {}).get(t, {}), seed_results.get(b, {}).get(t, {})
                    )
                    if value is not None:
                        each[s] = value
                if each:
                    per_t[t] = {"per_seed": each, **_spread(list(each.values()))}
                    if m == "acceptance":
                        per_t[t]["behind_at"] = {
                            s: _behind(
                                seed_results.get(a, {}).get(t, {}),
                                seed_results.get(b, {}).get(t, {}),
                            )
                            for s, seed_results in per_seed.items()
                            if s in each
                        }
            ratios[_ratio_name(m, a, b)] = per_t
    return ratios


def _ratio_of(metric: str, a: dict, b: dict) -> float | None:
    """`metric` of row `a` over row `b`; for "acceptance" the smallest ratio over the positions
    where both have an acceptance and `b`'s is > 0. None where there is nothing to compare."""
    if metric != "acceptance":
        x, y = a.get(metric), b.get(metric)
        return x / y if x is not None and y else None
    each = [x / y for _, x, y in _positions(a, b) if y]
    return min(each) if each else None


def _positions(a: dict, b: dict) -> list[tuple[int, float, float]]:
    """(position, `a`'s acceptance, `b`'s) where both rows have one."""
    pairs = zip(a.get("accept_rate_by_position") or [], b.get("accept_rate_by_position") or [])
    return [(j, x, y) for j, (x, y) in enumerate(pairs) if x is not None and y is not None]


def _behind(a: dict, b: dict) -> list[int]:
    """The positions where row `a`'s acceptance is below row `b`'s."""
    return [j for j, x, y in _positions(a, b) if x < y]


def _checks(ratios: dict) -> list[dict]:
    """Each claim of CLAIMS judged on its worst seed (an acceptance claim also says where a seed
    is behind, and carries its note for a miss at the first position only)."""
    checks = []
    for name, t, at_least, first_note in CLAIMS:
        r = ratios.get(name, {}).get(temp_key(t))
        if r is not None:
            claim = {
                "ratio": name,
                "T": temp_key(t),
                "at_least": at_least,
                "min": r["min"],
                "holds": r["min"] >= at_least,
                "seeds": len(r["per_seed"]),
            }
            behind = {s: js for s, js in r.get("behind_at", {}).items() if js}
            if behind:
                claim["behind_at"] = behind
                if first_note and all(js == [0] for js in behind.values()):
                    claim["note"] = first_note
            checks.append(claim)
    return checks


def build_summary(
    cfg: DemoConfig,
    results: dict[int, dict[str, dict]],
    stage_seconds: dict[str, float],
    total_seconds: float,
    target,
    ranks: int,
    uri: str,
    stage_cpu_seconds: dict[str, float] | None = None,
) -> dict:
    """summary.json's content (strict JSON: NaN -> None) from the pipeline's results."""
    temps = [temp_key(t) for t in cfg.eval.temperatures]
    per_seed = {str(s): results.get(s, {}) for s in cfg.seeds}
    spread = {
        kind: {
            t: {
                m: _spread([per_seed[s].get(kind, {}).get(t, {}).get(m) for s in per_seed])
                for m in METRICS
            }
            for t in temps
        }
        for kind in cfg.drafters
    }
    ratios = _ratios(cfg, per_seed, temps)
    checks = _checks(ratios)
    report = target.report if target is not None else {}
    summary = {
        "seeds": list(cfg.seeds),
        "temperatures": list(cfg.eval.temperatures),
        "per_seed": per_seed,
        "spread": spread,
        "ratios": ratios,
        "checks": checks,
        "supervision": supervision(cfg, per_seed),
        "eval": {
            "batch_size": cfg.eval.batch_size,
            "max_new_tokens": cfg.eval.max_new_tokens,
            "draft_temperature": cfg.eval.draft_temperature,
        },
        "stage_seconds": dict(stage_seconds),
        "stage_cpu_seconds": dict(stage_cpu_seconds or {}),
        "total_seconds": total_seconds,
        "target": {
            "path": str(target.path) if target else None,
            "from_cache": bool(target and target.from_cache),
            "num_parameters": report.get("num_parameters"),
            "final_loss": report.get("final_loss"),
            "train_seconds": report.get("train_seconds"),
            "probe": report.get("probe"),
        },
        "ranks": ranks,
        "config": asdict(cfg),
        "mlflow": {"uri": uri, "experiment": cfg.experiment},
    }
    return json_safe(summary)


def _f(v, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{digits}f}"


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _supervision_line(summary: dict) -> str:
    sup = summary.get("supervision", {})
    parts = []
    for kind, s in sup.items():
        if kind == "budget":
            continue
        if "num_anchors" not in s:
            parts.append(f"{_label(kind)}: {s['positions']} over {s['depth']} unrolled steps")
            continue
        share = s.get("anchored_share_of_valid")
        anchors = sorted({a for a in s.get("num_anchors", []) if a is not None})
        parts.append(
            f"{_label(kind)}: {s['positions']} anchors a block of {s['depth']} supervised "
            f"next tokens (A = {'/'.join(map(str, anchors)) or '-'} blocks per sequence; "
            f"anchored share of valid positions {_f(share, 2)})"
        )
    return "supervision: " + "; ".join(parts) + f". Budget: {sup.get('budget', '-')}."


def _seed_rows(summary: dict, temps: list[str]) -> list[str]:
    """Per drafter, temperature and seed: τ, speedup, acceptance by position, calibration."""
    per_seed = summary["per_seed"]
    lengths = (
        len(row.get("accept_rate_by_position", []))
        for seed in per_seed.values()
        for e in seed.values()
        for k, row in e.items()
        if k in temps
    )
    width = max(lengths, default=0)
    header = ["drafter", "T", "seed", "tau", "speedup"] + [f"acc@{k}" for k in range(width)]
    rows = [header + ["draft_ms", "verify_ms", "ECE", "AUROC", "ECE(STS)", "train_s"]]
    for kind in next(iter(per_seed.values()), {}):
        for t in temps:
            for s, seed_results in per_seed.items():
                row = seed_results.get(kind, {}).get(t)
                if not row:
                    continue
                acc = list(row["accept_rate_by_position"]) + [None] * width
                cal = row.get("calibration", {})
                train_s = summary["stage_seconds"].get(f"train-{kind}-s{s}")
                rows.append(
                    [_label(kind), t[1:], s, _f(row["tau"]), _f(row.get("speedup"), 2)]
                    + [_f(a) for a in acc[:width]]
                    + [
                        _f(row.get("draft_ms_per_round"), 2),
                        _f(row.get("verify_ms_per_round"), 2),
                        _f(cal.get("raw", {}).get("ece")),
                        _f(cal.get("raw", {}).get("auroc")),
                        _f(cal.get("sts", {}).get("ece")),
                        _f(train_s, 1),
                    ]
                )
    return _columns(rows)


def _spread_rows(summary: dict, temps: list[str]) -> list[str]:
    """min / mean / max of τ and speedup over the seeds (nothing for one seed)."""
    seeds = summary["seeds"]
    if len(seeds) < 2:
        return []
    rows = [["drafter", "T", "tau", "speedup"]]
    for kind, per_t in summary["spread"].items():
        for t in temps:
            cells = [
                "/".join(_f(v[k], 2) for k in ("min", "mean", "max")) if v else "-"
                for v in (per_t.get(t, {}).get(m) for m in METRICS)
            ]
            rows.append([_label(kind), t[1:], *cells])
    title = f"spread over seeds {', '.join(map(str, seeds))} (min / mean / max):"
    return ["", title, *_columns(rows)]


def _ratio_lines(summary: dict) -> list[str]:
    """The claimed ratios per seed with min / max, then whether each claim holds."""
    lines = []
    for name, per_t in summary["ratios"].items():
        metric, a, _, b = name.split("_")
        worst = ", the smallest over the positions" if metric == "acceptance" else ""
        for t, r in per_t.items():
            each = ", ".join(f"{v:.3f}" for v in r["per_seed"].values())
            lines.append(
                f"{metric}({_label(a)}) / {metric}({_label(b)}) at T = {t[1:]}{worst}: {each} "
                f"(seed {', '.join(r['per_seed'])}); min {r['min']:.3f}, max {r['max']:.3f}"
            )
    for c in summary.get("checks", []):
        metric, a, _, b = c["ratio"].split("_")
        where = " at every position" if metric == "acceptance" else ""
        behind = "; ".join(
            f"behind at position {', '.join(map(str, js))} in seed {s}"
            for s, js in c.get("behind_at", {}).items()
        )
        lines.append(
            f"claim {metric}({_label(a)}) >= {c['at_least']:.2f} x {metric}({_label(b)}){where} "
            f"at T = {c['T'][1:]} in every seed ({c['seeds']}): "
            f"{'holds' if c['holds'] else 'does NOT hold'} (min {c['min']:.3f}"
            + (f"; {behind})" if behind and not c["holds"] else ")")
        )
        if c.get("note") and not c["holds"]:
            lines.append(f"  {c['note']}")
    return lines


def _stage_lines(summary: dict) -> list[str]:
    """Wall (and CPU) seconds of the shared stages, then of each seed's, then the total."""
    stages, cpu = summary["stage_seconds"], summary.get("stage_cpu_seconds", {})

    def times(names: dict[str, str]) -> str:
        return ", ".join(
            f"{short} {stages[k]:.1f}" + (f" ({cpu[k]:.0f})" if k in cpu else "")
            for k, short in names.items()
        )

    per_seed_names = {
        s: {k: k[: -len(f"-s{s}")] for k in stages if k.endswith(f"-s{s}")}
        for s in summary["seeds"]
    }
    common = {k: k for k in stages if not any(k in names for names in per_seed_names.values())}
    lines = ["stage wall times, s (CPU s, all ranks): " + times(common)]
    lines += [f"  seed {s}: " + times(names) for s, names in per_seed_names.items()]
    target = summary["target"]
    lines.append(
        f"total {summary['total_seconds']:.1f} s (CPU {sum(cpu.values()):.0f} s); target "
        f"{'from cache' if target['from_cache'] else 'trained in this run'}; "
        f"{summary['ranks']} rank(s)"
    )
    return lines


def format_summary(summary: dict) -> str:
    """The comparison: per seed (τ, speedup, acceptance by position, calibration), the spread
    over the seeds, the DSpark ratios per seed with min / max, the claims, stage times."""
    temps = [temp_key(t) for t in summary["temperatures"]]
    ev = summary.get("eval", {})
    lines = [_supervision_line(summary), "", *_seed_rows(summary, temps)]
    lines.append(
        f"(speedup: tokens/s with the drafter over the target alone, both at batch "
        f"{ev.get('batch_size', '-')}, same prompts, same run; draft_ms / verify_ms: a "
        f"request's share of the batch's drafting / verification time per round)"
    )
    if ev.get("draft_temperature") is not None:
        lines.append(f"(T > 0: the drafts sampled at draft temperature {ev['draft_temperature']})")
    lines += _spread_rows(summary, temps)
    lines += ["", *_ratio_lines(summary), "", *_stage_lines(summary)]
    return "\n".join(lines)


def summary_metrics(summary: dict) -> dict[str, float]:
    """MLflow metrics: per seed `s<seed>/<kind>/<T>/<metric>`, the mean over seeds
    `<kind>/<T>/<metric>` with `_min` / `_max`, the ratios, stage times."""
    metrics: dict[str, float | None] = {}
    for s, seed_results in summary["per_seed"].items():
        for kind, entry in seed_results.items():
            for t, row in entry.items():
                if t == "train":
                    continue
                for m in METRICS:
                    metrics[f"s{s}/{kind}/{t}/{m}"] = row.get(m)
                for k, a in enumerate(row["accept_rate_by_position"]):
                    metrics[f"s{s}/{kind}/{t}/accept_rate@{k}"] = a
                for variant, vals in row.get("calibration", {}).items():
                    for key, v in vals.items():
                        metrics[f"s{s}/{kind}/{t}/confidence_{variant}_{key}"] = v
    for kind, per_t in summary["spread"].items():
        for t, per_m in per_t.items():
            for m, v in per_m.items():
                if v:
                    metrics[f"{kind}/{t}/{m}"] = v["mean"]
                    metrics[f"{kind}/{t}/{m}_min"] = v["min"]
                    metrics[f"{kind}/{t}/{m}_max"] = v["max"]
    for name, per_t in summary["ratios"].items():
        for t, r in per_t.items():
            metrics[f"{name}/{t}/min"] = r["min"]
            metrics[f"{name}/{t}/max"] = r["max"]
    for name, sec in summary["stage_seconds"].items():
        metrics[f"seconds/{name}"] = sec
    for name, sec in summary.get("stage_cpu_seconds", {}).items():
        metrics[f"cpu_seconds/{name}"] = sec
    return {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(v)}


def start_demo_run(cfg, uri: str, runs_dir: Path):
    """The demo's MLflow run (kind demo): every training is nested under it, every evaluation
    under the training of its drafter; the summary is logged into it at the end."""
    run_dir = runs_dir / "demo"
    shutil.rmtree(run_dir, ignore_errors=True)
    tracker = Tracker(
        enabled=True,
        uri=uri,
        experiment=cfg.experiment,
        run_name="demo",
        run_dir=str(run_dir),
        # the same place as the training and evaluation runs (all under runs/)
        artifact_location=default_artifact_location(str(runs_dir)),
        kind="demo",
        resume=False,
        tags={
            "demo": "true",
            "recipe": "demo",
            "seeds": ",".join(map(str, cfg.seeds)),
            "drafters": ",".join(cfg.drafters),
            "zero": cfg.budget.zero,
            "world_size": cfg.budget.world_size,
        },
    )
    tracker.log_params(flatten(cfg))
    return tracker


def log_summary(summary: dict, text: str, tracker) -> None:
    """The comparison into the demo's run: `summary_metrics`, the table and summary.json as
    artifacts."""
    tracker.log_params({"target_from_cache": summary["target"]["from_cache"]})
    tracker.log_metrics(summary_metrics(summary), step=0)
    tracker.log_text(text, "summary.txt")
    tracker.log_dict(summary, "summary.json")
