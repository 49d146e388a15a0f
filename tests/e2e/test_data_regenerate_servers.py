"""Regeneration through OpenAI-compatible servers (`--server.urls`).

Against real servers: two `transformers serve` processes on the tiny target, shared by the
module: greedy answers equal the in-rank path's; a server killed mid-run leaves its rows to the
other, none lost or written twice; Ctrl-C keeps every finished row and a rerun resumes.
Against small real HTTP servers that misbehave on purpose: HTTP 500s, bodies that are not JSON
and answers that come too late are retried, then recorded in failed.jsonl (a rerun answers
them); a server out of rotation is probed back; a fleet that stays down stops the run; bad
servers at the start exit 2 with one line naming the URL, and nothing written is lost.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dspark_ds import cli
from dspark_ds.data.config import DataConfig, RegenerateConfig, ServerConfig
from dspark_ds.data.formats import read_conversations
from dspark_ds.data.regen_parts import read_part
from dspark_ds.data.regeneration import regenerate
from dspark_ds.errors import TrainingStopped
from dspark_ds.target import TargetConfig

from helpers.openai_servers import MisbehavingServer, TransformersServe, free_port
from helpers.tiny_models import write_chat_jsonl

REPO = Path(__file__).resolve().parents[2]
NUM_ROWS = 24  # the equality check's rows
LONG_ROWS = 48  # rows of the runs that are interrupted mid-way


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_target):
    root = tmp_path_factory.mktemp("regen_servers")
    target = tiny_target
    src = write_chat_jsonl(root / "chat.jsonl", NUM_ROWS - 1, seed=4)
    with open(src, "a") as f:  # a prompts-only row in the benchmark layout, two turns
        f.write(json.dumps({"turns": ["Say hello.", "Count to five."]}) + "\n")
    long = write_chat_jsonl(root / "long.jsonl", LONG_ROWS, seed=7)
    return {"root": root, "target": target, "src": src, "long": long}


@pytest.fixture(scope="module")
def servers(env):
    """Two `transformers serve` processes on the tiny target (started together)."""
    pair = [TransformersServe(env["target"], env["root"], f"serve{i}") for i in range(2)]
    try:
        for s in pair:
            s.launch()
        for s in pair:
            s.wait_ready()
        yield pair
    finally:
        for s in pair:
            s.stop()


def server_cfg(
    env, out: Path, urls: list[str], src: str | None = None, **server
) -> RegenerateConfig:
    return RegenerateConfig(
        data=DataConfig(paths=[src or env["src"]], max_length=256),
        target=TargetConfig(path=env["target"], dtype="float32", device="cpu"),
        server=ServerConfig(urls=urls, **({"timeout_s": 60} | server)),
        output=str(out),
        max_new_tokens=8,
        temperature=0.0,
    )


def output_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def check_complete(out: Path, src: str) -> list[dict]:
    """Every row of `src` exactly once, sorted, each user turn answered; no failures."""
    rows = output_rows(out)
    originals = list(read_conversations([src]))
    assert [r["id"] for r in rows] == [o.index for o in originals]
    for row, orig in zip(rows, originals):
        users = [m["content"] for m in orig.messages if m["role"] == "user"]
        assert [m["content"] for m in row["messages"] if m["role"] == "user"] == users
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert len(answers) == len(users) and all(answers)
    assert Path(f"{out}.failed.jsonl").read_text() == ""
    return rows


def part_of(out: Path) -> Path:
    return Path(f"{out}.parts") / "part-00000-of-00001.jsonl"


def rows_in(part: Path) -> int:
    """Finished rows of a part another process is writing (read_part would cut a torn last
    line off the writer's file)."""
    return part.read_bytes().count(b"\n") if part.exists() else 0


# ---- real servers ----------------------------------------------------------------------------


@pytest.mark.slow
def test_greedy_answers_through_servers_equal_the_local_paths(env, servers, tmp_path):
    local_out, served_out = tmp_path / "local.jsonl", tmp_path / "served.jsonl"
    cfg = server_cfg(env, served_out, [s.url for s in servers], concurrency=4)
    local = regenerate(dataclasses.replace(cfg, output=str(local_out), server=ServerConfig()))
    served = regenerate(cfg)
    assert local["written"] == served["written"] == NUM_ROWS
    a, b = check_complete(local_out, env["src"]), check_complete(served_out, env["src"])
    same = sum(x["messages"] == y["messages"] for x, y in zip(a, b))
    print(f"greedy answers equal to the local path's: {same}/{NUM_ROWS} rows")
    assert same / NUM_ROWS >= 0.95
    # both servers answered (least-in-flight routing), every turn counted once
    answered = [s["answered"] for s in served["servers"]]
    turns = sum(len([m for m in r["messages"] if m["role"] == "user"]) for r in b)
    assert min(answered) > 0 and sum(answered) == turns, served["servers"]
    assert served["tokens_per_s"] > 0 and served["rows_per_s"] > 0
    # the max_new_tokens cut (finish_reason length) is kept and counted
    assert served["truncated_turns"] > 0


@pytest.mark.slow
def test_transformers_serve_refuses_sampling_fields_exit_2(env, servers, tmp_path, capsys):
    # transformers serve rejects top_k / min_p (HTTP 422): found by the start-up request
    out = tmp_path / "x.jsonl"
    argv = ["regenerate", "--data.paths", f"[{env['src']}]", "--target.path", env["target"]]
    argv += ["--output", str(out), "--server.urls", f"[{servers[0].url}]", "--temperature", "0.7"]
    rc = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert servers[0].url in err[0] and "422" in err[0] and "top_k" in err[0], err
    assert not Path(f"{out}.parts").exists()


@pytest.mark.slow
def test_server_killed_mid_run_its_rows_finish_on_the_other(env, servers, tmp_path):
    out = tmp_path / "killed.jsonl"
    cfg = server_cfg(
        env,
        out,
        [s.url for s in servers],
        src=env["long"],
        concurrency=4,
        retry_backoff_s=0.2,
        probe_interval_s=0.5,
    )
    cfg = dataclasses.replace(cfg, max_new_tokens=24)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(regenerate(cfg)))
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while len(read_part(part_of(out))) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        servers[1].kill()
        killed_at = len(read_part(part_of(out)))
        thread.join(timeout=180)
        assert not thread.is_alive()
    finally:
        if not servers[1].alive():  # the next tests get both servers again
            servers[1].start()
    assert killed_at < LONG_ROWS, "the run ended before the kill"
    assert result["written"] == LONG_ROWS and result["failed"] == 0
    check_complete(out, env["long"])
    records = read_part(part_of(out))
    assert sorted(r["id"] for r in records) == list(range(LONG_ROWS))  # none twice in the part
    a, b = result["servers"]
    assert b["outages"] >= 1 and a["outages"] == 0, result["servers"]
    assert a["answered"] > b["answered"], result["servers"]


