"""The session message schema (docs/internals.md section 6): messages as declared data, one MessagePack codec; no I/O, never pickle or eval.

Rules (everything that decides what is a valid message lives in this file):
- Messages are data. Each message is a frozen dataclass that names its `TAG` (a `Tag`) and
  annotates every field with its *kind*, an `Annotated` alias: `TensorId`, `TensorIds` (an id list,
  run-length encoded), `RequestId`, `AnswerId` (a request id or 0), `Seq`, `Shift`, `GraphId`
  (16 bytes), `Graph`, `DType`, `Shape`, `NBytes`, `Bindings`, `BindingRows`, `Text`, `Code`,
  `StatMap`, or `inline_as(tag)`. The alias's `Kind` says how the field travels (`write`), how it
  is checked (`read`, `bounds`) and what a Repeat does to it (`role`). At import the declarations
  are read once into a writer per class, a reader (decoder and validator) per tag and a shift per
  class; no message has code of its own. A new message is a dataclass, a `Tag` and a place in
  `ClientMessage` or `WorkerMessage`; handlers `match` on those unions and end in `assert_never`.
- A Batch is `[seq, [message, ...]]` or `[seq, [message, ...], received]`, a Reply
  `[ack, [message, ...]]`. `received` (absent: 0) is the highest Reply ack the client has taken in
  whole, bulk included: the worker may forget the replies up to it (it keeps the others to send
  again when the session resumes on a new link, protocol/resume.py). A message is the array
  `[tag, field, field, ...]`, its fields in declaration order; an `inline_as(tag)` flag does not
  travel (True sends the message as that tag instead), and optional last fields (Repeat's
  bindings and patches) are left off when None from the end; an optional field followed by a
  given one travels as nil. Client-to-worker tags are 1..10, worker-to-client tags
  16..21, so a message sent the wrong way is an unknown tag.
- Decoding is validation: known tag, exact arity, exact types (a bool is not an int, an int is
  not a float), bounded sizes, dtypes from `protocol.dtypes`. Anything else is a ProtocolError, and
  nothing else escapes a decoder.
- Sizes are bounded before anything is built: msgpack's own length limits, rank <= MAX_RANK,
  elements and nbytes <= MAX_NBYTES (and a message's nbytes == elements * itemsize of its dtype
  and shape), the product of a shape's non-zero dims <= MAX_NBYTES too (so a zero-element shape is
  still one an array can have), a batch's messages <= MAX_BATCH_MESSAGES (a reply's <=
  MAX_MESSAGES), and the ids a batch names after run-length expansion <= MAX_IDS, counted before
  expanding. Tensor ids are in 0..MAX_ID, request ids in 1..MAX_ID, on the wire and after a shift.
- dtypes travel as small ints, shapes as arrays, id lists run-length encoded as
  `[start, count, start, count, ...]`; the dataclasses hold plain tuples of ids.
- Bulk data never travels inside msgpack: an Upload's `nbytes` announces the BULK frames that
  follow, or, for an inline Upload (tag 10 instead of 3), bytes of the MESSAGE plaintext's raw
  tail after the msgpack batch, in message order; the tail is exactly the inline uploads' bytes
  (`decode_batch_prefix` finds where the batch ends). Results the other way alike: an inline
  Result (tag 21 instead of 16) carries its bytes in the tail after the msgpack reply
  (`decode_reply_prefix`, `check_reply_tail`).
- A Repeat (tag 9) is a batch's only message: the previous batch of the session again, every
  field of kind `TensorId`/`TensorIds` shifted by `id_shift`, every `RequestId` by `rid_shift`,
  and the `Bindings` fields (the Executes') replaced, in order, when bindings are given
  (`expand_batch`, `repeat_of`: one shift serves both). Its optional `patches`, flat on the wire as
  `[position, id, position, id, ...]` (1..MAX_PATCHES pairs, positions increasing), then replace
  the shifted tensor id at each position: the batch's tensor ids counted in message order, field
  order and list order (an id list run-length expanded), so that a data set's ids kept, or batches
  cycled, among ids that shift still make a Repeat. A position past the batch's ids is refused
  when the Repeat is expanded.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
import threading
import typing
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from operator import add, attrgetter, sub
from typing import Annotated, Any, ClassVar, NoReturn

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


class Tag(enum.IntEnum):
    """Every message's wire tag: client -> worker 1..10, worker -> client 16..21."""

    REGISTER = 1
    EXECUTE = 2
    UPLOAD = 3
    READ = 4
    DROP = 5
    SYNC = 6
    STATS = 7
    CLOSE = 8
    REPEAT = 9
    UPLOAD_INLINE = 10
    RESULT = 16
    DONE = 17
    STATS_REPLY = 18
    ERROR = 19
    GRAPH_UNKNOWN = 20
    RESULT_INLINE = 21


_FLOAT32 = struct.Struct(">f")
_FLOAT64 = struct.Struct(">d")


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


# -- checking values --------------------------------------------------------------------------


def _refuse(what: str) -> NoReturn:
    raise ProtocolError(what)


def _show(v: object) -> str:
    if isinstance(v, list | dict | bytes | str):
        return f"{type(v).__name__} of length {len(v)}"
    return f"{type(v).__name__} {v!r:.40}"


def _list(v: object, what: str, hi: int) -> list[Any]:
    if type(v) is not list or len(v) > hi:
        _refuse(f"{what} must be an array of at most {hi} items, got {_show(v)}")
    return v


