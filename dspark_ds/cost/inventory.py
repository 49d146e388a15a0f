"""What a run holds: the run config's drafter (built by its kind, `DrafterKind.build_config`) and
target, built on the meta device and counted, and the shapes one micro-batch flows through (the
input of the kinds' FLOP and activation counts: cost/flops.py, the tuner)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dspark_ds.drafters import build_draft_model
from dspark_ds.drafters.common.memory import StepShape, Widths
from dspark_ds.drafters.common.target_config import global_attr
from dspark_ds.drafters.registry import get_kind
from dspark_ds.errors import ConfigError
from dspark_ds.target import default_layer_ids, text_config
from dspark_ds.target_checkpoint import causal_lm_config, read_target_config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _qwen3(
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    tie_word_embeddings: bool = False,
) -> dict:
    """A dense Qwen3's config: the family shares its KV heads, head size and vocabulary."""
    return dict(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=tie_word_embeddings,
    )


# Public configs of the targets the shipped recipes use (no download needed to estimate them).
KNOWN_TARGETS: dict[str, dict] = {
    "Qwen/Qwen3-4B": _qwen3(2560, 9728, 36, 32, tie_word_embeddings=True),
    "Qwen/Qwen3-8B": _qwen3(4096, 12288, 36, 32),
    "Qwen/Qwen3-14B": _qwen3(5120, 17408, 40, 40),
    "Qwen/Qwen3-32B": _qwen3(5120, 25600, 64, 64),
}


@dataclass(frozen=True)
class ModuleParams:
    """The parameters one module holds directly."""

    numels: tuple[int, ...]
    trainable: bool
    """Any of them trains."""
    backward: bool
    """Its backward needs them (a trainable module, or a frozen projection whose input needs a
    gradient, like the shared lm_head; not a frozen embedding)."""
    in_layers: bool = False
    """It is part of a decoder layer (`layers.*`: what activation checkpointing runs again)."""


def module_params(model: torch.nn.Module) -> tuple[ModuleParams, ...]:
    out = []
    for name, mod in model.named_modules():
        params = list(mod.parameters(recurse=False))
        if not params:
            continue
        trainable = any(p.requires_grad for p in params)
        frozen_lookup = not trainable and isinstance(mod, torch.nn.Embedding)
        numels = tuple(p.numel() for p in params)
        out.append(ModuleParams(numels, trainable, not frozen_lookup, name.startswith("layers.")))
    return tuple(out)


