"""Every tensor op against NumPy: values, dtypes and shapes, through the public API."""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest

import emberlink as el
from emberlink import Device
from tests.graph_replay.cases import SPECIALS, UNARY, expect_ignoring_errors

F32 = np.float32


def arr(rng: np.random.Generator, *shape: int, dtype: str = "float32", lo: float = -2.0, hi: float = 2.0):
    return rng.uniform(lo, hi, size=shape).astype(dtype)


def check(t: el.Tensor, expected: npt.ArrayLike, *, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    want = np.asarray(expected)
    got = t.numpy()
    assert t.shape == want.shape == got.shape
    assert t.dtype == str(got.dtype)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


# -- unary ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_op_matches_numpy_as_method_and_function(dev: Device, rng, name: str, dtype: str) -> None:
    row = UNARY[name]
    a = arr(rng, 3, 4, dtype=dtype, lo=max(row.lo, -2.0), hi=min(row.hi, 2.0))
    x = dev.tensor(a)
    expected = row.expect(a)
    for got in (getattr(x, name)(), getattr(el, name)(x)):
        assert got.dtype == expected.dtype.name
        check(got, expected, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_op_on_nan_infinities_signed_zeros_and_ties_matches_numpy(dev: Device, name: str) -> None:
    got = getattr(el, name)(dev.tensor(SPECIALS))
    expected = expect_ignoring_errors(UNARY[name].expect)(SPECIALS)
    assert got.dtype == expected.dtype.name
    check(got, expected, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("name", ["floor", "ceil", "round", "trunc"])
def test_rounding_an_int_tensor_keeps_its_values_and_dtype(dev: Device, name: str) -> None:
    a = np.array([-3, 0, 7], dtype="int32")
    got = getattr(dev.tensor(a), name)()
    assert got.dtype == "int32"
    np.testing.assert_array_equal(got.numpy(), a)


def test_round_takes_ties_to_even_as_the_array_api_says(dev: Device) -> None:
    x = dev.tensor(np.array([0.5, 1.5, 2.5, -0.5, -1.5], dtype="float32"))
    np.testing.assert_array_equal(el.round(x).numpy(), [0.0, 2.0, 2.0, -0.0, -2.0])


@pytest.mark.parametrize("name", ["isnan", "isinf", "isfinite"])
def test_predicates_give_bool_and_refuse_a_bool_tensor(dev: Device, name: str) -> None:
    assert getattr(el, name)(dev.tensor(np.array([1, 2], dtype="int64"))).dtype == "bool"
    with pytest.raises(el.DTypeError, match=f"{name}: needs a numeric operand, got bool"):
        getattr(el, name)(dev.tensor(np.array([True])))


def test_python_operators_for_unary_ops(dev: Device, rng) -> None:
    a = arr(rng, 5)
    x = dev.tensor(a)
    check(-x, -a)
    check(abs(x), np.abs(a))
    assert +x is x
    m = dev.tensor(a > 0)
    check(~m, ~(a > 0))


def test_float_only_unary_op_on_ints_computes_in_float32(dev: Device) -> None:
    x = dev.tensor(np.array([1, 2, 3], dtype="int64"))
    check(x.exp(), np.exp(np.array([1, 2, 3], dtype="float32")), rtol=1e-6)
    check(x.abs(), np.array([1, 2, 3]))
    assert x.square().dtype == "int64"


# -- binary -----------------------------------------------------------------------------------------

BINARY = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "divide": np.divide,
    "pow": np.power,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "equal": np.equal,
    "not_equal": np.not_equal,
    "less": np.less,
    "less_equal": np.less_equal,
    "greater": np.greater,
    "greater_equal": np.greater_equal,
}

SHAPE_PAIRS = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 4), (3, 1)), ((), (2, 3)), ((4, 1), (1, 5))]


@pytest.mark.parametrize(("sa", "sb"), SHAPE_PAIRS)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_op_broadcasts_like_numpy(dev: Device, rng, name: str, sa, sb) -> None:
    lo = 0.5 if name == "pow" else -2.0
    a, b = arr(rng, *sa, lo=lo), arr(rng, *sb)
    b[np.abs(b) < 0.1] = 0.5  # no division by ~0
    check(getattr(el, name)(dev.tensor(a), dev.tensor(b)), BINARY[name](a, b), rtol=1e-5)


