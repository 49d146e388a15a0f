"""The drafter's transformers config for a run's target: the kind's `build_config` over the
target's own config, its errors named by the run's options (`model.*`, `target.*`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import torch
from torch import nn

from dspark_ds.config import TrainRunConfig
from dspark_ds.data.vocab_counts import token_counts
from dspark_ds.drafters import build_draft_model
from dspark_ds.drafters.common.vocab import draft_vocab_size, top_tokens, vocab_maps
from dspark_ds.drafters.presets import DrafterConfig
from dspark_ds.drafters.registry import get_kind
from dspark_ds.errors import ConfigError
from dspark_ds.target import default_layer_ids, text_config
from dspark_ds.target_checkpoint import read_target_config


def resolve_mask_token_id(cfg: TrainRunConfig) -> int:
    if cfg.model.mask_token_id is not None:
        return int(cfg.model.mask_token_id)
    # lazy: transformers, 0.9 s of import
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.data.tokenizer or cfg.target.path)
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    if mask_id is None or mask_id == tok.unk_token_id:
        raise ConfigError("model.mask_token_id: the tokenizer has no <|mask|> token; set the id")
    return int(mask_id)


def make_draft_config(cfg: TrainRunConfig):
    """The drafter's transformers config for this run's target (its kind's `build_config`)."""
    target_config = read_target_config(
        cfg.target.path,
        revision=cfg.target.revision,
        trust_remote_code=cfg.target.trust_remote_code,
    )
    num_layers = int(text_config(target_config).num_hidden_layers)
    layer_ids = cfg.target.layer_ids or default_layer_ids(num_layers)
    kind = get_kind(cfg.model.kind)
    mask_token_id = resolve_mask_token_id(cfg) if kind.capabilities.uses_mask_token else None
    try:
        return kind.build_config(
            target_config,
            cfg.model,
            target_layer_ids=layer_ids,
            mask_token_id=mask_token_id,
            target_path=cfg.target.path,
        )
    except ConfigError as err:
        # the builders name the drafter config's field (the run's `model` option) or the
        # target config's (set by the target the run names)
        field, _, why = str(err).partition(":")
        if field == "target_layer_ids":
            raise ConfigError(f"target.layer_ids:{why}") from err
        if field in {f.name for f in fields(DrafterConfig)}:
            raise ConfigError(f"model.{field}:{why}") from err
        raise ConfigError(f"target.path: {field}:{why}") from err


def drafter_maker(
    draft_config, source, run_dir: str | Path, init_state: dict | None = None
) -> Callable[[], nn.Module]:
    """What builds the run's drafter (random init). Collective with a draft vocabulary
    (`model.draft_vocab_size`): its N tokens are the most frequent supervised ones of the
    training data `source` (data/vocab_counts.py), the same on every rank, installed as the
    drafter's d2t / t2d before its head is copied from the target's rows; a start from a
    drafter with one (`init_state`, model.init_from) keeps that drafter's."""
    n = draft_vocab_size(draft_config)
    if not n:
        return lambda: build_draft_model(draft_config)
    vocab = int(draft_config.vocab_size)
    if init_state is not None and "d2t" in init_state:
        ids = init_state["d2t"].to(torch.int64) + torch.arange(init_state["d2t"].numel())
    else:
        ids = top_tokens(token_counts(source, vocab, run_dir), n)
    d2t, t2d = vocab_maps(ids, vocab)

    def make() -> nn.Module:
        model = build_draft_model(draft_config)
        model.set_draft_vocab(d2t, t2d)
        return model

    return make
