"""`dspark-ds compare` on two real tiny training runs (DSpark vs DFlash heads) in one MLflow
store: the differing params, both τ values, the overlay plots; and its error handling."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dspark_ds.cli import main as cli_main

from helpers.dist import check, python

REPO = Path(__file__).resolve().parents[2]

TINY = str(REPO / "dspark_ds" / "recipes" / "tiny_cpu.yaml")
DFLASH = [
    "--model.markov_rank",
    "0",
    "--model.confidence_head_alpha",
    "0",
    "--model.confidence_head_with_markov",
    "false",
    "--model.ce_loss_alpha",
    "1.0",
    "--model.l1_loss_alpha",
    "0.0",
]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, tiny_target):
    root = tmp_path_factory.mktemp("compare")
    target = tiny_target
    common = [
        "--config",
        TINY,
        "--target.path",
        target,
        "--output_dir",
        str(root / "runs"),
        "--train.max_steps",
        "3",
        "--train.progress_bar",
        "false",
        "--checkpoint.every_steps",
        "0",
        "--checkpoint.export_final",
        "false",
        "--validation.every_steps",
        "0",
        "--validation.num_batches",
        "1",
    ]
    spec = {
        "runs": [[*common, "--name", "dspark"], [*common, "--name", "dflash", *DFLASH]],
        "result_file": str(root / "result.json"),
    }
    (root / "spec.json").write_text(json.dumps(spec))
    check(
        python(
            [str(REPO / "tests" / "helpers" / "dist.py"), "train-many", str(root / "spec.json")],
            timeout_s=900,
        )
    )
    result = json.loads((root / "result.json").read_text())
    return root, f"sqlite:///{root / 'runs' / 'mlflow.db'}", result


@pytest.mark.slow
def test_compare_two_real_runs(two_runs, capsys):
    root, uri, result = two_runs
    out_dir = root / "plots"
    assert cli_main(["compare", "--tracking_uri", uri, "--out_dir", str(out_dir)]) == 0
    text = capsys.readouterr().out
    assert "2 run(s)" in text

    # the params that differ, with both values; identical ones are left out
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.strip()}
    assert sorted(rows["model.markov_rank"]) == ["0", "16"], text
    assert sorted(rows["model.ce_loss_alpha"]) == ["0.1", "1.0"], text
    assert "train.lr" not in rows and "train.max_steps" not in rows, text

    # both τ values, equal to what MLflow holds for each run
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    shown = [float(x) for x in rows["train/tau_probabilistic"][1:]]
    header = next(line for line in text.splitlines() if line.startswith("metric "))
    order = re.findall(r"\((\w{8})\)", header)
    ids = {r["mlflow_run_id"][:8]: r["mlflow_run_id"] for r in result.values()}
    expected = [
        client.get_metric_history(ids[o], "train/tau_probabilistic")[-1].value for o in order
    ]
    assert len(shown) == 2 and shown == pytest.approx(expected, rel=1e-3), text
    assert all(1.0 <= t <= 1 + 4 for t in shown)  # 1 + γ at most (γ = 4)
    assert "val/tau_probabilistic" in rows

    for name in ("loss.png", "tau.png"):
        data = (out_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


@pytest.mark.slow
def test_select_by_id_prefix_and_filter(two_runs, capsys):
    _, uri, result = two_runs
    rid = result["dflash"]["mlflow_run_id"]
    assert (
        cli_main(
            ["compare", "--tracking_uri", uri, "--run_ids", f"[{rid[:8]}]", "--out_dir", "null"]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "1 run(s)" in text and rid[:8] in text and "plots:" not in text
    assert (
        cli_main(
            [
                "compare",
                "--tracking_uri",
                uri,
                "--filter",
                "params.`model.markov_rank` = '16'",
                "--out_dir",
                "null",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "1 run(s)" in text and result["dspark"]["mlflow_run_id"][:8] in text


@pytest.mark.slow
def test_errors_name_the_option(two_runs, capsys):
    _, uri, _ = two_runs
    assert cli_main(["compare", "--tracking_uri", uri, "--experiment", "[nope]"]) == 2
    assert "experiment: 'nope' does not exist" in capsys.readouterr().err
    assert cli_main(["compare", "--tracking_uri", uri, "--filter", "params.x ~~ 1"]) == 2
    assert "filter:" in capsys.readouterr().err
    assert cli_main(["compare", "--tracking_uri", uri, "--run_ids", "[zz]"]) == 2
    assert "run_ids:" in capsys.readouterr().err


def test_an_all_digit_run_id_prefix_is_taken_as_its_digits():
    """`--run_ids [44420656]` parses as a number; compare must still use it as an id prefix."""
    from dspark_ds.config import parse
    from dspark_ds.tracking.compare import CompareConfig

    cfg = parse(CompareConfig, ["--run_ids", "[44420656, a1b2c3]"])
    assert [str(r) for r in cfg.run_ids] == ["44420656", "a1b2c3"]
    # prefixes YAML reads as numbers: a float (755331e2 = 75533100.0, seen in CI), hex, octal
    argv = ["--run_ids", "[755331e2, 0x1f2e3d, 00123456, '1_000a']"]
    assert parse(CompareConfig, argv).run_ids == ["755331e2", "0x1f2e3d", "00123456", "1_000a"]
    assert parse(CompareConfig, ["--run_ids=[755331e2]"]).run_ids == ["755331e2"]
