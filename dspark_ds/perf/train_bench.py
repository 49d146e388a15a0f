"""Training-step benchmark: step time, tokens/s, peak memory (resident + working) and achieved
FLOP/s per variant, each next to the drafter kind's reference variant of the same run.

    dspark-ds bench                                    # DSpark at the default shape, 4 variants
    dspark-ds bench --sizes.dspark.num_anchors 2048 --variants '[blockwise/chunked]' --json a2048.json
    dspark-ds bench --drafter eagle3                   # Eagle3: its variants
    dspark-ds bench --device cuda --dtype bfloat16 --variants '[flex/chunked, dense/reference]'

The drafter is a preset (`--drafter`: drafters/presets.py) sized by its kind's block of `--sizes`
as the demo sizes it (`DrafterSizes`, `Preset.sized`), built for a random Qwen3 target of the
bench's widths; one step is its
kind's `train.training_step` (drafters/kind.py: what training runs, its anchors drawn in the step), its
backward and AdamW. A variant is "<attention>/<loss>[/<compile>]": an attention and a loss path of
the kind (`perf.attn_implementation`, `perf.loss_impl`; `Capabilities.attn_impls`, `loss_impls`),
compile off (default) | layers | model (perf.compile); without `--variants`, the kind's
`bench_variants`, whose first is its reference (the straight-line path the ratio columns compare
with). Each variant runs in its own subprocess (perf/bench_variant.py), so peak memory is that
variant's alone, from after the model is built and cast (CPU: the process's peak RSS, VmHWM,
reset then; CUDA: max_memory_allocated). The peak is split into what stays resident — weights, gradients and optimizer state,
counted exactly from the tensors — and the step's working memory: peak minus resident minus the
process before the model existed (CUDA: nothing; CPU: the interpreter and libraries). FLOPs are the
kind's count for the variant's paths (`DrafterKind.cost.step_flops`, the tuner's compute term: the
matmuls the paths run, so dense attention counts the masked pairs it computes and the recompute
loss its logits twice). The achieved rate is compared with a plain [n x n] matmul of the run's own
dtype timed in the same process (n = 8192 on CUDA, 2048 on CPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from dspark_ds.drafters.perf import PerfConfig
from dspark_ds.drafters.presets import (
    DEFAULT_PRESET,
    PRESET_NAMES,
    DrafterSizes,
    preset,
    sized,
)
from dspark_ds.drafters.registry import get_kind
from dspark_ds.errors import ConfigError
from dspark_ds.tracking.store import resolve_uri
from dspark_ds.tracking.sweeps import Point, log_sweep

COMPILE_CHOICES = ("off", "layers", "model")


def parse_variant(variant: str, kind=None) -> tuple[str, str, str]:
    """ "<attention>/<loss>[/<compile>]" -> (attention, loss, compile), each a path `kind` (a
    `DrafterKind`; the default preset's when None) honours."""
    kind = kind or get_kind(preset(DEFAULT_PRESET).kind)
    attns = tuple(a for a in kind.capabilities.attn_impls if a != "auto")
    losses = tuple(a for a in kind.capabilities.loss_impls if a != "auto")
    parts = variant.split("/")
    if len(parts) == 2:
        parts.append("off")
    if (
        len(parts) != 3
        or parts[0] not in attns
        or parts[1] not in losses
        or parts[2] not in COMPILE_CHOICES
    ):
        raise ConfigError(
            f"variants: {variant!r} is not '<attention>/<loss>[/<compile>]' with attention in "
            f"{attns}, loss in {losses} ({kind.name} drafters) and compile in {COMPILE_CHOICES}"
        )
    return parts[0], parts[1], parts[2]


@dataclass
class TrainBenchConfig:
    """Benchmark one training step (forward + backward + AdamW) of a random drafter."""

    drafter: str = DEFAULT_PRESET
    """The preset benched (drafters/presets.py: dspark | dflash | eagle3), sized by its kind's
    block of `sizes` as the demo sizes it; its kind says which variants exist."""
    sizes: DrafterSizes = field(default_factory=DrafterSizes)
    """The drafter's sizes: the block of its kind (`--sizes.<kind>.<size>`: DSpark / DFlash
    num_draft_layers 2, block_size 7, num_anchors the preset's 512, markov_rank 64; Eagle3
    num_draft_layers 1, ttt_length 7)."""
    hidden_size: int = 256
    """Hidden size of the drafter (and of the synthetic target)."""
    num_attention_heads: int = 4
    """Query heads (head_dim = hidden_size / num_attention_heads)."""
    num_key_value_heads: int = 2
    """Key/value heads (GQA)."""
    intermediate_size: int = 768
    """MLP width."""
    num_target_layers: int = 5
    """Tapped target layers, so the context projection is (n·H -> H)."""
    vocab_size: int = 32000
    """Vocabulary size V."""
    draft_vocab_size: int = 0
    """The drafter's reduced draft vocabulary N (`model.draft_vocab_size`: an N-row head); 0 =
    the whole vocabulary."""
    seq_len: int = 2048
    """Sequence length S."""
    batch_size: int = 1
    """Sequences per step."""
    dtype: str = "float32"
    """float32 | bfloat16."""
    device: str = "cpu"
    """cpu | cuda."""
    variants: list[str] | None = None
    """Variants "<attention>/<loss>[/<compile>]" to run side by side; None = the drafter kind's
    (`Capabilities.bench_variants`: DSpark's dense/reference, blockwise/reference, dense/chunked,
    blockwise/chunked). The ratio columns compare with the kind's reference variant (the first
    of its own) when it runs."""
    loss_chunk_anchors: int | str = "auto"
    """Anchors per chunk of the chunked loss ("auto": perf.loss_chunk_anchors's device
    default, 32 on CPU and 256 on CUDA)."""
    matmul_size: int | None = None
    """n of the [n x n] matmul the achieved FLOP/s is compared with (None: 8192 on CUDA, 2048
    on CPU)."""
    warmup_steps: int = 1
    """Untimed steps first (allocator, optimizer state)."""
    repeats: int = 3
    """Timed steps; the step time is their median."""
    num_threads: int = 2
    """torch.set_num_threads in each variant's process (0 = leave torch's default)."""
    json: str | None = None
    """Write one JSON object per variant to this file (a JSON list)."""
    seed: int = 0
    """Seed of the weights, the batch and the anchors (the same for every variant)."""
    tracking_uri: str | None = None
    """Log the bench to MLflow (a parent run of kind bench, a child run per variant) at this
    URI; None = $MLFLOW_TRACKING_URI when set, else not logged."""
    tracking_experiment: str | None = None
    """MLflow experiment; None = $MLFLOW_EXPERIMENT_NAME, else dspark-ds."""

    def __post_init__(self) -> None:
        if self.drafter not in PRESET_NAMES:
            raise ConfigError(f"drafter: one of {PRESET_NAMES}, got {self.drafter!r}")
        self.sizes.validate("sizes")
        kind = self.kind
        if self.variants is None:
            self.variants = list(kind.capabilities.bench_variants)
        for v in self.variants:
            parse_variant(v, kind)
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("num_attention_heads: must divide hidden_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_key_value_heads: must divide num_attention_heads")
        if self.seq_len < 2:
            raise ConfigError(f"seq_len: must be >= 2, got {self.seq_len}")
        if self.repeats < 1:
            raise ConfigError(f"repeats: must be >= 1, got {self.repeats}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype: float32 or bfloat16, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device: cpu or cuda, got {self.device!r}")
        try:
            self.chunk_anchors  # noqa: B018 - validates loss_chunk_anchors
        except ValueError as err:
            raise ConfigError(str(err).replace("perf.", "", 1)) from None

    @property
    def model(self):
        """The benched drafter's `model` section: the preset, sized (ConfigError naming the
        field)."""
        model = sized(self.drafter, self.sizes.block(self.drafter))
        model = replace(model, draft_vocab_size=self.draft_vocab_size or None)
        return model.validate(prefix=None)

    @property
    def kind(self):
        """The benched drafter's `DrafterKind`."""
        return get_kind(preset(self.drafter).kind)

    @property
    def reference_variant(self) -> str:
        """The kind's reference variant: the ratio columns compare every variant with it."""
        return self.kind.capabilities.bench_variants[0]

    def perf(self, variant: str):
        """The `perf` section of a variant (its attention, loss and compile)."""
        attn, loss, compile_mode = parse_variant(variant, self.kind)
        return PerfConfig(
            loss_impl=loss,
            attn_implementation=attn,
            compile=compile_mode,
            loss_chunk_anchors=self.loss_chunk_anchors,
        )

    @property
    def chunk_anchors(self) -> int:
        """loss_chunk_anchors with "auto" resolved for the device."""
        return PerfConfig(loss_chunk_anchors=self.loss_chunk_anchors).chunk_anchors(self.device)

    @property
    def matmul_n(self) -> int:
        if self.matmul_size is not None:
            return self.matmul_size
        return 8192 if self.device.startswith("cuda") else 2048


# ---- the driver ---------------------------------------------------------------------------
def run_train_bench(cfg: TrainBenchConfig) -> list[dict]:
    """Runs every variant in a fresh subprocess, prints the table, writes --json."""
    results = []
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(cfg.num_threads or os.cpu_count()))
    for variant in tqdm(cfg.variants, desc="bench variants", unit="variant"):
        child_cfg = dataclasses.replace(cfg, variants=[variant], json=None)
        proc = subprocess.run(
            [sys.executable, "-m", "dspark_ds.perf.bench_variant", "--_child"],
            input=json.dumps(dataclasses.asdict(child_cfg)),
            capture_output=True,
            text=True,
            env=env,
        )
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-5:]
            # An out-of-memory kill (-9) is a result too: the variant does not fit.
            results.append(
                {"variant": variant, "error": " | ".join(tail) or f"rc {proc.returncode}"}
            )
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    add_reference_ratios(results, cfg.reference_variant)
    text = format_table(cfg, results)
    print(text)
    if cfg.json:
        Path(cfg.json).write_text(json.dumps(results, indent=2) + "\n")
    if cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"):
        log_bench(cfg, results, text)
    return results


