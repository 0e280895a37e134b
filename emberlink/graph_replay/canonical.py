"""Canonical bytes and content ids of graphs, and the strict decoder for graphs off the wire; no I/O.

Wire form (docs/internals.md section 3): msgpack of `[1, inputs, bindings, nodes, outputs]` with
`inputs = [[dtype, [dims...]], ...]`, `bindings = [kind, ...]`, `nodes = [[op, [value, ...],
[[attr, value], ...]], ...]` (attrs sorted by name), `outputs = [value, ...]`; tuples travel as
arrays, floats as float64. A graph's id is the blake2b-128 of those bytes.

Decoding is validation, and its only error is `ProtocolError`: bounded sizes first (bytes, node,
input, binding and output counts, rank, elements), then exact types, op names from the table,
attrs from the allow-list, references in range and earlier than their use, shapes re-inferred,
and finally the bytes must be the canonical encoding of what they decode to, so one graph has
exactly one id. Nothing here trusts a size it has not checked; nothing is evaluated.
"""

from __future__ import annotations

import hashlib
from typing import Any, cast

import msgpack

from emberlink.errors import DTypeError, ProtocolError, ShapeError
from emberlink.graph_replay.ir import BINDING_KINDS, MAX_RANK, AttrValue, Graph, Node, TensorSpec
from emberlink.graph_replay.ops import MAX_VARIADIC, OPS, check_attrs, graph_specs
from emberlink.protocol.limits import MAX_BINDINGS, MAX_GRAPH_BYTES

FORMAT_VERSION = 1
GRAPH_ID_BYTES = 16
MAX_NODES = 100_000
MAX_INPUTS = 16_384
MAX_OUTPUTS = MAX_NODES + MAX_INPUTS
MAX_VALUE_ELEMENTS = 1 << 36
"""Most elements one value may have (a sanity bound; the worker's quota is the real limit)."""
MAX_TOTAL_ELEMENTS = 1 << 40
_MAX_STR = 64


def _wire_value(v: object) -> Any:
    if isinstance(v, tuple):
        return [_wire_value(x) for x in v]
    return v


def encode_graph(graph: Graph) -> bytes:
    """The canonical msgpack bytes of `graph` (attrs sorted by name, tuples as arrays)."""
    obj = [
        FORMAT_VERSION,
        [[s.dtype, list(s.shape)] for s in graph.inputs],
        list(graph.bindings),
        [
            [n.op, list(n.inputs), [[k, _wire_value(v)] for k, v in sorted(n.attrs, key=lambda kv: kv[0])]]
            for n in graph.nodes
        ],
        list(graph.outputs),
    ]
    data: bytes = msgpack.packb(obj, use_bin_type=True, use_single_float=False)
    return data


def graph_id(data: bytes) -> bytes:
    """The content id of canonical graph bytes: blake2b with a 16-byte digest."""
    return hashlib.blake2b(data, digest_size=GRAPH_ID_BYTES).digest()


def check_graph_id(gid: object, data: bytes) -> None:
    """ProtocolError unless `gid` is the id of `data` (what the worker does on Register)."""
    if type(gid) is not bytes or len(gid) != GRAPH_ID_BYTES:
        raise ProtocolError(f"a graph id is {GRAPH_ID_BYTES} bytes, got {type(gid).__name__}")
    actual = graph_id(data)
    if gid != actual:
        raise ProtocolError(
            f"graph id mismatch: the message says {gid.hex()}, its bytes hash to {actual.hex()}"
        )


def decode_registered(gid: object, data: object) -> Graph:
    """Check a Register's `(gid, graph bytes)` pair and decode the graph; ProtocolError on any fault."""
    raw = _as_bytes(data)
    check_graph_id(gid, raw)
    return decode_graph(raw)


# -- decoding --------------------------------------------------------------------------------------


def _as_bytes(data: object) -> bytes:
    if isinstance(data, bytes | bytearray | memoryview):
        raw = bytes(data)
    else:
        raise ProtocolError(f"graph bytes must be bytes, got {type(data).__name__}")
    if len(raw) > MAX_GRAPH_BYTES:
        raise ProtocolError(f"graph of {len(raw)} bytes is over the limit of {MAX_GRAPH_BYTES}")
    return raw


def _list(v: object, what: str, limit: int, length: int | None = None) -> list[Any]:
    if type(v) is not list:
        raise ProtocolError(f"{what} must be an array, got {type(v).__name__}")
    if len(v) > limit or (length is not None and len(v) != length):
        want = f"exactly {length}" if length is not None else f"at most {limit}"
        raise ProtocolError(f"{what} has {len(v)} items, want {want}")
    return v


def _str(v: object, what: str) -> str:
    if type(v) is not str or len(v) > _MAX_STR:
        raise ProtocolError(f"{what} must be a short string, got {type(v).__name__}")
    return v