class _Budget:
    """Ids one batch may still name; spent before any run is expanded."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_IDS


Reader = Callable[[object, _Budget], Any]


def _ints(what: str, lo: int, hi: int) -> Reader:
    def read(v: object, budget: _Budget) -> int:
        if type(v) is not int or not lo <= v <= hi:
            _refuse(f"{what} must be an int in {lo}..{hi}, got {_show(v)}")
        return v

    return read


def _strs(what: str, lo: int, hi: int) -> Reader:
    def read(v: object, budget: _Budget) -> str:
        if type(v) is not str or not lo <= len(v) <= hi:
            _refuse(f"{what} must be a string of {lo}..{hi} characters, got {_show(v)}")
        return v

    return read


def _bins(what: str, lo: int, hi: int) -> Reader:
    def read(v: object, budget: _Budget) -> bytes:
        if type(v) is not bytes or not lo <= len(v) <= hi:
            _refuse(f"{what} must be {lo}..{hi} bytes, got {_show(v)}")
        return v

    return read


def _read_ids(v: object, budget: _Budget) -> tuple[int, ...]:
    runs = _list(v, "id list", _MAX_ARRAY)
    if len(runs) % 2:
        _refuse(f"an id list is [start, count, ...] pairs, got {len(runs)} items")
    starts, counts = runs[0::2], runs[1::2]
    for start, count in zip(starts, counts, strict=True):
        if type(start) is not int or not 0 <= start <= MAX_ID:
            _refuse(f"an id run must start at an int in 0..{MAX_ID}, got {_show(start)}")
        if type(count) is not int or not 1 <= count <= MAX_IDS or start + count - 1 > MAX_ID:
            _refuse(
                f"an id run from {start} must have 1..{min(MAX_IDS, MAX_ID - start + 1)} ids, got {_show(count)}"
            )
    total = sum(counts)
    if total > budget.left:
        _refuse(f"batch names more than {MAX_IDS} ids")
    budget.left -= total
    if total == len(starts):  # every run has count 1: the ids are the starts
        return tuple(starts)
    return tuple(chain.from_iterable(map(range, starts, map(add, starts, counts))))


def rle_encode(ids: Iterable[int]) -> list[int]:
    """`[start, count, ...]` runs of consecutive ids."""
    ids = ids if type(ids) is tuple else tuple(ids)
    if ids and ids[-1] - ids[0] == len(ids) - 1 and ids == tuple(range(ids[0], ids[0] + len(ids))):
        return [ids[0], len(ids)]
    runs: list[int] = []
    for x in ids:
        if runs and x == runs[-2] + runs[-1]:
            runs[-1] += 1
        else:
            runs += (x, 1)
    return runs


def _read_dtype(v: object, budget: _Budget) -> str:
    if type(v) is not int or not 1 <= v <= len(DTYPES):
        _refuse(f"a dtype code must be an int in 1..{len(DTYPES)}, got {_show(v)}")
    return DTYPES[v - 1]


def _write_dtype(dtype: str) -> int:
    try:
        return WIRE_CODE[dtype]
    except KeyError:
        raise ProtocolError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}") from None


def _read_shape(v: object, budget: _Budget) -> tuple[int, ...]:
    if type(v) is not list or len(v) > MAX_RANK:
        _refuse(f"a shape must be an array of at most {MAX_RANK} dimensions, got {_show(v)}")
    nonzero = 1
    for d in v:
        if type(d) is not int or not 0 <= d <= MAX_NBYTES:
            _refuse(f"a dimension must be an int in 0..{MAX_NBYTES}, got {_show(d)}")
        if d:
            nonzero *= d
    if nonzero > MAX_NBYTES:
        _refuse(f"shape {v!r} has more than {MAX_NBYTES} elements (zero dims aside)")
    return tuple(v)


_FLOAT_OR_BOOL = frozenset((float, bool))
_INT64_MIN, _INT64_MAX = _INT64


def _read_bindings(v: object, budget: _Budget) -> tuple[Scalar, ...]:
    values = _list(v, "bindings", MAX_BINDINGS)
    if not _FLOAT_OR_BOOL.issuperset(map(type, values)):  # checked in C when all are floats
        for b in values:
            t = type(b)
            if t is not float and t is not bool and (t is not int or not _INT64_MIN <= b <= _INT64_MAX):
                _refuse(f"a binding must be a bool, a float or an int64, got {_show(b)}")
    return tuple(values)


def _read_binding_rows(v: object, budget: _Budget) -> tuple[tuple[Scalar, ...], ...]:
    return tuple(_read_bindings(row, budget) for row in _list(v, "bindings of each Execute", MAX_MESSAGES))


_stat_name = _strs("stat name", 1, MAX_STAT_KEY)
_stat_text = _strs("stat value", 0, MAX_TEXT)
_stat_int = _ints("stat value", *_INT64)


MAX_PATCHES = 16
"""Most ids a Repeat may patch: more, and the batch goes in full (a Repeat stays smaller)."""


def _read_patches(v: object, budget: _Budget) -> tuple[tuple[int, int], ...]:
    flat = _list(v, "patches", 2 * MAX_PATCHES)
    if not flat or len(flat) % 2:
        _refuse(f"patches must be 1..{MAX_PATCHES} (position, id) pairs, got {_show(v)}")
    out = []
    after = -1
    for i in range(0, len(flat), 2):
        at, tid = flat[i], flat[i + 1]
        if type(at) is not int or not after < at < MAX_IDS:
            _refuse(f"a patch's position must be an int in {after + 1}..{MAX_IDS - 1}, got {_show(at)}")
        if type(tid) is not int or not 0 <= tid <= MAX_ID:
            _refuse(f"a patch's tensor id must be an int in 0..{MAX_ID}, got {_show(tid)}")
        out.append((at, tid))
        after = at
    return tuple(out)


def _write_patches(patches: tuple[tuple[int, int], ...] | None) -> list[int] | None:
    return None if patches is None else [v for pair in patches for v in pair]


def _read_stats(v: object, budget: _Budget) -> dict[str, StatValue]:
    if type(v) is not dict or len(v) > MAX_STATS:
        _refuse(f"stats must be a map of at most {MAX_STATS} entries, got {_show(v)}")
    for k, x in v.items():
        _stat_name(k, budget)
        t = type(x)
        if t is str:
            _stat_text(x, budget)
        elif t is not float:
            _stat_int(x, budget)
    return v


# -- kinds: how a field travels, is checked and is shifted -------------------------------------


class Role(enum.Enum):
    """What a Repeat does to a field."""

    KEPT = "kept"
    TENSOR = "tensor id"  # shifted by id_shift, kept in 0..MAX_ID
    REQUEST = "request id"  # shifted by rid_shift, kept in 1..MAX_ID
    BINDINGS = "bindings"  # replaced by the Repeat's next bindings tuple when it gives them


@dataclass(frozen=True, slots=True)
class Kind:
    """A field's kind: `read` checks a wire value and returns the field's value (ProtocolError
    otherwise); `write` turns a field's value into its wire value (None: it travels as it is)."""

    name: str
    read: Reader
    write: Callable[[Any], Any] | None = None
    role: Role = Role.KEPT
    many: bool = False  # a tuple of ids rather than one
    optional: bool = False  # the last field may be None, and is then left off
    inline_tag: Tag | None = None  # not on the wire: True picks this tag instead of the class's
    bounds: tuple[int, int] | None = None  # an int in lo..hi (what `read` checks), checked inline
    scalars: int = 0  # scalars nested this deep (1: a tuple, 2: tuples of them); F32 stays float32


def _int_kind(name: str, lo: int, hi: int, role: Role = Role.KEPT) -> Kind:
    return Kind(name, _ints(name, lo, hi), role=role, bounds=(lo, hi))


TENSOR_ID = _int_kind("tensor id", 0, MAX_ID, Role.TENSOR)
TENSOR_IDS = Kind("tensor ids", _read_ids, rle_encode, role=Role.TENSOR, many=True)
REQUEST_ID = _int_kind("request id", 1, MAX_ID, Role.REQUEST)
ANSWER_ID = _int_kind("request id or 0", 0, MAX_ID)  # 0: the session
SEQ = _int_kind("batch seq", 1, MAX_ID)
SHIFT = _int_kind("shift", -MAX_ID, MAX_ID)
GRAPH_ID = Kind("graph id", _bins("graph id", GID_SIZE, GID_SIZE))
GRAPH = Kind("graph", _bins("graph", 1, MAX_GRAPH_BYTES))
DTYPE = Kind("dtype", _read_dtype, _write_dtype)
SHAPE = Kind("shape", _read_shape)
NBYTES = _int_kind("nbytes", 0, MAX_NBYTES)  # == elements * itemsize of the message's dtype, shape
BINDINGS = Kind("bindings", _read_bindings, role=Role.BINDINGS, scalars=1)
BINDING_ROWS = Kind("bindings of each Execute", _read_binding_rows, optional=True, scalars=2)
PATCHES = Kind("patches", _read_patches, _write_patches, optional=True)
TEXT = Kind("text", _strs("text", 0, MAX_TEXT))
CODE = Kind("error code", _strs("error code", 1, MAX_CODE))
STAT_MAP = Kind("stats", _read_stats)


def _not_on_the_wire(v: object, budget: _Budget) -> NoReturn:
    raise AssertionError("a flag field is never read from the wire")


def inline_as(tag: Tag) -> Kind:
    """The kind of an `inline` flag: not on the wire, True sends the message as `tag`."""
    return Kind("inline flag", _not_on_the_wire, inline_tag=tag)


TensorId = Annotated[int, TENSOR_ID]
TensorIds = Annotated[tuple[int, ...], TENSOR_IDS]
RequestId = Annotated[int, REQUEST_ID]
AnswerId = Annotated[int, ANSWER_ID]
Seq = Annotated[int, SEQ]
Shift = Annotated[int, SHIFT]
GraphId = Annotated[bytes, GRAPH_ID]
Graph = Annotated[bytes, GRAPH]
DType = Annotated[str, DTYPE]
Shape = Annotated[tuple[int, ...], SHAPE]
NBytes = Annotated[int, NBYTES]
Bindings = Annotated[tuple[Scalar, ...], BINDINGS]
BindingRows = Annotated[tuple[tuple[Scalar, ...], ...] | None, BINDING_ROWS]
Patches = Annotated[tuple[tuple[int, int], ...] | None, PATCHES]
Text = Annotated[str, TEXT]
Code = Annotated[str, CODE]
StatMap = Annotated[dict[str, StatValue], STAT_MAP]


