"""`dspark-ds demo` configuration: the whole pipeline on CPU in minutes, nothing downloaded.

    dspark-ds demo --output_dir runs/demo                     # the measured demo (one seed)
    dspark-ds demo --output_dir runs/demo3 --seeds [0,1,2]    # the 3-seed check
    dspark-ds demo --output_dir /tmp/d --budget.max_steps 40  # a smaller budget
    dspark-ds demo --output_dir /tmp/g5 \
        --drafter.dspark.block_size 5 --drafter.eagle3.ttt_length 5   # γ 5 for every drafter
    dspark-ds demo --output_dir /tmp/a --loss preset --budget.optimizer adamw \
        --budget.weight_decay 0 --budget.zero zero2       # the paper's losses with AdamW

Every drafter (DSpark, DFlash, Eagle3) gets the same data, the same budget (`budget.*`: steps,
batch, learning-rate schedule, optimizer, ZeRO stage, ranks) and the same supervision (every
valid position of every sequence, over γ draft positions); each its own loss or the one the
study picked for it, and the order of the sequences that goes with it (`loss`; docs/demo.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from dspark_ds.data.config import DataConfig
from dspark_ds.demo.target import DemoTargetConfig
from dspark_ds.drafters.presets import PRESET_NAMES, PRESETS, DrafterSizes
from dspark_ds.errors import ConfigError, require_at_least_one

LAUNCHERS = ("fork", "torchrun")
OPTIMIZERS = ("adamw", "muon")
LOSSES = ("measured", "preset", "speculators")


@dataclass
class DemoDataConfig:
    """The drafters' training data: prompts of the synthetic corpus answered by the target."""

    num_train_prompts: int = 1024
    """Prompts (the first rows of the target's own corpus) whose answers the target regenerates
    for drafter training (the default budget, 480 steps x 2 sequences, reads 960 of them)."""
    num_heldout_prompts: int = 48
    """Held-out prompts (an independent stream of the same generator) for the evaluation."""
    max_length: int = 128
    """Prompt + answer tokens (the corpus' longest conversation is ~110)."""
    mode: Literal["offline", "online"] = "offline"
    """offline: `dspark-ds build-cache` once, every drafter reads the cache; online: the target
    runs inside each training job."""
    temperature: float = 0.7
    """Regeneration temperature (the paper's 0.7)."""
    top_p: float = 0.8
    """Regeneration nucleus (the paper's 0.8)."""
    top_k: int = 20
    """Regeneration top-k (the paper's 20)."""
    max_new_tokens: int = 96
    """Answer length cap during regeneration."""
    regenerate_batch_size: int = 64
    """Conversations generated together per rank."""

    def validate(self) -> None:
        require_at_least_one(
            self,
            (
                "num_train_prompts",
                "num_heldout_prompts",
                "max_length",
                "max_new_tokens",
                "regenerate_batch_size",
            ),
            "data.",
        )
        if self.mode not in ("offline", "online"):
            raise ConfigError(f"data.mode: must be offline | online, got {self.mode!r}")


