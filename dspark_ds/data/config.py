"""Config sections of the data pipeline (``--data.*``) and of the data subcommands."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dspark_ds.distributed import DistributedConfig
from dspark_ds.errors import ConfigError
from dspark_ds.target import TargetConfig

CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8")
MODES = ("offline", "online", "hybrid", "served")


@dataclass
class FleetConfig:
    """A fleet of OpenAI-compatible inference servers (SGLang, vLLM, ``transformers serve``): where
    they are, and how a client routes, retries and rotates its requests among them."""

    urls: list[str] = field(default_factory=list)
    """Base URLs, ``http://host:port/v1`` (a URL without a path gets ``/v1``). Each request goes
    to the server in rotation with the fewest requests in flight."""
    model: str | None = None
    """Model name sent with every request; None = the one the first server's ``/v1/models``
    lists. Every server must list it."""
    timeout_s: float = 600.0
    """Longest wait for one answer; longer counts as a failure of that server."""
    max_retries: int = 3
    """Retries of a failed request, on any server in rotation, with backoff."""
    retry_backoff_s: float = 1.0
    """Wait before the first retry of a request; doubled for each further one, at most 60 s."""
    probe_interval_s: float = 5.0
    """A server that failed is out of rotation; it is probed this often (``/health``, then
    ``/v1/models``) and back in rotation once it answers."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the servers' API key (`vllm serve --api-key`, SGLang's
    `--api-key`), sent as `Authorization: Bearer` when set; only this name is ever stored."""
    give_up_s: float = 900.0
    """Stop (exit 1) when no server has been in rotation for this long."""

    def _check_fleet(self, section: str) -> None:
        for i, url in enumerate(self.urls):
            if not str(url).startswith(("http://", "https://")):
                raise ConfigError(f"{section}.urls[{i}]: {url!r} is not an http:// or https:// URL")
        if len(set(self.urls)) != len(self.urls):
            raise ConfigError(f"{section}.urls: a URL is listed twice ({self.urls})")
        if self.max_retries < 0:
            raise ConfigError(f"{section}.max_retries must be >= 0, got {self.max_retries}")
        for name in ("timeout_s", "probe_interval_s", "give_up_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{section}.{name} must be > 0, got {getattr(self, name)}")
        if self.retry_backoff_s < 0:
            raise ConfigError(f"{section}.retry_backoff_s must be >= 0, got {self.retry_backoff_s}")


@dataclass
class ServerConfig(FleetConfig):
    """OpenAI-compatible inference servers (SGLang, vLLM, ``transformers serve``) that write the
    answers instead of a target loaded in the ranks. Empty ``urls``: the target answers inside
    the ranks (Hugging Face ``generate``); set: one client process drives every server and no
    target weights are loaded. A row whose request fails 1 + ``max_retries`` times goes to
    ``<output>.failed.jsonl`` with the reason (a rerun tries it again); with no server in
    rotation for ``give_up_s`` the run stops, keeping every finished row (a rerun resumes)."""

    concurrency: int = 64
    """Requests in flight over all servers together."""

    def __post_init__(self) -> None:
        self._check_fleet("server")
        if self.concurrency < 1:
            raise ConfigError(f"server.concurrency must be >= 1, got {self.concurrency}")


CONNECTOR = "SharedStorageHiddenStatesConnector"
"""The project's hidden-states connector (``dspark_ds/serve/vllm_connector``): vLLM's stock file
connector, made to run on CPU engines too."""


@dataclass
class ServedConfig(FleetConfig):
    """``data.mode: served``: a vLLM fleet serving the target computes each sequence's tapped
    hidden states (its ``extract_hidden_states`` method and a KV connector writing one file per
    sequence to shared storage); `dspark-ds serve-target` starts such a server from the recipe."""

    storage: str | None = None
    """The directory the servers' connector writes and the trainers read (a shared file system
    when they run on other hosts; each side may mount it at its own path, the file name is what
    counts). A file is deleted as soon as it is read."""
    prefetch_batches: int = 4
    """Micro-batches each rank fetches ahead of the one it trains on (the bounded queue: the
    features of this many batches wait in host memory, their requests in flight)."""
    file_wait_s: float = 30.0
    """Longest wait for a file the server named to appear on this host (a shared file system's
    caches) and for its writer to let go of it; past it the file counts as missing and the
    sequence is asked for again."""
    connector: str = CONNECTOR
    """vLLM's ``kv_connector``: the project's (the default; CPU and GPU engines), or a site's own
    (``ExampleHiddenStatesConnector``, a Mooncake or NIXL hidden-states connector) that writes
    the same ``hidden_states`` / ``token_ids`` safetensors files."""
    connector_module: str | None = None
    """vLLM's ``kv_connector_module_path`` for a connector of the site's (None: the project's
    module for its own connector, vLLM's registry for any other name)."""
    connector_extra: dict = field(default_factory=dict)
    """More of vLLM's ``kv_connector_extra_config`` (``shared_storage_path`` is ``storage``)."""
    tensor_parallel_size: int = 1
    """Each server's tensor-parallel size (vLLM's ``--tensor-parallel-size``): the GPUs one
    server spans."""
    expert_parallel: bool = False
    """vLLM's ``--enable-expert-parallel`` (MoE targets: experts split over the server's GPUs)."""
    vllm_args: list[str] = field(default_factory=list)
    """More ``vllm serve`` flags, as written (e.g. [--gpu-memory-utilization, "0.9"])."""

    def __post_init__(self) -> None:
        self._check_fleet("data.served")
        if self.file_wait_s <= 0:
            raise ConfigError(f"data.served.file_wait_s must be > 0, got {self.file_wait_s}")
        if self.prefetch_batches < 1:
            raise ConfigError(
                f"data.served.prefetch_batches must be >= 1, got {self.prefetch_batches}"
            )
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"data.served.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
            )
        if not self.connector:
            raise ConfigError("data.served.connector is empty: name a vLLM KV connector class")


