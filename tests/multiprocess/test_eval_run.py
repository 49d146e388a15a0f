"""`dspark-ds eval`: benchmark loading, the end-to-end report (table, JSON, CSV, plots, MLflow),
and two ranks splitting the prompts."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from dspark_ds.config import TrackingConfig
from dspark_ds.drafters import save_draft_model
from dspark_ds.errors import ConfigError
from dspark_ds.eval import EvalConfig, run_eval, speculative_generate
from dspark_ds.eval.benchmarks import (
    DEFAULT_BENCHMARKS,
    benchmark_path,
    encode_prompt,
    load_benchmark,
    num_prompts,
    select_prompts,
    shard,
)
from dspark_ds.eval.runner import stop_token_ids
from dspark_ds.target import TargetPathConfig

from helpers.evaluation import random_drafter

# ---- benchmarks -----------------------------------------------------------------------------


def test_packaged_benchmarks_load():
    sizes = {name: len(load_benchmark(benchmark_path(name, None))) for name in DEFAULT_BENCHMARKS}
    assert sizes == {
        "gsm8k": 1319,
        "math500": 500,
        "humaneval": 164,
        "mbpp": 257,
        "mt-bench": 80,
        "aime25": 30,
    }


def test_packaged_benchmarks_are_the_recorded_copies():
    # the README of the datasets folder records each file's sha256 (byte-identical copies of
    # DeepSpec's eval_datasets): an edited or truncated prompt file fails here
    import hashlib
    import re

    folder = benchmark_path(DEFAULT_BENCHMARKS[0], None).parent
    recorded = dict(
        re.findall(r"\| (\S+\.jsonl) \|.*`([0-9a-f]{64})`", (folder / "README.md").read_text())
    )
    assert sorted(recorded) == sorted(f"{name}.jsonl" for name in DEFAULT_BENCHMARKS)
    for name, digest in recorded.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name


def test_bad_rows_name_file_and_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"turns": ["ok"]}\n\n{"turns": []}\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:3: `turns`"):
        load_benchmark(path)
    path.write_text('{"turns": ["ok"]}\n{not json\n')
    with pytest.raises(ValueError, match=r"x\.jsonl:2: not valid JSON"):
        load_benchmark(path)
    with pytest.raises(ConfigError, match="benchmark 'nope'"):
        benchmark_path("nope", tmp_path)


def test_prompt_selection_and_sharding():
    rows = [[f"q{i}"] for i in range(20)]
    picked = select_prompts(rows, 7, seed=3)
    assert len(picked) == 7 and picked == select_prompts(rows, 7, seed=3)
    assert picked != select_prompts(rows, 7, seed=4)
    assert select_prompts(rows, None, seed=0) == rows
    parts = [shard(picked, r, 3) for r in range(3)]
    assert sorted(i for part in parts for i, _ in part) == list(range(7))
    assert all(picked[i] == item for part in parts for i, item in part)


def test_paper_protocol_is_the_default():
    """2048 new tokens, the reference's seed and per-benchmark sizes, and the same prompt subsets
    as its evaluation script (shuffle the rows with random.Random(seed), keep the first n)."""
    import random

    cfg = EvalConfig()
    assert (cfg.max_new_tokens, cfg.seed, cfg.max_samples) == (2048, 980406, None)
    assert cfg.temperature == 1.0 and cfg.budget_accounting == "exact"
    sizes = {name: num_prompts(name, None) for name in DEFAULT_BENCHMARKS}
    assert sizes == {
        "gsm8k": 500,
        "math500": 500,
        "humaneval": 164,
        "mbpp": 256,
        "mt-bench": 80,
        "aime25": 30,
    }
    assert num_prompts("my-set", None) is None and num_prompts("gsm8k", 7) == 7
    for name in ("gsm8k", "mbpp"):
        rows = load_benchmark(benchmark_path(name, None))
        reference = list(rows)
        random.Random(cfg.seed).shuffle(reference)
        picked = select_prompts(rows, sizes[name], cfg.seed)
        assert sorted(map(tuple, picked)) == sorted(map(tuple, reference[: sizes[name]]))
    with pytest.raises(ValueError, match="eval.budget_accounting"):
        EvalConfig(target=TargetPathConfig("t"), drafter="d", budget_accounting="paper").validate()


def test_prompts_are_chat_templated(tmp_path, tiny_target):
    from transformers import AutoTokenizer

    path = tiny_target
    tok = AutoTokenizer.from_pretrained(path)
    ids = encode_prompt(tok, ["What is 2 + 3?", "and then?"], {"enable_thinking": False})
    text = tok.decode(ids[0])
    assert (
        text
        == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert ids.shape[0] == 1 and ids.dtype == torch.long


# ---- the run --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_target):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("eval_run")
    target_dir = tiny_target
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    drafter = random_drafter(target, layer_ids=(0, 2), block_size=4, markov_std=0.3)
    save_draft_model(drafter, root / "draft")
    data = root / "data"
    data.mkdir()
    for name, words in (("chat", "hello"), ("math", "2 + 3")):
        (data / f"{name}.jsonl").write_text(
            "".join(json.dumps({"turns": [f"Say {words} {i}"]}) + "\n" for i in range(6))
        )
    return root, target_dir, target


def _cfg(root, target_dir, **kw) -> EvalConfig:
    base = dict(
        target=TargetPathConfig(path=str(target_dir)),
        drafter=str(root / "draft"),
        benchmarks=["chat", "math"],
        data_dir=str(root / "data"),
        max_samples=5,
        max_new_tokens=16,
        temperature=0.0,
        output_dir=str(root / "runs"),
        seed=0,
    )
    base.update(kw)
    return EvalConfig(**base)


def test_run_eval_writes_the_report_and_logs_mlflow(setup, capsys):
    from transformers import AutoTokenizer

    from dspark_ds.tracking.store import list_artifacts, read_run

    root, target_dir, target = setup
    cfg = _cfg(root, target_dir, name="greedy", measure_baseline=True)
    drafter_files = {p.name: p.read_bytes() for p in (root / "draft").iterdir()}
    payload = run_eval(cfg)
    # evaluation fits STS temperatures but never modifies the drafter it reads unless asked
    assert {p.name: p.read_bytes() for p in (root / "draft").iterdir()} == drafter_files
    assert "written_to" not in payload["calibration"]
    out_dir = root / "runs" / "greedy"
    for name in (
        "results.json",
        "results.csv",
        "results.txt",
        "acceptance_by_position.png",
        "tau_by_benchmark.png",
        "reliability_diagram.png",
        "threshold_sweep.png",
        "confidence_temperatures.json",
    ):
        assert (out_dir / name).stat().st_size > 0, name
    assert "average" in capsys.readouterr().out

    # Recompute τ of one benchmark independently, with the public decoding API.
    tok = AutoTokenizer.from_pretrained(target_dir)
    drafter = __import__("dspark_ds.drafters", fromlist=["x"]).load_draft_model(root / "draft")
    rows = select_prompts(load_benchmark(root / "data" / "chat.jsonl"), 5, 0)
    committed = rounds = 0
    for turns in rows:
        ids = encode_prompt(tok, turns, {"enable_thinking": False})
        _, st = speculative_generate(
            target, drafter, ids, max_new_tokens=16, stop_token_ids=stop_token_ids(target, tok)
        )
        committed += sum(st.committed_per_round)
        rounds += st.rounds
    chat = payload["benchmarks"][0]
    assert chat["benchmark"] == "chat" and chat["num_prompts"] == 5
    assert chat["tau"] == pytest.approx(committed / rounds)
    assert chat["rounds"] == rounds
    assert chat["speedup"] == pytest.approx(chat["tokens_per_s"] / chat["baseline_tokens_per_s"])
    accept = chat["accept_rate_by_position"]
    assert len(accept) == 4 and all(a is None or 0 <= a <= 1 for a in accept)
    assert payload["average"]["tau"] == pytest.approx(
        (chat["tau"] + payload["benchmarks"][1]["tau"]) / 2
    )

    calib = payload["calibration"]
    assert calib["split"]["fit_prompts"] == 6 and calib["split"]["held_out_prompts"] == 4
    for variant in ("raw", "sts"):
        assert 0 <= calib[variant]["pooled"]["ece"] <= 1
        assert len(calib[variant]["per_position"]) == 4
    assert calib["threshold_sweep"][0]["verify_tokens_saved"] == 0

    with open(out_dir / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [r["benchmark"] for r in table] == ["chat", "math"]
    assert float(table[0]["tau"]) == pytest.approx(chat["tau"])
    assert json.loads((out_dir / "results.json").read_text())["average"]["tau"] == pytest.approx(
        payload["average"]["tau"]
    )

    uri = f"sqlite:///{(root / 'runs').resolve() / 'mlflow.db'}"
    run = read_run(uri, payload["mlflow_run_id"])
    assert run.data.metrics["average/tau"] == pytest.approx(payload["average"]["tau"])
    assert run.data.metrics["chat/accept_rate_at_0"] == pytest.approx(accept[0])
    assert "confidence_raw/ece" in run.data.metrics and "confidence_sts/ece" in run.data.metrics
    assert run.data.params["max_new_tokens"] == "16" and run.data.tags["kind"] == "eval"
    artifacts = set(list_artifacts(uri, payload["mlflow_run_id"]))
    assert {
        "results.json",
        "acceptance_by_position.png",
        "tau_by_benchmark.png",
        "reliability_diagram.png",
    } <= artifacts


def test_sts_written_to_the_drafter_and_threshold_run(setup, tmp_path):
    import shutil

    root, target_dir, _ = setup
    drafter_copy = tmp_path / "draft"
    shutil.copytree(root / "draft", drafter_copy)

    def copy_cfg(name: str, **kw) -> EvalConfig:
        """The chat benchmark at T = 1 with the drafter's copy, not tracked."""
        return _cfg(
            root,
            target_dir,
            name=name,
            drafter=str(drafter_copy),
            temperature=1.0,
            benchmarks=["chat"],
            tracking=TrackingConfig(enabled=False),
            **kw,
        )

    cfg = copy_cfg("sts")
    cfg.calibration.write_to_drafter = True
    payload = run_eval(cfg)
    written = json.loads((drafter_copy / "config.json").read_text())["confidence_temperatures"]
    assert written == payload["calibration"]["sts"]["temperatures"]
    # A thresholded run uses them, and skips calibration (its proposals are cut).
    cut = run_eval(copy_cfg("cut", confidence_threshold=0.9))
    assert "skipped" in cut["calibration"]
    assert (
        cut["benchmarks"][0]["mean_proposal_length"]
        < payload["benchmarks"][0]["mean_proposal_length"]
    )


