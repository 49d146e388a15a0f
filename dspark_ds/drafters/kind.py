"""What the trainer, the tuner, evaluation, the bench and the demo ask of a drafter kind.

A kind ("dspark", which covers DFlash, or "eagle3") is one `DrafterKind` (drafters/dspark/kind.py,
drafters/eagle3/kind.py); drafters/registry.py holds one instance of each. Code outside drafters/
never branches on the kind: it asks `get_kind(name)` or `kind_of(model)`.

What a kind can do is data, its registration's `Capabilities` (`kind.capabilities`). What it does
is grouped by the subsystem that asks, one small protocol each, so that a new term of one
subsystem touches one part of every kind:

    kind.train    the training step: prepare, loss_impl_for, training_step, metrics
    kind.decode   a decoding round: extend, propose; tokens_per_round, has_confidence of a drafter
    kind.cost     the tuner's and the logs' counts: step_part, host_scale, host_copy,
                  activation_bytes, step_flops
    kind.report   what reports and tags say of it: describe, tags

One training step of a micro-batch is `kind.train.training_step(model, batch, ctx) ->
StepOutput`: the loss to back-propagate and this rank's metric sums, all on the device. Nothing
in it reads a value back to the host; the loss's denominators are summed over the ranks there
(one all_reduce, when training). The trainer reduces the sums of many micro-batches at once on
its log steps and turns them into metrics with `kind.train.metrics`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch
from torch import nn

from dspark_ds import distributed
from dspark_ds.drafters.common.memory import StepShape
from dspark_ds.drafters.common.registration import Capabilities, Registration
from dspark_ds.drafters.common.rounds import DraftRound, Proposal, VerifiedContext
from dspark_ds.drafters.perf import PerfConfig, compile_drafter
from dspark_ds.drafters.presets import DrafterConfig
from dspark_ds.errors import ConfigError

# The tensors of a training batch a step reads besides `sample_ids` (features from the target or
# its cache).
TRAIN_KEYS = ("input_ids", "target_hidden_states", "loss_mask", "target_last_hidden_states")
# The anchor sampler's statistics a step reports in `StepOutput.sampler_sums` (the reference's;
# per-sample means, logged as train/<name>), when its kind samples anchor blocks
# (drafters/dspark/sampler_stats.py counts them).
SAMPLER_STATS = (
    "valid_anchors_abs",
    "valid_anchors_ratio",
    "sampled_anchors_abs",
    "sampled_anchors_ratio",
    "block_supervised_tokens_abs",
    "block_supervised_tokens_ratio",
)


@dataclass(frozen=True)
class StepContext:
    """What one training step needs besides the model and the batch."""

    model: DrafterConfig
    """The run's `model` section (loss weights, decays)."""
    perf: PerfConfig
    """The run's `perf` section (chunk sizes, dropped blocks)."""
    loss_impl: str
    """The loss path, as `KindTrain.prepare` resolved it."""
    seed: int = 0
    epoch: int = 0
    """Seed and epoch of the anchor draws (kinds that sample blocks)."""
    training: bool = True
    """A backward follows: the loss's denominators are summed over every rank and the anchor
    sampler's statistics are counted. False (validation): neither; only the metric sums count."""


@dataclass
class StepOutput:
    """One micro-batch's step: the loss and this rank's metric sums, on the device."""

    loss: torch.Tensor
    """The scalar to back-propagate."""
    sums: torch.Tensor
    """[K] fp32: this rank's numerators and denominators of every metric (not reduced)."""
    names: tuple[str, ...]
    """What each entry of `sums` is."""
    sampler_sums: torch.Tensor | None = None
    """fp64 [len(SAMPLER_STATS) + 1]: the anchor sampler's statistics of the micro-batch
    (`sampler_stat_sums`), when training a kind that samples blocks."""

    @classmethod
    def of(cls, loss: torch.Tensor, sums: Mapping[str, torch.Tensor]) -> StepOutput:
        """From named scalar tensors (stacked in their order, as fp32)."""
        stacked = torch.stack([v.detach().to(torch.float32) for v in sums.values()])
        return cls(loss=loss, sums=stacked, names=tuple(sums))

    def global_sums(self) -> dict[str, float]:
        """Collective: `sums` summed over every rank (one all_reduce), as floats."""
        summed = distributed.all_reduce_(self.sums.clone())
        return dict(zip(self.names, summed.tolist()))