@dataclass
class DataConfig:
    """Where training samples come from and how they are batched."""

    paths: list[str] = field(default_factory=list)
    """Chat jsonl files (OpenAI ``messages``, ShareGPT ``conversations`` or ``turns`` rows), or
    one directory written by ``dspark-ds prepare``. Not needed in offline mode (the cache holds
    the tokens)."""
    mode: Literal["offline", "online", "hybrid", "served"] = "online"
    """offline: features from ``cache_dir``; online: the target runs in the training job;
    hybrid: online for the first epoch while writing ``cache_dir``, then from the cache;
    served: a vLLM fleet serving the target computes them (``data.served``)."""
    cache_dir: str | None = None
    """Target cache directory (offline: read; hybrid and build-cache: written)."""
    tokenizer: str | None = None
    """Tokenizer path or hub id; None = the target's."""
    max_length: int = 4096
    """Sequences are truncated to this many tokens."""
    batch_size: int = 1
    """Sequences per micro-batch on each rank."""
    num_workers: int = 2
    """DataLoader worker processes per rank (0 = load in the main process)."""
    skip_bad_rows: bool = False
    """Count and skip malformed jsonl rows instead of failing on the first one."""
    seed: int = 0
    """Shuffling seed; the order depends only on (seed, epoch, rank, world size)."""
    length_grouping: int = 64
    """Length-aware batching: sort windows of this many global batches by length (1 = off)."""
    chat_format: Literal["deepspec", "answer_only"] = "deepspec"
    """Training text and loss mask. deepspec: the reference implementation's, so τ compares with
    the paper's (Qwen3/ChatML: the default system prompt "You are a helpful assistant." and a
    mask from after `<|im_start|>assistant\n` through `<|im_end|>\n`, the empty think block
    included; Gemma4: answers behind the empty thought channel, mask through `<turn|>\n`).
    answer_only: no default system prompt, the mask covers each answer and its end-of-turn token
    only (the chat template's {% generation %} markers when it has them)."""
    system_prompt: str | None = None
    """System prompt added to conversations that have none (None = the chat format's default:
    deepspec adds "You are a helpful assistant." to ChatML conversations, answer_only none).
    Regeneration prompts get only this one."""
    enable_thinking: bool = False
    """Passed to the chat template (Qwen3: False renders the non-thinking form)."""
    min_loss_tokens: int = 2
    """Samples with fewer assistant tokens after truncation are skipped (DSpark needs 2)."""
    cache_dtype: str = "auto"
    """Storage dtype of cache features written by build-cache / hybrid mode: auto (= the
    target's) | float32 | bfloat16 | float16 | fp8 (e4m3 + per-token scale, half of bf16)."""
    samples_per_shard: int = 1024
    """Samples per cache shard (the unit of resumption and of checksum verification)."""
    served: ServedConfig = field(default_factory=ServedConfig)
    """The target's servers when ``mode`` is served (and for hybrid's first epoch when
    ``served.urls`` is set): their URLs, the shared storage, the prefetch queue."""
    cache_verify: Literal["sha256", "size"] = "sha256"
    """How a cache is checked before training: sha256 of every shard (ranks split the work) or
    sizes only (for multi-TB caches)."""

    @property
    def from_servers(self) -> bool:
        """Whether a served target computes features in the job's first epoch (served mode, or
        hybrid with ``served.urls``)."""
        return self.mode == "served" or (self.mode == "hybrid" and bool(self.served.urls))

    def check_served_storage(self) -> None:
        """Trainers (not `serve-target`, which takes ``--storage``) must name the storage."""
        if self.from_servers and not self.served.storage:
            raise ConfigError(
                "data.served.storage is required with data.served.urls: the directory the "
                "servers write the hidden states to (a file system both jobs mount)"
            )

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"data.mode must be {' | '.join(MODES)}, got {self.mode!r}")
        if self.mode == "served" and not self.served.urls:
            raise ConfigError(
                "data.served.urls is empty: data.mode=served needs the target's vLLM servers "
                "(dspark-ds serve-target starts one)"
            )

        if self.mode in ("offline", "hybrid") and not self.cache_dir:
            raise ConfigError(f"data.cache_dir is required when data.mode={self.mode}")
        for name in ("max_length", "batch_size", "length_grouping", "samples_per_shard"):
            if getattr(self, name) < 1:
                raise ConfigError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0, got {self.num_workers}")
        if self.chat_format not in ("deepspec", "answer_only"):
            raise ConfigError(
                f"data.chat_format must be deepspec | answer_only, got {self.chat_format!r}"
            )
        if self.cache_dtype not in CACHE_DTYPES:
            raise ConfigError(
                f"data.cache_dtype must be one of {CACHE_DTYPES}, got {self.cache_dtype!r}"
            )


