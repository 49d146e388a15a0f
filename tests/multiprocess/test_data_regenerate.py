"""Regeneration: the target answers every prompt; 2 ranks write each sample exactly once;
a crashed run resumes without redoing or duplicating rows."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from dspark_ds.data.config import DataConfig, RegenerateConfig
from dspark_ds.data.formats import read_conversations
from dspark_ds.data.regen_parts import merge_parts, read_part
from dspark_ds.data.regeneration import regenerate
from dspark_ds.target import TargetConfig

from helpers.tiny_models import write_chat_jsonl

NUM_ROWS = 9


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_target):
    root = tmp_path_factory.mktemp("regen")
    target = tiny_target
    src = write_chat_jsonl(root / "chat.jsonl", NUM_ROWS - 1, seed=4)
    with open(src, "a") as f:  # a prompts-only row in the benchmark layout
        f.write(json.dumps({"turns": ["Say hello.", "Count to five."]}) + "\n")
    return root, target, src


def make_cfg(env, out: Path) -> RegenerateConfig:
    _, target, src = env
    return RegenerateConfig(
        data=DataConfig(paths=[src], max_length=256),
        target=TargetConfig(path=target, dtype="float32", device="cpu"),
        output=str(out),
        batch_size=3,
        max_new_tokens=6,
        seed=1,
    )


def check_output(env, out: Path):
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(NUM_ROWS))  # every sample exactly once, sorted
    originals = list(read_conversations([env[2]]))
    for row, orig in zip(rows, originals):
        users = [m["content"] for m in orig.messages if m["role"] == "user"]
        assert [m["content"] for m in row["messages"] if m["role"] == "user"] == users
        answers = [m for m in row["messages"] if m["role"] == "assistant"]
        assert len(answers) == len(users) and all(a["content"] for a in answers)
        assert row["messages"][-1]["role"] == "assistant"
    assert out.with_name(out.name + ".failed.jsonl").read_text() == ""
    return rows


def _rank_main(rank: int, world: int, port: int, cfg: RegenerateConfig) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_RANK=str(rank),
    )
    from helpers.device_guard import DeviceGuard

    with DeviceGuard() as guard:  # no host-made tensor reaches a collective
        counts = regenerate(cfg)
    assert guard.stats["policed"] > 0, guard.stats
    Path(f"{cfg.output}.counts{rank}").write_text(json.dumps(counts))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_write_every_sample_exactly_once(env, tmp_path):
    cfg = make_cfg(env, tmp_path / "regen.jsonl")
    mp.spawn(_rank_main, args=(2, free_port(), cfg), nprocs=2, join=True)
    check_output(env, tmp_path / "regen.jsonl")
    parts = [
        read_part(tmp_path / "regen.jsonl.parts" / f"part-{r:05d}-of-00002.jsonl") for r in range(2)
    ]
    assert [sorted(r["id"] for r in p) for p in parts] == [[0, 2, 4, 6, 8], [1, 3, 5, 7]]
    total = json.loads((tmp_path / "regen.jsonl.counts0").read_text())
    assert total == {"written": NUM_ROWS, "failed": 0, "skipped": 0}


def test_resume_after_crash_skips_done_rows(env, tmp_path):
    out = tmp_path / "regen.jsonl"
    cfg = make_cfg(env, out)
    first = regenerate(cfg)
    assert first["written"] == NUM_ROWS
    reference = check_output(env, out)
    # Simulate a crash: the part keeps 4 rows plus half a line, no merged output.
    part = tmp_path / "regen.jsonl.parts" / "part-00000-of-00001.jsonl"
    lines = part.read_text().splitlines(keepends=True)
    part.write_text("".join(lines[:4]) + lines[4][:20])
    out.unlink()
    second = regenerate(cfg)
    assert second == {"written": NUM_ROWS, "failed": 0, "skipped": 0}
    rows = check_output(env, out)
    assert rows[:4] == reference[:4]  # kept, not regenerated
    assert len(read_part(part)) == NUM_ROWS
    assert merge_parts(str(out), 1) == {"written": NUM_ROWS, "failed": 0}


def test_changed_inputs_or_settings_are_refused_not_reused(env, tmp_path):
    # rows are resumed by row id: only rows made from the same files and settings may be
    src = tmp_path / "prompts.jsonl"
    shutil.copy(env[2], src)
    out = tmp_path / "regen.jsonl"
    cfg = dataclasses.replace(make_cfg(env, out), data=DataConfig(paths=[str(src)], max_length=256))
    assert regenerate(cfg)["written"] == NUM_ROWS
    first = out.read_text()
    hotter = dataclasses.replace(cfg, temperature=1.0)
    with pytest.raises(ValueError, match=r"temperature 0\.7 -> 1\.0.*--restart true"):
        regenerate(hotter)
    lines = src.read_text().splitlines(keepends=True)
    src.write_text("".join(reversed(lines)))  # the same file name, other prompts per row id
    with pytest.raises(ValueError, match=r"data\.paths\[0\] content changed"):
        regenerate(cfg)
    assert out.read_text() == first  # refused runs lose nothing

    # --restart discards the old rows: the result is a fresh run's, row for row
    fresh = tmp_path / "fresh.jsonl"
    regenerate(dataclasses.replace(hotter, output=str(fresh)))
    assert regenerate(dataclasses.replace(hotter, restart=True))["written"] == NUM_ROWS
    assert out.read_text() == fresh.read_text() != first
    # a rerun with the same inputs resumes (nothing regenerated)
    assert regenerate(hotter)["written"] == NUM_ROWS
    assert out.read_text() == fresh.read_text()

    # rows or an output with no record of their inputs (an older version made them) are refused
    (tmp_path / "regen.jsonl.parts" / "part-00000-of-00001.inputs.json").unlink()
    with pytest.raises(ValueError, match="no record of the inputs"):
        regenerate(hotter)
    shutil.rmtree(tmp_path / "regen.jsonl.parts")
    with pytest.raises(ValueError, match="regen.jsonl exists with no record"):
        regenerate(hotter)
