"""The tracker's background sender: every MLflow call of a run, in order, off the caller's thread.

A call is an `Op` (JSON-able: what to send, not how). `Sender.put` queues it and returns at once;
one thread sends the queue's head, merging consecutive metric ops into one `log_batch`. A failed
send that may succeed later (no connection, a timeout, HTTP 5xx / 429) stays at the head and is
retried with a growing pause (`RETRY_PAUSES_S`), so nothing queued behind it overtakes it; one the
server refuses for good (another 4xx) is dropped and counted. Nothing turns tracking off.

Memory is bounded: past `max_queued_values` metric values the oldest metric ops leave the queue.
Those of a training run's log rows (`in_log`) become one `replay` op over their steps, which reads
the rows back from train_log.jsonl when its turn comes; others are dropped and counted.

MLflow's own asynchronous logging (`log_batch(synchronous=False)`) is not used: a batch whose
request fails is logged as an error and dropped, and its queue has no bound.

`Delivery` is what an op does against the store; `tracking/sync.py` runs the same ops again,
from the file the end of a run writes when some could not be sent (`UNDELIVERED_FILE`).
"""

from __future__ import annotations

import collections
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

UNDELIVERED_FILE = "mlflow_undelivered.json"
RETRY_PAUSES_S = (0.5, 1.0, 2.0, 4.0)
"""Pauses between retries of a failed send; the last one repeats."""
MAX_BATCH_VALUES = 1000
"""MLflow's limit of metrics per log_batch."""


@dataclass
class Op:
    """One MLflow call of a run: `kind` (a `Delivery` method) and its JSON-able arguments."""

    kind: str
    args: dict = field(default_factory=dict)
    in_log: bool = False
    """Metrics of a training run's log row: train_log.jsonl holds them too."""

    @property
    def values(self) -> int:
        return len(self.args["metrics"]) if self.kind == "metrics" else 0

    def to_json(self) -> dict:
        return {"kind": self.kind, "args": self.args, "in_log": self.in_log}

    @classmethod
    def from_json(cls, data: dict) -> Op:
        return cls(data["kind"], data.get("args", {}), data.get("in_log", False))

    def describe(self) -> str:
        a = self.args
        if self.kind == "metrics":
            return f"metrics of step {a['step']} ({len(a['metrics'])} values)"
        if self.kind == "replay":
            return f"log steps {a['first']}-{a['last']} (from {a['log']})"
        if self.kind == "end":
            return f"the run's end ({a['status']})"
        return self.kind


def is_transient(err: BaseException) -> bool:
    """Worth a retry: no connection, a timeout, a server error; not a request the server refuses
    (HTTP 4xx other than 408 / 429) or a local file that is missing."""
    if isinstance(err, FileNotFoundError | NotADirectoryError | IsADirectoryError):
        return False
    # lazy: mlflow, 1.4 s of import
    from mlflow.exceptions import MlflowException

    if isinstance(err, MlflowException):
        status = err.get_http_status_code()
        return not (400 <= status < 500) or status in (408, 429)
    return True


