"""Fixtures for the worker's tests: in-process workers, each a real Worker with real listeners."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from emberlink.server.background import BackgroundWorker


@pytest.fixture
def make_worker() -> Iterator[Callable[..., BackgroundWorker]]:
    """`make_worker(**worker_options)`: a worker on the I/O loop, with memory and gRPC listeners."""
    made: list[BackgroundWorker] = []

    def make(**options: Any) -> BackgroundWorker:
        worker = BackgroundWorker(memory=True, grpc=True, **options)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.stop()


@pytest.fixture
def worker(make_worker: Callable[..., BackgroundWorker]) -> BackgroundWorker:
    return make_worker()
