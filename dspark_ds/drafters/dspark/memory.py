"""Activation memory of one DSpark / DFlash training micro-batch, from what autograd keeps
(the kind's `activation_bytes`, which `dspark-ds tune` adds to the ZeRO states).

The peak of a micro-batch is reached while the loss runs (forward or backward of its
vocabulary-sized part) or, for small vocabularies, in the first layer backward. At that point
memory holds: the batch (the target's features), every tensor the draft layers saved for their
backward, and the loss's own working set. Each term below follows the code it models, op by
op, and says what autograd saves there (S context tokens, T = B·A·γ draft tokens, b bytes of
the compute dtype, fp32 where the code upcasts):

- RMSNorm (transformers' Qwen3RMSNorm, on N rows of width W): the fp32 input (4NW), the
  normalised value in the compute dtype (bNW), the fp32 rsqrt (4N); its output (bNW) when a
  linear layer takes it (a Linear saves its input).
- a draft layer: input RMSNorm (H) + q / k RMSNorms per head (D) + the attention's own saves
  + o_proj's input + post-attention RMSNorm + the MLP (gate and up outputs, SiLU output, the
  product: 4·b·T·F); per layer also the context keys' RMSNorm (k_norm over S·Hkv rows).
- attention: "blockwise" and "flex" save q, k, v, the output and an fp32 log-sum-exp per query
  and head (flex's backward recomputes scores from them like the blockwise kernel); "dense"
  (SDPA with a boolean mask: the fused CPU kernel, the memory-efficient CUDA kernel) saves q,
  k and v repeated to every query head (GQA), the output, the log-sum-exp and the mask
  converted to an additive bias [B, 1, A·γ, S + A·γ] in the compute dtype.
- the loss: "reference" saves three fp32 [T, V] tensors (the CE's log-softmax, the draft
  softmax and the p_d - p_t difference of the L1 term); its peak adds the live logits of the
  L1 term in forward (draft and target logits in the compute dtype, their fp32 copies, the
  target softmax) or, in backward, the fp32 gradients flowing back to the logits. "chunked"
  keeps the hidden-state gradient (fp32 [T, H]) and per chunk of c·γ rows the logits, their
  fp32 copy, the softmaxes and the gradient; "recompute" saves nothing vocabulary-sized and
  holds, in backward, one chunk of the reference path's tensors.

`tests/unit/test_tuner_activations.py` checks `saved_bytes` against the bytes autograd actually
saves (saved_tensors_hooks) and `activation_bytes` against the peak of live tensors measured by
the profiler, on CPU, at several shapes, both dtypes, every attention and loss path.
"""

from __future__ import annotations

from dataclasses import dataclass

from dspark_ds.drafters.common.memory import LAYERS_RECOMPUTE, StepShape
from dspark_ds.drafters.dspark.step import loss_impl_for
from dspark_ds.drafters.perf import PerfConfig

ATTENTIONS = ("flex", "blockwise", "dense")
LOSSES = ("reference", "chunked", "recompute")


@dataclass(frozen=True)
class DSparkShape:
    """DSpark's part of a `StepShape` (`StepShape.drafter`): the blocks and the heads."""

    num_anchors: int
    """A: anchor blocks per sequence."""
    block_size: int
    """γ: tokens per block."""
    markov_rank: int
    """r of the Markov head; 0 = none (DFlash)."""
    markov_head_type: str = "vanilla"
    """The Markov head's form: vanilla | gated | rnn."""
    confidence_head: bool = True
    """The confidence head is trained."""

    @classmethod
    def of(cls, model) -> DSparkShape:
        """From the run's `model` section."""
        return cls(
            num_anchors=model.num_anchors,
            block_size=model.block_size,
            markov_rank=model.markov_rank,
            markov_head_type=model.markov_head_type,
            confidence_head=model.confidence_head_alpha > 0,
        )


def draft_tokens(s: StepShape) -> int:
    """T = B·A·γ draft slots of a step (at most one anchor per position)."""
    return s.batch * min(s.drafter.num_anchors, s.seq_len) * s.drafter.block_size


def _rms_norm(rows: float, width: int, b: int, feeds_linear: bool) -> float:
    return (
        4 * rows * width + b * rows * width + 4 * rows + (b * rows * width if feeds_linear else 0)
    )