# -- client -> worker -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Register:
    TAG: ClassVar[Tag] = Tag.REGISTER
    gid: GraphId
    graph: Graph


@dataclass(frozen=True, slots=True)
class Execute:
    """Run graph `gid` on `inputs`; its outputs get ids `out_base, out_base + 1, ...`."""

    TAG: ClassVar[Tag] = Tag.EXECUTE
    gid: GraphId
    inputs: TensorIds
    bindings: Bindings
    out_base: TensorId


@dataclass(frozen=True, slots=True)
class Upload:
    TAG: ClassVar[Tag] = Tag.UPLOAD
    tid: TensorId
    dtype: DType
    shape: Shape
    nbytes: NBytes
    # the bytes follow in the MESSAGE plaintext's tail, not in BULK frames
    inline: Annotated[bool, inline_as(Tag.UPLOAD_INLINE)] = False


@dataclass(frozen=True, slots=True)
class Read:
    TAG: ClassVar[Tag] = Tag.READ
    rid: RequestId
    tid: TensorId


@dataclass(frozen=True, slots=True)
class Drop:
    TAG: ClassVar[Tag] = Tag.DROP
    ids: TensorIds


@dataclass(frozen=True, slots=True)
class Sync:
    TAG: ClassVar[Tag] = Tag.SYNC
    rid: RequestId


@dataclass(frozen=True, slots=True)
class Stats:
    TAG: ClassVar[Tag] = Tag.STATS
    rid: RequestId


@dataclass(frozen=True, slots=True)
class Close:
    TAG: ClassVar[Tag] = Tag.CLOSE
    reason: Text


@dataclass(frozen=True, slots=True)
class Repeat:
    """The previous batch again, ids and rids shifted; `bindings` (one tuple per Execute, in
    order) replace the Executes' bindings, None keeps them; `patches` ((position, id) pairs,
    positions increasing) then replace the shifted tensor ids at those positions among the batch's
    tensor ids, None replaces none."""

    TAG: ClassVar[Tag] = Tag.REPEAT
    id_shift: Shift
    rid_shift: Shift
    bindings: BindingRows = None
    patches: Patches = None


ClientMessage = Register | Execute | Upload | Read | Drop | Sync | Stats | Close | Repeat


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    messages: tuple[ClientMessage, ...]
    received: int = 0


# -- worker -> client -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Result:
    TAG: ClassVar[Tag] = Tag.RESULT
    rid: RequestId
    dtype: DType
    shape: Shape
    nbytes: NBytes
    # the bytes follow in the MESSAGE plaintext's tail, not in BULK frames
    inline: Annotated[bool, inline_as(Tag.RESULT_INLINE)] = False


@dataclass(frozen=True, slots=True)
class Done:
    TAG: ClassVar[Tag] = Tag.DONE
    rid: RequestId


@dataclass(frozen=True, slots=True)
class StatsReply:
    TAG: ClassVar[Tag] = Tag.STATS_REPLY
    rid: RequestId
    stats: StatMap


@dataclass(frozen=True, slots=True)
class Error:
    TAG: ClassVar[Tag] = Tag.ERROR
    rid: AnswerId
    code: Code
    message: Text


@dataclass(frozen=True, slots=True)
class GraphUnknown:
    TAG: ClassVar[Tag] = Tag.GRAPH_UNKNOWN
    seq: Seq
    gid: GraphId


WorkerMessage = Result | Done | StatsReply | Error | GraphUnknown


@dataclass(frozen=True, slots=True)
class Reply:
    ack: int
    messages: tuple[WorkerMessage, ...]


# -- the schema: each message class's declarations, read once at import ----------------------


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    kind: Kind
    index: int  # among the dataclass's fields


@dataclass(frozen=True, slots=True)
class _Schema:
    cls: type
    tag: Tag
    fields: tuple[_Field, ...]  # every field, in order
    wire: tuple[_Field, ...]  # the fields that travel, in order
    flag: _Field | None  # the inline flag: last, not on the wire
    tensor: tuple[int, int, int] | None  # where dtype, shape and nbytes are, when it describes one

    @property
    def tags(self) -> tuple[Tag, ...]:
        """Its tag, and its inline tag when it has a flag."""
        inline = None if self.flag is None else self.flag.kind.inline_tag
        return (self.tag,) if inline is None else (self.tag, inline)


def _schema(cls: type) -> _Schema:
    """cls's declarations, checked: every field has one kind, a flag is last, optional fields are
    the last ones (and never with a flag), and an nbytes field comes with the dtype and shape it is
    the size of."""
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = []
    for i, f in enumerate(dataclasses.fields(cls)):
        kinds = [k for k in typing.get_args(hints[f.name])[1:] if isinstance(k, Kind)]
        if len(kinds) != 1:
            raise TypeError(f"{cls.__name__}.{f.name} must declare exactly one Kind")
        fields.append(_Field(f.name, kinds[0], i))
    wire = tuple(f for f in fields if f.kind.inline_tag is None)
    flag = fields[-1] if fields and fields[-1].kind.inline_tag is not None else None
    if len(wire) + (flag is not None) != len(fields) or len(wire) >= 15:
        raise TypeError(f"{cls.__name__}: a flag must be its last field, and it has at most 14 others")
    optional = [f.kind.optional for f in fields]
    if any(optional) and (flag is not None or optional != sorted(optional)):
        raise TypeError(f"{cls.__name__}: only its last fields may be optional, and then it has no flag")
    at = {f.kind: f.index for f in fields}
    tensor = None
    if NBYTES in at:
        if DTYPE not in at or SHAPE not in at:
            raise TypeError(f"{cls.__name__}: nbytes is the size of its dtype and shape")
        tensor = (at[DTYPE], at[SHAPE], at[NBYTES])
    tag = cls.TAG  # type: ignore[attr-defined]
    return _Schema(cls, tag, tuple(fields), wire, flag, tensor)


_CLIENT_SCHEMA = tuple(_schema(c) for c in typing.get_args(ClientMessage))
_WORKER_SCHEMA = tuple(_schema(c) for c in typing.get_args(WorkerMessage))


def _quick_init(cls: type) -> None:
    """Give a frozen, slotted dataclass an `__init__` with the same parameters and defaults that
    fills its slots through their descriptors. The one dataclasses writes for a frozen class sets
    each field with `object.__setattr__(self, name, value)`, a lookup by name per field: making a
    Result took 771 ns against 455 ns, and a step makes several messages on each end (a batch's
    expansion, its Batch, a Read's Result). Like dataclasses, it compiles the function from
    source made of the fields' names (identifiers of this module's classes, never wire data)."""
    fields = dataclasses.fields(cls)
    env: dict[str, Any] = {}
    params, body = [], []
    for i, f in enumerate(fields):
        if f.default_factory is not dataclasses.MISSING or not f.init:
            raise TypeError(f"{cls.__name__}.{f.name}: only plain fields (or defaults) here")
        env[f"_set{i}"] = cls.__dict__[f.name].__set__  # the slot's member descriptor
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            env[f"_default{i}"] = f.default
            params.append(f"{f.name}=_default{i}")
        body.append(f"    _set{i}(self, {f.name})")
    exec(f"def __init__(self, {', '.join(params)}):\n" + "\n".join(body), env)  # noqa: S102
    init = env["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__dict__["__init__"].__doc__
    cls.__init__ = init  # type: ignore[misc]


for _cls in (*typing.get_args(ClientMessage), *typing.get_args(WorkerMessage), Batch, Reply):
    _quick_init(_cls)


# -- encoding ---------------------------------------------------------------------------------

_packers = threading.local()
_KEEP_PACKER = 1 << 20  # a Packer whose buffer grew past this is dropped, not kept for the thread


def _pack(obj: Any) -> bytes:
    try:
        packer = _packers.packer
    except AttributeError:  # one Packer a thread, reused: half of packb's cost is making one
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    try:
        data: bytes = packer.pack(obj)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"cannot encode message: {e}") from e
    if len(data) > _KEEP_PACKER:  # its buffer is at least this big now (a Register's graph)
        del _packers.packer
    return data


