"""The matmul FLOPs of a run's steps: what the tuner divides by a device's rate (tune/workload.py,
tune/steptime.py) and what a training run reports on its log steps (`system/tflops_per_gpu`,
`system/mfu`; `WindowFlops`), one count for both.

What is counted:

- the drafter's forward and backward, the kind's own count (`DrafterKind.cost.step_flops`:
  drafters/dspark/memory.py, drafters/eagle3/memory.py) for the attention and loss paths the
  run takes on its device at its ZeRO stage — the second pass over the chunk logits of ZeRO-3's
  recompute loss included; matmuls only (each trained Linear 3x its forward, the frozen
  lm_head 2x, the target's aligned logits 1x, the attention's computed (query, key) pairs);
- the frozen target's forward when it runs in the job (online, hybrid, synthetic data): its
  decoder layers and causal attention (`forward_flops`); an offline run reads its features from
  the cache and a served one from a vLLM fleet, and counts none.

A log window's count (`WindowFlops`) is for the sequences it trained on (every rank's, from the
counts the log step already reduces: real tokens, sequences, and the anchor blocks the sampler
kept). Padding and the dummy blocks of short rows are not counted: the count is evaluated at
the window's mean tokens and kept anchor blocks per sequence, times its sequences (every term
is linear in the sequences of a micro-batch; the attention's anchors × context term is taken at
the means, not summed per sequence). The time is the window's wall time, so a validation or a
checkpoint inside the window counts against it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dspark_ds.cost.inventory import Inventory, inventory
from dspark_ds.drafters.registry import get_kind


def target_served(run_cfg) -> bool:
    """Whether a vLLM fleet computes the features (data.mode served, or hybrid with
    data.served.urls: its first epoch)."""
    return run_cfg.data.from_servers


def target_in_job(run_cfg) -> bool:
    """Whether the job runs the target's forward: online and hybrid runs and synthetic data; not
    offline ones (the cache) nor served ones (`target_served`)."""
    in_job = run_cfg.data.mode != "offline" and not target_served(run_cfg)
    return in_job or bool(run_cfg.train.synthetic_samples)


def attention_pairs(S: int, window: int | None) -> float:
    """(query, key) pairs of causal attention over S tokens, each query seeing at most `window`
    keys (a sliding-window layer; None: all before it)."""
    if window is None or S <= window:
        return S * S / 2
    return window * S - window * window / 2


def forward_flops(layer_params: int, attention, B: int, S: int) -> float:
    """A decoder's forward over B × S tokens: its layers' matmuls and the causal attention (QK^T
    and PV over the pairs each layer computes); no lm_head (FrozenTarget taps states).
    `attention`: each layer's (query width = heads × head size, sliding window or None)."""
    scores = sum(width * attention_pairs(S, window) for width, window in attention)
    return 2.0 * B * S * layer_params + 4.0 * B * scores


def target_forward_flops(inv: Inventory, run_cfg) -> float:
    """The target's forward over one micro-batch of the run."""
    B, S = run_cfg.data.batch_size, run_cfg.data.max_length
    return forward_flops(inv.target_layer_params, inv.target_attention, B, S)


def drafter_flops(inv: Inventory, run_cfg, device: str, stage: int) -> dict[str, float]:
    """The drafter's forward + backward over one micro-batch of the run, by component (the
    kind's count for the loss path it takes on `device` at ZeRO `stage`)."""
    kind = get_kind(run_cfg.model.kind)
    return kind.cost.step_flops(inv.step_shape(run_cfg), run_cfg.perf, device, stage)


class WindowFlops:
    """`flops(sequences, tokens, anchors_per_sequence)`: the model FLOPs of a log window (see
    the module docstring), for a run's config on `device` at ZeRO `zero_stage`."""

    def __init__(self, run_cfg, device: torch.device | str, zero_stage: int):
        self.run_cfg, self.stage = run_cfg, zero_stage
        self.device = torch.device(device).type
        self.kind = get_kind(run_cfg.model.kind)
        self.inv = inventory(run_cfg)  # the drafter and target on the meta device: no memory
        self.in_job = target_in_job(run_cfg)

    def per_sequence(self, tokens: float, anchors: float | None = None) -> float:
        """FLOPs of one sequence of `tokens` tokens and `anchors` kept anchor blocks (None: the
        recipe's `model.num_anchors`)."""
        model = self.run_cfg.model
        if self.kind.capabilities.anchor_blocks and anchors is not None:
            model = replace(model, num_anchors=anchors)
        shape = replace(
            self.inv.step_shape(self.run_cfg),
            batch=1,
            seq_len=tokens,
            drafter=self.kind.cost.step_part(model),
        )
        flops = sum(
            self.kind.cost.step_flops(shape, self.run_cfg.perf, self.device, self.stage).values()
        )
        if self.in_job:
            inv = self.inv
            flops += forward_flops(inv.target_layer_params, inv.target_attention, 1, tokens)
        return flops

    def __call__(
        self, sequences: float, tokens: float, anchors_per_sequence: float | None
    ) -> float:
        if sequences <= 0:
            return 0.0
        return sequences * self.per_sequence(tokens / sequences, anchors_per_sequence)
