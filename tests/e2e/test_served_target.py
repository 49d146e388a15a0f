"""Training against a served target (``data.mode served``): two real vLLM servers (vLLM's CPU
build; server a started by the `dspark-ds serve-target` command, b from the argv it builds; the
project's connector) serve a tiny Qwen3 target's hidden states into one storage directory.

The server side:
- serve-target's argv and the `vllm serve` command it prints go through vLLM's own argument
  parser and config validation, and vLLM's connector factory finds the project's connector;
- each file holds the prompt's ids, the connector's metadata and hidden states whose features
  (`ServedLayout.features`, the model's own final norm) equal `FrozenTarget`'s within FP32_TOL,
  taps -1 (the embeddings), a middle layer and L - 1: prompts of 1 to 511 tokens (server a
  prefills 64 a step), prefix-cache hits, four at once; files whole, readable by other users;
The training side:
- the served loader's batches equal the in-job target's (same samples and order; features within
  FP32_TOL), every file deleted once read;
- a damaged file (truncated, missing, of the wrong shape) is named in one line and asked for
  again; a sequence whose every try fails stops the loader in one line naming it;
- a server of other taps, another hidden size or another target is refused at the start;
- 2 gloo ranks: served training follows online training (same seed, same data) at ZeRO-2 and
  ZeRO-3, for DSpark and Eagle3, and hybrid mode keeps what it fetched as its cache; the fleet's
  throughput and the data wait are logged;
- every server gone (a proxy cut after a fixed number of requests): the run checkpoints and stops
  in one line, exit 1; resumed once the server is back it ends with the uninterrupted run's
  losses;
- a server killed in the middle of an epoch: the other carries on, no sequence lost or repeated;
- SIGTERM to serve-target stops vLLM's whole process group.

The servers start once for the module (both at once; 30-90 s on 2 cores); the kill and the
SIGTERM are the module's last tests.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dspark_ds.data.config import CONNECTOR, DataConfig, ServedConfig
from dspark_ds.data.loader import build_train_loader
from dspark_ds.data.served import DataUnavailable, ServedFeatures, connect
from dspark_ds.errors import ConfigError
from dspark_ds.serve.hidden_states import FORMAT
from dspark_ds.serve.target_server import CONNECTOR_DIR, SERVER_MODULE, build_command, group_running
from dspark_ds.target import TargetConfig, load_target, target_shared_weights

from helpers.dist import REPO, check, torchrun
from helpers.served_target import ServedTarget, read_hidden_states
from helpers.tcp_proxy import TcpProxy
from helpers.tiny_models import build_tiny_target, prepare_chat
from helpers.vllm_serving import require_vllm

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

NUM_LAYERS = 4
LAYERS = [-1, 1, NUM_LAYERS - 1]  # the embeddings, a middle layer, the last (normed) one
LAYER_IDS = LAYERS
MAX_LENGTH = 96  # training; the servers take prompts of up to SERVED_LENGTH
SERVED_LENGTH = 511
KV_BYTES = 64 << 20
"""Each server's KV cache (16 k tokens of the tiny target): 1 GiB less per server than the CPU
build's default here, which the suite's memory needs beside its other servers and clusters."""
CHUNK = 64  # server a's --max-num-batched-tokens: longer prompts are prefilled in chunks
FP32_TOL = 1e-5
"""Largest |served - in-job| allowed, float32 on both sides (absolute on the loader's batches,
whose values reach 3.7; relative to the largest value on the single files): 1.5e-6 absolute
and 4e-7 to 5e-7 relative measured, from vLLM's CPU kernels against transformers' eager ones."""
STEPS = 8
RECIPE = str(REPO / "dspark_ds" / "recipes" / "tiny_cpu.yaml")
EAGLE3 = str(REPO / "dspark_ds" / "recipes" / "eagle3_tiny_cpu.yaml")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    # NOTE: hidden 128 (head_dim 32): vLLM's CPU attention has no kernel for head_dim 8
    target = build_tiny_target(root / "target", hidden_size=128)
    prep = prepare_chat(root, 24, seed=1, tokenizer=target, max_length=MAX_LENGTH)
    storage = root / "hidden_states"
    small = ["--max-num-seqs", "8", "--kv-cache-memory-bytes", str(KV_BYTES)]
    chunked = [*small, "--max-num-batched-tokens", str(CHUNK)]
    servers = [
        ServedTarget(
            target,
            storage,
            LAYERS,
            log=root / "vllm_a.log",
            max_length=SERVED_LENGTH,
            vllm_args=chunked,
            via_cli=True,
        ),
        ServedTarget(
            target,
            storage,
            LAYERS,
            log=root / "vllm_b.log",
            max_length=SERVED_LENGTH,
            vllm_args=small,
        ),
    ]
    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda s: s.__enter__(), servers))
    try:
        with TcpProxy(servers[0].port) as proxy:
            yield SimpleNamespace(
                root=root, target=target, prep=prep, storage=storage, servers=started, proxy=proxy
            )
    finally:
        for server in servers:
            server.__exit__(None, None, None)


def _data(fleet, mode: str, urls: list[str] | None = None, **served) -> DataConfig:
    cfg = ServedConfig(
        urls=urls or [s.url for s in fleet.servers], storage=str(fleet.storage), **served
    )
    return DataConfig(
        paths=[str(fleet.prep)],
        mode=mode,
        served=cfg,
        batch_size=2,
        max_length=MAX_LENGTH,
        num_workers=0,
    )


def _target_cfg(fleet, layers=LAYERS, path=None) -> TargetConfig:
    return TargetConfig(path=path or fleet.target, dtype="float32", device="cpu", layer_ids=layers)


def _client(fleet, data: DataConfig, say=print, layers=LAYERS, path=None):
    tcfg = _target_cfg(fleet, layers, path)
    return connect(data, tcfg, layers, target_shared_weights(tcfg.path)[1], say=say)


def _served_loader(data: DataConfig, client: ServedFeatures, described):
    """Rank 0 of 1's loader of the fleet's features through `client`."""
    return build_train_loader(
        data,
        0,
        1,
        described,
        hidden_size=128,
        layer_ids=LAYERS,
        vocab_size=described.vocab_size,
        served=client,
    )


def _served_batches(fleet, data: DataConfig, say=print) -> tuple[list[dict], ServedFeatures]:
    client, described = _client(fleet, data, say)
    try:
        return list(_served_loader(data, client, described)), client
    finally:
        client.close()


@pytest.fixture(scope="module")
def online(fleet):
    data = _data(fleet, "online")
    target = load_target(_target_cfg(fleet))
    loader = build_train_loader(
        data, 0, 1, target, hidden_size=128, layer_ids=LAYERS, vocab_size=target.vocab_size
    )
    return list(loader)


def _assert_same_batches(served: list[dict], online: list[dict]) -> None:
    assert [b["sample_ids"].tolist() for b in served] == [b["sample_ids"].tolist() for b in online]
    for got, want in zip(served, online):
        for key in ("input_ids", "loss_mask", "attention_mask"):
            assert torch.equal(got[key], want[key].cpu()), key
        for key in ("target_hidden_states", "target_last_hidden_states"):
            torch.testing.assert_close(got[key], want[key].cpu(), rtol=0, atol=FP32_TOL)


def test_served_batches_equal_the_in_job_targets(fleet, online):
    served, client = _served_batches(fleet, _data(fleet, "served"))
    _assert_same_batches(served, online)
    assert client.counts() == (24, sum(int(b["attention_mask"].sum()) for b in online))
    assert all(s.answered > 0 for s in client.fleet.servers)  # least busy: both take requests
    assert os.listdir(fleet.storage) == []  # each file deleted once read


def test_damaged_files_are_named_and_asked_for_again(fleet, online, monkeypatch):
    read = ServedFeatures._read
    damage = ["truncate", "delete", "reshape"]

    def damaged(self, answer, ids, strict):
        try:
            how = None if strict else damage.pop(0)  # the reads run on several threads
        except IndexError:
            how = None
        if how is not None:
            path = self.storage / Path(answer.path).name
            _wait_written(path)
            if how == "truncate":
                os.truncate(path, path.stat().st_size // 2)
            elif how == "delete":
                path.unlink()
                path.with_name(path.name + ".lock").unlink(missing_ok=True)
            else:
                from safetensors.torch import load_file, save_file

                tensors = load_file(path)
                save_file(
                    {**tensors, "hidden_states": tensors["hidden_states"][:, :2].contiguous()}, path
                )
        return read(self, answer, ids, strict)

    monkeypatch.setattr(ServedFeatures, "_read", damaged)
    lines: list[str] = []
    served, _ = _served_batches(
        fleet, _data(fleet, "served", retry_backoff_s=0.05, file_wait_s=5), lines.append
    )
    _assert_same_batches(served, online)
    retried = [line for line in lines if "trying it again" in line]
    damage_lines = ("truncated", "is missing", "of shape")
    for why in damage_lines:  # the reads run concurrently: in any order
        named = [line for line in retried if why in line]
        assert len(named) == 1, lines
        assert named[0].startswith("[data] served: sample ") and "request cmpl-" in named[0]
    # under load a writer may hold its lock past file_wait_s: asked for again too, nothing else
    other = [line for line in retried if not any(why in line for why in damage_lines)]
    assert all("still locked by its writer" in line for line in other), lines
    assert os.listdir(fleet.storage) == []

    damage[:] = ["truncate"] * 10  # every try of the first sequence: the loader stops, naming it
    with pytest.raises(
        DataUnavailable,
        match=r"^\[data\] served: sample \d+ \(epoch 0, "
        r"micro-batch 0\): every try failed, the last: .*truncated.*\(2 tries\)$",
    ):
        _served_batches(
            fleet,
            _data(
                fleet, "served", max_retries=1, retry_backoff_s=0.05, urls=[fleet.servers[0].url]
            ),
            lines.append,
        )


def _wait_written(path: Path) -> None:
    from helpers.served_target import read_hidden_states

    read_hidden_states(path)


def test_unfit_servers_are_refused_at_the_start(fleet):
    url = fleet.servers[1].url
    data = _data(fleet, "served", urls=[url])
    with pytest.raises(ConfigError) as err:  # other taps
        client, _ = _client(fleet, data, layers=[0, 2, 3])
        client.check([1, 2, 3, 4])
    assert str(err.value).startswith(
        f"data.served.urls[0] {url}/v1: the server taps vLLM aux "
        "layers [0, 2, 4], the recipe needs [1, 3, 4]"
    )
    for path, why in (
        (
            build_tiny_target(fleet.root / "wide", hidden_size=64),
            "the served target has hidden_size 128, the recipe's has 64",
        ),
        (
            build_tiny_target(fleet.root / "other", hidden_size=128, seed=5),
            "is not among the recipe's target's top 5",
        ),
    ):
        with pytest.raises(ConfigError) as err:
            client, _ = _client(fleet, data, path=path)
            client.check([1, 2, 3, 4, 5, 6])
        assert str(err.value).startswith(f"data.served.urls[0] {url}/v1: "), err.value
        assert why in str(err.value) and "\n" not in str(err.value), err.value
    assert os.listdir(fleet.storage) == []


def _train_args(fleet, name: str, *extra: str, recipe: str = RECIPE) -> list[str]:
    return [
        "--config",
        recipe,
        "--target.path",
        str(fleet.target),
        "--target.layer_ids",
        json.dumps(LAYERS),
        "--output_dir",
        str(fleet.root / "runs"),
        "--name",
        name,
        "--train.max_steps",
        str(STEPS),
        "--train.synthetic_samples",
        "0",
        "--data.paths",
        f"[{fleet.prep}]",
        "--data.max_length",
        str(MAX_LENGTH),
        "--train.progress_bar",
        "false",
        "--tracking.enabled",
        "false",
        "--checkpoint.every_steps",
        "2",
        *extra,
    ]


def _served_args(fleet, urls: list[str], *extra: str) -> list[str]:
    return [
        "--data.mode",
        "served",
        "--data.served.urls",
        json.dumps(urls),
        "--data.served.storage",
        str(fleet.storage),
        *extra,
    ]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None}


@pytest.fixture(scope="module")
def trained(fleet):
    urls = [s.url for s in fleet.servers]
    runs = {
        "online": _train_args(fleet, "online"),
        "served": _train_args(fleet, "served", *_served_args(fleet, urls)),
        "served_z3": _train_args(
            fleet, "served_z3", "--deepspeed.config", "zero3", *_served_args(fleet, urls)
        ),
        "online_eagle3": _train_args(fleet, "online_eagle3", recipe=EAGLE3),
        "served_eagle3": _train_args(
            fleet, "served_eagle3", *_served_args(fleet, urls), recipe=EAGLE3
        ),
        "hybrid": _train_args(
            fleet,
            "hybrid",
            "--data.mode",
            "hybrid",
            "--data.cache_dir",
            str(fleet.root / "cache"),
            "--data.served.urls",
            json.dumps(urls),
            "--data.served.storage",
            str(fleet.storage),
        ),
    }
    out = fleet.root / "runs"
    out.mkdir(exist_ok=True)
    spec, result = out / "spec.json", out / "result.json"
    spec.write_text(json.dumps({"runs": list(runs.values()), "result_file": str(result)}))
    check(torchrun([str(REPO / "tests" / "helpers" / "dist.py"), "train-many", str(spec)]))
    return {name: _losses(out / name) for name in runs}


def test_two_ranks_served_training_follows_online(fleet, trained):
    assert sorted(trained["online"]) == list(range(1, STEPS + 1))
    for served, online in (
        ("served", "online"),
        ("served_z3", "online"),
        ("served_eagle3", "online_eagle3"),
        ("hybrid", "online"),
    ):
        for step, loss in trained[online].items():
            assert trained[served][step] == pytest.approx(loss, rel=1e-4, abs=1e-5), (served, step)
    # 24 samples, global batch 4: epoch 0 is steps 1-6; hybrid's epoch 1 reads the cache it wrote
    assert (fleet.root / "cache" / "manifest.json").exists()
    rows = [
        json.loads(line)
        for line in (fleet.root / "runs" / "served" / "train_log.jsonl").read_text().splitlines()
    ]
    assert sum(r["data/served_sequences_per_s"] > 0 for r in rows) >= 1
    assert all(0 <= r["data/wait_share"] <= 1 for r in rows)
    assert "data/served_sequences_per_s" not in rows[0] or rows[0]["data/served_tokens_per_s"] > 0
    assert os.listdir(fleet.storage) == []


def test_every_server_gone_stops_in_one_line_and_resumes(fleet, trained):
    proxy = fleet.proxy
    # 2 start-up probes, then 2 sequences per rank and step: the 19th request (step 5) finds no
    # server, for good
    proxy.cut_after(b"POST /v1/completions", 2 + 2 * 2 * 4)
    args = _train_args(
        fleet,
        "gone",
        *_served_args(
            fleet,
            [proxy.url],
            "--data.served.give_up_s",
            "3",
            "--data.served.probe_interval_s",
            "0.5",
            "--data.served.retry_backoff_s",
            "0.1",
            "--data.served.prefetch_batches",
            "1",
        ),
    )
    argv = ["-m", "dspark_ds.cli", "train", *args]
    stopped = torchrun(argv)
    assert stopped.returncode == 1, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    out = stopped.stdout + stopped.stderr
    assert "no server has been in rotation for 3 s (data.served.give_up_s)" in out, out[-3000:]
    assert "--checkpoint.resume auto continues from it" in out
    done = sorted(_losses(fleet.root / "runs" / "gone"))
    assert done and done[-1] < STEPS, done
    proxy.restore()
    resumed = torchrun([*argv, "--checkpoint.resume", "auto"])
    check(resumed)
    losses = _losses(fleet.root / "runs" / "gone")
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in trained["served"].items():
        assert losses[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    assert os.listdir(fleet.storage) == []


# ---- the server itself: vLLM's parser, the files, the prefix cache ------------------------------
@pytest.fixture(scope="module")
def reference(fleet):
    """(FrozenTarget over LAYERS, the model's final norm): the in-job features."""
    from transformers import AutoModelForCausalLM

    from dspark_ds.target import FrozenTarget

    model = AutoModelForCausalLM.from_pretrained(fleet.target, dtype=torch.float32).eval()
    return FrozenTarget(model, LAYERS), model.model.norm


# run by vLLM's Python: vLLM's own parser of `api_server` / `vllm serve`, its config validation,
# and its connector factory
PARSE = r"""
import json, shlex, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector)

argv, shell = json.loads(sys.argv[1]), sys.argv[2]
args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
validate_parsed_serve_args(args)
words = shlex.split(shell)
served = make_arg_parser(FlexibleArgumentParser()).parse_args(words[words.index("serve") + 1:])
served.model = served.model_tag
for a in (args, served):  # engine_id: a random default
    a.kv_transfer_config = {**vars(a.kv_transfer_config), "engine_id": None}
differs = {k for k, v in vars(args).items() if vars(served).get(k) != v}
config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
kv, spec = config.kv_transfer_config, config.speculative_config
cls = KVConnectorFactory.get_connector_class(kv)
print("PARSED " + json.dumps({
    "model": args.model, "differs_from_shell": sorted(differs),
    "method": spec.method,
    "aux_ids": spec.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids,
    "max_model_len": config.model_config.max_model_len,
    "dtype": str(config.model_config.dtype), "enforce_eager": config.model_config.enforce_eager,
    "kv_connector": kv.kv_connector, "kv_role": kv.kv_role,
    "storage": kv.kv_connector_extra_config["shared_storage_path"],
    "connector_class": f"{cls.__module__}.{cls.__name__}",
    "stock_subclass": issubclass(cls, ExampleHiddenStatesConnector),
}))
"""


def test_argv_and_printed_command_pass_vllms_parser(fleet, tmp_path):
    target_dir = fleet.target
    served = ServedTarget(target_dir, tmp_path / "storage", LAYER_IDS, log=tmp_path / "log")
    python = require_vllm()
    cmd = build_command(served.config, python=python, cuda=False, environ=served.environment())
    assert cmd.argv[:3] == [python, "-m", SERVER_MODULE]
    proc = subprocess.run(
        [python, "-c", PARSE, json.dumps(cmd.argv[3:]), cmd.shell],
        env=cmd.environ(served.environment()),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("PARSED ")]
    assert lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("PARSED ") :])
    assert got == {
        "model": target_dir,
        "differs_from_shell": ["model_tag"],  # the shell form names the model positionally
        "method": "extract_hidden_states",
        "aux_ids": [0, 2, NUM_LAYERS],
        "max_model_len": 512,
        "dtype": "torch.float32",
        "enforce_eager": True,
        "kv_connector": CONNECTOR,
        "kv_role": "kv_producer",
        "storage": str(tmp_path / "storage"),
        "connector_class": f"shared_storage_hidden_states.{CONNECTOR}",
        "stock_subclass": True,
    }
    # what the printed command sets: the CPU build's variables this environment lacks, the
    # connector's folder
    cpu = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
    expected = {k: v for k, v in cpu.items() if k not in os.environ}
    expected["PYTHONPATH"] = str(CONNECTOR_DIR)
    assert [w.partition("=")[::2] for w in shlex.split(cmd.shell)[: len(expected)]] == list(
        expected.items()
    )


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _fetch(server, ids: list[int], keep: bool = False) -> tuple[dict, dict]:
    """The served file of ``ids``: (tensors, metadata), its name and ids checked."""
    answer = server.extract(ids)
    path = answer["kv_transfer_params"]["hidden_states_path"]
    assert Path(path).parent == server.storage
    tensors, meta = read_hidden_states(path)
    assert tensors["token_ids"].tolist() == ids
    if not keep:
        for p in (Path(path), Path(f"{path}.lock")):
            p.unlink()
    return tensors, meta