@dataclass(frozen=True)
class Inventory(Widths):
    """Parameter counts and the shapes the activations depend on (its `Widths`)."""

    trainable: int
    frozen: int
    largest_module: int
    """Elements of the largest module (DeepSpeed's `largest_layer_params`)."""
    target_params: int
    target_layers: int
    trainable_numels: tuple[int, ...] = field(default=(), repr=False)
    """Elements of each trainable parameter, in the drafter's order (ZeRO-3's persistence)."""
    target_layer_params: int = 0
    """Parameters of the target's decoder layers and final norm (its forward FLOPs)."""
    target_active_layer_params: int = 0
    """...of them, those one token runs through: a MoE layer's routed experts at top-k of E
    (`active_params`; a served target's prefill FLOPs)."""
    layer_ids: tuple[int, ...] = ()
    """The target's tapped layers (target.layer_ids, or the default ones)."""
    target_attention: tuple[tuple[int, int | None], ...] = field(default=(), repr=False)
    """Each target layer's attention: (query width, sliding window or None)."""
    drafter_modules: int = 0
    """Modules of the drafter (ZeRO-3 hooks every one)."""
    target_modules: int = 0
    drafter_param_modules: tuple[ModuleParams, ...] = field(default=(), repr=False)
    """The drafter's modules that hold parameters directly (ZeRO-3 gathers per module)."""
    target_param_modules: tuple[ModuleParams, ...] = field(default=(), repr=False)
    attention: str | None = None
    """The attention path the drafter's layers force (`forced_attention`), or None."""

    def persistent(self, param_threshold: int, model_threshold: int) -> int:
        """Trainable elements ZeRO-3 keeps whole on every rank: parameters of at most
        `param_threshold` elements, in order, while their sum stays within `model_threshold`
        (DeepSpeed's rule; zero.Init divides the model threshold by the world size first)."""
        return sum(self.persistent_numels(param_threshold, model_threshold))

    def persistent_numels(self, param_threshold: int, model_threshold: int) -> list[int]:
        """The sizes of those persistent trainable parameters."""
        kept, out = 0, []
        for n in self.trainable_numels:
            if n <= param_threshold and kept + n <= model_threshold:
                kept += n
                out.append(n)
        return out

    def summary(self) -> dict[str, int]:
        """The counts and shapes (without the per-parameter and per-module lists)."""
        out = asdict(self)
        for key in (
            "trainable_numels",
            "drafter_param_modules",
            "target_param_modules",
            "target_attention",
        ):
            del out[key]
        return out

    def step_shape(self, run_cfg) -> StepShape:
        """One micro-batch of the run through these sizes (the kind's activation input; its own
        part from the kind, `DrafterKind.cost.step_part`)."""
        return StepShape.of(
            self,
            run_cfg.data.batch_size,
            run_cfg.data.max_length,
            drafter=get_kind(run_cfg.model.kind).cost.step_part(run_cfg.model),
            compute_bytes=2 if run_cfg.train.precision == "bf16" else 4,
            feature_bytes=DTYPE_BYTES[run_cfg.target.dtype],
            attention=self.attention,
        )


def target_config_of(path: str):
    # lazy: transformers, 0.9 s of import
    from transformers import AutoConfig, Qwen3Config

    if path in KNOWN_TARGETS and not Path(path).exists():
        return Qwen3Config(**KNOWN_TARGETS[path])
    if Path(path).expanduser().exists():
        return read_target_config(path)
    try:
        return AutoConfig.from_pretrained(path)
    except OSError as err:
        raise ConfigError(
            f"target.path: cannot read the config of {path!r} ({err}); use a local "
            f"directory or one of {sorted(KNOWN_TARGETS)}"
        ) from err


def _draft_config(run_cfg, target_config, layer_ids: list[int]):
    """The drafter's config, built by the recipe's kind as training builds it."""
    m = run_cfg.model
    return get_kind(m.kind).build_config(
        target_config,
        m,
        target_layer_ids=layer_ids,
        mask_token_id=m.mask_token_id if m.mask_token_id is not None else 0,
        target_path=run_cfg.target.path,
    )