Writer = Callable[[Any], list[Any]]


def _values(names: list[str]) -> Callable[[Any], tuple[Any, ...]]:
    """The function from a message to the tuple of these fields' values."""
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda x: (one(x),)
    return attrgetter(*names)


def _writer(s: _Schema) -> Writer:
    """The function from a message to its wire array."""
    tag = int(s.tag)
    names = [f.name for f in s.wire]
    if len(names) == 1 and s.wire[0].kind.write is None and not s.wire[0].kind.optional:
        one = attrgetter(names[0])
        return lambda x: [tag, one(x)]
    get = _values(names)
    converts = tuple((i, f.kind.write) for i, f in enumerate(s.wire, 1) if f.kind.write is not None)
    required = 1 + sum(1 for f in s.wire if not f.kind.optional)  # the tag and the fields always sent
    optional = required <= len(s.wire)
    if not converts and not optional and s.flag is None:
        return lambda x: [tag, *get(x)]
    inline_tag = int(s.tags[-1])
    flag = None if s.flag is None else attrgetter(s.flag.name)

    def write(x: Any) -> list[Any]:
        out = [tag, *get(x)]
        for i, convert in converts:
            out[i] = convert(out[i])
        if flag is not None and flag(x):
            out[0] = inline_tag
        if optional:
            while len(out) > required and out[-1] is None:
                out.pop()
        return out

    return write


_CLIENT_WRITERS: dict[type, Writer] = {s.cls: _writer(s) for s in _CLIENT_SCHEMA}
_WORKER_WRITERS: dict[type, Writer] = {s.cls: _writer(s) for s in _WORKER_SCHEMA}
_SCALAR_DEPTHS: dict[type, tuple[int, ...]] = {  # per wire item, tag first: 0 or Kind.scalars
    s.cls: (0, *(f.kind.scalars for f in s.wire))
    for s in _CLIENT_SCHEMA
    if any(f.kind.scalars for f in s.wire)
}


def _wire(messages: tuple[Any, ...], writers: dict[type, Writer], side: str) -> list[list[Any]]:
    try:
        return [writers[type(x)](x) for x in messages]
    except KeyError:
        for x in messages:
            if type(x) not in writers:
                _refuse(f"not a {side} message: {type(x).__name__}")
        raise


def _holds_f32(value: Any, depth: int) -> bool:
    if depth == 1:
        return F32 in map(type, value)
    if value is not None:
        for v in value:
            if _holds_f32(v, depth - 1):
                return True
    return False


def _array_header(n: int) -> bytes:
    if n < 16:
        return _FIXARRAY[n]
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _scalar_bytes(b: Scalar) -> bytes:
    t = type(b)
    if t is int and 0 <= b < 128:  # a positive fixint: the byte itself
        return _FIXINT[b]  # type: ignore[index]
    if t is F32:
        try:
            return b"\xca" + _FLOAT32.pack(b)
        except OverflowError:  # an F32 made by hand rather than with F32.of: send it as it is
            pass
    if t is float or t is F32:
        return b"\xcb" + _FLOAT64.pack(b)
    return _pack(b)


_FIXINT = tuple(bytes((i,)) for i in range(128))
_FIXARRAY = tuple(bytes((0x90 | n,)) for n in range(16))


def _scalars_bytes(value: Any, depth: int) -> bytes:
    if depth == 1:
        return b"".join([_array_header(len(value)), *map(_scalar_bytes, value)])
    return b"".join([_array_header(len(value)), *[_scalars_bytes(v, depth - 1) for v in value]])


def _message_bytes(wire: list[Any], depths: tuple[int, ...]) -> bytes:
    """A message's encoding assembled from parts, so that F32 bindings stay float32 (msgpack-python
    writes every float as float64): an array's encoding is its header, then its items'."""
    parts = [_array_header(len(wire))]
    run: list[Any] = []  # items packed together: a short array's encoding less its 1-byte header
    for v, depth in zip(wire, depths, strict=False):
        if depth:
            if run:
                parts.append(_pack(run)[1:])
                run = []
            parts.append(_scalars_bytes(v, depth))
        else:
            run.append(v)
    if run:
        parts.append(_pack(run)[1:])
    return b"".join(parts)


def _holds_f32_at(wire: list[Any], depths: tuple[int, ...] | None) -> bool:
    if depths is not None:
        for v, d in zip(wire, depths, strict=False):  # stops early where an optional field was left off
            if d and _holds_f32(v, d):
                return True
    return False


def encode_batch(batch: Batch) -> bytes:
    """The msgpack bytes of a client batch (the plaintext of one MESSAGE frame)."""
    messages = batch.messages
    wire = _wire(messages, _CLIENT_WRITERS, "client")
    depths = [_SCALAR_DEPTHS.get(type(x)) for x in messages]
    f32 = list(map(_holds_f32_at, wire, depths))
    if not any(f32):
        if batch.received:
            return _pack([batch.seq, wire, batch.received])
        return _pack([batch.seq, wire])
    parts = [b"\x93" if batch.received else b"\x92", _pack(batch.seq), _array_header(len(wire))]
    for w, at, has in zip(wire, depths, f32, strict=True):
        parts.append(_message_bytes(w, at) if has and at is not None else _pack(w))
    if batch.received:
        parts.append(_pack(batch.received))
    return b"".join(parts)


def encode_reply(reply: Reply) -> bytes:
    """The msgpack bytes of a worker reply (the plaintext of one MESSAGE frame)."""
    return _pack([reply.ack, _wire(reply.messages, _WORKER_WRITERS, "worker")])


def encode_reply_inline(ack: int, messages: tuple[WorkerMessage, ...], inline: Iterable[int]) -> bytes:
    """`encode_reply(Reply(ack, messages))` with the Results at positions `inline` sent inline, as
    if made with `inline=True` (without making them again: a reply is laid out on every step)."""
    wire = _wire(messages, _WORKER_WRITERS, "worker")
    for i in inline:
        if type(messages[i]) is not Result:
            raise TypeError(f"message {i} of the reply is a {type(messages[i]).__name__}, not a Result")
        wire[i][0] = _RESULT_INLINE
    return _pack([ack, wire])


_RESULT_INLINE = int(Tag.RESULT_INLINE)


def encode_result_inline(ack: int, result: Result) -> bytes:
    """`encode_reply_inline(ack, (result,), [0])`: a reply of one Result sent inline (a step's read
    of its loss), its wire array made here rather than through the generic writers."""
    return _pack(
        [ack, [[_RESULT_INLINE, result.rid, _write_dtype(result.dtype), result.shape, result.nbytes]]]
    )


# -- decoding ---------------------------------------------------------------------------------

MessageReader = Callable[[list[Any], _Budget], Any]


