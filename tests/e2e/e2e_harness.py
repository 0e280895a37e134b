"""Helpers for end-to-end tests: `emberlink worker` processes and the keys they use."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from emberlink.protocol.identity import Identity

from ..process_harness import Process


class WorkerProcess(Process):
    """An `emberlink worker` subprocess; its ticket is the first line of its stdout."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        super().__init__([sys.executable, "-m", "emberlink", "worker", *args], log, env=env)
        try:
            self.ticket = self.next_line(30)
        except BaseException:
            self.close()
            raise


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
