"""Host batches over the raw TCP transport travel pipelined (client/session.py, `Pipelined`): in
BULK frames of the link's `pipeline_chunk`, each its own blob. Values, a cut in the middle, flow
control with many in flight, and the transports that keep the worker's chunks."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np
import pytest

import emberlink as el
import emberlink.testing
from emberlink.client.session import PIPELINE_ENV
from emberlink.errors import ConfigError, WorkerLost
from emberlink.protocol.channel import OVERHEAD
from emberlink.protocol.limits import MAX_UNACKED_BATCHES
from emberlink.protocol.session import PIPELINE_BATCH_BYTES
from emberlink.transport.tcp import PIPELINE_CHUNK, TcpLink

from .test_owned_link import proxied_tcp_device


class Blobs:
    """The sizes of the blobs a TcpLink writes (from a user thread or from the loop)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        self.lock = threading.Lock()
        for name in ("write_direct", "send_nowait", "send"):
            inner = getattr(TcpLink, name)
            monkeypatch.setattr(TcpLink, name, self._counting(inner))

    def _counting(self, inner: Any) -> Any:
        def counted(link: TcpLink, blob: Any) -> Any:
            with self.lock:
                self.sizes.append(len(blob))
            return inner(link, blob)

        return counted


SIZES = [PIPELINE_CHUNK - 1, PIPELINE_CHUNK, PIPELINE_CHUNK + 1, 128 * 784 * 4, PIPELINE_BATCH_BYTES + 1]


def test_uploads_around_the_pipeline_chunk_arrive_intact_and_go_in_chunks_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blobs = Blobs(monkeypatch)
    total = el.jit(lambda t: t.astype("float32").sum())
    with emberlink.testing.worker(tcp=True) as w, w.device(transport="tcp") as dev:
        for step in range(3):
            for n in SIZES:
                x = (np.arange(n) * 7 + step).astype(np.uint8)
                dev.tensor(np.full(PIPELINE_CHUNK * 2, step, np.uint8))  # a tensor never used
                t = dev.tensor(x)
                assert float(total(t)) == float(x.astype(np.float32).sum())
                np.testing.assert_array_equal(t.numpy(), x)
    # The host batches went in chunks of the pipeline size, each its own blob (sealed: + OVERHEAD).
    assert blobs.sizes.count(PIPELINE_CHUNK + OVERHEAD) > 3 * len(SIZES)


def test_each_pipelined_frame_is_written_before_the_next_is_sealed(monkeypatch: pytest.MonkeyPatch) -> None:
    # The overlap: the worker opens chunk i while this side seals chunk i+1, so chunk i must be on
    # the wire before chunk i+1 is sealed (packing frames would seal one ahead).
    sealed_before_write: list[int] = []
    total = el.jit(lambda t: t.sum())
    with emberlink.testing.worker(tcp=True) as w, w.device(transport="tcp") as dev:
        channel = dev._executor._session._conn.channel  # type: ignore[attr-defined]
        inner = TcpLink.write_direct

        def write_direct(link: TcpLink, blob: Any) -> bool:
            sealed_before_write.append(channel._send.counter)
            return inner(link, blob)

        monkeypatch.setattr(TcpLink, "write_direct", write_direct)
        for i in range(4):
            x = np.full((128, 784), i, np.float32)
            assert float(total(dev.tensor(x))) == 128 * 784 * i
    # Blob k of the session's writes from the reading thread goes when exactly its own frame has
    # been sealed since the one before: the counters seen grow by one per write.
    steps = [b - a for a, b in itertools.pairwise(sealed_before_write)]
    assert len(sealed_before_write) >= 2 * (128 * 784 * 4 // PIPELINE_CHUNK + 2)
    assert set(steps) == {1}


def test_a_link_cut_in_the_middle_of_a_pipelined_upload_is_resumed_with_every_value_right(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    total = el.jit(lambda t: t.sum())
    cut_at = {3, 40}  # the chunks (counted over the whole run) after which the link is cut
    chunks = 0
    with emberlink.testing.worker(tcp=True) as w, proxied_tcp_device(w) as (dev, proxy):
        inner = TcpLink.write_direct

        def write_direct(link: TcpLink, blob: Any) -> bool:
            nonlocal chunks
            sent = inner(link, blob)
            if len(blob) == PIPELINE_CHUNK + OVERHEAD:
                chunks += 1
                if chunks in cut_at:
                    proxy.cut()
            return sent

        monkeypatch.setattr(TcpLink, "write_direct", write_direct)
        for i in range(12):
            x = np.full((128, 784), i, np.float32)
            assert float(total(dev.tensor(x))) == 128 * 784 * i
        assert dev.stats()["resumes"] == 2


def test_a_link_cut_in_the_middle_of_a_pipelined_upload_without_resume_fails_the_read_clearly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    total = el.jit(lambda t: t.sum())
    with emberlink.testing.worker(tcp=True) as w, proxied_tcp_device(w) as (dev, proxy):
        assert float(total(dev.tensor(np.ones((128, 784), np.float32)))) == 128 * 784
        dev._executor.set_resume_window(0)  # type: ignore[attr-defined]
        inner = TcpLink.write_direct

        def write_direct(link: TcpLink, blob: Any) -> bool:
            sent = inner(link, blob)
            if len(blob) == PIPELINE_CHUNK + OVERHEAD:
                proxy.cut()
            return sent

        monkeypatch.setattr(TcpLink, "write_direct", write_direct)
        with pytest.raises(WorkerLost):
            float(total(dev.tensor(np.ones((128, 784), np.float32))))


def test_more_pipelined_host_batches_in_flight_than_the_window_all_arrive_in_order() -> None:
    total = el.jit(lambda t: t.sum())
    with emberlink.testing.worker(tcp=True) as w, w.device(transport="tcp") as dev:
        assert float(total(dev.tensor(np.zeros((128, 784), np.float32)))) == 0.0  # parks the link
        n = MAX_UNACKED_BATCHES + 16  # more batches than may go unacknowledged: some wait for acks
        futures = [total(dev.tensor(np.full((128, 784), k, np.float32))).read_async() for k in range(n)]
        assert [float(f.result(timeout=60)) for f in futures] == [128 * 784 * k for k in range(n)]


def test_only_a_link_that_pipelines_gets_a_pipeline_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    with emberlink.testing.worker(grpc=True) as w:  # gRPC (and the relay, memory) keep the worker's
        for transport in ("grpc", "memory"):
            with w.device(transport=transport) as dev:
                assert dev._executor._session._conn.pipeline_chunk == 0  # type: ignore[attr-defined]
                x = np.arange(128 * 784, dtype=np.float32)
                np.testing.assert_array_equal(dev.tensor(x).numpy(), x)
    monkeypatch.setenv(PIPELINE_ENV, "0")
    with emberlink.testing.worker(tcp=True) as w, w.device(transport="tcp") as dev:
        assert dev._executor._session._conn.pipeline_chunk == 0  # type: ignore[attr-defined]
        x = np.arange(128 * 784, dtype=np.float32)
        np.testing.assert_array_equal(dev.tensor(x).numpy(), x)


@pytest.mark.parametrize("text", ["lots", "-1", "100", str(1 << 30)])
def test_a_bad_pipeline_chunk_setting_is_refused_saying_what_it_must_be(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv(PIPELINE_ENV, text)
    with emberlink.testing.worker(tcp=True) as w, pytest.raises(ConfigError, match=PIPELINE_ENV):
        w.device(transport="tcp")