@dataclass
class PrepareConfig:
    """``dspark-ds prepare``: normalise + tokenise chat jsonl into a token store."""

    data: DataConfig = field(default_factory=DataConfig)
    """Input files (``data.paths``), tokenizer, max length, bad-row policy."""
    output_dir: str = ""
    """Directory to write (tokens.safetensors + meta.json)."""


@dataclass
class RegenerateConfig:
    """``dspark-ds regenerate``: the target rewrites every assistant answer, in the ranks or
    through OpenAI-compatible servers (``server.urls``)."""

    data: DataConfig = field(default_factory=DataConfig)
    """Input jsonl (``data.paths``); ``data.max_length`` caps prompt + answer tokens."""
    target: TargetConfig = field(default_factory=TargetConfig)
    """The target that writes the answers. With ``server.urls`` only its tokenizer is read
    (``target.path``, unless ``data.tokenizer`` is set): it decides which prompts exceed
    ``data.max_length``."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """Inference servers that answer instead of the target in the ranks (``server.urls``)."""
    output: str = ""
    """Output jsonl (OpenAI ``messages`` layout); per-rank parts live in ``<output>.parts/``."""
    batch_size: int = 16
    """Conversations generated together per rank (in-rank path; servers batch by themselves)."""
    max_new_tokens: int = 2048
    """Answer length cap per assistant turn."""
    temperature: float = 0.7
    """Sampling temperature (paper: 0.7; 0 = greedy)."""
    top_p: float = 0.8
    """Nucleus sampling (paper: 0.8)."""
    top_k: int = 20
    """Top-k sampling (paper: 20; 0 = off)."""
    min_p: float = 0.0
    """Min-p sampling (0 = off)."""
    seed: int = 0
    """Sampling seed (combined with the sample id, so a resumed run stays reproducible)."""
    restart: bool = False
    """Discard the rows an earlier run left in ``<output>.parts`` (and ``<output>``) and start
    over. Without it a rerun resumes only rows made from the same input files and settings, and
    refuses (naming what changed) when they differ."""
    distributed: DistributedConfig = field(
        default_factory=lambda: DistributedConfig(timeout_s=1800)
    )
    """Network interface and timeout of the ranks; the timeout also bounds how long a rank
    that finished its share waits for the slowest one."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ConfigError(f"min_p must be in [0, 1), got {self.min_p}")


@dataclass
class BuildCacheConfig:
    """``dspark-ds build-cache``: run the target once over the data and store its features."""

    data: DataConfig = field(default_factory=DataConfig)
    """Input samples (``data.paths``), the output ``data.cache_dir``, ``data.cache_dtype``
    (auto | float32 | bfloat16 | float16 | fp8) and ``data.samples_per_shard``."""
    target: TargetConfig = field(default_factory=TargetConfig)
    """The target and ``target.layer_ids`` to tap."""
    batch_size: int = 8
    """Samples per target forward."""
    repair: bool = False
    """Check every shard against its sidecar (presence, size, sha256, samples; ranks split the
    hashing), delete the damaged ones and re-make exactly those, then rewrite the manifest. The
    result is byte-identical to a clean build. Without it a finished cache is not re-checked."""
    distributed: DistributedConfig = field(
        default_factory=lambda: DistributedConfig(timeout_s=1800)
    )
    """Network interface and timeout of the ranks; the timeout also bounds how long a rank
    that finished its share waits for the slowest one."""


@dataclass
class EstimateCacheConfig:
    """``dspark-ds estimate cache``: bytes a cache will take, before building it."""

    data: DataConfig = field(default_factory=DataConfig)
    """The data set (``data.paths``); ignored when ``num_samples`` and ``mean_tokens`` are set."""
    target: TargetConfig = field(default_factory=TargetConfig)
    """Only the target's config.json is read (hidden size, layers)."""
    dtype: str = "bfloat16"
    """Storage dtype: float32 | bfloat16 | float16 | fp8."""
    num_samples: int | None = None
    """Sample count, to estimate without reading data."""
    mean_tokens: float | None = None
    """Mean tokens per sample (after truncation), to estimate without reading data."""