def _compare(server, reference, ids: list[int], tensors: dict, meta: dict) -> float:
    """A served file against the in-job features of ``ids``; returns the relative error."""
    frozen, norm = reference
    hidden = tensors["hidden_states"]
    assert hidden.shape == (len(ids), len(server.layout.aux_ids), 128)
    assert hidden.dtype == torch.float32
    assert meta == {
        "format": FORMAT,
        "aux_layer_ids": json.dumps(server.layout.aux_ids),
        "hidden_size": "128",
        "num_hidden_layers": str(NUM_LAYERS),
        "vocab_size": "384",
        "model": server.model,
    }
    with torch.no_grad():
        features, last = server.layout.features(hidden, norm)
        ref, ref_last = frozen(torch.tensor([ids]))
    scale = float(ref.abs().max())
    err = float((features - ref[0]).abs().max()) / scale
    assert err <= FP32_TOL, f"{len(ids)} tokens: relative error {err:.2e}"
    assert float((last - ref_last[0]).abs().max()) / scale <= FP32_TOL
    return err


def _check_file(server, reference, ids: list[int], keep: bool = False) -> float:
    return _compare(server, reference, ids, *_fetch(server, ids, keep))


def test_served_features_equal_the_in_job_target(fleet, reference):
    server = fleet.servers[0]
    errs = {n: _check_file(server, reference, _prompt(n, seed=n)) for n in (1, 13, 200, 511)}
    print("relative error by prompt length:", {n: f"{e:.1e}" for n, e in errs.items()})


