"""The speculators checkpoint format (docs/checkpoint-format.md#the-speculators-format): the
directory that speculators 0.9 (the vLLM project's drafter trainer) saves and vLLM serves.

Its `config.json` holds `speculators_model_type`, `speculators_config` (the algorithm, the
proposal methods, the verifier: the target's path and architectures), the draft layers'
`transformer_layer_config`, `draft_vocab_size` and the kind's own fields; its weights have our
parameter names. Each kind declares its side (`Registration.speculators`: its
`<kind>/speculators_format.py`, with ARCHITECTURES, MODEL_TYPES, FIELDS, SAVES_SHARED,
to_speculators and from_speculators); this module holds what every kind shares and reads or writes a directory.

    data = speculators_dict(native, verifier)   # what `dspark-ds export --format speculators` writes
    native = native_dict(data, target_config)   # what load_draft_model reads (drafters/serving.py)

An option speculators has and dspark-ds does not (another proposal method, a reduced draft
vocabulary, other draft layers) is a ConfigError naming it: nothing is dropped on the way in.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark_ds.drafters.common.target_config import text_config
from dspark_ds.drafters.registry import REGISTERED
from dspark_ds.errors import ConfigError

SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose format is written (and read)."""

# speculators_model_type -> the kind's format module
_KIND_FORMATS = {
    t: r.speculators
    for r in REGISTERED.values()
    if r.speculators
    for t in r.speculators.MODEL_TYPES
}
# what speculators writes that no reader acts on (save_pretrained's bookkeeping)
_BOOKKEEPING = (
    "architectures",
    "auto_map",
    "dtype",
    "torch_dtype",
    "speculators_version",
    "transformers_version",
    "tie_word_embeddings",
    "_name_or_path",
)
_COMMON = (
    "speculators_model_type",
    "speculators_config",
    "transformer_layer_config",
    "draft_vocab_size",
    "target_hidden_size",
)
# transformer_layer_config: the Qwen3 decoder fields speculators' trainer writes, taken from ours
_LAYER_FIELDS = (
    "attention_bias",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "head_dim",
    "hidden_act",
    "hidden_size",
    "initializer_range",
    "intermediate_size",
    "layer_types",
    "max_position_embeddings",
    "max_window_layers",
    "model_type",
    "num_attention_heads",
    "num_hidden_layers",
    "num_key_value_heads",
    "pad_token_id",
    "rms_norm_eps",
    "rope_parameters",
    "sliding_window",
    "tie_word_embeddings",
    "use_cache",
    "use_sliding_window",
    "vocab_size",
)
# a proposal method's fields, and the values of the one dspark-ds decodes with (lossless greedy)
_GREEDY = {"proposal_type": "greedy", "verifier_accept_k": 1, "accept_tolerance": 0.0}


def is_speculators(data: dict) -> bool:
    """A config.json dict in the speculators format."""
    return "speculators_model_type" in data


def _kind_format(model_type):
    if model_type not in _KIND_FORMATS:
        raise ConfigError(
            f"speculators_model_type: {model_type!r} has no dspark-ds counterpart; dspark-ds "
            f"reads {', '.join(sorted(_KIND_FORMATS))}"
        )
    return _KIND_FORMATS[model_type]


def _format_of_architecture(architecture: str):
    for r in REGISTERED.values():
        if r.speculators is not None and architecture in r.speculators.ARCHITECTURES:
            return r.speculators
    raise ConfigError(
        f"architectures: {architecture} has no speculators format (speculators' drafter "
        "layers are Qwen3's: export it with --format native)"
    )


# ---- writing -------------------------------------------------------------------------------------
def verifier_of(target_path: str) -> dict:
    """`speculators_config.verifier` of a target (a local directory, written as its absolute
    path, or a hub id): its path and architectures."""
    config_file = Path(target_path) / "config.json"
    architectures = []
    if config_file.is_file():
        architectures = json.loads(config_file.read_text()).get("architectures") or []
        target_path = str(Path(target_path).resolve())
    return {"architectures": list(architectures), "name_or_path": str(target_path)}


def speculators_dict(native: dict, verifier: dict, dtype: str = "float32") -> dict:
    """A drafter's config.json dict (ours, with `architectures`) -> the speculators config.json
    of the same drafter, for the target `verifier` (`verifier_of`). ConfigError names what the
    format cannot hold."""
    # lazy: transformers' version only, 0.9 s of import
    import transformers

    fmt = _format_of_architecture(native["architectures"][0])
    if native.get("model_type") != "qwen3":
        raise ConfigError(
            f"model_type: {native.get('model_type')!r}; speculators' drafter layers are Qwen3's"
        )
    kind_fields, tokens = fmt.to_speculators(native)
    method = {**_GREEDY, "speculative_tokens": int(tokens)}
    layer = {k: native[k] for k in _LAYER_FIELDS if k in native}
    layer["tie_word_embeddings"] = False
    return {
        **kind_fields,
        "draft_vocab_size": int(native["vocab_size"]),
        "dtype": dtype,
        "speculators_config": {
            "algorithm": kind_fields["speculators_model_type"],
            "default_proposal_method": "greedy",
            "proposal_methods": [dict(sorted(method.items()))],
            "verifier": verifier,
        },
        "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": layer,
        "transformers_version": transformers.__version__,
    }


def saved_names(native: dict, names: list[str], shared: tuple[str, ...]) -> list[str]:
    """Which of a drafter's parameter names the speculators directory holds: all, or all but
    the target's embedding and lm_head (`shared`) for a kind that leaves them to the target."""
    fmt = _format_of_architecture(native["architectures"][0])
    return [n for n in names if fmt.SAVES_SHARED or n not in shared]


