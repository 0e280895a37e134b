"""Helpers for end-to-end tests: `emberlink worker` processes and the keys they use."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from emberlink.protocol.identity import Identity


class WorkerProcess:
    """An `emberlink worker` subprocess; its ticket is the first line of its stdout."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._log_file = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "emberlink", "worker", *args],
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        self.ticket = self._first_line(timeout=30)

    def _first_line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        line: list[bytes] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        if not line or not line[0]:
            self.kill()
            raise RuntimeError(f"worker printed no ticket; its log:\n{self.log.read_text()}")
        return line[0].decode().strip()

    def stderr(self) -> str:
        self._log_file.flush()
        return self.log.read_text()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log_file.close()


class Keys:
    """A worker key, an allowed client key and an allow file in a temporary folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.worker = Identity.generate(os.urandom)
        self.worker_key = folder / "worker.key"
        self.worker.save(self.worker_key)
        self.client = Identity.generate(os.urandom)
        self.client_key = folder / "client.key"
        self.client.save(self.client_key)
        self.allow = folder / "allow"
        self.allow.write_text(f"# test client\n{self.client.node_id}\n\n")

    def stranger_key(self) -> tuple[Identity, Path]:
        identity = Identity.generate(os.urandom)
        path = self.folder / f"stranger-{identity.node_id[:8]}.key"
        identity.save(path)
        return identity, path


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env
