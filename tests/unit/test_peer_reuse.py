"""tools/peer_compare.py --reuse_theirs: a previous run's speculators records are taken only
when they were made with this run's budget, data, target, drafter sizes, evaluation and
speculators options; anything else is refused naming the option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_ds.errors import ConfigError

from helpers.speculators_env import load_peer_compare

THEN = ["--budget.max_steps", "40", "--seeds", "[0]"]


@pytest.fixture
def tool(monkeypatch):
    return load_peer_compare(monkeypatch)


def _pipe(tool, argv, tmp_path):
    cfg = tool.parse(tool.PeerConfig, ["--output_dir", str(tmp_path / "out"), *argv])
    pipe = tool.DemoPipeline(cfg)
    pipe.num_anchors = {0: 30}
    return cfg, pipe


def _previous_file(tool, tmp_path) -> Path:
    """A peers.json as a run of THEN writes it (the theirs side's options as speculators
    resolves them), its date in the peers.md beside it."""
    cfg, pipe = _pipe(tool, THEN, tmp_path)
    recs = []
    for kind in cfg.drafters:
        s = tool.their_settings(pipe, kind, 0)
        options = {k: s[v] for k, v in tool.THEIR_OPTIONS.items()} | {"optimizer": "muon"}
        recs.append(
            {
                "kind": kind,
                "label": tool.PRESETS[kind].label,
                "seed": 0,
                "ours": {"tau_T0": 2.0},
                "theirs": {"tau_T0": 3.0 + len(recs), "train_s": 9.0, "options": options},
                "budget": tool.budget_record(cfg, s),
                "command": "python tools/peer_compare.py " + " ".join(THEN),
            }
        )
    (tmp_path / "peers.json").write_text(json.dumps(recs))
    (tmp_path / "peers.md").write_text(
        "Made by `python tools/peer_compare.py` on 2026-12-06 09:44 UTC."
    )
    return tmp_path / "peers.json"


def test_the_records_of_the_same_work_are_reused_with_their_origin(tool, tmp_path):
    file = _previous_file(tool, tmp_path)
    cfg, pipe = _pipe(
        tool, [*THEN, "--budget.optimizer", "muon", "--loss", "speculators"], tmp_path
    )
    previous = tool.Previous.load(str(file), cfg)  # ours' own optimizer and loss may change
    theirs = {kind: previous.theirs(pipe, kind, 0) for kind in cfg.drafters}
    assert [t["tau_T0"] for t in theirs.values()] == [3.0, 4.0, 5.0]
    origin = theirs[cfg.drafters[0]]["reused_from"]
    assert origin["date"] == "2026-12-06 09:44 UTC" and origin["file"] == str(file)
    recs = [
        {"label": k, "seed": 0, "ours": {"tau_T0": 1.0, "train_s": 1}, "theirs": t}
        for k, t in theirs.items()
    ]
    text = tool.table(recs, [0.0], "cmd", "now")
    assert f"reused from {file} (made by `python tools/peer_compare.py --budget" in text
    assert "on 2026-12-06 09:44 UTC" in text


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--data.max_length", "64"], "data.max_length"),
        (["--target.hidden_size", "96"], "target.hidden_size"),
        (["--drafter.dspark.num_draft_layers", "4"], "drafter.dspark"),
        (["--eval.max_new_tokens", "48"], "eval.max_new_tokens"),
        (["--seeds", "[0,1]"], "seed 1"),
    ],
)
def test_other_work_is_refused_naming_what_differs(tool, tmp_path, argv, named):
    file = _previous_file(tool, tmp_path)
    cfg, _ = _pipe(tool, [*THEN, *argv], tmp_path)
    with pytest.raises(ConfigError, match="reuse_theirs") as err:
        tool.Previous.load(str(file), cfg)
    assert named in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "argv, named",
    [(["--budget.lr", "1e-3"], "budget.lr"), (["--budget.warmup_ratio", "0.1"], "warmup_ratio")],
)
def test_another_budget_is_refused(tool, tmp_path, argv, named):
    file = _previous_file(tool, tmp_path)
    cfg, pipe = _pipe(tool, [*THEN, *argv], tmp_path)
    previous = tool.Previous.load(str(file), cfg)
    with pytest.raises(ConfigError, match=named):
        previous.theirs(pipe, cfg.drafters[0], 0)


def test_the_work_a_record_keeps_decides_not_todays_defaults(tool, tmp_path):
    """A record that keeps its work's options (`work`, written since) is judged by them: a default
    changed since its command ran does not make it another run's, and a record whose kept
    options differ is refused naming the option."""
    file = _previous_file(tool, tmp_path)
    recs = json.loads(file.read_text())
    cfg, _ = _pipe(tool, THEN, tmp_path)
    kept = tool.work_record(cfg)
    deeper = json.loads(json.dumps(kept))
    deeper["drafter"]["dspark"]["num_draft_layers"] += 1
    # the record says it was made at one more layer than this run's (as if the default moved)
    for rec in recs:
        rec["work"] = deeper
    file.write_text(json.dumps(recs))
    with pytest.raises(ConfigError, match=r"drafter\.dspark .*num_draft_layers"):
        tool.Previous.load(str(file), cfg)
    for rec in recs:
        rec["work"] = kept
    file.write_text(json.dumps(recs))
    tool.Previous.load(str(file), cfg)  # its own options: taken