def layer_saves(shape: StepShape, attn: str) -> float:
    """Bytes one draft layer's forward saves for its backward (its norms, the attention's own
    saves, o_proj's input, the MLP)."""
    if attn not in ATTENTIONS:
        raise ValueError(f"attn: expected one of {ATTENTIONS}, got {attn!r}")
    s, b = shape, shape.compute_bytes
    T, C = draft_tokens(s), s.context_tokens
    H, F, D = s.hidden, s.intermediate, s.head_dim
    q_width, kv_width = s.heads * D, s.kv_heads * D
    keys = C + T  # [context; drafts] per layer
    layer = (
        _rms_norm(T, H, b, feeds_linear=True)  # input_layernorm
        + _rms_norm(T * s.heads, D, b, feeds_linear=False)  # q_norm
        + _rms_norm(T * s.kv_heads, D, b, feeds_linear=False)  # k_norm, draft keys
        + _rms_norm(C * s.kv_heads, D, b, feeds_linear=False)  # k_norm, context keys
        + b * T * q_width  # o_proj's input
        + _rms_norm(T, H, b, feeds_linear=True)  # post_attention_layernorm
        + 4 * b * T * F  # MLP: gate and up outputs, SiLU output, their product
    )
    if attn == "dense":
        attention = (
            2 * b * T * q_width  # q, output
            + 2 * b * keys * q_width  # k, v repeated to every query head
            + 4 * T * s.heads  # log-sum-exp
            + b * _mask_elements(s)  # the mask as an additive bias
        )
    else:
        attention = 2 * b * T * q_width + 2 * b * keys * kv_width + 4 * T * s.heads
    return layer + attention


def _mask_elements(s: StepShape) -> int:
    """[B, 1, A·γ, S + A·γ]: the dense path's mask."""
    q_len = draft_tokens(s) // s.batch
    return s.batch * q_len * (s.seq_len + q_len)


def saved_bytes(shape: StepShape, attn: str, recompute: bool = False) -> dict[str, float]:
    """Bytes the drafter's forward (up to the loss) keeps for backward, by component.

    With `recompute` (perf.activation_checkpointing) each draft layer keeps only its input
    h [T, H] (the checkpoint holds its arguments to run it again; the context, RoPE and, dense,
    the boolean mask are shared by every layer and kept once)."""
    if attn not in ATTENTIONS:
        raise ValueError(f"attn: expected one of {ATTENTIONS}, got {attn!r}")
    s, b = shape, shape.compute_bytes
    T, C, H, D = draft_tokens(s), s.context_tokens, s.hidden, s.head_dim
    out: dict[str, float] = {}
    # the context: fc's input is the batch itself; hidden_norm's output is every layer's k/v input
    out["context_norm"] = _rms_norm(C, H, b, feeds_linear=True)
    # RoPE's cos and sin of the context and draft positions, shared by every layer
    out["rope"] = 2 * (C + T) * D * b
    if recompute:
        out["draft_layers"] = s.draft_layers * b * T * H
        if attn == "dense":
            out["mask"] = float(_mask_elements(s))  # boolean, one byte per element
    else:
        out["draft_layers"] = s.draft_layers * layer_saves(s, attn)
    out["final_norm"] = _rms_norm(T, H, b, feeds_linear=False)
    return out


def loss_bytes(shape: StepShape, loss: str, chunk_anchors: int) -> dict[str, float]:
    """The loss's working set at its peak (vocabulary-sized tensors and what goes with them)."""
    if loss not in LOSSES:
        raise ValueError(f"loss: expected one of {LOSSES}, got {loss!r}")
    s, b = shape, shape.compute_bytes
    T, V, H, r = draft_tokens(s), s.vocab, s.hidden, s.drafter.markov_rank
    half = b < 4  # bf16: fp32 copies of the logits where the code upcasts
    out: dict[str, float] = {}
    # the confidence head's input (hidden and the Markov embedding of the previous token)
    out["heads"] = b * T * (H + r) if s.drafter.confidence_head else 0.0
    if loss == "reference":
        # saved: log-softmax, p_d, p_d - p_t (fp32); live at the peak: p_t (fp32), draft and
        # target logits (compute dtype) and, under bf16, no extra copy (freed after softmax)
        out["logits"] = (12 + 4 + 2 * b) * T * V
        return out
    rows = min(chunk_anchors * s.drafter.block_size, T)
    if loss == "chunked":
        # per chunk: logits, target logits (+ their fp32 copies under bf16), p, q; or, inside
        # autograd.grad, logits, target logits and the gradient (+ its cast), with the Markov
        # weights' new gradients beside their fp32 accumulators
        computing = (2 * b + 8 + (8 if half else 0)) * rows * V + 8 * r * V
        backward = (2 * b + 4 + (b if half else 0)) * rows * V + 16 * r * V
        out["logits_chunk"] = max(computing, backward)
        out["grad_hidden"] = (4 + b) * T * H  # the fp32 accumulator and its cast
        return out
    # recompute: one chunk of the reference path, recomputed in backward, and the Markov
    # weights' gradients of that chunk (dense [V, r] each)
    out["logits_chunk"] = 24 * rows * V + 2 * b * r * V
    return out


