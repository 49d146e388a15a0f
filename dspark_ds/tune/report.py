"""The tuner's tables: memory and predicted step time per option (with the measurements of
`--measure`), the terms of each prediction, the scaling over node counts, the figures used."""

from __future__ import annotations

from dspark_ds.cost.inventory import Inventory
from dspark_ds.drafters.registry import get_kind
from dspark_ds.tune.cluster import GB as DECIMAL_GB
from dspark_ds.tune.cluster import Machine
from dspark_ds.tune.config import OPTIONS, TunerConfig
from dspark_ds.tune.estimate import GB, Estimate, batch_mismatch, recommend

MB = 1024**2
HEADER = [
    "option",
    "micro-batch",
    "recompute",
    "accum",
    "per GPU",
    "host/node",
    "states",
    "DeepSpeed est.",
    "activations",
    "fits",
    "step s",
    "tokens/s",
]
MEASURED_HEADER = ["measured peak", "est/meas", "measured step s", "pred/meas"]


def fmt_bytes(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / GB:.2f} GiB" if x >= GB else f"{x / MB:.1f} MiB"


def fmt_s(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def headline(cfg: TunerConfig, inv: Inventory, run_cfg, machine: Machine, nodes: int) -> list[str]:
    """The recipe and the cluster, in two lines."""
    drafter = get_kind(run_cfg.model.kind).report.describe(run_cfg.model)
    return [
        f"recipe {cfg.recipe}: {drafter}: {inv.trainable / 1e6:.1f} M trainable + "
        f"{inv.frozen / 1e6:.1f} M frozen params, target {inv.target_params / 1e9:.2f} B "
        f"({run_cfg.data.mode}), micro-batch {run_cfg.data.batch_size} × "
        f"{run_cfg.data.max_length}, global batch {run_cfg.train.global_batch_size}, "
        f"V={inv.vocab}{' (draft vocabulary)' if inv.draft_head else ''}, "
        f"{run_cfg.train.precision}",
        f"cluster {nodes} node(s) × {machine.gpus_per_node} "
        f"{'rank(s)' if cfg.device == 'cpu' else 'GPU(s)'} of "
        f"{machine.gpu_memory_bytes / GB:.0f} GiB, {machine.host_memory_bytes / GB:.0f} GiB "
        f"host RAM per node ({machine_label(cfg, machine)})",
    ]


def machine_label(cfg: TunerConfig, machine: Machine) -> str:
    calibrated = any(s.startswith("calibrated") for s in machine.sources.values())
    if calibrated:
        return "calibrated here"
    if cfg.cluster.profile:
        return f"profile {cfg.cluster.profile}"
    return f"preset {cfg.cluster.preset}"


def row(
    e: Estimate, machine: Machine, measured: dict[str, dict] | None, at_measurement: dict
) -> list[str]:
    out = [
        e.option,
        str(e.point.get("micro_batch", "-")),
        "yes" if e.point.get("recompute") else "-",
        str(e.step["accum"]),
        fmt_bytes(e.device_total),
        fmt_bytes(e.host_total_per_rank * machine.gpus_per_node),
        fmt_bytes(e.states),
        fmt_bytes(e.deepspeed_states),
        fmt_bytes(e.activations),
        "yes" if e.fits else "no",
        fmt_s(e.step["predicted_step_s"]),
        f"{e.step['tokens_per_s']:.0f}",
    ]
    if measured is None:
        return out
    m = measured.get(e.option)
    if m is None:
        return out + ["-"] * len(MEASURED_HEADER)
    here = e.device_total + e.host_total_per_rank  # one machine: device and host share RAM
    peak = m.get("peak_bytes")
    predicted = at_measurement.get(e.option, e.step["predicted_step_s"])
    return out + [
        fmt_bytes(peak),
        f"{here / peak:.2f}" if peak else "-",
        fmt_s(m["step_s"]),
        f"{predicted / m['step_s']:.2f}",
    ]


def table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = ["  ".join(f"{h:<{w}}" for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(f"{c:<{w}}" for c, w in zip(r, widths)) for r in rows]
    return lines


def terms_line(e: Estimate) -> str:
    """The prediction's terms, largest first (those of at least 1 % of the step)."""
    total = e.step["predicted_step_s"]
    terms = sorted(e.step["terms"].items(), key=lambda kv: -kv[1])
    shown = [f"{k} {fmt_s(v)}" for k, v in terms if v >= 0.01 * total]
    accum, micro = e.step["accum"], e.point.get("micro_batch")
    where = [f"micro-batch {micro}"] if micro else []
    where += ["recomputing the draft layers"] if e.point.get("recompute") else []
    where += [f"{accum} micro-batches per rank"] if accum > 1 else []
    return (
        f"  {e.option}: {fmt_s(total)} s = "
        + " + ".join(shown)
        + (f"  ({', '.join(where)})" if where else "")
    )


def conclusion(
    estimates: list[Estimate], as_given: list[Estimate] | None = None, given_micro: int = 0
) -> list[str]:
    best = recommend(estimates)
    if best is None:
        return [
            "nothing fits: lower data.batch_size / data.max_length / the drafter's work per "
            "position (model.num_anchors, or model.ttt_length of an unrolled drafter), use the "
            "chunked loss, more GPUs, or data.mode offline"
        ]
    option = next(o for o in OPTIONS if o.name == best.option)
    point = best.point
    flags = option.cli
    if point:
        flags += f" --data.batch_size {point['micro_batch']}"
        if point.get("recompute"):
            flags += " --perf.activation_checkpointing true"
        if point.get("note"):
            flags += f" --train.global_batch_size {point['global_batch']}"
    lines = [
        f"recommended: {best.option} at micro-batch {point.get('micro_batch', '?')} × "
        f"{best.step['accum']} accumulation"
        f"{', recomputing the draft layers' if point.get('recompute') else ''} ({flags}): "
        "the fastest predicted point that "
        f"fits, {fmt_s(best.step['predicted_step_s'])} s, {fmt_bytes(best.device_total)} per "
        "GPU"
    ]
    given = recommend(as_given or [])
    if given is not None and point:
        s_best, s_given = best.step["predicted_step_s"], given.step["predicted_step_s"]
        same_batch = given.step["sequences"] == best.step["sequences"]
        if same_batch and s_best > 0:
            lines.append(
                f"  the recipe as given (micro-batch {given_micro}): fastest that fits "
                f"{given.option}, {fmt_s(s_given)} s; the searched point is "
                f"{s_given / s_best:.2f}× as fast"
            )
    return lines


def scaling_table(scaling: dict[int, list[Estimate]]) -> list[str]:
    """Predicted step s and tokens/s per option at each node count (`*`: does not fit)."""
    counts = list(scaling)
    names = [e.option for e in scaling[counts[0]]]
    header = ["option"] + [f"{n} node(s): s / tokens/s @micro-batch" for n in counts]
    rows = []
    for i, name in enumerate(names):
        cells = [name]
        for n in counts:
            e = scaling[n][i]
            mark = "" if e.fits else " *"
            micro = e.point.get("micro_batch", "-")
            micro = f"{micro}+rc" if e.point.get("recompute") else micro
            cells.append(
                f"{fmt_s(e.step['predicted_step_s'])} / {e.step['tokens_per_s']:.0f} @{micro}{mark}"
            )
        rows.append(cells)
    lines = [
        "",
        "scaling (the global batch held; each option at its searched micro-batch; "
        "+rc = recomputing the draft layers; * = does not fit):",
    ]
    lines += table(rows, header)
    for n in counts:
        best = recommend(scaling[n])
        first = scaling[n][0]
        note = first.point.get("note") or first.step.get("note")
        note = f" ({note})" if note else ""
        at = (
            f"{best.option} at micro-batch {best.point.get('micro_batch')} × {best.step['accum']}"
            + (" recomputing the draft layers" if best.point.get("recompute") else "")
            if best
            else "none"
        )
        lines.append(
            f"  {n} node(s), {first.step['world']} GPUs, {first.point.get('global_batch')} "
            f"sequences per step: fastest that fits: {at}{note}"
        )
    return lines


def figures(machine: Machine) -> list[str]:
    """The headline figures and where each came from."""

    def src(key: str) -> str:
        return machine.sources.get(key, "default")

    def both(a: str, b: str) -> str:
        return src(a) if src(a) == src(b) else f"{src(a)}; {src(b)}"

    return [
        "figures: "
        f"peak {machine.peak_flops / 1e12:.3g} TFLOP/s × sustained "
        f"{machine.sustained_fraction:.3g} [{both('peak_flops', 'sustained_fraction')}], "
        f"all-reduce {machine.all_reduce_bytes_per_s / DECIMAL_GB:.3g} GB/s, all-gather "
        f"{machine.all_gather_bytes_per_s / DECIMAL_GB:.3g} GB/s, reduce-scatter "
        f"{machine.reduce_scatter_bytes_per_s / DECIMAL_GB:.3g} GB/s, latency "
        f"{machine.collective_latency_s * 1e6:.3g} µs [{src('all_reduce_bytes_per_s')}], "
        f"inter-node {machine.inter_node_bytes_per_s / DECIMAL_GB:.3g} GB/s "
        f"[{src('inter_node_bytes_per_s')}], host<->device "
        f"{machine.host_device_bytes_per_s / DECIMAL_GB:.3g} GB/s "
        f"[{src('host_device_bytes_per_s')}], NVMe {machine.nvme_read_bytes_per_s / DECIMAL_GB:.3g}"
        f" / {machine.nvme_write_bytes_per_s / DECIMAL_GB:.3g} GB/s read / write "
        f"[{src('nvme_read_bytes_per_s')}], CPU Adam {machine.cpu_adam_params_per_s / 1e6:.3g} M "
        f"params/s per rank [{src('cpu_adam_params_per_s')}], host time per op "
        f"{machine.op_overhead_s * 1e6:.3g} µs [{src('op_overhead_s')}], cache read "
        f"{machine.cache_read_bytes_per_s / DECIMAL_GB:.3g} GB/s per node "
        f"[{src('cache_read_bytes_per_s')}]"
    ]


def report(
    estimates: list[Estimate],
    cfg: TunerConfig,
    inv: Inventory,
    run_cfg,
    machine: Machine,
    measured: dict[str, dict] | None = None,
    scaling: dict[int, list[Estimate]] | None = None,
    calibration: dict | None = None,
    at_measurement: dict[str, float] | None = None,
    warnings: list[str] | None = None,
    as_given: list[Estimate] | None = None,
    data: list[str] | None = None,
) -> str:
    nodes = estimates[0].step["nodes"] if estimates else 1
    header = HEADER + (MEASURED_HEADER if measured else [])
    at_measurement = at_measurement or {}
    rows = [row(e, machine, measured or None, at_measurement) for e in estimates]
    lines = [*headline(cfg, inv, run_cfg, machine, nodes)]
    lines += [f"warning: {w}" for w in warnings or []]
    lines += ["", *table(rows, header)]
    lines += [f"  {e.option}: does not fit: {e.why}" for e in estimates if not e.fits]
    lines += ["", "predicted step, by term (seconds):"]
    lines += [terms_line(e) for e in estimates]
    if scaling and len(scaling) > 1:
        lines += scaling_table(scaling)
    lines += ["", *conclusion(estimates, as_given, run_cfg.data.batch_size)]
    lines += data or []
    note = next((e.point["note"] for e in estimates if e.point.get("note")), None)
    note = note or batch_mismatch(run_cfg, nodes * machine.gpus_per_node)
    if note:
        lines.append(f"note: {note}")
    lines.append(figures(machine)[0])
    if calibration:
        lines.append(
            f"calibrated {calibration['date']} on {calibration['ranks']} rank(s), "
            f"{calibration['dtype']}, {calibration['samples']} samples, load average "
            f"{calibration['load_average']}, {calibration['seconds']} s"
            + ("" if calibration.get("nvme_measured") else "; NVMe not measured")
        )
    if measured:
        lines.append(
            "measured here: estimate covers device + host bytes of one rank "
            "(on a CPU-only machine both live in the same RAM); measured step s = the median "
            f"of {cfg.measure_steps} steps, the slowest rank's; pred/meas = "
            + (
                "the prediction from the calibration samples taken between that option's "
                "steps over the measured step"
                if at_measurement
                else "the prediction over the measured step"
            )
        )
    return "\n".join(lines)
