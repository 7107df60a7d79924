"""How long an actor worked: the driver's idle shares (``idle/generators``, ``idle/trainers``)."""
from __future__ import annotations

import time
from contextlib import contextmanager


class BusyClock:
    """Seconds spent inside ``working()`` blocks since the last ``read()``; with ``also``, the
    same seconds count on that clock too (a generator hosted in a trainer's process keeps the
    process busy)."""

    def __init__(self, also: "BusyClock | None" = None):
        self.seconds, self.also = 0.0, also

    @contextmanager
    def working(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - t0
            self.seconds += seconds
            if self.also is not None:
                self.also.seconds += seconds

    def read(self) -> float:
        """The seconds worked since the last read; the clock starts again at 0."""
        out, self.seconds = self.seconds, 0.0
        return out
