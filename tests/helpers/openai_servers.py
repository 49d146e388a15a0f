"""Real OpenAI-compatible servers for the regeneration tests.

Stable API:

- ``TransformersServe(model_dir, log_dir)``: one ``transformers serve`` process (the
  ``transformers[serving]`` extra) on a free loopback port, CPU, the model preloaded.
  ``start()`` returns once ``/health`` answers (the process' log in the failure otherwise),
  ``kill()`` sends SIGKILL, ``stop()`` TERM then KILL; ``url`` is ``http://127.0.0.1:P/v1``.
- ``MisbehavingServer(mode, ...)``: a threaded ``http.server`` on a free loopback port that
  speaks enough of the OpenAI API (``/health``, ``/v1/models``, ``/v1/chat/completions``
  answering "pong") for the first ``good_chats`` chat requests, then misbehaves on purpose:
  ``"500"`` (HTTP 500), ``"garbage"`` (HTTP 200 with a body that is not JSON), ``"slow"``
  (answers after ``delay_s``), ``"dead"`` (HTTP 503 to everything, ``/health`` included),
  ``"ok"`` (never). ``heal()`` makes it answer well from then on; ``chats`` counts the chat
  requests; ``models_body`` replaces the ``/v1/models`` answer (bytes).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from helpers.system import wait_healthy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TransformersServe:
    """One `transformers serve` process on the loopback interface."""

    def __init__(self, model_dir: str, log_dir: Path, name: str = "serve"):
        self.model_dir = model_dir
        self.log = Path(log_dir) / f"{name}.log"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def launch(self) -> None:
        """Start the process (returns at once; `wait_ready` waits for it)."""
        env = os.environ | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", self.model_dir]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu"]
        cmd += ["--log-level", "warning"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 120) -> None:
        url = f"http://127.0.0.1:{self.port}/health"
        if wait_healthy(url, self.proc, timeout_s, poll_s=0.2, request_s=2):
            return
        if self.proc.poll() is not None:
            raise RuntimeError(f"transformers serve exited {self.proc.returncode}:\n{self.tail()}")
        raise RuntimeError(f"transformers serve not healthy after {timeout_s} s:\n{self.tail()}")

    def start(self) -> TransformersServe:
        self.launch()
        self.wait_ready()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self) -> str:
        return "".join(self.log.read_text(errors="replace").splitlines(keepends=True)[-30:])


def completion(text: str, tokens: int = 1) -> dict:
    return {
        "id": "x",
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": 1 + tokens},
    }


class MisbehavingServer:
    """A small real HTTP server that answers well, then misbehaves (module docstring)."""

    def __init__(
        self,
        mode: str,
        model: str = "tiny",
        good_chats: int = 1,
        delay_s: float = 2.0,
        models_body: bytes | None = None,
    ):
        self.mode, self.model, self.good_chats, self.delay_s = mode, model, good_chats, delay_s
        self.models_body = models_body
        self.chats = 0
        self.healed = False
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _dead(self) -> bool:
                return owner.mode == "dead" and owner.chats > owner.good_chats and not owner.healed

            def do_GET(self):
                if self._dead():
                    self._send(503, b'{"detail": "unavailable"}')
                elif self.path == "/health":
                    self._send(200, b"{}")
                elif self.path == "/v1/models":
                    body = (
                        owner.models_body
                        or json.dumps(
                            {"object": "list", "data": [{"id": owner.model, "object": "model"}]}
                        ).encode()
                    )
                    self._send(200, body)
                else:
                    self._send(404, b'{"detail": "Not Found"}')

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                json.loads(self.rfile.read(length))
                if self.path != "/v1/chat/completions":
                    self._send(404, b'{"detail": "Not Found"}')
                    return
                with owner._lock:
                    owner.chats += 1
                    good = owner.chats <= owner.good_chats or owner.healed or owner.mode == "ok"
                if good:
                    self._send(200, json.dumps(completion("pong")).encode())
                elif owner.mode == "500":
                    self._send(500, b'{"detail": "boom"}')
                elif owner.mode == "garbage":
                    self._send(200, b"<html>certainly not json</html>", "text/html")
                elif owner.mode == "slow":
                    time.sleep(owner.delay_s)
                    self._send(200, json.dumps(completion("late")).encode())
                else:  # dead
                    self._send(503, b'{"detail": "unavailable"}')

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def heal(self) -> None:
        self.healed = True

    def __enter__(self) -> MisbehavingServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
