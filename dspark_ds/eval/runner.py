"""`dspark-ds eval`: decode benchmark prompts with the drafter, report τ and calibration.

Ranks (torchrun / srun) split each benchmark's prompts round-robin; rank 0 gathers the
per-prompt stats, prints the table, writes results and logs them to MLflow.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dspark_ds import distributed
from dspark_ds.config import flatten
from dspark_ds.drafters import load_draft_model
from dspark_ds.drafters.io import draft_config_dict
from dspark_ds.drafters.registry import kind_of
from dspark_ds.drafters.serving import parity_suspects
from dspark_ds.errors import ConfigError
from dspark_ds.eval import batched, report
from dspark_ds.eval import calibration as cal
from dspark_ds.eval.batched import policy_summary
from dspark_ds.eval.benchmarks import (
    benchmark_path,
    encode_prompt,
    load_benchmark,
    num_prompts,
    select_prompts,
    shard,
)
from dspark_ds.eval.config import EvalConfig
from dspark_ds.eval.decoding import speculative_generate, target_generate
from dspark_ds.eval.policy import profile_sps
from dspark_ds.eval.rounds import DecodeStats, run_settings, sync
from dspark_ds.files import check_exists, check_model_path, first_line
from dspark_ds.serve.parity import EngineRun, compare, format_parity, our_counters
from dspark_ds.target import TargetConfig, load_causal_lm
from dspark_ds.tracking.mlflow import Tracker
from dspark_ds.tracking.store import (
    default_artifact_location,
    git_sha,
    read_export_record,
    resolve_uri,
    run_exists,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class PromptResult:
    """What one rank sends to rank 0 for one prompt."""

    benchmark: str
    index: int
    """Position of the prompt in the benchmark's selected subset."""
    stats: DecodeStats
    baseline_time_s: float | None = None
    baseline_new_tokens: int | None = None
    """Tokens the target alone generated (batched runs; at T > 0 they differ from `stats`')."""
    policies: dict | None = None
    """Batched runs with scheduler.compare: policy name -> `batched.PromptRun`."""
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None
    """The prompt's token ids and our generated ones (kept for the engine parity check)."""


def _resolve_device(cfg: EvalConfig) -> torch.device:
    return torch.device(cfg.device) if cfg.device else distributed.local_device()


