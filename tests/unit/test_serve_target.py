"""`dspark-ds serve-target` without vLLM: the command it builds and prints, its errors, and how it
runs a process (a shell script standing in for vLLM's Python). vLLM itself:
tests/e2e/test_served_target_vllm.py."""

from __future__ import annotations

import ast
import json
import os
import shlex
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dspark_ds import cli
from dspark_ds.data.config import CONNECTOR, DataConfig, ServedConfig
from dspark_ds.serve import hidden_states
from dspark_ds.serve.target_server import (
    CONNECTOR_DIR,
    SERVER_MODULE,
    ServeTargetConfig,
    build_command,
    group_running,
    run_foreground,
)
from dspark_ds.target import TargetConfig

CONNECTOR_FILE = CONNECTOR_DIR / "shared_storage_hidden_states.py"
CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture
def base_env(monkeypatch) -> dict[str, str]:
    """This process's environment without the CPU build's variables or an API key."""
    for name in (*CPU_ENV, "OPENAI_API_KEY", "PYTHONPATH", "DSPARK_DS_VLLM_PYTHON"):
        monkeypatch.delenv(name, raising=False)
    return dict(os.environ)


def config(
    target: str, storage, *, layer_ids=(-1, 1, 3), max_length=64, **served
) -> ServeTargetConfig:
    return ServeTargetConfig(
        target=TargetConfig(
            path=target, layer_ids=list(layer_ids) if layer_ids else None, dtype="float32"
        ),
        data=DataConfig(max_length=max_length, served=ServedConfig(**served)),
        host="127.0.0.1",
        port=8123,
        storage=str(storage),
    )


def flags(argv: list[str]) -> dict[str, str | bool]:
    """`--flag value` / `--switch` pairs of an argv's options."""
    out: dict[str, str | bool] = {}
    for i, word in enumerate(argv):
        if word.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else "--"
            out[word] = True if nxt.startswith("--") else nxt
    return out


def test_cpu_command(tiny_target, tmp_path, base_env):
    cmd = build_command(config(tiny_target, tmp_path / "hs"), python="/py", cuda=False)
    assert cmd.argv[:5] == ["/py", "-m", SERVER_MODULE, "--model", tiny_target]
    f = flags(cmd.argv)
    assert f["--host"] == "127.0.0.1" and f["--port"] == "8123"
    assert f["--dtype"] == "float32"
    assert f["--max-model-len"] == "65"  # the sequence and the token vLLM samples after it
    assert json.loads(f["--speculative-config"]) == {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        # our -1, 1, 3 of a 4-layer target: vLLM's 0, 2 and 4 (the pre-norm last state)
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}},
    }
    assert json.loads(f["--kv-transfer-config"]) == {
        "kv_connector": CONNECTOR,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "hs")},
        "kv_connector_module_path": "shared_storage_hidden_states",
    }
    assert f["--tensor-parallel-size"] == "1" and f["--enforce-eager"] is True
    assert "--enable-expert-parallel" not in f and "--served-model-name" not in f
    assert cmd.env == {**CPU_ENV, "PYTHONPATH": str(CONNECTOR_DIR)}
    assert cmd.api_key_env is None and "VLLM_API_KEY" not in cmd.environ(base_env)
    assert cmd.layout.aux_ids == [0, 2, 4]
    # an explicit KV cache size: the CPU build's legacy variable would override it, so it goes
    sized = config(tiny_target, tmp_path, vllm_args=["--kv-cache-memory-bytes", "67108864"])
    cmd = build_command(sized, python="/py", cuda=False)
    assert "VLLM_CPU_KVCACHE_SPACE" not in cmd.env and "VLLM_TARGET_DEVICE" in cmd.env


def test_gpu_command_with_the_served_section(tiny_target, tmp_path, base_env):
    cfg = config(
        tiny_target,
        "rel/hs",
        layer_ids=None,
        connector="ExampleHiddenStatesConnector",
        connector_extra={"num_writer_threads": 4},
        tensor_parallel_size=4,
        expert_parallel=True,
        model="served-name",
        vllm_args=["--gpu-memory-utilization", "0.9", "--max-model-len", "9"],
    )
    cmd = build_command(cfg, python="/py", cuda=True)
    f = flags(cmd.argv)
    assert "--enforce-eager" not in f and cmd.env == {}  # vLLM's stock connector, no PYTHONPATH
    assert f["--tensor-parallel-size"] == "4" and f["--enable-expert-parallel"] is True
    assert f["--served-model-name"] == "served-name"
    assert cmd.argv[-4:] == ["--gpu-memory-utilization", "0.9", "--max-model-len", "9"]  # last
    assert json.loads(f["--kv-transfer-config"]) == {
        "kv_connector": "ExampleHiddenStatesConnector",  # from vLLM's registry: no module path
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "num_writer_threads": 4,
            "shared_storage_path": os.path.abspath("rel/hs"),  # vLLM's cwd is not ours
        },
    }
    # target.layer_ids None: the default ids of 4 layers ([1]) and the last state
    assert cmd.layout.layer_ids == (1,) and cmd.layout.aux_ids == [2, 4]


