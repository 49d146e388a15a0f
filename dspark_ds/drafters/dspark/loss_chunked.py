"""The DSpark loss without [B, A, G, V] tensors: vocabulary work a few anchors at a time.

The reference path (`dspark_ds.drafters.dspark.loss.dspark_loss`) keeps draft logits, target
logits, both softmaxes and their gradients for every anchor alive at once. Here the
vocabulary-sized part (draft logits + Markov bias, aligned target logits, softmaxes, CE,
L1) runs over chunks of blocks, and each chunk's gradient is computed right away:

- the denominators (and so every loss coefficient) depend only on the eval mask, so they
  are known — all-reduced — before any logits exist (`dspark_ds.drafters.dspark.loss.plan_loss`);
- per chunk, the gradient of Σ coef·(w·ce + w·l1) w.r.t. the draft logits is written in
  closed form (CE: p - onehot; L1: p ⊙ (s - <p, s>), s = sign(p_d - p_t)) and pushed through
  `compute_logits` + the Markov head with autograd (any backend, any head type);
- the chunk's V-sized tensors are then freed; what survives is one [.., H] gradient per
  slot and the (small) head-parameter gradients, handed to autograd in `backward`.

Nothing is recomputed, so the FLOPs are those of the reference path. Live memory is
O(chunk × G × V). The per-slot values go to the same `finish_loss` as the reference path,
so loss, metrics and the distributed reduction are shared code.

Shape legend: B batch, A anchors, G block size, V vocab, H hidden, N = rows of a chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from dspark_ds.drafters.common.divergences import (
    divergences_and_grad,
    dpace_weights,
    slot_divergences,
)
from dspark_ds.drafters.dspark.config import DSPARK_LOSS, LossWeights
from dspark_ds.drafters.dspark.loss import LossPlan, SlotTerms, finish_loss, l1_distance, plan_loss
from dspark_ds.drafters.kind import StepOutput
from dspark_ds.drafters.perf import CHUNK_ANCHORS_CPU


def draft_logits(model: nn.Module, hidden_cGH: torch.Tensor, prev_cG: torch.Tensor) -> torch.Tensor:
    """Draft logits + Markov bias of a chunk of blocks ([c, G, H], [c, G] -> [c, G, V])."""
    logits = model.compute_logits(hidden_cGH)
    markov = model.markov_head
    if markov is None:
        return logits
    if markov.init_state(hidden_cGH[..., 0, :]) is None:
        # A stateless head (vanilla, gated): every slot's bias is the same `_step` on
        # its own inputs, so all G slots go through at once. NOTE: the slot loop of
        # apply_block_logits would, in backward, build a zero-filled [.., G, V] gradient
        # per slot and run the W2 gradient G times with K = chunk rows.
        _, bias = markov._step(None, prev_cG, hidden_cGH)
        return logits + bias.to(logits.dtype)
    return markov.apply_block_logits(logits, token_ids=prev_cG, hidden_states=hidden_cGH)


class _VocabChunks(torch.autograd.Function):
    """Forward: per-slot CE / L1 / greedy hits and the weighted CE + L1 loss; the gradients
    are computed during forward, chunk by chunk, and only replayed in backward."""

    @staticmethod
    def forward(ctx, runner: _ChunkRunner, hidden, *params):
        main_loss, terms, grads = runner.run(hidden, params)
        ctx.grads = grads
        ctx.mark_non_differentiable(*terms)
        return (main_loss, *terms)

    @staticmethod
    def backward(ctx, grad_main, *_unused):
        grads = ctx.grads
        ctx.grads = None  # NOTE: free the stored gradients; a second backward is an error.
        if grads is None:
            raise RuntimeError("chunked loss: backward called twice (retain_graph unsupported)")
        scaled = [None if g is None else g * grad_main.to(g.dtype) for g in grads]
        return (None, *scaled)


class _ChunkRunner:
    """Everything the chunks need besides the differentiable inputs."""

    def __init__(
        self,
        model: nn.Module,
        plan: LossPlan,
        prev_token_ids: torch.Tensor,
        target_ids: torch.Tensor,
        target_prev_hidden: torch.Tensor | None,
        chunk_anchors: int,
        with_grad: bool,
    ):
        self.model = model
        self.plan = plan
        self.prev_ids = prev_token_ids
        self.target_ids = target_ids
        self.target_prev_hidden = target_prev_hidden
        self.chunk_anchors = chunk_anchors
        self.with_grad = with_grad

    def run(self, hidden_BAGH: torch.Tensor, params: tuple[torch.Tensor, ...]):
        plan = self.plan
        bsz, num_blocks, G, H = hidden_BAGH.shape
        # Flatten B x A: chunks run over blocks of every sample alike.
        hidden = hidden_BAGH.reshape(bsz * num_blocks, G, H)
        prev = self.prev_ids.reshape(-1, G)
        ids = self.target_ids.reshape(-1)
        target_state = self.target_prev_hidden
        if target_state is not None:
            target_state = target_state.reshape(bsz * num_blocks, G, -1)
        # D-PACE: the weights are the chunk's own (its CE's), set once the CE is known
        dpace = plan.dpace_alpha is not None
        w = torch.ones_like(plan.w.reshape(-1)) if dpace else plan.w.reshape(-1)
        a_ce = w * plan.coef_ce  # d(main_loss)/d(ce) per slot
        a_l1 = w * plan.coef_l1 if plan.use_l1 else None
        w_out = w.clone()
        valid = plan.valid.reshape(-1)

        ce_out = torch.empty(ids.shape, dtype=torch.float32, device=hidden.device)
        l1_out = torch.empty_like(ce_out) if target_state is not None else None
        extra_out = {n: torch.empty_like(ce_out) for n in plan.coef_terms if l1_out is not None}
        hit_out = torch.empty(ids.shape, dtype=torch.bool, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if self.with_grad else None
        grad_params: list[torch.Tensor | None] = [None] * len(params)

        for b0 in range(0, hidden.shape[0], self.chunk_anchors):
            b1 = min(b0 + self.chunk_anchors, hidden.shape[0])
            r0, r1 = b0 * G, b1 * G
            h = hidden[b0:b1].detach().requires_grad_(self.with_grad)
            with torch.set_grad_enabled(self.with_grad):
                logits = draft_logits(self.model, h, prev[b0:b1])
            target_logits = None
            if target_state is not None:
                # Differentiable only if target_logits has trainable parameters (a frozen
                # lm_head, the normal case, makes this a plain forward).
                with torch.set_grad_enabled(self.with_grad):
                    target_logits = self.model.target_logits(target_state[b0:b1])
            target_grad = target_logits is not None and target_logits.requires_grad

            def weigh(ce_N, r0=r0, r1=r1):
                w_out[r0:r1] = dpace_weights(
                    ce_N.view(-1, G), valid[r0:r1].view(-1, G), plan.dpace_alpha
                ).view(-1)
                return w_out[r0:r1]

            grad_logits, grad_target = _slot_terms_and_grad(
                logits.detach().reshape(r1 - r0, -1),
                None if target_logits is None else target_logits.detach().reshape(r1 - r0, -1),
                ids[r0:r1],
                a_ce[r0:r1] if self.with_grad else None,
                None if (a_l1 is None or not self.with_grad) else a_l1[r0:r1],
                ce_out[r0:r1],
                None if l1_out is None else l1_out[r0:r1],
                hit_out[r0:r1],
                target_grad=target_grad,
                weigh=weigh if dpace else None,
            )
            if extra_out:
                grad_logits, grad_target = self._terms(
                    logits, target_logits, w_out[r0:r1], extra_out, (r0, r1), target_grad,
                    grad_logits, grad_target,
                )  # fmt: skip
            if self.with_grad:
                got = _push_back(logits, target_logits, grad_logits, grad_target, (h, *params))
                grad_hidden[b0:b1] += got[0]
                for i, g in enumerate(got[1:]):
                    if g is None:
                        continue
                    if grad_params[i] is None:
                        grad_params[i] = g.float()
                    else:  # NOTE: in place: a [V, r] Markov gradient per chunk otherwise
                        grad_params[i].add_(g)
                del got
            del logits, target_logits, grad_logits, grad_target

        grads = None
        if self.with_grad:
            grads = [grad_hidden.view_as(hidden_BAGH).to(hidden_BAGH.dtype)]
            grads += [None if g is None else g.to(p.dtype) for g, p in zip(grad_params, params)]
        return (*self._outputs(w_out, ce_out, hit_out, l1_out, extra_out), grads)

    def _outputs(self, w, ce, hit, l1, extra):
        """main_loss = Σ coef·w·(ce, l1, each term), and the per-slot terms in the order
        `chunked_dspark_loss` reads them: ce, hits, then l1 and the terms when computed."""
        plan = self.plan
        main = plan.coef_ce * (ce * w).sum()
        if plan.use_l1:
            main = main + plan.coef_l1 * (l1 * w).sum()
        for name, value in extra.items():
            main = main + plan.coef_terms[name] * (value * w).sum()
        shape = self.target_ids.shape
        tail = () if l1 is None else (l1, *extra.values())
        return main, tuple(t.view(shape) for t in (ce, hit, *tail))

    def _terms(self, logits, target_logits, w_N, extra_out, rows, target_grad, g_draft, g_target):
        """The distribution terms of a chunk: fills `extra_out`; adds their gradient (of
        Σ coef·w·term) to the CE + L1 one of the draft logits and, when `target_grad`, of the
        target logits."""
        r0, r1 = rows
        coefs = self.plan.coef_terms
        row_coefs = {n: w_N * c for n, c in coefs.items()} if self.with_grad else None
        values, g_d, g_t = divergences_and_grad(
            logits.detach().reshape(r1 - r0, -1),
            target_logits.detach().reshape(r1 - r0, -1),
            coefs,
            lk_eta=self.plan.lk_eta,
            row_coefs=row_coefs,
            target_grad=target_grad,
        )
        for name, value in values.items():
            extra_out[name][r0:r1] = value
        if g_d is not None:
            g_draft = g_draft.add_(g_d)
        if g_t is not None:
            g_target = g_t if g_target is None else g_target.add_(g_t)
        return g_draft, g_target


def _push_back(logits, target_logits, grad_logits, grad_target, inputs):
    """The chunk's logit gradients pushed through the heads: the gradients of `inputs`.

    NOTE: a function of its own: the lists hold this chunk's [N, V] logits and gradient, and
    left alive they would sit beside the next chunk's until its autograd.grad."""
    outputs, grad_outputs = [logits], [grad_logits.to(logits.dtype).view_as(logits)]
    if grad_target is not None:
        outputs.append(target_logits)
        grad_outputs.append(grad_target.to(target_logits.dtype).view_as(target_logits))
    return torch.autograd.grad(outputs, inputs, grad_outputs=grad_outputs, allow_unused=True)


