"""Layers every drafter kind shares: rotary embedding helpers, a decoder layer's call (with
activation checkpointing) and the target's shared weights.

Shape legend: B batch, H heads, L positions, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dspark_ds.errors import ConfigError


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BHLD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = (t.unsqueeze(1) for t in rope)  # [B, 1, L, D]
    return x_BHLD * cos + rotate_half(x_BHLD) * sin


def run_layer(layer: nn.Module, *args, recompute: bool = False):
    """`layer(*args)`; with `recompute` (perf.activation_checkpointing) and autograd recording,
    under torch's non-reentrant activation checkpointing: the layer's saved tensors are dropped
    after its forward and recomputed by running it again in its backward (RNG state replayed),
    so only its inputs stay. Works under ZeRO-3 (the recomputation's module calls gather their
    parameters again through DeepSpeed's hooks) and inside torch.compile.

    NOTE: the layer must compute the same thing when it runs again: no side effect whose
    second run would change its result (drafters/eagle3/model.py `unroll_attend`)."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(layer, *args, use_reentrant=False)
    return layer(*args)


class TargetSharedWeights:
    """What every drafter kind (DSpark, Eagle3) shares: the backend hooks that build its
    layers, init, and the frozen embedding / lm_head shared with the target.

    The class using it has `config`, `embed_tokens` and `lm_head`.
    """

    def make_embedding(self) -> nn.Module:
        return nn.Embedding(int(self.config.vocab_size), int(self.config.hidden_size))

    def make_layer(self, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def make_norm(self, dim: int) -> nn.Module:
        raise NotImplementedError

    def make_rotary(self) -> nn.Module:
        raise NotImplementedError

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits of an already normed state through the shared lm_head (a backend adds its
        final-logit soft-capping here)."""
        return self.lm_head(normed)

    @staticmethod
    def finalize_draft_config(cfg, target_text_config):
        """Family fix-ups of a drafter config built from a target (Gemma4 rebuilds its
        per-layer attributes); returns the config to use."""
        return cfg

    @staticmethod
    def interchange_config_dict(data: dict, config) -> dict:
        """Family / kind fix-ups of the config.json dict `save_draft_model` writes."""
        return data

    @classmethod
    def interchange_state_dict(cls, state: dict, config) -> dict:
        """Our parameter names -> the weight names the engines' loader for this backend reads
        (the same names, except DeepSeek-V4's layout)."""
        return state

    @classmethod
    def native_state_dict(cls, state: dict, config) -> dict:
        """The inverse of `interchange_state_dict`, for a directory's tensors."""
        return state

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = float(getattr(self.config, "initializer_range", 0.02))
        for module in self.modules():
            self.init_module(module, std)

    @staticmethod
    @torch.no_grad()
    def init_module(module: nn.Module, std: float) -> None:
        """One module's own parameters at their initial values (what `reset_parameters` does
        to each; under ZeRO-3 the engine calls it module by module, gathered)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()

    @torch.no_grad()
    def initialize_embeddings_and_head(
        self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, freeze: bool = True
    ) -> None:
        """Copies the target's embedding and lm_head (docs/algorithm.md#the-drafter) and
        freezes them; with a draft vocabulary (drafters/common/vocab.py), the lm_head's rows of
        its tokens."""
        if getattr(self, "draft_vocab", 0):
            lm_head_weight = self.head_weight_rows(lm_head_weight)
        for name, dst, src in (
            ("embed_tokens", self.embed_tokens.weight, embed_weight),
            ("lm_head", self.lm_head.weight, lm_head_weight),
        ):
            if tuple(dst.shape) != tuple(src.shape):
                raise ConfigError(
                    f"{name}: target weight {tuple(src.shape)} != drafter {tuple(dst.shape)}"
                )
            dst.copy_(src.detach().to(dst.dtype))
        if freeze:
            self.freeze_shared()

    def freeze_shared(self) -> None:
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)

    @staticmethod
    def shared_parameter_names() -> tuple[str, ...]:
        """Parameters copied from the target, frozen, and never in a training checkpoint."""
        return ("embed_tokens.weight", "lm_head.weight")
