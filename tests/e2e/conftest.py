"""Fixtures for end-to-end tests: real `emberlink worker` processes started with the CLI on port 0."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .e2e_harness import Keys, WorkerProcess, subprocess_env


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(tmp_path)


@pytest.fixture
def start_worker(tmp_path: Path, keys: Keys) -> Iterator[Callable[..., WorkerProcess]]:
    """`start_worker(*extra_args)`: a worker process on 127.0.0.1:0 admitting `keys.client`."""
    started: list[WorkerProcess] = []

    def start(*extra: str) -> WorkerProcess:
        log = tmp_path / f"worker-{len(started)}.log"
        args = ["--listen", "127.0.0.1:0", "--key", str(keys.worker_key), "--allow", str(keys.allow), *extra]
        worker = WorkerProcess(args, subprocess_env(), log)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()
