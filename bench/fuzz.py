"""A real `emberlink worker` under hostile sessions, with an honest client checking results and latency.

    .venv/bin/python bench/fuzz.py [--sessions 4] [--seconds 20 | --frames N] [--stall] [--seed 0]

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
SETTLE_SECONDS = 1.5  # after the last hostile session ends, before memory is measured
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
) -> None:
    """One batch: valid, or mutated structurally, byte by byte, or in its framing."""
    allowed = [k for k in kinds if (k != "stall" or stall) and (k != "repeat" or h.previous)]
    if not allowed:
        allowed = [k for k in kinds if k != "repeat"] or ["drop"]
    name = rng.choices(allowed, [_WEIGHTS[k] for k in allowed])[0]
    if name == "stall":
        await stall_round(rng, h, stall)
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
) -> None:
    rng = random.Random(args.seed * 1000 + index)
    pool = [random_graph(rng) for _ in range(16)]
    h = Hostile(ticket, identity, tally, args.answer_timeout)
    h.verbose = args.verbose
    while time.monotonic() < deadline and (max_frames is None or tally.frames < max_frames):
        t0 = time.monotonic()
        before = dict(tally.outcomes)
        try:
            if h.link is None:
                await h.open()
            await hostile_round(rng, h, pool, stall, args.mutate, args.kinds)
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


async def worker_stats(ticket: Ticket, identity: Identity) -> dict[str, Any]:
    """The worker's StatsReply, from a session of its own (which it then closes)."""
    tally = Tally()
    h = Hostile(ticket, identity, tally, 30.0)
    await h.open()
    try:
        got, _ = await h.exchange([m.Stats(1)])
        (stats,) = [x for x in got if type(x) is m.StatsReply]
        return dict(stats.stats)
    finally:
        await h.close()


RESUME_WINDOW = 1.0
"""The worker's `--resume-window` here (a later `--worker-arg` may change it): a hostile session
that hangs up is kept that long, charged to the worker's budget, before it ends (server/session.py)."""


async def settled_stats(
    ticket: Ticket, identity: Identity, pid: int, open_sessions: int
) -> tuple[dict[str, Any], int]:
    """Worker stats and RSS once only `open_sessions` sessions besides the probe are open (none
    left detached, waiting for a resume), and the worker has had time to hand freed memory back
    (server/worker.py's TRIM_DELAY) and the bytes charged to sessions have stopped changing (a
    session that ended may still be freeing what it held on a busy device)."""
    for _ in range(300):
        stats = await worker_stats(ticket, identity)
        if stats["sessions_open"] + stats["sessions_detached"] <= open_sessions + 1:
            await asyncio.sleep(SETTLE_SECONDS)
            stats = await worker_stats(ticket, identity)
            for _ in range(20):
                await asyncio.sleep(0.5)
                again = await worker_stats(ticket, identity)
                if again["held_bytes"] == stats["held_bytes"]:
                    break
                stats = again
            return stats, rss(pid)
        await asyncio.sleep(0.1)
    return stats, rss(pid)


def honest_main(args: argparse.Namespace) -> int:
    """The honest client: a small step at a steady pace, every value checked. Each stdin line
    starts a phase (and ends the one before); "stop" ends the last, and the results go to stdout
    as one JSON line."""
    import emberlink as el

    commands: queue.Queue[str] = queue.Queue()

    def read_commands() -> None:
        for line in sys.stdin:
            commands.put(line.strip())
        commands.put("stop")

    threading.Thread(target=read_commands, daemon=True).start()
    dev = el.Device.remote(args.honest, key=args.key)
    rng = np.random.default_rng(1)
    phases: dict[str, list[float]] = {}
    wrong = errors = 0
    period = 1.0 / args.rate
    command = commands.get()
    while command != "stop":
        latencies = phases.setdefault(command, [])
        while commands.empty():
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
    print(json.dumps({"latencies": phases, "wrong": wrong, "errors": errors}), flush=True)
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