class KindTrain(Protocol):
    """The training step's part (train/, the tuner's measured steps, the bench). `check_perf`
    and `prepare` are shared: they read the kind's registration."""

    registration: Registration

    def __init__(self, registration: Registration):
        self.registration = registration

    def loss_impl_for(self, loss_impl: str, zero3: bool) -> str:
        """perf.loss_impl -> the path a step takes, with or without ZeRO-3's partitioned
        parameters (the tuner's memory and FLOP terms ask the same). ConfigError names
        perf.loss_impl."""
        ...

    def training_step(
        self, model: Any, batch: Mapping[str, torch.Tensor], ctx: StepContext
    ) -> StepOutput:
        """Forward and loss of one micro-batch. `model`: what runs the forward (a DeepSpeed
        engine, whose `.module` is the drafter, or the drafter itself); `batch`: `TRAIN_KEYS` on
        the model's device and `sample_ids` on the host."""
        ...

    def metrics(self, sums: Mapping[str, float], model: DrafterConfig) -> dict[str, float]:
        """The metrics of `StepOutput.sums` summed over the ranks (docs/metrics.md)."""
        ...

    def check_perf(self, perf: PerfConfig) -> None:
        """Refuses, by name, a perf option this kind cannot honour."""
        caps = self.registration.capabilities
        for option, value, allowed in (
            ("loss_impl", perf.loss_impl, caps.loss_impls),
            ("attn_implementation", perf.attn_implementation, caps.attn_impls),
        ):
            if value not in allowed:
                raise ConfigError(
                    f"perf.{option}: {value!r} is not available for {self.registration.name} "
                    f"drafters; choose one of {allowed}"
                )

    def prepare(
        self,
        drafter: nn.Module,
        perf: PerfConfig,
        device: torch.device | str | None = None,
        *,
        zero_stage: int = 0,
    ) -> str:
        """Sets the drafter's attention implementation and activation checkpointing and, given
        the run's device, compiles it per `perf.compile`; returns the loss path for the run's
        ZeRO stage (`loss_impl_for`)."""
        self.check_perf(perf)
        drafter.attn_implementation = perf.attn_implementation
        drafter.activation_checkpointing = perf.activation_checkpointing
        if device is not None and perf.compile_mode(device) != "off":
            compile_drafter(drafter, perf.compile_mode(device), perf.compile_backend)
        return self.loss_impl_for(perf.loss_impl, zero3=zero_stage == 3)


class KindDecode(Protocol):
    """A decoding round's part (both loops of eval/; drafters/common/rounds.py). `extend` and
    `propose` are shared: a drafter has `extend_context` and `propose_round`."""

    def extend(self, drafter: nn.Module, context: VerifiedContext) -> None:
        """Appends positions the target verified to the drafter's cache."""
        drafter.extend_context(context)

    def propose(self, drafter: nn.Module, draft_round: DraftRound) -> Proposal:
        """One drafting round of speculative decoding for every row in flight."""
        return drafter.propose_round(draft_round)

    def tokens_per_round(self, config: Any) -> int:
        """The most tokens a drafter of this config (its transformers config) proposes in a
        round (γ): what a round's records, reports and calibration are sized by."""
        ...

    def has_confidence(self, config: Any) -> bool:
        """A drafter of this config scores its drafts (a confidence head): the confidence
        policies, the scheduler and calibration need one."""
        ...


