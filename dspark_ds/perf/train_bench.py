"""Training-step benchmark: step time, tokens/s, peak memory (resident + working) and achieved
FLOP/s per variant, each next to the drafter kind's reference variant of the same run.

    dspark-ds bench                                    # DSpark at the default shape, 4 variants
    dspark-ds bench --num_anchors 2048 --variants '[blockwise/chunked]' --json a2048.json
    dspark-ds bench --drafter eagle3                   # Eagle3: its variants
    dspark-ds bench --device cuda --dtype bfloat16 --variants '[flex/chunked, dense/reference]'

The drafter is a preset (`--drafter`: drafters/presets.py) sized by the bench's fields as the demo
sizes it (`Preset.sized`), built for a random Qwen3 target of the bench's widths; one step is its
kind's `training_step` (drafters/kind.py: what training runs, its anchors drawn in the step),
its backward and AdamW. A variant is "<attention>/<loss>[/<compile>]": an attention and a loss
path of the kind (`perf.attn_implementation`, `perf.loss_impl`; `DrafterKind.attn_impls`,
`loss_impls`), compile off (default) | layers | model (perf.compile); without `--variants`, the
kind's `bench_variants`, whose first is its reference (the straight-line path the ratio columns
compare with). Each variant runs in its own subprocess, so peak memory is that variant's alone
(CPU: the process's peak RSS, VmHWM; CUDA: max_memory_allocated after the model is built). The
peak is split into what stays resident — weights, gradients and optimizer state, counted
exactly from the tensors — and the step's working memory: peak minus resident minus the process
before the model existed (CUDA: nothing; CPU: the interpreter and libraries). FLOPs are the
kind's count for the variant's paths (`DrafterKind.step_flops`, the tuner's compute term: the
matmuls the paths run, so dense attention counts the masked pairs it computes and the recompute
loss its logits twice). The achieved rate is compared with a plain [n x n] matmul of the run's
own dtype timed in the same process (n = 8192 on CUDA, 2048 on CPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dspark_ds.drafters.presets import DEFAULT_PRESET, PRESET_NAMES
from dspark_ds.errors import ConfigError

COMPILE_CHOICES = ("off", "layers", "model")


def parse_variant(variant: str, kind=None) -> tuple[str, str, str]:
    """ "<attention>/<loss>[/<compile>]" -> (attention, loss, compile), each a path `kind` (a
    `DrafterKind`; the default preset's when None) honours."""
    from dspark_ds.drafters.presets import preset
    from dspark_ds.drafters.registry import get_kind

    kind = kind or get_kind(preset(DEFAULT_PRESET).kind)
    attns = tuple(a for a in kind.attn_impls if a != "auto")
    losses = tuple(a for a in kind.loss_impls if a != "auto")
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
    """The preset benched (drafters/presets.py: dspark | dflash | eagle3), sized by
    num_draft_layers, block_size, num_anchors, markov_rank and unrolled_layers as the demo sizes
    it; its kind says which variants exist."""
    hidden_size: int = 256
    """Hidden size of the drafter (and of the synthetic target)."""
    num_draft_layers: int = 2
    """Decoder layers of a drafter that drafts blocks in parallel (DSpark / DFlash)."""
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
    seq_len: int = 2048
    """Sequence length S."""
    num_anchors: int = 512
    """Anchors (blocks) per sequence A."""
    block_size: int = 7
    """Block size γ; an unrolled drafter's (Eagle3) training-time-test steps."""
    markov_rank: int = 64
    """DSpark's Markov rank r."""
    unrolled_layers: int = 1
    """Decoder layers of an unrolled drafter (Eagle3)."""
    batch_size: int = 1
    """Sequences per step."""
    dtype: str = "float32"
    """float32 | bfloat16."""
    device: str = "cpu"
    """cpu | cuda."""
    variants: list[str] | None = None
    """Variants "<attention>/<loss>[/<compile>]" to run side by side; None = the drafter kind's
    (`DrafterKind.bench_variants`: DSpark's dense/reference, blockwise/reference, dense/chunked,
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
        kind = self.kind
        if self.variants is None:
            self.variants = list(kind.bench_variants)
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
        from dspark_ds.drafters.presets import sized

        return sized(self.drafter, self).validate(prefix=None)

    @property
    def kind(self):
        """The benched drafter's `DrafterKind`."""
        from dspark_ds.drafters.presets import preset
        from dspark_ds.drafters.registry import get_kind

        return get_kind(preset(self.drafter).kind)

    @property
    def reference_variant(self) -> str:
        """The kind's reference variant: the ratio columns compare every variant with it."""
        return self.kind.bench_variants[0]

    def perf(self, variant: str):
        """The `perf` section of a variant (its attention, loss and compile)."""
        from dspark_ds.drafters.perf import PerfConfig

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
        from dspark_ds.drafters.perf import PerfConfig

        return PerfConfig(loss_chunk_anchors=self.loss_chunk_anchors).chunk_anchors(self.device)

    @property
    def matmul_n(self) -> int:
        if self.matmul_size is not None:
            return self.matmul_size
        return 8192 if self.device.startswith("cuda") else 2048


# ---- what runs inside one variant's process ------------------------------------------------
def target_config(cfg: TrainBenchConfig):
    """The random target the drafter is built for (a Qwen3 of the bench's widths)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_target_layers + 1,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        max_position_embeddings=max(4096, 2 * cfg.seq_len),
        tie_word_embeddings=False,
    )


def build_model(cfg: TrainBenchConfig):
    import torch

    from dspark_ds.drafters import build_draft_model

    draft_cfg = cfg.kind.build_config(
        target_config(cfg),
        cfg.model,
        target_layer_ids=list(range(cfg.num_target_layers)),
        mask_token_id=cfg.vocab_size - 1,
    )
    torch.manual_seed(cfg.seed)
    # NOTE: built on its device: a 2.3 B-parameter drafter built on the CPU and moved costs
    # ~40 s per variant on a GPU node. The fp32 build before the cast is not in the peak
    # (run_variant resets the peak statistics after it).
    with torch.device(cfg.device):
        model = build_draft_model(draft_cfg)
    model.freeze_shared()
    return model.to(dtype=getattr(torch, cfg.dtype)).train()


def build_batch(cfg: TrainBenchConfig, device: str):
    """A training batch of B random sequences: `TRAIN_KEYS` on `device` (the target's features
    in the run's dtype, as a bf16 target gives them), `sample_ids` on the host."""
    import torch

    from dspark_ds.drafters.kind import TRAIN_KEYS

    g = torch.Generator().manual_seed(cfg.seed + 1)
    B, S, H = cfg.batch_size, cfg.seq_len, cfg.hidden_size
    loss_mask = torch.ones(B, S)
    loss_mask[:, : min(16, S - 2)] = 0  # a short unsupervised prompt, like chat data
    batch = dict(
        input_ids=torch.randint(0, cfg.vocab_size - 1, (B, S), generator=g),
        loss_mask=loss_mask,
        target_hidden_states=torch.randn(B, S, cfg.num_target_layers * H, generator=g),
        target_last_hidden_states=torch.randn(B, S, H, generator=g),
    )
    dtype = getattr(torch, cfg.dtype)
    for key in ("target_hidden_states", "target_last_hidden_states"):
        batch[key] = batch[key].to(dtype)
    out = {k: batch[k].to(device) for k in TRAIN_KEYS}
    out["sample_ids"] = torch.arange(B)
    return out


def loss_args_for(cfg: TrainBenchConfig) -> dict[str, float]:
    """The loss weights of the benched section (a DSpark / DFlash section's `loss_weights`)."""
    from dataclasses import asdict

    return asdict(cfg.model.loss_weights)


def step_shape(cfg: TrainBenchConfig):
    """The `StepShape` of the bench's micro-batch (what the kind's FLOP count reads)."""
    import torch

    from dspark_ds.drafters.common.memory import StepShape

    width = torch.tensor([], dtype=getattr(torch, cfg.dtype)).element_size()
    return StepShape(
        batch=cfg.batch_size,
        seq_len=cfg.seq_len,
        hidden=cfg.hidden_size,
        intermediate=cfg.intermediate_size,
        vocab=cfg.vocab_size,
        heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        draft_layers=cfg.model.num_draft_layers,
        taps=cfg.num_target_layers,
        drafter=cfg.kind.step_part(cfg.model),
        compute_bytes=width,
        feature_bytes=width,
    )


def step_flops(cfg: TrainBenchConfig, variant: str) -> float:
    """FLOPs of one training step (forward + backward) of `variant`: the kind's count."""
    flops = cfg.kind.step_flops(step_shape(cfg), cfg.perf(variant), cfg.device, 0)
    return sum(flops.values())


def matmul_flops_per_s(device: str, dtype: str, size: int, repeats: int = 5) -> float:
    """A plain [size x size] @ [size x size] rate in `dtype`, median of `repeats`."""
    import torch

    a = torch.randn(size, size, device=device, dtype=getattr(torch, dtype))
    b = torch.randn(size, size, device=device, dtype=getattr(torch, dtype))
    times = []
    for i in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        if i:  # the first one warms up
            times.append(time.perf_counter() - t0)
    return 2.0 * size**3 / statistics.median(times)


def resident_bytes(model, optimizer) -> dict[str, int]:
    """What stays allocated across steps, counted from the tensors: weights (parameters and
    buffers), gradients, optimizer state."""
    import torch

    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    weights = sum(nbytes(p) for p in model.parameters()) + sum(nbytes(b) for b in model.buffers())
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(
        nbytes(v)
        for per_param in optimizer.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )
    return {"weights_bytes": weights, "grads_bytes": grads, "optimizer_state_bytes": state}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _rss_bytes(field_name: str) -> int:
    """VmRSS / VmHWM of this process from /proc (Linux), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def _memory_now(cuda: bool) -> int:
    import torch

    return torch.cuda.memory_allocated() if cuda else _rss_bytes("VmRSS")


def _training_step(cfg: TrainBenchConfig, variant: str):
    """The variant's drafter, batch and optimizer, and its training step (the kind's
    `training_step`, backward, AdamW) -> (model, batch, optimizer, step)."""
    import torch

    from dspark_ds.drafters.kind import StepContext

    kind, section, perf = cfg.kind, cfg.model, cfg.perf(variant)
    model = build_model(cfg)
    path = kind.prepare(model, perf, cfg.device)  # the attention, compile, the loss path
    ctx = StepContext(section, perf, path, seed=cfg.seed)
    batch = build_batch(cfg, cfg.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=6e-4, weight_decay=0.0)

    def step():
        # NOTE: gradients are cleared before the step, not after: they stay allocated between
        # steps, as a DeepSpeed engine's gradient buffers do, and count as resident.
        opt.zero_grad(set_to_none=True)
        out = kind.training_step(model, batch, ctx)
        out.loss.backward()
        opt.step()
        sums = dict(zip(out.names, out.sums.tolist()))
        return out.loss.item(), kind.metrics(sums, section)

    return model, batch, opt, step


def _timed_steps(cfg: TrainBenchConfig, step):
    """Warm-up steps, then `repeats` timed ones -> (first loss, last metrics, wall times, CPU
    times)."""
    first_loss, metrics = None, {}
    for _ in range(cfg.warmup_steps):
        first_loss, metrics = step()
    times, cpu_times = [], []
    for _ in range(cfg.repeats):
        _sync(cfg.device)
        t0, c0 = time.perf_counter(), time.process_time()
        loss, metrics = step()
        _sync(cfg.device)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        first_loss = loss if first_loss is None else first_loss
    return first_loss, metrics, times, cpu_times


def run_variant(cfg: TrainBenchConfig, variant: str) -> dict:
    """Builds, warms up and times one variant in this process."""
    import torch

    if cfg.num_threads > 0:
        torch.set_num_threads(cfg.num_threads)
    device = cfg.device
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device))
    # the process before the model: nothing on a GPU, interpreter + libraries in RSS
    baseline = _memory_now(cuda)
    model, batch, opt, step = _training_step(cfg, variant)
    matmul_rate = matmul_flops_per_s(device, cfg.dtype, cfg.matmul_n)
    if cuda:  # the peak of the steps only (not the fp32 build, not the matmul's inputs)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    # The idle process: imports, model, batch, optimizer (its state appears in step 1).
    idle = _memory_now(cuda)
    first_loss, metrics, times, cpu_times = _timed_steps(cfg, step)
    # NOTE: the peak covers warm-up and timed steps (the process high-water mark), so a
    # variant cannot look smaller because freed-but-retained heap hides its first step.
    peak = torch.cuda.max_memory_allocated() if cuda else _rss_bytes("VmHWM")
    resident = resident_bytes(model, opt)
    resident_total = sum(resident.values())
    step_time = statistics.median(times)
    flops = step_flops(cfg, variant)
    achieved = flops / step_time
    return {
        "variant": variant,
        "step_time_s": step_time,
        "step_times_s": times,
        # CPU seconds of this process per step: less sensitive than wall time to other
        # processes sharing the cores (wall time is the headline number).
        "step_cpu_time_s": statistics.median(cpu_times),
        "peak_memory_bytes": int(peak),
        "peak_memory_kind": "cuda_max_allocated" if cuda else "process_peak_rss",
        "idle_memory_bytes": int(idle),
        # What the steps add on top of the idle process (activations, logits, gradients).
        "step_peak_memory_bytes": int(peak - idle),
        "baseline_memory_bytes": int(baseline),
        **resident,
        "resident_bytes": resident_total,
        # peak minus what stays allocated (weights, gradients, optimizer state) and minus the
        # process before the model: activations, logits, the batch, transients
        "working_memory_bytes": int(peak - baseline - resident_total),
        "tokens_per_s": metrics["supervised_tokens"] / step_time,
        "supervised_tokens": metrics["supervised_tokens"],
        "flops_per_step": flops,
        "achieved_flops": achieved,
        "matmul_flops": matmul_rate,
        "matmul_size": cfg.matmul_n,
        "matmul_dtype": cfg.dtype,
        "achieved_flops_ratio": achieved / matmul_rate,
        "loss_chunk_anchors": cfg.chunk_anchors,
        "loss_first_step": first_loss,
        "num_threads": torch.get_num_threads(),
    }


# ---- the driver ---------------------------------------------------------------------------
def run_train_bench(cfg: TrainBenchConfig) -> list[dict]:
    """Runs every variant in a fresh subprocess, prints the table, writes --json."""
    from tqdm import tqdm

    results = []
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(cfg.num_threads or os.cpu_count()))
    for variant in tqdm(cfg.variants, desc="bench variants", unit="variant"):
        child_cfg = dataclasses.replace(cfg, variants=[variant], json=None)
        proc = subprocess.run(
            [sys.executable, "-m", "dspark_ds.perf.train_bench", "--_child"],
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
    import tempfile

    from dspark_ds.tracking.mlflow import resolve_uri
    from dspark_ds.tracking.sweeps import Point, log_sweep

    shape = {
        k: v
        for k, v in dataclasses.asdict(cfg).items()
        if k not in ("variants", "json", "tracking_uri", "tracking_experiment")
    }
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
        f"{cfg.kind.describe(cfg.model)}; H={cfg.hidden_size} V={cfg.vocab_size} "
        f"S={cfg.seq_len} B={cfg.batch_size} {cfg.dtype} {cfg.device} "
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


def main(argv: list[str] | None = None) -> int:
    """`python -m dspark_ds.perf.train_bench --_child`: one variant, its config as JSON on stdin, the
    result JSON on stdout (what `run_train_bench` starts per variant)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv != ["--_child"]:
        print("the benchmark runs as `dspark-ds bench` (see --help)", file=sys.stderr)
        return 2
    cfg = TrainBenchConfig(**json.loads(sys.stdin.read()))
    print(json.dumps(run_variant(cfg, cfg.variants[0])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