OPERATORS = [
    ("+", operator.add, np.add),
    ("-", operator.sub, np.subtract),
    ("*", operator.mul, np.multiply),
    ("/", operator.truediv, np.divide),
    ("**", operator.pow, np.power),
    ("==", operator.eq, np.equal),
    ("!=", operator.ne, np.not_equal),
    ("<", operator.lt, np.less),
    ("<=", operator.le, np.less_equal),
    (">", operator.gt, np.greater),
    (">=", operator.ge, np.greater_equal),
]


@pytest.mark.parametrize(("sym", "op", "ref"), OPERATORS, ids=[s for s, _, _ in OPERATORS])
def test_operator_with_python_scalar_on_either_side(dev: Device, rng, sym: str, op, ref) -> None:
    a = arr(rng, 2, 3, lo=0.5)
    x = dev.tensor(a)
    right, left = op(x, 1.5), op(1.5, x)  # the second goes through the reflected method
    check(right, ref(a, F32(1.5)), rtol=1e-6)
    check(left, ref(F32(1.5), a), rtol=1e-6)
    assert right.dtype in ("float32", "bool")


def test_operators_between_tensors_and_numpy_scalars(dev: Device) -> None:
    x = dev.tensor(np.array([1.0, 2.0], dtype="float32"))
    check(x * np.float64(2.0), np.array([2.0, 4.0], dtype="float32"))
    check(np.int64(3) - x, np.array([2.0, 1.0], dtype="float32"))


def test_logical_ops_and_bool_operators(dev: Device) -> None:
    a = np.array([True, True, False, False])
    b = np.array([True, False, True, False])
    x, y = dev.tensor(a), dev.tensor(b)
    check(x & y, a & b)
    check(x | y, a | b)
    check(el.logical_and(x, y), a & b)
    check(el.logical_or(x, True), a | True)
    check(el.logical_not(x), ~a)


@pytest.mark.parametrize(
    ("da", "db", "expected"),
    [
        ("float16", "float32", "float32"),
        ("float32", "float64", "float64"),
        ("int32", "int64", "int64"),
        ("int64", "float16", "float16"),
        ("bool", "int32", "int32"),
        ("bool", "float32", "float32"),
    ],
)
def test_two_tensors_promote_per_the_contract(dev: Device, da: str, db: str, expected: str) -> None:
    x = dev.tensor(np.ones(3, dtype=da))
    y = dev.tensor(np.ones(3, dtype=db))
    out = x + y if "bool" not in (da, db) else el.maximum(x, y)
    assert out.dtype == expected
    assert out.numpy().dtype == np.dtype(expected)


@pytest.mark.parametrize(
    ("dtype", "scalar", "expected"),
    [
        ("float16", 0.5, "float16"),
        ("int32", 2, "int32"),
        ("int32", 2.5, "float32"),
        ("bool", 1, "int64"),
        ("bool", 1.5, "float32"),
        ("float64", True, "float64"),
    ],
)
def test_python_scalar_never_widens_a_tensor_of_its_kind(dev: Device, dtype, scalar, expected) -> None:
    x = dev.tensor(np.ones(3, dtype=dtype))
    out = x * scalar
    assert out.dtype == expected
    assert out.numpy().dtype == np.dtype(expected)


def test_int_division_gives_float32(dev: Device) -> None:
    x = dev.tensor(np.array([1, 2, 3], dtype="int32"))
    check(x / 2, np.array([0.5, 1.0, 1.5], dtype="float32"))


def test_float16_arithmetic_stays_float16(dev: Device, rng) -> None:
    a = arr(rng, 8, dtype="float16")
    check(dev.tensor(a) * 2 + 1, (a * 2 + 1).astype("float16"), rtol=1e-3)


# -- reductions -------------------------------------------------------------------------------------

REDUCTIONS: dict[str, Callable[..., np.ndarray]] = {
    "sum": np.sum,
    "mean": np.mean,
    "max": np.max,
    "min": np.min,
    "prod": np.prod,
}


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2), (0, 1, 2)])
@pytest.mark.parametrize("name", sorted(REDUCTIONS))
def test_reduction_matches_numpy(dev: Device, rng, name: str, axis, keepdims: bool) -> None:
    a = arr(rng, 2, 3, 4, lo=0.5, hi=1.5)
    got = getattr(dev.tensor(a), name)(axis=axis, keepdims=keepdims)
    check(got, REDUCTIONS[name](a, axis=axis, keepdims=keepdims).astype("float32"), rtol=1e-5)