class KindCost(Protocol):
    """The cost model's part: the sizes, memory and FLOP terms the tuner predicts with and
    training logs (cost/, tune/, the bench). `activation_bytes` and `step_flops` are shared:
    they read the kind's cost terms module (drafters/<kind>/memory.py)."""

    terms: ModuleType
    """The kind's memory.py: its `activation_bytes` and `step_flops` of a `StepShape`."""

    def __init__(self, terms: ModuleType):
        self.terms = terms

    def step_part(self, model: DrafterConfig) -> Any:
        """The kind's part of a `StepShape` (`StepShape.drafter`) for a run's `model` section:
        the sizes its activation and FLOP terms read besides the common ones."""
        ...

    def host_scale(self, model: DrafterConfig, seq_len: int) -> int:
        """The count a training step's host work grows with, linearly, for a run's `model`
        section and sequence length (its loops: over blocks of anchors, over chunks of
        positions). The tuner times narrow copies at two small counts and extrapolates."""
        ...

    def host_copy(
        self, model: DrafterConfig, seq_len: int, count: int, longest: int
    ) -> tuple[DrafterConfig, int]:
        """The `model` section and sequence length of the tuner's narrow copy at `count` of
        `host_scale` (`longest`: the largest count a copy runs at)."""
        ...

    def activation_bytes(
        self, shape: StepShape, perf: PerfConfig, device: str, zero_stage: int
    ) -> dict[str, float]:
        """Activation bytes of one training micro-batch by component (`dspark-ds tune`)."""
        return self.terms.activation_bytes(shape, perf, device, zero_stage)

    def step_flops(
        self, shape: StepShape, perf: PerfConfig, device: str, zero_stage: int
    ) -> dict[str, float]:
        """Matmul FLOPs of one training micro-batch (forward + backward) by component, for the
        loss and attention paths training takes on `device` at `zero_stage` (`dspark-ds tune`'s
        compute term)."""
        return self.terms.step_flops(shape, perf, device, zero_stage)


class KindReport(Protocol):
    """What reports, run names and tracking tags say of the kind."""

    def describe(self, model: DrafterConfig) -> str:
        """A one-line summary of a `model` section (reports)."""
        ...

    def tags(self, config: Any) -> dict[str, object]:
        """What an evaluation run's MLflow tags say of a built drafter, from its transformers
        config (its heads, its depth of drafting)."""
        ...


class DrafterKind(Protocol):
    """One drafter kind: its registration (what it declares as data) and its parts."""

    registration: Registration
    """Its folder's `Registration` (drafters/<kind>/config.py)."""
    model_class: type[nn.Module]
    """The base class of every backend of this kind."""
    train: KindTrain
    decode: KindDecode
    cost: KindCost
    report: KindReport

    @property
    def name(self) -> str:
        """The `model.kind` value ("dspark" | "eagle3")."""
        return self.registration.name

    @property
    def capabilities(self) -> Capabilities:
        """What it can do (`Capabilities`: plain data)."""
        return self.registration.capabilities

    @property
    def architectures(self) -> Mapping[str, str]:
        """Target model_type -> the interchange architecture built and exported for it."""
        return self.registration.architectures

    def build_config(
        self,
        target_config: Any,
        model: DrafterConfig,
        *,
        target_layer_ids: list[int],
        mask_token_id: int | None = None,
        target_path: str | None = None,
    ) -> Any:
        """The drafter's transformers config for a target (its Hugging Face config, any family
        with a backend in `architectures`) and the run's `model` section. ConfigError names the
        drafter config's field."""
        ...


def ratio(num: float, den: float) -> float:
    """A metric from its summed numerator and denominator; NaN when nothing was counted."""
    return num / den if den > 0 else math.nan


def bare(model: Any) -> nn.Module:
    """The drafter inside `model` (a DeepSpeed engine or wrapper's `.module`), or `model`."""
    return getattr(model, "module", model)