def test_prefix_cache_hits_and_concurrent_requests(fleet, reference):
    server = fleet.servers[0]
    first = _prompt(300, seed=1)
    _check_file(server, reference, first)
    hits = server.metric("vllm:prefix_cache_hits")
    _check_file(server, reference, first)  # the whole prompt's blocks cached
    _check_file(server, reference, first[:128] + _prompt(100, seed=2))  # a shared prefix
    assert server.metric("vllm:prefix_cache_hits") - hits >= 2 * 128  # the states came from it
    prompts = [_prompt(40 + 30 * i, seed=10 + i) for i in range(4)]
    fetched: dict[int, tuple | BaseException] = {}

    def one(i: int) -> None:
        try:
            fetched[i] = _fetch(server, prompts[i])
        except BaseException as err:  # noqa: BLE001 - raised below, in the test's thread
            fetched[i] = err

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, ids in enumerate(prompts):  # NOTE: FrozenTarget is not thread-safe: compare here
        if isinstance(fetched[i], BaseException):
            raise fetched[i]
        _compare(server, reference, ids, *fetched[i])


def test_files_are_whole_with_the_stock_lock_and_readable_by_others(fleet, reference):
    server = fleet.servers[0]
    _check_file(server, reference, _prompt(20, seed=3), keep=True)
    names = sorted(p.name for p in server.storage.iterdir())
    files = [n for n in names if n.endswith(".safetensors")]
    assert files and not [n for n in names if n.endswith(".tmp")]  # renamed, none left over
    assert {f"{n}.lock" for n in files} <= set(names)  # the stock protocol's lock files
    umask = os.umask(0)
    os.umask(umask)
    modes = {oct(os.stat(server.storage / n).st_mode & 0o777) for n in files}
    assert modes == {oct(0o666 & ~umask)}  # not safetensors' 0600
    for name in names:
        (server.storage / name).unlink()


