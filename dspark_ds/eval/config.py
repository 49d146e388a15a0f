"""`dspark-ds eval` configuration: real speculative decoding of benchmark prompts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from dspark_ds.config import TrackingConfig
from dspark_ds.distributed import DistributedConfig
from dspark_ds.errors import ConfigError
from dspark_ds.eval.benchmarks import DEFAULT_BENCHMARKS, PAPER_SEED
from dspark_ds.target import TargetPathConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class CalibrationConfig:
    """Confidence-head calibration and sequential temperature scaling (STS)."""

    num_bins: int = 20
    """Equal-width bins for ECE and the reliability diagram."""
    thresholds: list[float] = field(
        default_factory=lambda: [0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    )
    """Confidence thresholds replayed in the threshold sweep."""
    fit_sts: bool = True
    """Fit one temperature per draft position (left to right, minimising the ECE of the
    cumulative confidence) on the fit split and report ECE / AUROC / Brier before and after."""
    fit_fraction: float = 0.5
    """Share of each benchmark's prompts (the first ones) used to fit STS; the rest measure it."""
    write_to_drafter: bool = False
    """Also store the fitted temperatures as `confidence_temperatures` in the drafter's
    config.json (atomically; other keys untouched), so later decoding applies them before the
    threshold. Off by default: evaluation never modifies the drafter it reads unless asked. They
    are always written to <output_dir>/<name>/confidence_temperatures.json."""

    def validate(self, prefix: str = "calibration") -> None:
        if self.num_bins < 2:
            raise ConfigError(f"{prefix}.num_bins must be >= 2, got {self.num_bins}")
        if not 0.0 < self.fit_fraction < 1.0:
            raise ConfigError(f"{prefix}.fit_fraction must be in (0, 1), got {self.fit_fraction}")
        if any(not 0.0 <= t <= 1.0 for t in self.thresholds):
            raise ConfigError(f"{prefix}.thresholds must lie in [0, 1], got {self.thresholds}")


@dataclass
class SchedulerConfig:
    """The paper's hardware-aware prefix scheduler (Algorithm 1) for batched evaluation."""

    enabled: bool = False
    """Choose each row's verification length with the scheduler instead of the static
    confidence_threshold: admit drafts across the batch in descending prefix survival while the
    expected throughput (R + Σ survival) · SPS rises. Needs a drafter with a confidence head."""
    context_tokens: int = 512
    """Cached positions per row while the steps-per-second table SPS(R, L) of the target is
    profiled (once, at start, on this machine)."""
    repeats: int = 3
    """Timed forwards per SPS(R, L) entry (the median counts; one more warms up)."""
    compare: bool = False
    """Also decode every benchmark with full-γ verification and with the static threshold
    `compare_threshold`, and report the three throughputs side by side."""
    compare_threshold: float = 0.5
    """The static confidence threshold of the comparison."""

    def validate(self, prefix: str = "scheduler") -> None:
        if self.context_tokens < 1 or self.repeats < 1:
            raise ConfigError(
                f"{prefix}.context_tokens and {prefix}.repeats must be >= 1, got "
                f"{self.context_tokens} / {self.repeats}"
            )
        if not 0.0 <= self.compare_threshold <= 1.0:
            raise ConfigError(
                f"{prefix}.compare_threshold must be in [0, 1], got {self.compare_threshold}"
            )


