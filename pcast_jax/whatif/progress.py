"""Progress of the what-if analyses: a tqdm bar on a terminal, one line per step otherwise.

The analyses announce their steps (:func:`plan` adds to the number of steps, :func:`stage` starts
the next one); nothing is shown unless a caller turned reporting on with :func:`reporting` (the
``pcast whatif`` command does), so library calls stay silent. A caller that runs several analyses
knows their steps beforehand calls :func:`fix` first: the total is then fixed from the first line
(the analyses' own :func:`plan` calls are ignored) and each line says the time left.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
import time
from collections.abc import Iterator

__all__ = ["reporting", "plan", "fix", "stage"]

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("pcast_whatif_progress", default=None)


class _Reporter:
    def __init__(self, desc: str, bar: bool, stream):
        self.desc, self.stream = desc, stream
        self.fixed = False
        self.total = self.done = 0
        self.lock = threading.Lock()  # analyses may run in threads (whatif.report): one line at a time
        self.current: str | None = None
        self.t0 = time.perf_counter()
        self.bar = None
        if bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=0, desc=desc, unit="step", file=stream, leave=True)

    def plan(self, steps: int) -> None:
        if self.fixed:
            return
        self.total += steps
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def fix(self, steps: int) -> None:
        self.total, self.fixed = self.done + (self.current is not None) + steps, True
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def stage(self, label: str) -> None:
        with self.lock:
            self._stage(label)

    def _stage(self, label: str) -> None:
        self._finish_current()
        self.current = label
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=True)
        else:
            elapsed = time.perf_counter() - self.t0
            total = max(self.total, self.done + 1)
            left = ""
            if self.fixed and self.done:
                left = f", ~{elapsed / self.done * (total - self.done):.0f} s left"
            print(f"{self.desc}: [{self.done + 1}/{total}] {label} ({elapsed:.1f} s{left})",
                  file=self.stream, flush=True)

    def _finish_current(self) -> None:
        if self.current is not None:
            self.done += 1
            if self.bar is not None:
                self.bar.update(1)
            self.current = None

    def close(self) -> None:
        self._finish_current()
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def reporting(desc: str, *, show: bool | None = None, stream=None) -> Iterator[None]:
    """Show the steps of the analyses run inside: ``show`` None → a bar when ``stream`` (stderr) is a
    terminal, step lines otherwise; True → a bar; False → nothing."""
    stream = sys.stderr if stream is None else stream
    if show is False or _ACTIVE.get() is not None:
        yield
        return
    bar = stream.isatty() if show is None else bool(show)
    rep = _Reporter(desc, bar, stream)
    token = _ACTIVE.set(rep)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        rep.close()


def plan(steps: int) -> None:
    """Announce ``steps`` more steps (no-op unless reporting is on)."""
    rep = _ACTIVE.get()
    if rep is not None:
        rep.plan(int(steps))


def stage(label: str) -> None:
    """Start the next step, ``label`` (no-op unless reporting is on)."""
    rep = _ACTIVE.get()
    if rep is not None:
        rep.stage(label)


def fix(steps: int) -> None:
    """Fix the number of steps still to come at ``steps`` (no-op unless reporting is on): later
    :func:`plan` calls are ignored and each step line says the time left."""
    rep = _ACTIVE.get()
    if rep is not None:
        rep.fix(int(steps))


def steps_done() -> tuple[int, int] | None:
    """(steps started or finished, total) of the reporter now active, or None when reporting is off."""
    rep = _ACTIVE.get()
    if rep is None:
        return None
    return rep.done + (rep.current is not None), rep.total
