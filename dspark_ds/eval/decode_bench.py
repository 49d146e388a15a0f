"""`dspark-ds bench-decode`: tokens/s of speculative decoding vs plain target decoding (one process)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dspark_ds.eval.benchmarks import benchmark_path, encode_prompt, load_benchmark, select_prompts
from dspark_ds.eval.config import DecodeBenchConfig
from dspark_ds.eval.decoding import speculative_generate, target_generate
from dspark_ds.eval.report import write_json
from dspark_ds.eval.rounds import sync
from dspark_ds.eval.runner import _resolve_device, load_models, stop_token_ids


def _timed(device: torch.device, fn, *args, **kwargs):
    sync(device)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    sync(device)
    return out, time.perf_counter() - t0


def run_decode_bench(cfg: DecodeBenchConfig) -> dict:
    """Decode the same prompts both ways; print and return tokens/s, τ and the speedup."""
    cfg.validate()
    device = _resolve_device(cfg)
    target, drafter, tokenizer = load_models(cfg, device)
    stops = stop_token_ids(target, tokenizer)
    rows = load_benchmark(benchmark_path(cfg.benchmark, cfg.data_dir))
    prompts = select_prompts(rows, cfg.warmup_prompts + cfg.num_prompts, cfg.seed)
    totals = {"target": [0, 0.0], "speculative": [0, 0.0]}
    committed = rounds = 0
    for i, turns in enumerate(prompts):
        ids = encode_prompt(tokenizer, turns, cfg.chat_template_kwargs).to(device)
        kwargs = dict(
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, stop_token_ids=stops
        )
        base, base_s = _timed(
            device,
            target_generate,
            target,
            ids,
            generator=torch.Generator(device).manual_seed(cfg.seed + i),
            **kwargs,
        )
        (spec, stats), spec_s = _timed(
            device,
            speculative_generate,
            target,
            drafter,
            ids,
            confidence_threshold=cfg.confidence_threshold,
            generator=torch.Generator(device).manual_seed(cfg.seed + i),
            **kwargs,
        )
        if i < cfg.warmup_prompts:
            continue
        totals["target"][0] += base.shape[1] - ids.shape[1]
        totals["target"][1] += base_s
        totals["speculative"][0] += spec.shape[1] - ids.shape[1]
        totals["speculative"][1] += spec_s
        committed += sum(stats.committed_per_round)
        rounds += stats.rounds
    result = {
        mode: {"tokens": n, "seconds": s, "tokens_per_s": n / s} for mode, (n, s) in totals.items()
    }
    result["tau"] = committed / rounds if rounds else float("nan")
    result["speedup"] = result["speculative"]["tokens_per_s"] / result["target"]["tokens_per_s"]
    print(
        f"[bench] {cfg.benchmark}, {cfg.num_prompts} prompts, T={cfg.temperature}: "
        f"target {result['target']['tokens_per_s']:.1f} tok/s, speculative "
        f"{result['speculative']['tokens_per_s']:.1f} tok/s (τ {result['tau']:.2f}), "
        f"speedup {result['speedup']:.2f}x",
        flush=True,
    )
    if cfg.output_json:
        write_json(Path(cfg.output_json), result)
    return result