def _resolve_dtype(cfg: EvalConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[cfg.dtype]


def stop_token_ids(target, tokenizer) -> list[int]:
    """The target's end-of-turn ids: generation_config.eos_token_id, else the tokenizer's."""
    gen = getattr(target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return sorted({int(e) for e in ([eos] if isinstance(eos, int) else eos)})


def load_models(cfg: EvalConfig, device: torch.device):
    """Target (HF causal LM), drafter (interchange directory) and tokenizer."""
    # lazy: transformers, 0.9 s of import
    from transformers import AutoTokenizer

    check_model_path(cfg.target.path, "target.path")
    check_model_path(cfg.tokenizer, "eval.tokenizer")
    check_exists(cfg.drafter, "eval.drafter", "drafter directory")
    dtype = _resolve_dtype(cfg, device)
    dtype_name = next(name for name, d in _DTYPES.items() if d == dtype)
    target_cfg = TargetConfig(
        path=cfg.target.path, dtype=dtype_name, attn_implementation=cfg.attn_implementation
    )
    try:
        target = load_causal_lm(target_cfg).to(device).eval()
    except OSError as err:  # not found, not a model, no connection: one line, exit 2
        raise ConfigError(
            f"target.path: cannot load a model from {cfg.target.path!r} ({first_line(err)})"
        ) from None
    # a published checkpoint (DFlash, vLLM's Eagle3) may leave its embedding and lm_head, and
    # its target's layer count, to the target
    shared = (target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    drafter = load_draft_model(
        cfg.drafter, dtype=dtype, device=device, target_config=target.config, shared_weights=shared
    )
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.target.path)
    return target, drafter, tokenizer


def decode_benchmarks(cfg: EvalConfig, target, drafter, tokenizer, device) -> list[PromptResult]:
    """This rank's share of every benchmark, decoded one prompt at a time (one seeded
    generator per prompt), or `cfg.batch_size` at a time (`_decode_batched`)."""
    stops = stop_token_ids(target, tokenizer)
    if cfg.batch_size > 1 or cfg.scheduler.enabled or cfg.scheduler.compare:
        return _decode_batched(cfg, target, drafter, tokenizer, stops)
    rank = distributed.rank_and_world()[0]
    results: list[PromptResult] = []
    for b, name in enumerate(cfg.benchmarks):
        mine = _my_prompts(cfg, name)
        for index, turns in tqdm(mine, desc=f"eval {name}", disable=rank != 0, unit="prompt"):
            input_ids = encode_prompt(tokenizer, turns, cfg.chat_template_kwargs).to(device)
            seed = cfg.seed + 1_000_003 * b + index
            out, stats, baseline_s = _decode_prompt(cfg, target, drafter, input_ids, seed, stops)
            result = PromptResult(name, index, stats, baseline_s)
            if cfg.engine.url is not None:
                result.prompt_ids = input_ids[0].tolist()
                result.output_ids = out[0, input_ids.shape[1] :].tolist()
            results.append(result)
    return results


def _my_prompts(cfg: EvalConfig, name: str) -> list[tuple[int, list[str]]]:
    """This rank's (index, turns) of a benchmark's selected prompts."""
    rows = select_prompts(
        load_benchmark(benchmark_path(name, cfg.data_dir)),
        num_prompts(name, cfg.max_samples),
        cfg.seed,
    )
    return shard(rows, *distributed.rank_and_world())


def _decode_prompt(cfg: EvalConfig, target, drafter, input_ids, seed: int, stops: list[int]):
    """One prompt at batch 1: (the output ids, its stats, the target alone's seconds when
    measured)."""
    device = input_ids.device
    out, stats = speculative_generate(
        target,
        drafter,
        input_ids,
        confidence_threshold=cfg.confidence_threshold,
        budget_accounting=cfg.budget_accounting,
        draft_temperature=cfg.draft_temperature,
        **run_settings(cfg, stops, device, seed),
    )
    if not cfg.measure_baseline:
        return out, stats, None
    t0 = time.perf_counter()
    target_generate(target, input_ids, **run_settings(cfg, stops, device, seed))
    sync(device)
    return out, stats, time.perf_counter() - t0


def _scheduler_sps(cfg: EvalConfig, target, drafter):
    """The scheduler's cost table SPS(rows, tokens), profiled on this machine (None when no
    run uses the scheduler)."""
    if not (cfg.scheduler.enabled or cfg.scheduler.compare):
        return None
    decode = kind_of(drafter).decode
    if not decode.has_confidence(drafter.config):
        raise ConfigError(
            "eval.scheduler needs a drafter with a confidence head; this one "
            f"({drafter.config.architectures[0]}) has none"
        )
    table = profile_sps(
        target,
        max_rows=cfg.batch_size,
        max_tokens=decode.tokens_per_round(drafter.config) + 1,
        context_tokens=cfg.scheduler.context_tokens,
        layer_ids=[int(i) for i in drafter.config.target_layer_ids],
        repeats=cfg.scheduler.repeats,
        progress=distributed.rank_and_world()[0] == 0,
    )
    return lambda rows, length: table[(rows, length)]


def _decode_batched(cfg: EvalConfig, target, drafter, tokenizer, stops) -> list[PromptResult]:
    """`decode_benchmarks` with `cfg.batch_size` prompts in flight (eval/batched.py)."""
    rank = distributed.rank_and_world()[0]
    sps = _scheduler_sps(cfg, target, drafter)
    results: list[PromptResult] = []
    for b, name in enumerate(cfg.benchmarks):
        mine = _my_prompts(cfg, name)
        if not mine:
            continue
        distributed.print0(f"[eval] {name}: {len(mine)} prompts, batch {cfg.batch_size}")
        prompts = [encode_prompt(tokenizer, turns, cfg.chat_template_kwargs) for _, turns in mine]
        main, baseline, policies = batched.decode_prompts(
            cfg, target, drafter, prompts, cfg.seed + 1_000_003 * b + rank, stops, sps
        )
        for k, (index, _) in enumerate(mine):
            results.append(
                PromptResult(
                    name,
                    index,
                    main[k],
                    baseline_time_s=baseline[k].time_s,
                    baseline_new_tokens=baseline[k].stats.new_tokens,
                    policies={p: runs[k] for p, runs in policies.items()} or None,
                )
            )
    return results


def gather_results(results: list[PromptResult]) -> list[PromptResult] | None:
    """Every rank's prompt results on rank 0 (None elsewhere)."""
    gathered = distributed.gather_object(results, dst=0)
    return None if gathered is None else [r for part in gathered for r in part]


def _records(results: list[PromptResult], block_size: int) -> cal.ConfidenceRecords:
    logits, accepted, committed = [], [], []
    for r in results:
        logits += r.stats.confidence_logits_per_round
        accepted += r.stats.accepted_per_round
        committed += r.stats.committed_per_round
    return cal.ConfidenceRecords.from_rounds(logits, accepted, committed, block_size)


def calibrate(cfg: EvalConfig, drafter, results: list[PromptResult], out_dir: Path) -> dict | None:
    """ECE / AUROC / Brier before and after STS, the threshold sweep, and their plots."""
    decode = kind_of(drafter).decode
    if not decode.has_confidence(drafter.config) or not results:
        return None
    if cfg.confidence_threshold > 0.0:
        # Truncated proposals hide the slots the head was least sure of: the labels would be
        # biased, so calibration needs uncut proposals.
        return {"skipped": "confidence_threshold > 0: calibration needs uncut proposals"}
    block_size = decode.tokens_per_round(drafter.config)
    c = cfg.calibration
    fit, held = _fit_and_held_out(cfg, results)
    held_records = _records(held, block_size)
    out: dict = {
        "raw": cal.confidence_report(held_records, None, c.num_bins),
        "split": {"fit_prompts": len(fit), "held_out_prompts": len(held)},
    }
    out["per_benchmark_raw"] = {
        name: cal.confidence_report(
            _records([r for r in results if r.benchmark == name], block_size), None, c.num_bins
        )["pooled"]
        for name in cfg.benchmarks
    }
    temps_G = cal.confidence_temperatures(drafter.config, block_size)
    curves = {"raw": out["raw"]}
    if c.fit_sts and fit:
        sts, temps_G = _fit_sts(cfg, fit, held_records, block_size, out_dir)
        out.update(sts)
        curves["STS"] = out["sts"]
    out["threshold_sweep"] = cal.threshold_sweep(
        _records(results, block_size), c.thresholds, temps_G
    )
    out["threshold_sweep_temperatures"] = temps_G.tolist() if temps_G is not None else None
    report.plot_reliability(out_dir / "reliability_diagram.png", curves)
    report.plot_threshold_sweep(out_dir / "threshold_sweep.png", out["threshold_sweep"])
    return out


def _fit_and_held_out(cfg: EvalConfig, results: list[PromptResult]):
    """The first `calibration.fit_fraction` of each benchmark's prompts, and the rest."""
    fit, held = [], []
    for name in cfg.benchmarks:
        mine = sorted((r for r in results if r.benchmark == name), key=lambda r: r.index)
        n_fit = math.ceil(cfg.calibration.fit_fraction * len(mine)) if len(mine) > 1 else 0
        fit += mine[:n_fit]
        held += mine[n_fit:]
    return fit, held


def _fit_sts(cfg: EvalConfig, fit: list[PromptResult], held, block_size: int, out_dir: Path):
    """STS temperatures fitted on the `fit` prompts and reported on the `held` records; saved
    to the output directory (and to the drafter's config.json when asked). Returns (the
    report's entries, the temperatures)."""
    c = cfg.calibration
    fit_records = _records(fit, block_size)
    temps = cal.fit_sequential_temperatures(fit_records, c.num_bins)
    temps_G = torch.tensor(temps, dtype=torch.float64)
    out = {"sts": cal.confidence_report(held, temps_G, c.num_bins)}
    report.write_json(out_dir / "confidence_temperatures.json", {cal.CONFIG_KEY: temps})
    where = f"{out_dir / 'confidence_temperatures.json'}; the drafter is unchanged"
    if c.write_to_drafter:
        try:
            out["written_to"] = str(cal.write_confidence_temperatures(cfg.drafter, temps))
            where = f"{out['written_to']}, which later decoding applies"
        except OSError as err:
            distributed.print0(
                f"[eval] WARNING: could not store STS temperatures in {cfg.drafter}: {err}"
            )
    distributed.print0(
        f"[eval] STS temperatures fitted on {len(fit)} prompt(s) "
        f"({fit_records.num_rounds} rounds) -> {where}"
    )
    return out, temps_G


def _flat_metrics(rows: list[report.BenchmarkResult], calib: dict | None) -> dict[str, float]:
    """Scalar metrics for the tracker: `<benchmark>/tau`, `<benchmark>/accept_rate@k`, ..."""
    metrics: dict[str, float] = {"average/tau": report.average_row(rows)["tau"]}
    for r in rows:
        for key in ("tau", "mean_proposal_length", "tokens_per_s", "draft_time_s", "verify_time_s"):
            metrics[f"{r.benchmark}/{key}"] = getattr(r, key)
        if r.speedup is not None:
            metrics[f"{r.benchmark}/speedup"] = r.speedup
        if r.baseline_tokens_per_s:
            metrics[f"{r.benchmark}/baseline_tokens_per_s"] = r.baseline_tokens_per_s
        for policy, p in r.extra.get("policies", {}).items():
            for key in ("tokens_per_s", "speedup", "tau"):
                metrics[f"{r.benchmark}/{policy}/{key}"] = p[key]
        for k, a in enumerate(r.accept_rate_by_position):
            if a is not None:
                metrics[f"{r.benchmark}/accept_rate@{k}"] = a
        for k, a in enumerate(r.conditional_accept_rate):
            if a is not None:
                metrics[f"{r.benchmark}/conditional_accept_rate@{k}"] = a
    for variant in ("raw", "sts"):
        if calib and variant in calib:
            for key in ("ece", "auroc", "brier"):
                metrics[f"confidence_{variant}/{key}"] = calib[variant]["pooled"][key]
                metrics[f"confidence_{variant}/conditional_{key}"] = calib[variant]["conditional"][
                    key
                ]
            for entry in calib[variant]["per_position"]:
                metrics[f"confidence_{variant}/ece@{entry['position']}"] = entry["ece"]
    return {k: float(v) for k, v in metrics.items() if v is not None and not math.isnan(float(v))}


HEADLINE = (
    "average/tau",
    "tau",
    "speedup",
    "tokens_per_s",
    "confidence_raw/auroc",
    "confidence_raw/ece",
    "confidence_sts/ece",
)
"""The figures an evaluation also logs into the training run of its drafter, as
eval/<eval name>/<figure>: "average/tau", each benchmark's τ, speedup and tokens/s, and the
confidence head's calibration."""


def headline(metrics: dict[str, float]) -> dict[str, float]:
    return {
        k: v
        for k, v in metrics.items()
        if k in HEADLINE or k.split("/")[-1] in HEADLINE[1:4] and k.count("/") == 1
    }


def log_to_tracking(
    cfg: EvalConfig, drafter, metrics: dict[str, float], run_dir: Path
) -> str | None:
    """One MLflow run per evaluation (rank 0): params, metrics, tags, the run dir as artifacts.
    When the drafter's export names the run that trained it (`mlflow_run.json`) in the same
    store, the evaluation is nested under that run, its metrics are attached to that run's
    model, and its headline figures are logged into the training run too. Returns the MLflow
    run id (None when tracking is off, or the run could not be made yet)."""
    t = cfg.tracking
    uri = resolve_uri(t.uri, cfg.output_dir)
    record = read_export_record(cfg.drafter) or {}
    trained_by = record.get("run_id")
    same_store = trained_by is not None and record.get("tracking_uri") == uri
    if trained_by and record.get("tracking_uri") is None and t.enabled:  # `dspark-ds export`'s
        same_store = run_exists(uri, trained_by)
    kind = kind_of(drafter)
    name = t.run_name or cfg.name
    tracker = Tracker(
        enabled=t.enabled,
        uri=uri,
        experiment=t.experiment,
        run_name=name,
        run_dir=str(run_dir),
        timeout_s=t.timeout_s,
        kind="eval",
        artifact_location=default_artifact_location(cfg.output_dir),
        # NOTE: an evaluation is never resumed: a rerun is a new run
        resume=False,
        parent_run_id=t.parent_run_id or (trained_by if same_store else None),
        flush_timeout_s=t.flush_timeout_s,
        tags={
            **t.tags,
            "git_sha": git_sha(),
            "drafter_kind": kind.name,
            "drafter": kind.capabilities.label,
            "target": cfg.target.path,
            "seed": cfg.seed,
            "temperature": cfg.temperature,
            "world_size": distributed.world_size(),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "drafter_architecture": drafter.config.architectures[0],
            **kind.report.tags(drafter.config),
            "trained_by": trained_by,
            "trained_by_uri": None if same_store else record.get("tracking_uri"),
        },
    )
    try:
        tracker.log_params(flatten(cfg))
        tracker.log_metrics(metrics, step=0, model_of_run=trained_by if same_store else None)
        tracker.log_artifacts(str(run_dir))
        if same_store:
            top = {f"eval/{name}/{k}": v for k, v in headline(metrics).items()}
            tracker.log_metrics(top, step=0, run_id=trained_by)
            if tracker.run_id:
                tracker.set_tags({f"eval.{name}": tracker.run_id}, run_id=trained_by)
        return tracker.run_id if tracker.enabled else None
    finally:
        tracker.finish()


def run_eval(cfg: EvalConfig) -> dict | None:
    """Entry point of `dspark-ds eval`. Returns the results payload on rank 0, None elsewhere."""
    cfg.validate()
    for name in cfg.benchmarks:  # a missing benchmark fails before the models load
        benchmark_path(name, cfg.data_dir)
    device = _resolve_device(cfg)
    engine = _start_engine(cfg)  # an unfit server fails before the models load
    # NOTE: gloo for CPU evaluation; NCCL object collectives run on the current CUDA device,
    # which init() sets to this rank's before the group exists.
    had_group = distributed.has_group()
    distributed.init(
        None if device.type == "cuda" else "gloo", always=False, settings=cfg.distributed
    )
    try:
        target, drafter, tokenizer = load_models(cfg, device)
        local = decode_benchmarks(cfg, target, drafter, tokenizer, device)
        results = gather_results(local)
        if results is None:
            return None
        parity = None
        if engine is not None:
            parity = _engine_parity(
                cfg, engine, drafter, results, stop_token_ids(target, tokenizer)
            )
        return _report(cfg, drafter, results, parity)
    finally:
        if not had_group and distributed.has_group():
            distributed.destroy()


def _start_engine(cfg: EvalConfig):
    """The engine side of the parity check (`engine.url`), checked before anything loads."""
    if cfg.engine.url is None:
        return None

    if distributed.rank_and_world()[1] > 1:
        raise ConfigError("engine.url: the parity check runs in one process (no torchrun / srun)")
    return EngineRun.start(cfg)


def _engine_parity(cfg: EvalConfig, engine, drafter, results: list[PromptResult], stops):
    """The same prompts through the server, one at a time; its counters against ours."""
    engine.decode(
        [r.prompt_ids for r in results],
        max_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        stops=stops,
    )
    data = {**draft_config_dict(drafter.config), "architectures": [drafter.architecture]}
    differ = sum(r.output_ids != out for r, out in zip(results, engine.outputs))
    return compare(
        engine.spent(),
        our_counters([r.stats for r in results]),
        prompts=len(results),
        outputs_differ=differ if cfg.temperature == 0 else 0,
        tolerance=cfg.engine.tolerance,
        suspects=parity_suspects(data),
    )


def _report(cfg: EvalConfig, drafter, results: list[PromptResult], parity=None) -> dict:
    """Rank 0: the per-benchmark rows, calibration, the printed table, the files of the run
    directory and the MLflow run; returns the results payload. A failed engine parity check
    (`parity`) is a ConfigError once everything is written."""
    out_dir = Path(cfg.run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    block_size = kind_of(drafter).decode.tokens_per_round(drafter.config)
    rows = [_benchmark_row(cfg, name, results, block_size) for name in cfg.benchmarks]
    calib = calibrate(cfg, drafter, results, out_dir)
    table = report.format_table(rows)
    policies = report.format_policy_table(rows)
    if policies:
        table += "\n\nverification policies (same batch size, same run):\n" + policies
    if parity is not None:
        table += "\n\nengine (vLLM's counters) against this evaluation, same prompts:\n"
        table += format_parity(parity)
    print(table, flush=True)
    if calib and "raw" in calib:
        print(_confidence_line(calib), flush=True)
    payload = {
        "config": json.loads(json.dumps(_config_dict(cfg), default=str)),
        "benchmarks": [report.result_dict(r) for r in rows],
        "average": report.average_row(rows),
        "calibration": calib,
    }
    if parity is not None:
        payload["engine_parity"] = parity.as_dict()
    report.write_json(out_dir / "results.json", payload)
    report.write_csv(out_dir / "results.csv", rows)
    report.plot_acceptance_by_position(out_dir / "acceptance_by_position.png", rows)
    report.plot_tau_by_benchmark(out_dir / "tau_by_benchmark.png", rows)
    (out_dir / "results.txt").write_text(table + "\n")
    metrics = _flat_metrics(rows, calib)
    if parity is not None:
        metrics.update(parity.metrics())
    payload["mlflow_run_id"] = log_to_tracking(cfg, drafter, metrics, out_dir)
    distributed.print0(f"[eval] results in {out_dir}")
    if parity is not None and not parity.ok:
        raise ConfigError(
            f"engine parity check failed ({'; '.join(parity.gaps)}); look at: "
            + " | ".join(parity.look_at)
        )
    return payload


def _benchmark_row(
    cfg: EvalConfig, name: str, results: list[PromptResult], block_size: int
) -> report.BenchmarkResult:
    """One benchmark's row: τ, acceptance, timing, the baseline and (batched) the policies."""
    mine = [r for r in results if r.benchmark == name]
    base = [r.baseline_time_s for r in mine if r.baseline_time_s is not None]
    base_tokens = [r.baseline_new_tokens for r in mine if r.baseline_new_tokens is not None]
    row = report.summarize_benchmark(
        name,
        [r.stats for r in mine],
        block_size,
        sum(base) if base else None,
        sum(base_tokens) if base_tokens else None,
    )
    row.extra["batch_size"] = cfg.batch_size
    if mine and mine[0].policies:
        row.extra["policies"] = {
            p: policy_summary([r.policies[p] for r in mine], row.baseline_tokens_per_s)
            for p in mine[0].policies
        }
    return row


def _confidence_line(calib: dict) -> str:
    """The held-out confidence metrics, raw and (when fitted) after STS, on one line."""
    line = "confidence (held-out, cumulative):"
    for variant, label in (("raw", "raw"), ("sts", "| STS")):
        if variant in calib:
            pooled = calib[variant]["pooled"]
            line += " {} ECE {:.4f} AUROC {:.4f} Brier {:.4f}".format(
                label, pooled["ece"], pooled["auroc"], pooled["brier"]
            )
    return line


def _config_dict(cfg: EvalConfig) -> dict:
    return asdict(cfg)