def test_a_server_killed_mid_epoch_loses_no_sequence(fleet, online):
    """The module's last test: server b is killed for good."""
    lines: list[str] = []
    data = _data(fleet, "served", prefetch_batches=3, retry_backoff_s=0.05)
    client, described = _client(fleet, data, lines.append)
    victim = fleet.servers[1]
    try:
        served = []
        for batch in _served_loader(data, client, described):
            served.append(batch)
            if len(served) == 2:
                os.killpg(victim.proc.pid, signal.SIGKILL)
        after = {s.base: s.answered for s in client.fleet.servers}
    finally:
        client.close()
    _assert_same_batches(served, online)
    assert any(f"out of rotation: {victim.url}/v1" in line for line in lines), lines
    assert after[f"{fleet.servers[0].url}/v1"] > after[f"{victim.url}/v1"]
    print(f"{sys.argv[0]}: served after the kill", after)


def test_sigterm_to_serve_target_stops_vllm(fleet):
    server = fleet.servers[0]
    # NOTE: ends the module's server: keep this test last
    pgid = server._vllm_group()
    assert pgid is not None and group_running(pgid)
    server.__exit__(None, None, None)
    print("serve-target exit code after SIGTERM:", server.exit_code)
    assert server.exit_code == 0  # serve-target left on its own, with vLLM's code
    assert not group_running(pgid)
    assert "Hidden-states write failed" not in server.log.read_text()
