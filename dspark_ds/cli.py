"""`dspark-ds <subcommand>`: jsonargparse over each subcommand's typed config.

    dspark-ds train --config dspark_ds/recipes/tiny_cpu.yaml --train.lr 1e-3
    dspark-ds train --config tiny_cpu --train.lr 1e-3          # a shipped recipe, by name
    dspark-ds train --config recipe.yaml --print_config        # the checked config, as YAML
    dspark-ds export --checkpoint runs/tiny --output_dir drafter/

Each subcommand is `module:ConfigClass` + `module:function(cfg)`; both are imported only when
that subcommand runs, so `dspark-ds --help` is instant and a component's subcommand appears as
soon as its module exists.

Exit codes: 2 and one line naming the dotted option for what the user must fix (a bad option, a
failed config check, any `ConfigError` raised while the subcommand runs: a path, a file, data,
a checkpoint); 1 and the full traceback for anything else (a bug); the training signals' own
codes (75 requeue, 130 Ctrl-C); 1 and one line for `TrainingStopped`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dspark_ds import __version__
from dspark_ds.errors import ConfigError, TrainingStopped

# name -> (config class, entry function, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "prepare": (
        "dspark_ds.data.config:PrepareConfig",
        "dspark_ds.data.tokens:prepare",
        "normalise and tokenise chat jsonl (loss mask = assistant tokens)",
    ),
    "regenerate": (
        "dspark_ds.data.config:RegenerateConfig",
        "dspark_ds.data.regeneration:regenerate",
        "let the target rewrite every assistant answer",
    ),
    "build-cache": (
        "dspark_ds.data.config:BuildCacheConfig",
        "dspark_ds.data.cache_writer:build_cache",
        "run the target once and store its features (offline mode)",
    ),
    "train": (
        "dspark_ds.config:TrainRunConfig",
        "dspark_ds.train.trainer:train",
        "train a drafter with DeepSpeed (ZeRO 0-3, offload), tracked in MLflow",
    ),
    "eval": (
        "dspark_ds.eval.config:EvalConfig",
        "dspark_ds.eval.runner:run_eval",
        "speculative decoding against the target: τ, calibration, plots",
    ),
    "export": (
        "dspark_ds.config:ExportConfig",
        "dspark_ds.train.export:run_export",
        "training checkpoint (any ZeRO stage) -> interchange directory",
    ),
    "demo": (
        "dspark_ds.demo.config:DemoConfig",
        "dspark_ds.demo.pipeline:run_demo",
        "the whole pipeline on CPU in minutes, nothing downloaded",
    ),
    "estimate": (
        "dspark_ds.data.config:EstimateCacheConfig",
        "dspark_ds.data.cache_writer:estimate_cache",
        "estimate the size of a target cache before building it (`estimate cache`)",
    ),
    "bench": (
        "dspark_ds.perf.train_bench:TrainBenchConfig",
        "dspark_ds.perf.train_bench:run_train_bench",
        "training-step throughput and memory of the drafter variants",
    ),
    "gpu-check": (
        "dspark_ds.perf.gpu_check:GpuCheckConfig",
        "dspark_ds.perf.gpu_check:run_gpu_check",
        "one-GPU self-check: bench, ZeRO-3 bf16 training, export, lossless decoding",
    ),
    "tune": (
        "dspark_ds.tune.config:TunerConfig",
        "dspark_ds.tune:run",
        "per-GPU memory of every ZeRO stage x offload option; which fit, which is fastest",
    ),
    "compare": (
        "dspark_ds.tracking.compare:CompareConfig",
        "dspark_ds.tracking.compare:run_compare",
        "MLflow runs side by side: differing params, final / best metrics, plots",
    ),
    "serve-check": (
        "dspark_ds.serve.check:ServeCheckConfig",
        "dspark_ds.serve.check:run_serve_check",
        "vLLM's own config validation and weight loader on a drafter directory (docs/serving.md)",
    ),
    "serve-target": (
        "dspark_ds.serve.target_server:ServeTargetConfig",
        "dspark_ds.serve.target_server:run_serve_target",
        "vLLM serving a recipe's target, writing its tapped hidden states (data.mode served)",
    ),
    "sync-tracking": (
        "dspark_ds.tracking.sync:SyncConfig",
        "dspark_ds.tracking.sync:run_sync",
        "send what a run could not deliver to MLflow (or replay its train_log.jsonl)",
    ),
    "bench-decode": (
        "dspark_ds.eval.config:DecodeBenchConfig",
        "dspark_ds.eval.decode_bench:run_decode_bench",
        "tokens/s of speculative decoding against the target alone",
    ),
}
# `dspark-ds estimate cache ...` reads as English; the word is optional.
SUBCOMMAND_WORDS = {"estimate": "cache"}


def _import(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def parse_config(name: str, argv: list[str]):
    """argv (after the subcommand) → a validated config instance of that subcommand. Raises
    ConfigError / SystemExit(2) with the option's name."""
    from dspark_ds.config import parse  # lazy: torch, 1.5 s of `dspark-ds --help`

    config_path, _, _ = SUBCOMMANDS[name]
    return parse(_import(config_path), argv, prog=f"dspark-ds {name}")


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = [
        "usage: dspark-ds <subcommand> [--config recipe.yaml | --config <shipped recipe>] "
        "[--section.option value ...]",
        "       dspark-ds --version",
        "",
        "subcommands:",
    ]
    lines += [f"  {n:<{width}}  {h}" for n, (_, _, h) in SUBCOMMANDS.items()]
    lines += ["", "`dspark-ds <subcommand> --help` lists every option with its documentation."]
    return "\n".join(lines)