def attention_backward_bytes(shape: StepShape, attn: str, chunk_blocks: int = 16) -> float:
    """The attention backward's own transients (the loss's tensors are gone by then).

    Every path: the gradients of q, k and v (dense: k and v repeated to every head).
    blockwise also holds one chunk of `chunk_blocks` blocks at a time: its recomputed
    probabilities and their gradient over [context up to the chunk's last anchor; own block]
    (the last chunk's reaches the whole sequence), 12 bytes per score under fp32 and 10 under
    bf16 (measured with the profiler on CPU; one chunk's are freed before the next chunk's
    exist, so the count of chunks does not matter)."""
    s, b = shape, shape.compute_bytes
    T, keys = draft_tokens(s), s.context_tokens + draft_tokens(s)
    q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
    width = q_width if attn == "dense" else kv_width
    grads = b * (T * q_width + 2 * keys * width)
    if attn == "blockwise":
        rows = s.batch * s.heads * min(chunk_blocks, s.drafter.num_anchors) * s.drafter.block_size
        return grads + (12 if b == 4 else 10) * rows * (s.seq_len + s.drafter.block_size)
    return grads + 4 * T * s.heads


def micro_batch_bytes(
    shape: StepShape, attn: str, loss: str, chunk_anchors: int, recompute: bool = False
) -> dict[str, float]:
    """Peak bytes of one micro-batch above the weights, gradients and optimizer state, by
    component: the batch's features, what the drafter keeps for backward, and the larger of
    the loss's working set and the last layer's backward (they never overlap: the loss's
    tensors are freed before the layers' backward starts; by the last layer's attention
    backward its MLP, o_proj and norms' saves and the final norm's are freed). With `recompute`
    the layers keep their inputs only, and the last layer's backward holds its recomputed
    saves besides its attention backward's transients."""
    s = shape
    out = {"features_in": s.features_in()}
    out.update(saved_bytes(s, attn, recompute))
    loss_part = loss_bytes(s, loss, chunk_anchors)
    layer_part = last_layer_backward_bytes(s, attn, recompute)
    if sum(loss_part.values()) >= layer_part:
        out.update(loss_part)
    else:
        out["recomputed_layer" if recompute else "layer_backward"] = layer_part
    return out


def last_layer_backward_bytes(shape: StepShape, attn: str, recompute: bool = False) -> float:
    """What the last draft layer's backward holds beyond the saves `saved_bytes` counts (the
    final norm's are freed by then): the larger of its MLP's backward (the gradients of the
    gate and up outputs beside its saves) and its attention's backward (`attention_backward_
    bytes`, once its MLP, o_proj and post-attention norm's saves are freed). With `recompute`
    the layer's own saves exist again while it runs backward."""
    s, b = shape, shape.compute_bytes
    T, H, F = draft_tokens(s), s.hidden, s.intermediate
    final_norm = _rms_norm(T, H, b, feeds_linear=False)
    mlp_backward = 2 * b * T * F
    freed = (
        _rms_norm(T, H, b, feeds_linear=True)  # post_attention_layernorm
        + 4 * b * T * F  # the MLP
        + b * T * s.heads * s.head_dim  # o_proj's input
    )
    attention = attention_backward_bytes(s, attn) - freed
    own = layer_saves(s, attn) if recompute else 0.0
    return own - final_norm + max(mlp_backward, attention)


def activation_bytes(
    shape: StepShape, perf: PerfConfig, device: str, stage: int
) -> dict[str, float]:
    """`micro_batch_bytes` for a run's shape and perf section on `device` (cuda | cpu) at ZeRO
    `stage`, resolving "auto" as training does (the kind's `activation_bytes`)."""
    attn, loss = _paths(perf, device, stage, shape)
    return micro_batch_bytes(
        shape, attn, loss, perf.chunk_anchors(device), perf.activation_checkpointing
    )


