"""A dependency-free progress bar over the benchmark grid, on stderr.

On a terminal it redraws one line; elsewhere (a log, the device machine's captured output) it prints one line
per finished case, so that the log shows where a long run got to.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True, width: int = 30):
        self.total, self.done, self.width, self.enabled = total, 0, width, enabled
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self.tty = self.stream.isatty()

    def advance(self, label: str, outcome: str) -> None:
        """Count one finished case, described by ``label`` and its ``outcome``."""
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        filled = int(self.width * self.done / max(self.total, 1))
        bar = "#" * filled + "-" * (self.width - filled)
        line = f"[{bar}] {self.done}/{self.total} {elapsed:6.0f}s  {label}: {outcome}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:200])
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
