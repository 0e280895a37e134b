"""The worker hands the heap's freed pages back after sessions end (server/worker.py, `_trim_soon`),
including those of a session that ends while a trim is already running."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable

import pytest

from emberlink.protocol.identity import AllowPolicy, Identity
from emberlink.server import worker as worker_module
from emberlink.server.worker import Worker


def trims_after(monkeypatch: pytest.MonkeyPatch, ends: Callable[[Worker, threading.Event], object]) -> int:
    """How many trims run when sessions end as `ends` says (given the worker and an event set once
    the first trim has begun; that trim runs until `ends` returns)."""
    began, go_on = threading.Event(), threading.Event()
    calls: list[int] = []

    def release_free_memory() -> bool:
        calls.append(1)
        began.set()
        go_on.wait(10)
        return True

    monkeypatch.setattr(worker_module, "TRIM_DELAY", 0.01)

    async def run() -> None:
        worker = Worker(Identity.generate(os.urandom), AllowPolicy.allow_any())
        worker._release_free_memory = release_free_memory  # this worker's trims only
        try:
            result = ends(worker, began)
            if asyncio.iscoroutine(result):
                await result
            go_on.set()
            for _ in range(500):  # until no trim is scheduled or running
                await asyncio.sleep(0.01)
                if worker._trim is None:
                    break
        finally:
            go_on.set()
            worker.close()

    asyncio.run(run())
    return len(calls)


def test_sessions_that_end_before_the_trim_starts_share_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def ends(worker: Worker, began: threading.Event) -> None:
        for _ in range(3):
            worker._trim_soon()

    assert trims_after(monkeypatch, ends) == 1


def test_a_session_that_ends_while_a_trim_runs_gets_a_trim_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    async def ends(worker: Worker, began: threading.Event) -> None:
        worker._trim_soon()
        assert await asyncio.to_thread(began.wait, 10)
        worker._trim_soon()  # its pages were freed after the running trim read the heap

    assert trims_after(monkeypatch, ends) == 2
