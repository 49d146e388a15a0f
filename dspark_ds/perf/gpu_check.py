"""`dspark-ds gpu-check`: a self-check of one GPU node in a few minutes, nothing downloaded.

    dspark-ds gpu-check                         # one GPU: the parts below, PASS / FAIL each
    dspark-ds gpu-check --device cpu            # every part on the CPU, a small shape (CI)

Parts, in order (each prints one PASS / FAIL line; a summary line ends the run; the exit
code is 1 if any part failed):

1. bench   `dspark-ds bench` at the Qwen3-8B DSpark shape (H 4096, 5 draft layers,
           32 / 8 heads, intermediate 12288, 5 taps, V 151 936, S 4096, A 512, γ 7, Markov
           r 256, B 1, bf16): the default training path (flex attention, chunked loss) and
           the reference layout (dense / reference), each in its own process. Passes when
           both run and agree on the first step's loss; the GPU targets (step time
           and working memory vs dense / reference, FLOP/s vs a same-process bf16 matmul)
           are printed beside it, met or not.
2. train   `torchrun --nproc_per_node 1 -m dspark_ds.cli train`: a tiny random Qwen3 target
           written with save_pretrained, ZeRO-3, bf16, DeepSpeed's default optimizer
           (FusedAdam on a GPU), 20 steps with a checkpoint and validation on the way.
           Passes when it exits 0 with 20 finite losses that fall.
3. export  `dspark-ds export` of the ZeRO-3 checkpoint: equal to the drafter the run
           exported from its live weights.
4. decode  greedy speculative decoding with the exported drafter against the target on a few
           prompts: equal, token for token, to Hugging Face's greedy `generate`.
5. vllm    only where vLLM is importable (this Python, `$DSPARK_DS_VLLM_PYTHON`, or the
           environment `tools/install.sh` makes; docs/serving.md): the export through vLLM's
           own config validation and weight loader (`dspark-ds serve-check`), and on a GPU a
           vLLM engine with it (`method: dspark`, the V2 model runner) decoding the prompts
           greedily, equal to `generate` token for token, with vLLM's τ. On a CPU the run is
           left out (vLLM's V2 runner needs Triton and a GPU).

Everything is written under a fresh `<output_dir>/gpu_check_<time>/` (target, run, export,
bench JSON, the logs of the subprocesses).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from dspark_ds import logs
from dspark_ds.cost.inventory import KNOWN_TARGETS
from dspark_ds.distributed import free_port
from dspark_ds.drafters import load_draft_model
from dspark_ds.drafters.presets import DEFAULT_PRESET, DrafterSizes
from dspark_ds.errors import ConfigError, require_at_least_one
from dspark_ds.perf.train_bench import TrainBenchConfig, run_train_bench
from dspark_ds.serve import check as serve_check
from dspark_ds.target import TargetPathConfig

TARGET_WIDTHS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
"""The bench's widths, named as a target's config names them."""


def _bench_shape(widths, *, target_layers, seq_len, dtype, drafter):
    """A `TrainBenchConfig`'s fields: the target's widths and a DSpark drafter of γ 7 (`drafter`:
    its layers, anchors and Markov rank)."""
    sizes = DrafterSizes.with_block(DEFAULT_PRESET, block_size=7, **drafter)
    return dict(
        widths,
        num_target_layers=target_layers,
        seq_len=seq_len,
        sizes=sizes,
        batch_size=1,
        dtype=dtype,
    )


# Qwen3-8B: the widths of its public config (the tuner's KNOWN_TARGETS), a DSpark drafter of 5
QWEN3_8B_SHAPE = _bench_shape(
    {k: KNOWN_TARGETS["Qwen/Qwen3-8B"][k] for k in TARGET_WIDTHS},
    target_layers=5,
    seq_len=4096,
    dtype="bfloat16",
    drafter=dict(num_draft_layers=5, num_anchors=512, markov_rank=256),
)
# a shape any CPU runs in seconds (widths in TARGET_WIDTHS' order)
SMALL_SHAPE = _bench_shape(
    dict(zip(TARGET_WIDTHS, (64, 4, 2, 128, 2000))),
    target_layers=3,
    seq_len=256,
    dtype="float32",
    drafter=dict(num_draft_layers=2, num_anchors=32, markov_rank=16),
)
SHAPES = {"qwen3-8b": QWEN3_8B_SHAPE, "small": SMALL_SHAPE}
# the targets on one H200-class GPU (docs/performance.md; reported, not part of PASS / FAIL)
TARGET_STEP_VS_REFERENCE = 0.75
TARGET_WORKING_VS_REFERENCE = 0.5
TARGET_MATMUL_FRACTION = 0.45
TARGET_VOCAB = 512  # the tiny target of the train / export / decode parts


@dataclass
class GpuCheckConfig:
    """One-GPU self-check: bench, ZeRO-3 bf16 training through the CLI, export, lossless
    greedy decoding; one PASS / FAIL line per part."""

    device: str = "cuda"
    """cuda (this node's first visible GPU) or cpu (every part on the CPU: fp32, gloo)."""
    shape: str = "auto"
    """Bench shape: qwen3-8b, small, or auto (qwen3-8b on cuda, small on cpu)."""
    output_dir: str = "gpu_check"
    """Each run writes a fresh gpu_check_<time>/ folder under this one."""
    bench_variants: list[str] = field(default_factory=list)
    """Bench variants; empty = the default training path of the device (flex/chunked on
    CUDA, blockwise/chunked on CPU) and dense/reference. E.g. add flex/chunked/layers to
    time perf.compile=layers."""
    bench_repeats: int = 3
    """Timed bench steps per variant (after one warm-up step, which compiles)."""
    train_steps: int = 20
    """Optimizer steps of the training part."""
    num_prompts: int = 4
    """Prompts of the decoding part."""
    max_new_tokens: int = 32
    """Tokens generated per prompt."""

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ConfigError(f"device: cuda or cpu, got {self.device!r}")
        if self.shape not in ("auto", *SHAPES):
            raise ConfigError(f"shape: auto or one of {sorted(SHAPES)}, got {self.shape!r}")
        require_at_least_one(
            self, ("bench_repeats", "train_steps", "num_prompts", "max_new_tokens")
        )
        if self.train_steps < 4:
            raise ConfigError(
                f"train_steps: at least 4 (the check compares the first and last 2), got {self.train_steps}"
            )

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


@dataclass
class PartResult:
    name: str
    ok: bool
    detail: str
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


# ---- the parts -----------------------------------------------------------------------------
def part_bench(cfg: GpuCheckConfig, work: Path) -> PartResult:

    shape = SHAPES[cfg.shape if cfg.shape != "auto" else ("qwen3-8b" if cfg.cuda else "small")]
    default = "flex/chunked" if cfg.cuda else "blockwise/chunked"
    bench_cfg = TrainBenchConfig(
        **shape, device=cfg.device, repeats=cfg.bench_repeats, json=str(work / "bench.json")
    )
    variants = cfg.bench_variants or [default, bench_cfg.reference_variant]
    bench_cfg = dataclasses.replace(bench_cfg, variants=variants)
    results = run_train_bench(bench_cfg)
    failed = [r for r in results if "error" in r]
    if failed:
        return PartResult("bench", False, f"{failed[0]['variant']}: {failed[0]['error'][:200]}")
    losses = [r["loss_first_step"] for r in results]
    tol = 2e-2 if shape["dtype"] == "bfloat16" else 1e-4
    if max(losses) - min(losses) > tol * max(abs(x) for x in losses):
        return PartResult("bench", False, f"the variants disagree on the first loss: {losses}")
    main = results[0]
    detail = (
        f"{main['variant']}: {main['step_time_s']:.3f} s/step, peak "
        f"{main['peak_memory_bytes'] / 2**30:.1f} GiB (working "
        f"{main['working_memory_bytes'] / 2**30:.1f} GiB), "
        f"{main['achieved_flops_ratio']:.0%} of a same-process {shape['dtype']} matmul"
    )
    notes = []
    if cfg.cuda and "step_time_vs_reference" in main:
        step = main["step_time_vs_reference"]
        working = main["working_memory_vs_reference"]
        flops = main["achieved_flops_ratio"]
        for label, value, limit, lower in (
            ("step time vs dense/reference", step, TARGET_STEP_VS_REFERENCE, True),
            ("working memory vs dense/reference", working, TARGET_WORKING_VS_REFERENCE, True),
            ("achieved / matmul FLOP/s", flops, TARGET_MATMUL_FRACTION, False),
        ):
            met = value <= limit if lower else value >= limit
            sign = "<=" if lower else ">="
            notes.append(
                f"target {label} {sign} {limit}: {value:.2f} ({'met' if met else 'not met'})"
            )
    return PartResult("bench", True, detail, notes=notes)


def write_tiny_target(path: Path) -> Path:
    """A random tiny Qwen3 causal LM (fp32 on disk), the training part's target."""
    # lazy: transformers' Qwen3 model, 2.7 s of import
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=TARGET_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,  # the smallest head vLLM's CPU attention takes (the vllm part)
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def _env(cfg: GpuCheckConfig) -> dict:
    env = dict(os.environ)
    if not cfg.cuda:
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _run(argv: list[str], cfg: GpuCheckConfig, log: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, env=_env(cfg), capture_output=True, text=True)
    log.write_text(
        f"$ {' '.join(argv)}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    )
    return proc


def _tail(proc: subprocess.CompletedProcess, log: Path) -> str:
    lines = [x for x in (proc.stderr or proc.stdout).strip().splitlines() if x.strip()]
    return f"exit {proc.returncode}: {lines[-1][:200] if lines else ''} (log: {log})"


def trainer_optimizer(stdout: str) -> str:
    """The optimizer a `dspark-ds train` run names in its first status line ("[train] dspark:
    ZeRO-3, loss recompute, optimizer FusedAdam, world size 1", after the time and rank every
    status line starts with); "?" when no line names one."""
    marker = ", optimizer "
    for line in stdout.splitlines():
        body = logs.strip_prefix(line)
        if body.startswith("[train]") and marker in body:
            return body.split(marker, 1)[1].split(",")[0]
    return "?"


def part_train(cfg: GpuCheckConfig, work: Path, target: Path) -> PartResult:

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny_cpu.yaml"
    bf16 = cfg.cuda
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1"]
    torchrun += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    flags = {
        "--config": str(recipe),
        "--name": "train",
        "--output_dir": str(work / "runs"),
        "--target.path": str(target),
        "--target.device": cfg.device,
        "--target.dtype": "bfloat16" if bf16 else "float32",
        "--train.precision": "bf16" if bf16 else "fp32",
        "--deepspeed.config": "zero3",
        "--train.max_steps": str(cfg.train_steps),
        "--checkpoint.every_steps": str(max(cfg.train_steps // 2, 1)),
        "--model.mask_token_id": str(TARGET_VOCAB - 1),
        "--train.progress_bar": "false",
        "--tracking.enabled": "false",
    }
    argv = [*torchrun, "-m", "dspark_ds.cli", "train", *(s for kv in flags.items() for s in kv)]
    log = work / "train.log"
    proc = _run(argv, cfg, log)
    if proc.returncode != 0:
        return PartResult("train", False, _tail(proc, log))
    rows = [
        json.loads(x)
        for x in (work / "runs" / "train" / "train_log.jsonl").read_text().splitlines()
    ]
    losses = [row["loss"] for row in rows]
    if len(losses) != cfg.train_steps or not all(math.isfinite(x) for x in losses):
        return PartResult("train", False, f"{len(losses)} steps logged, losses {losses}")
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    optimizer = trainer_optimizer(proc.stdout)
    detail = (
        f"ZeRO-3 {'bf16' if bf16 else 'fp32'}, optimizer {optimizer}, {len(losses)} steps, "
        f"loss {first:.3f} -> {last:.3f}"
    )
    if cfg.cuda and optimizer != "FusedAdam":
        return PartResult("train", False, detail + " (expected DeepSpeed's FusedAdam)")
    if not last < first:
        return PartResult("train", False, detail + " (the loss did not fall)")
    return PartResult("train", True, detail)


def part_export(cfg: GpuCheckConfig, work: Path) -> PartResult:
    run_dir, out = work / "runs" / "train", work / "export"
    argv = [sys.executable, "-m", "dspark_ds.cli", "export"]
    argv += ["--checkpoint", str(run_dir), "--output_dir", str(out)]
    log = work / "export.log"
    proc = _run(argv, cfg, log)
    if proc.returncode != 0:
        return PartResult("export", False, _tail(proc, log))
    live = load_file(run_dir / "export" / "model.safetensors")
    got = load_file(out / "model.safetensors")
    differ = sorted(k for k in live if k not in got or not bool((live[k] == got[k]).all()))
    if differ or live.keys() != got.keys():
        return PartResult("export", False, f"differs from the run's live export: {differ[:5]}")
    return PartResult("export", True, f"{len(got)} tensors, equal to the run's live export")


def part_decode(cfg: GpuCheckConfig, work: Path, target_dir: Path) -> PartResult:
    # lazy: transformers, 0.9 s of import
    from transformers import AutoModelForCausalLM

    # lazy: dspark_ds.eval loads transformers, 0.6 s of `gpu-check --help`
    from dspark_ds.eval import speculative_generate

    device = torch.device("cuda" if cfg.cuda else "cpu")
    # NOTE: fp32: lossless means equal to the target's own greedy decoding, which bf16 would
    # make depend on the batch shape of each target forward (near-ties flip)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    drafter = load_draft_model(work / "export").to(device=device, dtype=torch.float32).eval()
    equal, committed, rounds = 0, 0, 0
    for i in range(cfg.num_prompts):
        g = torch.Generator().manual_seed(i)
        prompt = torch.randint(0, TARGET_VOCAB - 1, (1, 12), generator=g).to(device)
        n = cfg.max_new_tokens
        with torch.no_grad():
            out, stats = speculative_generate(target, drafter, prompt, max_new_tokens=n)
            ref = _greedy(target, prompt, n)
        equal += out.tolist() == ref.tolist()
        committed += sum(stats.committed_per_round)
        rounds += stats.rounds
    detail = (
        f"{equal}/{cfg.num_prompts} prompts equal to greedy generate on {device.type}, "
        f"τ {committed / max(rounds, 1):.2f}"
    )
    return PartResult("decode", equal == cfg.num_prompts, detail)


def _greedy(target, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """The target's own greedy continuation of exactly n tokens (no stop token), the reference
    a lossless decode must equal."""
    return target.generate(
        prompt,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )


def part_vllm(cfg: GpuCheckConfig, work: Path, target_dir: Path) -> PartResult:
    # lazy: transformers, 0.9 s of import
    from transformers import AutoModelForCausalLM

    check = serve_check.ServeCheckConfig(
        drafter=str(work / "export"),
        target=TargetPathConfig(path=str(target_dir)),
        generate=cfg.cuda,
        device=cfg.device,
        num_prompts=cfg.num_prompts,
        max_new_tokens=cfg.max_new_tokens,
    )
    result = serve_check.run_serve_check(check)
    load = result["load"]
    detail = (
        f"vLLM {load['vllm_version']}: config valid, {load['model_class'].rsplit('.', 1)[1]} "
        f"took all {load['tensors']} tensors"
    )
    if not cfg.cuda:
        return PartResult("vllm", True, detail + "; the DSpark run needs a GPU (V2 runner)")
    device = torch.device("cuda")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device)
    equal = 0
    for prompt, got in zip(result["prompts"], result["generate"]["outputs"]):
        ids = torch.tensor([prompt], device=device)
        n = cfg.max_new_tokens
        with torch.no_grad():
            ref = _greedy(target, ids, n)
        equal += ref[0, ids.shape[1] :].tolist() == got
    counters = result["generate"]["counters"]
    drafts = counters.get("vllm:spec_decode_num_drafts") or 0
    tau = 1 + (counters.get("vllm:spec_decode_num_accepted_tokens") or 0) / max(drafts, 1)
    detail += (
        f"; DSpark in vLLM: {equal}/{len(result['prompts'])} prompts equal to greedy generate, "
        f"τ {tau:.2f} over {drafts} drafts"
    )
    return PartResult("vllm", equal == len(result["prompts"]) and drafts > 0, detail)


# ---- the driver ----------------------------------------------------------------------------
def run_gpu_check(cfg: GpuCheckConfig) -> list[PartResult]:
    """`dspark-ds gpu-check`: prints one line per part and a summary; exit 1 if any failed."""
    if cfg.cuda and not torch.cuda.is_available():
        raise ConfigError("device: cuda, but torch sees no GPU here (use --device cpu)")
    work = Path(cfg.output_dir) / time.strftime("gpu_check_%Y%m%d_%H%M%S")
    work.mkdir(parents=True, exist_ok=False)
    name = torch.cuda.get_device_name() if cfg.cuda else "cpu"
    print(f"[gpu-check] {name}, torch {torch.__version__}, writing {work}", flush=True)
    t_start = time.perf_counter()
    results: list[PartResult] = []
    target_dir = work / "target"

    def attempt(label: str, fn, *args) -> PartResult:
        t0 = time.perf_counter()
        try:
            res = fn(*args)
        except Exception as err:  # noqa: BLE001 - a failed part is a FAIL line, not a crash
            res = PartResult(label, False, f"{type(err).__name__}: {err}")
        res.seconds = time.perf_counter() - t0
        return res

    parts = [
        ("bench", part_bench, "the training step: default path and dense/reference"),
        ("train", part_train, f"torchrun, ZeRO-3, {cfg.train_steps} steps of a tiny target"),
        ("export", part_export, "dspark-ds export of the ZeRO-3 checkpoint"),
        ("decode", part_decode, "greedy speculative decoding vs generate"),
    ]

    if serve_check.vllm_python() is not None:
        parts.append(("vllm", part_vllm, "the export in vLLM (its loader; a DSpark run on a GPU)"))
    else:
        print("[gpu-check] vLLM is not importable here: no vllm part (docs/serving.md)")
    for i, (label, fn, what) in enumerate(parts, 1):
        print(f"[gpu-check] {i}/{len(parts)} {label}: {what} ...", flush=True)
        if label == "train":
            write_tiny_target(target_dir)
            res = attempt(label, fn, cfg, work, target_dir)
        elif label in ("export", "decode", "vllm") and not results[2 if label == "vllm" else -1].ok:
            failed = results[2 if label == "vllm" else -1].name
            res = PartResult(label, False, f"skipped: {failed} failed")
        elif label in ("decode", "vllm"):
            res = attempt(label, fn, cfg, work, target_dir)
        else:
            res = attempt(label, fn, cfg, work)
        results.append(res)
        print(f"{'PASS' if res.ok else 'FAIL'}  {res.name:<7}{res.seconds:7.1f} s  {res.detail}")
        for note in res.notes:
            print(f"      {note}")
        sys.stdout.flush()
    passed = sum(r.ok for r in results)
    total_s = time.perf_counter() - t_start
    print(
        f"gpu-check: {passed}/{len(results)} parts passed in {total_s:.0f} s on {name} "
        f"({'PASS' if passed == len(results) else 'FAIL'}; details under {work})",
        flush=True,
    )
    (work / "summary.json").write_text(
        json.dumps([r.__dict__ for r in results] + [{"total_s": total_s, "device": name}], indent=1)
    )
    if passed != len(results):
        raise SystemExit(1)
    return results