def test_any_and_all(dev: Device) -> None:
    a = np.array([[0.0, 1.0], [0.0, 0.0]], dtype="float32")
    x = dev.tensor(a)
    check(x.any(), np.any(a))
    check(x.any(axis=1), np.any(a, axis=1))
    check((x >= 0).all(), np.all(a >= 0))
    check(x.all(axis=0, keepdims=True), np.all(a, axis=0, keepdims=True))


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
@pytest.mark.parametrize("name", ["argmax", "argmin"])
def test_argmax_argmin_match_numpy(dev: Device, rng, name: str, axis) -> None:
    a = arr(rng, 3, 5)
    x = dev.tensor(a)
    got = getattr(x, name)(axis=axis)
    assert got.dtype == "int64"
    check(got, getattr(np, name)(a, axis=axis))
    check(getattr(el, name)(x, axis=axis, keepdims=True), getattr(np, name)(a, axis=axis, keepdims=True))


def test_sum_of_ints_is_int64_and_mean_is_float32(dev: Device) -> None:
    x = dev.tensor(np.array([[1, 2], [3, 4]], dtype="int32"))
    check(x.sum(), np.int64(10))
    check(x.mean(0), np.array([2.0, 3.0], dtype="float32"))
    check(el.sum(x, 1), np.array([3, 7]))


# -- matmul and shapes ------------------------------------------------------------------------------

MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((4,), (4, 5)),
    ((3, 4), (4,)),
    ((4,), (4,)),
    ((2, 3, 4), (4, 5)),
    ((2, 1, 3, 4), (5, 4, 2)),
]


@pytest.mark.parametrize(("sa", "sb"), MATMUL_SHAPES)
def test_matmul_matches_numpy(dev: Device, rng, sa, sb) -> None:
    a, b = arr(rng, *sa), arr(rng, *sb)
    x, y = dev.tensor(a), dev.tensor(b)
    check(x @ y, a @ b, rtol=1e-5)
    check(el.matmul(x, y), a @ b, rtol=1e-5)
    check(x.matmul(y), a @ b, rtol=1e-5)


def test_reshape_accepts_minus_one_and_both_spellings(dev: Device, rng) -> None:
    a = arr(rng, 2, 3, 4)
    x = dev.tensor(a)
    check(x.reshape(6, -1), a.reshape(6, -1))
    check(x.reshape((-1,)), a.reshape(-1))
    check(el.reshape(x, (4, 6)), a.reshape(4, 6))
    check(x.flatten(), a.reshape(-1))
    assert x.reshape(2, 3, 4) is x


def test_permute_transpose_and_T(dev: Device, rng) -> None:
    a = arr(rng, 2, 3, 4)
    x = dev.tensor(a)
    check(x.permute(2, 0, 1), a.transpose(2, 0, 1))
    check(el.permute_dims(x, (1, 2, 0)), a.transpose(1, 2, 0))
    check(x.transpose(0, 2), a.swapaxes(0, 2))
    check(x.mT, a.swapaxes(-1, -2))
    check(x.T, a.T)
    m = arr(rng, 3, 5)
    check(dev.tensor(m).T, m.T)


def test_broadcast_to_expand_dims_and_squeeze(dev: Device, rng) -> None:
    a = arr(rng, 3, 1)
    x = dev.tensor(a)
    check(x.broadcast_to(2, 3, 4), np.broadcast_to(a, (2, 3, 4)))
    check(el.broadcast_to(x, (3, 5)), np.broadcast_to(a, (3, 5)))
    check(x.expand_dims(0), a[None])
    check(el.expand_dims(x, -1), a[..., None])
    check(x.squeeze(), a.squeeze())
    check(el.squeeze(x.expand_dims(0), 0), a)
    b = arr(rng, 1, 3, 1, 2)
    check(dev.tensor(b).squeeze((0, 2)), b.squeeze((0, 2)))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat_and_stack(dev: Device, rng, axis: int) -> None:
    parts = [arr(rng, 2, 3) for _ in range(3)]
    ts = [dev.tensor(p) for p in parts]
    check(el.concat(ts, axis=axis), np.concatenate(parts, axis=axis))
    check(el.stack(ts, axis=axis), np.stack(parts, axis=axis))


def test_concat_and_stack_of_more_than_64_tensors(dev: Device, rng) -> None:
    parts = [arr(rng, 2) for _ in range(150)]
    ts = [dev.tensor(p) for p in parts]
    check(el.concat(ts), np.concatenate(parts))
    check(el.stack(ts, axis=1), np.stack(parts, axis=1))


def test_concat_promotes_dtypes(dev: Device) -> None:
    out = el.concat([dev.tensor(np.ones(2, "float32")), dev.tensor(np.ones(2, "float64"))])
    assert out.dtype == "float64"


# -- indexing ---------------------------------------------------------------------------------------