def _reader(s: _Schema, tag: Tag) -> MessageReader:
    """The function from a wire array with this tag to its message, or ProtocolError."""
    cls, name = s.cls, s.cls.__name__
    most = len(s.wire) + 1
    least = most - sum(1 for f in s.wire if f.kind.optional)
    arity = f"{most - 1}" if most == least else f"{least - 1} to {most - 1}"
    ints = tuple((i, *f.kind.bounds, f.name) for i, f in enumerate(s.wire) if f.kind.bounds is not None)
    # The readers of the fields an array of n items holds: an optional field before the last one
    # sent may be nil (None), the last one sent may not (it would have been left off).
    calls_at = {
        n: tuple(
            (i, _nullable(f.kind.read) if f.kind.optional and i < n - 2 else f.kind.read)
            for i, f in enumerate(s.wire)
            if f.kind.bounds is None and i < n - 1
        )
        for n in range(least, most + 1)
    }
    extra = [] if s.flag is None else [tag == s.flag.kind.inline_tag]  # the flag: which tag it came as
    tensor = s.tensor

    def read(m: list[Any], budget: _Budget) -> Any:
        n = len(m)
        calls = calls_at.get(n)
        if calls is None:
            _refuse(f"{name} has {arity} fields, got {n - 1}")
        args = m[1:]
        for i, lo, hi, field in ints:
            v = args[i]
            if type(v) is not int or not lo <= v <= hi:
                _refuse(f"{name}.{field} must be an int in {lo}..{hi}, got {_show(v)}")
        try:
            for i, r in calls:
                args[i] = r(args[i], budget)
        except ProtocolError as e:
            raise ProtocolError(f"{name}: {e}") from None
        if n < most:
            args += [None] * (most - n)  # the optional last fields, left off
        args += extra
        if tensor is not None:
            dtype, shape, nbytes = args[tensor[0]], args[tensor[1]], args[tensor[2]]
            if nbytes != math.prod(shape) * ITEMSIZE[dtype]:
                _refuse(f"{name}: nbytes {nbytes} does not match {dtype} of shape {shape}")
        return cls(*args)

    return read


def _nullable(read: Reader) -> Reader:
    """`read`, and None for a nil (an optional field that travels because a later one does)."""

    def read_or_none(v: object, budget: _Budget) -> Any:
        return None if v is None else read(v, budget)

    return read_or_none


def _readers(schema: tuple[_Schema, ...]) -> dict[int, MessageReader]:
    return {int(tag): _reader(s, tag) for s in schema for tag in s.tags}


_CLIENT_READERS = _readers(_CLIENT_SCHEMA)
_WORKER_READERS = _readers(_WORKER_SCHEMA)


def _messages(
    v: object, readers: dict[int, MessageReader], most: int, side: str, budget: _Budget
) -> tuple[Any, ...]:
    out = []
    for m in _list(v, "messages", most):
        if type(m) is not list or not m:
            _refuse(f"a message must be a non-empty array, got {_show(m)}")
        tag = m[0]
        read = readers.get(tag) if type(tag) is int else None
        if read is None:
            _refuse(f"unknown {side} message tag {_show(tag)}")
        out.append(read(m, budget))
    return tuple(out)


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


_FIRST_FEED = 4096
_SMALL = _limits(_FIRST_FEED)  # the limits of every input of up to 4 KiB: allocations stay tiny
_UNPACK_ERRORS = (msgpack.UnpackException, ValueError, TypeError, OverflowError, RecursionError)


def _unpack(data: BytesLike) -> list[Any]:
    n = len(data)
    try:
        obj = msgpack.unpackb(data, **(_SMALL if n <= _FIRST_FEED else _limits(n)))
    except _UNPACK_ERRORS as e:
        raise ProtocolError(f"malformed msgpack: {type(e).__name__}: {e}"[:200]) from e
    return _list(obj, "envelope", 3)


def _unpack_prefix(data: BytesLike) -> tuple[list[Any], int]:
    """The msgpack object at the start of data and where it ends; the bytes after it are not
    copied (fed to the decoder in growing slices until one object is complete)."""
    small = type(data) is bytes and len(data) <= _FIRST_FEED
    view = data if small else memoryview(data).cast("B")  # slices of a view below copy nothing
    n = len(view)
    if n <= _FIRST_FEED:  # small: one call, and ExtraData says where the object ends
        try:
            return _list(msgpack.unpackb(view, **_SMALL), "envelope", 3), n
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


_seq = _ints("seq", 1, MAX_ID)
_received = _ints("received", 1, MAX_ID)
_ack = _ints("ack", 0, MAX_ID)


def _batch(envelope: list[Any]) -> Batch:
    if len(envelope) not in (2, 3):
        _refuse(f"a batch is [seq, messages] or [seq, messages, received], got {len(envelope)} items")
    budget = _Budget()
    seq = _seq(envelope[0], budget)
    received = _received(envelope[2], budget) if len(envelope) == 3 else 0
    messages = _messages(envelope[1], _CLIENT_READERS, MAX_BATCH_MESSAGES, "client", budget)
    if len(messages) > 1 and any(type(x) is Repeat for x in messages):
        _refuse("a Repeat must be the only message of its batch")
    return Batch(seq, messages, received)


def _reply(envelope: list[Any]) -> Reply:
    if len(envelope) != 2:
        _refuse(f"a reply is [ack, messages], got {len(envelope)} items")
    budget = _Budget()
    ack = _ack(envelope[0], budget)
    return Reply(ack, _messages(envelope[1], _WORKER_READERS, MAX_MESSAGES, "worker", budget))


def decode_batch(data: BytesLike) -> Batch:
    """The Batch that is the whole of data; ProtocolError if it is anything but a valid one.

    A Repeat is returned as it came (`expand_batch` applies it)."""
    return _batch(_unpack(data))


def decode_batch_prefix(data: BytesLike) -> tuple[Batch, int]:
    """The Batch at the start of a MESSAGE frame's plaintext and the offset of the raw tail after
    it (the inline uploads' bytes, checked against the expanded batch by `check_tail`)."""
    envelope, end = _unpack_prefix(data)
    return _batch(envelope), end


def decode_repeat(data: BytesLike, repeat: Repeat) -> tuple[int, int] | None:
    """`(seq, received)` of the batch that is the whole of `data` when it is exactly `repeat` (one
    Repeat without bindings, patched or not) and valid; None for anything else, which `decode_batch_prefix` then
    decodes in full (it accepts every batch this accepts, as the same batch). A replayed step's
    batch, expected ahead, is checked by comparing its bytes with the Repeat's encoding, without
    unpacking it or building messages: `[seq, [repeat], received]` is the array header, the seq,
    those bytes, and the received (absent when 0) as msgpack unsigned ints, nothing after them."""
    if repeat.bindings is not None or len(data) > _FIRST_FEED:
        return None
    middle = _repeat_middle(repeat)
    found = _batch_head(data)
    if found is None:
        return None
    seq, at = found
    end = at + len(middle)
    if data[at:end] != middle:
        return None
    received = _batch_tail(data, end)
    return None if received is None else (seq, received)


def encode_repeat_batch(seq: int, repeat: Repeat, received: int) -> bytes:
    """`encode_batch(Batch(seq, (repeat,), received))` for a Repeat without bindings, made from the
    bytes `decode_repeat` compares (the worker foresees a replayed step's exact batch)."""
    if repeat.bindings is not None:
        return encode_batch(Batch(seq, (repeat,), received))
    middle = _repeat_middle(repeat)
    if received:
        return b"".join((b"\x93", _pack(seq), middle, _pack(received)))
    return b"".join((b"\x92", _pack(seq), middle))


def repeat_batch_parts(seq: int, repeat: Repeat, received: int) -> tuple[bytes, bytes]:
    """`encode_repeat_batch(seq, repeat, received)` of a patched Repeat without bindings, less its
    patches' array: the bytes before it and after it. The same Repeat patching other ids at the
    same positions encodes to `before + encode_patches(positions, ids) + after` (the client
    makes a cycled batch's head so, its parts made ahead)."""
    if repeat.bindings is not None or repeat.patches is None:
        raise ValueError("repeat_batch_parts needs a patched Repeat without bindings")
    before = repatched_prefix(repeat)
    if received:
        return b"".join((b"\x93", _pack(seq), before)), _pack(received)
    return b"".join((b"\x92", _pack(seq), before)), b""


def encode_patches(positions: Iterable[int], ids: Iterable[int]) -> bytes:
    """The msgpack bytes of a Repeat's patches, (position, id) pairs in order (`repeat_batch_parts`)."""
    return _pack([v for pair in zip(positions, ids, strict=True) for v in pair])