def _paths(perf: PerfConfig, device: str, stage: int, shape: StepShape) -> tuple[str, str]:
    """(attention, loss) paths training takes on `device` at ZeRO `stage` (the one the
    drafter's layers force, if any)."""
    attn = shape.attention or perf.attn_implementation
    if attn == "auto":  # the drafter's own rule (DSparkDraftModel.resolve_attn_implementation)
        attn = "flex" if device == "cuda" else "blockwise"
    return attn, loss_impl_for(perf.loss_impl, zero3=stage == 3)


# ---- FLOPs (the tuner's compute term) ----------------------------------------------------------
# Matmul FLOPs one micro-batch executes, forward and backward (2 per multiply-add), as the code
# runs them: a Linear whose weight trains costs 3x its forward (input and weight gradients), the
# frozen lm_head 2x (input gradient only), the target's aligned logits 1x (no gradient); the
# attention counts the (query, key) pairs the kernel computes. Elementwise work (softmaxes,
# norms, the loss's vocabulary-sized terms) is not counted: it is inside the sustained rate the
# tuner divides by. `tests/multiprocess/test_tuner_speed.py` checks the sum against torch's FLOP formulas.
def attention_pairs(shape: StepShape, attn: str, chunk_blocks: int = 16) -> float:
    """(query, key) pairs one layer's attention computes per head.

    blockwise: per chunk of `chunk_blocks` anchors (sorted), every query row of the chunk
    against the context up to the chunk's last anchor plus its own block: anchors spread
    over the sequence put chunk j's last one near (j + 1)/n of it; flex: its visible
    pairs (about half the context on average); dense: every query against S + A·γ keys."""
    s = shape
    T, G, S = draft_tokens(s), s.drafter.block_size, s.seq_len
    A = min(s.drafter.num_anchors, S)
    if attn == "dense":
        return float(T * (S + A * G))
    if attn == "blockwise":
        n = -(-A // chunk_blocks)
        return float(T * (S * (n + 1) / (2 * n) + G))
    return float(T * (S / 2 + G))


def micro_batch_flops(
    shape: StepShape, attn: str, loss: str, recompute: bool = False
) -> dict[str, float]:
    """FLOPs of one micro-batch by component (see above); `recompute`
    (perf.activation_checkpointing): the draft layers' forward runs again in backward."""
    s = shape
    T, C = draft_tokens(s), s.context_tokens
    H, F, V, D, r = s.hidden, s.intermediate, s.vocab, s.head_dim, s.drafter.markov_rank
    q_width, kv_width = s.heads * D, s.kv_heads * D
    out: dict[str, float] = {}
    # fc: the features are the batch (no input gradient)
    out["context_projection"] = 4.0 * C * s.taps * H * H
    layer = (
        2 * T * H * (q_width + 2 * kv_width)  # q, k, v of the draft tokens
        + 2 * C * H * 2 * kv_width  # k, v of the context
        + 2 * T * q_width * H  # o_proj
        + 6 * T * H * F  # gate, up, down
    )
    out["draft_layers"] = 3.0 * s.draft_layers * layer
    # forward QK^T + PV; backward: dense 2x that, blockwise / flex also recompute the scores
    factor = 3.0 if attn == "dense" else 3.5
    out["attention"] = factor * s.draft_layers * 4 * D * s.heads * attention_pairs(s, attn)
    out["lm_head"] = 4.0 * T * H * V
    out["target_logits"] = 2.0 * T * H * V if s.aligned else 0.0
    if r > 0:
        out["markov"] = 6.0 * T * r * V
        if s.drafter.markov_head_type == "gated":
            out["markov"] += 6.0 * T * (H + r) * r
        elif s.drafter.markov_head_type == "rnn":
            out["markov"] += 6.0 * T * (2 * r + H) * 3 * r
    if s.drafter.confidence_head:
        out["confidence_head"] = 6.0 * T * (H + r)
    if recompute:  # each layer's forward again: its matmuls and the attention's forward
        out[LAYERS_RECOMPUTE] = out["draft_layers"] / 3 + out["attention"] / factor
    if loss == "recompute":
        # each chunk's forward (draft logits, Markov bias, target logits) runs again in backward
        out["loss_recompute"] = 2.0 * T * H * V + (2.0 * T * r * V if r > 0 else 0.0)
        out["loss_recompute"] += out["target_logits"]
    return out


def step_flops(shape: StepShape, perf: PerfConfig, device: str, stage: int) -> dict[str, float]:
    """`micro_batch_flops` for a run's shape and perf section on `device` at ZeRO `stage` (the
    attention and loss paths training takes there; the kind's `step_flops`)."""
    attn, loss = _paths(perf, device, stage, shape)
    return micro_batch_flops(shape, attn, loss, perf.activation_checkpointing)
