"""Signals that stop a training run in good order: the step in progress finishes, a checkpoint
is written, then the process leaves with an exit code that says why.

    SIGTERM, SIGUSR1   Slurm's pre-emption warning, `scontrol requeue`, `scancel`, torchrun
                       passing on a stop → exit 75 (EX_TEMPFAIL) and <run>/REQUEUE: the sbatch
                       script requeues the job, which resumes from the checkpoint.
    SIGINT (Ctrl-C)    → exit 130 (128 + SIGINT, what a shell reports for an interrupted
                       command); no REQUEUE: a person asked to stop. A second Ctrl-C ends the
                       process at once (the default action is back after the first), without a
                       checkpoint: the last complete one stays in charge.

The first signal a rank receives decides for that rank (`Signals.request`); the ranks agree in
each step's control all_reduce, the one that also checks the loss is finite (the trainer's
`_control`), and leave after that step: if any rank was asked to requeue, every rank requeues
(`exit_code_for`). The handled signals are unblocked while the handlers are in place: one that
a launcher's inherited mask held back is taken then.
"""

from __future__ import annotations

import json
import os
import signal
import socket

from dspark_ds import distributed, logs

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"
INTERRUPT_EXIT_CODE = 130  # 128 + SIGINT

_REQUEUE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

EXIT_FILE_ENV = "DSPARK_EXIT_FILE"


def record_exit(code: int, reason: str, step: int) -> None:
    """Writes why the run stops to $DSPARK_EXIT_FILE (set by slurm/common.sh), when set: a
    launcher in between (torchrun exits 1 whatever its workers' codes) hides the exit code
    the batch script decides on."""
    path = os.environ.get(EXIT_FILE_ENV)
    if not path:
        return
    record = {"code": code, "reason": reason, "step": step, "host": socket.gethostname()}
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as err:
        logs.emit(f"[signals] cannot write {path}: {err}", 0)


class Signals:
    """Installs the handlers for the training loop (`install` / `restore`) and says what this
    rank was asked (`request`)."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self._was_blocked: set[int] = set()

    def install(self) -> None:
        handled = (*_REQUEUE_SIGNALS, signal.SIGINT)
        for sig in handled:
            self._previous[sig] = signal.signal(sig, self._handle)
        # NOTE: a launcher that leaves these blocked (the mask is inherited across exec) would
        # make the run deaf to pre-emption: unblocked here, one sent before is delivered now
        self._was_blocked = set(signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)) & set(handled)

    def restore(self) -> None:
        if self._was_blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, self._was_blocked)
            self._was_blocked = set()
        for sig, handler in self._previous.items():
            # NOTE: SIGINT stays at its default once the first Ctrl-C is handled
            if not (sig == signal.SIGINT and self.received == signal.SIGINT):
                signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        first = self.received is None
        if first:
            self.received = signum
        if signum == signal.SIGINT:
            # a second Ctrl-C is handled by the kernel: the process ends at once
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if first:
                logs.emit_from_signal_handler(
                    "[train] Ctrl-C: finishing this step and writing a checkpoint, then exit "
                    f"{INTERRUPT_EXIT_CODE}; press Ctrl-C again to stop at once without one",
                    distributed.rank_and_world()[0],
                )

    def request(self) -> int:
        """This rank's request: 0 go on, 1 stop (Ctrl-C), 2 requeue. The largest over the ranks
        decides (`exit_code_for`)."""
        if self.received in _REQUEUE_SIGNALS:
            return 2
        return 1 if self.received == signal.SIGINT else 0


def exit_code_for(request: int) -> int | None:
    """The exit code every rank leaves with for the ranks' largest `Signals.request` (75 if any
    rank was asked to requeue, else 130 if any got Ctrl-C), or None to go on."""
    return {0: None, 1: INTERRUPT_EXIT_CODE, 2: REQUEUE_EXIT_CODE}[int(request)]