@dataclass
class EngineConfig:
    """A running vLLM server (OpenAI-compatible) serving the target with this drafter: the
    evaluation sends it the same prompts and compares its speculative-decoding counters with
    ours (docs/serving.md#parity)."""

    url: str | None = None
    """Base URL, http://host:port (or .../v1); None = no engine parity check."""
    model: str | None = None
    """Model name sent with every request; None = the only one the server lists."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the server's API key (`vllm serve --api-key`), sent as
    `Authorization: Bearer`; only this name is ever stored, never the key."""
    tolerance: float = 0.0
    """Largest gap allowed between the engine's and our acceptance at any draft position (the
    share of rounds that accepted it) and in τ, relative; greedy float32 is exact (0)."""
    timeout_s: float = 600.0
    """Longest wait for one answer."""

    def validate(self, prefix: str = "engine") -> None:
        if self.url is None:
            return
        if not str(self.url).startswith(("http://", "https://")):
            raise ConfigError(f"{prefix}.url: {self.url!r} is not an http:// or https:// URL")
        if self.tolerance < 0:
            raise ConfigError(f"{prefix}.tolerance must be >= 0, got {self.tolerance}")
        if self.timeout_s <= 0:
            raise ConfigError(f"{prefix}.timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class EvalConfig:
    """Speculative decoding of benchmark prompts with a drafter against its target (docs/evaluation.md)."""

    target: TargetPathConfig = field(default_factory=TargetPathConfig)
    """The target model (target.path: local directory or Hugging Face hub id of a causal LM)."""
    drafter: str = ""
    """Drafter interchange directory (config.json + model.safetensors), ours or DeepSpec's."""
    tokenizer: str | None = None
    """Tokenizer for the chat template; None = the target's."""
    benchmarks: list[str] = field(default_factory=lambda: list(DEFAULT_BENCHMARKS))
    """Benchmark names: `<data_dir>/<name>.jsonl` files in the {"turns": [...]} layout."""
    data_dir: str | None = None
    """Folder of the benchmark jsonl files; None = the copies shipped with the package."""
    max_samples: int | None = None
    """Prompts per benchmark (a seeded random subset); None = the paper's evaluation sizes
    (gsm8k 500, math500 500, aime25 30, humaneval 164, mbpp 256, livecodebench 500, mt-bench 80,
    alpaca 500, arena-hard-v2 500; every row of other benchmarks)."""
    max_new_tokens: int = 2048
    """Generation budget per prompt (the paper's: 2048)."""
    budget_accounting: Literal["exact", "reference", "engine"] = "exact"
    """exact: never verify past the budget (the last round's proposal is cut to the tokens left).
    reference: as the reference's evaluation, proposals are never cut for the budget; rounds run
    until the output is longer than max_new_tokens, the output is trimmed, and every round counts
    in τ (use it to compare τ with the paper's tables). engine: as vLLM's scheduler, proposals are
    never cut and rounds run while the output is shorter than max_new_tokens (what
    `engine.url`'s parity check uses)."""
    temperature: float = 1.0
    """Sampling temperature; 0 = greedy. The paper's Table 1 reports T = 1."""
    draft_temperature: float | None = None
    """What the drafter samples its drafts at when temperature > 0: None = the request's
    temperature (the paper's rule, vLLM's `draft_sample_method: probabilistic`); 0 = its argmax,
    verified as a one-hot proposal (vLLM's default, `draft_sample_method: greedy`); another
    value = softmax(logits / it). Lossless at every value; it moves τ (docs/evaluation.md)."""
    confidence_threshold: float = 0.0
    """Cut each proposal at the first slot whose confidence is below this; 0 = never cut.
    Calibration and the threshold sweep need 0 (uncut proposals)."""
    chat_template_kwargs: dict = field(default_factory=lambda: {"enable_thinking": False})
    """Extra arguments of tokenizer.apply_chat_template (Qwen3: non-thinking, as in training)."""
    seed: int = PAPER_SEED
    """Seeds the prompt subset and each prompt's sampling generator (seed + prompt index);
    the default is the reference's evaluation seed."""
    dtype: str = "auto"
    """Compute dtype of target and drafter: auto (bfloat16 on CUDA, float32 on CPU) | float32 |
    bfloat16 | float16."""
    device: str | None = None
    """Device; None = cuda:LOCAL_RANK when CUDA is available, else cpu."""
    attn_implementation: str | None = None
    """Attention kernel of the target (passed to from_pretrained: sdpa | eager |
    flash_attention_2); None = transformers' choice for the family (sdpa where it has it, else
    eager: DeepSeek-V4, gpt-oss)."""
    batch_size: int = 1
    """Prompts in flight per rank. 1 = the batch-1 loop (the reference's setting). N > 1 =
    batched speculative decoding (finished prompts are replaced from the queue); the target alone
    is then always decoded too, at the same batch size, for the wall-clock speedup."""
    measure_baseline: bool = False
    """Also decode every prompt with the target alone to report tokens/s speedup (always on
    with batch_size > 1)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """The paper's confidence scheduler (batched evaluation)."""
    name: str = "eval"
    """Run name: results go to <output_dir>/<name>; also the default MLflow run name."""
    output_dir: str = "runs"
    """Parent directory of runs (as for `train`: the default MLflow store
    sqlite:///<output_dir>/mlflow.db then holds training and evaluation runs side by side)."""
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    """Confidence calibration / STS options."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """A vLLM server serving the target with this drafter: its own speculative-decoding
    counters beside ours on the same prompts (the parity check)."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """MLflow tracking, the same section as `train`'s (rank 0 only)."""
    distributed: DistributedConfig = field(
        default_factory=lambda: DistributedConfig(timeout_s=1800)
    )
    """Network interface and timeout of the ranks (each decodes its share of the prompts; the
    timeout also bounds how long one that finished waits for the slowest)."""

    @property
    def run_dir(self) -> str:
        return os.path.join(self.output_dir, self.name)

    def validate(self) -> None:
        """Raise ConfigError naming the dotted option."""
        if not self.target.path:
            raise ConfigError("target.path: is required (a directory or hub id of the target)")
        if not self.drafter:
            raise ConfigError("eval.drafter is required (a drafter interchange directory)")
        if not self.benchmarks:
            raise ConfigError("eval.benchmarks is empty")
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(f"eval.max_samples must be >= 1 or null, got {self.max_samples}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"eval.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.budget_accounting not in ("exact", "reference", "engine"):
            raise ConfigError(
                "eval.budget_accounting must be exact | reference | engine, got "
                f"{self.budget_accounting!r}"
            )
        if self.temperature < 0:
            raise ConfigError(f"eval.temperature must be >= 0, got {self.temperature}")
        if self.draft_temperature is not None and self.draft_temperature < 0:
            raise ConfigError(
                f"eval.draft_temperature must be >= 0 or null, got {self.draft_temperature}"
            )
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise ConfigError(
                f"eval.confidence_threshold must be in [0, 1], got {self.confidence_threshold}"
            )
        if not self.name or "/" in self.name:
            raise ConfigError(f"eval.name must be a plain name, got {self.name!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"eval.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.batch_size < 1:
            raise ConfigError(f"eval.batch_size must be >= 1, got {self.batch_size}")
        self.scheduler.validate("eval.scheduler")
        self.calibration.validate("eval.calibration")
        self.engine.validate("engine")
        if self.engine.url is not None:
            self._validate_engine_run()

    def _validate_engine_run(self) -> None:
        """The parity check compares round by round: one prompt at a time, whole proposals,
        rounds counted as vLLM's scheduler counts them."""
        if self.batch_size != 1 or self.scheduler.enabled or self.scheduler.compare:
            raise ConfigError(
                "engine.url: the parity check decodes one prompt at a time; drop eval.batch_size"
                " / eval.scheduler"
            )
        if self.confidence_threshold > 0:
            raise ConfigError(
                "engine.url: the parity check needs whole proposals (vLLM does not cut them); "
                "set eval.confidence_threshold 0"
            )
        if self.budget_accounting == "reference":
            raise ConfigError(
                "eval.budget_accounting: reference counts one more round than vLLM at the "
                "budget; the parity check uses engine (the default with engine.url)"
            )
        self.budget_accounting = "engine"


@dataclass
class DecodeBenchConfig:
    """Wall-clock throughput of speculative decoding vs the target alone, on the same prompts."""

    target: TargetPathConfig = field(default_factory=TargetPathConfig)
    """The target model (target.path: local directory or Hugging Face hub id)."""
    drafter: str = ""
    """Drafter interchange directory."""
    tokenizer: str | None = None
    """Tokenizer for the chat template; None = the target's."""
    benchmark: str = "mt-bench"
    """Benchmark whose prompts are decoded (`<data_dir>/<name>.jsonl`)."""
    data_dir: str | None = None
    """Folder of the benchmark jsonl files; None = the packaged copies."""
    num_prompts: int = 8
    """Timed prompts (a seeded random subset)."""
    warmup_prompts: int = 1
    """Untimed prompts decoded first in both modes (CUDA kernels, allocator, caches)."""
    max_new_tokens: int = 256
    """Generation budget per prompt."""
    temperature: float = 0.0
    """Sampling temperature; 0 = greedy (then both modes produce the same tokens)."""
    confidence_threshold: float = 0.0
    """Confidence truncation threshold of the drafter; 0 = off."""
    chat_template_kwargs: dict = field(default_factory=lambda: {"enable_thinking": False})
    """Extra arguments of tokenizer.apply_chat_template."""
    seed: int = 0
    """Seeds the prompt subset and the sampling generators."""
    dtype: str = "auto"
    """auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16."""
    device: str | None = None
    """Device; None = cuda:LOCAL_RANK when CUDA is available, else cpu."""
    attn_implementation: str | None = None
    """Attention kernel of the target; None = transformers' choice for the family."""
    output_json: str | None = None
    """Also write the numbers to this JSON file."""

    def validate(self) -> None:
        if not self.target.path or not self.drafter:
            raise ConfigError("target.path and drafter are required")
        if self.num_prompts < 1 or self.warmup_prompts < 0:
            raise ConfigError(
                f"bench.num_prompts must be >= 1 and bench.warmup_prompts >= 0, got "
                f"{self.num_prompts} / {self.warmup_prompts}"
            )
        if self.max_new_tokens < 1:
            raise ConfigError(f"bench.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"bench.temperature must be >= 0, got {self.temperature}")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise ConfigError(
                f"bench.confidence_threshold must be in [0, 1], got {self.confidence_threshold}"
            )
        if self.dtype not in _DTYPES:
            raise ConfigError(f"bench.dtype must be one of {_DTYPES}, got {self.dtype!r}")
