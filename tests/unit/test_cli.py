"""The CLI: bad options exit 2 naming the option; --help documents fields; --print_config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dspark_ds.cli import main, parse_config

REPO = Path(__file__).resolve().parents[2]
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


def _one_line_exit_2(capsys, *argv) -> str:
    code, text = run(capsys, *argv)
    assert code == 2, text
    lines = [line for line in text.splitlines() if line.startswith("dspark-ds: error:")]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def test_missing_or_empty_files_are_one_line_errors(capsys, tmp_path):
    train = ["train", "--config", RECIPE, "--output_dir", str(tmp_path / "runs")]
    # "org/name" may be a hub id: not checked, never contacted (the data check fails first)
    real = ["--target.path", "Qwen/Qwen3-0.6B", "--train.synthetic_samples", "0"]
    nope = tmp_path / "nope.jsonl"
    line = _one_line_exit_2(capsys, *train, *real, "--data.paths", f"[{nope}]")
    assert f"data.paths[0]: file {nope} does not exist" in line
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    line = _one_line_exit_2(capsys, *train, *real, "--data.paths", f"[{empty}]")
    assert f"data.paths[0]: {empty} is empty" in line
    # NOTE: a hub-like target: the recipe's runs/tiny_target looks local (and is checked first)
    # wherever the working directory holds a runs/ folder, as after a demo run from the checkout
    hub = ["--target.path", "Qwen/Qwen3-0.6B"]
    for option in ("checkpoint.resume", "model.init_from"):
        line = _one_line_exit_2(capsys, *train, *hub, f"--{option}", str(tmp_path / "gone"))
        assert f"{option}: " in line and f"{tmp_path / 'gone'} does not exist" in line
    # prepare on a file that holds no rows
    from helpers.tiny_models import build_tiny_tokenizer

    build_tiny_tokenizer(tmp_path / "tok")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n \n")
    argv = ["--data.paths", f"[{blank}]", "--data.tokenizer", str(tmp_path / "tok")]
    line = _one_line_exit_2(capsys, "prepare", *argv, "--output_dir", str(tmp_path / "p"))
    assert "holds no rows (empty)" in line
    assert not (tmp_path / "p").exists()
    # eval: a missing benchmark fails before any model loads; so does a missing drafter
    ev = ["eval", "--target.path", "org/target", "--output_dir", str(tmp_path / "runs")]
    line = _one_line_exit_2(capsys, *ev, "--drafter", str(tmp_path), "--benchmarks", "[nope]")
    assert "benchmark 'nope'" in line
    line = _one_line_exit_2(
        capsys, *ev, "--drafter", str(tmp_path / "d"), "--benchmarks", "[gsm8k]"
    )
    assert f"eval.drafter: drafter directory {tmp_path / 'd'} does not exist" in line


def test_local_looking_target_paths_fail_at_once(capsys, tmp_path, monkeypatch):
    from dspark_ds.files import looks_local

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for path in ("./t", "../t", "/abs/t", "~/t", "runs/t", "a/b/c", "t/"):
        assert looks_local(path), path
    for path in ("Qwen/Qwen3-8B", "gpt2", "org/name"):  # may be hub ids
        assert not looks_local(path), path
    # the tiny recipe's default target (runs/tiny_target): `runs` exists here, so it is local
    # and refused at once, instead of after ~25 s of hub retries
    line = _one_line_exit_2(capsys, "train", "--config", str(REPO / RECIPE))
    assert "target.path: runs/tiny_target does not exist (a local path" in line
    argv = ["--data.paths", "[x]", "--data.cache_dir", "c", "--target.path", "./missing"]
    line = _one_line_exit_2(capsys, "build-cache", *argv)
    assert "target.path: ./missing does not exist" in line


def test_version(capsys):
    from dspark_ds import __version__

    code, text = run(capsys, "--version")
    assert code == 0 and text.strip() == f"dspark-ds {__version__}"


def test_shipped_recipes_by_name(capsys, tmp_path, monkeypatch):
    by_path = parse_config("train", ["--config", str(REPO / RECIPE)])
    monkeypatch.chdir(tmp_path)  # not where the package lives
    assert parse_config("train", ["--config", "tiny_cpu"]) == by_path
    assert parse_config("train", ["--config=tiny_cpu.yaml"]) == by_path
    line = _one_line_exit_2(capsys, "train", "--config", "tiny_cpuu")
    assert "--config: tiny_cpuu is neither a file nor a shipped recipe" in line
    assert "tiny_cpu," in line  # the names to choose from


def test_print_config_runs_the_checks(capsys, tmp_path):
    # a bad config must not print as if it were fine
    for bad in (["--train.lr", "-1"], ["--data.batch_size", "0"]):
        code, text = run(capsys, "train", "--config", RECIPE, *bad, "--print_config")
        assert code == 2 and "synthetic_samples" not in text, text
    code, text = run(capsys, "train", "--config", RECIPE, "--print_config", "--train.lr", "2e-4")
    assert code == 0
    (tmp_path / "printed.yaml").write_text(text)  # what it prints is a recipe that parses back
    again = parse_config("train", ["--config", str(tmp_path / "printed.yaml")])
    assert again == parse_config("train", ["--config", RECIPE, "--train.lr", "2e-4"])


def test_wasteful_block_shapes_warn(capsys):
    parse_config("train", ["--config", RECIPE, "--model.num_anchors", "100"])
    err = capsys.readouterr().err
    assert "warning: model.num_anchors 100 exceeds the 63 anchor positions" in err
    parse_config("train", ["--config", RECIPE, "--model.block_size", "40"])
    assert "warning: model.block_size 40 is more than half of data.max_length 64" in (
        capsys.readouterr().err
    )
    parse_config("train", ["--config", RECIPE])
    assert "warning" not in capsys.readouterr().err


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


def test_only_config_errors_are_one_line_exits(capsys, monkeypatch):
    """What the user must fix (a ConfigError, wherever the run finds it) is one line and exit 2;
    any other exception is a bug: the CLI lets it through (Python prints its traceback and exits
    1)."""
    import dspark_ds.train.trainer as trainer
    from dspark_ds.errors import ConfigError

    def fixable(cfg):
        raise ConfigError("data.paths: a fixable problem")

    def bug(cfg):
        raise ValueError("an internal invariant broke")

    argv = ["train", "--config", RECIPE, "--target.path", "org/name"]
    monkeypatch.setattr(trainer, "train", fixable)
    line = _one_line_exit_2(capsys, *argv)
    assert line == "dspark-ds: error: data.paths: a fixable problem"
    monkeypatch.setattr(trainer, "train", bug)
    with pytest.raises(ValueError, match="an internal invariant broke"):
        main(argv)


@pytest.mark.slow  # a subprocess run (its imports: about 7 s)
def test_the_command_ends_without_interpreter_finalization():
    """`dspark-ds` (and `python -m dspark_ds.cli`) ends a finished subcommand with os._exit
    after destroying its process group, as multi-rank runs do: at finalization DeepSpeed's
    module-global gloo groups could abort a finished single-process run (SIGABRT, "terminate
    called without an active exception", seen once in a test's 1-process training). An exit
    hook of the program therefore never runs, the exit code and the output stay; `main()`
    called from inside another program still returns."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('finalized', flush=True))\n"
        "from dspark_ds.cli import entry\n"
        "sys.exit(entry(['tune', '--recipe', 'dspark_ds/recipes/dspark_qwen3_8b.yaml']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recommended:" in proc.stdout and "finalized" not in proc.stdout