def test_a_site_connector_module_and_its_pythonpath(tiny_target, tmp_path, base_env):
    cfg = config(tiny_target, tmp_path, connector="SiteConnector", connector_module="site.hs")
    cmd = build_command(cfg, python="/py", cuda=True)
    kv = json.loads(flags(cmd.argv)["--kv-transfer-config"])
    assert kv["kv_connector_module_path"] == "site.hs" and "PYTHONPATH" not in cmd.env
    base = {**base_env, "PYTHONPATH": "/site"}
    own = build_command(config(tiny_target, tmp_path), python="/py", cuda=True, environ=base)
    assert own.environ(base)["PYTHONPATH"] == f"{CONNECTOR_DIR}{os.pathsep}/site"


def test_printed_command_is_the_same_server_and_never_shows_the_key(
    tiny_target, tmp_path, base_env
):
    key = "sk-serve-target-test-51c2"
    base = {**base_env, "SERVE_KEY": key}
    cfg = config(tiny_target, tmp_path / "a b", api_key_env="SERVE_KEY")  # a path with a space
    cmd = build_command(cfg, python="/py", cuda=False, environ=base)
    words = shlex.split(cmd.shell)
    assert words[:3] == [f"{k}={v}" for k, v in cmd.env.items()]
    assert words[3:6] == ["vllm", "serve", tiny_target]
    assert words[6:-2] == cmd.argv[5:]  # the same flags, each a word after the shell's quoting
    assert words[-2:] == ["--api-key", "$SERVE_KEY"] and '"$SERVE_KEY"' in cmd.shell
    assert key not in cmd.shell and key not in " ".join(cmd.argv)
    assert cmd.environ(base)["VLLM_API_KEY"] == key  # vLLM's own variable: not in ps' argv


