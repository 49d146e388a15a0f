"""Rows/s and generated tokens/s of `dspark-ds regenerate`: in the ranks against through
`transformers serve` servers, on the demo's target and training prompts, in one run.

    PYTHONPATH=. python3 tools/bench_regenerate.py --workdir /tmp/bench_regen

Runs, one after the other, greedy (T 0, so every path writes the same answers and the same
number of tokens), the demo's lengths (max_new_tokens 96, max_length 128):
  local       `torchrun --nproc_per_node R -m dspark_ds.launch regenerate`, batch 64, float32
              (the demo's settings)
  servers     R `transformers serve` processes (float32), one client, --server.concurrency 2R
  servers-cb  the same with --continuous-batching (a 512 x 32-token KV cache per server),
              --server.concurrency 32R
Times are the client command's wall clock (process start, model or tokenizer load, answers,
merge); the servers start (and get one warm-up request each) before the clock starts. Tokens
are counted with the target's tokenizer on the answers written. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_ports(n: int) -> list[int]:
    """n distinct ports free right now (held open together while they are chosen)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_health(port: int, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on {port} exited {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.25)
    raise RuntimeError(f"server on {port} not healthy after {timeout_s} s")


def warm_up(port: int, model: str, n: int) -> None:
    """n concurrent short requests (continuous batching sets itself up on the first)."""
    import concurrent.futures

    body = json.dumps({"model": model, "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": "Hello"}]}).encode()  # fmt: skip

    def one(_):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


def answer_tokens(path: Path, tok) -> tuple[int, int]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    answers = [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
    return len(rows), sum(len(tok(a, add_special_tokens=False)["input_ids"]) for a in answers)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--ranks", type=int, default=2, help="local ranks = servers")
    ap.add_argument("--skip", nargs="*", default=[], choices=["local", "servers", "servers-cb"])
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from dspark_ds.data.synthetic import make_corpus, write_jsonl
    from dspark_ds.demo.target import DemoTargetConfig, ensure_demo_target

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    target = str(ensure_demo_target(DemoTargetConfig()).path)
    prompts, _ = make_corpus(0, args.rows, 0)  # the demo's training prompts (seed 0)
    write_jsonl(prompts, work / "prompts.jsonl")
    tok = AutoTokenizer.from_pretrained(target)
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                        "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
                        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    common = ["regenerate", "--data.paths", f"[{work / 'prompts.jsonl'}]", "--target.path", target,
              "--max_new_tokens", "96", "--data.max_length", "128", "--temperature", "0",
              "--restart", "true"]  # fmt: skip
    results = []

    def timed(name: str, cmd: list[str], out: Path, note: str) -> None:
        t0 = time.monotonic()
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        seconds = time.monotonic() - t0
        rows, tokens = answer_tokens(out, tok)
        results.append((name, note, rows, seconds, rows / seconds, tokens / seconds))
        print(f"{name}: {rows} rows, {tokens} tokens in {seconds:.1f} s", file=sys.stderr)

    if "local" not in args.skip:
        out = work / "local.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks),
               "-m", "dspark_ds.launch", *common, "--output", str(out), "--batch_size", "64",
               "--target.device", "cpu", "--target.dtype", "float32"]  # fmt: skip
        timed("local", cmd, out, f"{args.ranks} ranks, batch 64")

    for name, extra, concurrency in (
        ("servers", [], 2),
        # NOTE: without a KV-cache budget, continuous batching on the CPU took 14 GB per server
        (
            "servers-cb",
            [
                "--continuous-batching",
                "--cb-block-size",
                "32",
                "--cb-num-blocks",
                "512",
                "--cb-max-batch-tokens",
                "2048",
            ],
            32,
        ),  # fmt: skip
    ):
        if name in args.skip:
            continue
        ports = free_ports(args.ranks)
        serve = [sys.executable, "-m", "transformers.cli.transformers", "serve", target]
        procs = []
        for p in ports:
            cmd = [*serve, "--host", "127.0.0.1", "--port", str(p), "--device", "cpu",
                   "--dtype", "float32", *extra]  # fmt: skip
            with open(work / f"{name}-{p}.log", "wb") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        try:
            t0 = time.monotonic()
            for p, proc in zip(ports, procs):
                wait_health(p, proc)
            for p in ports:
                warm_up(p, target, concurrency)
            print(f"{name}: up and warm in {time.monotonic() - t0:.1f} s", file=sys.stderr)
            out = work / f"{name}.jsonl"
            urls = ",".join(f"http://127.0.0.1:{p}/v1" for p in ports)
            total = concurrency * args.ranks
            cmd = [sys.executable, "-m", "dspark_ds.cli", *common, "--output", str(out),
                   "--server.urls", f"[{urls}]", "--server.concurrency", str(total)]  # fmt: skip
            timed(name, cmd, out, f"{args.ranks} servers, concurrency {total}")
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait()

    print("| path | setup | rows | wall s | rows/s | generated tokens/s |")
    print("|---|---|---|---|---|---|")
    for name, note, rows, seconds, rps, tps in results:
        print(f"| {name} | {note} | {rows} | {seconds:.1f} | {rps:.1f} | {tps:.0f} |")
    same = [p for p in ("servers", "servers-cb") if (work / f"{p}.jsonl").exists()]
    if (work / "local.jsonl").exists():
        local = (work / "local.jsonl").read_text().splitlines()
        for p in same:
            other = (work / f"{p}.jsonl").read_text().splitlines()
            n = sum(a == b for a, b in zip(local, other))
            print(f"{p}: {n}/{len(local)} rows identical to the local path's")


if __name__ == "__main__":
    main()