def _attention_shape(drafter, tcfg) -> tuple[int, int, int]:
    """(heads, key/value heads, head size) of the drafter's attention, as its layers were built
    (a Gemma4 drafter's are the target's full-attention ones, not the config's global fields)."""
    for module in drafter.modules():
        if all(hasattr(module, a) for a in ("num_heads", "num_kv_heads", "head_dim")):
            return int(module.num_heads), int(module.num_kv_heads), int(module.head_dim)
    heads = int(global_attr(tcfg, "num_attention_heads"))
    head_dim = int(global_attr(tcfg, "head_dim", tcfg.hidden_size // heads))
    return heads, int(global_attr(tcfg, "num_key_value_heads", heads)), head_dim


def _target_attention(decoder, tcfg) -> tuple[tuple[int, int | None], ...]:
    """Each target decoder layer's (query width, sliding window or None), read from its
    attention module (Gemma4's sliding and full layers differ in both); a layer without a
    `self_attn.q_proj` (linear attention, MLA) is counted at the config's global width."""
    heads = int(global_attr(tcfg, "num_attention_heads"))
    width = heads * int(global_attr(tcfg, "head_dim", tcfg.hidden_size // heads))
    out = []
    for layer in decoder.layers:
        attn = getattr(layer, "self_attn", None)
        q_proj = getattr(attn, "q_proj", None)
        if isinstance(q_proj, torch.nn.Linear):
            window = getattr(attn, "sliding_window", None)
            out.append((int(q_proj.out_features), int(window) if window else None))
        else:
            out.append((width, None))
    return tuple(out)


def active_params(layers: torch.nn.Module, top_k: int | None) -> int:
    """Parameters of `layers` one token runs through: all of them, except that the parameters of
    a module named `experts` (a MoE layer's routed experts: one fused tensor per projection
    whose first dimension is the expert, or a list of expert modules) count at `top_k` of its
    experts. Shared experts (`shared_expert(s)`) run for every token. No `top_k`: all of them."""
    total = float(sum(p.numel() for p in layers.parameters()))
    for name, module in layers.named_modules():
        if not top_k or name.rsplit(".", 1)[-1] != "experts":
            continue
        params = list(module.parameters())
        if not params:
            continue
        experts = len(module) if isinstance(module, torch.nn.ModuleList) else params[0].shape[0]
        routed = sum(p.numel() for p in params)
        total -= routed * (1 - min(top_k, experts) / experts)
    return round(total)


def inventory(run_cfg) -> Inventory:
    """Counts from the real drafter (of the recipe's kind) and target classes built on the meta
    device (no memory)."""
    # lazy: transformers, 0.9 s of import
    from transformers import AutoModelForCausalLM

    tcfg_full = target_config_of(run_cfg.target.path)
    tcfg = text_config(tcfg_full)
    layer_ids = run_cfg.target.layer_ids or default_layer_ids(int(tcfg.num_hidden_layers))
    draft_cfg = _draft_config(run_cfg, tcfg_full, layer_ids)
    with torch.device("meta"):
        drafter = build_draft_model(draft_cfg)
        target = AutoModelForCausalLM.from_config(causal_lm_config(tcfg_full))
    shared = set(drafter.shared_parameter_names())
    for name, p in drafter.named_parameters():
        p.requires_grad_(name not in shared)  # as training runs it (the shared two frozen)
    target.requires_grad_(False)
    decoder = target.get_decoder()
    params = list(drafter.named_parameters())
    trainable_numels = tuple(p.numel() for name, p in params if name not in shared)
    heads, kv_heads, head_dim = _attention_shape(drafter, tcfg)
    return Inventory(
        trainable=sum(trainable_numels),
        frozen=sum(p.numel() for name, p in params if name in shared),
        largest_module=max(
            sum(p.numel() for p in mod.parameters(recurse=False)) for mod in drafter.modules()
        ),
        target_params=sum(p.numel() for p in target.parameters()),
        hidden=int(tcfg.hidden_size),
        # the drafter's MLP width (a MoE target without a dense one sizes it from its experts;
        # a drafter of MoE layers says what a token runs through: `active_mlp_width`)
        intermediate=int(
            getattr(drafter, "active_mlp_width", None)
            or getattr(tcfg, "intermediate_size", None)
            or draft_cfg.intermediate_size
        ),
        vocab=int(tcfg.vocab_size),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        draft_layers=int(draft_cfg.num_hidden_layers),
        target_layers=int(tcfg.num_hidden_layers),
        taps=len(layer_ids),
        trainable_numels=trainable_numels,
        target_layer_params=sum(p.numel() for p in decoder.layers.parameters()),
        target_active_layer_params=active_params(
            decoder.layers, global_attr(tcfg, "num_experts_per_tok")
        ),
        layer_ids=tuple(layer_ids),
        target_attention=_target_attention(decoder, tcfg),
        drafter_modules=sum(1 for _ in drafter.modules()),
        target_modules=sum(1 for _ in target.modules()),
        drafter_param_modules=module_params(drafter),
        target_param_modules=module_params(target),
        attention=getattr(drafter, "forced_attention", None),
    )
