"""Helpers for the worker's tests: remote devices over in-process workers (`emberlink.testing`), and a
wire client: protocol/session.py's ClientConnection seals its batches, and a test may put bytes
a real client never would (forged tails, out-of-order seqs, garbage) on top of its channel; replies
are opened by the connection frame by frame (`open_reply`) without acting on them, so a test sees
exactly what the worker sent (acks, inline flags, GraphUnknown)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from emberlink import Device
from emberlink.client.remote import RemoteExecutor
from emberlink.errors import TransportError
from emberlink.protocol import messages as m
from emberlink.protocol.channel import BULK, CHUNK_SIZE, MESSAGE, Channel, pack_frames, split_frames
from emberlink.protocol.handshake import ClientHandshake
from emberlink.protocol.identity import Identity
from emberlink.protocol.session import ClientConnection
from emberlink.testing import InProcessWorker
from emberlink.transport.base import Link


class WireClient:
    """A session client for the worker's tests (runs on the worker's loop): valid batches go
    through a ClientConnection (without step templates, so each goes as given); a batch out of
    seq order or with a forged inline tail is sealed by hand on the same channel."""

    def __init__(self, link: Link, channel: Channel, resume_secret: bytes = b"") -> None:
        self.link = link
        self.conn = ClientConnection(channel, CHUNK_SIZE, {}, _nobody, templates=False)
        self.resume_secret = resume_secret  # what a resume of this session proves it holds

    @property
    def channel(self) -> Channel:
        return self.conn.channel

    @classmethod
    async def connect(cls, worker: InProcessWorker, identity: Identity | None = None) -> WireClient:
        """A session as `identity`, default a new client the worker admits."""
        link = await worker.open_link()
        who = identity if identity is not None else worker.new_client()
        hs = ClientHandshake(who, worker.node_id, os.urandom)
        await link.send(hs.hello())
        auth, channel, _ = hs.receive_welcome(bytes(await link.recv()))
        await link.send(auth)
        return cls(link, channel, hs.resume_secret)

    async def send(
        self,
        seq: int,
        messages: Sequence[m.ClientMessage],
        bulks: Sequence[np.ndarray] = (),
        tail: bytes = b"",
    ) -> None:
        """One batch: its MESSAGE frame (plaintext: the msgpack batch, then `tail`, the inline
        uploads' bytes), then `bulks` in BULK frames, packed into blobs as a client packs them.
        The connection seals it when it is the next batch in order and carries no forged tail."""
        arrays = [np.array(a, order="C") for a in bulks]
        frames: Iterable[bytes | bytearray]
        if seq == self.conn.submitted + 1 and not tail:
            self.conn.submit(list(messages), arrays, sum(a.nbytes for a in arrays))
            frames = self.conn.next_frames() or ()
        else:
            frames = [self.channel.seal(m.encode_batch(m.Batch(seq, tuple(messages))) + tail, MESSAGE)]
            for array in arrays:
                frames.extend(self.channel.seal_chunks(array.data.cast("B")))
        for blob in pack_frames(frames):
            await self.link.send(blob)

    async def reply(self) -> tuple[m.Reply, list[np.ndarray]]:
        """The next Reply and the arrays of its Results (in message order)."""
        frames = split_frames(await self.link.recv())
        reply, plain, start = self.conn.open_reply(frames[0])
        arrays: list[np.ndarray] = []
        rest = list(frames[1:])
        for msg in reply.messages:
            if type(msg) is m.Result and msg.inline:  # its bytes follow the reply in the same frame
                out = np.empty(msg.shape, msg.dtype)
                out.data.cast("B")[:] = plain[start : start + msg.nbytes]
                start += msg.nbytes
                arrays.append(out)
            elif type(msg) is m.Result:
                out = np.empty(msg.shape, msg.dtype)
                view = out.data.cast("B") if msg.nbytes else None
                remaining = msg.nbytes
                while remaining:
                    if not rest:
                        rest = list(split_frames(await self.link.recv()))
                    frame = rest.pop(0)
                    assert frame[1] == BULK
                    remaining -= self.channel.open_bulk(frame, view, remaining, "result")
                arrays.append(out)
        return reply, arrays

    async def reply_until(self, ack: int) -> list[m.WorkerMessage]:
        """Every message received until the worker acknowledges batch `ack`."""
        got: list[m.WorkerMessage] = []
        while True:
            reply, _ = await self.reply()
            got.extend(reply.messages)
            if reply.ack >= ack:
                return got

    async def ended(self) -> bool:
        """Whether the worker closed the link (reading what is left first)."""
        try:
            while True:
                await self.link.recv()
        except TransportError:
            return True

    async def close(self) -> None:
        await self.link.close()


def _nobody(msg: m.Result) -> tuple[None, None]:
    """Replies are opened one by one here (`WireClient.reply`), never acted on by the connection."""
    raise AssertionError("WireClient reads its replies itself")


def new_identity() -> Identity:
    return Identity.generate(os.urandom)


def memory_device(worker: InProcessWorker, identity: Identity | None = None) -> Device:
    """A remote Device over the worker's memory endpoint, as `identity` (default a new admitted client)."""
    return worker.device(identity=identity if identity is not None else worker.new_client())


def grpc_device(worker: InProcessWorker, identity: Identity | None = None) -> Device:
    """The same over gRPC on loopback."""
    return worker.device(identity=identity if identity is not None else worker.new_client(), transport="grpc")


def executor_of(dev: Device) -> RemoteExecutor:
    executor = dev._executor
    assert isinstance(executor, RemoteExecutor)
    return executor


def worker_stats(dev: Device) -> dict[str, Any]:
    return executor_of(dev).worker_stats()
