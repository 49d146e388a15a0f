"""DeepSeek-V4 backend of the DSpark / DFlash drafter (`model.backbone: target` on a DeepSeek-V4
target): the target family's own decoder layers (drafters/common/deepseek_v4.py) around the DSpark
draft attention, in the layout vLLM's and SGLang's V4 DSpark serve (vLLM's `DSparkDraftModel`,
SGLang's `DeepseekV4ForCausalLMDSpark`; docs/drafters.md#deepseek-v4s-own-drafter).

What differs from the Qwen3 backend: the residual is `hc_mult` streams (the embedding copied into
each), mixed in and out of every attention and MoE block by hyper-connections and collapsed by
the hyper-head before the final norm; keys and values are one tensor (MQA, K = V); attention has a
sink per head, so it runs the dense masked path (the blockwise and flex kernels have no sink).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4HyperConnection,
    DeepseekV4RMSNorm,
    DeepseekV4SparseMoeBlock,
)

from dspark_ds.drafters.common.cache import DraftKVCache
from dspark_ds.drafters.common.deepseek_v4 import (
    DeepseekV4AttentionProjections,
    DeepseekV4Backend,
    our_names,
    vllm_names,
)
from dspark_ds.drafters.common.layers import run_layer
from dspark_ds.drafters.dspark.model import DSparkDraftModel


class DeepseekV4DSparkAttention(DeepseekV4AttentionProjections):
    """Queries from the draft slots; the one KV head from [context ; draft]."""

    def forward(
        self, h, ctx, rope_ctx, rope_draft, mask, cache: DraftKVCache | None, layer_idx: int
    ):
        q = self.rope(self.project_q(h), rope_draft)
        kv_ctx = self.rope(self.project_kv(ctx)[0], rope_ctx)
        if cache is not None:
            kv_ctx = cache.append(layer_idx, kv_ctx, kv_ctx)[0]
        kv = torch.cat([kv_ctx, self.rope(self.project_kv(h)[0], rope_draft)], dim=2)
        return self.project_out(self.attend(q, kv, mask), rope_draft)


class DeepseekV4DSparkDecoderLayer(nn.Module):
    """Streams [B, L, hc, H]: h = post ⊗ attn(norm(pre · h)) + combᵀ h, then the same around
    the MoE block (transformers' DeepseekV4DecoderLayer, with DSpark's attention)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = DeepseekV4DSparkAttention(config)
        self.mlp = DeepseekV4SparseMoeBlock(config, layer_idx)
        self.input_layernorm = DeepseekV4RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = DeepseekV4RMSNorm(config.hidden_size, eps=eps)
        self.attn_hc = DeepseekV4HyperConnection(config)
        self.ffn_hc = DeepseekV4HyperConnection(config)

    @staticmethod
    def _mix(streams, post, comb, out):
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed

    def forward(self, h, ctx, rope_ctx, rope_draft, mask, cache, layer_idx):
        post, comb, collapsed = self.attn_hc(h)
        attn = self.self_attn(
            self.input_layernorm(collapsed), ctx, rope_ctx, rope_draft, mask, cache, layer_idx
        )
        h = self._mix(h, post, comb, attn)
        post, comb, collapsed = self.ffn_hc(h)
        return self._mix(h, post, comb, self.mlp(self.post_attention_layernorm(collapsed)))


class DeepseekV4DSparkModel(DeepseekV4Backend, DSparkDraftModel):
    architecture = "DSparkDraftModel"
    forced_attention = "dense"  # the per-head sink is in the dense path only (the tuner reads it)
    # NOTE: DeepSeek's V4 drafter has no confidence bias, and vLLM's and SGLang's V4 loaders
    # build `confidence_head.proj` without one (vLLM's fails on a `proj.bias`, SGLang's drops it)
    confidence_head_bias = False

    def __init__(self, config):
        super().__init__(config)
        self.hc_mult = int(config.hc_mult)
        self.hc_head = self.make_hyper_head()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if hasattr(self, "hc_head"):  # once, when the hyper-head exists too
            super().reset_parameters()

    def make_layer(self, layer_idx):
        return DeepseekV4DSparkDecoderLayer(self.config, layer_idx)

    def resolve_attn_implementation(self, device: torch.device) -> str:
        return self.forced_attention

    @property
    def active_mlp_width(self) -> int:
        """The MLP width one token runs through: its routed experts and the shared one."""
        c = self.config
        experts = int(c.num_experts_per_tok) + int(getattr(c, "n_shared_experts", 1) or 1)
        return experts * int(c.moe_intermediate_size)

    def backbone(self, h, ctx, ctx_pos, draft_pos, mask, cache: DraftKVCache | None = None):
        rope_ctx = self.rotary_emb(h, ctx_pos)
        rope_draft = self.rotary_emb(h, draft_pos)
        mask = self.windowed(mask, ctx_pos, draft_pos, cache)
        recompute = self.activation_checkpointing and cache is None
        streams = h.unsqueeze(-2).expand(*h.shape[:-1], self.hc_mult, h.shape[-1]).contiguous()
        for i, layer in enumerate(self.layers):
            streams = run_layer(
                layer, streams, ctx, rope_ctx, rope_draft, mask, cache, i, recompute=recompute
            )
        # NOTE: the hyper-head's output, before the final norm, as vLLM's V4 DSpark returns it:
        # its confidence head reads that state, its logits lm_head(norm(.)) (compute_logits)
        return self.hc_head(streams)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def target_logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.lm_head(state)  # the target's final states are normed already

    def windowed(self, mask, ctx_pos, draft_pos, cache: DraftKVCache | None):
        """`mask` [B, 1, Lq, K] (None: all visible) with V4's sliding window on the context: a
        block sees the last `sliding_window` context positions before its first slot (vLLM's
        draft layers keep that window), and its own slots. Keys are [context ; draft]: the
        cache's (positions counted over the keys its rows may see) or `ctx_pos`'s."""
        bsz, length = draft_pos.shape
        slot = torch.arange(length, device=draft_pos.device) % self.query_block
        first = draft_pos - slot  # [B, Lq] each query's block start
        if cache is not None:
            seen = cache.seq_length
            key_mask = None if mask is None else mask[:, 0, 0, :seen]
            if key_mask is None:
                ctx_pos = torch.arange(seen, device=draft_pos.device).expand(bsz, -1)
            else:
                ctx_pos = key_mask.long().cumsum(-1) - 1
        window = int(self.config.sliding_window)
        in_window = ctx_pos[:, None, :] >= first[:, :, None] - window  # [B, Lq, S]
        own = in_window.new_ones(
            bsz, length, mask.shape[-1] - ctx_pos.shape[1] if mask is not None else length
        )
        visible = torch.cat([in_window, own], dim=-1)[:, None]
        return visible if mask is None else mask & visible

    # ---- vLLM's layout (drafters/dspark/serving.py writes its config fields) ----------------
    @classmethod
    def interchange_state_dict(cls, state: dict, config) -> dict:
        return vllm_names(state, int(config.num_hidden_layers))

    @classmethod
    def native_state_dict(cls, state: dict, config) -> dict:
        return our_names(state, int(config.num_hidden_layers))
