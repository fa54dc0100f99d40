"""The progress bar both sweep drivers show."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

__all__ = ["progress_bar"]


@contextlib.contextmanager
def progress_bar(show: bool | None, total: int, *, desc: str, unit: str,
                 done: int = 0) -> Iterator[Callable[[], None]]:
    """Yield a function that advances a tqdm bar on stderr by one step; a no-op when not shown.

    Args:
      show: show the bar; None shows it when stderr is a terminal.
      total: number of steps.
      desc: label before the bar.
      unit: what one step is called.
      done: steps already done when the bar starts.
    """
    if not (sys.stderr.isatty() if show is None else show):
        yield lambda: None
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=done, desc=desc, unit=unit, file=sys.stderr)
    try:
        yield lambda: bar.update(1)
    finally:
        bar.close()