class Sender:
    """Sends `Op`s through `delivery` on a background thread (or inline: `run_inline`)."""

    def __init__(self, delivery, *, max_queued_values: int = 200_000, log=None):
        """`log(line)`: where the sender's warnings go (one per outage, one when back)."""
        self.delivery = delivery
        self.max_queued_values = max_queued_values
        self._log = log or (lambda line: None)
        self._queue: collections.deque[Op] = collections.deque()
        self._inflight: list[Op] = []
        self._cond = threading.Condition()
        self._queued_values = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self.sent_ops = 0
        self.dropped: list[str] = []
        """What was given up: refused by the server, or evicted without a log to replay from."""
        self.failing_since: float | None = None
        self.last_error: str | None = None
        self.refused_start: str | None = None
        """Why the server refused to make the run (then nothing else can be sent)."""

    # ---- the caller's side ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="mlflow-sender", daemon=True)
        self._thread.start()

    def put(self, op: Op) -> None:
        with self._cond:
            self._queue.append(op)
            self._queued_values += op.values
            while self._queued_values > self.max_queued_values and self._evict_oldest_metrics():
                pass
            self._cond.notify_all()

    def pending(self) -> list[Op]:
        with self._cond:
            return [*self._inflight, *self._queue]

    def idle(self) -> bool:
        with self._cond:
            return not self._queue and not self._inflight

    def drain(self, timeout_s: float) -> bool:
        """Waits until everything queued was sent (True) or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._inflight:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                self._cond.wait(min(left, 0.2))
            return True

    def stop(self, timeout_s: float) -> list[Op]:
        """Ends the thread (after the send in progress, at most `timeout_s`); returns what was
        not sent, in order."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.pending()

    def _evict_oldest_metrics(self) -> bool:
        """Lock held: the oldest queued metric op leaves memory (a replay op over its step when
        the run's log holds it). False when no metric op is left to evict."""
        ops = self._queue
        for i, op in enumerate(ops):
            if op.kind != "metrics":
                continue
            self._queued_values -= op.values
            replay_log = getattr(self.delivery, "replay_log", None)
            if op.in_log and replay_log is not None:
                step = op.args["step"]
                before = ops[i - 1] if i > 0 else None
                if before is not None and before.kind == "replay" and before.args["last"] < step:
                    before.args["last"] = step
                    del ops[i]
                else:
                    ops[i] = Op("replay", {"log": str(replay_log), "first": step, "last": step})
            else:
                self.dropped.append(f"{op.describe()}: evicted from the full queue")
                del ops[i]
            return True
        return False

    # ---- the thread ----------------------------------------------------------------------------
    def _take(self) -> list[Op]:
        """Lock held: the head op, or the metric ops at the head up to one batch."""
        first = self._queue.popleft()
        taken = [first]
        if first.kind == "metrics":
            values = first.values
            target = first.args.get("run_id")
            while self._queue and self._queue[0].kind == "metrics":
                head = self._queue[0]
                if head.args.get("run_id") != target or values + head.values > MAX_BATCH_VALUES:
                    break
                values += head.values
                taken.append(self._queue.popleft())
        self._queued_values -= sum(op.values for op in taken)
        return taken

    def _loop(self) -> None:
        failures = 0
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop or not self._queue:
                    return
                if self.refused_start is not None:  # no run: nothing queued can arrive
                    self.dropped += [f"{op.describe()}: no run" for op in self._queue]
                    self._queue.clear()
                    self._queued_values = 0
                    self._cond.notify_all()
                    continue
                self._inflight = self._take()
            try:
                self.delivery.apply(self._inflight)
            except Exception as err:  # noqa: BLE001 - a failed send never reaches the caller
                if is_transient(err):
                    failures += 1
                    self._failed(err)
                    with self._cond:
                        self._queue.extendleft(reversed(self._inflight))
                        self._queued_values += sum(op.values for op in self._inflight)
                        self._inflight = []
                        pause = RETRY_PAUSES_S[min(failures, len(RETRY_PAUSES_S)) - 1]
                        self._cond.wait_for(lambda: self._stop, pause)
                    continue
                self._refused(err)
            else:
                if self.failing_since is not None:
                    self._log(
                        f"[tracking] {self.delivery.uri} answers again after "
                        f"{time.monotonic() - self.failing_since:.0f} s; sending what waited"
                    )
                self.failing_since, failures = None, 0
                self.sent_ops += len(self._inflight)
            with self._cond:
                self._inflight = []
                self._cond.notify_all()

    def _failed(self, err: BaseException) -> None:
        self.last_error = _one_line(err)
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            self._log(
                f"[tracking] WARNING: cannot reach {self.delivery.uri} ({self.last_error}); "
                "training goes on, and what is logged meanwhile is sent when it answers"
            )

    def _refused(self, err: BaseException) -> None:
        what = ", ".join(op.describe() for op in self._inflight)
        if any(op.kind == "start" for op in self._inflight):
            self.refused_start = _one_line(err)
        self.dropped.append(f"{what}: {_one_line(err)}")
        self._log(f"[tracking] WARNING: {self.delivery.uri} refused {what}: {_one_line(err)}")

    # ---- without a thread (dspark-ds sync-tracking) --------------------------------------------
    def run_inline(self, timeout_s: float) -> bool:
        """Sends the queue on this thread, retrying until `timeout_s` passed; True when all went."""
        self.start()
        done = self.drain(timeout_s)
        self.stop(timeout_s=max(1.0, self.delivery.timeout_s + 1))
        return done


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return (text[:160] + "...") if len(text) > 160 else text or type(err).__name__


def write_undelivered(path: Path, header: dict, ops: list[Op]) -> None:
    """The ops a run's end could not send, for `dspark-ds sync-tracking` (written atomically)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**header, "ops": [op.to_json() for op in ops]}, indent=1))
    tmp.replace(path)


def read_undelivered(path: Path) -> tuple[dict, list[Op]]:
    data = json.loads(path.read_text())
    ops = [Op.from_json(o) for o in data.pop("ops", [])]
    return data, ops


def summarize(ops: list[Op]) -> str:
    """`ops` in a few words: how many log steps (and which), and the other calls."""
    steps = sorted({o.args["step"] for o in ops if o.kind == "metrics"})
    ranges = [(o.args["first"], o.args["last"]) for o in ops if o.kind == "replay"]
    parts = []
    if steps or ranges:
        count = len(steps) + sum(1 for _ in ranges)
        spans = [f"{a}-{b}" for a, b in ranges] + ([f"{steps[0]}-{steps[-1]}"] if steps else [])
        parts.append(
            f"{len(steps)} metric step(s)"
            + (f" and {count - len(steps)} log span(s)" if ranges else "")
            + f" (steps {', '.join(spans)})"
        )
    others = collections.Counter(o.describe() for o in ops if o.kind not in ("metrics", "replay"))
    parts += [f"{what}" + (f" x{n}" if n > 1 else "") for what, n in others.items()]
    return "; ".join(parts) or "nothing"
