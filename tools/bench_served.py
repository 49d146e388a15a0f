"""Training step time and data-wait share of the three ways of feeding target features, on the
demo's shape: online (the target in the job), offline (a cache `dspark-ds build-cache` made
first), served (one vLLM server of the same target, `dspark-ds serve-target`).

    PYTHONPATH=. python3 tools/bench_served.py --workdir /tmp/bench_served

The demo's shape: its target (the cached trained one, else its config with random weights), the
synthetic corpus' first --rows conversations prepared at max_length 128 (not regenerated), its
DSpark preset, 2 torchrun ranks (DS_ACCELERATOR=cpu, 1 thread each), ZeRO-2, global batch 2,
micro-batch 1, float32, MLflow off. Each mode runs --repeats times, mode after mode; the cache
is built, the server started and warmed up (8 requests, their files deleted) before the clock.
Per run: median `system/step_s` and mean `data/wait_share` over the steps after --warmup, the
fleet's mean `data/served_sequences_per_s`, the train command's wall clock, the 1-minute load
(os.getloadavg every second while it ran), the served client's retries, the last loss (same seed
and data: the modes agree to float32 rounding). Prints a Markdown table; logs stay in --workdir.
NOTE: the vLLM server shares the machine's cores with the ranks.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_regenerate import free_ports, wait_health  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MAX_LENGTH = 128


def demo_target(out: Path) -> tuple[str, str]:
    """(path, what it is): the demo's cached trained target, else its config with random weights."""
    import torch
    from transformers import Qwen3ForCausalLM

    from dspark_ds.data.synthetic import make_corpus
    from dspark_ds.demo.target import DemoTargetConfig, _cache_key, build_model_config, cache_root
    from dspark_ds.demo.tokenizer import train_tokenizer

    cfg = DemoTargetConfig()
    rows, _ = make_corpus(cfg.seed, cfg.num_train_rows, 0)
    cached = cache_root(cfg) / "targets" / f"qwen3-tiny-{_cache_key(cfg, rows)}"
    if (cached / "demo_target.json").is_file():
        return str(cached), "demo target (trained, cached)"
    if not (out / "config.json").is_file():
        tok = train_tokenizer(rows, cfg.vocab_size)
        torch.manual_seed(0)
        Qwen3ForCausalLM(build_model_config(cfg, tok)).save_pretrained(out)
        tok.save_pretrained(out)
    return str(out), "demo target config, random weights"


