"""Inline uploads and step templates (Repeat) of the session protocol (docs/internals.md section 6)."""

from __future__ import annotations

import itertools
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import numpy as np
import pytest

import emberlink as el
from emberlink.protocol import messages as m
from emberlink.protocol.channel import OVERHEAD
from emberlink.testing import InProcessWorker

from .server_harness import WireClient, executor_of, memory_device, worker_stats

T = TypeVar("T")


def run(worker: InProcessWorker, coro: Coroutine[Any, Any, T]) -> T:
    return worker.call(coro, 20)


def train(dev: el.Device, steps: int, optimizer: type, lr: float, seed: int) -> tuple[list[float], list[int]]:
    """A small MLP trained on fresh data each step: every step's loss, and the bytes the client sent
    for it besides the data's own."""
    nn = el.nn
    model = nn.Sequential(nn.Linear(20, 32, seed=0), nn.ReLU(), nn.Linear(32, 5, seed=1)).to(dev)
    opt = optimizer(model.parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    losses, sent = [], []
    for _ in range(steps):
        x = rng.standard_normal((64, 20), dtype=np.float32)
        y = rng.integers(0, 5, 64)
        before = dev.stats()["bytes_sent"]
        loss = nn.functional.cross_entropy(model(dev.tensor(x)), dev.tensor(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        sent.append(int(dev.stats()["bytes_sent"]) - int(before) - x.nbytes - y.nbytes)
    return losses, sent


def adam_losses(dev: el.Device, steps: int) -> list[float]:
    """Adam: its bindings change every step."""
    return train(dev, steps, el.optim.Adam, 1e-2, 0)[0]


def sgd_step_bytes(dev: el.Device, steps: int) -> tuple[list[float], list[int]]:
    return train(dev, steps, el.optim.SGD, 0.1, 1)


def test_inline_uploads_round_trip_and_land_exactly(worker: InProcessWorker) -> None:
    rng = np.random.default_rng(3)
    arrays = [
        rng.standard_normal((7, 3)).astype(np.float32),
        np.array(True),
        rng.integers(-5, 5, (4, 0, 2)).astype(np.int32),
        rng.standard_normal(33).astype(np.float16),
        rng.integers(0, 2**40, 5).astype(np.int64),
        np.arange(12.0).reshape(3, 4).T,  # not contiguous
        rng.standard_normal(300_000),  # 2.4 MB: larger than a chunk, goes in BULK frames
    ]
    with memory_device(worker) as dev:
        tensors = [dev.tensor(a) for a in arrays]
        for a, t in zip(arrays, tensors, strict=True):
            got = t.numpy()
            assert got.dtype == a.dtype and got.shape == a.shape
            np.testing.assert_array_equal(got, a)
        np.testing.assert_array_equal((tensors[0] * 2.0).numpy(), arrays[0] * 2)  # a stored view computes


def test_small_uploads_travel_inside_the_message_frame(worker: InProcessWorker) -> None:
    x = np.arange(1000, dtype=np.float32)
    with memory_device(worker) as dev:
        dev.sync()
        before = dev.stats()["bytes_sent"]
        t = dev.tensor(x)
        np.testing.assert_array_equal(t.numpy(), x)
        sent = int(dev.stats()["bytes_sent"]) - int(before)
    # One frame (Upload, Read, the 4,000 bytes) rather than a MESSAGE and a BULK frame.
    assert sent < x.nbytes + 2 * OVERHEAD, sent


def test_inline_upload_whose_tail_does_not_match_is_refused(worker: InProcessWorker) -> None:
    x = np.arange(4, dtype=np.float32)

    async def go(tail: bytes) -> list[m.WorkerMessage]:
        c = await WireClient.connect(worker)
        await c.send(1, [m.Upload(1, "float32", (4,), 16, True), m.Sync(1)], tail=tail)
        got = list((await c.reply())[0].messages)
        assert await c.ended()
        return got

    for tail in (x.tobytes()[:-1], x.tobytes() + b"\x00"):
        (error,) = run(worker, go(tail))
        assert type(error) is m.Error and error.rid == 0 and error.code == "refused"


def test_raw_inline_and_bulk_uploads_in_one_batch_land_exactly(worker: InProcessWorker) -> None:
    a, b, c_ = np.arange(3, dtype=np.float32), np.arange(5, dtype=np.int64), np.ones(2, np.float64)

    async def go() -> list[np.ndarray]:
        c = await WireClient.connect(worker)
        await c.send(
            1,
            [
                m.Upload(1, "float32", (3,), 12, True),
                m.Upload(2, "int64", (5,), 40),
                m.Upload(3, "float64", (2,), 16, True),
                m.Read(1, 1),
                m.Read(2, 2),
                m.Read(3, 3),
            ],
            [b],
            tail=a.tobytes() + c_.tobytes(),
        )
        _, arrays = await c.reply()
        await c.close()
        return arrays

    got = run(worker, go())
    for want, have in zip([a, b, c_], got, strict=True):
        np.testing.assert_array_equal(have, want)


def test_repeated_steps_are_sent_as_repeats_and_match_the_local_cpu(worker: InProcessWorker) -> None:
    with el.Device.cpu() as cpu:
        expected, _ = sgd_step_bytes(cpu, 12)
    with memory_device(worker) as dev:
        got, sent = sgd_step_bytes(dev, 12)
        stats = dev.stats()
    assert got == expected
    assert stats["batches_repeated"] >= 9
    assert max(sent[3:]) <= OVERHEAD + 16, sent  # one frame: seq and a Repeat of two small shifts


def test_repeats_with_changing_bindings_match_the_local_cpu(worker: InProcessWorker) -> None:
    with el.Device.cpu() as cpu:
        expected = adam_losses(cpu, 10)
    with memory_device(worker) as dev:
        got = adam_losses(dev, 10)
        stats = dev.stats()
    assert got == expected
    assert stats["batches_repeated"] >= 7


def test_graph_unknown_in_the_middle_of_repeated_steps_keeps_the_losses(make_worker) -> None:
    worker = make_worker(graph_cache_bytes=64)  # smaller than one graph: every replay misses
    with el.Device.cpu() as cpu:
        expected = adam_losses(cpu, 8)
        expected_sgd, _ = sgd_step_bytes(cpu, 8)
    with memory_device(worker) as dev:
        got = adam_losses(dev, 8)
        got_sgd, _ = sgd_step_bytes(dev, 8)
        stats = dev.stats()
    assert got == expected and got_sgd == expected_sgd
    assert stats["graph_cache_misses"] >= 3 and stats["batches_resent"] >= 3


def test_repeat_without_a_template_ends_only_that_session(worker: InProcessWorker) -> None:
    bystander = memory_device(worker)
    x = bystander.tensor(np.arange(3, dtype=np.float32))

    async def go() -> list[m.WorkerMessage]:
        c = await WireClient.connect(worker)
        await c.send(1, [m.Repeat(1, 1)])
        got = list((await c.reply())[0].messages)
        assert await c.ended()
        return got

    (error,) = run(worker, go())
    assert type(error) is m.Error and error.rid == 0 and error.code == "refused"
    assert "repeats" in error.message
    np.testing.assert_array_equal((x + 1.0).numpy(), np.arange(3) + 1)
    assert worker_stats(bystander)["sessions_open"] == 1
    bystander.close()


@pytest.mark.parametrize(
    "repeat",
    [
        m.Repeat(-10, 1),  # takes ids below 0
        m.Repeat(1, -5),  # takes a rid to 0 or below
        m.Repeat(1, 1, ((1.0,), (2.0,))),  # bindings for two Executes, the batch has none
        m.Repeat(1, 1, None, ((2, 7),)),  # patches a third tensor id, the batch names two
        m.Repeat(1, 1, None, ((0, 1), (5, 1))),  # one patch fits, the next one does not
    ],
)
def test_repeat_that_does_not_fit_its_template_is_refused(worker: InProcessWorker, repeat: m.Repeat) -> None:
    async def go() -> list[m.WorkerMessage]:
        c = await WireClient.connect(worker)
        await c.send(1, [m.Upload(3, "float32", (0,), 0), m.Read(2, 3)])
        await c.reply_until(1)
        await c.send(2, [repeat])
        got = list((await c.reply())[0].messages)
        assert await c.ended()
        return got

    error = run(worker, go())[-1]
    assert type(error) is m.Error and error.rid == 0 and error.code == "refused"


def test_repeat_applies_the_previous_batch_shifted(worker: InProcessWorker) -> None:
    x = np.arange(4, dtype=np.float32)

    async def go() -> tuple[m.Reply, list[np.ndarray]]:
        c = await WireClient.connect(worker)
        await c.send(1, [m.Upload(1, "float32", (4,), 16, True), m.Read(1, 1)], tail=x.tobytes())
        await c.reply_until(1)
        await c.send(2, [m.Repeat(5, 10)], tail=(x + 1).tobytes())
        reply = await c.reply()
        await c.close()
        return reply

    reply, (array,) = run(worker, go())
    (result,) = reply.messages
    assert result == m.Result(11, "float32", (4,), 16, True)
    np.testing.assert_array_equal(array, x + 1)


def test_no_repeats_when_replay_is_off(worker: InProcessWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBERLINK_REPLAY", "0")
    with memory_device(worker) as dev:
        sgd_step_bytes(dev, 4)
        assert executor_of(dev).replay is False
        assert dev.stats()["batches_repeated"] == 0


def jit_losses(dev: el.Device, feed: str, steps: int, measured: int) -> tuple[list[float], int]:
    """A jitted small-MLP SGD step over four batches cycled: gathered by a resident DataLoader
    (an epoch every four steps; the data set's ids stay while the others shift) or uploaded once
    beforehand (the batch's ids cycle while the parameters' shift). Every step's loss, and how
    many of the last `measured` steps' batches went as Repeats (remote devices only)."""
    nn = el.nn
    rng = np.random.default_rng(4)
    xs = rng.standard_normal((64, 20), dtype=np.float32)
    ys = rng.integers(0, 5, 64)
    model = nn.Sequential(nn.Linear(20, 32, seed=0), nn.ReLU(), nn.Linear(32, 5, seed=1)).to(dev)
    opt = el.optim.SGD(model.parameters(), lr=0.1)

    @el.jit
    def step(x: el.Tensor, y: el.Tensor) -> el.Tensor:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    batches: Iterator[Any]
    if feed == "loader":
        loader = el.data.DataLoader((xs, ys), batch_size=16, device=dev, resident=True)
        batches = itertools.chain.from_iterable(itertools.repeat(loader))
    else:
        uploaded = [(dev.tensor(xs[k : k + 16]), dev.tensor(ys[k : k + 16])) for k in range(0, 64, 16)]
        batches = itertools.cycle(uploaded)
    losses = [float(step(*next(batches))) for _ in range(steps - measured)]
    before = dev.stats().get("batches_repeated", 0)
    losses += [float(step(*next(batches))) for _ in range(measured)]
    return losses, int(dev.stats().get("batches_repeated", 0)) - int(before)


@pytest.mark.parametrize("feed", ["loader", "uploaded"])
def test_steps_whose_batches_keep_or_cycle_ids_go_as_repeats_and_match_the_local_cpu(
    worker: InProcessWorker, feed: str
) -> None:
    with el.Device.cpu() as cpu:
        expected, _ = jit_losses(cpu, feed, 16, 8)
    with memory_device(worker) as dev:
        got, repeated = jit_losses(dev, feed, 16, 8)
    assert got == expected
    assert repeated == 8  # two epochs of four steps: every batch a Repeat, an epoch's first too