def decode_repatched(
    data: BytesLike, repeat: Repeat, prefix: bytes | None = None
) -> tuple[int, int, tuple[int, ...]] | None:
    """`(seq, received, ids)` of the batch that is the whole of `data` when it is `repeat` (a patched
    Repeat without bindings) with other tensor ids at the same patch positions, `ids` in order, and
    valid; None for anything else (decoded in full, as in `decode_repeat`). Batches uploaded
    beforehand and cycled patch other ids every step: `repatch` then makes its messages from those
    the last patches expanded to. `prefix`: `repatched_prefix(repeat)`, made ahead (a cycled
    step's Repeat is a new one every step)."""
    patches = repeat.patches
    if repeat.bindings is not None or patches is None or len(data) > _FIRST_FEED:
        return None
    if prefix is None:
        prefix = repatched_prefix(repeat)
    found = _batch_head(data)
    if found is None:
        return None
    seq, at = found
    at += len(prefix)
    count = 2 * len(patches)  # 2..2 * MAX_PATCHES: a fixarray or an array 16
    if data[at - len(prefix) : at] != prefix or at + 3 > len(data):
        return None
    if count < 16:
        if data[at] != 0x90 | count:
            return None
        at += 1
    else:
        if data[at] != 0xDC or int.from_bytes(data[at + 1 : at + 3], "big") != count:
            return None
        at += 3
    ids = []
    for position, _ in patches:
        found = _uint_at(data, at)
        if found is None or found[0] != position:
            return None
        found = _uint_at(data, found[1])
        if found is None or found[0] > MAX_ID:
            return None
        tid, at = found
        ids.append(tid)
    received = _batch_tail(data, at)
    return None if received is None else (seq, received, tuple(ids))


def repatched_prefix(repeat: Repeat) -> bytes:
    """The bytes `decode_repatched` compares before a patched Repeat's patches (its tag, shifts and
    nil bindings, as the client encodes them)."""
    return _repeat_middle(repeat, patched=False)


def _batch_head(data: BytesLike) -> tuple[int, int] | None:
    """The seq of a batch of 2 or 3 items (a msgpack unsigned int in 1..MAX_ID) and where its
    messages begin; None for anything else."""
    if len(data) < 3 or data[0] not in (0x92, 0x93):
        return None
    found = _uint_at(data, 1)
    if found is None or not 1 <= found[0] <= MAX_ID:
        return None
    return found


def _batch_tail(data: BytesLike, at: int) -> int | None:
    """The received of a batch whose messages end at `at`: 0 for a batch of 2 items that ends
    there, else an unsigned int in 1..MAX_ID (0 is sent absent) that ends the data; None otherwise."""
    if data[0] == 0x92:
        return 0 if at == len(data) else None
    found = _uint_at(data, at)
    if found is None or found[1] != len(data) or not 1 <= found[0] <= MAX_ID:
        return None
    return found[0]


_UINT_SIZES = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
"""The msgpack unsigned int formats (beyond a positive fixint): the first byte, then this many
big-endian bytes."""


def _uint_at(data: BytesLike, at: int) -> tuple[int, int] | None:
    """The msgpack unsigned int at `at` in data and where it ends; None if none is there whole."""
    if at >= len(data):
        return None
    first = data[at]
    if first < 0x80:
        return first, at + 1
    size = _UINT_SIZES.get(first)
    if size is None or at + 1 + size > len(data):
        return None
    return int.from_bytes(data[at + 1 : at + 1 + size], "big"), at + 1 + size


_last_middle: tuple[Repeat | None, bool, bytes] = (None, True, b"")


def _repeat_middle(repeat: Repeat, patched: bool = True) -> bytes:
    """The bytes of `[repeat]` (a batch's messages) as the client encodes them, for `decode_repeat`;
    without `patched`, only those before its patches' array (for `decode_repatched`). The last one
    is kept (a replayed step expects the same Repeat object every step)."""
    global _last_middle
    last = _last_middle  # (one read: another thread may replace it meanwhile)
    if last[0] is repeat and last[1] is patched:
        return last[2]
    wire: list[Any] = [int(Tag.REPEAT), repeat.id_shift, repeat.rid_shift]
    if repeat.patches is not None:
        wire += [None, _write_patches(repeat.patches) if patched else []]
    middle = _pack([wire])
    if not patched:
        middle = middle[:-1]  # less the empty array (one byte)
    _last_middle = (repeat, patched, middle)
    return middle


def decode_reply(data: BytesLike) -> Reply:
    """The Reply that is the whole of a MESSAGE frame's plaintext; ProtocolError if it is anything
    but a valid one."""
    return _reply(_unpack(data))


def decode_reply_prefix(data: BytesLike) -> tuple[Reply, int]:
    """The Reply at the start of a MESSAGE frame's plaintext and the offset of the raw tail after
    it (the inline results' bytes, checked by `check_reply_tail`)."""
    envelope, end = _unpack_prefix(data)
    return _reply(envelope), end


def inline_bytes(messages: tuple[ClientMessage, ...]) -> int:
    """How many tail bytes the inline uploads of (expanded) messages take."""
    return sum(x.nbytes for x in messages if type(x) is Upload and x.inline)


def check_tail(batch: Batch, tail: int) -> None:
    """Refuse a tail that is not exactly the expanded batch's inline uploads."""
    want = inline_bytes(batch.messages)
    if tail != want:
        _refuse(f"batch {batch.seq} carries {tail} inline bytes, its uploads announce {want}")


def check_reply_tail(reply: Reply, tail: int) -> None:
    """Refuse a tail that is not exactly the reply's inline results."""
    want = sum(x.nbytes for x in reply.messages if type(x) is Result and x.inline)
    if tail != want:
        _refuse(f"reply {reply.ack} carries {tail} inline bytes, its results announce {want}")


# -- the id shift (Repeat) --------------------------------------------------------------------


ShiftFn = Callable[[Any, int, int, Iterator[tuple[Scalar, ...]] | None], list[Any]]


@dataclass(frozen=True, slots=True)
class _Shifted:
    """What a Repeat changes in one message class (from its fields' kinds)."""

    cls: type
    get: Callable[[Any], tuple[Any, ...]]  # every field's value
    shift: ShiftFn  # (message, id_shift, rid_shift, bindings or None) -> its values, changed
    ids: tuple[int, ...]  # where its TensorId and TensorIds fields are, in order
    rids: tuple[int, ...]  # where its RequestId fields are
    bindings: tuple[int, ...]  # where its Bindings fields are


def _out_of_range(x: int, by: int, lo: int) -> NoReturn:
    kind = "tensor" if lo == 0 else "request"
    _refuse(f"{kind} id {x} shifted by {by} leaves {lo}..{MAX_ID}")


