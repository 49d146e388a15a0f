"""The model FLOPs a training run reports on its log steps (`system/tflops_per_gpu`,
`system/mfu`), counted as `dspark-ds tune` counts its compute term.

What is counted, for the sequences a log window trained on (every rank's, from the counts the
log step already reduces: real tokens, sequences, and the anchor blocks the sampler kept):

- the drafter's forward and backward, the kind's own count (`DrafterKind.step_flops`:
  drafters/dspark/memory.py, drafters/eagle3/memory.py) for the attention and loss paths the
  run takes on its device at its ZeRO stage — the second pass over the chunk logits of ZeRO-3's
  recompute loss included; matmuls only (each trained Linear 3x its forward, the frozen
  lm_head 2x, the target's aligned logits 1x, the attention's computed (query, key) pairs);
- the frozen target's forward when it runs in the job (online, hybrid, synthetic data): its
  decoder layers and causal attention (`tune.workload.forward_flops`); an offline run reads
  its features from the cache and counts none.

Padding and the dummy blocks of short rows are not counted: the count is evaluated at the
window's mean tokens and kept anchor blocks per sequence, times its sequences (every term is
linear in the sequences of a micro-batch; the attention's anchors × context term is taken at
the means, not summed per sequence). The time is the window's wall time, so a validation or a
checkpoint inside the window counts against it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dspark_ds.drafters.registry import get_kind


class WindowFlops:
    """`flops(sequences, tokens, anchors_per_sequence)`: the model FLOPs of a log window (see
    the module docstring), for a run's config on `device` at ZeRO `zero_stage`."""

    def __init__(self, run_cfg, device: torch.device | str, zero_stage: int):
        from dspark_ds.tune.inventory import inventory
        from dspark_ds.tune.workload import target_in_job

        self.run_cfg, self.stage = run_cfg, zero_stage
        self.device = torch.device(device).type
        self.kind = get_kind(run_cfg.model.kind)
        self.inv = inventory(run_cfg)  # the drafter and target on the meta device: no memory
        self.in_job = target_in_job(run_cfg)

    def per_sequence(self, tokens: float, anchors: float | None = None) -> float:
        """FLOPs of one sequence of `tokens` tokens and `anchors` kept anchor blocks (None: the
        recipe's `model.num_anchors`)."""
        from dspark_ds.tune.workload import forward_flops

        model = self.run_cfg.model
        if self.kind.anchor_blocks and anchors is not None:
            model = replace(model, num_anchors=anchors)
        shape = replace(
            self.inv.step_shape(self.run_cfg),
            batch=1,
            seq_len=tokens,
            drafter=self.kind.step_part(model),
        )
        flops = sum(
            self.kind.step_flops(shape, self.run_cfg.perf, self.device, self.stage).values()
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


def peak_flops(peak_tflops: float | None, precision: str, device: torch.device) -> float | None:
    """The peak MFU is measured against: `train.peak_tflops`, else a known GPU's dense bf16
    figure under bf16 (tune/cluster.py `DEVICE_PRESETS`), else None (no MFU: a CPU, another
    GPU, fp32)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device.type != "cuda" or precision != "bf16":
        return None
    from dspark_ds.tune.cluster import device_peak_flops

    return device_peak_flops(torch.cuda.get_device_name(device))