KEYS = [
    1,
    -1,
    slice(None),
    slice(1, None),
    slice(None, -1),
    slice(-3, -1),
    slice(None, None, 2),
    slice(None, None, -1),
    slice(-1, 0, -2),
    slice(5, 1, 1),
    (1, 2),
    (slice(None), 0),
    (Ellipsis, 1),
    (None, 0),
    (0, None, slice(1, 3)),
    (slice(None, None, -1), slice(None, None, -2), 1),
    Ellipsis,
    (slice(1, 3), Ellipsis, None),
]


@pytest.mark.parametrize("key", KEYS, ids=[repr(k) for k in KEYS])
def test_basic_indexing_matches_numpy(dev: Device, rng, key) -> None:
    a = arr(rng, 4, 5, 3)
    check(dev.tensor(a)[key], a[key])


def test_out_of_range_index_raises_index_error(dev: Device, rng) -> None:
    x = dev.tensor(arr(rng, 3, 2))
    with pytest.raises(IndexError, match="out of range"):
        x[3]
    with pytest.raises(IndexError, match="too many indices"):
        x[0, 0, 0]


def test_integer_tensor_index_takes_along_its_axis(dev: Device, rng) -> None:
    a = arr(rng, 4, 5)
    x = dev.tensor(a)
    idx = np.array([3, 0, 3], dtype="int64")
    i = dev.tensor(idx)
    check(x[i], a[idx])
    check(x[:, i], a[:, idx])
    check(x[..., i], a[..., idx])
    check(x.take(i, axis=1), np.take(a, idx, axis=1))
    check(el.take(x, i, axis=None), np.take(a, idx))
    check(x[dev.tensor(np.array([[0, 1], [2, 3]]))], a[np.array([[0, 1], [2, 3]])])


def test_iteration_and_len(dev: Device, rng) -> None:
    a = arr(rng, 3, 2)
    x = dev.tensor(a)
    assert len(x) == 3
    rows = [r.numpy() for r in x]
    np.testing.assert_array_equal(np.stack(rows), a)


def test_where_with_tensors_and_scalars(dev: Device, rng) -> None:
    a, b = arr(rng, 3, 4), arr(rng, 4)
    c = a > 0
    cond, x, y = dev.tensor(c), dev.tensor(a), dev.tensor(b)
    check(el.where(cond, x, y), np.where(c, a, b))
    check(el.where(cond, x, 0.0), np.where(c, a, F32(0)))
    check(el.where(cond, 1.0, y), np.where(c, F32(1), b))


def test_astype_converts_and_is_identity_for_the_same_dtype(dev: Device, rng) -> None:
    a = arr(rng, 5)
    x = dev.tensor(a)
    check(x.astype("int32"), a.astype("int32"))
    check(el.astype(x, np.float64), a.astype("float64"))
    check(x.astype("bool"), a.astype(bool))
    assert x.astype("float32") is x


# -- creation ---------------------------------------------------------------------------------------


def test_creation_functions(dev: Device) -> None:
    check(dev.zeros((2, 3)), np.zeros((2, 3), "float32"))
    check(dev.ones(4, dtype="int32"), np.ones(4, "int32"))
    check(dev.full((2, 2), 7), np.full((2, 2), 7, "int64"))
    check(dev.full((2,), 2.5, dtype="float64"), np.full(2, 2.5))
    check(dev.full((1,), True), np.array([True]))
    check(dev.arange(5), np.arange(5))
    check(dev.arange(1, 10, 3), np.arange(1, 10, 3))
    check(dev.arange(0.0, 1.0, 0.25), np.arange(0, 1, 0.25, dtype="float32"))
    check(dev.arange(5, 0, -2), np.arange(5, 0, -2))
    check(dev.eye(3), np.eye(3, dtype="float32"))
    check(dev.eye(2, 4, k=1, dtype="int64"), np.eye(2, 4, k=1, dtype="int64"))


def test_rand_and_randn_are_deterministic_per_seed(dev: Device) -> None:
    u1 = dev.rand((1000,), seed=7).numpy()
    u2 = dev.rand((1000,), seed=7).numpy()
    u3 = dev.rand((1000,), seed=8).numpy()
    np.testing.assert_array_equal(u1, u2)
    assert not np.array_equal(u1, u3)
    assert u1.dtype == np.float32 and 0.0 <= u1.min() and u1.max() < 1.0
    assert abs(u1.mean() - 0.5) < 0.05
    n = dev.randn((2, 2000), seed=3, dtype="float64").numpy()
    assert n.dtype == np.float64 and abs(n.mean()) < 0.1 and abs(n.std() - 1.0) < 0.1


