"""The session message schema (docs/internals.md section 6) in MessagePack; no I/O, never pickle or eval.

Rules (everything that decides what is a valid message lives in this file):
- A Batch is `[seq, [message, ...]]`, a Reply `[ack, [message, ...]]`. A message is an array
  whose first item is its tag. Client-to-worker tags are 1..8, worker-to-client tags 16..20, so
  a message sent the wrong way is an unknown tag.
- Decoding is validation: known tag, exact arity, exact types (a bool is not an int, an int is
  not a float), bounded sizes, dtypes from DTYPES. Anything else is a ProtocolError, and nothing
  else escapes a decoder.
- Sizes are bounded before anything is built: msgpack's own length limits, rank <= MAX_RANK,
  elements and nbytes <= MAX_NBYTES (and nbytes == elements * itemsize), and the ids a batch
  names after run-length expansion <= MAX_IDS, counted before expanding.
- dtypes travel as small ints, shapes as arrays, id lists run-length encoded as
  `[start, count, start, count, ...]`; the dataclasses hold plain tuples of ids.
- Bulk data never travels inside a message: `nbytes` announces the BULK frames that follow.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

import msgpack

from emberlink.errors import ProtocolError

BytesLike = bytes | bytearray | memoryview
Scalar = bool | int | float
StatValue = int | float | str

DTYPES: dict[str, int] = {"bool": 1, "int32": 4, "int64": 8, "float16": 2, "float32": 4, "float64": 8}
"""Allowed dtype names and their item sizes."""
_DTYPE_CODES = ("bool", "int32", "int64", "float16", "float32", "float64")  # wire code = index + 1
_DTYPE_TO_CODE = {name: i + 1 for i, name in enumerate(_DTYPE_CODES)}

GID_SIZE = 16
MAX_ID = (1 << 63) - 1
MAX_MESSAGES = 65_536
MAX_IDS = 1 << 18
MAX_RANK = 16
MAX_NBYTES = 1 << 40
MAX_BINDINGS = 4096
MAX_GRAPH_BYTES = 16 * 1024 * 1024
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


ClientMessage = Register | Execute | Upload | Read | Drop | Sync | Stats | Close


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    messages: tuple[ClientMessage, ...]


# -- worker -> client -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Result:
    rid: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


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
        return [3, m.tid, _dtype_code(m.dtype), list(m.shape), m.nbytes]
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
        return [16, m.rid, _dtype_code(m.dtype), list(m.shape), m.nbytes]
    if type(m) is StatsReply:
        return [18, m.rid, dict(m.stats)]
    if type(m) is Error:
        return [19, m.rid, m.code, m.message]
    if type(m) is GraphUnknown:
        return [20, m.seq, m.gid]
    raise ProtocolError(f"not a worker message: {type(m).__name__}")


def _dtype_code(dtype: str) -> int:
    try:
        return _DTYPE_TO_CODE[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype!r} is not one of {', '.join(_DTYPE_CODES)}") from None


def _pack(obj: Any) -> bytes:
    try:
        data: bytes = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"cannot encode message: {e}") from e
    return data


def encode_batch(batch: Batch) -> bytes:
    """The msgpack bytes of a client batch (the plaintext of one MESSAGE frame)."""
    messages = batch.messages
    if not any(type(b) is F32 for m in messages if type(m) is Execute for b in m.bindings):
        return _pack([batch.seq, [_wire_client(m) for m in messages]])
    # msgpack-python writes every float as float64, so batches with F32 bindings are assembled
    # from parts: an array's encoding is its header followed by its items' encodings.
    parts = [b"\x92", _pack(batch.seq), _array_header(len(messages))]
    parts += [_execute_bytes(m) if type(m) is Execute else _pack(_wire_client(m)) for m in messages]
    return b"".join(parts)


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _execute_bytes(m: Execute) -> bytes:
    parts = [b"\x95", _pack(2), _pack(m.gid), _pack(rle_encode(m.inputs)), _array_header(len(m.bindings))]
    parts += [_float32(b) if type(b) is F32 else _pack(b) for b in m.bindings]
    parts.append(_pack(m.out_base))
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
    code = _int(dtype_v, "dtype code", 1, len(_DTYPE_CODES))
    dtype = _DTYPE_CODES[code - 1]
    dims = _list(shape_v, "shape", MAX_RANK)
    elements = 1
    for d in dims:
        elements *= _int(d, "dimension", 0, MAX_NBYTES)
        if elements > MAX_NBYTES:
            _refuse(f"shape {dims!r} has more than {MAX_NBYTES} elements")
    nbytes = _int(nbytes_v, "nbytes", 0, MAX_NBYTES)
    if nbytes != elements * DTYPES[dtype]:
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
    if tag == 3 and type(tag) is int:
        _arity(m, 5, "Upload")
        return Upload(_int(m[1], "tid"), *_tensor_desc(m[2], m[3], m[4]))
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
    if tag == 16 and type(tag) is int:
        _arity(m, 5, "Result")
        return Result(_int(m[1], "rid", 1), *_tensor_desc(m[2], m[3], m[4]))
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


def _unpack(data: BytesLike) -> list[Any]:
    n = len(data)
    try:
        # Every limit is also capped by the input's length (an item takes at least one byte),
        # so a header that claims a huge array allocates nothing.
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=min(MAX_TEXT, n),
            max_bin_len=min(MAX_GRAPH_BYTES, n),
            max_array_len=min(_MAX_ARRAY, n),
            max_map_len=min(MAX_STATS, n),
            max_ext_len=0,
        )
    except (msgpack.UnpackException, ValueError, TypeError, OverflowError, RecursionError) as e:
        raise ProtocolError(f"malformed msgpack: {type(e).__name__}: {e}"[:200]) from e
    return _list(obj, "envelope", 2)


def _decode(
    data: BytesLike, first: str, first_lo: int, decode_one: Callable[[object], Any]
) -> tuple[int, tuple[Any, ...]]:
    envelope = _unpack(data)
    if len(envelope) != 2:
        _refuse(f"an envelope is [{first}, messages], got {len(envelope)} items")
    number = _int(envelope[0], first, first_lo)
    messages = _list(envelope[1], "messages", MAX_MESSAGES)
    return number, tuple(decode_one(m) for m in messages)


def decode_batch(data: BytesLike) -> Batch:
    """The Batch in a MESSAGE frame's plaintext; ProtocolError if it is anything but a valid one."""
    budget = _Budget()
    seq, messages = _decode(data, "seq", 1, lambda m: _client_message(m, budget))
    return Batch(seq, messages)


def decode_reply(data: BytesLike) -> Reply:
    """The Reply in a MESSAGE frame's plaintext; ProtocolError if it is anything but a valid one."""
    ack, messages = _decode(data, "ack", 0, _worker_message)
    return Reply(ack, messages)