@pytest.mark.slow
def test_ctrl_c_keeps_finished_rows_and_a_rerun_resumes(env, servers, tmp_path):
    out = tmp_path / "interrupted.jsonl"
    argv = ["regenerate", "--data.paths", f"[{env['long']}]", "--target.path", env["target"]]
    argv += ["--output", str(out), "--server.urls", f"[{servers[0].url},{servers[1].url}]"]
    argv += ["--server.concurrency", "1", "--temperature", "0", "--max_new_tokens", "64"]
    argv += ["--data.max_length", "256"]
    # NOTE: one request at a time and longer answers: the whole run takes several seconds
    # after its fifth row (at concurrency 2 and 24 tokens it took 2 s, and once in CI it had
    # finished before the signal arrived)
    env_vars = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    }
    # NOTE: a shell without job control starts its background jobs with SIGINT ignored, and a
    # child inherits that (Python then installs no Ctrl-C handler): as a terminal would, the
    # child gets SIGINT's default disposition whatever started the test run
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspark_ds.cli", *argv],
        env=env_vars,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while rows_in(part_of(out)) < 5 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    out_text, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "dspark-ds: interrupted" in err and "the same command resumes" in out_text, err
    kept = part_of(out).read_text()
    first = read_part(part_of(out))
    assert 5 <= len(first) < LONG_ROWS and all("messages" in r for r in first)
    assert len({r["id"] for r in first}) == len(first)
    assert not out.exists()  # merged only when every row is done

    assert cli.main(argv) == 0
    assert part_of(out).read_text().startswith(kept)  # the kept rows were not redone
    check_complete(out, env["long"])
    assert sorted(r["id"] for r in read_part(part_of(out))) == list(range(LONG_ROWS))


