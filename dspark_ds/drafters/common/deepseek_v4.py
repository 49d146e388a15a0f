"""DeepSeek-V4's pieces for the drafters that draft in parallel with the target's own decoder
layers (`model.backbone: target` on a DeepSeek-V4 target; drafters/dspark/deepseek_v4.py).

A draft layer is a DeepSeek-V4 decoder layer as vLLM's V4 DSpark builds its draft layers: the
sliding-window attention of V4 (shared-KV multi-query attention, low-rank query, partial
interleaved RoPE on the trailing slice of each head, a learnable sink per head, the grouped
low-rank output; no compressor: vLLM gives draft layers compress ratio 1), the routed + shared
experts (top-k routed: draft layers have no hash routing), and two hyper-connections mixing the
`hc_mult` residual streams; after the last layer the hyper-head collapses the streams and the
final norm follows. transformers' DeepSeek-V4 modules are used where their signature fits (norms,
rotary embedding, hyper-connections, the MoE block); the attention is ours, since DSpark's
queries attend to [context ; block] with the context's keys from the projected target features.

`vllm_names` / `our_names` map our parameter names to the weight names vLLM's V4 DSpark loader
reads (`DSparkDeepseekV4ForCausalLM.load_weights`: `mtp.{i}.*` in DeepSeek's own naming, the
experts one tensor each; SGLang's `DeepseekV4ForCausalLMDSpark` reads the same names) and back
(docs/checkpoint-format.md#deepseek-v4).
"""

from __future__ import annotations

import re

import torch
from torch import nn
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Experts,
    DeepseekV4GroupedLinear,
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
    DeepseekV4RotaryEmbedding,
    DeepseekV4TopKRouter,
    DeepseekV4UnweightedRMSNorm,
    apply_rotary_pos_emb,
)

from dspark_ds.drafters.common import attention
from dspark_ds.drafters.common.layers import TargetSharedWeights
from dspark_ds.errors import ConfigError

_SINK_PAD = 8  # the sink's extra query / key dimension, padded to a multiple of 8


