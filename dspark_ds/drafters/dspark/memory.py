"""Activation memory of one DSpark / DFlash training step, by component (for `dspark-ds tune`).

Forward-saved tensors plus the largest backward transient of one micro-batch (B × S):
features in, the context projection, per draft layer the A·γ draft tokens and the attention over
[context; block], and the vocabulary-sized tensors: draft / Markov-corrected / target logits over
B·A·γ·V and their fp32 softmaxes, log-softmax and |p_d - p_t| (the chunked loss holds only
loss_chunk_anchors·γ·V of them at a time), plus their gradients in the backward.
"""

from __future__ import annotations

from dspark_ds.drafters.common.memory import StepShapes
from dspark_ds.drafters.dspark.step import loss_impl_for
from dspark_ds.drafters.presets import DrafterConfig
from dspark_ds.perf.config import PerfConfig


def activation_bytes(
    s: StepShapes, model: DrafterConfig, perf: PerfConfig, device: str, stage: int
) -> dict[str, float]:
    """Peak activation bytes of one micro-batch by component; `device` cuda | cpu, `stage` the
    ZeRO stage (it decides the loss path, as in training)."""
    b, B, S = s.compute_bytes, s.batch, s.seq_len
    A, G = model.num_anchors, model.block_size
    H, F, V = s.hidden, s.intermediate, s.vocab
    Q = min(A, S) * G  # draft tokens per sequence (at most one anchor per position)
    kv = s.kv_heads * s.head_dim
    qd = s.heads * s.head_dim
    out: dict[str, float] = {}
    out["features_in"] = s.features_in()
    out["context_proj"] = B * S * H * b * 3  # fc out, norm in/out
    per_layer_tokens = B * Q * (6 * H + 2 * qd + 3 * F) * b  # norms, q, attn out, mlp
    per_layer_kv = B * (S + Q) * 4 * kv * b  # k, v before / after norm + rope
    if device == "cuda" or perf.attn_implementation in ("auto", "blockwise"):
        # flex_attention (CUDA) and the blockwise kernel (elsewhere) keep only the output and
        # a log-sum-exp per query and head; probabilities are recomputed in backward
        per_layer_attn = B * Q * (qd * b + s.heads * 4)
    else:
        # scores + probabilities (fp32) over [context; own block] for every draft token
        per_layer_attn = B * s.heads * Q * (S + G) * 4 * 2
    out["draft_layers"] = s.draft_layers * (per_layer_tokens + per_layer_kv + per_layer_attn)
    impl = loss_impl_for(perf.loss_impl, zero3=stage == 3)
    rows = B * Q
    if impl != "reference":
        rows = min(rows, perf.loss_chunk_anchors * G)
    # at the peak (inside the L1 term): the Markov-corrected draft logits and the aligned target
    # logits (compute dtype), the fp32 log-softmax saved by the CE, the softmaxes of draft and
    # target and their difference (fp32), plus the fp32 copy of the draft logits under bf16.
    # The backward frees these saved tensors as it creates the logits' gradients, so it does
    # not add another full set.
    # The fused chunked loss (loss_chunked.py) works in place: per chunk the draft and target
    # logits, p_d and p_t (fp32; the gradient overwrites them), plus the fp32 copy under bf16;
    # its recompute form holds what the reference path holds, for one chunk.
    fp32_buffers = 2 if impl == "chunked" else 4
    out["logits_softmax"] = rows * V * (2 * b + 4 * fp32_buffers + (4 if b == 2 else 0))
    out["markov_confidence"] = B * Q * (2 * model.markov_rank + H) * b
    return out