def test_tensor_follows_numpy_dtypes_and_torch_defaults_for_python_data(dev: Device) -> None:
    assert dev.tensor([1.0, 2.0]).dtype == "float32"
    assert dev.tensor([1, 2]).dtype == "int64"
    assert dev.tensor([True]).dtype == "bool"
    assert dev.tensor(3.0).shape == ()
    assert dev.tensor(np.zeros(2, "float64")).dtype == "float64"
    assert dev.tensor(np.zeros(2, "int32")).dtype == "int32"
    assert dev.tensor([1, 2], dtype="float16").dtype == "float16"
    assert dev.tensor(np.zeros(2, "float64"), dtype=np.float32).dtype == "float32"


def test_tensor_copies_its_data(dev: Device) -> None:
    a = np.array([1.0, 2.0], dtype="float32")
    x = dev.tensor(a)
    a[0] = 100.0
    np.testing.assert_array_equal(x.numpy(), [1.0, 2.0])
    out = x.numpy()
    out[1] = -1.0
    np.testing.assert_array_equal(x.numpy(), [1.0, 2.0])


def test_fortran_order_and_strided_inputs_upload_correctly(dev: Device, rng) -> None:
    a = np.asfortranarray(arr(rng, 3, 4))
    check(dev.tensor(a), a)
    check(dev.tensor(a[:, ::2]), a[:, ::2])


# -- reads and metadata -----------------------------------------------------------------------------


def test_reads_and_metadata(dev: Device) -> None:
    x = dev.tensor(np.array([[1.5, 2.0, 3.0]], dtype="float32"))
    assert x.shape == (1, 3) and x.dtype == "float32" and x.ndim == 2 and x.size == 3
    assert x.device is dev
    s = x.sum()
    assert float(s) == 6.5 and int(s) == 6 and s.item() == 6.5 and bool(s)
    assert isinstance(s.item(), float)
    assert isinstance(dev.tensor(3).item(), int)
    np.testing.assert_array_equal(np.asarray(x), [[1.5, 2.0, 3.0]])
    assert np.asarray(x, dtype="float64").dtype == np.float64
    assert "float32" in repr(x) and "(1, 3)" in repr(x)


def test_item_float_and_bool_need_one_element(dev: Device) -> None:
    x = dev.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="one element"):
        x.item()
    with pytest.raises(ValueError, match="ambiguous"):
        bool(x)
    with pytest.raises(TypeError):
        len(dev.tensor(1.0))


def test_to_another_device_reads_and_uploads(dev: Device, device_factory) -> None:
    other = device_factory()
    try:
        x = dev.tensor([1.0, 2.0]) * 2
        y = x.to(other)
        assert y.device is other and x.to(dev) is x
        np.testing.assert_array_equal((y + 1).numpy(), [3.0, 5.0])
    finally:
        other.close()


# -- training ops -----------------------------------------------------------------------------------


def _log_softmax(a: np.ndarray, axis: int) -> np.ndarray:
    s = a - a.max(axis=axis, keepdims=True)
    out: np.ndarray = s - np.log(np.exp(s).sum(axis=axis, keepdims=True))
    return out


def test_softmax_log_softmax_and_one_hot(dev: Device, rng) -> None:
    a = arr(rng, 3, 5)
    x = dev.tensor(a)
    F = el.nn.functional
    check(F.log_softmax(x), _log_softmax(a, 1), rtol=1e-5)
    check(F.softmax(x, axis=0), np.exp(_log_softmax(a, 0)), rtol=1e-5)
    labels = np.array([0, 4, 2])
    check(F.one_hot(dev.tensor(labels), 5), np.eye(5, dtype="float32")[labels])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_and_mse_match_numpy(dev: Device, rng, reduction: str) -> None:
    z, labels = arr(rng, 6, 4), rng.integers(0, 4, 6)
    nll = -_log_softmax(z, 1)[np.arange(6), labels]
    expected = {"mean": nll.mean(), "sum": nll.sum(), "none": nll}[reduction]
    F = el.nn.functional
    check(F.cross_entropy(dev.tensor(z), dev.tensor(labels), reduction=reduction), expected, rtol=1e-5)
    p, t = arr(rng, 3, 2), arr(rng, 3, 2)
    sq = (p - t) ** 2
    expected = {"mean": sq.mean(), "sum": sq.sum(), "none": sq}[reduction]
    check(F.mse_loss(dev.tensor(p), dev.tensor(t), reduction=reduction), expected, rtol=1e-5)