class DeepseekV4AttentionProjections(nn.Module):
    """V4's attention weights, named as transformers names them: q_a / q_b (low-rank query,
    normed), kv (one head read as key and value), o_a (grouped) / o_b, and the per-head sinks."""

    def __init__(self, config):
        super().__init__()
        hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = 1  # one head read as key and value
        self.head_dim = int(config.head_dim)
        self.o_groups = int(config.o_groups)
        self.scaling = self.head_dim**-0.5
        width = self.num_heads * self.head_dim
        self.q_a_proj = nn.Linear(hidden, int(config.q_lora_rank), bias=False)
        self.q_a_norm = DeepseekV4RMSNorm(int(config.q_lora_rank), eps=eps)
        self.q_b_proj = nn.Linear(int(config.q_lora_rank), width, bias=False)
        self.q_b_norm = DeepseekV4UnweightedRMSNorm(eps=eps)
        self.kv_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.kv_norm = DeepseekV4RMSNorm(self.head_dim, eps=eps)
        rank = self.o_groups * int(config.o_lora_rank)
        self.o_a_proj = DeepseekV4GroupedLinear(width // self.o_groups, rank, self.o_groups)
        self.o_b_proj = nn.Linear(rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, H] -> [B, Hq, L, D], normed, before RoPE."""
        bsz, length, _ = x.shape
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        return self.q_b_norm(q.view(bsz, length, self.num_heads, self.head_dim).transpose(1, 2))

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L, H] -> (kv, kv), [B, 1, L, D] each: V4 reads one tensor as key and value."""
        kv = self.kv_norm(self.kv_proj(x)).unsqueeze(1)
        return kv, kv

    def rope(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """V4's interleaved RoPE on the trailing rope slice of each head."""
        return apply_rotary_pos_emb(x, *rope)

    def attend(self, q, kv, mask) -> torch.Tensor:
        """Attention with V4's per-head sink: a logit every row has, whose value is zero.
        q [B, Hq, Q, D], kv [B, 1, K, D], mask None or bool [B, 1, Q, K] (True: visible); a row
        that sees nothing gives zero.

        The sink runs as one more key through the shared kernels (drafters/common/attention.py):
        queries get an extra dimension set to 1 and the sink key sink_h / scaling there (every
        other key 0), so its score is sink_h for every query; its value is zero. Head sizes are
        padded by 8 (fused kernels want multiples of 8); what the kernel saves for backward is
        its output and log-sum-exp, not the scores."""
        bsz, heads, length, dim = q.shape
        keys = kv.shape[2]
        pad = _SINK_PAD
        ones = q.new_ones(bsz, heads, length, 1)
        q = torch.cat([q, ones, q.new_zeros(bsz, heads, length, pad - 1)], dim=-1)
        kv = torch.cat([kv.expand(bsz, heads, keys, dim), kv.new_zeros(bsz, heads, keys, pad)], -1)
        sink = (self.sinks.float() / self.scaling).to(kv.dtype).view(1, heads, 1, 1)
        sink_key = torch.cat(
            [
                kv.new_zeros(bsz, heads, 1, dim),
                sink.expand(bsz, heads, 1, 1),
                kv.new_zeros(bsz, heads, 1, pad - 1),
            ],
            dim=-1,
        )
        k = torch.cat([kv, sink_key], dim=2)
        v = torch.cat([kv, kv.new_zeros(bsz, heads, 1, dim + pad)], dim=2)
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)
        return attention.attend(q, k, v, mask, scaling=self.scaling)[..., :dim]

    def project_out(self, out: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """[B, Hq, L, D] -> [B, L, H]: the value's RoPE undone at the query's position (K = V),
        then the grouped low-rank output projection."""
        cos, sin = rope
        out = apply_rotary_pos_emb(out, cos, -sin).transpose(1, 2)
        grouped = out.reshape(*out.shape[:2], self.o_groups, -1)
        return self.o_b_proj(self.o_a_proj(grouped).flatten(2))


class DeepseekV4MainRotary(nn.Module):
    """V4's rotary embedding at its `main` RoPE (the one its sliding-window layers use):
    `(x, positions) -> (cos, sin)` as the drafters' backbones call it."""

    def __init__(self, config):
        super().__init__()
        self.inner = DeepseekV4RotaryEmbedding(config)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        return self.inner(x, position_ids, layer_type="main")


class DeepseekV4Backend:
    """The layer hooks of `TargetSharedWeights` for a V4 drafter, its hyper-head, and the init
    of what transformers' own init gives V4's modules (the kind's model class adds
    `make_layer` and the streams)."""

    def make_norm(self, dim: int) -> nn.Module:
        return DeepseekV4RMSNorm(dim, eps=self.config.rms_norm_eps)

    def make_rotary(self) -> nn.Module:
        return DeepseekV4MainRotary(self.config)

    def make_hyper_head(self) -> nn.Module:
        return DeepseekV4HyperHead(self.config)

    @staticmethod
    def finalize_draft_config(cfg, target_text_config):
        """Draft layers: sliding-window attention, top-k routed experts, as vLLM builds them."""
        check_supported(cfg)
        # the target's own, for the config.json vLLM reads (drafters/dspark/serving.py)
        cfg.target_layer_types = list(target_text_config.layer_types)
        cfg.target_mlp_layer_types = list(target_text_config.mlp_layer_types)
        layers = int(cfg.num_hidden_layers)
        cfg.layer_types = ["sliding_attention"] * layers
        cfg.mlp_layer_types = ["moe"] * layers
        return cfg

    @staticmethod
    @torch.no_grad()
    def init_module(module: nn.Module, std: float) -> None:
        """Also V4's modules, as transformers' own init gives them (their tensors are made
        empty)."""
        TargetSharedWeights.init_module(module, std)
        if isinstance(module, DeepseekV4HyperConnection):
            module.fn.normal_(0.0, std)
            module.base.zero_()
            module.scale.fill_(1.0)
        elif isinstance(module, DeepseekV4HyperHead):
            module.hc_fn.normal_(0.0, std)
            module.hc_base.zero_()
            module.hc_scale.fill_(1.0)
        elif isinstance(module, DeepseekV4Experts):
            module.gate_up_proj.normal_(0.0, std)
            module.down_proj.normal_(0.0, std)
        elif isinstance(module, DeepseekV4TopKRouter):
            module.weight.normal_(0.0, std)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, DeepseekV4AttentionProjections):
            module.sinks.zero_()


_V4_FIELDS = ("hc_mult", "q_lora_rank", "o_groups", "o_lora_rank", "head_dim", "sliding_window")


def check_supported(cfg) -> None:
    """A DeepSeek-V4 config has what the V4 draft layers are built from."""
    for name in _V4_FIELDS:
        if getattr(cfg, name, None) is None:
            raise ConfigError(
                f"{name}: missing from the DeepSeek-V4 config; the V4 backbone needs it"
            )


# ---- vLLM's weight names --------------------------------------------------------------------
# our name inside a draft layer -> vLLM's (DeepSeek's checkpoint naming, which transformers'
# conversion mapping for deepseek_v4 renames the other way)
_LAYER_NAMES = {
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.sinks": "attn.attn_sink",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
}
# our top-level name -> (vLLM's name after `mtp.{stage}.`, stage: "first" | "last")
_HEAD_NAMES = {
    "fc.weight": ("main_proj.weight", "first"),
    "hidden_norm.weight": ("main_norm.weight", "first"),
    "norm.weight": ("norm.weight", "last"),
    "hc_head.hc_fn": ("hc_head_fn", "last"),
    "hc_head.hc_base": ("hc_head_base", "last"),
    "hc_head.hc_scale": ("hc_head_scale", "last"),
}
_HEAD_PREFIXES = ("markov_head.", "confidence_head.")  # the same names after mtp.{last}.
_SHARED = ("embed_tokens.weight", "lm_head.weight")  # vLLM aliases the target's
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


def vllm_names(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Our state dict -> the tensors vLLM's V4 DSpark loader reads (no embedding / lm_head: it
    aliases the target's); the experts split into `ffn.experts.{e}.w1 / w2 / w3`."""
    last = num_layers - 1
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in _SHARED:
            continue
        match = _LAYER.match(name)
        if match is None:
            head = next((p for p in _HEAD_PREFIXES if name.startswith(p)), None)
            if head is not None:
                out[f"mtp.{last}.{name}"] = tensor
                continue
            if name not in _HEAD_NAMES:
                raise ConfigError(f"{name}: no place for it in vLLM's DeepSeek-V4 DSpark layout")
            vname, stage = _HEAD_NAMES[name]
            out[f"mtp.{0 if stage == 'first' else last}.{vname}"] = tensor
            continue
        i, rest = match.groups()
        if rest == "mlp.experts.gate_up_proj":
            for e, (w1, w3) in enumerate(t.chunk(2, dim=0) for t in tensor.unbind(0)):
                out[f"mtp.{i}.ffn.experts.{e}.w1.weight"] = w1.contiguous()
                out[f"mtp.{i}.ffn.experts.{e}.w3.weight"] = w3.contiguous()
        elif rest == "mlp.experts.down_proj":
            for e, w2 in enumerate(tensor.unbind(0)):
                out[f"mtp.{i}.ffn.experts.{e}.w2.weight"] = w2.contiguous()
        elif rest in _LAYER_NAMES:
            out[f"mtp.{i}.{_LAYER_NAMES[rest]}"] = tensor
        else:
            raise ConfigError(f"{name}: no place for it in vLLM's DeepSeek-V4 DSpark layout")
    return out


def our_names(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """The inverse of `vllm_names`: a V4 DSpark directory's tensors under our names (experts
    stacked again); a name vLLM's layout has no place for is kept as it is, so that the
    loader names it as unexpected."""
    last = num_layers - 1
    layer_names = {v: k for k, v in _LAYER_NAMES.items()}
    head_names = {(v, s): k for k, (v, s) in _HEAD_NAMES.items()}
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        match = _MTP.match(name)
        if match is None:
            out[name] = tensor
            continue
        stage, rest = int(match.group(1)), match.group(2)
        expert = _EXPERT.match(rest)
        stages = ("first",) * (stage == 0) + ("last",) * (stage == last)
        head = next((head_names[(rest, s)] for s in stages if (rest, s) in head_names), None)
        if expert is not None:
            experts.setdefault((str(stage), expert.group(2)), {})[int(expert.group(1))] = tensor
        elif rest in layer_names:
            out[f"layers.{stage}.{layer_names[rest]}"] = tensor
        elif head is not None:
            out[head] = tensor
        elif stage == last and rest.startswith(_HEAD_PREFIXES):
            out[rest] = tensor
        else:
            out[name] = tensor
    for stage in sorted({s for s, _ in experts}):
        w1, w2, w3 = (experts.get((stage, w), {}) for w in ("w1", "w2", "w3"))
        ids = sorted(w1)
        if not ids or sorted(w2) != ids or sorted(w3) != ids or ids != list(range(len(ids))):
            raise ConfigError(f"mtp.{stage}.ffn.experts: w1 / w2 / w3 not given for every expert")
        prefix = f"layers.{stage}.mlp.experts"
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([w1[e], w3[e]]) for e in ids])
        out[f"{prefix}.down_proj"] = torch.stack([w2[e] for e in ids])
    return out
