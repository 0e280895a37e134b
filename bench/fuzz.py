"""A real `emberlink worker` under hostile sessions, with an honest client checking results and latency.

    .venv/bin/python bench/fuzz.py [--sessions 4] [--seconds 20 | --frames N] [--stall] [--seed 0]
                                   [--rounds 1] [--warm-up 3] [--check-rss]

The worker runs as `emberlink worker` (default limits unless `--worker-arg` adds flags), in its
own process. N hostile sessions, each with an allowed key, run in this process over gRPC: they
build valid batches (uploads inline and in bulk, Registers of random graphs, Executes, Reads,
Drops, Syncs, Stats, Repeats, batches of thousands of messages) and send most of them mutated,
structurally (shapes, nbytes, dtypes, ids past the id space, unknown and forged graphs, Repeat
shifts and bindings, batch seq, BULK chunks reordered or in odd sizes) or byte by byte in the
plaintext before sealing. With `--stall` they also send the inputs that used to stall a worker
(issue 12): a sum over a broadcast to 2^33 elements, a 4096^2 float64 matmul, a 100,000-node
graph, 100,000 Syncs in one blob, and sessions holding 60 MiB each. A session that the worker
ends is replaced by a new one.

Meanwhile an honest client, in a process of its own, runs a small step at a steady pace and
checks every value. It runs alone first, then under the hostile load: the table compares the two.

Memory is measured three times, each while the honest client is idle and once every hostile
session has ended, through one probe session of the fuzzer's own: the baseline, after a warm-up
in which every hostile session sends each kind of batch and each stalling input once and after
the honest client's steps alone (so that what a worker keeps for good once it has served them
counts in it); after each of `--rounds`
hostile rounds (growth must stop); and at the end.

Outcomes of hostile batches, by class: `answered` (the reply came; per-request errors are counted
by code as `error:<code>`), `ended:<code>` (the worker ended the session with that error, then
closed the link), and the two that are bugs: `closed without an error` and `no answer` (neither
a reply nor an end within `--answer-timeout` seconds, after a probe batch).

The exit status is 1 when the worker crashed, any bug outcome occurred, the honest client saw a
wrong value or lost its session, a session was left open, or the worker's memory (its
`memory_stats()` in-use bytes, and RSS with `--check-rss`) did not come back within 5% of the
baseline taken before the hostile sessions started.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from emberlink.errors import EmberlinkError, ProtocolError, TransportError
from emberlink.graph_replay.canonical import encode_graph, graph_id
from emberlink.graph_replay.ir import Graph, Node, TensorSpec, binding_spec
from emberlink.graph_replay.ops import check_attrs, infer
from emberlink.protocol import messages as m
from emberlink.protocol.channel import BULK, CHUNK_SIZE, MESSAGE, pack_frames, split_frames
from emberlink.protocol.handshake import ClientHandshake
from emberlink.protocol.identity import Identity
from emberlink.protocol.limits import MAX_BATCH_MESSAGES
from emberlink.protocol.ticket import Ticket
from emberlink.transport import grpc as grpc_transport

MiB = 1 << 20
SETTLE_SECONDS = 1.0  # after the last hostile session ends, before memory is measured (TRIM_DELAY 0.5)
PROBE_AFTER = 1.0  # seconds without an answer before a probe batch follows (see Hostile.answer)
BUGS = ("closed without an error", "no answer")
DTYPES = ("float32", "float64", "int32", "int64", "uint8", "int8", "int16", "float16", "bool")


# -- graphs -------------------------------------------------------------------------------------------


class Builder:
    """Appends inferred nodes, so every graph the fuzzer builds is valid before it mutates it."""

    def __init__(self, inputs: list[TensorSpec], bindings: list[str]) -> None:
        self.inputs, self.bindings = inputs, bindings
        self.specs = [*inputs, *(binding_spec(k) for k in bindings)]
        self.nodes: list[Node] = []

    def add(self, op: str, *ins: int, **attrs: Any) -> int:
        node = Node(op, tuple(ins), check_attrs(op, attrs))
        self.specs.append(infer(op, [self.specs[v] for v in ins], node.attrs))
        self.nodes.append(node)
        return len(self.specs) - 1

    def body(self, outputs: list[int]) -> tuple[bytes, bytes, Graph]:
        graph = Graph(tuple(self.inputs), tuple(self.bindings), tuple(self.nodes), tuple(outputs))
        raw = encode_graph(graph)
        return graph_id(raw), raw, graph


def random_graph(rng: random.Random) -> tuple[bytes, bytes, Graph]:
    """A small valid graph over one float32 input and a float binding: elementwise ops, views,
    reductions, a matmul or a softmax."""
    n = rng.choice((1, 3, 16, 256, 4096))
    rows = rng.choice((1, 2, 4))
    g = Builder([TensorSpec("float32", (rows, n))], ["float"])
    v = 0
    for _ in range(rng.randint(1, 8)):
        op = rng.choice(
            ("add", "multiply", "exp", "negative", "relu", "tanh", "sum", "permute", "softmax", "matmul")
        )
        spec = g.specs[v]
        try:
            if op in ("add", "multiply"):
                v = g.add(op, v, 1)
            elif op in ("exp", "negative", "relu", "tanh"):
                v = g.add(op, v)
            elif op == "sum" and spec.ndim:
                v = g.add("sum", v, axis=-1, keepdims=True)
            elif op == "permute" and spec.ndim == 2:
                v = g.add("permute_dims", v, axes=(1, 0))
            elif op == "softmax" and spec.ndim:
                v = g.add("softmax", v, axis=-1)
            elif op == "matmul" and spec.ndim == 2:
                v = g.add("matmul", v, g.add("permute_dims", v, axes=(1, 0)))
        except EmberlinkError:
            continue
    return g.body([v])


STALLS = ("broadcast", "matmul", "nodes", "syncs", "hold")
"""The issue's stalling inputs (`--stall` sends them all, `--stall=nodes,syncs` some): a sum over
a broadcast to 2^33 elements, a 4096^2 float64 matmul, a 100,000-node graph, 100,000 Syncs in one
blob, 60 MiB held by each session."""


def stalling_graphs(names: tuple[str, ...]) -> list[tuple[str, bytes, bytes, int]]:
    """The stalling inputs among `names` as (name, gid, body, inputs); the graphs must be refused
    by a limit, the others bounded."""
    out: list[tuple[str, bytes, bytes, int]] = []
    if "broadcast" in names:
        g = Builder([TensorSpec("float32", (1,))], [])
        gid, body, _ = g.body([g.add("sum", g.add("broadcast_to", 0, shape=(1 << 33,)))])
        out.append(("broadcast", gid, body, 1))
    if "matmul" in names:
        g = Builder([], [])
        a = g.add("ones", shape=(4096, 4096), dtype="float64")
        gid, body, _ = g.body([g.add("sum", g.add("matmul", a, a))])
        out.append(("matmul", gid, body, 0))
    if "nodes" in names:
        nodes = tuple(Node("negative", (k,)) for k in range(100_000))
        raw = encode_graph(Graph((TensorSpec("float32", (4,)),), (), nodes, (100_000,)))
        out.append(("nodes", graph_id(raw), raw, 1))
    out += [(name, b"", b"", 0) for name in ("syncs", "hold") if name in names]
    return out


# -- a hostile session ------------------------------------------------------------------------------


class Ended(Exception):
    """The worker ended the session: with an Error (its code), or by closing the link (None)."""

    def __init__(self, code: str | None) -> None:
        super().__init__(code)
        self.code = code


@dataclass
class Tally:
    frames: int = 0
    batches: int = 0
    sessions: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    checked: int = 0
    wrong: int = 0


class Hostile:
    """One session with an allowed key that sends what the fuzzer tells it, frame by frame."""

    def __init__(self, ticket: Ticket, identity: Identity, tally: Tally, answer_timeout: float) -> None:
        self.ticket, self.identity, self.tally, self.timeout = ticket, identity, tally, answer_timeout
        self.link: Any = None
        self.channel: Any = None
        self.seq = 0
        self.rid = 0
        self.tid = 1
        self.graphs: dict[bytes, bytes] = {}
        self.previous = False
        self.last = ""
        self.verbose = False
        self.inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.reader: asyncio.Future[None] | None = None
        self.pending: deque[memoryview] = deque()

    async def open(self) -> None:
        host, port = self.ticket.addrs[0]
        self.link = await grpc_transport.connect(host, port)
        hs = ClientHandshake(self.identity, self.ticket.node_id, os.urandom)
        await self.link.send(hs.hello())
        auth, self.channel, _ = hs.receive_welcome(bytes(await self.link.recv()))
        await self.link.send(auth)
        # One reader for the link's life: cancelling a gRPC read would cancel the whole call.
        self.inbox = asyncio.Queue()
        self.reader = asyncio.ensure_future(self.read_all(self.link, self.inbox))
        self.pending = deque()
        self.seq, self.previous = 0, False
        self.graphs.clear()
        self.tally.sessions += 1

    @staticmethod
    async def read_all(link: Any, inbox: asyncio.Queue[bytes | None]) -> None:
        try:
            while True:
                inbox.put_nowait(bytes(await link.recv()))
        except TransportError:
            inbox.put_nowait(None)

    async def recv(self) -> bytes:
        blob = await self.inbox.get()
        if blob is None:
            self.inbox.put_nowait(None)
            raise TransportError("the worker closed the link")
        return blob

    async def close(self) -> None:
        if self.link is not None:
            await self.link.close()
            self.link = None
        if self.reader is not None:
            self.reader.cancel()
            self.reader = None

    def next_tid(self, count: int = 1) -> int:
        tid = self.tid
        self.tid += count
        return tid

    def next_rid(self) -> int:
        self.rid += 1
        return self.rid

    def frames(
        self, seq: int, messages: list[m.ClientMessage], bulks: list[np.ndarray], tail: bytes, mutate: Any
    ) -> list[bytes | bytearray]:
        plain = bytearray(m.encode_batch(m.Batch(seq, tuple(messages))) + tail)
        if mutate is not None:
            mutate(plain)
        out: list[bytes | bytearray] = [self.channel.seal(bytes(plain), MESSAGE)]
        for a in bulks:
            out.extend(self.channel.seal_chunks(np.ascontiguousarray(a).data.cast("B"), CHUNK_SIZE))
        return out

    async def send_frames(self, frames: list[bytes | bytearray]) -> None:
        for blob in pack_frames(frames):
            await self.link.send(blob)
        self.tally.frames += len(frames)
        self.tally.batches += 1

    async def exchange(
        self,
        messages: list[m.ClientMessage],
        bulks: list[np.ndarray] = (),  # type: ignore[assignment]
        *,
        tail: bytes = b"",
        mutate: Any = None,
        frames: list[bytes | bytearray] | None = None,
        seq: int | None = None,
    ) -> tuple[list[m.WorkerMessage], list[np.ndarray]]:
        """Send one batch and wait for its reply; raises Ended when the worker ends the session."""
        self.seq = self.seq + 1 if seq is None else seq
        kinds = Counter(type(x).__name__ for x in messages)
        self.last = f"batch {self.seq}: {dict(kinds)}, bytes mutated: {mutate is not None}"
        await self.send_frames(
            frames if frames is not None else self.frames(self.seq, messages, bulks, tail, mutate)
        )
        self.previous = True
        return await self.answer()

    async def answer(self) -> tuple[list[m.WorkerMessage], list[np.ndarray]]:
        got: list[m.WorkerMessage] = []
        arrays: list[np.ndarray] = []
        probed = False
        while True:
            try:
                reply, results = await asyncio.wait_for(self.reply(), self.timeout if probed else PROBE_AFTER)
            except TimeoutError:
                if self.verbose and probed:
                    print(f"no answer in {self.timeout} s to {self.last} after a probe", file=sys.stderr)
                if probed:
                    self.tally.outcomes["no answer"] += 1
                    raise Ended("no answer") from None
                probed = True  # the worker may wait for bytes a mutated batch announced: a next batch
                self.seq += 1
                await self.send_frames(self.frames(self.seq, [m.Sync(self.next_rid())], [], b"", None))
                continue
            got.extend(reply.messages)
            arrays.extend(results)
            for msg in reply.messages:
                if type(msg) is m.Error and msg.rid == 0:
                    await self.expect_closed()
                    self.tally.outcomes[f"ended:{msg.code}"] += 1
                    raise Ended(msg.code)
            unknown = [x for x in reply.messages if type(x) is m.GraphUnknown]
            if unknown:  # resend from that seq, with something it can apply
                self.seq = unknown[0].seq - 1
                body = self.graphs.get(unknown[0].gid)
                msgs: list[m.ClientMessage] = [m.Sync(self.next_rid())]
                if body is not None:
                    msgs.insert(0, m.Register(unknown[0].gid, body))
                self.seq += 1
                await self.send_frames(self.frames(self.seq, msgs, [], b"", None))
                continue
            if reply.ack >= self.seq:
                self.tally.outcomes["answered"] += 1
                for msg in got:
                    if type(msg) is m.Error:
                        self.tally.outcomes[f"error:{msg.code}"] += 1
                return got, arrays

    async def expect_closed(self) -> None:
        try:
            while True:
                await asyncio.wait_for(self.recv(), self.timeout)
        except TransportError:
            return
        except TimeoutError:
            self.tally.outcomes["link left open after the error"] += 1

    async def frame(self) -> memoryview:
        """The next frame from the worker (a blob may hold several)."""
        while not self.pending:
            try:
                blob = await self.recv()
            except TransportError:
                self.tally.outcomes["closed without an error"] += 1
                raise Ended(None) from None
            self.pending.extend(split_frames(blob))
        return self.pending.popleft()

    async def reply(self) -> tuple[m.Reply, list[np.ndarray]]:
        kind, plain = self.channel.open(await self.frame())
        if kind is not MESSAGE:
            raise ProtocolError("the worker sent a BULK frame where a reply should be")
        reply, start = m.decode_reply_prefix(plain)
        m.check_reply_tail(reply, len(plain) - start)
        arrays = []
        for msg in reply.messages:
            if type(msg) is m.Result and msg.inline:  # its bytes follow the reply in the same frame
                out = np.empty(msg.shape, msg.dtype)
                if msg.nbytes:
                    out.data.cast("B")[:] = plain[start : start + msg.nbytes]
                start += msg.nbytes
                arrays.append(out)
            elif type(msg) is m.Result:
                out = np.empty(msg.shape, msg.dtype)
                view, done = (out.data.cast("B") if msg.nbytes else memoryview(b"")), 0
                while done < msg.nbytes:
                    kind, n = self.channel.open_into(await self.frame(), view[done:])
                    if kind is not BULK:
                        raise ProtocolError("the worker sent a reply where a result's bytes should be")
                    done += n
                arrays.append(out)
        return reply, arrays


# -- what hostile sessions send -----------------------------------------------------------------------


def random_array(rng: random.Random, big: bool = False) -> np.ndarray:
    dtype = rng.choice(DTYPES)
    shape = tuple(rng.choice((0, 1, 2, 3, 7, 64)) for _ in range(rng.randint(0, 3)))
    if big:
        shape = (rng.choice((1, 4, 16)) * MiB // 8,)
    size = int(np.prod(shape)) if shape else 1
    return (np.arange(size) % 5).astype(dtype).reshape(shape)


def structural(rng: random.Random, h: Hostile, batch: list[m.ClientMessage]) -> list[m.ClientMessage]:
    """One structural mutation of a valid batch."""
    out = list(batch)
    if not out:
        return out
    i = rng.randrange(len(out))
    x = out[i]
    kind = rng.randrange(9)
    if type(x) is m.Upload:
        if kind == 0:
            out[i] = m.Upload(x.tid, x.dtype, (*x.shape, 2), x.nbytes * 2, x.inline)
        elif kind == 1:
            out[i] = m.Upload(x.tid, rng.choice(DTYPES), x.shape, x.nbytes, x.inline)
        elif kind == 2:
            out[i] = m.Upload(x.tid, x.dtype, (0, 1 << 40, 1 << 40), 0, x.inline)
        elif kind == 3:
            out[i] = m.Upload(m.MAX_ID, x.dtype, x.shape, x.nbytes, x.inline)
        else:
            out[i] = m.Upload(x.tid, x.dtype, x.shape, x.nbytes, not x.inline)
    elif type(x) is m.Execute:
        if kind < 3:
            out[i] = m.Execute(x.gid, x.inputs, x.bindings, m.MAX_ID - rng.randrange(2))
        elif kind < 5:
            out[i] = m.Execute(bytes(rng.randrange(256) for _ in range(16)), x.inputs, x.bindings, x.out_base)
        elif kind < 7:
            out[i] = m.Execute(x.gid, tuple(rng.randrange(1 << 20) for _ in x.inputs), x.bindings, x.out_base)
        else:
            out[i] = m.Execute(x.gid, x.inputs, (True, 1 << 62, -1.5)[: rng.randrange(4)], x.out_base)
    elif type(x) is m.Register:
        body = bytearray(x.graph)
        body[rng.randrange(len(body))] ^= 1 + rng.randrange(255)
        out[i] = m.Register(x.gid if kind < 5 else graph_id(bytes(body)), bytes(body))
    elif type(x) is m.Read:
        out[i] = m.Read(x.rid, rng.choice((m.MAX_ID, 0, x.tid + 1)))
    else:
        out.insert(i, m.Drop((rng.randrange(1 << 30), m.MAX_ID)))
    return out


def byte_mutation(rng: random.Random) -> Any:
    def mutate(plain: bytearray) -> None:
        for _ in range(rng.randint(1, 3)):
            where = rng.randrange(max(len(plain), 1))
            how = rng.randrange(3)
            if how == 0 and plain:
                plain[where] ^= 1 + rng.randrange(255)
            elif how == 1:
                plain[where:where] = bytes([rng.randrange(256)])
            elif plain:
                del plain[where]

    return mutate


KINDS = ("upload", "graph", "many", "drop", "chunks", "repeat", "stall")
"""What a hostile round sends (`--kinds` picks some): uploads read back, a graph run, thousands of
small messages, drops and stats, BULK chunks reordered or in odd sizes, a Repeat of the previous
batch, one of the issue's stalling inputs (with `--stall`)."""
_WEIGHTS = {"upload": 20, "graph": 20, "many": 20, "drop": 20, "chunks": 20, "repeat": 10, "stall": 3}


