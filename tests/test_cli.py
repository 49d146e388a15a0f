"""The CLI: bad options exit 2 naming the option; --help documents fields; --print_config."""

from __future__ import annotations

import pytest

from dspark_ds.cli import main, parse_config

RECIPE = "dspark_ds/recipes/tiny_cpu.yaml"


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--train.lrr", "1"], "train.lrr"),
        (["--train.lr", "abc"], "train.lr"),
        (["--train.lr", "-1"], "train.lr"),
        (["--train.precision", "fp8"], "train.precision"),
        (["--data.batch_size", "0"], "data.batch_size"),
        (
            ["--model.confidence_head_with_markov", "true", "--model.markov_rank", "0"],
            "model.confidence_head_with_markov",
        ),
        (["--checkpoint.keep_last", "0"], "checkpoint.keep_last"),
        (["--target.path", ""], "target.path"),
    ],
)
def test_bad_option_exits_2_naming_it(capsys, argv, option):
    code, text = run(capsys, "train", "--config", RECIPE, *argv)
    assert code == 2
    assert option in text


def test_unknown_subcommand_exits_2(capsys):
    code, text = run(capsys, "trian")
    assert code == 2 and "trian" in text


def test_help_lists_subcommands_and_field_docs(capsys):
    code, text = run(capsys, "--help")
    assert code == 0
    for name in (
        "prepare",
        "regenerate",
        "build-cache",
        "train",
        "eval",
        "export",
        "demo",
        "estimate",
        "bench",
        "bench-decode",
    ):
        assert name in text
    code, text = run(capsys, "train", "--help")
    assert code == 0
    assert "--train.lr" in text and "Peak learning rate" in text
    assert "--deepspeed.config" in text and "zero3_offload_cpu" in text


def test_print_config_and_overrides(capsys):
    code, text = run(capsys, "train", "--config", RECIPE, "--train.lr", "1e-4", "--print_config")
    assert code == 0
    assert "lr: 0.0001" in text and "synthetic_samples: 256" in text
    cfg = parse_config(
        "train", ["--config", RECIPE, "--train.lr", "2e-4", "--deepspeed.config", "zero3"]
    )
    assert cfg.train.lr == 2e-4 and cfg.deepspeed.config == "zero3"
    assert cfg.model.num_anchors == 8  # from the recipe


def test_setup_errors_exit_2(capsys, tmp_path):
    # found while setting up, before any process group or model exists
    code, text = run(
        capsys,
        "train",
        "--config",
        RECIPE,
        "--target.path",
        str(tmp_path / "nope"),
        "--output_dir",
        str(tmp_path),
    )
    assert code == 2 and "target.path" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["train", "--config", RECIPE, "--eval.every_steps", "2"],
            "--eval.every_steps: renamed to --validation.every_steps",
        ),
        (["eval", "--target", "t", "--drafter", "d"], "--target: renamed to --target.path"),
        (["bench-decode", "--target=t", "--drafter", "d"], "--target: renamed to --target.path"),
        (
            ["export", "--checkpoint", "c", "--output_dir", "o", "--target_path", "t"],
            "--target_path: renamed to --target.path",
        ),
        (
            ["tune", "--recipe", RECIPE, "--target_path", "t"],
            "--target_path: renamed to --target.path",
        ),
    ],
)
def test_old_spellings_exit_2_naming_the_new_one(capsys, argv, message):
    code, text = run(capsys, *argv)
    assert code == 2 and message in text


def test_an_old_recipe_section_is_named(capsys, tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text(open(RECIPE).read().replace("\nvalidation:\n", "\neval:\n"))
    code, text = run(capsys, "train", "--config", str(old))
    assert code == 2 and f"eval: renamed to validation (in {old})" in text


def test_the_target_is_target_path_everywhere():
    for name, argv in (
        ("train", ["--config", RECIPE]),
        ("eval", ["--drafter", "d"]),
        ("bench-decode", ["--drafter", "d"]),
        ("export", ["--checkpoint", "c", "--output_dir", "o"]),
        ("tune", ["--recipe", RECIPE]),
    ):
        cfg = parse_config(name, [*argv, "--target.path", "some/target"])
        assert cfg.target.path == "some/target", name