@torch.no_grad()
def _slot_terms_and_grad(
    logits_NV: torch.Tensor,
    target_logits_NV: torch.Tensor | None,
    ids_N: torch.Tensor,
    a_ce_N: torch.Tensor | None,
    a_l1_N: torch.Tensor | None,
    ce_out: torch.Tensor,
    l1_out: torch.Tensor | None,
    hit_out: torch.Tensor,
    target_grad: bool = False,
    weigh=None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Fills the per-slot CE, L1 and greedy hits; returns d(a_ce·ce + a_l1·l1)/d(logits)
    and, when `target_grad`, d(a_l1·l1)/d(target logits) (None otherwise). `weigh`: the
    per-slot weights of the CE just computed (D-PACE's), which a_ce and a_l1 are multiplied by.

    Written with few full passes over [N, V] and in-place updates: on CPU this part is
    memory-bound, and the chunk is sized to stay in cache.
    """
    d = logits_NV.float()
    hit_out.copy_(d.argmax(-1) == ids_N)
    p = torch.log_softmax(d, dim=-1)
    ce_out.copy_(-p.gather(-1, ids_N.unsqueeze(-1)).squeeze(-1))
    if weigh is not None:
        w_N = weigh(ce_out)
        a_ce_N = None if a_ce_N is None else a_ce_N * w_N
        a_l1_N = None if a_l1_N is None else a_l1_N * w_N
    p.exp_()  # log p -> p, in place
    neg_s = q = None
    if target_logits_NV is not None:
        # q - p_d, then its L1 norm = Σ|p_d - p_t|; the sign of (p_t - p_d) is -s.
        q = torch.softmax(target_logits_NV.float(), dim=-1)
        neg_s = q - p if target_grad else q.sub_(p)
        l1_out.copy_(torch.linalg.vector_norm(neg_s, ord=1, dim=-1))
    if a_ce_N is None:
        return None, None
    grad_target = None
    if a_l1_N is not None:
        neg_s.sign_()
        if target_grad:
            # d l1 / d target = q ⊙ (-s - <q, -s>).
            q_dot = (q.unsqueeze(1) @ neg_s.unsqueeze(2)).view(-1, 1)
            grad_target = (neg_s - q_dot).mul_(q).mul_(a_l1_N.unsqueeze(-1))
        # d l1 / d logits = p ⊙ (s - <p, s>) = p ⊙ (<p, -s> - (-s)).
        p_dot_neg_s = (p.unsqueeze(1) @ neg_s.unsqueeze(2)).view(-1)
        row = (a_ce_N + a_l1_N * p_dot_neg_s).unsqueeze(-1)
        grad = neg_s.mul_(-a_l1_N.unsqueeze(-1)).add_(row).mul_(p)
    else:
        grad = p.mul_(a_ce_N.unsqueeze(-1))
    # d ce / d logits = p - onehot(target).
    grad.scatter_add_(-1, ids_N.unsqueeze(-1), -a_ce_N.unsqueeze(-1))
    return grad, grad_target


def _plan(
    feats, confidence_pred, weights: LossWeights, chunk_anchors: int, over_ranks: bool
) -> LossPlan:
    if chunk_anchors < 1:
        raise ValueError(f"loss_chunk_anchors: must be >= 1, got {chunk_anchors}")
    return plan_loss(
        feats.eval_mask,
        weights,
        has_aligned=feats.target_prev_hidden is not None,
        has_confidence=confidence_pred is not None,
        over_ranks=over_ranks,
    )


def chunked_dspark_loss(
    model: nn.Module,
    feats,
    confidence_pred: torch.Tensor | None,
    weights: LossWeights = DSPARK_LOSS,
    *,
    chunk_anchors: int = CHUNK_ANCHORS_CPU,
    over_ranks: bool = True,
    recompute: bool = False,
    pad_to_blocks: int = 0,
) -> StepOutput:
    """`dspark_loss` on `model.forward_hidden(...)` output (`feats`), chunked.

    Same loss, metric sums and gradients as the reference path (to fp32 rounding). The caller
    backpropagates once (no retain_graph / double backward).

    `recompute` (ZeRO-3): the same chunks, differentiated by plain autograd, each chunk under
    `torch.utils.checkpoint` (its V-sized tensors recomputed in backward). Every parameter is
    reached through a module call (lm_head, Markov, confidence), forward and recompute alike,
    so ZeRO-3's hooks gather and release partitioned weights as in any activation-checkpointed
    model; the fused path instead hands autograd gradients of parameters it differentiated
    itself. The price: the chunk's logits are computed twice. Live memory stays
    O(chunk × G × V).

    `pad_to_blocks` (with `recompute`): run as many chunks as that many blocks take, the last
    ones empty. NOTE: under ZeRO-3 every rank must call the heads equally often (each call
    gathers their partitioned weights with the other ranks); ranks that dropped different
    numbers of empty blocks pad to the count they all share (the micro-batch's rows ×
    num_anchors).
    """
    plan = _plan(feats, confidence_pred, weights, chunk_anchors, over_ranks)
    if recompute:
        terms, main = _recomputed_terms(model, feats, plan, chunk_anchors, pad_to_blocks), None
    else:
        terms, main = _fused_terms(model, feats, plan, chunk_anchors)
    return finish_loss(
        plan,
        terms,
        eval_mask=feats.eval_mask,
        block_keep_mask=feats.block_keep_mask,
        confidence_pred=confidence_pred,
        main_loss=main,
    )


def _fused_terms(model: nn.Module, feats, plan: LossPlan, chunk_anchors: int):
    """(The per-slot terms, the CE + L1 + terms part of the loss) with each chunk's gradient
    computed right away (`_VocabChunks`)."""
    # Every trainable parameter is offered to the chunk's autograd.grad (unused ones get
    # None), so a backend whose compute_logits has its own parameters stays correct.
    params = tuple(p for p in model.parameters() if p.requires_grad)
    with_grad = torch.is_grad_enabled() and (feats.hidden.requires_grad or bool(params))
    runner = _ChunkRunner(
        model,
        plan,
        feats.prev_token_ids,
        feats.target_ids,
        feats.target_prev_hidden,
        chunk_anchors,
        with_grad,
    )
    if with_grad:
        main, ce, hit, *rest = _VocabChunks.apply(runner, feats.hidden, *params)
    else:
        main, (ce, hit, *rest), _ = runner.run(feats.hidden, params)
    has_l1 = feats.target_prev_hidden is not None
    terms = SlotTerms(
        ce=ce,
        l1=rest[0] if has_l1 else None,
        greedy_hit=hit,
        extra=dict(zip(plan.coef_terms, rest[1:])) if has_l1 else {},
    )
    return terms, main


def _chunk_terms(model, hidden_cGH, prev_cG, ids_cG, target_state_cGH, names=(), lk_eta=0.0):
    """Per-slot CE, L1, greedy hits and the distribution terms `names` of a chunk of blocks,
    with plain autograd ops."""
    logits = draft_logits(model, hidden_cGH, prev_cG)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    ids = ids_cG.reshape(-1)
    ce = F.cross_entropy(flat, ids, reduction="none")
    with torch.no_grad():
        hit = flat.argmax(-1) == ids
    l1 = None
    extra = ()
    if target_state_cGH is not None:
        target = model.target_logits(target_state_cGH).reshape(flat.shape)
        l1 = l1_distance(flat, target)
        terms = slot_divergences(flat, target, names, lk_eta=lk_eta)
        extra = tuple(terms[n] for n in names)
    return ce, l1, hit, *extra


def _recomputed_terms(model: nn.Module, feats, plan: LossPlan, chunk_anchors, pad_to_blocks):
    """The per-slot terms, each chunk under `torch.utils.checkpoint` while grad is enabled."""
    bsz, num_blocks, G, H = feats.hidden.shape
    hidden = feats.hidden.reshape(bsz * num_blocks, G, H)
    prev = feats.prev_token_ids.reshape(-1, G)
    ids = feats.target_ids.reshape(-1, G)
    target_state = feats.target_prev_hidden
    if target_state is not None:
        target_state = target_state.reshape(bsz * num_blocks, G, -1)
    recompute = torch.is_grad_enabled()
    names = tuple(plan.coef_terms) if target_state is not None else ()
    ce, l1, hit, extra = [], [], [], {n: [] for n in names}
    for b0 in range(0, max(hidden.shape[0], pad_to_blocks), chunk_anchors):
        chunk = slice(b0, b0 + chunk_anchors)
        args = (
            model,
            hidden[chunk],
            prev[chunk],
            ids[chunk],
            None if target_state is None else target_state[chunk],
            names,
            plan.lk_eta,
        )
        if recompute:
            # NOTE: ZeRO-3 releases a frozen head weight (the target's lm_head) after each call,
            # so the recomputed chunk saved it empty; its backward gathers it again before use.
            # torch's check of the recomputed tensors' shapes would refuse the empty one.
            out = torch.utils.checkpoint.checkpoint(
                _chunk_terms, *args, use_reentrant=False, determinism_check="none"
            )
        else:
            out = _chunk_terms(*args)
        ce.append(out[0])
        l1.append(out[1])
        hit.append(out[2])
        for name, value in zip(names, out[3:]):
            extra[name].append(value)
    shape = feats.target_ids.shape
    return SlotTerms(
        ce=torch.cat(ce).view(shape),
        l1=None if target_state is None else torch.cat(l1).view(shape),
        greedy_hit=torch.cat(hit).view(shape),
        extra={n: torch.cat(v).view(shape) for n, v in extra.items()},
    )