async def hostile_round(
    rng: random.Random,
    h: Hostile,
    pool: list[tuple[bytes, bytes, Graph]],
    stall: list[Any],
    p_mutate: float,
    kinds: tuple[str, ...] = KINDS,
    chosen: str | None = None,
) -> None:
    """One batch: valid, or mutated structurally, byte by byte, or in its framing; of kind
    `chosen` ("stall:NAME" for one stalling input) or, by default, of a random one of `kinds`."""
    allowed = [k for k in kinds if (k != "stall" or stall) and (k != "repeat" or h.previous)]
    if not allowed:
        allowed = [k for k in kinds if k != "repeat"] or ["drop"]
    name = chosen or rng.choices(allowed, [_WEIGHTS[k] for k in allowed])[0]
    if name.startswith("stall"):
        await stall_round(rng, h, [x for x in stall if name in ("stall", f"stall:{x[0]}")])
        return
    if name == "repeat":
        shift = rng.choice((0, 1, 7, -3, m.MAX_ID))
        await h.exchange([m.Repeat(shift, rng.choice((0, 1, -1)))])
        return
    batch: list[m.ClientMessage] = []
    bulks: list[np.ndarray] = []
    tail = b""
    kind = {"upload": 0, "graph": 1, "many": 2, "drop": 3, "chunks": 4}[name]
    if kind == 0:  # uploads, read back
        for _ in range(rng.randint(1, 4)):
            a = random_array(rng, big=rng.random() < 0.02)
            tid = h.next_tid()
            inline = a.nbytes < 4096 and rng.random() < 0.5
            batch += [m.Upload(tid, str(a.dtype), a.shape, a.nbytes, inline), m.Read(h.next_rid(), tid)]
            if inline:
                tail += a.tobytes()
            elif a.nbytes:
                bulks.append(a)
    elif kind == 1:  # a graph run
        gid, body, graph = rng.choice(pool)
        x = np.ones(graph.inputs[0].shape, np.float32)
        tid, out = h.next_tid(), h.next_tid()
        h.graphs[gid] = body
        batch += [m.Upload(tid, "float32", x.shape, x.nbytes), m.Register(gid, body)]
        batch += [
            m.Execute(gid, (tid,), (rng.uniform(-2, 2),), out),
            m.Read(h.next_rid(), out),
            m.Drop((tid,)),
        ]
        bulks.append(x)
    elif kind == 2:  # loop work: many small messages in one batch
        count = rng.choice((100, 2000, MAX_BATCH_MESSAGES))
        batch += [m.Sync(h.next_rid()) if i % 4 else m.Stats(h.next_rid()) for i in range(count)]
    elif kind == 3:
        batch += [m.Drop((h.next_tid(64),)), m.Sync(h.next_rid()), m.Stats(h.next_rid())]
    else:  # chunks out of order or in odd sizes
        big = rng.random() < 0.5
        a = np.arange(300_000 if big else 1000, dtype=np.float32)
        chunk = rng.choice((65536, CHUNK_SIZE) if big else (1, 999, CHUNK_SIZE))
        tid = h.next_tid()
        msgs: list[m.ClientMessage] = [m.Upload(tid, "float32", a.shape, a.nbytes), m.Read(h.next_rid(), tid)]
        h.seq += 1
        frames = [h.channel.seal(m.encode_batch(m.Batch(h.seq, tuple(msgs))), MESSAGE)]
        frames += list(h.channel.seal_chunks(a.data.cast("B"), chunk))
        if rng.random() < 0.5 and len(frames) > 2:
            frames[1], frames[2] = frames[2], frames[1]
        await h.exchange(msgs, frames=frames, seq=h.seq)
        return
    mutate = None
    mutated = rng.random() < p_mutate
    if mutated:
        if rng.random() < 0.5:
            batch = structural(rng, h, batch)
        else:
            mutate = byte_mutation(rng)
    seq = h.seq + (2 if rng.random() < 0.01 else 1)
    got, arrays = await h.exchange(batch, bulks, tail=tail, mutate=mutate, seq=seq)
    if not mutated and kind == 0:
        check_uploads(h, batch, bulks, tail, got, arrays)


