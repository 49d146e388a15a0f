"""The target side of decoding: incremental forwards with a KV cache and the feature tap.

Legend: R rows, L = tokens in one forward, V = vocabulary, n = tapped layers, H = target hidden
size.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from dspark_ds.errors import ConfigError
from dspark_ds.eval.recurrent import (
    check_recurrent_target,
    crop_cache,
    rollback_state,
    start_recording,
)
from dspark_ds.target import residual_state, text_config


def tap_layers(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the tapped layers in id order: id -1 is the embedding output
    (`hidden_states[0]`), id i the output of decoder layer i (`hidden_states[i + 1]`), each
    as `residual_state` takes it (DeepSeek-V4: the mean of its residual streams)."""
    return torch.cat([residual_state(hidden_states[i + 1]) for i in layer_ids], dim=-1)


def check_drafter_matches_target(target, drafter) -> None:
    """Refuse a drafter that was not built for this target (clear message naming the field)."""
    check_recurrent_target(target.config)
    t_cfg = text_config(target.config)
    d_cfg = drafter.config
    num_layers = int(t_cfg.num_hidden_layers)
    layer_ids = [int(i) for i in d_cfg.target_layer_ids]
    if int(d_cfg.num_target_layers) != num_layers:
        raise ConfigError(
            f"drafter config num_target_layers={d_cfg.num_target_layers} but the target has "
            f"{num_layers} decoder layers"
        )
    if any(i < -1 or i >= num_layers for i in layer_ids):
        raise ConfigError(
            f"drafter target_layer_ids {layer_ids} out of range for {num_layers} layers"
        )
    # NOTE: id L-1 means two things. Here and in training (target.py) it is HF's
    # hidden_states[L], the final *normed* state, so dspark-ds agrees with itself; but the
    # reference implementation's cache stores the raw output of decoder layer L-1. A checkpoint
    # tapping L-1 is therefore ambiguous across the interchange format, and (as docs/algorithm.md#target-features and the
    # reference's evaluator do) evaluation refuses it.
    if num_layers - 1 in layer_ids:
        raise ConfigError(
            f"drafter target_layer_ids {layer_ids} include the target's final layer {num_layers - 1}"
            ", whose features differ between dspark-ds (normed) and the reference (raw); use an "
            "earlier layer"
        )
    if int(d_cfg.vocab_size) != int(t_cfg.vocab_size):
        raise ConfigError(
            f"drafter vocab_size={d_cfg.vocab_size} differs from the target's {t_cfg.vocab_size}"
        )
    if int(d_cfg.hidden_size) != int(t_cfg.hidden_size):
        raise ConfigError(
            f"drafter hidden_size={d_cfg.hidden_size} differs from the target's {t_cfg.hidden_size}"
        )


def new_target_cache(target) -> DynamicCache:
    """An empty KV cache for `target` that a rejected draft can be rolled back out of."""
    cache = DynamicCache(config=target.config)
    # NOTE: sliding-window layers (Gemma4) drop old K/V as they go unless past recording is
    # on, and then a rejected draft could not be rolled back.
    start_recording(cache)
    return cache


@functools.cache
def _cache_kwarg(model_class: type) -> str:
    # NOTE: transformers 5.2x renamed `past_key_values` to `cache` (the old name warns).
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_target(
    target,
    cache: DynamicCache,
    ids_RL: torch.Tensor,
    positions_RL: torch.Tensor,
    layer_ids: list[int],
    *,
    attention_mask: torch.Tensor | None = None,
    logits_to_keep: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target on L new tokens per row, after the cached ones, at RoPE `positions_RL`;
    `attention_mask` [R, cached + L] hides padding (None: nothing is padded).

    Returns (fp32 logits [R, L or logits_to_keep, V], tapped features [R, L, n*H] or None when
    no layer is tapped). The new tokens are in the cache afterwards.
    """
    out = target(
        input_ids=ids_RL,
        position_ids=positions_RL,
        attention_mask=attention_mask,
        **{_cache_kwarg(type(target)): cache},
        use_cache=True,
        output_hidden_states=bool(layer_ids),
        logits_to_keep=logits_to_keep,
    )
    features = tap_layers(out.hidden_states, layer_ids) if layer_ids else None
    return out.logits.float(), features


@dataclass
class TargetStep:
    """What one target forward returns to the decoding loop."""

    logits_LV: torch.Tensor
    """fp32 next-token logits for each input position (batch dimension removed)."""
    features_LnH: torch.Tensor | None
    """Tapped features of the input positions, [1, L, n*H] (the drafter's context); None when
    no layer is tapped (plain decoding)."""


class TargetDecoder:
    """A target under incremental decoding of one row: one KV cache, rolled back after each
    verification (the batched loop's padded rows: eval/padded.py); a hybrid target's recurrent
    layers (eval/recurrent.py), and DeepSeek-V4's compressed attention (eval/compressed.py), are
    snapshotted before each forward and replayed up to the kept positions."""

    def __init__(self, target, layer_ids: list[int], *, rollback: bool = True):
        self.target = target
        self.layer_ids = [int(i) for i in layer_ids]
        self.cache = new_target_cache(target)
        self.num_cached = 0
        # `rollback` False: plain decoding keeps every token (no snapshot taken)
        self.states = rollback_state(target) if rollback else None
        self._forward_start = 0  # where the last forward's tokens begin

    def forward(self, input_ids_1L: torch.Tensor, *, logits_to_keep: int = 0) -> TargetStep:
        """Run the target on new tokens placed right after the cached ones."""
        length = input_ids_1L.shape[1]
        position_ids = torch.arange(
            self.num_cached, self.num_cached + length, device=input_ids_1L.device
        ).unsqueeze(0)
        args = (self.target, self.cache, input_ids_1L, position_ids, self.layer_ids)
        if self.states is None:
            logits, features = forward_target(*args, logits_to_keep=logits_to_keep)
        else:
            with self.states.recording(self.cache):
                logits, features = forward_target(*args, logits_to_keep=logits_to_keep)
        self._forward_start = self.num_cached
        self.num_cached += length
        return TargetStep(logits_LV=logits[0], features_LnH=features)

    def keep(self, num_tokens: int) -> None:
        """Roll the cache back to its first `num_tokens` positions (drop rejected drafts); a
        recurrent state can be rolled back into the last forward's tokens only."""
        if num_tokens > self.num_cached:
            raise ValueError(f"cannot keep {num_tokens} tokens of a {self.num_cached}-token cache")
        if self.states is not None and num_tokens < self._forward_start:
            raise ValueError(
                f"cannot keep {num_tokens} tokens: the recurrent state can be rolled back to "
                f"{self._forward_start} tokens at the earliest"
            )
        appended = self.num_cached - self._forward_start
        # NOTE: crop(0) still trims sliding-window layers to their window.
        crop_cache(self.cache, self.num_cached - num_tokens)
        self.num_cached = num_tokens
        if self.states is not None:
            self.states.rollback(self.cache, [num_tokens - self._forward_start], appended)