async def run(args: argparse.Namespace, setup: Setup) -> int:
    tmp, worker, ticket, honest_proc = setup.tmp, setup.worker, setup.ticket, setup.honest
    hostile, probe = setup.hostile, setup.probe
    assert honest_proc.stdin is not None and honest_proc.stdout is not None

    def honest_phase(name: str) -> None:
        honest_proc.stdin.write(f"{name}\n")  # type: ignore[union-attr]
        honest_proc.stdin.flush()  # type: ignore[union-attr]

    stall = stalling_graphs(args.stall)
    marks = [("start", setup.started)]

    def mark(name: str) -> None:
        marks.append((name, time.monotonic()))

    mark("worker and honest client started")
    honest_phase("warm-up")
    # Warm-up of the worker's hostile paths, so the baseline counts what a served worker keeps.
    warm = Tally()
    await hostile_session(0, ticket, hostile[0], warm, time.monotonic() + 2.0, None, stall, args)
    mark("warm-up")
    for _ in range(300):  # the honest client's session is open (its process may start slowly)
        if (await worker_stats(ticket, probe))["sessions_open"] >= 2:
            break
        await asyncio.sleep(0.1)
    mark("honest session open")
    before, rss_before = await settled_stats(ticket, probe, worker.pid, 1)
    mark("baseline settled")
    honest_phase("alone")
    await asyncio.sleep(args.alone)
    mark("honest alone")

    tally = Tally()
    deadline = time.monotonic() + (args.seconds if args.frames is None else 1e9)
    started = time.monotonic()
    honest_phase("hostile")
    sessions = asyncio.gather(
        *(
            hostile_session(i, ticket, hostile[i], tally, deadline, args.frames, stall, args)
            for i in range(args.sessions)
        )
    )
    while not sessions.done():  # progress, for long runs
        await asyncio.wait([sessions], timeout=args.report_every)
        if not sessions.done():
            print(
                f"{time.monotonic() - started:7.0f} s: {tally.frames:,} frames, {tally.batches:,} batches, "
                f"worker RSS {rss(worker.pid) / MiB:.1f} MiB",
                file=sys.stderr,
                flush=True,
            )
    sessions.result()
    elapsed = time.monotonic() - started
    mark("hostile sessions")
    honest_phase("after")
    after, rss_after = await settled_stats(ticket, probe, worker.pid, 1)
    mark("after settled")
    honest_phase("stop")
    out = await asyncio.get_running_loop().run_in_executor(None, honest_proc.stdout.read)
    mark("honest client stopped")
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    report: dict[str, Any] = next(
        (x for x in lines if "latencies" in x), {"latencies": {}, "wrong": -1, "errors": -1}
    )
    final, _ = await settled_stats(ticket, probe, worker.pid, 0)
    alive = worker.poll() is None
    mark("final settled")
    phases = ", ".join(f"{name} {t - t0:.1f}" for (_, t0), (name, t) in itertools.pairwise(marks))

    lat = report["latencies"]
    in_use_ok = abs(after["in_use_bytes"] - before["in_use_bytes"]) <= 0.05 * max(
        before["in_use_bytes"], 1 << 20
    )
    rss_ok = abs(rss_after - rss_before) <= 0.05 * rss_before
    bugs = sum(tally.outcomes[b] for b in BUGS)
    print(
        f"\nbench/fuzz.py: {args.sessions} hostile sessions, {elapsed:.1f} s, seed {args.seed}, stall {args.stall}"
    )
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, worker: `emberlink worker` {' '.join(args.worker_arg)}\n"
    )
    print("| measure | value |\n|---|---:|")
    rows = [
        ("hostile frames sent", f"{tally.frames:,} ({tally.frames / elapsed:,.0f}/s)"),
        ("hostile batches sent", f"{tally.batches:,}"),
        ("hostile sessions opened", f"{tally.sessions:,}"),
        ("uploads read back and checked / wrong", f"{tally.checked:,} / {tally.wrong}"),
        ("worker alive at the end", "yes" if alive else "NO"),
        ("sessions open at the end (besides the probe)", str(final["sessions_open"] - 1)),
        (
            "worker RSS before / after, MiB",
            f"{rss_before / MiB:.1f} / {rss_after / MiB:.1f} ({(rss_after - rss_before) / max(rss_before, 1):+.1%})",
        ),
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
            ("in_use_bytes not back within 5%", not in_use_ok),
            ("held_bytes not back to the baseline", after["held_bytes"] != before["held_bytes"]),
            ("RSS not back within 5%", args.check_rss and not rss_ok),
        )
        if bad
    ]
    failed = bool(reasons)
    print(
        f"\nresult: {'FAILED: ' + '; '.join(reasons) if failed else 'ok'} (worker log: {tmp / 'worker.log'})"
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