def check_uploads(
    h: Hostile,
    batch: list[m.ClientMessage],
    bulks: list[np.ndarray],
    tail: bytes,
    got: list[m.WorkerMessage],
    arrays: list[np.ndarray],
) -> None:
    """An unmutated upload read back must come back exactly."""
    sent: dict[int, bytes] = {}
    bulk = iter(bulks)
    offset = 0
    for msg in batch:
        if type(msg) is m.Upload:
            if msg.inline:
                sent[msg.tid] = tail[offset : offset + msg.nbytes]
                offset += msg.nbytes
            else:
                sent[msg.tid] = next(bulk).tobytes() if msg.nbytes else b""
    reads = {x.rid: x.tid for x in batch if type(x) is m.Read}
    results = iter(arrays)
    for answer in got:
        if type(answer) is m.Result:
            value = next(results)
            want = sent.get(reads.get(answer.rid, -1))
            if want is not None:
                h.tally.checked += 1
                if value.tobytes() != want:
                    h.tally.wrong += 1


async def stall_round(rng: random.Random, h: Hostile, stall: list[Any]) -> None:
    name, gid, body, n_inputs = rng.choice(stall)
    if name == "syncs":  # 100,000 Syncs in one blob: several batches of MAX_BATCH_MESSAGES
        frames: list[bytes | bytearray] = []
        for _ in range(-(-100_000 // MAX_BATCH_MESSAGES)):
            h.seq += 1
            syncs = tuple(m.Sync(h.next_rid()) for _ in range(MAX_BATCH_MESSAGES))
            frames.append(h.channel.seal(m.encode_batch(m.Batch(h.seq, syncs)), MESSAGE))
        await h.send_frames(frames)
        await h.answer()
    elif name == "hold":  # hold 60 MiB
        a = np.ones(15 * MiB, np.float32)
        await h.exchange([m.Upload(h.next_tid(), "float32", a.shape, a.nbytes), m.Sync(h.next_rid())], [a])
    else:
        msgs: list[m.ClientMessage] = []
        bulks: list[np.ndarray] = []
        inputs: tuple[int, ...] = ()
        if n_inputs:
            x = np.ones(1 if name == "broadcast" else 4, np.float32)
            tid = h.next_tid()
            msgs.append(m.Upload(tid, "float32", x.shape, x.nbytes))
            bulks.append(x)
            inputs = (tid,)
        out = h.next_tid()
        msgs += [m.Register(gid, body), m.Execute(gid, inputs, (), out), m.Read(h.next_rid(), out)]
        await h.exchange(msgs, bulks)


async def hostile_session(
    index: int,
    ticket: Ticket,
    identity: Identity,
    tally: Tally,
    deadline: float,
    max_frames: int | None,
    stall: list[Any],
    args: argparse.Namespace,
    warm_up: bool = False,
) -> None:
    """One hostile session after another as `identity` until `deadline` or `max_frames`; a warm-up
    session (its own random stream) first sends one batch of every kind and every stalling input."""
    rng = random.Random(args.seed * 1000 + index + (500 if warm_up else 0))
    pool = [random_graph(rng) for _ in range(16)]
    h = Hostile(ticket, identity, tally, args.answer_timeout)
    h.verbose = args.verbose
    plan = [k for k in args.kinds if k != "stall"] + [f"stall:{x[0]}" for x in stall] if warm_up else []
    while plan or (time.monotonic() < deadline and (max_frames is None or tally.frames < max_frames)):
        t0 = time.monotonic()
        before = dict(tally.outcomes)
        try:
            if h.link is None:
                await h.open()
            await hostile_round(rng, h, pool, stall, args.mutate, args.kinds, plan.pop(0) if plan else None)
        except Ended:
            await h.close()
        except (TransportError, EmberlinkError) as e:
            tally.outcomes[f"client-side: {type(e).__name__}"] += 1
            if args.verbose:
                print(f"session {index}: {type(e).__name__}: {e}", file=sys.stderr)
            await h.close()
        finally:
            if args.verbose and time.monotonic() - t0 > 0.5:
                changed = {
                    k: v - before.get(k, 0) for k, v in tally.outcomes.items() if v != before.get(k, 0)
                }
                print(
                    f"session {index}: a round of {time.monotonic() - t0:.1f} s: {changed}", file=sys.stderr
                )
    await h.close()


# -- the worker, its memory, the honest client ------------------------------------------------------


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Probe:
    """One session of the fuzzer's own for the whole run, asking the worker for its StatsReply.
    One session, not one per question: a session that hangs up stays detached for the resume
    window, charged to the worker's budget, and would be counted in what it measures."""

    def __init__(self, ticket: Ticket, identity: Identity) -> None:
        self.h = Hostile(ticket, identity, Tally(), 30.0)

    async def stats(self) -> dict[str, Any]:
        for _ in range(3):
            try:
                if self.h.link is None:
                    await self.h.open()
                got, _ = await self.h.exchange([m.Stats(self.h.next_rid())])
                (stats,) = [x for x in got if type(x) is m.StatsReply]
                return dict(stats.stats)
            except (Ended, TransportError, EmberlinkError) as e:
                print(f"the probe session ended ({type(e).__name__}: {e}); opening another", file=sys.stderr)
                await self.h.close()
        raise RuntimeError("the worker does not answer the probe session")

    async def close(self) -> None:
        if self.h.link is not None:
            self.h.seq += 1
            await self.h.send_frames(self.h.frames(self.h.seq, [m.Close("probe done")], [], b"", None))
            await self.h.expect_closed()
            await self.h.close()


RESUME_WINDOW = 1.0
"""The worker's `--resume-window` here (a later `--worker-arg` may change it): a hostile session
that hangs up is kept that long, charged to the worker's budget, before it ends (server/session.py)."""
SESSIONS_END_WITHIN = 60.0
"""Seconds the sessions of a finished phase may take to end (each waits out its resume window)."""


async def settled_stats(probe: Probe, pid: int, sessions: int) -> tuple[dict[str, Any], int]:
    """Worker stats and RSS once at most `sessions` sessions (the probe's included) are open or
    detached, the worker has had time to hand freed memory back (server/worker.py's TRIM_DELAY),
    and what sessions hold has stopped changing (a session that ended may still be freeing what
    it held on a busy device). The honest client is idle meanwhile, so what it holds is steady."""
    deadline = time.monotonic() + SESSIONS_END_WITHIN
    stats = await probe.stats()
    while stats["sessions_open"] + stats["sessions_detached"] > sessions and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        stats = await probe.stats()
    await asyncio.sleep(SETTLE_SECONDS)
    for _ in range(40):
        again = await probe.stats()
        if (again["held_bytes"], again["in_use_bytes"]) == (stats["held_bytes"], stats["in_use_bytes"]):
            break
        stats = again
        await asyncio.sleep(0.25)
    return stats, rss(pid)


def honest_main(args: argparse.Namespace) -> int:
    """The honest client: a small step at a steady pace, every value checked. It says
    `{"ready": true}` once its session is open and a first step came back; then each stdin line
    starts a phase (and ends the one before), acknowledged with `{"phase": name}` once the step
    in flight is done; in phase "idle" it runs no steps. "stop" ends the last phase, and the
    results go to stdout as one JSON line."""
    import emberlink as el

    commands: queue.Queue[str] = queue.Queue()

    def read_commands() -> None:
        for line in sys.stdin:
            commands.put(line.strip())
        commands.put("stop")

    def say(what: dict[str, Any]) -> None:
        print(json.dumps(what), flush=True)

    threading.Thread(target=read_commands, daemon=True).start()
    dev = el.Device.remote(args.honest, key=args.key)
    rng = np.random.default_rng(1)
    float(dev.tensor(np.ones(64, np.float32)).sum())  # the session is open and serves
    say({"ready": True})
    phases: dict[str, list[float]] = {}
    wrong = errors = 0
    period = 1.0 / args.rate
    command = commands.get()
    while command != "stop":
        say({"phase": command})
        latencies = phases.setdefault(command, [])
        while command != "idle" and commands.empty():
            x = rng.standard_normal(64).astype(np.float32)
            t0 = time.perf_counter()
            try:
                got = float(((dev.tensor(x) * 2.0) + 1.0).sum())
            except EmberlinkError as e:
                errors += 1
                print(f"honest client: {type(e).__name__}: {e}", file=sys.stderr)
                dev = el.Device.remote(args.honest, key=args.key)
                continue
            latencies.append(time.perf_counter() - t0)
            want = float(((x * np.float32(2.0)) + np.float32(1.0)).sum(dtype=np.float32))
            if not np.isclose(got, want, rtol=1e-5, atol=1e-5):
                wrong += 1
            time.sleep(max(0.0, period - (time.perf_counter() - t0)))
        command = commands.get()
    dev.close()
    say({"latencies": phases, "wrong": wrong, "errors": errors})
    return 0


def percentiles(samples: list[float]) -> str:
    """p50 / p99 / max in milliseconds."""
    if not samples:
        return "-"
    s = sorted(samples)

    def at(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))] * 1e3

    return f"{at(0.5):.1f} / {at(0.99):.1f} / {s[-1] * 1e3:.1f}"


