"""The typed config tree of `dspark-ds train` and `dspark-ds export`.

Every section is a small dataclass; jsonargparse turns the field docstrings into `--help` and
the field paths into dotted flags (`--train.lr 1e-4`). Sections owned by other components are
imported from next to their code (`data.DataConfig`, `target.TargetConfig`,
`drafters.presets.DrafterConfig`). Every check raises
`ConfigError` naming the dotted option; the CLI turns that into exit code 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Literal

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

from dspark_ds.data.config import DataConfig
from dspark_ds.distributed import DistributedConfig, print0
from dspark_ds.drafters.perf import PerfConfig
from dspark_ds.drafters.presets import DEFAULT_PRESET, DrafterConfig
from dspark_ds.drafters.registry import get_kind
from dspark_ds.errors import ConfigError
from dspark_ds.files import check_exists, check_model_path
from dspark_ds.target import TargetConfig, TargetPathConfig


@dataclass
class TrainConfig:
    """Optimisation: AdamW (or Muon for the weight matrices) with fp32 master weights, linear
    warmup then cosine decay."""

    lr: float = 6e-4
    """Peak learning rate."""
    warmup_ratio: float = 0.04
    """Fraction of the optimizer steps spent in linear warmup."""
    min_lr_ratio: float = 0.0
    """The cosine ends at lr × min_lr_ratio."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW for every trained weight. muon: Muon (momentum orthogonalised by
    Newton-Schulz, DeepSpeed's, partition-aware under ZeRO-1/2/3) for the draft layers' weight
    matrices and the feature projection, AdamW (lr, betas, eps, weight_decay) for the rest:
    norms, biases, vectors and vocabulary-sized matrices (docs/training.md#muon)."""
    muon_lr: float | None = None
    """Muon's peak learning rate; None = train.lr. Each matrix's step is scaled to AdamW's
    update RMS (0.2 × √max(rows, cols), torch's `match_rms_adamw`), so an AdamW rate carries
    over."""
    muon_momentum: float = 0.95
    """Muon's (Nesterov) momentum."""
    muon_weight_decay: float = 0.1
    """Muon's decoupled weight decay (the weights shrink by lr × muon_weight_decay a step)."""
    muon_shard_ns: bool = True
    """ZeRO-0 in fp32 on several ranks: each weight matrix's Muon update (its Newton-Schulz
    iteration) is computed on one rank and broadcast, so a rank does 1/N of that work instead
    of all of it; the same step bit for bit (engine/optimizer.py). false: every rank computes
    every update, as DeepSpeed's step does. ZeRO-1/2/3 and bf16 split the work themselves."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (DeepSpeed `gradient_clipping`); 0 = off."""
    precision: Literal["bf16", "fp32"] = "bf16"
    """Compute dtype of the drafter; master weights and optimizer states stay fp32."""
    global_batch_size: int = 512
    """Sequences per optimizer step over all ranks; gradient accumulation = global /
    (data.batch_size × world size), which must divide exactly."""
    num_epochs: int = 10
    """Passes over the training data."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (also sets the schedule length); None = epochs."""
    seed: int = 42
    """Seed of the drafter init, anchor sampling and synthetic data."""
    log_every: int = 10
    """Log losses and throughput every this many optimizer steps."""
    synthetic_samples: int = 0
    """> 0: train on this many random token sequences of length data.max_length whose
    features the target computes online, instead of data.paths (smoke tests, ZeRO tuning)."""
    progress_bar: bool = True
    """Show a tqdm bar on rank 0 when stdout is a terminal; otherwise (and with false) rank 0
    prints a plain progress line every log_every steps (Slurm logs)."""
    peak_tflops: float | None = None
    """One GPU's peak matmul TFLOP/s in the compute dtype, for `system/mfu` (achieved model
    FLOP/s over it); None = the datasheet's dense bf16 figure of a known GPU (H100 / H200 SXM)
    under bf16, else no MFU (`system/tflops_per_gpu` is logged either way)."""
    max_nonfinite_in_row: int = 3
    """A step whose loss is NaN or inf on any rank is skipped (no update; counted in
    train/nonfinite_steps); this many such steps in a row stop the run (exit 1) with a
    checkpoint of the last finite weights."""

    def validate(self, prefix: str = "train") -> None:
        _require(self.lr > 0, f"{prefix}.lr", "must be > 0", self)
        _require(0 <= self.warmup_ratio < 1, f"{prefix}.warmup_ratio", "must be in [0, 1)", self)
        _require(0 <= self.min_lr_ratio <= 1, f"{prefix}.min_lr_ratio", "must be in [0, 1]", self)
        _require(self.weight_decay >= 0, f"{prefix}.weight_decay", "must be >= 0", self)
        if self.muon_lr is not None:
            _require(self.muon_lr > 0, f"{prefix}.muon_lr", "must be > 0", self)
        _require(0 <= self.muon_momentum < 1, f"{prefix}.muon_momentum", "must be in [0, 1)", self)
        _require(self.muon_weight_decay >= 0, f"{prefix}.muon_weight_decay", "must be >= 0", self)
        _require(self.max_grad_norm >= 0, f"{prefix}.max_grad_norm", "must be >= 0", self)
        _require(self.global_batch_size >= 1, f"{prefix}.global_batch_size", "must be >= 1", self)
        _require(self.num_epochs >= 1, f"{prefix}.num_epochs", "must be >= 1", self)
        if self.max_steps is not None:
            _require(self.max_steps >= 1, f"{prefix}.max_steps", "must be >= 1", self)
        _require(self.log_every >= 1, f"{prefix}.log_every", "must be >= 1", self)
        if self.peak_tflops is not None:
            _require(self.peak_tflops > 0, f"{prefix}.peak_tflops", "must be > 0", self)
        _require(self.synthetic_samples >= 0, f"{prefix}.synthetic_samples", "must be >= 0", self)
        _require(
            self.max_nonfinite_in_row >= 1, f"{prefix}.max_nonfinite_in_row", "must be >= 1", self
        )


@dataclass
class DeepSpeedConfig:
    """The DeepSpeed engine: a JSON from ds_configs/ plus the run's own values."""

    config: str = "zero2"
    """Name of a shipped JSON (zero0 | zero1 | zero2 | zero3 | zero3_offload_cpu |
    zero3_offload_nvme) or a path to your own. Keys set to "auto" are filled from the run
    (batch sizes, clipping, precision, optimizer); explicit values must agree with the run."""
    overrides: dict | None = None
    """Extra keys merged into the JSON last, e.g. {"zero_optimization": {"offload_param":
    {"nvme_path": "/local"}}}."""
    zero_init: bool | None = None
    """Build the drafter inside deepspeed.zero.Init so no rank holds it whole; None = on
    under ZeRO-3."""
    torch_adam: bool | None = None
    """Use torch.optim.AdamW instead of DeepSpeed's fused / CPU Adam; None = on when there is
    no GPU and the optimizer is not offloaded."""
    backend: str | None = None
    """torch.distributed backend; None = nccl on GPU, gloo on CPU."""


@dataclass
class TrackingConfig:
    """MLflow tracking (rank 0 sends; docs/tracking.md)."""

    enabled: bool = True
    """Log to MLflow."""
    uri: str | None = None
    """Tracking URI (http://server:5000, databricks, ...); None = $MLFLOW_TRACKING_URI, else
    sqlite:///<output_dir>/mlflow.db."""
    experiment: str | None = None
    """MLflow experiment name; None = $MLFLOW_EXPERIMENT_NAME, else dspark-ds."""
    run_name: str | None = None
    """MLflow run name; None = the run's `name`."""
    tags: dict[str, str] = field(default_factory=dict)
    """Extra tags for the run."""
    parent_run_id: str | None = None
    """Nest this run under that MLflow run (the demo sets it for its stages); a nested run never
    reads $MLFLOW_RUN_ID."""
    register_as: str | None = None
    """Register the exported drafter as a new version of this MLflow registered model."""
    timeout_s: float = 10.0
    """One request's timeout; a request that fails is retried in the background, never by the
    training step."""
    flush_timeout_s: float = 60.0
    """How long the end of a run waits for MLflow to take what is still queued; the rest is
    kept in <run_dir>/mlflow_undelivered.json for `dspark-ds sync-tracking`."""
    max_queued_values: int = 200_000
    """Metric values kept in memory while the server does not answer; past it the oldest log
    steps are dropped from memory and read back from train_log.jsonl when it answers."""
    system_metrics: bool = True
    """Per node (one monitor on each node's local rank 0): CPU, host memory and, with a GPU,
    utilisation, memory and power (nvidia-ml-py), as system/node<k>/* on log steps."""
    system_interval_s: float = 1.0
    """Seconds between two samples of the node monitor (each log step logs their mean)."""

    def validate(self, prefix: str = "tracking") -> None:
        if self.timeout_s <= 0 or self.flush_timeout_s < 0 or self.system_interval_s <= 0:
            raise ConfigError(
                f"{prefix}.timeout_s and {prefix}.system_interval_s must be > 0 and "
                f"{prefix}.flush_timeout_s >= 0"
            )
        if self.max_queued_values < 1000:
            raise ConfigError(f"{prefix}.max_queued_values must be >= 1000 (one batch)")


@dataclass
class CheckpointConfig:
    """DeepSpeed checkpoints under <output_dir>/<name>/checkpoints."""

    every_steps: int = 1000
    """Save every this many optimizer steps (0 = only at the end and on signals)."""
    keep_last: int = 3
    """Keep the newest K checkpoints; older ones are deleted after a successful save."""
    resume: str | None = None
    """auto = continue from the newest checkpoint of this run if any; a path = that checkpoint
    (a tag directory); None = start fresh (refuses to overwrite existing checkpoints)."""
    save_final: bool = True
    """Save a checkpoint when training ends."""
    export_final: bool = True
    """Export the final weights to <run>/export (interchange format, docs/checkpoint-format.md)."""
    verify: Literal["auto", "size", "sha256"] = "auto"
    """How a checkpoint is checked before a resume loads it, against the sizes and sha256 that
    every rank recorded for its files at save: "size" (presence and size of every file),
    "sha256" (also the contents; the ranks split the hashing), "auto" (sha256 when the
    checkpoint holds at most 4 GiB per rank, sizes only above). A damaged checkpoint is skipped
    for the newest one that passes, with a line saying which and why."""


@dataclass
class ValidationConfig:
    """Periodic validation on held-out data during training (loss terms and τ)."""

    every_steps: int = 0
    """Validate every this many optimizer steps (0 = only at the end)."""
    num_batches: int = 8
    """Micro-batches per rank per validation."""
    paths: list[str] = field(default_factory=list)
    """Held-out chat jsonl files (same format as data.paths); empty with synthetic data = a
    disjoint synthetic set; empty otherwise = no validation."""
    cache_dir: str | None = None
    """Held-out offline target cache (data.mode offline)."""

    def validate(self, prefix: str = "validation") -> None:
        _require(self.every_steps >= 0, f"{prefix}.every_steps", "must be >= 0", self)
        _require(self.num_batches >= 1, f"{prefix}.num_batches", "must be >= 1", self)


@dataclass
class TrainRunConfig:
    """`dspark-ds train`: everything one training run needs."""

    name: str = DEFAULT_PRESET
    """Run name: the directory <output_dir>/<name> and the default MLflow run name (default:
    the name of the default `model` section's drafter)."""
    output_dir: str = "runs"
    """Parent directory of runs (also holds the default MLflow store)."""
    model: DrafterConfig = field(default_factory=DrafterConfig)
    """Drafter architecture and loss."""
    target: TargetConfig = field(default_factory=TargetConfig)
    """The frozen target (its config shapes the drafter; its embedding and lm_head are shared)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data (data.batch_size is the micro-batch per rank)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    """ZeRO stage, offload, engine details."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """MLflow."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence, retention and resume."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """Periodic validation on held-out data."""
    perf: PerfConfig = field(default_factory=PerfConfig)
    """How the step computes attention and the loss (same results, different cost)."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """How the ranks reach each other: network interface, rendezvous and collective timeout."""

    @property
    def run_dir(self) -> str:
        return os.path.join(self.output_dir, self.name)

    def validate(self) -> TrainRunConfig:
        """Cross-field checks; raises ConfigError naming the dotted option."""
        _require(bool(self.name) and "/" not in self.name, "name", "must be a plain name", self)
        _require(bool(self.target.path), "target.path", "is required", self)
        self.model.validate()

        get_kind(self.model.kind).train.check_perf(
            self.perf
        )  # a perf option the kind cannot honour
        self.train.validate()
        self.validation.validate()
        self.tracking.validate()
        _require(self.checkpoint.every_steps >= 0, "checkpoint.every_steps", "must be >= 0", self)
        _require(self.checkpoint.keep_last >= 1, "checkpoint.keep_last", "must be >= 1", self)
        if self.train.synthetic_samples == 0 and self.data.mode != "offline":
            _require(
                bool(self.data.paths),
                "data.paths",
                "is empty: give chat jsonl files, an offline data.cache_dir, or "
                "train.synthetic_samples > 0",
                self,
            )
        if self.train.synthetic_samples == 0:
            self.data.check_served_storage()
        if self.train.synthetic_samples:
            _require(
                self.train.synthetic_samples >= self.train.global_batch_size,
                "train.synthetic_samples",
                f"must be >= train.global_batch_size ({self.train.global_batch_size})",
                self,
            )

        if get_kind(self.model.kind).capabilities.anchor_blocks:
            self._warn_block_shapes()
        return self

    def _warn_block_shapes(self) -> None:
        """Settings that run but waste the step: said once, on rank 0, not refused."""
        m, length = self.model, self.data.max_length
        candidates = length - 1  # anchor p needs p and p+1 supervised (docs/algorithm.md#anchors)
        if m.num_anchors > candidates:
            warn(
                f"model.num_anchors {m.num_anchors} exceeds the {candidates} anchor positions a "
                f"data.max_length {length} sequence has: at least {m.num_anchors - candidates} "
                "blocks per sequence are dummies that cost compute and train nothing"
            )
        if m.block_size > length // 2:
            warn(
                f"model.block_size {m.block_size} is more than half of data.max_length {length}: "
                "most blocks run past the end of their sequence, where their slots have no label"
            )

    def check_paths(self) -> TrainRunConfig:
        """The files and directories the run reads exist; ConfigError naming the option.

        Separate from `validate()` (which `--print_config` runs too): a recipe names paths of the
        cluster it is meant for. A local-looking target path is checked here, before
        transformers would spend ~25 s asking the hub for it."""
        check_model_path(self.target.path, "target.path")
        check_model_path(self.data.tokenizer, "data.tokenizer")
        if self.train.synthetic_samples == 0 and self.data.mode != "offline":
            for i, path in enumerate(self.data.paths):
                check_exists(path, f"data.paths[{i}]")
                if os.path.isfile(path) and os.path.getsize(path) == 0:
                    raise ConfigError(f"data.paths[{i}]: {path} is empty")
        if self.data.mode == "offline" and self.train.synthetic_samples == 0:
            check_exists(self.data.cache_dir, "data.cache_dir", "cache directory")
        for i, path in enumerate(self.validation.paths):
            check_exists(path, f"validation.paths[{i}]")
        if self.validation.cache_dir:
            check_exists(self.validation.cache_dir, "validation.cache_dir", "cache directory")
        if self.model.init_from:
            check_exists(self.model.init_from, "model.init_from", "drafter directory")
        if self.checkpoint.resume not in (None, "auto"):
            check_exists(self.checkpoint.resume, "checkpoint.resume", "checkpoint")
        return self


@dataclass
class ExportConfig:
    """`dspark-ds export`: a training checkpoint (any ZeRO stage) → interchange directory."""

    checkpoint: str = ""
    """A run directory, its checkpoints/ directory (uses `latest`), or one tag directory."""
    output_dir: str = ""
    """Directory to write config.json + model.safetensors."""
    target: TargetPathConfig = field(default_factory=TargetPathConfig)
    """Where to read the shared embedding and lm_head (target.path); None = the target of the
    saved run."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Storage dtype of the exported weights."""
    format: Literal["native", "speculators"] = "native"
    """native: the format the engines load for the drafter's kind and layout
    (docs/checkpoint-format.md); speculators: speculators 0.9's directory (its config.json and
    weight names; the verifier is the target), which speculators and vLLM load
    (docs/checkpoint-format.md#the-speculators-format)."""
    overwrite: bool = False
    """Write into a non-empty output_dir: replace its config.json and weights (other files are
    kept). Without it a non-empty output_dir is refused."""

    def validate(self) -> ExportConfig:
        _require(bool(self.checkpoint), "checkpoint", "is required", self)
        _require(bool(self.output_dir), "output_dir", "is required", self)
        return self


_WARNED: set[str] = set()


def warn(message: str) -> None:
    """A config warning on stderr, once per process, on rank 0 only."""
    if message not in _WARNED:
        _WARNED.add(message)
        print0(f"dspark-ds: warning: {message}", file=sys.stderr)


def _require(ok: bool, option: str, why: str, section) -> None:
    if not ok:
        value = _lookup(section, option.rsplit(".", 1)[-1])
        shown = "" if value is _MISSING else f", got {value!r}"
        raise ConfigError(f"{option}: {why}{shown}")


_MISSING = object()


def _lookup(section, name: str):
    return getattr(section, name, _MISSING) if is_dataclass(section) else _MISSING


def flatten(obj, prefix: str = "") -> dict[str, object]:
    """A dataclass tree as {"train.lr": 0.0006, ...} (MLflow params, diffs between runs)."""
    out: dict[str, object] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value):
            out.update(flatten(value, key + "."))
        elif isinstance(value, dict) and value:
            for k, v in _flatten_dict(value, key + ".").items():
                out[k] = v
        else:
            out[key] = value
    return out