def _int(v: object, what: str, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v < hi:
        raise ProtocolError(f"{what} must be an int in [{lo}, {hi}), got {v!r:.40}")
    return v


def _spec(v: object, i: int) -> TensorSpec:
    dtype, shape = _list(v, f"input {i}", 2, 2)
    dims = _list(shape, f"input {i} shape", MAX_RANK)
    spec = TensorSpec(
        _str(dtype, f"input {i} dtype"),
        tuple(_int(d, f"input {i} dim", 0, MAX_VALUE_ELEMENTS + 1) for d in dims),
    )
    if spec.size > MAX_VALUE_ELEMENTS:
        raise ProtocolError(f"input {i} of shape {spec.shape} is over {MAX_VALUE_ELEMENTS} elements")
    return spec


def _attr_value(v: object, where: str) -> AttrValue:
    """Arrays become tuples (at most two levels: a getitem key); scalars pass as they are."""
    if type(v) is list:
        items = _list(v, where, MAX_RANK)
        return cast(AttrValue, tuple(tuple(_list(x, where, 4)) if type(x) is list else x for x in items))
    if v is None or type(v) in (bool, int, float, str):
        return cast(AttrValue, v)
    raise ProtocolError(f"{where}: a {type(v).__name__} is not an attr value")


def _node(v: object, i: int, n_values: int) -> Node:
    op, inputs, attrs = _list(v, f"node {i}", 3, 3)
    op = _str(op, f"node {i} op")
    if op not in OPS:
        raise ProtocolError(f"node {i}: unknown op {op!r}")
    refs = tuple(
        _int(r, f"node {i} ({op}) input", 0, n_values) for r in _list(inputs, f"node {i}", MAX_VARIADIC)
    )
    pairs: list[tuple[str, AttrValue]] = []
    for pair in _list(attrs, f"node {i} ({op}) attrs", len(OPS[op].attrs)):
        name, value = _list(pair, f"node {i} ({op}) attr", 2, 2)
        name = _str(name, f"node {i} ({op}) attr name")
        pairs.append((name, _attr_value(value, f"node {i} ({op}) attr {name!r}")))
    if [k for k, _ in pairs] != sorted({k for k, _ in pairs}):
        raise ProtocolError(f"node {i} ({op}): attrs are not sorted by name without repeats")
    return Node(op, refs, check_attrs(op, pairs, fill_defaults=False))


def _structure(obj: object) -> Graph:
    version, inputs, bindings, nodes, outputs = _list(obj, "graph", 5, 5)
    if type(version) is not int or version != FORMAT_VERSION:
        raise ProtocolError(f"graph format version {version!r:.20} is not {FORMAT_VERSION}")
    specs = tuple(_spec(s, i) for i, s in enumerate(_list(inputs, "inputs", MAX_INPUTS)))
    kinds = tuple(_str(k, "binding kind") for k in _list(bindings, "bindings", MAX_BINDINGS))
    if any(k not in BINDING_KINDS for k in kinds):
        raise ProtocolError(f"binding kinds must be among {BINDING_KINDS}")
    first = len(specs) + len(kinds)
    node_list = _list(nodes, "nodes", MAX_NODES)
    decoded = tuple(_node(n, i, first + i) for i, n in enumerate(node_list))
    n_values = first + len(decoded)
    outs = tuple(_int(o, "output", 0, n_values) for o in _list(outputs, "outputs", MAX_OUTPUTS))
    return Graph(specs, kinds, decoded, outs)


# ExtraData, FormatError and StackError are ValueErrors; TypeError for unhashable map keys.
_UNPACK_ERRORS = (ValueError, TypeError, RecursionError, MemoryError, OverflowError, msgpack.UnpackException)


def _unpack(raw: bytes) -> object:
    limit = len(raw)
    try:
        return msgpack.unpackb(
            raw,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=_MAX_STR,
            max_bin_len=0,
            max_map_len=0,
            max_ext_len=0,
            max_array_len=min(limit, MAX_OUTPUTS),
        )
    except _UNPACK_ERRORS as e:
        raise ProtocolError(f"graph bytes are not valid msgpack: {type(e).__name__}: {e}") from None


def graph_size(data: object) -> tuple[int, int]:
    """How many nodes and outputs graph bytes hold, read without building or inferring the nodes
    (a worker checks its node limit before paying for that: skipping 100,000 nodes takes ~6 ms,
    decoding them ~90 ms); ProtocolError if the bytes do not start like a graph."""
    raw = _as_bytes(data)
    try:
        unpacker = msgpack.Unpacker(
            max_buffer_size=max(len(raw), 1), max_array_len=min(len(raw), MAX_OUTPUTS)
        )
        unpacker.feed(raw)
        if unpacker.read_array_header() != 5:
            raise ValueError("a graph is an array of 5 items")
        unpacker.skip()  # version
        unpacker.skip()  # inputs
        unpacker.skip()  # bindings
        nodes = unpacker.read_array_header()
        for _ in range(nodes):
            unpacker.skip()
        outputs = unpacker.read_array_header()
    except (*_UNPACK_ERRORS, msgpack.OutOfData) as e:
        raise ProtocolError(
            f"graph bytes are not a [version, inputs, bindings, nodes, outputs] array: {e}"
        ) from None
    return nodes, outputs


def decode_graph(data: object) -> Graph:
    """Strictly decode canonical graph bytes, re-inferring every spec; only ProtocolError escapes."""
    raw = _as_bytes(data)
    obj = _unpack(raw)
    try:
        graph = _structure(obj)
        specs = graph_specs(graph)
    except (ShapeError, DTypeError) as e:
        raise ProtocolError(f"malformed graph: {e}") from None
    for v, spec in enumerate(specs):
        if spec.size > MAX_VALUE_ELEMENTS:
            raise ProtocolError(f"value {v} of shape {spec.shape} is over {MAX_VALUE_ELEMENTS} elements")
    if sum(s.size for s in specs) > MAX_TOTAL_ELEMENTS:
        raise ProtocolError(f"the graph's values hold over {MAX_TOTAL_ELEMENTS} elements")
    if encode_graph(graph) != raw:
        raise ProtocolError("graph bytes are not in canonical form")
    return graph


__all__ = [
    "FORMAT_VERSION",
    "GRAPH_ID_BYTES",
    "MAX_NODES",
    "check_graph_id",
    "decode_graph",
    "decode_registered",
    "encode_graph",
    "graph_id",
    "graph_size",
]
