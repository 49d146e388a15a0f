"""Activation memory of one Eagle3 training step, by component (for `dspark-ds tune`).

The unroll keeps every one of the T = ttt_length steps for the backward: per step and layer the
2H-wide layer input, q / k / v (the keys of every step stay referenced by the later steps'
attention), the attention (the dense kernel's fp32 scores and probabilities over the causal
S × S part, or flex's output and log-sum-exp), o_proj and the MLP; then the T stacked outputs.
With perf.activation_checkpointing each layer of each step keeps its input and its keys and
values only, and one layer's working set exists again while it is recomputed in backward.
The loss works over B·S·T rows of vocabulary size: the full logits, per step the fp32
log-softmax and the target distribution it is compared with (the reference path), or
T·loss_chunk_anchors rows at a time (the chunked path), plus the target's own logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark_ds.drafters.common.memory import LAYERS_RECOMPUTE, StepShape
from dspark_ds.drafters.eagle3.loss import loss_impl_for
from dspark_ds.drafters.perf import PerfConfig


@dataclass(frozen=True)
class Eagle3Shape:
    """Eagle3's part of a `StepShape` (`StepShape.drafter`)."""

    ttt_length: int = 7
    """T: training-time-test steps unrolled per position."""

    @classmethod
    def of(cls, model) -> Eagle3Shape:
        """From the run's `model` section."""
        return cls(ttt_length=model.ttt_length)


def activation_bytes(s: StepShape, perf: PerfConfig, device: str, stage: int) -> dict[str, float]:
    """Peak activation bytes of one micro-batch by component; `device` cuda | cpu, `stage` the
    ZeRO stage (it decides the loss path, as in training)."""
    b, B, S, T = s.compute_bytes, s.batch, s.seq_len, s.drafter.ttt_length
    H, F, V = s.hidden, s.intermediate, s.vocab
    kv = s.kv_heads * s.head_dim
    qd = s.heads * s.head_dim
    out: dict[str, float] = {}
    out["features_in"] = s.features_in()
    out["context_proj"] = B * S * H * b  # fc out (the layer's hidden_norm normalizes it)
    # per step and layer: embedding, the two input norms and their 2H concatenation, q before /
    # after norm + rope, k / v likewise, o_proj, the residuals and the MLP's three F-wide tensors
    per_step_tokens = B * S * (8 * H + 3 * qd + 4 * kv + 3 * F) * b
    flex = perf.attn_implementation == "flex" or (
        device == "cuda" and perf.attn_implementation == "auto"
    )
    if flex:
        per_step_attn = B * S * (qd * b + s.heads * 4)
    else:
        # the dense kernel saves fp32 q and the keys / values repeated to every head, and the
        # probabilities (fp32) over the causal S × S part (+ the chain) for every query
        per_step_attn = B * S * 3 * qd * 4 + B * s.heads * S * S * 4
    if perf.activation_checkpointing:
        # each layer of each step runs again in backward: it keeps its hidden input and, since
        # the later steps attend to them, its keys and values; each step its embedding; and, at
        # the backward's peak, one layer's working set while it is recomputed
        kept = T * B * S * H * b + T * s.draft_layers * B * S * (H + 2 * kv) * b
        out["ttt_steps"] = kept + per_step_tokens + per_step_attn
    else:
        out["ttt_steps"] = T * s.draft_layers * (per_step_tokens + per_step_attn)
    impl = loss_impl_for(perf.loss_impl, zero3=stage == 3)
    chunked = impl == "chunked"
    # the stacked step outputs and their final norm (+ the chunked loss's valid rows, their
    # norm and the [N, H] gradient it stores)
    out["stacked_hidden"] = B * S * T * H * b * (4 if chunked else 2)
    fp32_copy = 4 if b == 2 else 0
    if chunked:
        # per chunk of loss_chunk_anchors × T rows: draft and target logits (+ fp32 copies),
        # the target distribution, log-softmax, the accept-rate terms and the closed-form
        # gradient (fp32)
        rows = min(B * S * T, perf.chunk_anchors(device) * T)
        out["logits_softmax"] = rows * V * (2 * b + 2 * fp32_copy + 5 * 4)
    else:
        # the draft logits over every row, per step the fp32 log-softmax and the shifted target
        # distribution the cross-entropy saves; the last step's transients (fp32 copy, product,
        # accept-rate terms); the target's logits and distribution over every position
        rows = B * S * T
        out["logits_softmax"] = rows * V * (b + 2 * 4) + B * S * V * (fp32_copy + 3 * 4)
        out["target_logits"] = B * S * V * (b + 4)
    return out


def step_flops(s: StepShape, perf: PerfConfig, device: str, stage: int) -> dict[str, float]:
    """Matmul FLOPs of one micro-batch by component, forward and backward, as the code runs
    them (the tuner's compute term; drafters/dspark/memory.py states the conventions): the
    context projection once, then per unrolled step and layer the 2H-wide q / k / v, o_proj,
    the MLP and the attention (the dense kernel computes every S × S score, flex about the
    causal half and recomputes them in backward), the layers' forward once more under
    perf.activation_checkpointing, and the lm_head over the B·S·T loss rows
    (input gradient only) with the target's logits beside them."""
    B, S, T = s.batch, s.seq_len, s.drafter.ttt_length
    H, F, V, D = s.hidden, s.intermediate, s.vocab, s.head_dim
    q_width, kv_width = s.heads * D, s.kv_heads * D
    N = B * S
    out: dict[str, float] = {"context_projection": 4.0 * N * s.taps * H * H}
    layer = 2 * N * (2 * H * (q_width + 2 * kv_width) + q_width * H + 3 * H * F)
    out["draft_layers"] = 3.0 * T * s.draft_layers * layer
    flex = perf.attn_implementation == "flex" or (
        device == "cuda" and perf.attn_implementation == "auto"
    )
    pairs = B * (S * S / 2 + S * T) if flex else B * S * (S + T)
    factor = 3.5 if flex else 3.0
    out["attention"] = factor * T * s.draft_layers * 4 * D * s.heads * pairs
    if perf.activation_checkpointing:  # each layer's forward again, at every unrolled step
        out[LAYERS_RECOMPUTE] = out["draft_layers"] / 3 + out["attention"] / factor
    rows = N * T
    out["lm_head"] = 4.0 * rows * H * V
    impl = loss_impl_for(perf.loss_impl, zero3=stage == 3)
    # the chunked loss projects the target's state of every loss row; the reference path
    # computes the target's logits once per position
    out["target_logits"] = 2.0 * (rows if impl == "chunked" else N) * H * V
    return out
