"""The Eagle3 baseline drafter (EAGLE-3): autoregressive, trained with test-time-training unrolling.

One decoder layer (by default) on top of the target's tapped features:

    step 0:  h = fc(target_hidden_states)            # [B, S, n*H] -> [B, S, H]
    layer:   x = [input_layernorm(embed(token)) ; hidden_norm(h)]   # 2H wide, feeds q/k/v
             h = h + attn(x);  h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                        # embedding and lm_head frozen, from the target

Position t pairs the target's features of position t with the NEXT token x_{t+1} and predicts
x_{t+2}. Training unrolls `ttt_length` steps: step k > 0 feeds the drafter's own (un-normed)
output of step k-1 back in, with the tokens shifted by one more position (x_{t+k+1}), at RoPE
position t + k. A step-k query at t sees the step-0 keys of positions 0..t (causal) and the keys
of steps 1..k at the same t — exactly the keys an inference round drafting from position t has
in its cache. So training step k at t equals the k-th chained draft of an inference round whose
last verified position is t (train/serve parity; tested).

Labels follow the DSpark convention (docs/algorithm.md#labels-and-the-eval-mask) with anchor a = t + 1: step k predicts token
t + k + 2, the target's own distribution for it is `lm_head(target_last_hidden_states[t + k + 1])`
and `eval_mask[t, k]` = (x_{t+1}, x_{t+2}, ..., x_{t+k+2} supervised and inside the sequence).

Shape legend: B batch, S sequence, T ttt_length (chain steps), V vocab, H hidden, L new positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask

from dspark_ds.drafters.common.attention import attend
from dspark_ds.drafters.common.cache import DraftKVCache
from dspark_ds.drafters.common.flex import flex_attend
from dspark_ds.drafters.common.forward import TrainingForward
from dspark_ds.drafters.common.layers import TargetSharedWeights, apply_rope, run_layer
from dspark_ds.drafters.common.rounds import DraftRound, Proposal, VerifiedContext, first_stop
from dspark_ds.drafters.common.sampling import sample_from_logits
from dspark_ds.drafters.common.vocab import DraftVocab
from dspark_ds.errors import ConfigError

EAGLE3_FIELDS = ("target_layer_ids", "num_target_layers", "ttt_length", "step_loss_decay")
TTT_ATTN_IMPLEMENTATIONS = ("dense", "flex")

# A layer's attention kernel: (q [B,Hq,L,D], k, v [B,Hkv,L,D], after norms and RoPE) -> [B,Hq,L,D].
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Eagle3Hidden:
    """The unrolled forward before the vocabulary projection (the chunked loss's input)."""

    hidden: torch.Tensor  # [B, S, T, H] raw (un-normed) output of step k at position t
    target_ids: torch.Tensor  # [B, S, T] (draft ids with a draft vocabulary; -1 outside it)
    eval_mask: torch.Tensor  # [B, S, T] bool
    target_last_hidden_states: torch.Tensor | None = None  # [B, S, H]


@dataclass
class Eagle3ForwardOutput:
    """Everything the Eagle3 loss needs from one unrolled training forward."""

    draft_logits: torch.Tensor  # [B, S, T, V]: step k at position t predicts token t + k + 2
    target_ids: torch.Tensor  # [B, S, T] that token (0 beyond the sequence)
    eval_mask: torch.Tensor  # [B, S, T] bool, a contiguous valid prefix along T
    target_logits: torch.Tensor | None = None  # [B, S, V]: the target's logits for token t + 1


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t + n] at t (dim 1), zero-filled past the end."""
    if n == 0:
        return x
    pad = x.new_zeros((x.shape[0], min(n, x.shape[1]), *x.shape[2:]))
    return torch.cat([x[:, n:], pad], dim=1)


def build_ttt_eval_mask(loss_mask: torch.Tensor, ttt_length: int) -> torch.Tensor:
    """[B, S, T] bool: anchor x_{t+1} and labels x_{t+2..t+k+2} supervised, as a prefix along T."""
    sup = loss_mask > 0.5
    anchor = shift_left(sup, 1)
    labels = torch.stack([shift_left(sup, k + 2) for k in range(ttt_length)], dim=-1)
    valid = anchor.unsqueeze(-1) & labels
    # NOTE: cumprod in int32 (bf16 cannot hold the running product reliably).
    return valid.to(torch.int32).cumprod(dim=-1).bool()


# ---- attention kernels ---------------------------------------------------------------------------
def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def ttt_attention_dense(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scaling: float
) -> torch.Tensor:
    """Step k = len(keys) - 1 of the unrolled forward, exactly, with O(S² + k·S) scores.

    Query t sees keys[0][0..t] (causal) and keys[j][t] for j = 1..k (its own chain). The chain
    part is a per-position dot product, so no [S, (k+1)·S] score matrix is ever built.
    """
    groups = q.shape[1] // keys[0].shape[1]
    seq = q.shape[2]
    qf = q.float()
    k0, v0 = _repeat_kv(keys[0], groups).float(), _repeat_kv(values[0], groups).float()
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    scores0 = (qf @ k0.transpose(-1, -2)) * scaling
    scores0 = scores0.masked_fill(~causal, float("-inf"))
    chain_k = [_repeat_kv(k, groups).float() for k in keys[1:]]
    chain_v = [_repeat_kv(v, groups).float() for v in values[1:]]
    if chain_k:
        chain_scores = torch.stack([(qf * k).sum(-1) for k in chain_k], dim=-1) * scaling
        probs = torch.softmax(torch.cat([scores0, chain_scores], dim=-1), dim=-1)
        out = probs[..., :seq] @ v0
        for j, v in enumerate(chain_v):
            out = out + probs[..., seq + j].unsqueeze(-1) * v
    else:
        out = torch.softmax(scores0, dim=-1) @ v0
    return out.to(q.dtype)


def ttt_attention_flex(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scaling: float
) -> torch.Tensor:
    """The same visibility as one flex_attention call over [keys_0; ...; keys_k] (GPU training)."""
    seq = q.shape[2]
    # NOTE: the sequence length as a tensor, not a Python int: the compiled kernel would
    # specialise (and recompile) on a captured int (drafters/common/flex.py)
    seq_t = torch.tensor(seq, device=q.device)

    def mask_mod(b, h, q_idx, kv_idx):
        pos = kv_idx % seq_t
        return ((kv_idx < seq_t) & (kv_idx <= q_idx)) | ((kv_idx >= seq_t) & (pos == q_idx))

    k = torch.cat(keys, dim=2)
    v = torch.cat(values, dim=2)
    block_mask = create_block_mask(
        mask_mod, B=None, H=None, Q_LEN=seq, KV_LEN=k.shape[2], device=q.device
    )
    return flex_attend(q, k, v, block_mask, scaling=scaling)  # compiled on CUDA


def unroll_attend(kernel, prior_k: tuple, prior_v: tuple, scaling: float, new: list) -> AttendFn:
    """One layer's attention at step k = len(prior_k) of the unroll: over the keys / values of
    steps 0..k-1 and its own, which it puts in `new` ([k, v]) for the later steps.

    NOTE: under activation checkpointing the layer runs again in backward: both runs do the
    same (a compiled layer must trace one graph for both), and the second run's `new` is read
    by nobody."""

    def attend_fn(q, k, v):
        new[0], new[1] = k, v
        return kernel(q, [*prior_k, k], [*prior_v, v], scaling)

    return attend_fn


def causal_cache_mask(q_len: int, cached: int, device: torch.device) -> torch.Tensor:
    """[1, 1, q_len, cached + q_len] bool: new position i sees the cache and new positions <= i."""
    kv = torch.arange(cached + q_len, device=device)
    return (kv.view(1, -1) <= (cached + torch.arange(q_len, device=device)).view(-1, 1)).view(
        1, 1, q_len, -1
    )


# ---- the attention every Eagle3 layer uses ------------------------------------------------------
class Eagle3Attention:
    """GQA attention whose q/k/v projections read the 2H-wide [embedding ; hidden] input.

    Mixed into a backend's projections (drafters/common/qwen3.py, gemma4.py, built with
    `in_features = 2H`); the kernel (`attend_fn`) decides what each query sees.
    """

    o_proj: nn.Linear

    def project(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, L, 2H] -> q [B, Hq, L, D], k, v [B, Hkv, L, D] (normed, RoPE applied)."""
        q = self.project_q(x)
        k, v = self.project_kv(x)
        return apply_rope(q, rope), apply_rope(k, rope), v

    def forward(self, x: torch.Tensor, rope, attend_fn: AttendFn) -> torch.Tensor:
        bsz, length, _ = x.shape
        out = attend_fn(*self.project(x, rope))
        return self.o_proj(out.transpose(1, 2).reshape(bsz, length, -1))