def log_bench(cfg: TrainBenchConfig, results: list[dict], text: str) -> str | None:
    """The bench as MLflow runs: a parent (kind bench, the shape as params, the table) and a
    child per variant (its numbers as metrics, a failed variant's error as a tag)."""
    shape = {
        k: v
        for k, v in dataclasses.asdict(cfg).items()
        if k not in ("sizes", "variants", "json", "tracking_uri", "tracking_experiment")
    }
    # the benched drafter's sizes, as the preset sized them
    shape.update(
        {k: getattr(cfg.model, k) for k in dataclasses.asdict(cfg.sizes.block(cfg.drafter))}
    )
    points = [
        Point(
            name=r["variant"],
            params={"variant": r["variant"]},
            tags={"variant": r["variant"], "error": r.get("error")},
            metrics={
                k: float(v)
                for k, v in r.items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            },
        )
        for r in results
    ]
    uri = resolve_uri(cfg.tracking_uri, ".")
    # a local store's folder keeps the runs' files and artifacts; a server keeps its own
    store = Path(uri.removeprefix("sqlite:///")).parent if uri.startswith("sqlite:///") else None
    where = store / "bench" if store else Path(tempfile.mkdtemp(prefix="dspark_bench_"))
    return log_sweep(
        kind="bench",
        name=f"bench-{cfg.device}-{cfg.dtype}",
        uri=uri,
        experiment=cfg.tracking_experiment,
        run_dir=where / time.strftime("%Y%m%d-%H%M%S"),
        artifact_location=((store or where) / "mlartifacts").resolve().as_uri(),
        tags={"device": cfg.device, "dtype": cfg.dtype},
        params=shape,
        text={"bench.txt": text},
        points=points,
    )


