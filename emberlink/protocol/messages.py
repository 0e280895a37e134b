"""The session message schema (docs/internals.md section 6) in MessagePack; no I/O, never pickle or eval.

Rules (everything that decides what is a valid message lives in this file):
- A Batch is `[seq, [message, ...]]` or `[seq, [message, ...], received]`, a Reply
  `[ack, [message, ...]]`. `received` (absent: 0) is the highest Reply ack the client has taken in
  whole, bulk included: the worker may forget the replies up to it (it keeps the others to send
  again when the session resumes on a new link, protocol/resume.py). A message is an array
  whose first item is its tag. Client-to-worker tags are 1..10, worker-to-client tags 16..21, so
  a message sent the wrong way is an unknown tag.
- Decoding is validation: known tag, exact arity, exact types (a bool is not an int, an int is
  not a float), bounded sizes, dtypes from `protocol.dtypes`. Anything else is a ProtocolError, and nothing
  else escapes a decoder.
- Sizes are bounded before anything is built: msgpack's own length limits, rank <= MAX_RANK,
  elements and nbytes <= MAX_NBYTES (and nbytes == elements * itemsize), the product of a
  shape's non-zero dims <= MAX_NBYTES too (so a zero-element shape is still one an array can
  have), a batch's messages <= MAX_BATCH_MESSAGES (a reply's <= MAX_MESSAGES), and the ids a
  batch names after run-length expansion <= MAX_IDS, counted before expanding.
- dtypes travel as small ints, shapes as arrays, id lists run-length encoded as
  `[start, count, start, count, ...]`; the dataclasses hold plain tuples of ids.
- Bulk data never travels inside msgpack: an Upload's `nbytes` announces the BULK frames that
  follow, or, for an inline Upload (tag 10 instead of 3), bytes of the MESSAGE plaintext's raw
  tail after the msgpack batch, in message order; the tail is exactly the inline uploads' bytes
  (`decode_batch_prefix` finds where the batch ends). Results the other way alike: an inline
  Result (tag 21 instead of 16) carries its bytes in the tail after the msgpack reply
  (`decode_reply_prefix`, `check_reply_tail`).
- A Repeat (tag 9) is a batch's only message: the previous batch of the session again, every
  tensor id shifted by `id_shift`, every request id by `rid_shift`, and the Executes' bindings
  replaced when given (`expand_batch`, `repeat_of`).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

import msgpack

from emberlink.errors import ProtocolError
from emberlink.protocol.dtypes import DTYPES, ITEMSIZE, WIRE_CODE
from emberlink.protocol.limits import MAX_BATCH_MESSAGES, MAX_BINDINGS, MAX_GRAPH_BYTES, MAX_RANK

BytesLike = bytes | bytearray | memoryview
Scalar = bool | int | float
StatValue = int | float | str


GID_SIZE = 16
MAX_ID = (1 << 63) - 1
MAX_MESSAGES = 65_536
MAX_IDS = 1 << 18
MAX_NBYTES = 1 << 40
MAX_TEXT = 64 * 1024
MAX_CODE = 64
MAX_STATS = 256
MAX_STAT_KEY = 128
_MAX_ARRAY = 2 * MAX_IDS
_INT64 = (-(1 << 63), (1 << 63) - 1)


_FLOAT32 = struct.Struct(">f")


class F32(float):
    """A binding value the encoder sends as a msgpack float32 (5 bytes instead of 9).

    Make one with `F32.of(value)`, which rounds to the nearest float32, so the encoding is exact.
    Only for bindings that every use casts to float32 (graph_replay.ops.binding_dtypes): the
    worker decodes a plain float and casts it to float32 to the same bits as the float64 value.
    """

    __slots__ = ()

    @classmethod
    def of(cls, value: float) -> float:
        """`value` rounded to float32 and marked, or `value` itself where float32 overflows."""
        try:
            return cls(_FLOAT32.unpack(_FLOAT32.pack(value))[0])
        except OverflowError:
            return value


# -- client -> worker -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Register:
    gid: bytes
    graph: bytes


@dataclass(frozen=True, slots=True)
class Execute:
    gid: bytes
    inputs: tuple[int, ...]
    bindings: tuple[Scalar, ...]
    out_base: int


@dataclass(frozen=True, slots=True)
class Upload:
    tid: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    inline: bool = False  # the bytes follow in the MESSAGE plaintext's tail, not in BULK frames


@dataclass(frozen=True, slots=True)
class Read:
    rid: int
    tid: int


@dataclass(frozen=True, slots=True)
class Drop:
    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Sync:
    rid: int


@dataclass(frozen=True, slots=True)
class Stats:
    rid: int


@dataclass(frozen=True, slots=True)
class Close:
    reason: str


@dataclass(frozen=True, slots=True)
class Repeat:
    """The previous batch again, ids and rids shifted; `bindings` (one tuple per Execute, in
    order) replace the Executes' bindings, None keeps them."""

    id_shift: int
    rid_shift: int
    bindings: tuple[tuple[Scalar, ...], ...] | None = None


