"""Canonical encoding, graph ids and the strict decoder (which raises only ProtocolError)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from emberlink.errors import ProtocolError
from emberlink.graph_replay.canonical import (
    MAX_NODES,
    check_graph_id,
    decode_graph,
    decode_registered,
    encode_graph,
    graph_id,
    graph_size,
)
from emberlink.graph_replay.ir import Graph, Node, TensorSpec
from emberlink.graph_replay.ops import check_attrs

from .cases import CASE_IDS, CASES, Case

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _mlp_step() -> Graph:
    """x @ w + b, relu, cross-entropy against labels, scaled by a binding."""
    return Graph(
        inputs=(TensorSpec("float32", (8, 4)), TensorSpec("float32", (4, 3)), TensorSpec("int64", (8,))),
        bindings=("float",),
        nodes=(
            Node("matmul", (0, 1)),
            Node("relu", (4,)),
            Node("cross_entropy", (5, 2), check_attrs("cross_entropy", {})),
            Node("multiply", (6, 3)),
            Node("sum", (5,), check_attrs("sum", {"axis": (0, -1), "keepdims": True})),
        ),
        outputs=(7, 8),
    )


def _pack(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_case_graph_round_trips(case: Case) -> None:
    g = case.graph()
    data = encode_graph(g)
    assert decode_graph(data) == g
    assert encode_graph(decode_graph(data)) == data


def test_graph_id_is_blake2b_128_of_the_canonical_bytes_and_stable() -> None:
    data = encode_graph(_mlp_step())
    assert len(graph_id(data)) == 16
    # A fixed graph has a fixed id: a change here means every client's cache keys changed.
    assert graph_id(data).hex() == "c84b1d0812bd8adc7c6439abfa2ae28b"


def test_equal_graphs_built_apart_have_one_id_and_attr_order_does_not_matter() -> None:
    a = _mlp_step()
    nodes = list(a.nodes)
    nodes[4] = Node("sum", (5,), (("keepdims", True), ("axis", (0, -1))))
    b = Graph(a.inputs, a.bindings, tuple(nodes), a.outputs)
    assert encode_graph(a) == encode_graph(b)


def test_a_changed_attr_changes_the_id() -> None:
    a = _mlp_step()
    nodes = list(a.nodes)
    nodes[4] = Node("sum", (5,), check_attrs("sum", {"axis": (0, -1), "keepdims": False}))
    b = Graph(a.inputs, a.bindings, tuple(nodes), a.outputs)
    assert graph_id(encode_graph(a)) != graph_id(encode_graph(b))


def test_check_graph_id_refuses_a_mismatch_with_a_clear_message() -> None:
    data = encode_graph(_mlp_step())
    check_graph_id(graph_id(data), data)
    with pytest.raises(ProtocolError, match="graph id mismatch: the message says 00000000"):
        check_graph_id(bytes(16), data)
    with pytest.raises(ProtocolError, match="a graph id is 16 bytes"):
        check_graph_id(graph_id(data)[:8], data)
    assert decode_registered(graph_id(data), data) == _mlp_step()
    with pytest.raises(ProtocolError, match="mismatch"):
        decode_registered(bytes(16), data)


def _tree() -> list[Any]:
    tree: list[Any] = msgpack.unpackb(encode_graph(_mlp_step()))
    return tree


def _with(path: tuple[int, ...], value: Any) -> bytes:
    tree = _tree()
    target = tree
    for k in path[:-1]:
        target = target[k]
    target[path[-1]] = value
    return _pack(tree)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_with((0,), 2), "format version 2 is not 1"),
        (_with((0,), True), "format version True is not 1"),
        (_with((3, 0, 0), "matmul_"), "node 0: unknown op 'matmul_'"),
        (_with((3, 0, 0), "__class__"), "unknown op"),
        (_with((3, 1, 1), [6]), "node 1 (relu) input must be an int in [0, 5)"),
        (_with((4,), [9]), "output must be an int in [0, 9)"),
        (_with((4,), [3]), "output 3 is a binding"),
        (_with((1, 0, 0), "uint16"), "unknown dtype 'uint16'"),
        (_with((1, 0, 1), [1] * 17), "input 0 shape has 17 items, want at most 16"),
        (_with((1, 0, 1), [1 << 20, 1 << 20]), "over 68719476736 elements"),
        (_with((1, 0, 1), [8, -4]), "input 0 dim must be an int"),
        (_with((2, 0), "complex"), "binding kinds must be among"),
        (_with((3, 4, 2), [["keepdims", True], ["axis", [0, -1]]]), "not sorted"),
        (_with((3, 4, 2), [["axis", [0, -1]], ["axis", [0, -1]]]), "not sorted"),
        (_with((3, 4, 2), [["axis", [0, -1]]]), "missing attr 'keepdims'"),
        (_with((3, 4, 2), [["axis", [0, -1]], ["keepdims", 1]]), "attr 'keepdims' must be a bool"),
        (_with((3, 4, 2), [["axis", [0, 5]], ["keepdims", True]]), "sum: axis 5 is out of range"),
        (_with((3, 0, 1), [0, 0]), "matmul: shapes (8, 4) and (8, 4) do not align"),
        (_with((3, 2, 2), [["reduction", "avg"]]), "reduction"),
        (_with((3, 2, 2), [["reduction", {"a": 1}]]), "max_map_len"),
        (_with((3, 2, 2), [["reduction", b"mean"]]), "not valid msgpack"),
        (encode_graph(_mlp_step()) + b"\x00", "not valid msgpack"),
        (_pack({"version": 1}), "not valid msgpack"),
        (_pack([1, [], [], [], []])[:-1], "not valid msgpack"),
        (b"", "not valid msgpack"),
        (_pack(_tree()[:4]), "graph has 4 items, want exactly 5"),
    ],
)
def test_malformed_graphs_are_refused_with_a_clear_message(data: bytes, message: str) -> None:
    with pytest.raises(
        ProtocolError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        decode_graph(data)


def test_non_canonical_bytes_are_refused() -> None:
    g = Graph(
        (),
        ("float",),
        (
            Node(
                "arange",
                (),
                check_attrs("arange", {"start": 0.5, "stop": 2.0, "step": 0.5, "dtype": "float32"}),
            ),
        ),
        (1,),
    )
    single = msgpack.packb(msgpack.unpackb(encode_graph(g)), use_single_float=True)
    with pytest.raises(ProtocolError, match="not in canonical form"):
        decode_graph(single)
    wide_int = encode_graph(g).replace(b"\x91\x01", b"\x91\xd1\x00\x01")  # outputs [1] as int16
    with pytest.raises(ProtocolError, match="not in canonical form"):
        decode_graph(wide_int)


def test_node_count_is_bounded() -> None:
    nodes = [["ones", [], [["dtype", "bool"], ["shape", []]]]] * (MAX_NODES + 1)
    with pytest.raises(ProtocolError, match=f"nodes has {MAX_NODES + 1} items, want at most {MAX_NODES}"):
        decode_graph(_pack([1, [], [], nodes, [0]]))


def test_total_elements_are_bounded() -> None:
    node = ["zeros", [], [["dtype", "bool"], ["shape", [1 << 19, 1 << 18]]]]
    with pytest.raises(ProtocolError, match="over 68719476736 elements"):
        decode_graph(_pack([1, [], [], [node], [0]]))
    nodes = [["zeros", [], [["dtype", "bool"], ["shape", [1 << 18, 1 << 17]]]]] * 40
    with pytest.raises(ProtocolError, match="hold over 1099511627776 elements"):
        decode_graph(_pack([1, [], [], nodes, [0]]))


@pytest.mark.parametrize(
    "data",
    [
        b"\x91" * 10_000 + b"\xc0",  # arrays nested 10,000 deep
        b"\x81\xa1k" * 10_000 + b"\xc0",  # maps nested 10,000 deep
        b"\xdd\xff\xff\xff\xff",  # array32 claiming 4 G items
        b"\xdf\xff\xff\xff\xff",  # map32 claiming 4 G pairs
        b"\xdb\xff\xff\xff\xff",  # str32 claiming 4 GiB
        b"\xc6\xff\xff\xff\xff",  # bin32 claiming 4 GiB
        b"\xc9\xff\xff\xff\xff\x05",  # ext32 claiming 4 GiB
        b"\x95\x01\x90\x90\xdd\x7f\xff\xff\xff\x90",  # a graph whose node list claims 2 G nodes
        b"\xc1",  # never-used byte
    ],
)
def test_hostile_bytes_raise_only_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_graph(data)


def test_non_bytes_are_refused() -> None:
    with pytest.raises(ProtocolError, match="graph bytes must be bytes"):
        decode_graph("not bytes")


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_protocol_error(data: bytes) -> None:
    try:
        decode_graph(data)
    except ProtocolError:
        pass


_leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=8)
)
_trees = st.recursive(
    _leaves,
    lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=4), kids, max_size=3),
    max_leaves=40,
)


@FUZZ
@given(_trees)
def test_arbitrary_msgpack_trees_raise_only_protocol_error(tree: Any) -> None:
    try:
        decode_graph(_pack(tree))
    except ProtocolError:
        pass


def _paths(tree: Any, prefix: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    out = [prefix] if prefix else []
    if isinstance(tree, list):
        for k, sub in enumerate(tree):
            out.extend(_paths(sub, (*prefix, k)))
    return out


_PATHS = _paths(_tree())


@FUZZ
@given(st.sampled_from(_PATHS), _trees)
def test_a_valid_graph_with_any_part_replaced_raises_only_protocol_error(
    path: tuple[int, ...], value: Any
) -> None:
    try:
        graph = decode_graph(_with(path, value))
    except ProtocolError:
        return
    assert encode_graph(graph) == _with(path, value)


def test_graph_size_counts_nodes_and_outputs_without_decoding_them() -> None:
    nodes = tuple(Node("negative", (k,)) for k in range(5000))
    raw = encode_graph(Graph((TensorSpec("float32", (4,)),), (), nodes, (5000, 3, 1)))
    assert graph_size(raw) == (5000, 3)


@pytest.mark.parametrize("raw", [b"", b"\x91\x01", b"\x95\x01\x90\x90", msgpack.packb([1, [], [], 7, []])])
def test_graph_size_of_bytes_that_are_not_a_graph_is_a_protocol_error(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        graph_size(raw)