def _fail(message: str) -> int:
    print(f"dspark-ds: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"dspark-ds {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        return _fail(f"unknown subcommand {name!r}; choose from {', '.join(SUBCOMMANDS)}")
    if name in SUBCOMMAND_WORDS and rest[:1] == [SUBCOMMAND_WORDS[name]]:
        rest = rest[1:]
    config_path, entry_path, _ = SUBCOMMANDS[name]
    try:
        _import(config_path)
        entry = _import(entry_path)
    except (ImportError, AttributeError) as err:
        return _fail(f"subcommand {name!r} is not available in this install ({err})")

    try:
        cfg = parse_config(name, rest)
    except SystemExit as err:  # --help / --print_config exit 0; parse errors exit 2
        return int(err.code or 0)
    except (argparse.ArgumentError, ConfigError) as err:
        return _fail(_parse_error_text(err))
    # lazy: torch, 1.5 s of `dspark-ds --help`; network.py, 16 ms of it (docs/testing.md)
    from dspark_ds.distributed import leave
    from dspark_ds.network import NetworkError
    from dspark_ds.train.signals import INTERRUPT_EXIT_CODE

    try:
        entry(cfg)
    except NetworkError as err:  # the ranks cannot reach each other: one line, no traceback
        print(f"dspark-ds: error: {_one_line(err)}", file=sys.stderr, flush=True)
        return 1
    except ConfigError as err:
        # found while the subcommand runs (a cache that does not match, a batch size that does
        # not divide, a path that does not exist, ...): one line, no traceback
        return _fail(_one_line(err))
    except TrainingStopped as err:  # raised by every rank together, after what could be saved
        print(f"dspark-ds: error: {_one_line(err)}", file=sys.stderr, flush=True)
        leave(err.exit_code, _AS_PROCESS)
        return err.exit_code
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which checkpoints first)
        print("dspark-ds: interrupted", file=sys.stderr, flush=True)
        return INTERRUPT_EXIT_CODE
    except SystemExit as err:  # the trainer's signal exits (75, 130), every rank together
        leave(int(err.code or 0), _AS_PROCESS)
        raise
    leave(0, _AS_PROCESS)
    return 0


def _one_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return "; ".join(lines) if lines else type(err).__name__


def _parse_error_text(err: Exception) -> str:
    text = str(err).strip()
    # jsonargparse wraps __post_init__ errors; the last line names the option
    lines = [line for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        for marker in ("ConfigError:", "ValueError:"):
            if marker in line:
                return line.split(marker, 1)[1].strip()
    return text


_AS_PROCESS = False
"""Set by `entry`: `main` is this process's whole program (`leave` may end it)."""


def entry(argv: list[str] | None = None) -> int:
    """The `dspark-ds` command (and `python -m dspark_ds.cli`): `main` as the process's whole
    program, which ends without the interpreter's finalization once a subcommand's work is
    done (distributed.leave)."""
    global _AS_PROCESS
    _AS_PROCESS = True
    return main(argv)


if __name__ == "__main__":
    sys.exit(entry())
