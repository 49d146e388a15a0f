"""tools/depth_study.py on a tiny grid (depths 1 and 2, the budget 2x of 2 steps, one seed,
the demo smoke's tiny target): a record per kind, depth and budget in study.json, the grid and
both comparisons in study.md's tables, the picture, the study's MLflow run with every training
nested under it, and a rerun that trains nothing again."""

from __future__ import annotations

import json
import re

import pytest

from dspark_ds.drafters.presets import PRESET_NAMES
from dspark_ds.tracking.store import child_runs, list_artifacts, read_run

from helpers.tiny_models import TINY_DEMO_DRAFTERS, TINY_DEMO_TARGET
from helpers.tools import load_tool

# test_peer_compare's tiny work (the demo smoke's target, fewer prompts and steps)
TINY = [
    *TINY_DEMO_TARGET,
    *TINY_DEMO_DRAFTERS,
    *"""
    --data.num_train_prompts 16 --data.num_heldout_prompts 2
    --data.max_new_tokens 16 --data.regenerate_batch_size 8
    --budget.max_steps 2 --budget.global_batch_size 2
    --eval.max_new_tokens 8 --seeds [0] --depths [1,2] --budgets [2]
""".split(),
]
CELLS = {(k, d, 2) for k in PRESET_NAMES for d in (1, 2)}


@pytest.mark.slow
def test_depth_study_writes_every_cell_and_resumes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSPARK_DS_CACHE", str(tmp_path / "cache"))
    study = load_tool(monkeypatch, "depth_study")
    docs, out = tmp_path / "docs", tmp_path / "out"
    docs.mkdir()
    (docs / "study.md").write_text(
        f"# prose before\n\n{study.TABLE_BEGIN}\nold\n{study.TABLE_END}\n\nprose after\n"
    )
    argv = ["--output_dir", str(out), "--docs_dir", str(docs), *TINY]
    assert study.main(argv) == 0

    doc = json.loads((docs / "study.json").read_text())
    assert doc["base_steps"] == 2 and "tools/depth_study.py" in doc["command"]
    recs = doc["records"]
    assert {(r["kind"], r["depth"], r["budget_multiple"]) for r in recs} == CELLS
    assert len(recs) == len(CELLS)
    for r in recs:
        assert r["steps"] == r["trained_steps"] == 2 * r["budget_multiple"], r["run"]
        for t in ("T0", "T1"):
            assert 1.0 <= r[f"tau_{t}"] <= 5.0 and r[f"speedup_{t}"] > 0, (r["run"], t)
            assert r[f"draft_ms_per_round_{t}"] > 0 and len(r[f"accept_rate_by_position_{t}"]) == 4
        assert r["train_wall_s"] > 0 and r["train_cpu_s"] > 0
    # the depth reached every kind's drafter
    config = json.loads((out / "runs" / "eagle3-d2-b2-s0" / "export" / "config.json").read_text())
    assert config["draft_num_hidden_layers"] == 2

    text = (docs / "study.md").read_text()
    assert text.startswith("# prose before") and text.rstrip().endswith("prose after")
    assert "\nold\n" not in text
    grid, by_time, by_cost = text.split("### ")[1:4]
    assert [s.splitlines()[0] for s in (grid, by_time, by_cost)] == [
        "Every cell",
        "At equal training time",
        "At equal draft cost per round",
    ]
    assert len([line for line in grid.splitlines() if line.startswith("| ")]) == 1 + 6
    for section in (by_time, by_cost):  # DSpark and DFlash: 2 depths each
        assert len([line for line in section.splitlines() if line.startswith("| ")]) == 1 + 4
    png = (docs / "images" / "study.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000

    uri = f"sqlite:///{out / 'mlflow.db'}"
    run_id = (out / "runs" / "study" / "mlflow_run_id").read_text().strip()
    run = read_run(uri, run_id)
    assert run.info.status == "FINISHED" and run.data.params["depths"] == "[1, 2]"
    assert "tau_T1/dspark_d2_b2" in run.data.metrics
    assert {"study.png", "study.json", "study-table.md"} <= set(list_artifacts(uri, run_id))
    trainings = {r.info.run_name for r in child_runs(uri, run_id)}
    assert trainings == {f"demo-train-{k}-d{d}-b{b}-s0" for k, d, b in CELLS}

    # a rerun keeps every cell: nothing trained again, the same MLflow run continued
    logs = sorted(out.glob("runs/*/train_log.jsonl"))
    stamps = [p.stat().st_mtime_ns for p in logs]
    capsys.readouterr()
    assert study.main(argv) == 0
    said = capsys.readouterr().out
    assert said.count("done before, kept") == 6 and not re.search(r"stage \d+: train-", said)
    assert [p.stat().st_mtime_ns for p in logs] == stamps and len(logs) == 6
    assert (out / "runs" / "study" / "mlflow_run_id").read_text().strip() == run_id
    assert len(json.loads((docs / "study.json").read_text())["records"]) == 6