# ---- misbehaving servers -------------------------------------------------------------------


def quick(env, out: Path, urls: list[str], **server) -> RegenerateConfig:
    settings = {
        "timeout_s": 0.5,
        "max_retries": 2,
        "retry_backoff_s": 0.02,
        "probe_interval_s": 0.05,
        "give_up_s": 5.0,
    } | server
    cfg = server_cfg(env, out, urls, **settings)
    src = env["root"] / "three.jsonl"
    if not src.exists():
        write_chat_jsonl(src, 3, seed=1)
    return dataclasses.replace(cfg, data=DataConfig(paths=[str(src)], max_length=256))


@pytest.mark.parametrize(
    "mode,reason",
    [
        ("500", "HTTP 500 (boom)"),
        ("garbage", "not an OpenAI chat completion"),
        ("slow", "no answer within 0.25 s"),
    ],
)
def test_misbehaving_server_is_retried_then_rows_go_to_failed_jsonl(env, tmp_path, mode, reason):
    out = tmp_path / "out.jsonl"
    with MisbehavingServer(mode, delay_s=1.0) as server:
        cfg = quick(env, out, [server.url], concurrency=1, timeout_s=0.25)
        counts = regenerate(cfg)
        assert counts["written"] == 0 and counts["failed"] == 3
        failed = [json.loads(line) for line in Path(f"{out}.failed.jsonl").read_text().splitlines()]
        assert [r["id"] for r in failed] == [0, 1, 2]
        for rec in failed:
            assert rec["error"].startswith(f"turn 0: {server.url}: {reason}"), rec
            assert rec["error"].endswith("(3 tries)"), rec
        assert server.chats == 1 + 3 * 3  # the start-up request, then 1 + max_retries per row
        assert counts["servers"][0]["outages"] >= 1
        # a rerun tries the failed rows again; the merge keeps the answers, each row once
        server.heal()
        again = regenerate(cfg)
    assert again["written"] == 3 and again["failed"] == 0
    rows = output_rows(out)
    assert [r["id"] for r in rows] == [0, 1, 2]
    assert all(r["messages"][-1]["content"] == "pong" for r in rows)
    assert Path(f"{out}.failed.jsonl").read_text() == ""


def heal_once_refused(server: MisbehavingServer, down_s: float) -> None:
    """Heals `server` `down_s` after it first turned a chat away: the outage the run sees does
    not depend on how long the run took to send its first row (a timer from the test's start
    healed it before a loaded run's first row, once in the full suite)."""

    def run():
        deadline = time.monotonic() + 120
        while server.chats <= server.good_chats and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(down_s)
        server.heal()

    threading.Thread(target=run, daemon=True).start()


