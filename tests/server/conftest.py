"""Fixtures for the worker's tests: a fresh in-process worker per test (`emberlink.testing`), since
these tests look at the worker's own state (its sessions, its memory, draining it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import emberlink.testing
from emberlink.testing import InProcessWorker


@pytest.fixture
def make_worker() -> Iterator[Callable[..., InProcessWorker]]:
    """`make_worker(**worker_options)`: a worker with memory and gRPC listeners, stopped after the test."""
    made: list[InProcessWorker] = []

    def make(**options: Any) -> InProcessWorker:
        worker = emberlink.testing.worker(grpc=True, **options)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.stop()


@pytest.fixture
def worker(make_worker: Callable[..., InProcessWorker]) -> InProcessWorker:
    return make_worker()