def warm_up(url: str, store, storage: Path, n: int) -> None:
    """n concurrent hidden-state requests of the data's sequences; their files are deleted once
    the connector lets go of them."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]

    def one(i: int) -> None:
        body = {"model": model, "prompt": store[i]["input_ids"].tolist(), "max_tokens": 1}
        req = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            named = json.loads(r.read())["kv_transfer_params"]["hidden_states_path"]
        path = storage / Path(named).name
        lock = path.with_name(path.name + ".lock")
        deadline = time.monotonic() + 60
        while not (path.exists() or lock.exists()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if lock.exists():
            with open(lock) as f:
                fcntl.flock(f, fcntl.LOCK_SH)  # the writer holds it until the file is complete
        path.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


def summarize(log: Path, warmup: int) -> dict:
    rows = [json.loads(line) for line in log.read_text().splitlines() if line]
    timed = [r for r in rows if r["step"] > warmup and "system/step_s" in r]
    served = [r["data/served_sequences_per_s"] for r in timed if "data/served_sequences_per_s" in r]
    return {
        "steps": len(timed),
        "step_s": statistics.median(r["system/step_s"] for r in timed),
        "wait_share": statistics.fmean(r["data/wait_share"] for r in timed),
        "served_seq_s": statistics.fmean(served) if served else None,
        "final_loss": rows[-1]["loss"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10, help="first steps left out of the figures")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rows", type=int, default=1024, help="corpus conversations (the demo's)")
    ap.add_argument(
        "--modes",
        nargs="*",
        default=["online", "offline", "served"],
        choices=["online", "offline", "served"],
    )
    args = ap.parse_args()

    from dspark_ds import config as c
    from dspark_ds.data.config import BuildCacheConfig, DataConfig, PrepareConfig
    from dspark_ds.data.synthetic import make_corpus, write_jsonl
    from dspark_ds.data.tokens import TokenStore, prepare
    from dspark_ds.demo.config import DemoBudgetConfig
    from dspark_ds.demo.pipeline import max_valid_anchors
    from dspark_ds.drafters.presets import DrafterSizes, sized
    from dspark_ds.target import TargetConfig

    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc)
    target, target_note = demo_target(work / "target")
    prepared, cache, storage = work / "prepared", work / "cache", work / "hidden_states"
    if not (prepared / "meta.json").is_file():
        rows, _ = make_corpus(0, args.rows, 0)
        jsonl = str(write_jsonl(rows, work / "train.jsonl"))
        data = DataConfig(paths=[jsonl], tokenizer=target, max_length=MAX_LENGTH, num_workers=0)
        prepare(PrepareConfig(data=data, output_dir=str(prepared)))
    anchors = max_valid_anchors(prepared)
    b = DemoBudgetConfig(max_steps=args.steps, nproc=2)
    tcfg = TargetConfig(path=target, dtype="float32", device="cpu")
    base = c.TrainRunConfig(
        name="bench",
        output_dir=str(work / "runs"),
        model=sized("dspark", DrafterSizes.with_block("dspark", num_anchors=anchors).dspark),
        target=tcfg,
        data=DataConfig(
            mode="online",
            paths=[str(prepared)],
            max_length=MAX_LENGTH,
            batch_size=b.micro_batch_size,
            num_workers=0,
            seed=0,
        ),
        train=c.TrainConfig(
            lr=b.lr,
            warmup_ratio=b.warmup_ratio,
            min_lr_ratio=0.0,
            precision="fp32",
            global_batch_size=b.global_batch_size,
            num_epochs=1000,
            max_steps=b.max_steps,
            seed=0,
            log_every=1,
            progress_bar=False,
        ),
        deepspeed=c.DeepSpeedConfig(config=b.zero),
        tracking=c.TrackingConfig(enabled=False),
        checkpoint=c.CheckpointConfig(
            every_steps=0, keep_last=1, save_final=False, export_final=False
        ),
        validation=c.ValidationConfig(every_steps=0, num_batches=1),
    )
    plain = c.to_plain(base)
    del plain["data"]["served"]  # NOTE: its defaults (the connector's name) come from the code
    (work / "train.yaml").write_text(yaml.safe_dump(plain, sort_keys=False))
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = os.environ | {
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": pythonpath,
        "PYTHONWARNINGS": "ignore::FutureWarning",
    }

    def torchrun(sub: str, config: Path, extra: list[str], log: Path) -> tuple[float, list]:
        """Its wall clock, and the 1-minute load average sampled every second while it ran."""
        port = free_ports(1)[0]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={b.world_size}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            "-m",
            "dspark_ds.cli",
            sub,
            "--config",
            str(config),
            *extra,
        ]
        t0, load = time.monotonic(), [os.getloadavg()[0]]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
            load.append(os.getloadavg()[0])
        if rc := proc.returncode:
            tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
            raise RuntimeError(f"{sub} exited {rc}; {log}:\n{tail}")
        return time.monotonic() - t0, load

    notes = [f"target: {target_note} ({target}); {anchors} anchors per sequence"]
    if "offline" in args.modes and not (cache / "manifest.json").is_file():
        ccfg = BuildCacheConfig(
            data=DataConfig(
                paths=[str(prepared)],
                cache_dir=str(cache),
                mode="offline",
                max_length=MAX_LENGTH,
                num_workers=0,
                cache_dtype="float32",
                samples_per_shard=256,
            ),
            target=tcfg,
            batch_size=32,
        )
        (work / "build-cache.yaml").write_text(c.dump_config(ccfg))
        seconds, _ = torchrun("build-cache", work / "build-cache.yaml", [], work / "cache.log")
        notes.append(f"build-cache ({args.rows} sequences, 2 ranks, batch 32): {seconds:.1f} s")

    results = []

    def timed(mode: str, run: int, extra: list[str]) -> None:
        name = f"{mode}-{run}"
        shutil.rmtree(work / "runs" / name, ignore_errors=True)
        wall, load = torchrun(
            "train", work / "train.yaml", ["--name", name, *extra], work / f"{name}.log"
        )
        s = summarize(work / "runs" / name / "train_log.jsonl", args.warmup)
        log = (work / f"{name}.log").read_text().splitlines()
        s |= {
            "mode": mode,
            "run": run,
            "wall_s": wall,
            "load": load,
            "retries": sum("trying it again" in line for line in log),
        }
        results.append(s)
        print(
            f"{name}: {s['steps']} steps, median {s['step_s']:.3f} s, wait share "
            f"{s['wait_share']:.2f}, wall {wall:.1f} s",
            file=sys.stderr,
        )

    for mode in ("online", "offline"):
        if mode in args.modes:
            for run in range(1, args.repeats + 1):
                extra = ["--data.mode", "offline", "--data.cache_dir", str(cache)]
                timed(mode, run, extra if mode == "offline" else [])

    if "served" in args.modes:
        port = free_ports(1)[0]
        cmd = [
            sys.executable,
            "-m",
            "dspark_ds.cli",
            "serve-target",
            "--config",
            str(work / "train.yaml"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--storage",
            str(storage),
        ]
        server_log = work / "serve-target.log"
        shutil.rmtree(storage, ignore_errors=True)
        t0 = time.monotonic()
        with open(server_log, "w") as out:
            server = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_health(port, server, timeout_s=600)
            warm_up(url, TokenStore.load(prepared), storage, 8)
            notes.append(
                f"served: serve-target up and warm in {time.monotonic() - t0:.0f} s "
                f"(8 warm-up requests); storage {storage}"
            )
            notes.append(f"served: {len(os.listdir(storage))} files left after the warm-up")
            for run in range(1, args.repeats + 1):
                timed(
                    "served",
                    run,
                    [
                        "--data.mode",
                        "served",
                        "--data.served.urls",
                        f"[{url}]",
                        "--data.served.storage",
                        str(storage),
                    ],
                )
                left = sorted(os.listdir(storage))
                notes.append(
                    f"served run {run}: {len(left)} files left in the storage"
                    + (f": {left[:4]}" if left else "")
                )
        finally:
            server.send_signal(signal.SIGTERM)  # serve-target forwards it to vLLM's group
            try:
                code = server.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                code = server.wait()
            notes.append(f"served: serve-target exited {code} on SIGTERM")
            vllm = [
                line.split("]", 1)[-1].strip()
                for line in server_log.read_text().splitlines()
                if "core ids=" in line or "Torch threads" in line
            ]
            notes.append(f"served: vLLM's CPU threads: {' / '.join(vllm)}")

    ended = datetime.now(timezone.utc)
    print(
        f"{started:%Y-%m-%d %H:%M} - {ended:%H:%M} UTC, {os.cpu_count()} cores, {args.steps} "
        f"steps per run, figures over steps {args.warmup + 1}-{args.steps}"
    )
    print()
    print(
        "| mode | run | median step s | mean data wait share | served seq/s | train wall s "
        "| load 1-min mean / max | served retries | final loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        seq = f"{r['served_seq_s']:.1f}" if r["served_seq_s"] is not None else "-"
        retries = r["retries"] if r["mode"] == "served" else "-"
        print(
            f"| {r['mode']} | {r['run']} | {r['step_s']:.3f} | {r['wait_share']:.2f} | {seq} "
            f"| {r['wall_s']:.1f} | {statistics.fmean(r['load']):.1f} / {max(r['load']):.1f} "
            f"| {retries} | {r['final_loss']:.4f} |"
        )
    print()
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
