"""Shape and dtype inference, attr checking and the op table itself."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from emberlink.errors import DTypeError, ShapeError
from emberlink.graph_replay.ir import (
    DTYPES,
    KIND_OF_DTYPE,
    AttrValue,
    Graph,
    Node,
    TensorSpec,
    binding_spec,
    kind_of_scalar,
)
from emberlink.graph_replay.ops import (
    ATTR_KINDS,
    OPS,
    check_attrs,
    graph_specs,
    infer,
    op_names,
    operand_dtype,
)

F32 = "float32"


def t(dtype: str, *shape: int) -> TensorSpec:
    return TensorSpec(dtype, shape)


B_INT, B_FLOAT, B_BOOL = binding_spec("int"), binding_spec("float"), binding_spec("bool")


def test_op_table_is_exactly_the_ops_of_internals_section_2() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "internals.md").read_text()
    section = doc.split("**Ops**", 1)[1].split("`getitem` keys", 1)[0]
    names = set()
    for line in section.splitlines():
        cells = line.split("|")
        if len(cells) > 3 and not set(cells[2].strip()) <= {"-"}:
            names.update(re.findall(r"`(\w+)`", re.sub(r"\(.*?\)", "", cells[2])))
    assert names == set(OPS)
    assert op_names() == tuple(sorted(OPS))


def test_every_declared_attr_is_on_the_allow_list() -> None:
    for opdef in OPS.values():
        for name, kind in opdef.attrs.items():
            assert kind in ATTR_KINDS[name], (opdef.name, name, kind)
        assert set(opdef.defaults) <= set(opdef.attrs)


def test_check_attrs_sorts_and_fills_defaults() -> None:
    assert check_attrs("sum", {"axis": 1}) == (("axis", 1), ("keepdims", False))
    assert check_attrs("sum", [("keepdims", True), ("axis", None)]) == (("axis", None), ("keepdims", True))


def test_check_attrs_without_defaults_needs_every_attr() -> None:
    with pytest.raises(ShapeError, match="sum: missing attr 'keepdims'"):
        check_attrs("sum", {"axis": 1}, fill_defaults=False)


@pytest.mark.parametrize(
    ("op", "attrs", "exc", "message"),
    [
        ("sum", {"axis": True}, DTypeError, "sum: attr 'axis' must be"),
        ("sum", {"axis": 1.0}, DTypeError, "sum: attr 'axis'"),
        ("sum", {"axis": [0, 1]}, DTypeError, "sum: attr 'axis'"),
        ("sum", {"axiss": 1}, ShapeError, "sum: unknown attr 'axiss'"),
        ("reshape", {"shape": (2, -1)}, DTypeError, "non-negative"),
        ("reshape", {"shape": (2, 2**70)}, DTypeError, "reshape: attr 'shape'"),
        ("astype", {"dtype": "uint16"}, DTypeError, "astype: attr 'dtype' must be one of"),
        ("rand", {"shape": (2,), "dtype": "int32"}, DTypeError, "rand: attr 'dtype'"),
        ("arange", {"start": 0, "stop": float("nan"), "step": 1, "dtype": F32}, DTypeError, "finite"),
        ("cross_entropy", {"reduction": "avg"}, DTypeError, "reduction"),
        ("getitem", {"key": (("s", 0, 2, 0),)}, ShapeError, "not normalized"),
        ("getitem", {"key": (("s", -1, 2, 1),)}, ShapeError, "not normalized"),
        ("getitem", {"key": (("x", 1),)}, DTypeError, "malformed key item"),
        ("getitem", {"key": (("i", True),)}, DTypeError, "malformed key item"),
        ("no_such_op", {}, ShapeError, "unknown op 'no_such_op'"),
    ],
)
def test_bad_attrs_are_refused_naming_op_and_attr(
    op: str, attrs: dict[str, Any], exc: type, message: str
) -> None:
    with pytest.raises(exc, match=re.escape(message)):
        check_attrs(op, attrs)


def test_matmul_misaligned_shapes_name_both_shapes() -> None:
    with pytest.raises(ShapeError, match=re.escape("matmul: shapes (3, 4) and (5, 2) do not align: 4 != 5")):
        infer("matmul", [t(F32, 3, 4), t(F32, 5, 2)])


@pytest.mark.parametrize(
    ("a", "b", "out"),
    [
        ((3, 4), (4, 2), (3, 2)),
        ((4,), (4, 2), (2,)),
        ((3, 4), (4,), (3,)),
        ((4,), (4,), ()),
        ((7, 1, 3, 4), (5, 4, 2), (7, 5, 3, 2)),
    ],
)
def test_matmul_follows_numpy_shapes(a: tuple[int, ...], b: tuple[int, ...], out: tuple[int, ...]) -> None:
    assert infer("matmul", [t(F32, *a), t(F32, *b)]) == t(F32, *out)


def test_broadcast_failure_names_op_and_both_shapes() -> None:
    with pytest.raises(ShapeError, match=re.escape("add: shapes (3,) and (4,) do not broadcast")):
        infer("add", [t(F32, 3), t(F32, 4)])


@pytest.mark.parametrize(
    ("a", "b", "out"),
    [
        ("float32", "float64", "float64"),
        ("int32", "int64", "int64"),
        ("float16", "float32", "float32"),
        ("bool", "int32", "int32"),
        ("float16", "bool", "float16"),
        ("int64", "float16", "float16"),
        ("int32", "float32", "float32"),
        ("uint8", "int8", "int16"),
        ("uint8", "int16", "int16"),
        ("uint8", "int32", "int32"),
        ("uint8", "int64", "int64"),
        ("int8", "int16", "int16"),
        ("uint8", "uint8", "uint8"),
        ("bool", "uint8", "uint8"),
        ("uint8", "float16", "float16"),
        ("int16", "float32", "float32"),
    ],
)
def test_two_tensors_promote_per_internals(a: str, b: str, out: str) -> None:
    assert infer("add", [t(a, 2), t(b, 2)]).dtype == out
    assert infer("add", [t(b, 2), t(a, 2)]).dtype == out


@pytest.mark.parametrize(
    ("tensor", "scalar", "out"),
    [
        ("float16", "float", "float16"),
        ("float16", "int", "float16"),
        ("int32", "int", "int32"),
        ("int32", "bool", "int32"),
        ("int32", "float", "float32"),
        ("int64", "float", "float32"),
        ("bool", "int", "int64"),
        ("bool", "float", "float32"),
        ("uint8", "int", "uint8"),
        ("int8", "bool", "int8"),
        ("int16", "float", "float32"),
    ],
)
def test_weak_scalar_promotion(tensor: str, scalar: str, out: str) -> None:
    assert infer("multiply", [t(tensor, 2), binding_spec(scalar)]).dtype == out
    assert infer("multiply", [binding_spec(scalar), t(tensor, 2)]).dtype == out
    assert operand_dtype("multiply", [t(tensor, 2), binding_spec(scalar)]) == out


def test_int_pairs_promote_as_numpy_and_the_array_api_lattice() -> None:
    ints = [d for d in DTYPES if KIND_OF_DTYPE[d] == "int"]
    for a in ints:
        for b in ints:
            assert infer("add", [t(a, 2), t(b, 2)]).dtype == np.promote_types(a, b).name, (a, b)


def test_comparison_gives_bool_but_computes_in_promoted_dtype() -> None:
    specs = [t("int32", 3), B_FLOAT]
    assert infer("less", specs) == t("bool", 3)
    assert operand_dtype("less", specs) == "float32"


def test_divide_of_ints_is_float32() -> None:
    assert infer("divide", [t("int64", 3), t("int32", 3)]).dtype == "float32"
    assert infer("divide", [t("int32", 3), B_INT]).dtype == "float32"
    assert infer("divide", [t("float64", 3), B_INT]).dtype == "float64"


def test_binary_op_needs_a_tensor() -> None:
    with pytest.raises(DTypeError, match="add: needs at least one tensor, got int scalar and float scalar"):
        infer("add", [B_INT, B_FLOAT])


def test_where_of_two_scalars_takes_the_default_dtype_of_the_higher_kind() -> None:
    assert infer("where", [t("bool", 2, 3), B_FLOAT, B_INT]) == t("float32", 2, 3)
    assert infer("where", [t("bool", 3), t("float16", 2, 1), B_FLOAT]) == t("float16", 2, 3)


@pytest.mark.parametrize(
    ("op", "specs", "message"),
    [
        (
            "logical_and",
            [t("int32", 2), t("bool", 2)],
            "logical_and: needs bool operands, got int32 and bool",
        ),
        ("add", [t("bool", 2), t("bool", 2)], "add: needs numeric operands, got bool and bool"),
        ("subtract", [t("bool", 2), B_BOOL], "subtract: needs numeric operands, got bool and bool scalar"),
        ("negative", [t("bool", 2)], "negative: needs a numeric operand, got bool"),
        ("trunc", [t("bool", 2)], "trunc: needs a numeric operand, got bool"),
        ("isinf", [t("bool", 2)], "isinf: needs a numeric operand, got bool"),
        ("logical_not", [t("float32", 2)], "logical_not: needs a bool operand, got float32"),
        ("where", [t("int32", 2), t("float32", 2), t("float32", 2)], "where: condition must be bool"),
        ("exp", [B_FLOAT], "exp: input 0 must be a tensor, got a float scalar"),
        ("full", [t("float32", 2)], "full: input 0 must be a binding"),
        ("rand", [B_FLOAT], "rand: input 0 must be an int binding, got a float scalar"),
        ("take", [t("float32", 3), t("float32", 2)], "take: indices must be int32 or int64, got float32"),
        (
            "cross_entropy",
            [t("int32", 2, 3), t("int64", 2)],
            "cross_entropy: logits must be float, got int32",
        ),
        ("matmul", [t("bool", 2, 2), t("bool", 2, 2)], "matmul: needs numeric operands, got bool and bool"),
    ],
)
def test_dtype_errors_name_op_and_dtypes(op: str, specs: list[TensorSpec], message: str) -> None:
    with pytest.raises(DTypeError, match=re.escape(message)):
        infer(op, specs, {"shape": (2,), "dtype": F32} if op in ("full", "rand") else {})


@pytest.mark.parametrize(
    ("op", "specs", "attrs", "message"),
    [
        ("add", [t(F32, 2)], {}, "add: takes 2 inputs, got 1"),
        ("concat", [], {}, "concat: takes 1 to 64 inputs, got 0"),
        ("sum", [t(F32, 2, 3)], {"axis": 2}, "sum: axis 2 is out of range for rank 2"),
        ("sum", [t(F32, 2, 3)], {"axis": (1, -1)}, "sum: repeated axis in (1, -1) for shape (2, 3)"),
        ("max", [t(F32, 0, 3)], {"axis": 0}, "max: cannot reduce shape (0, 3) over an empty axis"),
        ("argmax", [t(F32, 0)], {}, "argmax: cannot reduce shape (0,)"),
        (
            "reshape",
            [t(F32, 2, 3)],
            {"shape": (4, 2)},
            "reshape: cannot reshape (2, 3) (6 elements) to (4, 2)",
        ),
        ("permute_dims", [t(F32, 2, 3)], {"axes": (0, 0)}, "permute_dims: axes (0, 0) are not a permutation"),
        (
            "broadcast_to",
            [t(F32, 2, 3)],
            {"shape": (3, 3)},
            "broadcast_to: cannot broadcast shape (2, 3) to (3, 3)",
        ),
        ("expand_dims", [t(F32, 2)], {"axis": 2}, "expand_dims: axis 2 is out of range for rank 1"),
        ("squeeze", [t(F32, 2, 1)], {"axis": (0,)}, "squeeze: cannot squeeze axes (0,) of shape (2, 1)"),
        (
            "concat",
            [t(F32, 2, 3), t(F32, 2, 4)],
            {"axis": 0},
            "concat: shapes (2, 3), (2, 4) differ off axis 0",
        ),
        ("stack", [t(F32, 2), t(F32, 3)], {}, "stack: shapes (2,), (3,) are not all equal"),
        ("getitem", [t(F32, 2, 3)], {"key": (("i", 2),)}, "getitem: index 2 is out of range for axis 0"),
        ("getitem", [t(F32, 2)], {"key": (("i", 0), ("i", 0))}, "indexes more axes than shape (2,) has"),
        ("getitem", [t(F32, 2)], {"key": (("s", 0, 3, 1),)}, "slice 0:3 is out of range for axis 0"),
        (
            "cross_entropy",
            [t(F32, 4, 3), t("int64", 3)],
            {},
            "needs logits [N, C>0] and labels [N], got (4, 3) and (3,)",
        ),
        ("arange", [], {"start": 0, "stop": 3, "step": 0, "dtype": F32}, "arange: step must not be 0"),
        (
            "getitem_grad",
            [t(F32, 2)],
            {"key": (("i", 0),), "shape": (3, 3)},
            "getitem_grad: gradient shape (2,) != (3,)",
        ),
        (
            "scatter_add",
            [t(F32, 2, 5), t("int64", 3)],
            {"axis": 0, "size": 4},
            "does not hold indices shape (3,)",
        ),
        (
            "take",
            [t(F32, 0, 2), t("int64", 1)],
            {"axis": 0},
            "take: cannot take (1,) indices from empty axis 0",
        ),
    ],
)
def test_shape_errors_name_op_and_shapes(
    op: str, specs: list[TensorSpec], attrs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ShapeError, match=re.escape(message)):
        infer(op, specs, attrs)


@pytest.mark.parametrize(
    ("op", "specs", "attrs", "out"),
    [
        ("zeros", [], {"shape": (2, 3), "dtype": "int32"}, t("int32", 2, 3)),
        ("full", [B_FLOAT], {"shape": (2,), "dtype": "float16"}, t("float16", 2)),
        ("arange", [], {"start": 0, "stop": 10, "step": 3, "dtype": "int64"}, t("int64", 4)),
        ("arange", [], {"start": 0.0, "stop": 1.0, "step": 0.25, "dtype": F32}, t(F32, 4)),
        ("arange", [], {"start": 5, "stop": 0, "step": 1, "dtype": F32}, t(F32, 0)),
        ("eye", [], {"n": 2, "m": 3, "dtype": F32}, t(F32, 2, 3)),
        ("randn", [B_INT], {"shape": (4,), "dtype": F32}, t(F32, 4)),
        ("exp", [t("int32", 3)], {}, t(F32, 3)),
        ("sqrt", [t("float16", 3)], {}, t("float16", 3)),
        ("abs", [t("int64", 3)], {}, t("int64", 3)),
        ("floor", [t("int32", 3)], {}, t("int32", 3)),
        ("round", [t("float16", 3)], {}, t("float16", 3)),
        ("log1p", [t("bool", 3)], {}, t(F32, 3)),
        ("arctan", [t("float64", 3)], {}, t("float64", 3)),
        ("isnan", [t("int64", 2, 3)], {}, t("bool", 2, 3)),
        ("isfinite", [t("float16", 3)], {}, t("bool", 3)),
        ("sum", [t("bool", 2, 3)], {"axis": -1}, t("int64", 2)),
        ("sum", [t("int32", 2, 3)], {"axis": (0, 1), "keepdims": True}, t("int64", 1, 1)),
        ("sum", [t("float16", 2, 3)], {}, t("float16")),
        ("mean", [t("int32", 2, 3)], {"axis": 0}, t(F32, 3)),
        ("max", [t("bool", 2, 3)], {"axis": -2, "keepdims": True}, t("bool", 1, 3)),
        ("argmax", [t(F32, 2, 3)], {"axis": -1}, t("int64", 2)),
        ("argmin", [t(F32, 2, 3)], {"keepdims": True}, t("int64", 1, 1)),
        ("permute_dims", [t(F32, 2, 3, 4)], {"axes": (2, 0, -2)}, t(F32, 4, 2, 3)),
        ("expand_dims", [t(F32, 2, 3)], {"axis": -1}, t(F32, 2, 3, 1)),
        ("squeeze", [t(F32, 1, 3, 1)], {"axis": (0, -1)}, t(F32, 3)),
        ("concat", [t("int32", 2, 3), t(F32, 2, 1)], {"axis": -1}, t(F32, 2, 4)),
        ("stack", [t(F32, 2, 3)] * 3, {"axis": -1}, t(F32, 2, 3, 3)),
        ("getitem", [t(F32, 5, 6, 7)], {"key": (("s", 1, 5, 2), ("n",), ("i", 3))}, t(F32, 2, 1, 7)),
        ("take", [t(F32, 5, 6)], {"axis": 1}, t(F32, 5, 2, 3)),
        ("take", [t(F32, 5, 6)], {}, t(F32, 2, 3)),
        ("cross_entropy", [t("float16", 4, 3), t("int32", 4)], {"reduction": "none"}, t("float16", 4)),
        ("cross_entropy", [t(F32, 4, 3), t("int64", 4)], {}, t(F32)),
        ("one_hot", [t("int64", 4)], {"num_classes": 3, "dtype": "bool"}, t("bool", 4, 3)),
        ("getitem_grad", [t(F32, 2, 7)], {"key": (("s", 1, 5, 2),), "shape": (5, 7)}, t(F32, 5, 7)),
        ("scatter_add", [t(F32, 5, 2, 3)], {"axis": 1, "size": 6}, t(F32, 5, 6)),
        ("scatter_add", [t(F32, 2, 3)], {"axis": None, "size": 6}, t(F32, 6)),
        ("softmax", [t("float64", 2, 3)], {"axis": 0}, t("float64", 2, 3)),
        ("log_softmax", [t("int32", 2, 3)], {}, t(F32, 2, 3)),
    ],
)
def test_infer_gives_the_output_spec(
    op: str, specs: list[TensorSpec], attrs: dict[str, Any], out: TensorSpec
) -> None:
    if op == "take":
        specs = [*specs, t("int64", 2, 3)]
    if op == "scatter_add":
        specs = [*specs, t("int32", 2, 3)]
    assert infer(op, specs, attrs) == out


def test_tensor_spec_refuses_unknown_dtype_and_bad_shapes() -> None:
    with pytest.raises(DTypeError, match="unknown dtype 'uint16'"):
        TensorSpec("uint16", (2,))
    with pytest.raises(ShapeError, match="non-negative ints"):
        TensorSpec("float32", (2, -1))
    with pytest.raises(ShapeError, match="non-negative ints"):
        TensorSpec("float32", [2])  # type: ignore[arg-type]
    with pytest.raises(ShapeError, match="rank 17 is over the limit of 16"):
        TensorSpec("float32", (1,) * 17)
    assert TensorSpec("float16", (3, 4)).nbytes == 24
    assert set(DTYPES) == {
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "float32",
        "float64",
    }


def test_kind_of_scalar_refuses_non_python_scalars() -> None:
    assert [kind_of_scalar(v) for v in (True, 3, 2.5)] == ["bool", "int", "float"]
    with pytest.raises(DTypeError):
        kind_of_scalar("3")


def test_graph_specs_infers_every_value_and_checks_references() -> None:
    g = Graph(
        inputs=(t(F32, 2, 3),),
        bindings=("float",),
        nodes=(Node("multiply", (0, 1)), Node("sum", (2,), check_attrs("sum", {"axis": 1}))),
        outputs=(3,),
    )
    assert graph_specs(g)[2:] == (t(F32, 2, 3), t(F32, 2))
    forward = Graph(g.inputs, g.bindings, (Node("exp", (2,)),), (2,))
    with pytest.raises(ShapeError, match=r"node 0 \(exp\): input 2 is not an earlier value"):
        graph_specs(forward)
    with pytest.raises(ShapeError, match="output 1 is a binding"):
        graph_specs(Graph(g.inputs, g.bindings, g.nodes, (1,)))


# -- binding dtypes ------------------------------------------------------------------------------


def test_binding_dtypes_give_the_one_dtype_each_binding_is_cast_to() -> None:
    from emberlink.graph_replay.ir import Graph, Node
    from emberlink.graph_replay.ops import binding_dtypes

    f32, f64 = TensorSpec("float32", (3,)), TensorSpec("float64", (3,))
    g = Graph(
        (f32, f64, TensorSpec("int32", (3,))),
        ("float", "float", "float", "int", "float", "int"),
        (
            Node("multiply", (0, 3)),  # b0: float32
            Node("multiply", (0, 4)),  # b1: float32 ...
            Node("add", (1, 4)),  # ... and float64: no single dtype
            Node("greater", (2, 6)),  # b3 (int) against int32
            Node("full", (7,), check_attrs("full", {"shape": (2,), "dtype": "float64"})),  # b4: float64
            Node("divide", (2, 5)),  # b2: int32 / float -> float32
        ),
        (9, 10, 11, 12, 13, 14),
    )
    # b5 is used by nothing: no dtype
    assert binding_dtypes(g) == ("float32", None, "float32", "int32", "float64", None)


@pytest.mark.parametrize(
    ("start", "stop", "step"),
    [(-(1 << 63), (1 << 63) - 1, 1), ((1 << 63) - 1, -(1 << 63), -1), (0, 1e300, 1e-300)],
)
def test_an_arange_longer_than_any_array_is_a_shape_error(start: float, stop: float, step: float) -> None:
    attrs: dict[str, AttrValue] = {"start": start, "stop": stop, "step": step, "dtype": "float64"}
    with pytest.raises(ShapeError, match="arange"):
        infer("arange", [], attrs)


def test_a_slice_of_an_axis_past_the_index_range_has_its_exact_length() -> None:
    x = TensorSpec("float32", ((1 << 63) - 1,))
    assert infer("getitem", [x], {"key": (("s", 0, (1 << 63) - 1, 2),)}).shape == (1 << 62,)