def _shifter(
    get: Callable[[Any], tuple[Any, ...]], changes: tuple[tuple[int, Role, bool], ...], names: list[str]
) -> ShiftFn:
    """The one id shift, for expand_batch and repeat_of alike: a message's field values with each
    tensor id shifted by d, each request id by dr, and its bindings the next of rows (if given).

    `ordered` is the rule, field by field, and says which id leaves its range first; `shift` gives
    the same values by kind of field (fewer steps: a replayed batch is expanded on every step),
    and leaves a shift that takes an id out of range to `ordered`."""

    def ordered(x: Any, d: int, dr: int, rows: Iterator[tuple[Scalar, ...]] | None) -> list[Any]:
        v = list(get(x))
        for i, role, many in changes:
            if role is _TENSOR:
                if not d:
                    continue
                if many:
                    ids = v[i]
                    if ids:
                        edge = max(ids) if d > 0 else min(ids)  # the id a shift this way takes out first
                        if not 0 <= edge + d <= MAX_ID:
                            _out_of_range(edge, d, 0)
                        v[i] = tuple(map(add, ids, repeat(d)))
                else:
                    y = v[i] + d
                    if not 0 <= y <= MAX_ID:
                        _out_of_range(v[i], d, 0)
                    v[i] = y
            elif role is _REQUEST:
                y = v[i] + dr
                if not 1 <= y <= MAX_ID:
                    _out_of_range(v[i], dr, 1)
                v[i] = y
            elif rows is not None:
                v[i] = next(rows)
        return v

    # `shift`, written out for this class's fields (as `_quick_init` writes an `__init__`): a
    # replayed step's batch is expanded on every step, and a loop over the kinds of fields cost
    # twice as much.
    lines = [f"    v{i} = x.{name}" for i, name in enumerate(names)]
    tensors = [(i, many) for i, role, many in changes if role is _TENSOR]
    if tensors:
        lines.append("    if d:")
        for i, many in tensors:
            if many:
                lines += [
                    f"        if v{i}:",
                    f"            if not 0 <= (max(v{i}) if d > 0 else min(v{i})) + d <= MAX_ID:",
                    "                return ordered(x, d, dr, rows)",
                    f"            v{i} = tuple(map(add, v{i}, repeat(d)))",
                ]
            else:
                lines += [
                    f"        v{i} += d",
                    f"        if not 0 <= v{i} <= MAX_ID:",
                    "            return ordered(x, d, dr, rows)",
                ]
    for i, role, _ in changes:
        if role is _REQUEST:
            lines += [
                f"    v{i} += dr",
                f"    if not 1 <= v{i} <= MAX_ID:",
                "        return ordered(x, d, dr, rows)",
            ]
    bindings = [i for i, role, _ in changes if role is Role.BINDINGS]
    if bindings:
        lines.append("    if rows is not None:")
        lines += [f"        v{i} = next(rows)" for i in bindings]
    lines.append(f"    return [{', '.join(f'v{i}' for i in range(len(names)))}]")
    env: dict[str, Any] = {"MAX_ID": MAX_ID, "ordered": ordered, "add": add, "repeat": repeat}
    exec("def shift(x, d, dr, rows):\n" + "\n".join(lines), env)  # noqa: S102
    shift: ShiftFn = env["shift"]
    return shift


_TENSOR, _REQUEST = Role.TENSOR, Role.REQUEST


def _shifted(s: _Schema) -> _Shifted | None:
    changes = tuple((f.index, f.kind.role, f.kind.many) for f in s.fields if f.kind.role is not Role.KEPT)
    if not changes:
        return None
    at = {role: tuple(i for i, r, _ in changes if r is role) for role in Role}
    names = [f.name for f in s.fields]
    get = _values(names)
    return _Shifted(
        s.cls, get, _shifter(get, changes, names), at[Role.TENSOR], at[Role.REQUEST], at[Role.BINDINGS]
    )


_SHIFTS = {s.cls: sh for s in _CLIENT_SCHEMA if (sh := _shifted(s)) is not None}
_BINDS = frozenset(cls for cls, sh in _SHIFTS.items() if sh.bindings)


def _rows(repeat: Repeat, template: tuple[ClientMessage, ...]) -> Iterator[tuple[Scalar, ...]] | None:
    """The Repeat's bindings, one tuple for each template message that has bindings, or None."""
    if repeat.bindings is None:
        return None
    executes = sum(1 for x in template if type(x) in _BINDS)
    if len(repeat.bindings) != executes:
        _refuse(f"Repeat gives {len(repeat.bindings)} bindings tuples, the batch's Executes take {executes}")
    return iter(repeat.bindings)


def expand_batch(batch: Batch, template: tuple[ClientMessage, ...] | None) -> Batch:
    """`batch` with a Repeat replaced by the template (the session's previous batch) shifted;
    any other batch as it is. ProtocolError: a Repeat without a template, a shift that takes an
    id out of range, or bindings that do not match the template's Executes."""
    if len(batch.messages) != 1 or type(batch.messages[0]) is not Repeat:
        return batch
    if template is None:
        _refuse(f"batch {batch.seq} repeats a previous batch, and this session has none")
    return Batch(batch.seq, expand(batch.messages[0], template), batch.received)


def expand(r: Repeat, template: tuple[ClientMessage, ...]) -> tuple[ClientMessage, ...]:
    """The messages Repeat `r` stands for after `template` (`expand_batch` of a batch of it)."""
    if r.patches is not None:
        return _patched(r, template)
    if r.bindings is None and not r.id_shift and not r.rid_shift:
        return template  # nothing changes
    rows, d, dr = _rows(r, template), r.id_shift, r.rid_shift
    out = []
    shifts = _SHIFTS
    for x in template:
        sh = shifts.get(type(x))
        out.append(x if sh is None else sh.cls(*sh.shift(x, d, dr, rows)))
    return tuple(out)


def patch_sites(
    messages: tuple[ClientMessage, ...], positions: Iterable[int]
) -> tuple[tuple[int, int, int], ...] | None:
    """Where each of `positions` (increasing, among the messages' tensor ids counted as a Repeat's
    patches count them) lies: `(message, field, item)`, item -1 for a single id; None if one lies
    past the messages' ids."""
    sites = []
    wanted = iter(positions)
    at = next(wanted, None)
    base = 0
    for k, x in enumerate(messages):
        sh = _SHIFTS.get(type(x))
        if sh is None or at is None:
            continue
        values = sh.get(x)
        for i in sh.ids:
            f = values[i]
            n = 1 if type(f) is int else len(f)
            while at is not None and at < base + n:
                sites.append((k, i, -1 if type(f) is int else at - base))
                at = next(wanted, None)
            base += n
    return tuple(sites) if at is None else None


def ids_if_repatched(
    expected: tuple[ClientMessage, ...],
    sent: tuple[ClientMessage, ...],
    sites: tuple[tuple[int, int, int], ...],
) -> tuple[int, ...] | None:
    """The tensor ids `sent` has at `sites` (`patch_sites` of `expected`) if `sent` is `expected`
    with those ids there (`same_messages(repatch(expected, sites, ids), sent)`), else None; in one
    pass, without making the repatched messages (a cycled batch's check, on every step)."""
    if len(expected) != len(sent):
        return None
    ids: list[int] = []
    at, end = 0, len(sites)
    for k, x in enumerate(expected):
        y = sent[k]
        t = type(x)
        if at == end or sites[at][0] != k:
            if x != y:
                return None
            if t in _BINDS:
                shx = _SHIFTS[t]
                if not _same_bindings(shx, shx.get(x), shx.get(y)):
                    return None
            continue
        if type(y) is not t:
            return None
        sh = _SHIFTS[t]
        vx, vy = list(sh.get(x)), sh.get(y)
        while at < end and sites[at][0] == k:
            _, i, j = sites[at]
            f = vy[i]
            if j < 0:
                if type(f) is not int:
                    return None
                vx[i] = f
            else:
                g = vx[i]
                if type(f) is int or len(f) != len(g):
                    return None
                f = f[j]
                vx[i] = (*g[:j], f, *g[j + 1 :])
            ids.append(f)
            at += 1
        if vx != list(vy) or not _same_bindings(sh, vx, vy):
            return None
    return tuple(ids) if at == end else None


def _same_bindings(sh: _Shifted, vx: Sequence[Any], vy: Sequence[Any]) -> bool:
    """Whether two messages' fields (`sh.get` of each) hold the same scalars in their bindings
    (`_same_scalars`)."""
    for i in sh.bindings:
        if not _same_scalars(vx[i], vy[i]):
            return False
    return True


def repatch(
    messages: tuple[ClientMessage, ...], sites: tuple[tuple[int, int, int], ...], ids: Iterable[int]
) -> tuple[ClientMessage, ...]:
    """`messages` with the tensor id at each of `sites` (`patch_sites`) replaced by the next of `ids`:
    `expand(Repeat(d, dr, None, new), template)` from `expand(Repeat(d, dr, None, old), template)`
    when `new` patches the positions `old` did."""
    out = list(messages)
    changed: dict[int, list[Any]] = {}
    for (k, i, j), tid in zip(sites, ids, strict=True):
        v = changed.get(k)
        if v is None:
            v = changed[k] = list(_SHIFTS[type(out[k])].get(out[k]))
        if j < 0:
            v[i] = tid
        else:
            items = list(v[i])
            items[j] = tid
            v[i] = tuple(items)
    for k, v in changed.items():
        out[k] = type(out[k])(*v)
    return tuple(out)