ClientMessage = Register | Execute | Upload | Read | Drop | Sync | Stats | Close | Repeat


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    messages: tuple[ClientMessage, ...]
    received: int = 0


# -- worker -> client -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Result:
    rid: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    inline: bool = False  # the bytes follow in the MESSAGE plaintext's tail, not in BULK frames


@dataclass(frozen=True, slots=True)
class Done:
    rid: int


@dataclass(frozen=True, slots=True)
class StatsReply:
    rid: int
    stats: dict[str, StatValue]


@dataclass(frozen=True, slots=True)
class Error:
    rid: int
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class GraphUnknown:
    seq: int
    gid: bytes


WorkerMessage = Result | Done | StatsReply | Error | GraphUnknown


@dataclass(frozen=True, slots=True)
class Reply:
    ack: int
    messages: tuple[WorkerMessage, ...]


# -- encoding ---------------------------------------------------------------------------------


def rle_encode(ids: Iterable[int]) -> list[int]:
    """`[start, count, ...]` runs of consecutive ids."""
    runs: list[int] = []
    for x in ids:
        if runs and x == runs[-2] + runs[-1]:
            runs[-1] += 1
        else:
            runs += (x, 1)
    return runs


def _wire_client(m: ClientMessage) -> list[Any]:
    if type(m) is Execute:
        return [2, m.gid, rle_encode(m.inputs), list(m.bindings), m.out_base]
    if type(m) is Read:
        return [4, m.rid, m.tid]
    if type(m) is Register:
        return [1, m.gid, m.graph]
    if type(m) is Upload:
        return [10 if m.inline else 3, m.tid, _dtype_code(m.dtype), list(m.shape), m.nbytes]
    if type(m) is Repeat:
        if m.bindings is None:
            return [9, m.id_shift, m.rid_shift]
        return [9, m.id_shift, m.rid_shift, [list(b) for b in m.bindings]]
    if type(m) is Drop:
        return [5, rle_encode(m.ids)]
    if type(m) is Sync:
        return [6, m.rid]
    if type(m) is Stats:
        return [7, m.rid]
    if type(m) is Close:
        return [8, m.reason]
    raise ProtocolError(f"not a client message: {type(m).__name__}")


def _wire_worker(m: WorkerMessage) -> list[Any]:
    if type(m) is Done:
        return [17, m.rid]
    if type(m) is Result:
        return [21 if m.inline else 16, m.rid, _dtype_code(m.dtype), list(m.shape), m.nbytes]
    if type(m) is StatsReply:
        return [18, m.rid, dict(m.stats)]
    if type(m) is Error:
        return [19, m.rid, m.code, m.message]
    if type(m) is GraphUnknown:
        return [20, m.seq, m.gid]
    raise ProtocolError(f"not a worker message: {type(m).__name__}")


def _dtype_code(dtype: str) -> int:
    try:
        return WIRE_CODE[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}") from None


def _pack(obj: Any) -> bytes:
    try:
        data: bytes = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"cannot encode message: {e}") from e
    return data


