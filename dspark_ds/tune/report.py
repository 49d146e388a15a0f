"""The tuner's table: one row per option, why the others do not fit, the recommendation."""

from __future__ import annotations

from dspark_ds.tune.config import OPTIONS, TunerConfig
from dspark_ds.tune.estimate import GB, Estimate, batch_mismatch, recommend
from dspark_ds.tune.inventory import Inventory

MB = 1024**2
HEADER = ["option", "per GPU", "host/node", "states", "DeepSpeed est.", "activations", "fits",
          "overhead"]  # fmt: skip
MEASURED_HEADER = ["measured peak", "est/meas", "step s"]


def fmt_bytes(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / GB:.2f} GiB" if x >= GB else f"{x / MB:.1f} MiB"


def headline(cfg: TunerConfig, inv: Inventory, run_cfg) -> list[str]:
    """The recipe and the cluster, in two lines."""
    from dspark_ds.drafters.registry import get_kind

    drafter = get_kind(run_cfg.model.kind).describe(run_cfg.model)
    return [
        f"recipe {cfg.recipe}: {drafter}: {inv.trainable / 1e6:.1f} M trainable + "
        f"{inv.frozen / 1e6:.1f} M frozen params, target {inv.target_params / 1e9:.2f} B "
        f"({run_cfg.data.mode}), micro-batch {run_cfg.data.batch_size} × "
        f"{run_cfg.data.max_length}, V={inv.vocab}, {run_cfg.train.precision}",
        f"cluster {cfg.nodes} node(s) × {cfg.gpus_per_node} GPU(s) of {cfg.gpu_memory_gb:g} GiB, "
        f"{cfg.cpu_memory_gb:g} GiB host RAM per node",
    ]


def row(e: Estimate, cfg: TunerConfig, measured: dict[str, dict] | None) -> list[str]:
    out = [
        e.option,
        fmt_bytes(e.device_total),
        fmt_bytes(e.host_total_per_rank * cfg.gpus_per_node),
        fmt_bytes(e.states),
        fmt_bytes(e.deepspeed_states),
        fmt_bytes(e.activations),
        "yes" if e.fits else "no",
        f"+{e.overhead:.0%}",
    ]
    if measured is None:
        return out
    m = measured.get(e.option)
    if m is None:
        return out + ["-", "-", "-"]
    here = e.device_total + e.host_total_per_rank  # one machine: device and host share RAM
    return out + [fmt_bytes(m["peak_bytes"]), f"{here / m['peak_bytes']:.2f}", f"{m['step_s']:.3f}"]


def table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = ["  ".join(f"{h:<{w}}" for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(f"{c:<{w}}" for c, w in zip(r, widths)) for r in rows]
    return lines


def conclusion(estimates: list[Estimate]) -> str:
    best = recommend(estimates)
    if best is None:
        return (
            "nothing fits: lower data.batch_size / data.max_length / model.num_anchors "
            "(Eagle3: model.ttt_length), use the chunked loss, more GPUs, or data.mode offline"
        )
    option = next(o for o in OPTIONS if o.name == best.option)
    return (
        f"recommended: {best.option} ({option.cli}): the least overhead among the "
        f"options that fit, {fmt_bytes(best.device_total)} per GPU"
    )


def report(
    estimates: list[Estimate],
    cfg: TunerConfig,
    inv: Inventory,
    run_cfg,
    measured: dict[str, dict] | None = None,
) -> str:
    header = HEADER + (MEASURED_HEADER if measured else [])
    rows = [row(e, cfg, measured or None) for e in estimates]
    lines = [*headline(cfg, inv, run_cfg), "", *table(rows, header)]
    lines += [f"  {e.option}: does not fit: {e.why}" for e in estimates if not e.fits]
    lines += ["", conclusion(estimates)]
    note = batch_mismatch(run_cfg, cfg.world_size)
    if note:
        lines.append(f"note: {note}")
    if measured:
        lines.append(
            "measured here: estimate covers device + host bytes of one rank "
            "(on a CPU-only machine both live in the same RAM)"
        )
    return "\n".join(lines)