# ---- the family-independent model ------------------------------------------------------------
class Eagle3DraftModel(TrainingForward, TargetSharedWeights, DraftVocab, nn.Module):
    """Base class; a backend supplies its layer, norm, rotary embedding and logits."""

    architecture: str = ""
    REQUIRED_CONFIG_FIELDS = EAGLE3_FIELDS  # what config.json must carry
    OPTIONAL_CONFIG_FIELDS: dict = {}

    def __init__(self, config):
        super().__init__()
        self.config = config
        for field in EAGLE3_FIELDS:
            if not hasattr(config, field):
                raise ConfigError(f"{field}: missing from the Eagle3 drafter config")
        hidden = int(config.hidden_size)
        self.target_layer_ids = [int(i) for i in config.target_layer_ids]
        self.ttt_length = int(config.ttt_length)
        self.step_loss_decay = float(config.step_loss_decay)
        # "auto": flex_attention on CUDA tensors, the exact dense kernel elsewhere.
        self.attn_implementation = "auto"
        # perf.activation_checkpointing (set by the kind's `prepare`): recompute each layer of
        # each unrolled step in backward
        self.activation_checkpointing = False

        self.embed_tokens = self.make_embedding()
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = self.make_norm(hidden)
        self.rotary_emb = self.make_rotary()
        self.init_draft_vocab()
        self.lm_head = nn.Linear(hidden, self.head_rows(), bias=False)
        self.reset_parameters()

    # ---- what a backend provides (layer hooks and head_logits: TargetSharedWeights) -----------
    def target_logits(self, target_last_hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's logits from its final normed state, through the shared lm_head."""
        return self.head_logits(target_last_hidden_states.to(self.lm_head.weight.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits from the drafter's raw (un-normed) output hidden state."""
        return self.head_logits(self.norm(hidden))

    # ---- set-up (the same contract as DSparkDraftModel) --------------------------------------
    def resolve_attn_implementation(self, device: torch.device) -> str:
        impl = self.attn_implementation
        if impl == "auto":
            return "flex" if device.type == "cuda" else "dense"
        if impl not in TTT_ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation: expected 'auto' or one of {TTT_ATTN_IMPLEMENTATIONS}, "
                f"got {impl!r}"
            )
        return impl

    def project_context(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, L, n*H] tapped target features -> [B, L, H] step-0 hidden (no norm: the layer's
        hidden_norm normalizes it)."""
        expected = len(self.target_layer_ids) * int(self.config.hidden_size)
        if target_hidden_states.shape[-1] != expected:
            raise ValueError(
                f"target_hidden_states: last dim {target_hidden_states.shape[-1]} != "
                f"{len(self.target_layer_ids)} tapped layers x hidden {self.config.hidden_size}"
            )
        return self.fc(target_hidden_states.to(self.fc.weight.dtype))

    def run_layers(
        self, embeds, h, positions, attend_fns: list[AttendFn], recompute: bool = False
    ) -> torch.Tensor:
        rope = self.rotary_emb(h, positions)
        for layer, attend_fn in zip(self.layers, attend_fns):
            h = run_layer(layer, embeds, h, rope, attend_fn, recompute=recompute)
        return h

    # ---- training forward: the TTT unroll --------------------------------------------------
    def full_logits(self, feats: Eagle3Hidden) -> Eagle3ForwardOutput:
        """The unroll's full logits ([B, S, T, V]; the reference path of the loss) from
        `forward_hidden`'s result; `forward` (drafters/common/forward.py) returns them."""
        target_logits = None
        if feats.target_last_hidden_states is not None:
            with torch.no_grad():
                target_logits = self.target_logits(feats.target_last_hidden_states)
        return Eagle3ForwardOutput(
            draft_logits=self.compute_logits(feats.hidden),
            target_ids=feats.target_ids,
            eval_mask=feats.eval_mask,
            target_logits=target_logits,
        )

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        target_hidden_states: torch.Tensor,
        loss_mask: torch.Tensor,
        target_last_hidden_states: torch.Tensor | None = None,
        ttt_length: int | None = None,
    ) -> Eagle3Hidden:
        """Unrolls `ttt_length` (default: the config's) steps over every position at once."""
        steps = int(ttt_length or self.ttt_length)
        bsz, seq_len = input_ids.shape
        device = input_ids.device
        impl = self.resolve_attn_implementation(device)
        kernel = ttt_attention_flex if impl == "flex" else ttt_attention_dense
        # The growing per-layer key/value lists of the unroll (one [B, Hkv, S, D] per step).
        kv = [([], []) for _ in self.layers]
        h = self.project_context(target_hidden_states)
        base_pos = torch.arange(seq_len, device=device).expand(bsz, -1)
        hiddens = []
        for k in range(steps):
            new = [[None, None] for _ in self.layers]
            attend_fns = [
                unroll_attend(kernel, tuple(keys), tuple(values), layer.self_attn.scaling, slot)
                for layer, (keys, values), slot in zip(self.layers, kv, new)
            ]
            embeds = self.embed_tokens(shift_left(input_ids, k + 1))
            h = self.run_layers(
                embeds, h, base_pos + k, attend_fns, recompute=self.activation_checkpointing
            )
            for (keys, values), (k_new, v_new) in zip(kv, new):
                keys.append(k_new)
                values.append(v_new)
            hiddens.append(h)
        labels = torch.stack([shift_left(input_ids, k + 2) for k in range(steps)], dim=-1)
        labels, in_vocab = self.draft_labels(labels)
        if in_vocab is not None:  # never the draft's argmax: a greedy miss
            labels = torch.where(in_vocab, labels, -1)
        return Eagle3Hidden(
            hidden=torch.stack(hiddens, dim=2),
            target_ids=labels,
            eval_mask=build_ttt_eval_mask(loss_mask, steps),
            target_last_hidden_states=target_last_hidden_states,
        )

    # ---- inference primitives: chain drafting with a KV cache --------------------------------
    def new_cache(self) -> DraftKVCache:
        return DraftKVCache(len(self.layers))

    def extend(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        cache: DraftKVCache,
        positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Appends L positions (cache.seq_length ..) to the cache, causally; -> raw hidden [B,L,H].

        `hidden` [B, L, H] is the step input (projected target features, or the drafter's own
        previous output); `token_ids` [B, L] the token that FOLLOWS each position. Batched
        decoding (left-padded rows) passes the RoPE `positions` [B, L] and `key_mask`
        [B, cache.seq_length + L], the keys each row may see (the causal rule still applies).
        """
        bsz, q_len = token_ids.shape
        cached = cache.seq_length
        device = token_ids.device
        mask = causal_cache_mask(q_len, cached, device) if q_len > 1 else None
        if key_mask is not None:
            rows = key_mask.bool()[:, None, None, :]
            mask = rows if mask is None else mask & rows

        def make_attend(layer_idx: int, scaling: float) -> AttendFn:
            def attend_fn(q, k, v):
                k, v = cache.append(layer_idx, k, v)
                return attend(q, k, v, mask, scaling=scaling)

            return attend_fn

        attend_fns = [
            make_attend(i, layer.self_attn.scaling) for i, layer in enumerate(self.layers)
        ]
        if positions is None:
            positions = torch.arange(cached, cached + q_len, device=device).expand(bsz, -1)
        return self.run_layers(self.embed_tokens(token_ids), hidden, positions, attend_fns)

    def extend_context(self, c: VerifiedContext) -> None:
        """Append verified positions to the cache (the kind's `extend`): position i pairs
        the target's features of i with `c.next_ids[:, i]`, the token after it. Keeps each
        row's output at its last kept position in `cache.last_hidden`, where the next chain
        starts."""
        hidden = self.extend(
            self.project_context(c.features),
            c.next_ids,
            c.cache,
            positions=c.positions,
            key_mask=c.key_mask,
        )
        if c.num_kept is None:
            c.cache.last_hidden = hidden[:, -1]
        else:
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            c.cache.last_hidden = hidden[rows, c.num_kept - 1]

    def propose_round(self, r: DraftRound) -> Proposal:
        """One round (the kind's `propose`): every row chains up to `r.budget` single-token
        steps from its last verified state; the chain ends early once every row has drawn a
        stop token. No confidence head."""
        cache = r.cache
        verified = cache.seq_length
        last = cache.last_hidden.unsqueeze(1)  # [R, 1, H]
        rows = last.shape[0]
        tokens, logits = [], []
        for i in range(r.budget):
            step_logits = self.full_vocab_logits(self.compute_logits(last))  # [R, 1, V]
            token = sample_from_logits(step_logits, r.temperature, r.generator)  # [R, 1]
            tokens.append(token)
            logits.append(step_logits)
            if i + 1 == r.budget or (
                r.stop_token_ids and all(int(t) in r.stop_token_ids for t in token[:, 0])
            ):
                break
            key_mask = None
            if r.key_mask is not None:  # the padded context, then the chain so far
                key_mask = torch.cat([r.key_mask, r.key_mask.new_ones(rows, i + 1)], dim=1)
            positions = (r.starts + i).unsqueeze(1)
            last = self.extend(last, token, cache, positions=positions, key_mask=key_mask)
        # Draft positions' keys came from the drafter's own hidden states; the next round
        # replaces them with the target's features, so only verified context may persist.
        cache.crop(verified)
        drafts = torch.cat(tokens, dim=1)
        lengths = []
        for row in drafts.tolist():
            stop = first_stop(row, r.stop_token_ids)
            lengths.append(len(row) if stop is None else stop + 1)
        return Proposal(drafts, torch.cat(logits, dim=1), lengths)

    def propose(
        self,
        *,
        context_features: torch.Tensor,
        next_token_ids: torch.Tensor,
        start: int,
        cache: DraftKVCache,
        num_tokens: int | None = None,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        stop_token_ids: set[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`extend_context` then `propose_round` for one unpadded batch -> (tokens [B, k], draft
        logits [B, k, V]) (the train / serve parity tests' entry).

        `start` is the position of x_start, the last committed token. `context_features`
        [B, start - cache.seq_length, n*H] are the target features of the positions verified
        since the last round, `next_token_ids` [B, same] the token after each of them (so the
        last one is x_start). Drafts up to `num_tokens` (default ttt_length) tokens, stopping
        early after a stop token; the cache is cropped back to `start` (verified context only).
        """
        cached = cache.seq_length
        bsz, new = context_features.shape[:2]
        if new < 1 or cached + new != start:
            raise ValueError(
                f"context_features: cache holds {cached} positions and {new} new ones were "
                f"given, but the round starts at {start} (needs >= 1 new position)"
            )
        if tuple(next_token_ids.shape) != (bsz, new):
            raise ValueError(
                f"next_token_ids: shape {tuple(next_token_ids.shape)} != context_features "
                f"{(bsz, new)}"
            )
        count = int(num_tokens if num_tokens is not None else self.ttt_length)
        if count < 1:
            raise ValueError(f"num_tokens: must be >= 1, got {count}")
        device = context_features.device
        positions = torch.arange(cached, start, device=device).expand(bsz, -1)
        self.extend_context(VerifiedContext(context_features, positions, cache, next_token_ids))
        proposal = self.propose_round(
            DraftRound(
                x_start=next_token_ids[:, -1],
                starts=torch.full((bsz,), start, dtype=torch.long, device=device),
                cache=cache,
                budget=count,
                temperature=temperature,
                generator=generator,
                stop_token_ids=set(stop_token_ids or ()),
            )
        )
        return proposal.tokens, proposal.logits