def encode_batch(batch: Batch) -> bytes:
    """The msgpack bytes of a client batch (the plaintext of one MESSAGE frame)."""
    messages = batch.messages
    if not any(type(b) is F32 for m in messages for bs in _bindings_of(m) for b in bs):
        if batch.received:
            return _pack([batch.seq, [_wire_client(m) for m in messages], batch.received])
        return _pack([batch.seq, [_wire_client(m) for m in messages]])
    # msgpack-python writes every float as float64, so batches with F32 bindings are assembled
    # from parts: an array's encoding is its header followed by its items' encodings.
    head = b"\x93" if batch.received else b"\x92"
    parts = [head, _pack(batch.seq), _array_header(len(messages))]
    for m in messages:
        if type(m) is Execute:
            parts.append(_execute_bytes(m))
        elif type(m) is Repeat and m.bindings is not None:
            parts += [
                b"\x94",
                _pack(9),
                _pack(m.id_shift),
                _pack(m.rid_shift),
                _array_header(len(m.bindings)),
            ]
            parts += [_scalars_bytes(b) for b in m.bindings]
        else:
            parts.append(_pack(_wire_client(m)))
    if batch.received:
        parts.append(_pack(batch.received))
    return b"".join(parts)


def _bindings_of(m: ClientMessage) -> tuple[tuple[Scalar, ...], ...]:
    if type(m) is Execute:
        return (m.bindings,)
    if type(m) is Repeat and m.bindings is not None:
        return m.bindings
    return ()


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _execute_bytes(m: Execute) -> bytes:
    parts = [b"\x95", _pack(2), _pack(m.gid), _pack(rle_encode(m.inputs)), _scalars_bytes(m.bindings)]
    parts.append(_pack(m.out_base))
    return b"".join(parts)


def _scalars_bytes(bindings: tuple[Scalar, ...]) -> bytes:
    parts = [_array_header(len(bindings))]
    parts += [_float32(b) if type(b) is F32 else _pack(b) for b in bindings]
    return b"".join(parts)


def _float32(value: float) -> bytes:
    try:
        return b"\xca" + _FLOAT32.pack(value)
    except OverflowError:  # an F32 made by hand rather than with F32.of: send it as it is
        return _pack(float(value))


def encode_reply(reply: Reply) -> bytes:
    """The msgpack bytes of a worker reply (the plaintext of one MESSAGE frame)."""
    return _pack([reply.ack, [_wire_worker(m) for m in reply.messages]])


# -- decoding ---------------------------------------------------------------------------------


def _refuse(what: str) -> NoReturn:
    raise ProtocolError(what)


def _int(v: object, what: str, lo: int = 0, hi: int = MAX_ID) -> int:
    if type(v) is not int or not lo <= v <= hi:
        _refuse(f"{what} must be an int in {lo}..{hi}, got {_show(v)}")
    return v


def _str(v: object, what: str, lo: int = 0, hi: int = MAX_TEXT) -> str:
    if type(v) is not str or not lo <= len(v) <= hi:
        _refuse(f"{what} must be a string of {lo}..{hi} characters, got {_show(v)}")
    return v


def _bin(v: object, what: str, lo: int, hi: int) -> bytes:
    if type(v) is not bytes or not lo <= len(v) <= hi:
        _refuse(f"{what} must be {lo}..{hi} bytes, got {_show(v)}")
    return v


def _list(v: object, what: str, hi: int) -> list[Any]:
    if type(v) is not list or len(v) > hi:
        _refuse(f"{what} must be an array of at most {hi} items, got {_show(v)}")
    return v


def _show(v: object) -> str:
    if isinstance(v, list | dict | bytes | str):
        return f"{type(v).__name__} of length {len(v)}"
    return f"{type(v).__name__} {v!r:.40}"