@dataclass
class Setup:
    """The processes and identities of one run."""

    tmp: Path
    worker: subprocess.Popen[str]
    log: Any
    ticket: Ticket
    honest: subprocess.Popen[str]
    hostile: list[Identity]
    probe: Identity
    started: float


def start(args: argparse.Namespace) -> Setup:
    """Keys, an allow file, the worker process and the honest client's process."""
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="emberlink-fuzz-"))
    worker_key, honest_key = tmp / "worker.key", tmp / "honest.key"
    worker_id, honest = Identity.generate(os.urandom), Identity.generate(os.urandom)
    worker_id.save(worker_key)
    honest.save(honest_key)
    hostile = [Identity.generate(os.urandom) for _ in range(args.sessions)]
    probe = Identity.generate(os.urandom)
    allow = tmp / "allow"
    allow.write_text("".join(f"{i.node_id}\n" for i in (honest, probe, *hostile)))
    log = open(tmp / "worker.log", "wb")  # noqa: SIM115 - kept open for the worker's life
    worker = subprocess.Popen(
        [sys.executable, "-m", "emberlink", "worker", "--listen", "127.0.0.1:0", "--key", str(worker_key)]
        + ["--allow", str(allow), "--resume-window", str(RESUME_WINDOW), *args.worker_arg],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    assert worker.stdout is not None
    ticket = Ticket.parse(worker.stdout.readline().strip())
    argv = [
        sys.executable,
        __file__,
        "--honest",
        str(ticket),
        "--key",
        str(honest_key),
        "--rate",
        str(args.rate),
    ]
    honest_proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return Setup(tmp, worker, log, ticket, honest_proc, hostile, probe, started)


class Honest:
    """The parent's end of the honest client's process: phases started and acknowledged."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.proc, self.stdin, self.stdout = proc, proc.stdin, proc.stdout

    async def line(self, timeout: float = SESSIONS_END_WITHIN) -> dict[str, Any]:
        """The honest client's next JSON line ({} if it ended or said nothing in time)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                text = await asyncio.wait_for(loop.run_in_executor(None, self.stdout.readline), timeout)
            except TimeoutError:
                return {}
            if not text:
                return {}
            if text.startswith("{"):
                return dict(json.loads(text))

    async def phase(self, name: str) -> None:
        """Start phase `name` and wait until the honest client is in it."""
        self.stdin.write(f"{name}\n")
        self.stdin.flush()
        said = await self.line()
        if said.get("phase") != name:
            raise RuntimeError(f"the honest client did not start phase {name!r} (it said {said})")

    async def stop(self) -> dict[str, Any]:
        self.stdin.write("stop\n")
        self.stdin.flush()
        report = await self.line()
        return report if "latencies" in report else {"latencies": {}, "wrong": -1, "errors": -1}


async def hostile_phase(
    args: argparse.Namespace,
    setup: Setup,
    tally: Tally,
    stall: list[Any],
    seconds: float,
    frames: int | None,
    progress: bool,
    warm_up: bool = False,
) -> float:
    """All hostile sessions for `seconds` (or until `frames` more frames); the seconds it took."""
    started = time.monotonic()
    deadline = started + (seconds if frames is None else 1e9)
    limit = None if frames is None else tally.frames + frames
    sessions = asyncio.gather(
        *(
            hostile_session(i, setup.ticket, setup.hostile[i], tally, deadline, limit, stall, args, warm_up)
            for i in range(args.sessions)
        )
    )
    while not sessions.done():  # progress, for long runs
        await asyncio.wait([sessions], timeout=args.report_every)
        if progress and not sessions.done():
            print(
                f"{time.monotonic() - started:7.0f} s: {tally.frames:,} frames, {tally.batches:,} batches, "
                f"worker RSS {rss(setup.worker.pid) / MiB:.1f} MiB",
                file=sys.stderr,
                flush=True,
            )
    sessions.result()
    return time.monotonic() - started


async def run(args: argparse.Namespace, setup: Setup) -> int:
    worker, honest = setup.worker, Honest(setup.honest)
    stall = stalling_graphs(args.stall)
    marks = [("start", setup.started)]

    def mark(name: str) -> None:
        marks.append((name, time.monotonic()))

    mark("worker started")
    # Warm-up: every hostile session, as in the run, so that the baseline counts what a worker
    # that has served hostile sessions keeps for good (imports, code paths, allocator pools);
    # the honest client's process starts meanwhile.
    await hostile_phase(args, setup, Tally(), stall, args.warm_up, None, False, warm_up=True)
    mark("warm-up")
    if not (await honest.line()).get("ready"):
        raise RuntimeError("the honest client did not start")
    probe = Probe(setup.ticket, setup.probe)
    # The honest client's steps alone come before the baseline, so that it counts what the honest
    # session holds once it has run (its graph, plans, buffers), and the rounds measure only what
    # the hostile sessions leave behind.
    await honest.phase("alone")
    await asyncio.sleep(args.alone)
    mark("honest alone")
    await honest.phase("idle")
    before, rss_before = await settled_stats(probe, worker.pid, 2)  # the honest client and the probe
    mark("baseline settled")

    tally = Tally()
    elapsed = 0.0
    rounds: list[tuple[dict[str, Any], int]] = []
    for _ in range(args.rounds):
        await honest.phase("hostile")
        elapsed += await hostile_phase(args, setup, tally, stall, args.seconds, args.frames, True)
        mark("hostile sessions")
        await honest.phase("idle")
        rounds.append(await settled_stats(probe, worker.pid, 2))
        mark("settled")
    after, rss_after = rounds[-1]
    report = await honest.stop()
    final, _ = await settled_stats(probe, worker.pid, 1)
    await probe.close()
    alive = worker.poll() is None
    mark("honest client stopped, final settled")
    phases = ", ".join(f"{name} {t - t0:.1f}" for (_, t0), (name, t) in itertools.pairwise(marks))

    lat = report["latencies"]

    def in_use_ok(stats: dict[str, Any]) -> bool:
        base, now = int(before["in_use_bytes"]), int(stats["in_use_bytes"])
        return abs(now - base) <= 0.05 * max(base, 1 << 20)

    def rss_ok(value: int) -> bool:
        return abs(value - rss_before) <= 0.05 * rss_before

    bugs = sum(tally.outcomes[b] for b in BUGS)
    print(
        f"\nbench/fuzz.py: {args.sessions} hostile sessions, {elapsed:.1f} s in {args.rounds} round(s), "
        f"seed {args.seed}, stall {args.stall}"
    )
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, worker: `emberlink worker` {' '.join(args.worker_arg)}\n"
    )
    print("| measure | value |\n|---|---:|")
    rss_rounds = " / ".join(f"{r / MiB:.1f}" for _, r in rounds)
    rows = [
        ("hostile frames sent", f"{tally.frames:,} ({tally.frames / max(elapsed, 1e-9):,.0f}/s)"),
        ("hostile batches sent", f"{tally.batches:,}"),
        ("hostile sessions opened", f"{tally.sessions:,}"),
        ("uploads read back and checked / wrong", f"{tally.checked:,} / {tally.wrong}"),
        ("worker alive at the end", "yes" if alive else "NO"),
        ("sessions open at the end (besides the probe)", str(final["sessions_open"] - 1)),
        (
            "worker RSS before / after, MiB",
            f"{rss_before / MiB:.1f} / {rss_after / MiB:.1f} ({(rss_after - rss_before) / max(rss_before, 1):+.1%})",
        ),
        ("worker RSS after each round, MiB", rss_rounds),
        ("worker in_use_bytes before / after", f"{before['in_use_bytes']:,} / {after['in_use_bytes']:,}"),
        (
            "worker held_bytes (charged to sessions) before / after",
            f"{before['held_bytes']:,} / {after['held_bytes']:,}",
        ),
        ("worker peak_bytes during the run", f"{after['peak_bytes']:,}"),
        ("honest steps alone / under attack", f"{len(lat.get('alone', []))} / {len(lat.get('hostile', []))}"),
        ("honest wrong values / errors", f"{report['wrong']} / {report['errors']}"),
        ("honest latency alone, p50 / p99 / max ms", percentiles(lat.get("alone", []))),
        ("honest latency under attack, p50 / p99 / max ms", percentiles(lat.get("hostile", []))),
        ("seconds by phase", phases),
    ]
    for k, v in rows:
        print(f"| {k} | {v} |")
    print("\n| outcome of a hostile batch | count |\n|---|---:|")
    for outcome, n in sorted(tally.outcomes.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"| {outcome}{' (BUG)' if outcome in BUGS else ''} | {n:,} |")
    reasons = [
        why
        for why, bad in (
            ("the worker died", not alive),
            (f"{bugs} bug outcomes", bugs),
            (f"{tally.wrong} wrong values read back", tally.wrong),
            (f"honest client: {report['wrong']} wrong values", report["wrong"]),
            (f"honest client: {report['errors']} errors", report["errors"]),
            (f"{final['sessions_open'] - 1} sessions left open", final["sessions_open"] != 1),
            ("in_use_bytes not back within 5%", not all(in_use_ok(s) for s, _ in rounds)),
            (
                "held_bytes not back to the baseline",
                any(s["held_bytes"] != before["held_bytes"] for s, _ in rounds),
            ),
            ("RSS not back within 5%", args.check_rss and not all(rss_ok(r) for _, r in rounds)),
        )
        if bad
    ]
    failed = bool(reasons)
    print(
        f"\nresult: {'FAILED: ' + '; '.join(reasons) if failed else 'ok'} (worker log: {setup.tmp / 'worker.log'})"
    )
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4, help="concurrent hostile sessions")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the hostile sessions run")
    parser.add_argument("--frames", type=int, help="stop after this many hostile frames instead")
    parser.add_argument(
        "--stall",
        nargs="?",
        const=",".join(STALLS),
        default="",
        type=lambda text: tuple(x for x in text.split(",") if x),
        help=f"also send the issue's stalling inputs: all, or some of {','.join(STALLS)}",
    )
    parser.add_argument("--mutate", type=float, default=0.6, help="share of batches mutated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=50.0, help="honest steps a second")
    parser.add_argument("--alone", type=float, default=5.0, help="seconds the honest client runs alone")
    parser.add_argument(
        "--warm-up", type=float, default=3.0, help="seconds of hostile sessions before the baseline is taken"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="hostile rounds, memory measured after each (growth must stop)"
    )
    parser.add_argument("--answer-timeout", type=float, default=10.0, help="seconds a batch may wait")
    parser.add_argument("--check-rss", action="store_true", help="fail unless RSS is back within 5%%")
    parser.add_argument("--worker-arg", action="append", default=[], help="an extra `emberlink worker` flag")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="say what slow rounds and client errors were"
    )
    parser.add_argument(
        "--kinds",
        type=lambda text: tuple(text.split(",")),
        default=KINDS,
        help=f"what hostile sessions send, comma-separated among {','.join(KINDS)} (default: all)",
    )
    parser.add_argument("--report-every", type=float, default=30.0, help="seconds between progress lines")
    parser.add_argument("--honest", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.honest:
        return honest_main(args)
    setup = start(args)
    try:
        return asyncio.run(run(args, setup))
    finally:
        setup.honest.kill()
        setup.honest.wait(30)
        setup.worker.terminate()
        setup.worker.wait(30)
        setup.log.close()


if __name__ == "__main__":
    sys.exit(main())
