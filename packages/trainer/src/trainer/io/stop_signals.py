"""Stopping a run cleanly on SIGTERM or Ctrl-C: the loop finishes its step, saves
and stops."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
from collections.abc import Iterator


@dataclasses.dataclass
class StopFlag:
    requested: bool = False
    signal_name: str = ""


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """While inside, SIGTERM and a first Ctrl-C (SIGINT) set a flag: the loop
    finishes its step, saves and stops, instead of dying mid-step. A second
    Ctrl-C aborts at once (KeyboardInterrupt), as usual."""
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if signum == signal.SIGINT and flag.requested:
            raise KeyboardInterrupt
        flag.requested, flag.signal_name = True, signal.Signals(signum).name
        if signum == signal.SIGINT:
            print(
                "\nCtrl-C: stopping after this step (again to abort)", file=sys.stderr, flush=True
            )

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for sig, old_handler in previous.items():
            signal.signal(sig, old_handler)