@dataclass
class DemoBudgetConfig:
    """The training budget every drafter gets (same steps, batch, schedule, optimizer and
    engine)."""

    max_steps: int = 480
    """Optimizer steps per drafter."""
    global_batch_size: int = 2
    """Sequences per optimizer step over all ranks. With every valid position anchoring a
    block, the number of updates matters more than the sequences per update: over 3 seeds the
    DSpark / DFlash τ ratio was 0.99-1.15 (T = 0) and 1.05-1.14 (T = 1) at 240 steps x 8,
    1.17-1.31 and 1.25-1.38 at 480 x 4, and 1.19-1.30 and 1.21-1.30 at 480 x 2 (the default:
    half the sequences of 480 x 4, 75-82 s per drafter against 94-111 s; the README's demo
    section)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch on each rank (accumulation fills the rest)."""
    lr: float = 3e-3
    """Peak learning rate (linear warmup, cosine decay to 0); Eagle3 uses the same, as in the
    paper's comparison (one schedule for every drafter)."""
    warmup_ratio: float = 0.05
    """Warmup share of the steps."""
    optimizer: Literal["adamw", "muon"] = "muon"
    """`train.optimizer` of every drafter: muon (Muon for the draft layers' weight matrices,
    AdamW for the rest; docs/training.md#muon) or adamw. With Muon every drafter drafted
    better in docs/demo.md's study (seed 0, τ at T = 0 with each preset's own loss: DSpark
    2.36 -> 3.76, DFlash 2.06 -> 3.26, Eagle3 3.82 -> 4.03)."""
    weight_decay: float = 0.01
    """`train.weight_decay`: AdamW's (of every weight under adamw, of the weights Muon does not
    take under muon; Muon's matrices decay by `train.muon_weight_decay`, 0.1), as speculators'
    defaults."""
    zero: str = "zero0"
    """DeepSpeed config (a shipped name or a JSON path). ZeRO-0: under ZeRO-1/2/3 DeepSpeed's
    Muon cannot clip the gradients (train.max_grad_norm is not applied), which cost DSpark 0.29
    in τ at T = 0 (docs/peers.md); on 2 ranks ZeRO-0 with Muon and clipping gives the 1-rank
    run's weights (6 steps, within 5e-7). With adamw, `zero2` trains the same; `zero3` runs the
    same demo (the tests hold ZeRO-3 to ZeRO-0's results; a ZeRO-3 step of the demo's DSpark
    took 0.29 s against ZeRO-2's 0.14 s on 2 CPU ranks over gloo)."""
    nproc: int | None = None
    """Training (and regeneration / cache) ranks; None = 2 when the machine has >= 2 cores,
    else 1."""

    def validate(self) -> None:
        require_at_least_one(
            self, ("max_steps", "global_batch_size", "micro_batch_size"), "budget."
        )
        if self.lr <= 0:
            raise ConfigError(f"budget.lr: must be > 0, got {self.lr}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"budget.optimizer: {' | '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.weight_decay < 0:
            raise ConfigError(f"budget.weight_decay: must be >= 0, got {self.weight_decay}")
        if self.nproc is not None and self.nproc < 1:
            raise ConfigError(f"budget.nproc: must be >= 1 or null, got {self.nproc}")
        if self.global_batch_size % (self.micro_batch_size * self.world_size):
            raise ConfigError(
                f"budget.global_batch_size: {self.global_batch_size} is not a multiple of "
                f"budget.micro_batch_size × ranks = {self.micro_batch_size} × {self.world_size}"
            )

    @property
    def world_size(self) -> int:
        return self.nproc or (2 if (os.cpu_count() or 1) >= 2 else 1)


@dataclass
class DemoEvalConfig:
    """Real speculative decoding of the held-out prompts."""

    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    """Sampling temperatures (0 = greedy)."""
    max_new_tokens: int = 96
    """Generation budget per prompt."""
    batch_size: int = 8
    """Prompts in flight (batched speculative decoding); the target alone is decoded at the same
    batch size in the same evaluation, for the wall-clock speedup."""
    draft_temperature: float | None = None
    """What the drafters sample their drafts at when T > 0 (`dspark-ds eval
    --draft_temperature`): None = T; 0 = their argmax (vLLM's default `draft_sample_method:
    greedy`)."""

    def validate(self) -> None:
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ConfigError(
                f"eval.temperatures: need >= 1 value, all >= 0, got {self.temperatures}"
            )
        if self.draft_temperature is not None and self.draft_temperature < 0:
            raise ConfigError(
                f"eval.draft_temperature: must be >= 0 or null, got {self.draft_temperature}"
            )
        require_at_least_one(self, ("max_new_tokens", "batch_size"), "eval.")


@dataclass
class DemoConfig:
    """`dspark-ds demo`: corpus → tokenizer + tiny target, then per seed: regenerate → cache →
    DSpark, DFlash and Eagle3 trained with DeepSpeed → batched speculative decoding at T = 0 and
    T = 1 with the target alone alongside (τ and speedup) → the spread over seeds → MLflow."""

    output_dir: str = "runs/demo"
    """Everything the demo writes: data, runs, mlflow.db, summary.json, summary.txt."""
    target: DemoTargetConfig = field(default_factory=DemoTargetConfig)
    """The tiny target (trained once, then cached under ~/.cache/dspark-ds)."""
    data: DemoDataConfig = field(default_factory=DemoDataConfig)
    """Drafter training data and held-out prompts."""
    drafter: DrafterSizes = field(default_factory=DrafterSizes.for_demo)
    """Drafter sizes, sized to the tiny target as the paper's are to Qwen3: one block per kind
    (`--drafter.<kind>.<size>`), each preset sized by its kind's (`Preset.sized`,
    drafters/presets.py). The defaults give every drafter the same γ (7); each kind's block is
    its `Registration.demo_sizes` over the block's defaults (DSpark and DFlash: 3 layers)."""
    budget: DemoBudgetConfig = field(default_factory=DemoBudgetConfig)
    """The training budget every drafter gets."""
    loss: Literal["measured", "preset", "speculators"] = "measured"
    """Each drafter's loss: "preset", its preset's own (the paper's); "speculators", the one
    speculators 0.9 trains its kind with (`Preset.speculators_loss`: DSpark KL to the
    target's distribution, DFlash cross-entropy against the target's greedy token with D-PACE
    position weights, Eagle3 every unrolled step weighted 1.0; docs/peers.md); "measured",
    the one each drafter drafted best with in docs/demo.md's and docs/peers.md's measurements
    (`Preset.demo_loss`: DSpark speculators' KL plus the CE against the target's greedy token,
    DFlash speculators' loss plus 0.5 x the KL, Eagle3 its own), each in the order of the
    sequences it drafted best in (`Preset.demo_data`: DFlash a random order, the others grouped
    by length; with "preset" and "speculators" every drafter grouped by length) and with the
    optimizer settings it drafted best with (`Preset.demo_train`: DFlash's Muon at momentum 0.9,
    the others' at train.muon_momentum's 0.95)."""
    eval: DemoEvalConfig = field(default_factory=DemoEvalConfig)
    """Speculative-decoding evaluation."""
    drafters: list[str] = field(default_factory=lambda: list(PRESET_NAMES))
    """Which drafters to train and compare: the paper's presets (drafters/presets.py: dspark,
    dflash, eagle3)."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """Each seed repeats everything after the target: regeneration sampling, the drafters'
    init, anchor sampling and data order, and evaluation sampling (the corpus, the target and
    the held-out prompts stay the same). The summary shows every seed and the spread."""
    tracking_uri: str | None = None
    """MLflow tracking URI; None = sqlite:///<output_dir>/mlflow.db."""
    experiment: str = "dspark-ds-demo"
    """MLflow experiment of every run the demo makes."""
    launcher: Literal["fork", "torchrun"] = "fork"
    """How the multi-rank stages (regenerate, build-cache, train) start their ranks: "fork" =
    forked from this process, which imported torch, transformers, DeepSpeed and MLflow once
    (the ranks run the same `dspark-ds <subcommand> --config <yaml>` with the variables
    torchrun sets); "torchrun" = `torchrun --nproc_per_node N -m dspark_ds.cli ...`, new
    interpreters that import everything again per stage (~15 s each here). Same results."""
    num_threads: int = 1
    """torch threads of the demo process (evaluation) and of each rank.

    NOTE: tiny models gain nothing from intra-op threads, and on a 2-core machine 2 ranks with
    several threads each oversubscribe it (often 10x slower)."""

    def loss_fields(self, name: str) -> dict:
        """The `model` fields that give the drafter `name` the loss `loss` names."""
        own = PRESETS[name]
        chosen = {"preset": {}, "speculators": own.speculators_loss, "measured": own.demo_loss}
        return dict(chosen[self.loss])

    def data_order(self, name: str) -> dict:
        """The `data` fields that order the drafter `name`'s sequences: its preset's measured
        order (`Preset.demo_data`) with the measured loss, the data section's otherwise."""
        return dict(PRESETS[name].demo_data) if self.loss == "measured" else {}

    def train_fields(self, name: str) -> dict:
        """The `train` fields the drafter `name` trains with over the budget's: its preset's
        measured optimizer settings (`Preset.demo_train`) with the measured loss, none
        otherwise."""
        return dict(PRESETS[name].demo_train) if self.loss == "measured" else {}

    def length_grouping(self, name: str) -> int:
        """The `data.length_grouping` the drafter `name` trains with (1: a random order)."""
        return self.data_order(name).get("length_grouping", DataConfig.length_grouping)

    def draft_lengths(self) -> dict[str, int]:
        """γ of each drafter the demo trains, from its kind's size block."""
        return {name: self.drafter.block(name).draft_length for name in self.drafters}

    def validate(self) -> None:
        if not self.output_dir:
            raise ConfigError("output_dir: is required")
        unknown = [d for d in self.drafters if d not in PRESET_NAMES]
        if unknown or not self.drafters or len(set(self.drafters)) != len(self.drafters):
            raise ConfigError(
                f"drafters: choose distinct names from {list(PRESET_NAMES)}, got {self.drafters}"
            )
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ConfigError(f"seeds: need >= 1 distinct seeds >= 0, got {self.seeds}")
        if self.num_threads < 1:
            raise ConfigError(f"num_threads: must be >= 1, got {self.num_threads}")
        if self.loss not in LOSSES:
            raise ConfigError(f"loss: {' | '.join(LOSSES)}, got {self.loss!r}")
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"launcher: {' | '.join(LAUNCHERS)}, got {self.launcher!r}")
        if self.launcher == "fork" and self.num_threads > 1:
            # OpenMP's thread pool does not survive fork(): a forked rank that runs parallel
            # regions after the parent did hangs (seen with torch's libgomp)
            raise ConfigError(
                f"num_threads: {self.num_threads} needs launcher torchrun (a forked rank "
                "cannot use OpenMP threads once the demo process has); use --launcher torchrun"
            )
        self.data.validate()
        self.budget.validate()
        self.drafter.validate("drafter")
        self.eval.validate()