def add_reference_ratios(results: list[dict], reference: str) -> None:
    """Each variant's step time, working memory and peak as a ratio to the `reference`
    variant's in the same run (when it ran and did not fail)."""
    ref = next((r for r in results if r["variant"] == reference and "error" not in r), None)
    if ref is None:
        return
    for r in results:
        if "error" in r:
            continue
        r["step_time_vs_reference"] = r["step_time_s"] / ref["step_time_s"]
        r["working_memory_vs_reference"] = r["working_memory_bytes"] / max(
            ref["working_memory_bytes"], 1
        )
        r["peak_memory_vs_reference"] = r["peak_memory_bytes"] / ref["peak_memory_bytes"]


def format_table(cfg: TrainBenchConfig, results: list[dict]) -> str:
    shape = (
        f"{cfg.kind.report.describe(cfg.model)}; H={cfg.hidden_size} V={cfg.vocab_size}"
        + (f" draft V={cfg.draft_vocab_size} " if cfg.draft_vocab_size else " ")
        + f"S={cfg.seq_len} B={cfg.batch_size} {cfg.dtype} {cfg.device} "
        f"threads={cfg.num_threads} chunk={cfg.chunk_anchors} matmul={cfg.dtype}[{cfg.matmul_n}]"
    )
    head = (
        f"{'variant':<24}{'step s':>9}{'cpu s':>8}{'tokens/s':>10}{'peak MB':>10}{'step MB':>9}"
        f"{'resid MB':>10}{'work MB':>9}{'GFLOP/s':>10}{'matmul':>9}{'ratio':>7}"
        f"{'t/ref':>7}{'work/ref':>9}{'loss':>10}"
    )
    lines = [shape, head, "-" * len(head)]

    def ratio(r: dict, key: str) -> str:
        return f"{r[key]:.2f}" if key in r else "-"

    for r in results:
        if "error" in r:
            lines.append(f"{r['variant']:<24}  FAILED: {r['error'][:120]}")
            continue
        lines.append(
            f"{r['variant']:<24}{r['step_time_s']:>9.3f}{r['step_cpu_time_s']:>8.2f}"
            f"{r['tokens_per_s']:>10.0f}"
            f"{r['peak_memory_bytes'] / 2**20:>10.0f}{r['step_peak_memory_bytes'] / 2**20:>9.0f}"
            f"{r['resident_bytes'] / 2**20:>10.0f}{r['working_memory_bytes'] / 2**20:>9.0f}"
            f"{r['achieved_flops'] / 1e9:>10.1f}"
            f"{r['matmul_flops'] / 1e9:>9.1f}{r['achieved_flops_ratio']:>7.2f}"
            f"{ratio(r, 'step_time_vs_reference'):>7}{ratio(r, 'working_memory_vs_reference'):>9}"
            f"{r['loss_first_step']:>10.5f}"
        )
    lines.append(
        "peak = resident (weights + grads + optimizer state) + working + the process before the "
        f"model; t/ref, work/ref: step time and working memory / {cfg.reference_variant}'s"
    )
    return "\n".join(lines)
