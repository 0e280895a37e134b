"""Helpers for the worker's tests: remote devices over in-process workers (`emberlink.testing`), and a
raw session client that speaks the session protocol frame by frame, so tests can send what a real
client never would (forged registers, garbage, out-of-order batches)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from emberlink import Device
from emberlink.client.remote import RemoteExecutor
from emberlink.errors import TransportError
from emberlink.protocol import messages as m
from emberlink.protocol.channel import BULK, MESSAGE, Channel, pack_frames, split_frames
from emberlink.protocol.handshake import ClientHandshake
from emberlink.protocol.identity import Identity
from emberlink.testing import InProcessWorker
from emberlink.transport.base import Link


class RawClient:
    """A client that builds and reads frames itself (runs on the worker's loop)."""

    def __init__(self, link: Link, channel: Channel) -> None:
        self.link = link
        self.channel = channel

    @classmethod
    async def connect(cls, worker: InProcessWorker, identity: Identity | None = None) -> RawClient:
        """A session as `identity`, default a new client the worker admits."""
        link = await worker.open_link()
        who = identity if identity is not None else worker.new_client()
        hs = ClientHandshake(who, worker.node_id, os.urandom)
        await link.send(hs.hello())
        auth, channel, _ = hs.receive_welcome(bytes(await link.recv()))
        await link.send(auth)
        return cls(link, channel)

    async def send(
        self,
        seq: int,
        messages: Sequence[m.ClientMessage],
        bulks: Sequence[np.ndarray] = (),
        tail: bytes = b"",
    ) -> None:
        """One batch: its MESSAGE frame (plaintext: the msgpack batch, then `tail`, the inline
        uploads' bytes), then `bulks` in BULK frames, packed into blobs as a client packs them."""
        frames: list[bytes | bytearray] = [
            self.channel.seal(m.encode_batch(m.Batch(seq, tuple(messages))) + tail, MESSAGE)
        ]
        for array in bulks:
            frames.extend(self.channel.seal_chunks(np.array(array, order="C").data.cast("B")))
        for blob in pack_frames(frames):
            await self.link.send(blob)

    async def reply(self) -> tuple[m.Reply, list[np.ndarray]]:
        """The next Reply and the arrays of its Results (in message order)."""
        frames = split_frames(await self.link.recv())
        kind, plain = self.channel.open(frames[0])
        assert kind is MESSAGE
        reply, start = m.decode_reply_prefix(plain)
        m.check_reply_tail(reply, len(plain) - start)
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
                view = out.data.cast("B") if msg.nbytes else memoryview(b"")
                done = 0
                while done < msg.nbytes:
                    if not rest:
                        rest = list(split_frames(await self.link.recv()))
                    kind, n = self.channel.open_into(rest.pop(0), view[done:])
                    assert kind is BULK
                    done += n
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