def test_batched_run_reports_speedup_and_policies(setup, capsys):
    """--batch_size 2 with the scheduler comparison: the same τ as batch 1 at T = 0 (same
    acceptances), the target alone measured at the same batch size, three policies reported."""
    root, target_dir, _ = setup
    off = TrackingConfig(enabled=False)
    one = run_eval(_cfg(root, target_dir, name="b1", benchmarks=["chat"], tracking=off))
    cfg = _cfg(root, target_dir, name="b2", benchmarks=["chat"], batch_size=2, tracking=off)
    cfg.scheduler.compare = True
    cfg.scheduler.context_tokens = 16
    cfg.scheduler.repeats = 1
    two = run_eval(cfg)
    a, b = one["benchmarks"][0], two["benchmarks"][0]
    assert (a["tau"], a["rounds"], a["new_tokens"]) == (b["tau"], b["rounds"], b["new_tokens"])
    assert b["baseline_tokens_per_s"] > 0 and b["speedup"] == pytest.approx(
        b["tokens_per_s"] / b["baseline_tokens_per_s"]
    )
    policies = b["extra"]["policies"]
    assert set(policies) == {"full", "threshold", "scheduler"}
    assert policies["full"]["tau"] == pytest.approx(b["tau"])
    assert all(p["tokens_per_s"] > 0 and p["speedup"] > 0 for p in policies.values())
    assert policies["full"]["drafts_verified_per_round"] >= max(
        policies["threshold"]["drafts_verified_per_round"],
        policies["scheduler"]["drafts_verified_per_round"],
    )
    assert "verification policies" in capsys.readouterr().out
    # a drafter without a confidence head cannot be scheduled
    dflash = random_drafter(
        __import__("transformers").AutoModelForCausalLM.from_pretrained(target_dir),
        layer_ids=(0, 2),
        markov_rank=0,
        confidence=False,
    )
    save_draft_model(dflash, root / "dflash")
    cfg = _cfg(
        root,
        target_dir,
        name="b3",
        drafter=str(root / "dflash"),
        batch_size=2,
        benchmarks=["chat"],
        tracking=off,
    )
    cfg.scheduler.enabled = True
    with pytest.raises(ValueError, match="eval.scheduler needs a drafter with a confidence head"):
        run_eval(cfg)