def _patched(r: Repeat, template: tuple[ClientMessage, ...]) -> tuple[ClientMessage, ...]:
    """`expand` of a Repeat with patches: every message shifted, then the tensor id at each
    patch's position (among the batch's tensor ids, in order) replaced by the patch's id."""
    assert r.patches is not None
    rows, d, dr = _rows(r, template), r.id_shift, r.rid_shift
    patches = iter(r.patches)
    at, tid = next(patches)
    end = MAX_IDS  # past every position: the patches are all placed
    base = 0  # the position of the message's first tensor id
    out = []
    for x in template:
        sh = _SHIFTS.get(type(x))
        if sh is None:
            out.append(x)
            continue
        v = sh.shift(x, d, dr, rows)
        for i in sh.ids:
            f = v[i]
            if type(f) is int:
                if at == base:
                    v[i] = tid
                    at, tid = next(patches, (end, 0))
                base += 1
            else:
                n = len(f)
                if at < base + n:
                    ids = list(f)
                    while at < base + n:
                        ids[at - base] = tid
                        at, tid = next(patches, (end, 0))
                    v[i] = tuple(ids)
                base += n
        out.append(sh.cls(*v))
    if at != end:
        _refuse(f"Repeat patches tensor id {at}, the batch names {base}")
    return tuple(out)


def same_messages(a: tuple[ClientMessage, ...], b: tuple[ClientMessage, ...]) -> bool:
    """Whether two batches' messages are equal and encode to the same bytes (bindings' scalars of
    the same types, floats bit for bit)."""
    if a != b:
        return False
    for x, y in zip(a, b, strict=True):
        t = type(x)
        if t in _BINDS:
            sh = _SHIFTS[t]
            if not _same_bindings(sh, sh.get(x), sh.get(y)):
                return False
    return True


def _same_scalars(a: tuple[Scalar, ...], b: tuple[Scalar, ...]) -> bool:
    """Equal and of the same types, floats bit for bit (1 == 1.0 == True and 0.0 == -0.0 in Python)."""
    if a is b:  # a jitted step's constant bindings: the same tuple every replay
        return True
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if type(x) is not type(y):
            return False
        if isinstance(x, float):
            if _FLOAT64.pack(x) != _FLOAT64.pack(y):
                return False
        elif x != y:
            return False
    return True


def _first_id(values: tuple[Any, ...], at: tuple[int, ...]) -> int | None:
    """The first id in these fields of a message's values (a list's first item), if any."""
    for i in at:
        v = values[i]
        if type(v) is int:
            return v
        if v:
            return v[0]  # type: ignore[no-any-return]
    return None


def repeat_of(
    previous: tuple[ClientMessage, ...], messages: tuple[ClientMessage, ...], like: Repeat | None = None
) -> Repeat | None:
    """The Repeat that expands `previous` to exactly `messages`, or None if there is none: one
    shift for every id if there is one, else a shift and at most MAX_PATCHES patches.

    `like`, a patched Repeat that the batch is expected to repeat (the last one, whose patches
    did not give this batch), is tried first with the same shifts and positions and this batch's
    ids there: batches uploaded beforehand and cycled change only the patched ids from step to
    step. Measured on the small MLP's three-message batch here: 7 µs rather than 21."""
    if like is not None and like.patches is not None and like.bindings is None:
        found = _repatched(previous, messages, like)
        if found is not None:
            return found
    found, ids_differ = _shift_of(previous, messages)
    if found is None or not ids_differ:
        return found
    return _patches_of(previous, messages, found)


def _tensor_ids(batch: tuple[ClientMessage, ...]) -> list[int]:
    """The batch's tensor ids in the order patches count them."""
    out: list[int] = []
    for x in batch:
        sh = _SHIFTS.get(type(x))
        if sh is not None:
            v = sh.get(x)
            for i in sh.ids:
                f = v[i]
                if type(f) is int:
                    out.append(f)
                else:
                    out.extend(f)
    return out


def _repatched(
    previous: tuple[ClientMessage, ...], messages: tuple[ClientMessage, ...], like: Repeat
) -> Repeat | None:
    """`like` with its patches' ids taken from `messages` if that expands `previous` to them."""
    assert like.patches is not None
    ids = _tensor_ids(messages)
    if like.patches[-1][0] >= len(ids):
        return None
    found = Repeat(like.id_shift, like.rid_shift, None, tuple((at, ids[at]) for at, _ in like.patches))
    try:
        return found if same_messages(expand(found, previous), messages) else None
    except ProtocolError:
        return None


def _patches_of(
    previous: tuple[ClientMessage, ...], messages: tuple[ClientMessage, ...], tried: Repeat
) -> Repeat | None:
    """The Repeat with patches that expands `previous` to `messages`, when one shift (`tried`,
    from the first ids) does not: the shift among those of the first MAX_PATCHES + 1 ids (with at
    most MAX_PATCHES ids that differ, one of them has it) that leaves the fewest ids to patch; or,
    for a batch of at most MAX_PATCHES ids, shift 0 with every changed id patched (when each id
    differs from the true shift, no id shows it, and another shift may leave the id space)."""
    a, b = _tensor_ids(previous), _tensor_ids(messages)
    if len(a) != len(b) or not a:
        return None
    diffs = list(map(sub, b, a))
    counts = Counter(diffs)
    least = len(diffs) - MAX_PATCHES
    shifts = set(diffs[: MAX_PATCHES + 1])
    if len(diffs) <= MAX_PATCHES:
        shifts.add(0)
    for d in sorted(shifts, key=counts.__getitem__, reverse=True):
        if not least <= counts[d] < len(diffs):
            continue  # too many ids to patch, or none (then the batches differ elsewhere)
        patches = tuple((i, y) for i, (y, e) in enumerate(zip(b, diffs, strict=True)) if e != d)
        found = Repeat(d, tried.rid_shift, tried.bindings, patches)
        try:
            if expand(found, previous) == messages:
                return found
        except ProtocolError:
            continue
    return None


def _shift_of(
    previous: tuple[ClientMessage, ...], messages: tuple[ClientMessage, ...]
) -> tuple[Repeat | None, bool]:
    """The Repeat without patches that expands `previous` to `messages` (from their first ids and
    rids), and whether that holds but for tensor ids (repeat_of looks for patches then); None if
    the batches differ elsewhere."""
    if len(previous) != len(messages) or not messages:
        return None, False
    d = dr = None
    same_bindings = True
    given: list[tuple[Scalar, ...]] = []
    for p, c in zip(previous, messages, strict=True):
        t = type(p)
        if t is not type(c) or t is Repeat:
            return None, False
        sh = _SHIFTS.get(t)
        if sh is None:
            continue
        pv, cv = sh.get(p), sh.get(c)
        if d is None:
            a, b = _first_id(pv, sh.ids), _first_id(cv, sh.ids)
            if a is not None and b is not None:
                d = b - a
        if dr is None and sh.rids:
            dr = cv[sh.rids[0]] - pv[sh.rids[0]]
        for i in sh.bindings:
            given.append(cv[i])
            same_bindings = same_bindings and _same_scalars(pv[i], cv[i])
    found = Repeat(d or 0, dr or 0, None if same_bindings else tuple(given))
    ids_differ = False
    try:
        rows = _rows(found, previous)
        for p, c in zip(previous, messages, strict=True):
            sh = _SHIFTS.get(type(p))
            if sh is None:
                if p != c:
                    return None, False
            else:
                v, w = sh.shift(p, found.id_shift, found.rid_shift, rows), sh.get(c)
                if v != list(w):
                    if any(v[i] != w[i] for i in range(len(w)) if i not in sh.ids):
                        return None, False
                    ids_differ = True
    except ProtocolError:
        ids_differ = True  # a shifted id left its range: a patch may stand for it
    return found, ids_differ
