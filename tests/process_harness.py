"""A subprocess for tests (the e2e and relay suites): stdout read line by line on a thread,
stderr kept in a log file that failures quote."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path


class Process:
    """A subprocess whose stdout lines are read by a thread into a queue; stderr goes to a log file."""

    def __init__(
        self, argv: list[str], log: Path, *, stdin: bool = False, env: dict[str, str] | None = None
    ) -> None:
        self.log = log
        self._log_file = log.open("wb")
        env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            env=env,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode().rstrip("\n"))
        self.lines.put(None)

    def next_line(self, timeout: float) -> str:
        """The next stdout line; fails the test with the log if none comes in time or the process ended."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output within {timeout} s; log:\n{self.stderr()}") from None
        if line is None:
            self.lines.put(None)
            raise AssertionError(f"process ended (rc={self.proc.wait()}); log:\n{self.stderr()}")
        return line

    def expect(self, prefix: str, timeout: float) -> str:
        """Skip lines until one starts with `prefix`; return it."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.next_line(max(deadline - time.monotonic(), 0.01))
            if line.startswith(prefix):
                return line

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def stderr(self) -> str:
        self._log_file.flush()
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reader.join(5)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._log_file.close()
