"""Sending a run of blobs while the next is made on a helper thread (transport/pipeline.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from emberlink.errors import TransportError
from emberlink.transport import memory, pipeline


def made(count: int, size: int, log: list[str] | None = None) -> Iterator[bytes]:
    for i in range(count):
        if log is not None:
            log.append(threading.current_thread().name)
        yield bytes([i % 256]) * size


@pytest.mark.parametrize("ahead", [False, True])
async def test_every_blob_arrives_whole_and_in_order(ahead: bool) -> None:
    a, b = memory.pair(capacity=64)
    sent: list[int] = []
    await pipeline.send_blobs(a, made(20, 1000), sent.append, ahead=ahead)
    assert sent == [1000] * 20
    assert [bytes(await b.recv()) for _ in range(20)] == list(made(20, 1000))


async def test_ahead_makes_the_first_blob_here_and_the_rest_on_a_helper() -> None:
    a, _b = memory.pair(capacity=64)
    where: list[str] = []
    await pipeline.send_blobs(a, made(5, 10, where), lambda n: None, ahead=True)
    assert where[0] == threading.current_thread().name
    assert all(name.startswith("emberlink-seal") for name in where[1:])


async def test_an_error_while_making_a_blob_reaches_the_sender_after_the_blobs_before_it() -> None:
    a, b = memory.pair(capacity=64)

    def broken() -> Iterator[bytes]:
        yield b"one"
        yield b"two"
        raise ValueError("sealing failed")

    with pytest.raises(ValueError, match="sealing failed"):
        await pipeline.send_blobs(a, broken(), lambda n: None, ahead=True)
    assert [await b.recv(), await b.recv()] == [b"one", b"two"]


async def test_a_failed_send_abandons_the_run_after_at_most_one_more_blob(
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = memory.pair(capacity=64)
    log: list[str] = []
    await b.close()
    await asyncio.sleep(0)
    with pytest.raises(TransportError):
        await pipeline.send_blobs(a, made(50, 10, log), lambda n: None, ahead=True)
    await asyncio.sleep(0.05)  # the blob being made finishes and is dropped quietly
    assert len(log) <= 2
    assert "never retrieved" not in caplog.text


def test_only_long_runs_on_machines_with_cores_to_spare_are_made_ahead() -> None:
    assert pipeline.worth_ahead(64 << 20, cpus=16)
    assert not pipeline.worth_ahead(64 << 20, cpus=2)
    assert not pipeline.worth_ahead(pipeline.AHEAD_BYTES - 1, cpus=16)
