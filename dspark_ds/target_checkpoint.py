"""What a target directory holds: its config, read or refused in one line, and the causal LM it is.

- `read_target_config`: the transformers config of a target path; a path transformers cannot
  read (no config.json, a config without a `model_type`, a family transformers does not know, a
  processor or tokenizer directory) is a ConfigError naming the path and what is missing.
- `causal_lm_config`: the config the target's causal-LM class is built from: the checkpoint's
  own, or, for a vision-language checkpoint whose family has no causal-LM class (Kimi-K2.5:
  `Kimi_K25ForConditionalGeneration`, its text model DeepSeek-V3), its text model's. Such a
  target is its text model alone: its weights are read from the checkpoint under the whole
  model's names (`whole_model_on_meta`, `text_model_names`; `TargetWeights.sources` reads
  them), the vision tower's never; `target.load_causal_lm` loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dspark_ds.errors import ConfigError
from dspark_ds.files import check_model_path, first_line, looks_local

# Files a processor, tokenizer or image-processor directory holds without a model's config.
_PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "video_preprocessor_config.json",
)


def _local_dir(path: str) -> Path | None:
    local = Path(path).expanduser()
    return local if local.is_dir() else None


def _without_config(option: str, path: str, local: Path) -> ConfigError:
    found = sorted(p.name for p in local.iterdir())
    if any(name in _PROCESSOR_FILES for name in found):
        held = ", ".join(n for n in found if n in _PROCESSOR_FILES)
        what = f"it holds {held}: a processor / tokenizer directory, not a model checkpoint"
    elif found:
        what = f"it holds {', '.join(found[:4])}{', ...' if len(found) > 4 else ''}"
    else:
        what = "it is empty"
    return ConfigError(f"{option}: {path} has no config.json, the model's config ({what})")


def read_target_config(
    path: str | None,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    option: str = "target.path",
):
    """The transformers config of the target at `path` (a local directory or a hub id), or a
    one-line ConfigError naming `option`, the path and what is missing."""
    # lazy: transformers, 0.9 s of import
    from transformers import AutoConfig, __version__

    if not path:
        raise ConfigError(f"{option} is required (a local directory or a hub id)")
    check_model_path(path, option)
    local = _local_dir(path)
    if local is not None and not (local / "config.json").is_file():
        raise _without_config(option, path, local)
    try:
        config = AutoConfig.from_pretrained(
            path, revision=revision, trust_remote_code=trust_remote_code
        )
    except OSError as err:  # not found on the hub, no connection
        raise ConfigError(
            f"{option}: cannot read a model config from {path!r} ({first_line(err)})"
        ) from None
    except (ValueError, KeyError) as err:
        if local is None and not looks_local(path):
            raise ConfigError(f"{option}: {path}: {first_line(err)}") from None
        model_type = _raw_model_type(local / "config.json")
        if model_type is None:
            raise ConfigError(
                f"{option}: {local / 'config.json'} has no model_type, the field transformers "
                "reads a checkpoint's model family from"
            ) from None
        raise ConfigError(
            f"{option}: {path} is a {model_type!r} checkpoint, a model_type transformers "
            f"{__version__} does not know; a newer transformers, or target.trust_remote_code "
            "with the checkpoint's own code, may read it"
        ) from None
    if not _has_causal_lm(config) and not _has_causal_lm(getattr(config, "text_config", config)):
        raise ConfigError(
            f"{option}: {path} is a {config.model_type} checkpoint, which has no causal LM: "
            "transformers has no AutoModelForCausalLM class for it, nor for a text model in it"
        )
    return config


def _raw_model_type(config_json: Path) -> str | None:
    try:
        value = json.loads(config_json.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return str(value) if value else None


def _has_causal_lm(config) -> bool:
    # lazy: transformers, 0.9 s of import
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        return True  # remote code
    try:
        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return False
    return True


def causal_lm_config(config):
    """The config the target's causal-LM class is built from: `config` itself, or the text
    model's config of a checkpoint whose family has no causal-LM class (a vision-language
    model: Kimi-K2.5); ConfigError when neither has one."""
    if _has_causal_lm(config):
        return config
    text = getattr(config, "text_config", None)
    if text is not None and _has_causal_lm(text):
        return text
    model_type = getattr(config, "model_type", None) or type(config).__name__
    raise ConfigError(
        f"target.path: {model_type} checkpoints have no causal-LM class in transformers "
        "(AutoModelForCausalLM), nor a text model that has one; the target must be a causal LM"
    )


def is_text_model_of(config) -> bool:
    """Whether the target of a checkpoint with `config` is the text model inside it."""
    return causal_lm_config(config) is not config


def whole_model_on_meta(config) -> nn.Module:
    """The checkpoint's whole model (its `architectures` class), built on the meta device: the
    names its weights are stored under, and transformers' conversions of them."""
    # lazy: transformers, 0.9 s of import
    import transformers

    names = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, names[0], None) if names else None
    if model_class is None:
        raise ConfigError(
            f"target.path: the {config.model_type} checkpoint's architectures {names} name no "
            "transformers class to read its weights' names from"
        )
    with torch.device("meta"):
        return model_class(config)


def text_model_names(whole: nn.Module, causal_lm: nn.Module) -> dict[str, str]:
    """{prefix in the whole model: prefix in the causal LM}: the text model's decoder (the
    submodule built from the text config) and the output head."""
    # lazy: transformers, 0.9 s of import
    from transformers import PreTrainedModel

    text = causal_lm.config
    decoder = next(
        (
            name
            for name, module in whole.named_modules()
            if name
            and isinstance(module, PreTrainedModel)
            and module.config is whole.config.text_config
        ),
        None,
    )
    head = whole.get_output_embeddings()
    head_name = next((n for n, m in whole.named_modules() if m is head), None)
    if decoder is None or head_name is None:
        raise ConfigError(
            f"target.path: found no {text.model_type} text model and head inside the "
            f"{whole.config.model_type} checkpoint's model"
        )
    lm_head = causal_lm.get_output_embeddings()
    lm_head_name = next(n for n, m in causal_lm.named_modules() if m is lm_head)
    return {decoder + ".": causal_lm.base_model_prefix + ".", head_name + ".": lm_head_name + "."}