# ---- reading -------------------------------------------------------------------------------------
def _speculative_tokens(data: dict, model_type: str) -> int:
    """The draft tokens a round of the default proposal method, after checking that every
    proposal method is the lossless greedy chain dspark-ds verifies."""
    spec = data.get("speculators_config")
    if not isinstance(spec, dict):
        raise ConfigError("speculators_config: missing from the speculators config.json")
    if spec.get("algorithm") != model_type:
        raise ConfigError(
            f"speculators_config.algorithm: {spec.get('algorithm')!r} in a "
            f"speculators_model_type {model_type!r} checkpoint"
        )
    methods = spec.get("proposal_methods") or []
    if not methods:
        raise ConfigError("speculators_config.proposal_methods: empty")
    for i, method in enumerate(methods):
        where = f"speculators_config.proposal_methods[{i}]"
        for key in sorted(set(method) - set(_GREEDY) - {"speculative_tokens"}):
            raise ConfigError(f"{where}.{key}: a proposal option dspark-ds has no counterpart for")
        for key, value in _GREEDY.items():
            if method.get(key, value) != value:
                raise ConfigError(
                    f"{where}.{key}: {method[key]!r}; dspark-ds proposes one greedy chain and "
                    f"verifies it losslessly ({key} {value!r})"
                )
    if spec.get("default_proposal_method", "greedy") != "greedy":
        raise ConfigError(
            f"speculators_config.default_proposal_method: {spec['default_proposal_method']!r}"
        )
    if "speculative_tokens" not in methods[0]:
        raise ConfigError("speculators_config.proposal_methods[0].speculative_tokens: missing")
    return int(methods[0]["speculative_tokens"])


def _layer_config(data: dict) -> dict:
    """transformer_layer_config, checked: Qwen3 full-attention layers over the whole vocabulary."""
    layer = data.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError("transformer_layer_config: missing from the speculators config.json")
    model_type = layer.get("model_type", "qwen3")
    if model_type != "qwen3":
        raise ConfigError(
            f"transformer_layer_config.model_type: {model_type!r}; dspark-ds drafter layers "
            "are Qwen3's (per-head q / k norms)"
        )
    other = sorted({t for t in layer.get("layer_types") or [] if t != "full_attention"})
    if other:
        raise ConfigError(
            f"transformer_layer_config.layer_types: {other}; dspark-ds drafters have "
            "full-attention layers only"
        )
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if key not in layer:
            raise ConfigError(f"transformer_layer_config.{key}: missing")
    vocab = int(layer["vocab_size"])
    draft_vocab = data.get("draft_vocab_size")
    if draft_vocab is None or int(draft_vocab) != vocab:
        raise ConfigError(
            f"draft_vocab_size: {draft_vocab} against the vocabulary's {vocab} (a reduced "
            "draft vocabulary, with d2t / t2d maps); dspark-ds drafters predict the target's "
            "whole vocabulary"
        )
    hidden = data.get("target_hidden_size")
    if hidden is not None and int(hidden) != int(layer["hidden_size"]):
        raise ConfigError(
            f"target_hidden_size: {hidden} != the drafter's hidden size {layer['hidden_size']}; "
            "dspark-ds drafters have their target's width"
        )
    return {**layer, "model_type": "qwen3", "tie_word_embeddings": False}


def _target_family(data: dict, target_config) -> tuple[int, str, str]:
    """(the target's layer count, model_type, text model_type): from `target_config`, else from
    the verifier directory the checkpoint names."""
    if target_config is None:
        verifier = (data.get("speculators_config") or {}).get("verifier") or {}
        path = verifier.get("name_or_path")
        if not path or not (Path(path) / "config.json").is_file():
            raise ConfigError(
                f"speculators_config.verifier.name_or_path: {path!r} is not a local model "
                "directory; give the target (target.path) to read its layer count from"
            )
        # lazy: transformers' config classes, 0.9 s of import
        from transformers import AutoConfig

        target_config = AutoConfig.from_pretrained(path)
    text = text_config(target_config)
    return (
        int(text.num_hidden_layers),
        str(target_config.model_type),
        str(getattr(text, "model_type", target_config.model_type)),
    )


def native_dict(data: dict, target_config=None) -> dict:
    """A speculators config.json dict -> the drafter config dict our backends build from.
    `target_config` (the target's Hugging Face config) gives the target's layer count; without
    it, the verifier directory the checkpoint names does. ConfigError names the first option
    dspark-ds cannot honour."""
    model_type = data["speculators_model_type"]
    fmt = _kind_format(model_type)
    known = {*_BOOKKEEPING, *_COMMON, *fmt.FIELDS[model_type]}
    for key in sorted(set(data) - known):
        raise ConfigError(
            f"{key}: a speculators {model_type} option dspark-ds has no counterpart for"
        )
    if data.get("tie_word_embeddings"):
        raise ConfigError("tie_word_embeddings: true; dspark-ds drafters keep their own lm_head")
    tokens = _speculative_tokens(data, model_type)
    layer = _layer_config(data)
    num_layers, target_type, text_type = _target_family(data, target_config)
    kind = fmt.from_speculators(data, layer, tokens)
    return {
        **layer,
        **kind,
        "dtype": data.get("dtype"),
        "num_target_layers": num_layers,
        "target_model_type": target_type,
        "target_text_model_type": text_type,
    }