def _flatten_dict(d: dict, prefix: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten_dict(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---- parse / dump --------------------------------------------------------------------------
def build_parser(config_cls, prog: str):
    """A jsonargparse parser over `config_cls`: `--config recipe.yaml`, dotted flags, and the
    field docstrings as --help."""
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    doc = (config_cls.__doc__ or "").strip().splitlines()[0]
    parser = ArgumentParser(prog=prog, description=doc, exit_on_error=False)
    parser.add_argument(
        "--config",
        action=ActionConfigFile,
        help="YAML recipe; later flags override it (--train.lr 1e-4)",
    )
    parser.add_class_arguments(config_cls, nested_key=None, fail_untyped=False)
    return parser


RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
_RECIPE_NAME = re.compile(r"^[\w.-]+$")


def shipped_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def resolve_recipe(value: str) -> str:
    """A `--config` value → a file: the path itself when it exists, else the shipped recipe of
    that name (`tiny_cpu` or `tiny_cpu.yaml`). Inline YAML and other paths pass through."""
    if not _RECIPE_NAME.match(value) or Path(value).exists():
        return value
    recipe = RECIPES_DIR / f"{value.removesuffix('.yaml')}.yaml"
    if recipe.is_file():
        return str(recipe)
    raise ConfigError(
        f"--config: {value} is neither a file nor a shipped recipe ({', '.join(shipped_recipes())})"
    )


def _split_argv(argv: list[str]) -> tuple[list[str], str | None]:
    """Shipped recipes named by `--config` resolved; `--print_config[=flags]` taken out (its
    flags, "" for none, or None when absent)."""
    out, print_flags, args = [], None, iter(argv)
    for arg in args:
        if arg == "--print_config" or arg.startswith("--print_config="):
            print_flags = arg.partition("=")[2]
        elif arg == "--config":
            out += [arg, resolve_recipe(next(args, ""))]
        elif arg.startswith("--config="):
            out.append("--config=" + resolve_recipe(arg.partition("=")[2]))
        else:
            out.append(arg)
    return out, print_flags


def parse(config_cls, argv: list[str], prog: str = "dspark-ds"):
    """argv → a validated `config_cls` instance. Raises ConfigError / SystemExit(2) naming the
    option. `--print_config` prints the resolved YAML and exits (SystemExit(0)) only after
    every check has passed: a bad config never prints as if it were fine."""
    parser = build_parser(config_cls, prog)
    if hasattr(config_cls, "normalize_argv"):  # options whose text YAML would change
        argv = config_cls.normalize_argv(list(argv))
    argv, print_flags = _split_argv(argv)
    raw = parser.parse_args(argv)
    _tag_recipe(raw)
    ns = parser.instantiate(raw)
    values = {f.name: ns[f.name] for f in dataclasses.fields(config_cls) if f.name in ns}
    cfg = config_cls(**values)
    if hasattr(cfg, "validate"):
        cfg.validate()
    if print_flags is not None:
        raw.pop("config", None)
        print(parser.dump(raw, **_print_flags(print_flags)), end="")
        raise SystemExit(0)
    return cfg


def _tag_recipe(raw) -> None:
    """A run started from a recipe file carries the file's name as the tag `recipe` (unless
    tracking.tags sets one); `--print_config` prints it, so the printed recipe keeps it."""
    paths = [str(p) for p in raw.get("config") or [] if p is not None]
    if "tracking.tags" not in raw or not paths or Path(paths[-1]).suffix != ".yaml":
        return
    tags = dict(raw["tracking.tags"] or {})
    tags.setdefault("recipe", Path(paths[-1]).stem)
    raw["tracking.tags"] = tags


def _print_flags(flags: str) -> dict:
    """jsonargparse's `--print_config=flag,...` as `dump()` arguments."""
    known = {
        "skip_default": "skip_default",
        "skip_unset": "skip_unset",
        "skip_null": "skip_unset",
        "comments": "with_comments",
    }
    kwargs = {"skip_unset": False}
    for flag in filter(None, flags.split(",")):
        if flag not in known:
            raise ConfigError(
                f"--print_config: unknown flag {flag!r} (choose from {sorted(known)})"
            )
        kwargs[known[flag]] = True
    return kwargs


def to_plain(cfg) -> dict:
    """A config dataclass as plain YAML/JSON-able data."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def dump_config(cfg) -> str:
    """A config dataclass as YAML (what `--print_config` shows and checkpoints keep)."""
    return yaml.safe_dump(to_plain(cfg), sort_keys=False)
