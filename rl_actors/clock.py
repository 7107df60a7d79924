"""How long an actor worked: the driver's idle shares (``idle/generators``, ``idle/trainers``)."""
from __future__ import annotations

import time
from contextlib import contextmanager


class BusyClock:
    """Seconds spent inside ``working()`` blocks since the last ``read()``."""

    def __init__(self):
        self.seconds = 0.0

    @contextmanager
    def working(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0

    def read(self) -> float:
        """The seconds worked since the last read; the clock starts again at 0."""
        out, self.seconds = self.seconds, 0.0
        return out
