"""The family-independent DSpark drafter: one forward for every backend.

A backend (qwen3.py, gemma4.py) supplies only its layers, norms, embedding, rotary
embedding and, where it differs, `compute_logits`. Anchors, masks, labels, the Markov and
confidence heads, and the inference primitives live here once.

Shape legend: B batch, S sequence, A anchors, G block size (γ), V vocab, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dspark_ds.drafters.common.cache import DraftKVCache
from dspark_ds.drafters.common.forward import TrainingForward
from dspark_ds.drafters.common.layers import TargetSharedWeights, apply_rope, run_layer
from dspark_ds.drafters.common.rounds import DraftRound, Proposal, VerifiedContext
from dspark_ds.drafters.common.sampling import sample_from_logits
from dspark_ds.drafters.common.vocab import DraftVocab
from dspark_ds.drafters.dspark.block_attention import attend, build_block_mask
from dspark_ds.drafters.dspark.blocks import (
    DSparkForwardOutput,
    block_labels,
    build_noise_input_ids,
    create_position_ids,
    gather_blocks,
    sample_anchor_positions,
)
from dspark_ds.drafters.dspark.markov import ConfidenceHead, build_markov_head
from dspark_ds.errors import ConfigError


@dataclass
class DSparkHiddenOutput:
    """`forward_hidden`: everything the loss needs, with hidden states instead of logits."""

    hidden: torch.Tensor  # [B, A, G, H] the backbone's draft states (input of compute_logits)
    prev_token_ids: torch.Tensor  # [B, A, G] token before each slot (Markov / confidence input)
    target_ids: torch.Tensor  # [B, A, G] labels (draft ids with a draft vocabulary)
    eval_mask: torch.Tensor  # [B, A, G] bool
    block_keep_mask: torch.Tensor  # [B, A] bool
    anchor_positions: torch.Tensor  # [B, A]
    target_prev_hidden: torch.Tensor | None = None  # [B, A, G, H] target state one step back
    label_in_vocab: torch.Tensor | None = None  # [B, A, G] bool; None: no draft vocabulary


class DraftAttention:
    """Queries from draft slots; keys/values from [context ; draft] with shared projections.

    Mixed into a backend's projections (drafters/common/qwen3.py, gemma4.py), which provide
    `project_q(h) -> [B, Hq, L, D]` and `project_kv(x) -> (k, v)`, each [B, Hkv, L, D] after
    their norms and before RoPE, `o_proj` and `scaling`.
    """

    scaling: float
    o_proj: nn.Linear

    def rope(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return apply_rope(x, rope)

    def forward(
        self, h, ctx, rope_ctx, rope_draft, mask, cache: DraftKVCache | None, layer_idx: int
    ):
        bsz, q_len, _ = h.shape
        q = self.rope(self.project_q(h), rope_draft)
        k_ctx, v_ctx = self.project_kv(ctx)
        k_ctx = self.rope(k_ctx, rope_ctx)
        if cache is not None:
            k_ctx, v_ctx = cache.append(layer_idx, k_ctx, v_ctx)
        k_draft, v_draft = self.project_kv(h)
        k = torch.cat([k_ctx, self.rope(k_draft, rope_draft)], dim=2)
        v = torch.cat([v_ctx, v_draft], dim=2)
        out = attend(q, k, v, mask, scaling=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class DSparkDraftModel(TrainingForward, TargetSharedWeights, DraftVocab, nn.Module):
    """Base class; see the module docstring. Construct through a backend or `build_draft_model`."""

    architecture: str = ""
    # the confidence head's bias (its `proj.bias`); a backend whose engines build the head
    # without one says False
    confidence_head_bias: bool = True
    # config.json: what a drafter directory must carry, and what older ones may leave out
    REQUIRED_CONFIG_FIELDS = ("block_size", "mask_token_id", "target_layer_ids", "num_anchors")
    OPTIONAL_CONFIG_FIELDS = {
        "sample_from_anchor": True,
        "markov_rank": 0,
        "markov_head_type": "vanilla",
        "enable_confidence_head": False,
        "confidence_head_with_markov": False,
    }

    def __init__(self, config):
        super().__init__()
        self.config = config
        hidden = int(config.hidden_size)
        self.block_size = int(config.block_size)
        # NOTE: the layout decides which slots predict (docs/serving.md#the-block-layout): with
        # sample_from_anchor the block is [anchor, MASK × (γ-1)] and slot j predicts token
        # p + j + 1; without, [anchor, MASK × γ], slot j >= 1 predicts token p + j and the anchor
        # slot's output is dropped. Both give γ predictions with the same labels.
        self.sample_from_anchor = bool(getattr(config, "sample_from_anchor", True))
        self.query_block = self.block_size + (0 if self.sample_from_anchor else 1)
        self.mask_token_id = int(config.mask_token_id)
        self.num_anchors = int(config.num_anchors)
        self.target_layer_ids = list(config.target_layer_ids)
        # "auto": flex_attention on CUDA tensors; elsewhere (no flex backward on CPU) the exact
        # blockwise path, which skips the work the mask hides ("dense" stays the reference).
        self.attn_implementation = "auto"
        # perf.activation_checkpointing (set by the kind's `prepare`): recompute each layer in
        # backward
        self.activation_checkpointing = False

        self.embed_tokens = self.make_embedding()
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = self.make_norm(hidden)
        self.rotary_emb = self.make_rotary()
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = self.make_norm(hidden)
        self.init_draft_vocab()
        self.lm_head = nn.Linear(hidden, self.head_rows(), bias=False)
        self.markov_head = build_markov_head(config, self.head_rows())
        self.confidence_head = None
        self.confidence_head_with_markov = False
        if bool(getattr(config, "enable_confidence_head", False)):
            self.confidence_head_with_markov = bool(
                getattr(config, "confidence_head_with_markov", False)
            )
            if self.confidence_head_with_markov and self.markov_head is None:
                raise ConfigError("confidence_head_with_markov: needs markov_rank > 0")
            extra = int(config.markov_rank) if self.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(hidden + extra, bias=self.confidence_head_bias)
        self.reset_parameters()

    # ---- what a backend provides (see TargetSharedWeights for the layer hooks) -------
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits of the drafter's final (normed) states, before any Markov bias."""
        return self.head_logits(hidden)

    def target_logits(self, state: torch.Tensor) -> torch.Tensor:
        """Logits of the target's own final states (the aligned logits the loss compares
        with): `compute_logits`, unless a backend's norms its input (DeepSeek-V4's)."""
        return self.compute_logits(state)

    # ---- the shared backbone ---------------------------------------------------------
    def project_context(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, L, n*H] tapped target features -> [B, L, H] context, shared by every layer."""
        return self.hidden_norm(self.fc(target_hidden_states.to(self.fc.weight.dtype)))

    def backbone(self, h, ctx, ctx_pos, draft_pos, mask, cache: DraftKVCache | None = None):
        rope_ctx = self.rotary_emb(h, ctx_pos)
        rope_draft = self.rotary_emb(h, draft_pos)
        recompute = self.activation_checkpointing and cache is None
        for i, layer in enumerate(self.layers):
            h = run_layer(layer, h, ctx, rope_ctx, rope_draft, mask, cache, i, recompute=recompute)
        return self.norm(h)

    def resolve_attn_implementation(self, device: torch.device) -> str:
        if self.attn_implementation == "auto":
            return "flex" if device.type == "cuda" else "blockwise"
        return self.attn_implementation

    # ---- training forward (docs/algorithm.md: anchors .. confidence head) ------------------------
    def full_logits(self, feats: DSparkHiddenOutput) -> DSparkForwardOutput:
        """Full logits of `forward_hidden`'s result (what `dspark_loss` reads); `forward`
        (drafters/common/forward.py) returns them."""
        hidden_BAGH = feats.hidden
        aligned = None
        if feats.target_prev_hidden is not None:
            aligned = self.target_logits(feats.target_prev_hidden)
        logits = self.compute_logits(hidden_BAGH)
        if self.markov_head is not None:
            logits = self.markov_head.apply_block_logits(
                logits, token_ids=feats.prev_token_ids, hidden_states=hidden_BAGH
            )
        return DSparkForwardOutput(
            draft_logits=logits,
            target_ids=feats.target_ids,
            eval_mask=feats.eval_mask,
            block_keep_mask=feats.block_keep_mask,
            confidence_pred=self.predict_confidence(hidden_BAGH, feats.prev_token_ids),
            aligned_target_logits=aligned,
            anchor_positions=feats.anchor_positions,
            label_in_vocab=feats.label_in_vocab,
        )

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        target_hidden_states: torch.Tensor,
        loss_mask: torch.Tensor,
        target_last_hidden_states: torch.Tensor | None = None,
        anchor_positions: torch.Tensor | None = None,
        block_keep_mask: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> DSparkHiddenOutput:
        """The training forward up to (not including) the vocabulary projection.

        `forward` turns this into full logits; the chunked losses (loss_chunked.py) project a
        few anchors at a time instead, so [B, A, G, V] never exists at once.
        """
        bsz, seq_len = input_ids.shape
        device = input_ids.device
        G, Q = self.block_size, self.query_block
        if anchor_positions is None:
            if block_keep_mask is not None:
                raise ValueError("block_keep_mask: given without anchor_positions")
            anchor_positions, block_keep_mask = sample_anchor_positions(
                loss_mask, self.num_anchors, generator=generator
            )
        elif block_keep_mask is None:
            block_keep_mask = torch.ones_like(anchor_positions, dtype=torch.bool)
        anchor_positions = anchor_positions.long().to(device)
        block_keep_mask = block_keep_mask.bool().to(device)
        num_blocks = anchor_positions.shape[1]

        noise_ids = build_noise_input_ids(
            input_ids,
            anchor_positions,
            block_keep_mask,
            mask_token_id=self.mask_token_id,
            block_size=Q,
        )
        h = self.embed_tokens(noise_ids)
        ctx = self.project_context(target_hidden_states)
        ctx_pos = torch.arange(seq_len, device=device).expand(bsz, -1)
        draft_pos = create_position_ids(anchor_positions, Q)
        mask = build_block_mask(
            self.resolve_attn_implementation(device),
            anchor_positions,
            block_keep_mask,
            seq_len=seq_len,
            block_size=Q,
        )
        hidden = self.backbone(h, ctx, ctx_pos, draft_pos, mask)
        hidden_BAGH = hidden.view(bsz, num_blocks, Q, -1)[:, :, Q - G :]

        safe_idx, eval_mask = block_labels(
            loss_mask, anchor_positions, block_keep_mask, block_size=G
        )
        target_ids = input_ids.gather(1, safe_idx.flatten(1)).view_as(safe_idx)
        prev_state = None
        if target_last_hidden_states is not None:
            # The target's own distribution for the same token: its state one step earlier.
            prev_state = gather_blocks(target_last_hidden_states, (safe_idx - 1).clamp(min=0))
            prev_state = prev_state.to(self.lm_head.weight.dtype)

        anchor_tokens = input_ids.gather(1, anchor_positions)
        prev_ids = torch.cat([anchor_tokens.unsqueeze(-1), target_ids[..., :-1]], dim=-1)
        labels, in_vocab = self.draft_labels(target_ids)
        return DSparkHiddenOutput(
            hidden=hidden_BAGH,
            prev_token_ids=prev_ids,
            target_ids=labels,
            label_in_vocab=in_vocab,
            eval_mask=eval_mask,
            block_keep_mask=block_keep_mask,
            anchor_positions=anchor_positions,
            target_prev_hidden=prev_state,
        )

    def predict_confidence(
        self, hidden: torch.Tensor, prev_token_ids: torch.Tensor
    ) -> torch.Tensor | None:
        """[..., G, H], [..., G] -> [..., G] fp32 logits, or None without a confidence head."""
        if self.confidence_head is None:
            return None
        features = hidden
        if self.confidence_head_with_markov:
            prev = self.markov_head.prev_embeddings(prev_token_ids).to(hidden.dtype)
            features = torch.cat([hidden, prev], dim=-1)
        return self.confidence_head(features).float()

    # ---- inference primitives (docs/algorithm.md#inference) --------------------------------------
    def new_cache(self) -> DraftKVCache:
        return DraftKVCache(len(self.layers))

    def extend_context(self, c: VerifiedContext) -> None:
        """Append verified context to the cache (the kind's `extend`).

        Every layer's context keys / values come from the same projected context C
        (docs/algorithm.md#the-drafter), so no block has to run; positions never attend to
        each other here, so `c.key_mask`, `c.next_ids` and `c.num_kept` are not needed.
        """
        ctx = self.project_context(c.features)
        rope = self.rotary_emb(ctx, c.positions)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            k, v = attn.project_kv(ctx)
            c.cache.append(i, attn.rope(k, rope), v)

    def draft_block_from_cache(
        self,
        block_input_ids: torch.Tensor,
        block_positions: torch.Tensor,
        cache: DraftKVCache,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One draft block per row against the context in the cache -> the backbone's hidden
        [B, G, H] (normed; DeepSeek-V4's before its final norm: the input of compute_logits).

        block_input_ids / block_positions [B, G]; key_mask [B, cache.seq_length] marks the
        cached context each row may see (left-padded rows), None: all of it. The block's keys
        are not cached.
        """
        bsz, q_len = block_input_ids.shape
        h = self.embed_tokens(block_input_ids)
        no_ctx = h.new_zeros(bsz, 0, h.shape[-1])
        mask = None
        if key_mask is not None:
            own_block = key_mask.new_ones(bsz, q_len)
            mask = torch.cat([key_mask.bool(), own_block.bool()], dim=1)[:, None, None, :]
        return self.backbone(h, no_ctx, block_positions[:, :0], block_positions, mask, cache)

    def forward_draft_block(
        self,
        *,
        context_features: torch.Tensor,
        block_input_ids: torch.Tensor,
        start: int,
        cache: DraftKVCache,
    ) -> torch.Tensor:
        """`extend_context` then `draft_block_from_cache` for one unpadded batch, the block
        `[x_start, MASK...]` at `start` (the train / serve parity tests' entry).

        context_features [B, start - cache.seq_length, n*H] are the tapped target features of
        the positions verified since the last round. Returns the backbone's hidden [B, G, H].
        """
        cached = cache.seq_length
        if cached + context_features.shape[1] != start:
            raise ValueError(
                f"context_features: cache holds {cached} positions and {context_features.shape[1]} "
                f"new ones were given, but the block starts at {start}"
            )
        device = block_input_ids.device
        bsz, q_len = block_input_ids.shape
        ctx_pos = torch.arange(cached, start, device=device).expand(bsz, -1)
        self.extend_context(VerifiedContext(context_features, ctx_pos, cache))
        draft_pos = torch.arange(start, start + q_len, device=device).expand(bsz, -1)
        return self.draft_block_from_cache(block_input_ids, draft_pos, cache)

    def sample_draft_tokens(
        self,
        base_logits: torch.Tensor,
        *,
        first_prev_token_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        forced_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-to-right sampling through the Markov head: (tokens [B, G], logits [B, G, V]).

        `base_logits` are over the draft vocabulary (`compute_logits`); the tokens are target
        ids and the logits over the whole vocabulary (-inf outside a reduced one).
        `forced_tokens` skips the draws and scores the given tokens instead.
        """
        if self.markov_head is None:
            logits = self.full_vocab_logits(base_logits)
            if forced_tokens is not None:
                return forced_tokens.long(), logits
            return sample_from_logits(logits, temperature, generator), logits
        tokens, logits = self.markov_head.sample_block(
            base_logits,
            first_prev_token_ids=first_prev_token_ids,
            hidden_states=hidden_states,
            temperature=temperature,
            generator=generator,
            forced_tokens=forced_tokens,
            to_target=self.to_target_ids,
        )
        return tokens, self.full_vocab_logits(logits)

    def propose_round(self, r: DraftRound) -> Proposal:
        """One round (the kind's `propose`): `[x_start, MASK × (γ-1)]` per row in one
        forward (`[x_start, MASK × γ]` without `sample_from_anchor`), the Markov head samples
        each block left to right, the confidence head scores every slot. Always drafts the
        whole block (the loop verifies what it can)."""
        rows = r.x_start.shape[0]
        G, Q = self.block_size, self.query_block
        device = r.x_start.device
        block_ids = torch.full((rows, Q), self.mask_token_id, dtype=torch.long, device=device)
        block_ids[:, 0] = r.x_start
        positions = r.starts.unsqueeze(1) + torch.arange(Q, device=device)
        hidden = self.draft_block_from_cache(block_ids, positions, r.cache, r.key_mask)
        hidden = hidden[:, Q - G :]
        tokens, logits = self.sample_draft_tokens(
            self.compute_logits(hidden),
            first_prev_token_ids=block_ids[:, 0],
            hidden_states=hidden,
            temperature=r.temperature,
            generator=r.generator,
        )
        prev = torch.cat([block_ids[:, :1], tokens[:, :-1]], dim=1)
        return Proposal(tokens, logits, [G] * rows, self.predict_confidence(hidden, prev))
