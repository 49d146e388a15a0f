"""Remake the pictures of docs/tracking.md: the MLflow UI, photographed by headless Chromium.

    python tools/mlflow_pictures.py --out docs/images
    python tools/mlflow_pictures.py --out docs/images --work /tmp/pics --reuse true

1. a small `dspark-ds demo` (the smoke test's sizes) and a `dspark-ds tune` sweep of the Qwen3-8B
   recipe, both into one MLflow store under --work (skipped with --reuse when it is there);
2. `mlflow server` on that store, on loopback;
3. Chromium (Debian's `chromium`, `apt-get install chromium`), headless, driven over its
   DevTools protocol: the demo's experiment with every nested run expanded
   (mlflow-demo-nested.png), and MLflow's compare view of the sweep's options
   (mlflow-tune-compare.png);
4. the server and the browser stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_ARGS = [
    "--target.num_train_rows", "200", "--target.vocab_size", "320",
    "--target.hidden_size", "32", "--target.num_hidden_layers", "3",
    "--target.num_attention_heads", "2", "--target.num_key_value_heads", "1",
    "--target.intermediate_size", "64", "--target.max_steps", "30", "--target.batch_size", "8",
    "--target.lr", "1e-2", "--target.warmup_steps", "2", "--target.num_probe_rows", "8",
    "--target.num_threads", "1",
    "--data.num_train_prompts", "24", "--data.num_heldout_prompts", "4",
    "--data.max_new_tokens", "24", "--data.regenerate_batch_size", "12",
    "--drafter.dspark.num_draft_layers", "1", "--drafter.dspark.block_size", "4",
    "--drafter.dspark.markov_rank", "8", "--drafter.eagle3.ttt_length", "4",
    "--budget.max_steps", "20", "--budget.global_batch_size", "4",
    "--budget.micro_batch_size", "2", "--eval.max_new_tokens", "12",
]  # fmt: skip
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run",
                  "--hide-scrollbars", "--window-size=1500,760"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(*args: str, env: dict | None = None) -> None:
    subprocess.run([sys.executable, "-m", "dspark_ds.cli", *args], check=True, cwd=REPO,
                   env={**os.environ, **(env or {})})  # fmt: skip


def make_store(work: Path) -> str:
    """A demo and a tuner sweep in one sqlite store; returns its URI."""
    uri = f"sqlite:///{work / 'demo' / 'mlflow.db'}"
    cli("demo", "--output_dir", str(work / "demo"), *DEMO_ARGS,
        env={"DSPARK_DS_CACHE": str(work / "cache")})  # fmt: skip
    cli("tune", "--recipe", "dspark_ds/recipes/dspark_qwen3_8b.yaml", "--tracking.uri", uri,
        "--tracking.experiment", "dspark-ds-tune", "--overrides",
        json.dumps(["--output_dir", str(work / "tune")]))  # fmt: skip
    return uri


@contextlib.contextmanager
def process(cmd: list[str], ready_url: str, timeout_s: float = 120, **kwargs):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, **kwargs)  # fmt: skip
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited ({proc.returncode})")
            try:
                with urllib.request.urlopen(ready_url, timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nothing at {ready_url} after {timeout_s} s") from None
                time.sleep(0.5)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


class Page:
    """One Chromium tab over the DevTools protocol (aiohttp's websocket client)."""

    def __init__(self, ws):
        self.ws, self._id = ws, 0

    async def call(self, method: str, **params):
        self._id += 1
        await self.ws.send_json({"id": self._id, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json()
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    async def js(self, expression: str):
        out = await self.call("Runtime.evaluate", expression=expression, awaitPromise=True,
                              returnByValue=True)  # fmt: skip
        if "exceptionDetails" in out:
            raise RuntimeError(f"script failed: {out['exceptionDetails']}")
        return out.get("result", {}).get("value")

    async def wait_for(self, expression: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not await self.js(
            f"(() => {{ try {{ return {expression}; }} catch (e) {{ return false; }} }})()"
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the page never had {expression}")
            await asyncio.sleep(0.5)

    async def open(self, url: str, ready: str) -> None:
        await self.call("Page.navigate", url=url)
        await self.wait_for(ready)
        await asyncio.sleep(2)  # the table's last rows and fonts

    async def shot(self, path: Path) -> None:
        data = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(data["data"]))
        print(f"wrote {path}")

    async def key(self, name: str) -> None:
        code = {"Escape": 27}[name]
        for kind in ("rawKeyDown", "keyUp"):
            await self.call("Input.dispatchKeyEvent", type=kind, key=name, code=name,
                            windowsVirtualKeyCode=code)  # fmt: skip


EXPANDER = "button[data-component-id$='runnamecellrenderer.tsx_46']"
"""The nested runs' expander of MLflow 3's runs table (a plus icon while collapsed)."""
EXPAND_ALL = """(async () => {
  for (let round = 0; round < 8; round++) {
    const closed = [...document.querySelectorAll("SELECTOR")]
      .filter(b => b.innerHTML.includes('V4.5'));
    if (!closed.length) break;
    closed[0].click();
    await new Promise(r => setTimeout(r, 1000));
  }
  return document.querySelectorAll("SELECTOR").length;
})()""".replace("SELECTOR", EXPANDER)
SELECT = """(label => [...document.querySelectorAll('div')]
  .find(d => d.childElementCount === 0 && d.innerText.trim() === label)
  .parentElement.querySelector('.du-bois-light-select'))"""
"""The select box of the compare view's plot under the label `label`."""
DROP_PARAMS = """(async () => {
  const params = %s('Parameters:');
  for (const name of ['deepspeed.config', 'deepspeed.overrides']) {
    const chip = [...params.querySelectorAll('.du-bois-light-select-selection-item')]
      .find(c => c.innerText.trim() === name);
    if (chip) chip.querySelector('.du-bois-light-select-selection-item-remove').click();
    await new Promise(r => setTimeout(r, 500));
  }
  return true;
})()""".replace("%s", SELECT)
CLOSE_PANELS = """(() => {
  const close = [...document.querySelectorAll('button[aria-label="Close"]')];
  close.forEach(b => b.click());
  return close.length;
})()"""


async def photograph(ui: str, uri: str, out: Path, profile: Path) -> None:
    import aiohttp
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    demo = client.get_experiment_by_name("dspark-ds-demo")
    sweep_exp = client.get_experiment_by_name("dspark-ds-tune")
    sweep = client.search_runs([sweep_exp.experiment_id], "tags.kind = 'tune'",
                               order_by=["attributes.start_time DESC"])  # fmt: skip
    parent = next(r for r in sweep if "mlflow.parentRunId" not in r.data.tags)
    options = [r.info.run_id for r in sweep if r.data.tags.get("mlflow.parentRunId")
               == parent.info.run_id]  # fmt: skip
    port = free_port()
    cmd = ["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
           f"--remote-debugging-port={port}", "about:blank"]  # fmt: skip
    with process(cmd, f"http://127.0.0.1:{port}/json/version"):
        async with aiohttp.ClientSession() as http:
            async with http.put(f"http://127.0.0.1:{port}/json/new?about:blank") as r:
                tab = await r.json()
            async with http.ws_connect(tab["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                await page.call("Page.enable")
                await page.call("Runtime.enable")
                await page.open(
                    f"{ui}/#/experiments/{demo.experiment_id}/runs",
                    "document.body.innerText.includes('matching runs')",
                )
                await page.js(CLOSE_PANELS)
                await page.wait_for(f'!!document.querySelector("{EXPANDER}")')
                print("expanders:", await page.js(EXPAND_ALL))
                await asyncio.sleep(2)
                await page.shot(out / "mlflow-demo-nested.png")
                # NOTE: the compare view scrolls inside its own pane: a tall window shows it all
                await page.call("Emulation.setDeviceMetricsOverride", width=1500, height=1250,
                                deviceScaleFactor=1, mobile=False)  # fmt: skip
                compare = (f"{ui}/#/compare-runs?runs={json.dumps(options)}"
                           f"&experiments={json.dumps([sweep_exp.experiment_id])}")  # fmt: skip
                await page.open(
                    compare.replace(" ", ""),
                    "document.body.innerText.includes('zero3+offload_opt')",
                )
                plot = "!!document.querySelector('.js-plotly-plot')"
                await page.wait_for(plot)
                # the plot's axes: the option and its predicted memory per GPU
                await page.js(DROP_PARAMS)
                await page.key("Escape")
                await asyncio.sleep(1)
                await page.wait_for(plot)
                await asyncio.sleep(2)
                await page.shot(out / "mlflow-tune-compare.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "images"))
    ap.add_argument("--work", default=None, help="where the store goes (default: a temp dir)")
    ap.add_argument("--reuse", default="false", help="true: photograph the store in --work")
    args = ap.parse_args()
    if shutil.which("chromium") is None:
        sys.exit("chromium not installed: apt-get install chromium")
    work = Path(args.work or tempfile.mkdtemp(prefix="mlflow_pictures_"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{work / 'demo' / 'mlflow.db'}"
    if args.reuse != "true" or not (work / "demo" / "mlflow.db").is_file():
        uri = make_store(work)
    port = free_port()
    ui = f"http://127.0.0.1:{port}"
    server = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port",
              str(port), "--workers", "1", "--backend-store-uri", uri]  # fmt: skip
    with process(server, f"{ui}/health", cwd=work), tempfile.TemporaryDirectory() as profile:
        asyncio.run(photograph(ui, uri, out, Path(profile)))


if __name__ == "__main__":
    main()
