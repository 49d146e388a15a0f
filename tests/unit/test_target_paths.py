"""A target path transformers cannot read stops with one line and exit 2, naming the path and
what is missing: no config.json (an empty directory, weights alone, a processor / tokenizer
directory), a config.json without a `model_type`, a `model_type` transformers does not know."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from dspark_ds.cli import main as cli_main
from dspark_ds.errors import ConfigError
from dspark_ds.target_checkpoint import causal_lm_config, read_target_config


def _bad_target(root, case: str) -> tuple[str, str]:
    """(a target directory of `case`, what the one line must say of it)."""
    path = root / case
    path.mkdir()
    if case == "weights_only":
        (path / "model.safetensors").write_bytes(b"")
        return str(
            path
        ), f"{path} has no config.json, the model's config (it holds model.safetensors)"
    if case == "processor_only":
        (path / "preprocessor_config.json").write_text(json.dumps({"do_resize": True}))
        (path / "tokenizer_config.json").write_text("{}")
        return str(path), (
            f"{path} has no config.json, the model's config (it holds preprocessor_config.json, "
            "tokenizer_config.json: a processor / tokenizer directory, not a model checkpoint)"
        )
    if case == "no_model_type":
        (path / "config.json").write_text(json.dumps({"hidden_size": 8}))
        return str(path), f"{path / 'config.json'} has no model_type"
    if case == "unknown_model_type":
        (path / "config.json").write_text(json.dumps({"model_type": "no_such_family"}))
        return str(path), f"{path} is a 'no_such_family' checkpoint, a model_type transformers"
    return str(path), f"{path} has no config.json, the model's config (it is empty)"


CASES = ["empty", "weights_only", "processor_only", "no_model_type", "unknown_model_type"]


@pytest.mark.parametrize("case", CASES)
def test_train_on_an_unreadable_target_is_one_line_exit_2(case, tmp_path, capsys):
    path, says = _bad_target(tmp_path, case)
    argv = ["train", "--config", "dspark_ds/recipes/tiny_cpu.yaml", "--target.path", path]
    argv += ["--model.mask_token_id", "1", f"--output_dir={tmp_path / 'runs'}"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("dspark-ds: error: target.path: ") and says in err, err


@pytest.mark.parametrize("case", ["processor_only", "unknown_model_type"])
def test_the_other_readers_of_a_target_say_the_same(case, tmp_path, capsys):
    """`estimate cache` and `eval` read the target through the same function."""
    path, says = _bad_target(tmp_path, case)
    argv = ["estimate", "cache", "--target.path", path, "--num_samples", "10"]
    argv += ["--mean_tokens", "100"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    with pytest.raises(ConfigError, match="^target.path: ") as raised:
        read_target_config(path)
    assert says in str(raised.value)


def test_a_checkpoint_without_a_causal_lm_is_refused_by_name(tmp_path, capsys):
    """A model transformers reads but that is no causal LM, nor holds a text model that is."""
    cfg = AutoConfig.for_model("vit", hidden_size=32, num_hidden_layers=4, num_attention_heads=2)
    with pytest.raises(ConfigError, match="^target.path: vit checkpoints have no causal-LM class"):
        causal_lm_config(cfg)
    cfg.save_pretrained(tmp_path / "vit")
    argv = ["train", "--config", "dspark_ds/recipes/tiny_cpu.yaml"]
    argv += ["--target.path", str(tmp_path / "vit"), f"--output_dir={tmp_path / 'runs'}"]
    assert cli_main([*argv, "--model.mask_token_id", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"target.path: {tmp_path / 'vit'} is a vit checkpoint, which has no causal LM" in err
