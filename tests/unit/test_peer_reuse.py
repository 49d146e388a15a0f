"""tools/peer_compare.py --reuse_theirs: a previous run's speculators records are taken only
when they were made with this run's budget, data, target, drafter sizes, evaluation and
speculators options, from the same target weights and prepared data; anything else is refused
naming the option. With --draws, each draw is taken from its own record, and several draws'
records hold their means and ranges."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dspark_ds.errors import ConfigError

from helpers.speculators_env import load_peer_compare

THEN = ["--budget.max_steps", "40", "--seeds", "[0]"]


@pytest.fixture
def tool(monkeypatch):
    return load_peer_compare(monkeypatch)


def _pipe(tool, argv, tmp_path, weights: bytes = b"the target's weights"):
    """A pipeline of `argv` whose target (`weights`) is trained and seed 0's data prepared."""
    cfg = tool.parse(tool.PeerConfig, ["--output_dir", str(tmp_path / "out"), *argv])
    pipe = tool.DemoPipeline(cfg)
    pipe.num_anchors = {0: 30}
    target = tmp_path / "target"
    target.mkdir(exist_ok=True)
    (target / "model.safetensors").write_bytes(weights)
    pipe.target = SimpleNamespace(path=target)
    prepared = pipe.seed_data(0) / "prepared"
    prepared.mkdir(parents=True, exist_ok=True)
    (prepared / "meta.json").write_text(json.dumps({"fingerprint": "d0c989c4"}))
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
                "inputs": tool.inputs_record(pipe, 0),
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


def test_a_record_of_another_target_or_data_from_the_same_options_is_refused(tool, tmp_path):
    """The same options train another target on another CPU type: a record is reused only where
    the target's weights and the prepared data are this run's, and a record that keeps neither
    (made before they were written down) is refused too."""
    file = _previous_file(tool, tmp_path)
    cfg, pipe = _pipe(tool, THEN, tmp_path, weights=b"rounded otherwise")
    previous = tool.Previous.load(str(file), cfg)  # the options alone are the same
    with pytest.raises(ConfigError, match="inputs.target_sha256") as err:
        previous.theirs(pipe, cfg.drafters[0], 0)
    assert "another CPU type" in str(err.value) and "\n" not in str(err.value)
    cfg, pipe = _pipe(tool, THEN, tmp_path)  # the record's target, other data
    (pipe.seed_data(0) / "prepared" / "meta.json").write_text('{"fingerprint": "9f"}')
    with pytest.raises(ConfigError, match="inputs.data_fingerprint 'd0c989c4'"):
        previous.theirs(pipe, cfg.drafters[0], 0)
    recs = json.loads(file.read_text())
    for rec in recs:
        del rec["inputs"]
    file.write_text(json.dumps(recs))
    cfg, pipe = _pipe(tool, THEN, tmp_path)
    with pytest.raises(ConfigError, match="keeps no fingerprint of its target's weights"):
        tool.Previous.load(str(file), cfg).theirs(pipe, cfg.drafters[0], 0)


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


def test_a_draw_the_file_lacks_is_refused_before_anything_runs(tool, tmp_path):
    file = _previous_file(tool, tmp_path)  # one training a side
    cfg, _ = _pipe(tool, [*THEN, "--draws", "2"], tmp_path)
    with pytest.raises(ConfigError, match="no training of draw 101") as err:
        tool.Previous.load(str(file), cfg)
    assert "--draws" in str(err.value) and "\n" not in str(err.value)


def test_each_draw_takes_its_own_training_from_a_file_of_draws(tool, tmp_path):
    file = _previous_file(tool, tmp_path)
    recs = json.loads(file.read_text())
    for rec in recs:
        one = rec["theirs"]
        rec["draws"] = [
            {"draw": 0, "ours": {}, "theirs": one},
            {"draw": 101, "ours": {}, "theirs": {**one, "tau_T0": one["tau_T0"] + 0.5}},
        ]
    file.write_text(json.dumps(recs))
    cfg, pipe = _pipe(tool, [*THEN, "--draws", "2"], tmp_path)
    previous = tool.Previous.load(str(file), cfg)
    kind = cfg.drafters[0]
    assert cfg.draw_seeds(0) == [0, 101]
    assert previous.theirs(pipe, kind, 0, 0)["tau_T0"] == 3.0
    assert previous.theirs(pipe, kind, 0, 101)["tau_T0"] == 3.5


def test_the_records_of_several_draws_hold_their_means_and_the_table_their_ranges(tool, tmp_path):
    cfg, pipe = _pipe(tool, [*THEN, "--draws", "3"], tmp_path)
    kind = cfg.drafters[0]

    def entry(draw, tau_ours, tau_theirs):
        def side(tau):
            row = {"tau": tau, "accept_rate_by_position": [tau / 10, tau / 20]}
            return {"train": {"steps": 40, "train_s": 1.0}, "T0": row}

        theirs = side(tau_theirs)
        theirs["train"]["options"] = {"seed": draw}
        settings = tool.their_settings(pipe, kind, 0)
        inputs = tool.inputs_record(pipe, 0)
        return {
            "draw": draw,
            "ours": side(tau_ours),
            "theirs": theirs,
            "their_job": settings,
            "inputs": inputs,
        }

    cfg.eval.temperatures = [0.0]
    results = {0: {kind: [entry(0, 4.0, 4.5), entry(101, 5.0, 4.5), entry(102, 6.0, 4.5)]}}
    seconds = {"train-ours-dspark-s0": 10.0, "train-ours-dspark-s0-d101": 20.0}
    seconds["train-ours-dspark-s0-d102"] = 30.0
    (rec,) = tool.records(cfg, results, seconds, "cmd", "now")
    assert rec["ours"]["tau_T0"] == pytest.approx(5.0) and rec["ours"]["tau_T0_range"] == [4, 6]
    assert rec["ours"]["accept_rate_by_position_T0"] == pytest.approx([0.5, 0.25])
    assert rec["ours"]["train_s"] == pytest.approx(20.0)
    assert [d["draw"] for d in rec["draws"]] == [0, 101, 102]
    assert rec["theirs"]["options"] == {"seed": 0}  # the first draw's: what a reuse checks
    assert rec["inputs"] == tool.inputs_record(pipe, 0)  # the target's weights and the data
    text = tool.table([rec], [0.0], "cmd", "now")
    assert "| 5.000 (4.00–6.00) | 4.500 (4.50–4.50) |" in text
    assert "ours ≥ theirs in mean τ over 3 trainings a side in T=0 1/1 seeds" in text
    assert "training seeds 101, 102" in text
    tool.plot([rec], [0.0], tmp_path / "images" / "draws.png")
    assert (tmp_path / "images" / "draws.png").read_bytes().startswith(b"\x89PNG")


def test_a_seed_that_is_its_own_draw_is_refused(tool, tmp_path):
    with pytest.raises(ConfigError, match="seeds: 101 is also one of its draws") as err:
        _pipe(tool, ["--seeds", "[0,101]", "--draws", "3"], tmp_path)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="draws: 0"):
        _pipe(tool, ["--draws", "0"], tmp_path)