def test_a_server_out_of_rotation_is_probed_back(env, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    with MisbehavingServer("dead", good_chats=1) as server:
        cfg = quick(env, out, [server.url], concurrency=1, max_retries=50, probe_interval_s=0.1)
        heal_once_refused(server, down_s=0.5)  # down for ~0.5 s, /health included
        counts = regenerate(cfg)
    assert counts["written"] == 3 and counts["failed"] == 0
    assert counts["servers"][0]["outages"] >= 1
    logged = capsys.readouterr().out
    assert f"out of rotation: {server.url}: HTTP 503" in logged
    assert f"back in rotation: {server.url}" in logged


def test_least_in_flight_routing_spreads_the_requests(env, tmp_path):
    out = tmp_path / "out.jsonl"
    with MisbehavingServer("ok") as a, MisbehavingServer("ok") as b:
        counts = regenerate(quick(env, out, [a.url, b.url], concurrency=2))
    assert counts["written"] == 3
    assert a.chats >= 2 and b.chats >= 2, (a.chats, b.chats)  # 1 start-up request each


def test_a_fleet_that_stays_down_stops_the_run_keeping_its_rows(env, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    with MisbehavingServer("dead", good_chats=2) as server:  # start-up + one row, then down
        cfg = quick(env, out, [server.url], concurrency=1, max_retries=1000, give_up_s=0.5)
        with pytest.raises(TrainingStopped, match=r"no server has been in rotation for 0\.5 s"):
            regenerate(cfg)
    assert [r["id"] for r in read_part(part_of(out))] == [0]  # the answered row is kept
    assert not out.exists()


def test_bad_servers_at_start_exit_2_naming_the_url(env, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    out.write_text("earlier output\n")

    def run(*urls, extra=()):
        argv = ["regenerate", "--data.paths", f"[{env['src']}]", "--target.path", env["target"]]
        argv += ["--output", str(out), "--server.urls", f"[{','.join(urls)}]", *extra]
        rc = cli.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1, (rc, err)
        return err[0]

    dead = f"http://127.0.0.1:{free_port()}/v1"
    with (
        MisbehavingServer("ok", model="tiny") as good,
        MisbehavingServer("ok", model="other") as other,
        MisbehavingServer("ok", models_body=b"<html>hello</html>") as html,
        MisbehavingServer(
            "ok", models_body=b'{"object": "list", "data": [{"id": "a"}, {"id": "b"}]}'
        ) as two,
        MisbehavingServer("garbage", good_chats=0) as garbage,
    ):
        msg = run(good.url, dead)
        assert f"server.urls[1] {dead}: unreachable" in msg, msg
        msg = run(good.url, other.url)
        assert f"server.urls[1] {other.url}: serves other, not 'tiny'" in msg, msg
        msg = run(html.url)
        assert f"server.urls[0] {html.url}: GET /models: not an OpenAI model list" in msg, msg
        msg = run(two.url)
        assert "lists 2 models (a, b); choose one with --server.model" in msg, msg
        msg = run(good.url, extra=["--server.model", "missing"])
        assert f"server.urls[0] {good.url}: serves tiny, not 'missing'" in msg, msg
        msg = run(garbage.url)
        assert f"{garbage.url}: a one-token chat request failed: not an OpenAI" in msg, msg
    assert "server.urls[0]: 'ftp://x:1/v1' is not an http:// or https:// URL" in run("ftp://x:1/v1")
    assert out.read_text() == "earlier output\n"  # nothing written is lost
    assert not Path(f"{out}.parts").exists()


def test_changed_settings_are_refused_and_several_ranks_too(env, tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl"
    with MisbehavingServer("ok") as server:
        cfg = quick(env, out, [server.url])
        assert regenerate(cfg)["written"] == 3
        first = out.read_text()
        with pytest.raises(ValueError, match=r"max_new_tokens 8 -> 9.*--restart true"):
            regenerate(dataclasses.replace(cfg, max_new_tokens=9))
        # rows of the in-rank path are not resumed by the server path either
        local_record = {"settings": {"batch_size": 16}, "fingerprint": "x"}
        (Path(f"{out}.parts") / "part-00000-of-00002.inputs.json").write_text(
            json.dumps(local_record)
        )
        with pytest.raises(ValueError, match="holds rows made from other inputs"):
            regenerate(cfg)
        assert out.read_text() == first
        assert regenerate(dataclasses.replace(cfg, restart=True))["written"] == 3
        assert not (Path(f"{out}.parts") / "part-00000-of-00002.inputs.json").exists()
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(ValueError, match="one client process drives every server"):
            regenerate(cfg)
