"""tools/peer_compare.py on a tiny budget: ours and speculators 0.9's drafters of every kind
trained on the demo's work (a tiny target, a few steps, one seed, two draws), all evaluated by
our evaluator; the table of peers.md and the records of peers.json come out for every kind, each
side's τ the mean of its two trainings.

Needs the speculators environment tools/install.sh makes (a missing one fails naming it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_ds.drafters.presets import PRESET_NAMES, PRESETS

from helpers.speculators_env import load_peer_compare, require_speculators
from helpers.tiny_models import TINY_DEMO_DRAFTERS, TINY_DEMO_TARGET

# the demo smoke's tiny target (helpers.tiny_models.TINY_DEMO_TARGET), fewer prompts and steps
TINY = [
    *TINY_DEMO_TARGET,
    *TINY_DEMO_DRAFTERS,
    *"""
    --data.num_train_prompts 16 --data.num_heldout_prompts 2
    --data.max_new_tokens 16 --data.regenerate_batch_size 8
    --budget.max_steps 2 --budget.global_batch_size 2
    --eval.max_new_tokens 8 --seeds [0] --draws 2
""".split(),
]


@pytest.mark.slow
def test_peer_compare_writes_the_table_and_the_records_of_every_kind(tmp_path, monkeypatch):
    env = Path(require_speculators()).parents[1]
    monkeypatch.setenv("DSPARK_DS_CACHE", str(tmp_path / "cache"))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "peers.md").write_text(
        "# prose before\n\n<!-- peers table: written by tools/peer_compare.py -->\nold\n"
        "<!-- end of the peers table -->\n\nprose after\n"
    )
    argv = [
        "--output_dir",
        str(tmp_path / "out"),
        "--docs_dir",
        str(docs),
        "--speculators_env",
        str(env),
        *TINY,
    ]
    assert load_peer_compare(monkeypatch).main(argv) == 0

    records = json.loads((docs / "peers.json").read_text())
    assert sorted(r["kind"] for r in records) == sorted(PRESET_NAMES)
    for r in records:
        assert r["seed"] == 0 and "tools/peer_compare.py" in r["command"]
        assert r["budget"]["optimizer_steps"] == 2 and r["budget"]["sequences_per_step"] == 2
        assert [d["draw"] for d in r["draws"]] == [0, 101]  # the seed's own, then another
        for side in ("ours", "theirs"):
            assert r[side]["steps"] == 2, (r["kind"], side)  # each trainer ran the budget
            for t in ("T0", "T1"):
                gamma = r["budget"]["draft_length"]
                taus = [d[side][f"tau_{t}"] for d in r["draws"]]
                assert all(1.0 <= tau <= gamma + 1 for tau in taus), (r["kind"], side, t)
                assert r[side][f"tau_{t}"] == pytest.approx(sum(taus) / 2)
                assert r[side][f"tau_{t}_range"] == [min(taus), max(taus)]
        # each draw trained its own drafter, from its own seed (speculators' included)
        assert r["draws"][1]["theirs"]["options"]["seed"] == 101
        assert r["theirs"]["options"]["lr"] == r["budget"]["lr"]
        assert r["theirs"]["options"]["scheduler_type"] == "cosine"

    text = (docs / "peers.md").read_text()
    assert text.startswith("# prose before") and text.rstrip().endswith("prose after")
    assert "\nold\n" not in text  # the table between the markers was replaced
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]
    assert sorted(row.split(" | ")[0][2:] for row in rows) == sorted(
        PRESETS[k].label for k in PRESET_NAMES
    )
    assert "Made by `python tools/peer_compare.py --output_dir" in text
    assert "the mean over 2 trainings of that side" in text
    assert (docs / "images" / "peers_draws.png").read_bytes().startswith(b"\x89PNG")
    out = tmp_path / "out"
    for kind in PRESET_NAMES:
        for name in (f"{kind}-s0", f"{kind}-s0-d101"):
            assert (out / "runs" / name / "export" / "config.json").is_file(), name
            assert (out / "theirs" / name / "run" / "model" / "config.json").is_file(), name
