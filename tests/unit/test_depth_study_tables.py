"""tools/depth_study.py's pure parts, without training: the tables and the two comparisons from
hand-made records (the nearest cell chosen as worked out by hand), the docs it writes, its
options' errors, the resume rules and each cell's training config."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from dspark_ds.config import parse
from dspark_ds.errors import ConfigError

from helpers.tools import load_tool

LABELS = {"dspark": "DSpark", "dflash": "DFlash", "eagle3": "Eagle3"}


@pytest.fixture
def study(monkeypatch):
    return load_tool(monkeypatch, "depth_study")


def rec(kind, depth, multiple, cpu, ms, tau, speedup=1.0, seed=0) -> dict:
    r = {
        "kind": kind,
        "label": LABELS[kind],
        "depth": depth,
        "budget_multiple": multiple,
        "steps": 10 * multiple,
        "seed": seed,
        "train_wall_s": cpu / 2,
        "train_cpu_s": cpu,
    }
    for t, scale in (("T0", 1.5), ("T1", 1.0)):
        r.update({f"tau_{t}": tau * scale, f"speedup_{t}": speedup * scale})
        r.update({f"draft_ms_per_round_{t}": ms, f"verify_ms_per_round_{t}": 2 * ms})
        r[f"accept_rate_by_position_{t}"] = [0.9, 0.5, None]
    return r


# Eagle3's cells: training CPU s and draft ms per round
EAGLE3 = [
    rec("eagle3", 1, 1, cpu=60, ms=0.6, tau=1.6, speedup=1.2),
    rec("eagle3", 2, 1, cpu=90, ms=1.1, tau=1.8, speedup=1.0),
    rec("eagle3", 1, 2, cpu=110, ms=0.6, tau=2.0, speedup=1.5),
    rec("eagle3", 2, 2, cpu=180, ms=1.0, tau=2.2, speedup=1.1),
]


def test_equal_training_time_takes_the_nearest_cpu_seconds_of_any_budget(study):
    recs = [
        *EAGLE3,
        rec("dspark", 1, 1, cpu=100, ms=0.8, tau=2.0),  # 90 and 110 tie: the smaller budget
        rec("dspark", 2, 1, cpu=108, ms=1.0, tau=2.2),  # 110: Eagle3's 2x cell
        rec("dflash", 1, 2, cpu=170, ms=0.5, tau=1.1),  # 180
        rec("dspark", 1, 1, cpu=100, ms=0.8, tau=2.0, seed=1),  # no Eagle3 cell of seed 1
    ]
    got = [
        (
            r["kind"],
            r["depth"],
            r["budget_multiple"],
            r["seed"],
            e and (e["depth"], e["budget_multiple"]),
        )
        for r, e in study.matches(recs, "train_cpu_s", same_budget=False)
    ]
    assert got == [
        ("dspark", 1, 1, 0, (2, 1)),
        ("dspark", 2, 1, 0, (1, 2)),
        ("dflash", 1, 2, 0, (2, 2)),
        ("dspark", 1, 1, 1, None),
    ]
    rows = study.time_table(recs)[2:]
    assert rows[0] == (
        "| 1x | DSpark | 1 | 0 | 100.0 | 2 layer(s), 1x | 90.0 | 2.000 | 1.800 | 1.111 |"
    )
    assert rows[1].endswith("| 108.0 | 1 layer(s), 2x | 110.0 | 2.200 | 2.000 | 1.100 |")
    assert rows[3] == "| 1x | DSpark | 1 | 1 | 100.0 | — | — | 2.000 | — | — |"


def test_equal_draft_cost_takes_the_nearest_draft_ms_of_the_same_budget(study):
    recs = [
        *EAGLE3,
        # 1x: Eagle3 0.6 ms (depth 1) or 1.1 ms (depth 2); the 2x cell's exact 1.0 is not a
        # candidate
        rec("dspark", 2, 1, cpu=100, ms=1.0, tau=2.25, speedup=1.5),
        rec("dflash", 1, 2, cpu=100, ms=0.75, tau=1.0, speedup=0.75),  # 2x: 0.6 (d1) not 1.0
    ]
    pairs = study.matches(recs, "draft_ms_per_round_T1", same_budget=True)
    assert [(e["depth"], e["budget_multiple"]) for _, e in pairs] == [(2, 1), (1, 2)]
    rows = study.cost_table(recs)[2:]
    # τ 2.25 / 1.8 = 1.25, speedup 1.5 / 1.0; τ 1.0 / 2.0, speedup 0.75 / 1.5
    assert rows[0] == "| 1x | DSpark | 2 | 0 | 1.00 | 2 | 1.10 | 2.250 | 1.800 | 1.250 | 1.500 |"
    assert rows[1] == "| 2x | DFlash | 1 | 0 | 0.75 | 1 | 0.60 | 1.000 | 2.000 | 0.500 | 0.500 |"


def test_grid_table_has_a_row_per_cell_in_budget_kind_depth_order(study):
    recs = [*EAGLE3, rec("dspark", 2, 1, cpu=100, ms=1.0, tau=2.25, speedup=1.5)]
    lines = study.grid_table(recs, [0.0, 1.0])
    assert lines[0].startswith("| drafter | depth | budget | steps | seed | τ T=0 | τ T=1 |")
    assert "| train s | train CPU s | acceptance by position T=1 |" in lines[0]
    order = [line.split(" | ")[:3] for line in lines[2:]]
    assert order == [
        ["| DSpark", "2", "1x"],
        ["| Eagle3", "1", "1x"],
        ["| Eagle3", "2", "1x"],
        ["| Eagle3", "1", "2x"],
        ["| Eagle3", "2", "2x"],
    ]
    assert lines[2] == (
        "| DSpark | 2 | 1x | 10 | 0 | 3.375 | 2.250 | 2.25 | 1.50 | 1.00 | 2.00 | 50.0 | 100.0 "
        "| 0.90 0.50 — |"
    )


def _doc(study, recs, tmp_path) -> tuple:
    cfg = parse(study.StudyConfig, ["--docs_dir", str(tmp_path / "docs"), "--depths", "[1,2]"])
    cfg = replace(cfg, budgets=[1, 2], output_dir=str(tmp_path / "out"))
    state = {"settings": study.settings(cfg), "records": recs}
    return cfg, study.document(cfg, state, "python tools/depth_study.py --depths [1,2]")


def test_docs_written_between_the_markers_or_with_a_header(study, tmp_path):
    recs = [*EAGLE3, rec("dspark", 2, 1, cpu=100, ms=1.0, tau=2.25, speedup=1.5)]
    recs.append(rec("dspark", 3, 1, cpu=1, ms=1, tau=1))  # not of this grid: left out
    cfg, doc = _doc(study, recs, tmp_path)
    assert len(doc["records"]) == 5 and doc["base_steps"] == 480
    study.write_docs(cfg, doc, tmp_path / "artifacts")
    docs = tmp_path / "docs"
    text = (docs / "study.md").read_text()
    assert text.startswith(study.HEADER) and study.TABLE_BEGIN in text
    for title in ("Every cell", "At equal training time", "At equal draft cost per round"):
        assert f"\n### {title}\n" in text
    assert "Made by `python tools/depth_study.py --depths [1,2]` on " in text
    assert json.loads((docs / "study.json").read_text())["records"] == doc["records"]
    assert (docs / "images" / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "artifacts" / "study-table.md").is_file()

    (docs / "study.md").write_text(f"intro\n{study.TABLE_BEGIN}\nold\n{study.TABLE_END}\nend\n")
    study.write_docs(cfg, doc, tmp_path / "artifacts")
    text = (docs / "study.md").read_text()
    assert text.startswith("intro\n") and text.endswith(f"{study.TABLE_END}\nend\n")
    assert "\nold\n" not in text and text.count("### Every cell") == 1


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--depths", "[0,1]"], "depths"),
        (["--depths", "[2,2]"], "depths"),
        (["--depths", "[]"], "depths"),
        (["--budgets", "[1,1]"], "budgets"),
        (["--budgets", "[0]"], "budgets"),
        (["--eval.temperatures", "[0.0]"], "eval.temperatures"),
        (["--budget.max_steps", "0"], "budget.max_steps"),
    ],
)
def test_bad_options_exit_2_naming_the_option(study, argv, option, capsys, tmp_path):
    assert study.main(["--output_dir", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {option}:") and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_resume_refuses_a_changed_setting_and_keeps_a_larger_grid(study, tmp_path, capsys):
    out = tmp_path / "out"
    base = ["--output_dir", str(out), "--budget.max_steps", "40", "--depths", "[1]"]
    first = parse(study.StudyConfig, base)
    out.mkdir()
    kept = rec("dspark", 1, 1, cpu=1, ms=1, tau=1)
    state = {"settings": study.settings(first), "records": [kept], "data_ready": [0]}
    study.save_state(first, {**state, "params": None})
    # a larger grid, other docs: the same settings, the cell and the data kept
    again = parse(study.StudyConfig, [*base, "--depths", "[1,2]", "--docs_dir", "d"])
    loaded = study.load_state(again)
    assert loaded["records"] == [kept] and loaded["data_ready"] == [0]
    # another budget: refused, naming the option, before anything is written
    before = (out / "study.json").read_text()
    assert study.main([*base, "--budget.max_steps", "80"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: resume:") and "budget.max_steps 40, this run has 80" in err
    assert "\n" not in err and (out / "study.json").read_text() == before
    with pytest.raises(ConfigError, match="drafter.dspark.block_size"):
        study.load_state(parse(study.StudyConfig, [*base, "--drafter.dspark.block_size", "3"]))
    # --resume false: afresh
    fresh = parse(study.StudyConfig, [*base, "--budget.max_steps", "80", "--resume", "false"])
    assert study.load_state(fresh)["records"] == []


def test_resume_refuses_cells_a_drafter_trained_otherwise_under_the_same_options(
    study, tmp_path, monkeypatch
):
    """`--loss measured` names each preset's measured loss and order; cells made while a preset
    trained otherwise (an older dspark-ds, the same options) are not resumed."""
    out = tmp_path / "out"
    cfg = parse(study.StudyConfig, ["--output_dir", str(out), "--depths", "[1]"])
    out.mkdir()
    state = {"settings": study.settings(cfg), "records": [rec("dflash", 1, 1, 1, 1, 1)]}
    study.save_state(cfg, {**state, "data_ready": [0], "params": None})
    assert study.load_state(cfg)["records"] == state["records"]
    before = study.PRESETS["dflash"]
    changed = replace(before, demo_loss={}, demo_data={"length_grouping": 64})
    monkeypatch.setitem(study.PRESETS, "dflash", changed)
    with pytest.raises(ConfigError, match="resume: .* trains_with.dflash .*'kl': 0.5") as err:
        study.load_state(cfg)
    assert "--resume false" in str(err.value)
    # what the settings hold: DFlash's measured order; another --loss is refused by its name
    monkeypatch.setitem(study.PRESETS, "dflash", before)
    assert study.settings(cfg)["trains_with.dflash"]["data"] == {"length_grouping": 1}
    assert study.settings(cfg)["trains_with.dflash"]["train"] == {"muon_momentum": 0.9}
    tuned = replace(before, demo_train={})
    monkeypatch.setitem(study.PRESETS, "dflash", tuned)
    with pytest.raises(ConfigError, match="resume: .* trains_with.dflash .*'muon_momentum'"):
        study.load_state(cfg)
    monkeypatch.setitem(study.PRESETS, "dflash", before)
    other = parse(study.StudyConfig, ["--output_dir", str(out), "--loss", "preset"])
    with pytest.raises(ConfigError, match="loss"):
        study.load_state(other)


def test_a_cell_trains_at_its_depth_and_budget_under_its_own_names(study, tmp_path):
    cfg = parse(study.StudyConfig, ["--output_dir", str(tmp_path), "--budget.max_steps", "30"])
    data = study.DemoPipeline(cfg)
    data.target, data.num_anchors = SimpleNamespace(path=tmp_path / "target"), {0: 20}
    depth = cfg.drafter.dspark.num_draft_layers
    pipe = study.CellPipeline(cfg, data, depth=4, multiple=4)
    assert pipe.num_anchors is data.num_anchors and pipe.stages is data.stages
    for kind in ("dspark", "dflash", "eagle3"):
        run = pipe.train_config(kind, 0)
        assert run.model.num_draft_layers == 4 != depth and run.train.max_steps == 120, kind
        assert run.name == f"{kind}-d4-b4-s0"
        assert run.tracking.run_name == f"demo-train-{kind}-d4-b4-s0"
    assert pipe.export_dir("eagle3", 0) == pipe.runs_dir / "eagle3-d4-b4-s0" / "export"
    assert pipe.eval_name("dspark", 1.0, 0) == "eval-dspark-d4-b4-T1-s0"
    assert cfg.budget.max_steps == 30 and cfg.drafter.dspark.num_draft_layers == depth  # unchanged
    names = [c.name for c in study.cells(replace(cfg, depths=[2, 1], budgets=[2, 1]))]
    assert names[:4] == ["dspark-d1-b1-s0", "dflash-d1-b1-s0", "eagle3-d1-b1-s0", "dspark-d2-b1-s0"]
    assert len(names) == 12 and names[-1] == "eagle3-d2-b2-s0"


def test_cell_metrics_name_the_cell(study):
    metrics = study.cell_metrics(rec("dflash", 2, 4, cpu=7, ms=0.5, tau=2.0), [0.0, 1.0])
    assert metrics["tau_T1/dflash_d2_b4"] == 2.0 and metrics["speedup_T0/dflash_d2_b4"] == 1.5
    assert (
        metrics["train_cpu_s/dflash_d2_b4"] == 7 and "draft_ms_per_round_T1/dflash_d2_b4" in metrics
    )


def test_progress_line_has_the_cell_the_time_so_far_and_the_steps_left(study, capsys):
    progress = study.Progress(total=12, steps_left=30)
    progress.start(1, study.Cell("dspark", 2, 1, 0), 10)
    first = capsys.readouterr().out
    assert first.startswith("[study] cell 1/12: DSpark depth 2, 1x (10 steps), seed 0 ...")
    assert "elapsed 0:00:0" in first and "ETA" not in first
    progress.finish(time.perf_counter() - 10.2, 10)  # 10 steps in 10 s: 20 steps left
    progress.start(2, study.Cell("eagle3", 2, 2, 0), 20)
    assert capsys.readouterr().out.rstrip().endswith(", ETA 0:00:20")


def test_first_position_gaps_pair_dspark_with_dflash_cell_by_cell(study, tmp_path):
    """DSpark's acceptance at position 0 (T = 0) minus DFlash's, per depth, of the cells that
    have both (the same depth, budget and seed), as worked out by hand; the picture gets its
    fourth panel from them and keeps three without DFlash."""

    def first(kind, depth, multiple, seed, value):
        r = rec(kind, depth, multiple, cpu=1, ms=1, tau=1, seed=seed)
        r["accept_rate_by_position_T0"] = [value, 0.5, None]
        return r

    recs = [
        first("dspark", 3, 1, 0, 0.90),
        first("dflash", 3, 1, 0, 0.93),  # -0.03
        first("dspark", 3, 1, 1, 0.95),
        first("dflash", 3, 1, 1, 0.92),  # +0.03
        first("dspark", 3, 4, 0, 0.97),
        first("dflash", 3, 4, 0, 0.96),  # +0.01
        first("dspark", 5, 1, 0, 0.91),  # no DFlash of depth 5: no gap
        first("dflash", 1, 1, 0, 0.80),  # no DSpark of depth 1: no gap
        *EAGLE3,
    ]
    gaps = study.first_position_gaps(recs)
    assert list(gaps) == [3]
    assert [(m, s) for m, s, _ in gaps[3]] == [(1, 0), (1, 1), (4, 0)]
    assert [g for _, _, g in gaps[3]] == pytest.approx([-0.03, 0.03, 0.01])
    study.plot(recs, tmp_path / "four.png")
    without = [r for r in recs if r["kind"] != "dflash"]
    assert study.first_position_gaps(without) == {}
    study.plot(without, tmp_path / "three.png")
    from PIL import Image

    wide, narrow = (Image.open(tmp_path / n).size[0] for n in ("four.png", "three.png"))
    assert wide > narrow * 1.2