def test_bad_options_name_the_field(setup):
    root, target_dir, _ = setup
    for kw, field in (
        (dict(temperature=-1.0), "eval.temperature"),
        (dict(draft_temperature=-0.5), "eval.draft_temperature"),
        (dict(benchmarks=[]), "eval.benchmarks"),
        (dict(dtype="int8"), "eval.dtype"),
        (dict(drafter=""), "eval.drafter"),
        (dict(batch_size=0), "eval.batch_size"),
    ):
        with pytest.raises(ValueError, match=field):
            run_eval(_cfg(root, target_dir, **kw))


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_split_the_prompts_through_the_cli(setup):
    from helpers.dist import GUARDED, check, guard_stats, guarded_env, torchrun

    root, target_dir, _ = setup
    single = run_eval(_cfg(root, target_dir, name="one", tracking=TrackingConfig(enabled=False)))
    # under the device guard (helpers/device_guard.py): no host-made tensor reaches a collective
    argv = [*GUARDED, "-m", "dspark_ds.cli", "eval", f"--target.path={target_dir}"]
    argv += [f"--drafter={root / 'draft'}", "--benchmarks=[chat, math]"]
    argv += [f"--data_dir={root / 'data'}", "--max_samples=5", "--max_new_tokens=16"]
    argv += ["--temperature=0.0", f"--output_dir={root / 'runs'}", "--name=two"]
    argv += ["--tracking.enabled=false"]
    check(torchrun(argv, env=guarded_env(root / "guard")))
    assert [s["policed"] > 0 for s in guard_stats(root / "guard")] == [True, True]
    two = json.loads((root / "runs" / "two" / "results.json").read_text())
    for a, b in zip(single["benchmarks"], two["benchmarks"]):
        assert (a["benchmark"], a["num_prompts"], a["rounds"], a["new_tokens"]) == (
            b["benchmark"],
            b["num_prompts"],
            b["rounds"],
            b["new_tokens"],
        )
        assert a["tau"] == pytest.approx(b["tau"])
        assert a["accept_rate_by_position"] == pytest.approx(b["accept_rate_by_position"])
