"""Progress for waits of more than a moment: `waiting(what)` says what started at once and then,
every few seconds until it ends, how long it has run, on stderr, whether or not it is a terminal
(a log line each time, for a server's log or a pipe), so no wait of over ~2 s is silent. Where a
progress bar covers a wait (on a terminal) it says the same as the bar would not."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from contextlib import contextmanager

EVERY_S = 2.0  # between the lines while it runs


@contextmanager
def waiting(what: str, every: float = EVERY_S, out=None):
    out = out or sys.stderr
    started = time.monotonic()
    done = threading.Event()

    def say(text: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # (a closed stream: no one to tell)
            print(text, file=out, flush=True)

    def tick() -> None:
        while not done.wait(every):
            say(f"{what}: {time.monotonic() - started:.0f} s so far")

    say(f"{what}...")
    thread = threading.Thread(target=tick, daemon=True, name="ft-progress")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        seconds = time.monotonic() - started
        if seconds >= every:
            say(f"{what}: done in {seconds:.1f} s")