class _Budget:
    """Ids one batch may still name; spent before any run is expanded."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_IDS

    def ids(self, v: object, what: str) -> tuple[int, ...]:
        runs = _list(v, what, _MAX_ARRAY)
        if len(runs) % 2:
            _refuse(f"{what} must be [start, count, ...] pairs, got {len(runs)} items")
        total = 0
        for i in range(0, len(runs), 2):
            start = _int(runs[i], f"{what} run start")
            count = _int(runs[i + 1], f"{what} run count", 1, MAX_IDS)
            if start + count - 1 > MAX_ID:
                _refuse(f"{what} run {start}+{count} passes the largest id")
            total += count
        if total > self.left:
            _refuse(f"batch names more than {MAX_IDS} ids")
        self.left -= total
        if len(runs) == 2 * total:  # every run has count 1: the ids are the starts
            return tuple(runs[0::2])
        return tuple(x for i in range(0, len(runs), 2) for x in range(runs[i], runs[i] + runs[i + 1]))


def _gid(v: object) -> bytes:
    return _bin(v, "graph id", GID_SIZE, GID_SIZE)


def _tensor_desc(dtype_v: object, shape_v: object, nbytes_v: object) -> tuple[str, tuple[int, ...], int]:
    code = _int(dtype_v, "dtype code", 1, len(DTYPES))
    dtype = DTYPES[code - 1]
    dims = _list(shape_v, "shape", MAX_RANK)
    elements = nonzero = 1
    for d in dims:
        elements *= _int(d, "dimension", 0, MAX_NBYTES)
        nonzero *= d or 1
        if nonzero > MAX_NBYTES:
            _refuse(f"shape {dims!r} has more than {MAX_NBYTES} elements (zero dims aside)")
    nbytes = _int(nbytes_v, "nbytes", 0, MAX_NBYTES)
    if nbytes != elements * ITEMSIZE[dtype]:
        _refuse(f"nbytes {nbytes} does not match {dtype} of shape {tuple(dims)}")
    return dtype, tuple(dims), nbytes


def _binding(v: object) -> Scalar:
    t = type(v)
    if t is bool or t is float:
        return v  # type: ignore[return-value]
    return _int(v, "binding", *_INT64)


def _stat_value(v: object) -> StatValue:
    t = type(v)
    if t is float:
        return v  # type: ignore[return-value]
    if t is str:
        return _str(v, "stat value")
    return _int(v, "stat value", *_INT64)


def _arity(m: list[Any], n: int, name: str) -> None:
    if len(m) != n:
        _refuse(f"{name} has {n - 1} fields, got {len(m) - 1}")


def _client_message(v: object, budget: _Budget) -> ClientMessage:
    m = _list(v, "message", 8)
    if not m:
        _refuse("empty message")
    tag = m[0]
    if tag == 2 and type(tag) is int:
        _arity(m, 5, "Execute")
        bindings = _list(m[3], "bindings", MAX_BINDINGS)
        return Execute(
            _gid(m[1]),
            budget.ids(m[2], "Execute inputs"),
            tuple(_binding(b) for b in bindings),
            _int(m[4], "out_base"),
        )
    if tag == 4 and type(tag) is int:
        _arity(m, 3, "Read")
        return Read(_int(m[1], "rid", 1), _int(m[2], "tid"))
    if tag == 1 and type(tag) is int:
        _arity(m, 3, "Register")
        return Register(_gid(m[1]), _bin(m[2], "graph", 1, MAX_GRAPH_BYTES))
    if (tag == 3 or tag == 10) and type(tag) is int:
        _arity(m, 5, "Upload")
        return Upload(_int(m[1], "tid"), *_tensor_desc(m[2], m[3], m[4]), tag == 10)
    if tag == 9 and type(tag) is int:
        if len(m) not in (3, 4):
            _refuse(f"Repeat has 2 or 3 fields, got {len(m) - 1}")
        given: tuple[tuple[Scalar, ...], ...] | None = None
        if len(m) == 4:
            lists = _list(m[3], "Repeat bindings", MAX_MESSAGES)
            given = tuple(
                tuple(_binding(b) for b in _list(bs, "Repeat bindings", MAX_BINDINGS)) for bs in lists
            )
        return Repeat(_int(m[1], "id_shift", -MAX_ID), _int(m[2], "rid_shift", -MAX_ID), given)
    if tag == 5 and type(tag) is int:
        _arity(m, 2, "Drop")
        return Drop(budget.ids(m[1], "Drop ids"))
    if tag == 6 and type(tag) is int:
        _arity(m, 2, "Sync")
        return Sync(_int(m[1], "rid", 1))
    if tag == 7 and type(tag) is int:
        _arity(m, 2, "Stats")
        return Stats(_int(m[1], "rid", 1))
    if tag == 8 and type(tag) is int:
        _arity(m, 2, "Close")
        return Close(_str(m[1], "close reason"))
    _refuse(f"unknown client message tag {_show(tag)}")


def _worker_message(v: object) -> WorkerMessage:
    m = _list(v, "message", 8)
    if not m:
        _refuse("empty message")
    tag = m[0]
    if tag == 17 and type(tag) is int:
        _arity(m, 2, "Done")
        return Done(_int(m[1], "rid", 1))
    if (tag == 16 or tag == 21) and type(tag) is int:
        _arity(m, 5, "Result")
        return Result(_int(m[1], "rid", 1), *_tensor_desc(m[2], m[3], m[4]), tag == 21)
    if tag == 18 and type(tag) is int:
        _arity(m, 3, "StatsReply")
        stats = m[2]
        if type(stats) is not dict or len(stats) > MAX_STATS:
            _refuse(f"stats must be a map of at most {MAX_STATS} entries, got {_show(stats)}")
        return StatsReply(
            _int(m[1], "rid", 1),
            {_str(k, "stat name", 1, MAX_STAT_KEY): _stat_value(x) for k, x in stats.items()},
        )
    if tag == 19 and type(tag) is int:
        _arity(m, 4, "Error")
        return Error(_int(m[1], "rid"), _str(m[2], "error code", 1, MAX_CODE), _str(m[3], "error message"))
    if tag == 20 and type(tag) is int:
        _arity(m, 3, "GraphUnknown")
        return GraphUnknown(_int(m[1], "seq", 1), _gid(m[2]))
    _refuse(f"unknown worker message tag {_show(tag)}")


def _limits(n: int) -> dict[str, Any]:
    # Every limit is also capped by the input's length (an item takes at least one byte),
    # so a header that claims a huge array allocates nothing.
    return {
        "raw": False,
        "strict_map_key": True,
        "use_list": True,
        "max_str_len": min(MAX_TEXT, n),
        "max_bin_len": min(MAX_GRAPH_BYTES, n),
        "max_array_len": min(_MAX_ARRAY, n),
        "max_map_len": min(MAX_STATS, n),
        "max_ext_len": 0,
    }


_UNPACK_ERRORS = (msgpack.UnpackException, ValueError, TypeError, OverflowError, RecursionError)


def _unpack(data: BytesLike) -> list[Any]:
    try:
        obj = msgpack.unpackb(data, **_limits(len(data)))
    except _UNPACK_ERRORS as e:
        raise ProtocolError(f"malformed msgpack: {type(e).__name__}: {e}"[:200]) from e
    return _list(obj, "envelope", 3)


_FIRST_FEED = 4096


def _unpack_prefix(data: BytesLike) -> tuple[list[Any], int]:
    """The msgpack object at the start of data and where it ends; the bytes after it are not
    copied (fed to the decoder in growing slices until one object is complete)."""
    view = memoryview(data).cast("B")
    n = len(view)
    if n <= _FIRST_FEED:  # small: one call, and ExtraData says where the object ends
        try:
            return _list(msgpack.unpackb(view, **_limits(n)), "envelope", 3), n
        except msgpack.ExtraData as e:  # args: (the object, the bytes after it)
            return _list(e.args[0], "envelope", 3), n - len(e.args[1])
        except _UNPACK_ERRORS as e:
            raise ProtocolError(f"malformed msgpack: {type(e).__name__}: {e}"[:200]) from e
    try:
        unpacker = msgpack.Unpacker(max_buffer_size=max(n, 1), **_limits(n))
        fed = min(n, _FIRST_FEED)
        unpacker.feed(view[:fed])
        while True:
            try:
                obj = unpacker.unpack()
                break
            except msgpack.OutOfData:
                if fed == n:
                    raise ValueError("truncated msgpack") from None
                more = min(n, fed * 4)
                unpacker.feed(view[fed:more])
                fed = more
        end: int = unpacker.tell()
    except _UNPACK_ERRORS as e:
        raise ProtocolError(f"malformed msgpack: {type(e).__name__}: {e}"[:200]) from e
    return _list(obj, "envelope", 3), end


def _decode(
    data: BytesLike | list[Any],
    first: str,
    first_lo: int,
    decode_one: Callable[[object], Any],
    max_messages: int = MAX_MESSAGES,
) -> tuple[int, tuple[Any, ...]]:
    envelope = data if type(data) is list else _unpack(data)  # type: ignore[arg-type]
    if len(envelope) != 2:
        _refuse(f"an envelope is [{first}, messages], got {len(envelope)} items")
    number = _int(envelope[0], first, first_lo)
    messages = _list(envelope[1], "messages", max_messages)
    return number, tuple(decode_one(m) for m in messages)


def decode_batch(data: BytesLike) -> Batch:
    """The Batch that is the whole of data; ProtocolError if it is anything but a valid one.

    A Repeat is returned as it came (`expand_batch` applies it)."""
    return _batch(_unpack(data))


def decode_batch_prefix(data: BytesLike) -> tuple[Batch, int]:
    """The Batch at the start of a MESSAGE frame's plaintext and the offset of the raw tail after
    it (the inline uploads' bytes, checked against the expanded batch by `check_tail`)."""
    envelope, end = _unpack_prefix(data)
    return _batch(envelope), end


def _batch(envelope: list[Any]) -> Batch:
    budget = _Budget()
    received = 0
    if len(envelope) == 3:
        received = _int(envelope[2], "received", 1)
        envelope = envelope[:2]
    seq, messages = _decode(envelope, "seq", 1, lambda m: _client_message(m, budget), MAX_BATCH_MESSAGES)
    if len(messages) > 1 and any(type(x) is Repeat for x in messages):
        _refuse("a Repeat must be the only message of its batch")
    return Batch(seq, messages, received)


def inline_bytes(messages: tuple[ClientMessage, ...]) -> int:
    """How many tail bytes the inline uploads of (expanded) messages take."""
    return sum(x.nbytes for x in messages if type(x) is Upload and x.inline)


def check_tail(batch: Batch, tail: int) -> None:
    """Refuse a tail that is not exactly the expanded batch's inline uploads."""
    want = inline_bytes(batch.messages)
    if tail != want:
        _refuse(f"batch {batch.seq} carries {tail} inline bytes, its uploads announce {want}")


# -- step templates (Repeat) ------------------------------------------------------------------


def _shift(x: int, by: int, what: str, lo: int = 0) -> int:
    y = x + by
    if not lo <= y <= MAX_ID:
        _refuse(f"{what} {x} shifted by {by} leaves {lo}..{MAX_ID}")
    return y


def _shift_ids(ids: tuple[int, ...], by: int, what: str) -> tuple[int, ...]:
    if not ids or not by:
        return ids
    _shift(min(ids), by, what)
    _shift(max(ids), by, what)
    return tuple(x + by for x in ids)


def expand_batch(batch: Batch, template: tuple[ClientMessage, ...] | None) -> Batch:
    """`batch` with a Repeat replaced by the template (the session's previous batch) shifted;
    any other batch as it is. ProtocolError: a Repeat without a template, a shift that takes an
    id out of range, or bindings that do not match the template's Executes."""
    if len(batch.messages) != 1 or type(batch.messages[0]) is not Repeat:
        return batch
    r = batch.messages[0]
    if template is None:
        _refuse(f"batch {batch.seq} repeats a previous batch, and this session has none")
    d, dr = r.id_shift, r.rid_shift
    bindings = None
    if r.bindings is not None:
        executes = sum(1 for x in template if type(x) is Execute)
        if len(r.bindings) != executes:
            _refuse(f"Repeat gives bindings for {len(r.bindings)} Executes, the batch has {executes}")
        bindings = iter(r.bindings)
    out: list[ClientMessage] = []
    for x in template:
        t = type(x)
        if t is Upload:
            out.append(Upload(_shift(x.tid, d, "tid"), x.dtype, x.shape, x.nbytes, x.inline))  # type: ignore[union-attr]
        elif t is Execute:
            ex: Execute = x  # type: ignore[assignment]
            bs = next(bindings) if bindings is not None else ex.bindings
            out.append(
                Execute(ex.gid, _shift_ids(ex.inputs, d, "input"), bs, _shift(ex.out_base, d, "out_base"))
            )
        elif t is Read:
            out.append(Read(_shift(x.rid, dr, "rid", 1), _shift(x.tid, d, "tid")))  # type: ignore[union-attr]
        elif t is Drop:
            out.append(Drop(_shift_ids(x.ids, d, "dropped id")))  # type: ignore[union-attr]
        elif t is Sync:
            out.append(Sync(_shift(x.rid, dr, "rid", 1)))  # type: ignore[union-attr]
        elif t is Stats:
            out.append(Stats(_shift(x.rid, dr, "rid", 1)))  # type: ignore[union-attr]
        else:  # Register, Close: nothing to shift (a template never holds a Repeat: it is expanded)
            out.append(x)
    return Batch(batch.seq, tuple(out), batch.received)


def _same_scalars(a: tuple[Scalar, ...], b: tuple[Scalar, ...]) -> bool:
    """Equal and of the same types, floats bit for bit (1 == 1.0 == True and 0.0 == -0.0 in Python)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if type(x) is not type(y):
            return False
        if isinstance(x, float):
            if struct.pack(">d", x) != struct.pack(">d", y):
                return False
        elif x != y:
            return False
    return True


def _first_id(x: ClientMessage) -> int | None:
    t = type(x)
    if t is Upload or t is Read:
        return x.tid  # type: ignore[union-attr]
    if t is Execute:
        return x.out_base  # type: ignore[union-attr]
    if t is Drop and x.ids:  # type: ignore[union-attr]
        return x.ids[0]  # type: ignore[union-attr]
    return None


def repeat_of(previous: tuple[ClientMessage, ...], messages: tuple[ClientMessage, ...]) -> Repeat | None:
    """The Repeat that expands `previous` to exactly `messages`, or None if there is none."""
    if len(previous) != len(messages) or not messages:
        return None
    d = dr = None
    same_bindings = True
    for p, c in zip(previous, messages, strict=True):
        t = type(p)
        if t is not type(c) or t is Repeat:
            return None
        if d is None:
            a, b = _first_id(p), _first_id(c)
            if a is not None and b is not None:
                d = b - a
        if dr is None and (t is Read or t is Sync or t is Stats):
            dr = c.rid - p.rid  # type: ignore[union-attr]
        if type(p) is Execute and type(c) is Execute and same_bindings:
            same_bindings = _same_scalars(p.bindings, c.bindings)
    bindings: tuple[tuple[Scalar, ...], ...] | None = None
    if not same_bindings:
        bindings = tuple(c.bindings for c in messages if type(c) is Execute)
    repeat = Repeat(d or 0, dr or 0, bindings)
    try:
        expanded = expand_batch(Batch(1, (repeat,)), previous).messages
    except ProtocolError:
        return None
    return repeat if expanded == messages else None


def decode_reply(data: BytesLike) -> Reply:
    """The Reply that is the whole of a MESSAGE frame's plaintext; ProtocolError if it is anything
    but a valid one."""
    ack, messages = _decode(data, "ack", 0, _worker_message)
    return Reply(ack, messages)


def decode_reply_prefix(data: BytesLike) -> tuple[Reply, int]:
    """The Reply at the start of a MESSAGE frame's plaintext and the offset of the raw tail after
    it (the inline results' bytes, checked by `check_reply_tail`)."""
    envelope, end = _unpack_prefix(data)
    ack, messages = _decode(envelope, "ack", 0, _worker_message)
    return Reply(ack, messages), end


def check_reply_tail(reply: Reply, tail: int) -> None:
    """Refuse a tail that is not exactly the reply's inline results."""
    want = sum(x.nbytes for x in reply.messages if type(x) is Result and x.inline)
    if tail != want:
        _refuse(f"reply {reply.ack} carries {tail} inline bytes, its results announce {want}")