def serve_target(tiny_target: str, *argv: str) -> int:
    """`dspark-ds serve-target` of the tiny target with the tiny_cpu recipe, then `argv`."""
    return cli.main(["serve-target", "--config", "tiny_cpu", "--target.path", tiny_target, *argv])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--target.path", ""], "target.path: is required"),
        ([], "storage: is required"),
        (
            ["--storage", "S", "--target.layer_ids", "[1, 4]"],
            "target.layer_ids: [1, 4] out of range",
        ),
        (
            ["--storage", "S", "--target.path", "no/such/dir"],
            "target.path: no/such/dir does not exist",
        ),
        (["--storage", "S", "--port", "0"], "port: must be in 1..65535"),
        (
            ["--storage", "S", "--data.served.connector_extra", '{"shared_storage_path": "/x"}'],
            "data.served.connector_extra: shared_storage_path is set by --storage",
        ),
        (["--storage", "S"], "vllm_python: no Python with vLLM found (`bash tools/install.sh`"),
    ],
    ids=["no-target", "no-storage", "layer-range", "target-missing", "port", "extra", "no-vllm"],
)
def test_bad_input_is_one_line_naming_the_option(
    argv, message, tiny_target, tmp_path, base_env, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSPARK_DS_VLLM_ENV", str(tmp_path / "no-venv"))
    no_vllm = SimpleNamespace(util=SimpleNamespace(find_spec=lambda name: None))
    monkeypatch.setattr("dspark_ds.serve.check.importlib", no_vllm)  # this Python lacks vllm
    rc = serve_target(tiny_target, *argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert message in err
    assert not (tmp_path / "S").exists()


def test_dry_run_prints_and_starts_nothing(tiny_target, tmp_path, base_env, capsys):
    rc = serve_target(
        tiny_target,
        "--storage",
        str(tmp_path / "hs"),
        "--dry_run",
        "true",
        "--vllm_python",
        str(tmp_path / "never-run"),
    )
    out = capsys.readouterr().out
    assert rc == 0 and not (tmp_path / "hs").exists()
    assert "(4 layers) on CPU" in out  # tiny_cpu: target.device cpu
    assert f"PYTHONPATH={CONNECTOR_DIR} vllm serve {tiny_target} --host 0.0.0.0 --port 8000" in out
    assert "--max-model-len 65 " in out  # tiny_cpu: data.max_length 64


def fake_vllm(tmp_path: Path, body: str) -> Path:
    """A shell script in vLLM's Python's place; ``$OUT`` is a file beside it."""
    script = tmp_path / "fake-python"
    script.write_text(f'#!/bin/sh\nOUT="{tmp_path}/out"\n{body}\n')
    script.chmod(0o755)
    return script


# a child of the stand-in's group, asleep for 30 s: started in the background, then waited for
# until it runs `sleep` (a signal that reaches the forked shell before its exec is lost with the
# shell's own trap, and the group's leftover would be waited for 30 s: the product's bound, not
# what these tests time)
SLEEPING_CHILD = 'sleep 30 &\nuntil [ "$(cat /proc/$!/comm 2>/dev/null)" = sleep ]; do :; done\n'


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        text = stat.read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"


def test_runs_vllm_and_exits_with_its_code(tiny_target, tmp_path, base_env):
    python = fake_vllm(tmp_path, 'echo "$PYTHONPATH $VLLM_TARGET_DEVICE $*" > "$OUT"; exit 3')
    with pytest.raises(SystemExit) as exit_:
        serve_target(tiny_target, "--storage", str(tmp_path / "hs"), "--vllm_python", str(python))
    assert exit_.value.code == 3
    assert (tmp_path / "hs").is_dir()
    seen = (tmp_path / "out").read_text()
    assert seen.startswith(f"{CONNECTOR_DIR} cpu -m {SERVER_MODULE} --model {tiny_target} ")


def test_sigterm_goes_to_vllms_group_and_handlers_come_back(tmp_path, base_env):
    # the stand-in (with a child) asks for its own stop: SIGTERM to us, which we forward
    script = fake_vllm(
        tmp_path,
        "trap 'echo TERM > \"$OUT\"; exit 7' TERM\n"
        f'echo $$ > "$OUT.pgid"\n{SLEEPING_CHILD}kill -TERM $PPID\nwait',
    )
    before = signal.getsignal(signal.SIGTERM)
    t0 = time.monotonic()
    assert run_foreground([str(script)], dict(os.environ)) == 7
    assert time.monotonic() - t0 < 10  # the `sleep 30` went with its group
    assert (tmp_path / "out").read_text().strip() == "TERM"
    assert not group_running(int((tmp_path / "out.pgid").read_text()))
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_another_thread_receives_is_forwarded_too(tmp_path, base_env):
    # the kernel hands a process's signal to any thread that does not block it: with this one
    # blocking SIGTERM, a thread of the process (as a test worker's or a library's) takes it,
    # and the main thread's wait must still wake up to forward it (a plain proc.wait() slept on
    # until the stand-in's 30 s of sleeps ended)
    script = fake_vllm(
        tmp_path,
        # (its children inherit the blocked SIGTERM: a stand-in that waits in short sleeps, which
        # its trap ends between two of them, leaves no child to outlive it)
        "trap 'echo TERM > \"$OUT\"; exit 7' TERM\nsleep 0.5\nkill -TERM $PPID\n"
        "for i in $(seq 300); do sleep 0.1; done",
    )
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        t0 = time.monotonic()
        assert run_foreground([str(script)], dict(os.environ)) == 7
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        stop.set()
    assert time.monotonic() - t0 < 10
    assert (tmp_path / "out").read_text().strip() == "TERM"


def test_a_second_signal_kills_and_leftovers_are_reaped(tmp_path, base_env):
    script = fake_vllm(
        tmp_path,
        "trap 'echo TERM >> \"$OUT\"' TERM\nkill -TERM $PPID\n"
        "sleep 0.3\nkill -TERM $PPID\nsleep 30",
    )
    assert run_foreground([str(script)], dict(os.environ)) == 128 + signal.SIGKILL
    orphan = fake_vllm(tmp_path, 'sleep 30 &\necho $! > "$OUT"\nexit 0')
    t0 = time.monotonic()
    assert run_foreground([str(orphan)], dict(os.environ), stop_wait_s=5) == 0
    pid = int((tmp_path / "out").read_text())
    assert not running(pid) and time.monotonic() - t0 < 4  # SIGTERM'd at once: not waited for


def test_connector_folder_and_imports():
    # vLLM's Python imports every module of the folder by name: only the connector is there
    assert sorted(p.name for p in CONNECTOR_DIR.glob("*.py")) == [
        "__init__.py",
        "shared_storage_hidden_states.py",
    ]
    tree = ast.parse(CONNECTOR_FILE.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    assert roots - {"__future__", "fcntl", "json", "os", "re", "uuid", "functools"} == {
        "torch",
        "safetensors",
        "vllm",
    }
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    assert CONNECTOR in classes  # data.served.connector's default is this module's class
    # the format literal is duplicated (the connector cannot import dspark_ds): the same value
    (value,) = [
        n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and [t.id for t in n.targets] == ["FORMAT"]
    ]
    assert value == hidden_states.FORMAT
