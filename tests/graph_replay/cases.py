"""One table of op cases shared by the NumPy tests (against direct NumPy) and the CuPy tests (against NumPy).

A case is one node applied to fixed random inputs: arrays become graph inputs, Python scalars
bindings. `expect` computes the answer directly with NumPy, following docs/internals.md. A new op
gets a row here and is then covered on both backends; `test_every_op_has_a_case` enforces it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from emberlink.graph_replay.ir import Graph, Node, TensorSpec, kind_of_scalar
from emberlink.graph_replay.ops import check_attrs
from emberlink.graph_replay.plan import Plan, compile_plan

_rng = np.random.default_rng(20261130)


def f(*shape: int, dtype: str = "float32", lo: float = -3.0, hi: float = 3.0) -> np.ndarray:
    return _rng.uniform(lo, hi, size=shape).astype(dtype)


def i(*shape: int, dtype: str = "int32", lo: int = -5, hi: int = 6) -> np.ndarray:
    return _rng.integers(lo, hi, size=shape).astype(dtype)


def b(*shape: int) -> np.ndarray:
    return _rng.random(size=shape) < 0.5


@dataclass(frozen=True)
class Case:
    id: str
    op: str
    args: tuple[Any, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    expect: Callable[..., Any] | None = None

    def graph(self) -> Graph:
        inputs = [a for a in self.args if isinstance(a, np.ndarray)]
        scalars = [a for a in self.args if not isinstance(a, np.ndarray)]
        refs, n_in, ti, si = [], len(inputs), 0, 0
        for a in self.args:
            if isinstance(a, np.ndarray):
                refs.append(ti)
                ti += 1
            else:
                refs.append(n_in + si)
                si += 1
        node = Node(self.op, tuple(refs), check_attrs(self.op, self.attrs))
        return Graph(
            inputs=tuple(TensorSpec(str(a.dtype), a.shape) for a in inputs),
            bindings=tuple(kind_of_scalar(s) for s in scalars),
            nodes=(node,),
            outputs=(n_in + len(scalars),),
        )

    def plan(self) -> Plan:
        return compile_plan(self.graph())

    def inputs(self) -> list[np.ndarray]:
        return [a for a in self.args if isinstance(a, np.ndarray)]

    def bindings(self) -> list[Any]:
        return [a for a in self.args if not isinstance(a, np.ndarray)]


def run_case(backend: Any, case: Case) -> np.ndarray:
    """Run one case on `backend`; the output comes back as a NumPy array."""
    plan = case.plan()
    inputs = [backend.from_numpy(a) for a in case.inputs()]
    (out,) = backend.run(plan, inputs, case.bindings())
    result: np.ndarray = backend.to_numpy(out)
    return result


def assert_close(got: np.ndarray, want: Any, case_id: str, *, loose: bool = False) -> None:
    """Exact for bool and ints; relative tolerance by float dtype (looser across devices), scaled
    by the largest finite value; NaNs and infinities where `want` has them."""
    want = np.asarray(want)
    assert got.dtype == want.dtype, (case_id, got.dtype, want.dtype)
    assert got.shape == want.shape, (case_id, got.shape, want.shape)
    if got.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want, err_msg=case_id)
        return
    rtol = {"float16": 2e-3, "float32": 2e-6, "float64": 1e-12}[str(got.dtype)]
    if loose:
        rtol *= 50
    finite = np.abs(want[np.isfinite(want)].astype(np.float64))
    atol = rtol * max(1.0, float(finite.max())) if finite.size else rtol
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True, err_msg=case_id)


# -- independent references ------------------------------------------------------------------------

_M64 = (1 << 64) - 1


def _splitmix_ref(seed: int, count: int) -> list[int]:
    out, state = [], seed & _M64
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        out.append(z ^ (z >> 31))
    return out


def rand_ref(seed: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    bits = {"float16": 11, "float32": 24, "float64": 53}[dtype]
    words = _splitmix_ref(seed, math.prod(shape))
    return (
        np.array([(w >> (64 - bits)) / 2.0**bits for w in words], dtype=np.float64)
        .astype(dtype)
        .reshape(shape)
    )


def randn_ref(seed: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    words = _splitmix_ref(seed, 2 * math.prod(shape))
    vals = []
    for k in range(0, len(words), 2):
        u1, u2 = (words[k] >> 11) / 2.0**53, (words[k + 1] >> 11) / 2.0**53
        vals.append(math.sqrt(-2.0 * math.log1p(-u1)) * math.cos(2.0 * math.pi * u2))
    return np.array(vals, dtype=np.float64).astype(dtype).reshape(shape)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return (1 / (1 + np.exp(-x.astype(np.float64)))).astype(x.dtype)


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    x64 = x.astype(np.float64)
    m = x64.max(axis=axis, keepdims=True)
    out: np.ndarray = (x64 - m - np.log(np.exp(x64 - m).sum(axis=axis, keepdims=True))).astype(x.dtype)
    return out


def _cross_entropy(logits: np.ndarray, labels: np.ndarray, reduction: str) -> np.ndarray:
    lsm = _log_softmax(logits.astype(np.float64), 1)
    n, c = logits.shape
    nll = np.array([-lsm[k, labels[k]] if 0 <= labels[k] < c else np.nan for k in range(n)])
    out = {"none": nll, "sum": nll.sum(), "mean": nll.sum() / n if n else np.float64(np.nan)}[reduction]
    return np.asarray(out).astype(logits.dtype)


def _scatter_add(g: np.ndarray, idx: np.ndarray, axis: int | None, size: int) -> np.ndarray:
    if axis is None:
        out = np.zeros(size, g.dtype)
        for k, j in zip(idx.ravel(), g.ravel()):
            out[k] += j
        return out
    moved = np.moveaxis(g, range(axis, axis + idx.ndim), range(idx.ndim))
    out = np.zeros((size, *moved.shape[idx.ndim :]), g.dtype)
    for pos in np.ndindex(idx.shape):
        out[idx[pos]] += moved[pos]
    return np.moveaxis(out, 0, axis)


def unfold_ref(
    x: np.ndarray, kernel_size: tuple[int, int], dilation=(1, 1), padding=(0, 0), stride=(1, 1)
) -> np.ndarray:
    """torch.nn.functional.unfold by its definition, one element at a time."""
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = kernel_size, dilation, padding, stride
    n, c, h, w = x.shape
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((n, c * kh * kw, oh * ow), x.dtype)
    for b, ch, i, j, r, q in np.ndindex(n, c, kh, kw, oh, ow):
        y, z = r * sh - ph + i * dh, q * sw - pw + j * dw
        if 0 <= y < h and 0 <= z < w:
            out[b, (ch * kh + i) * kw + j, r * ow + q] = x[b, ch, y, z]
    return out


def fold_ref(
    cols: np.ndarray,
    output_size: tuple[int, int],
    kernel_size: tuple[int, int],
    dilation=(1, 1),
    padding=(0, 0),
    stride=(1, 1),
) -> np.ndarray:
    """torch.nn.functional.fold by its definition: each column entry added to its pixel (float64
    accumulation, then the input's dtype)."""
    (h, w), (kh, kw), (dh, dw), (ph, pw), (sh, sw) = output_size, kernel_size, dilation, padding, stride
    n, ck, _ = cols.shape
    c = ck // (kh * kw)
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    acc = np.float64 if cols.dtype.kind == "f" else cols.dtype
    out = np.zeros((n, c, h, w), acc)
    for b, ch, i, j, r, q in np.ndindex(n, c, kh, kw, oh, ow):
        y, z = r * sh - ph + i * dh, q * sw - pw + j * dw
        if 0 <= y < h and 0 <= z < w:
            out[b, ch, y, z] += cols[b, (ch * kh + i) * kw + j, r * ow + q]
    return out.astype(cols.dtype)


# -- the table -------------------------------------------------------------------------------------

F16, F32, F64 = "float16", "float32", "float64"
_pos = f(3, 4, lo=0.1, hi=5.0)
_x34, _y34, _x31, _x41 = f(3, 4), f(3, 4), f(3, 1), f(4, 1)
_logits, _labels = f(6, 5), i(6, lo=0, hi=5, dtype="int64")
_g = f(5, 2, 3)
_sidx = np.array([[0, 3, 3], [1, 0, 3]], dtype=np.int32)


@dataclass(frozen=True)
class Elementwise:
    """A unary elementwise op's case row: its meaning in direct NumPy (on an array of the op's
    result dtype's family, errors ignored) and the inputs it is defined on, `[lo, hi]`.

    The rows drive this table's cases (hence both backends), the client's value tests on every
    device kind, and, for differentiable ops, the client's gradient checks.
    """

    expect: Callable[[np.ndarray], np.ndarray]
    lo: float = -3.0
    hi: float = 3.0


UNARY: dict[str, Elementwise] = {
    "negative": Elementwise(np.negative),
    "abs": Elementwise(np.abs),
    "square": Elementwise(np.square),
    "sign": Elementwise(np.sign),
    "relu": Elementwise(lambda x: np.maximum(x, np.zeros((), x.dtype))),
    "floor": Elementwise(np.floor),
    "ceil": Elementwise(np.ceil),
    "round": Elementwise(np.round),
    "trunc": Elementwise(np.trunc),
    "exp": Elementwise(np.exp),
    "expm1": Elementwise(np.expm1),
    "log": Elementwise(np.log, lo=0.1, hi=5.0),
    "log1p": Elementwise(np.log1p, lo=-0.9, hi=5.0),
    "sqrt": Elementwise(np.sqrt, lo=0.1, hi=5.0),
    "tanh": Elementwise(np.tanh),
    "sigmoid": Elementwise(lambda x: _sigmoid(x)),
    "sin": Elementwise(np.sin),
    "cos": Elementwise(np.cos),
    "sinh": Elementwise(np.sinh),
    "cosh": Elementwise(np.cosh),
    "arctan": Elementwise(np.arctan),
    "isnan": Elementwise(np.isnan),
    "isinf": Elementwise(np.isinf),
    "isfinite": Elementwise(np.isfinite),
}
"""Every unary elementwise op but `logical_not` (bool only, below)."""

SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 0.5, -0.5, 1.5, 2.5, -2.5, 1e-8, -7.0, 40.0])
"""Values every unary op is checked on too: NaN, infinities, signed zeros, ties of `round`."""


def expect_ignoring_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with NumPy's floating-point warnings off (inf and nan are results here, as on a GPU)."""

    def run(*args: Any) -> Any:
        with np.errstate(all="ignore"):
            return fn(*args)

    return run


BINARY_EXPECT: dict[str, Callable[[Any, Any], Any]] = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "divide": np.true_divide,
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


def _cases() -> list[Case]:
    c: list[Case] = []
    add = c.append
    # creation
    add(
        Case(
            "zeros-int32",
            "zeros",
            (),
            {"shape": (2, 3), "dtype": "int32"},
            lambda: np.zeros((2, 3), np.int32),
        )
    )
    add(Case("ones-bool", "ones", (), {"shape": (4,), "dtype": "bool"}, lambda: np.ones(4, bool)))
    add(Case("ones-0d", "ones", (), {"shape": (), "dtype": F64}, lambda: np.ones((), F64)))
    add(Case("full-f16", "full", (3.5,), {"shape": (2, 2), "dtype": F16}, lambda v: np.full((2, 2), v, F16)))
    add(Case("full-int-into-f32", "full", (7,), {"shape": (3,), "dtype": F32}, lambda v: np.full(3, 7, F32)))
    add(
        Case(
            "full-float-truncates-into-int32",
            "full",
            (2.7,),
            {"shape": (3,), "dtype": "int32"},
            lambda v: np.full(3, 2, np.int32),
        )
    )
    add(
        Case(
            "full-bool-into-int64",
            "full",
            (True,),
            {"shape": (2,), "dtype": "int64"},
            lambda v: np.ones(2, np.int64),
        )
    )
    ar = {"start": 0, "stop": 10, "step": 3, "dtype": "int64"}
    add(Case("arange-int", "arange", (), ar, lambda: np.arange(0, 10, 3, dtype=np.int64)))
    ar = {"start": 5, "stop": -4, "step": -2, "dtype": "int32"}
    add(Case("arange-negative-step", "arange", (), ar, lambda: np.arange(5, -4, -2, dtype=np.int32)))
    ar = {"start": 0.0, "stop": 1.0, "step": 0.25, "dtype": F32}
    add(Case("arange-float", "arange", (), ar, lambda: np.arange(0, 1, 0.25).astype(F32)))
    ar = {"start": 1, "stop": 1, "step": 1, "dtype": F64}
    add(Case("arange-empty", "arange", (), ar, lambda: np.zeros(0, F64)))
    add(Case("eye-k1", "eye", (), {"n": 3, "m": 4, "k": 1, "dtype": F32}, lambda: np.eye(3, 4, 1, F32)))
    add(
        Case(
            "eye-int-k-1",
            "eye",
            (),
            {"n": 3, "m": 3, "k": -1, "dtype": "int64"},
            lambda: np.eye(3, 3, -1, np.int64),
        )
    )
    for dt in (F16, F32, F64):
        add(
            Case(
                f"rand-{dt}",
                "rand",
                (42,),
                {"shape": (4, 5), "dtype": dt},
                lambda s, dt=dt: rand_ref(s, (4, 5), dt),
            )
        )
        add(
            Case(
                f"randn-{dt}",
                "randn",
                (-7,),
                {"shape": (3, 7), "dtype": dt},
                lambda s, dt=dt: randn_ref(s, (3, 7), dt),
            )
        )
    add(
        Case(
            "rand-huge-seed",
            "rand",
            (2**63 - 1,),
            {"shape": (6,), "dtype": F64},
            lambda s: rand_ref(s, (6,), F64),
        )
    )
    # unary
    for name, row in UNARY.items():
        add(Case(f"{name}-f32", name, (f(3, 4, lo=row.lo, hi=row.hi),), {}, row.expect))
        add(Case(f"{name}-specials-f64", name, (SPECIALS,), {}, expect_ignoring_errors(row.expect)))
    for name in ("floor", "ceil", "round", "trunc"):
        add(Case(f"{name}-int32-keeps-values-and-dtype", name, (i(7),), {}, lambda x: x.copy()))
    add(Case("round-ties-to-even-f16", "round", (np.array([0.5, 1.5, 2.5, -0.5], F16),), {}, np.round))
    add(Case("isnan-int64-is-false", "isnan", (i(5, dtype="int64"),), {}, lambda x: np.zeros(5, bool)))
    add(Case("isfinite-int32-is-true", "isfinite", (i(5),), {}, lambda x: np.ones(5, bool)))
    add(Case("log1p-tiny-is-exact", "log1p", (np.array([1e-10, -1e-12], F64),), {}, np.log1p))
    add(Case("expm1-tiny-is-exact", "expm1", (np.array([1e-10, -1e-12], F64),), {}, np.expm1))
    add(Case("sinh-int32-gives-f32", "sinh", (i(5),), {}, lambda x: np.sinh(x.astype(F32))))
    add(Case("sign-with-zeros-f64", "sign", (np.array([-2.0, 0.0, 3.0, -0.0]),), {}, np.sign))
    add(Case("abs-int64", "abs", (i(7, dtype="int64"),), {}, np.abs))
    add(Case("negative-int32", "negative", (i(7),), {}, np.negative))
    add(Case("square-int32", "square", (i(7),), {}, np.square))
    add(Case("relu-f16", "relu", (f(9, dtype=F16),), {}, lambda x: np.maximum(x, np.float16(0))))
    add(Case("relu-int32", "relu", (i(9),), {}, lambda x: np.maximum(x, 0).astype(np.int32)))
    add(Case("exp-int32-gives-f32", "exp", (i(5),), {}, lambda x: np.exp(x.astype(F32))))
    add(Case("sqrt-bool-gives-f32", "sqrt", (b(5),), {}, lambda x: np.sqrt(x.astype(F32))))
    add(Case("exp-f16", "exp", (f(6, dtype=F16),), {}, np.exp))
    big = np.array([-1000.0, -30.0, 0.0, 30.0, 1000.0], F32)
    add(Case("sigmoid-saturates-f32", "sigmoid", (big,), {}, UNARY["sigmoid"].expect))
    add(
        Case(
            "sigmoid-f16-no-overflow",
            "sigmoid",
            (np.array([-14, -3, 0, 3, 14], F16),),
            {},
            UNARY["sigmoid"].expect,
        )
    )
    add(Case("logical_not-bool", "logical_not", (b(3, 2),), {}, np.logical_not))
    # binary
    for name, fn in BINARY_EXPECT.items():
        y = _pos[:1] if name in ("divide", "pow") else _x31
        x = np.abs(_x34) if name == "pow" else _x34
        add(Case(f"{name}-broadcast-f32", name, (x, y), {}, fn))
    add(Case("add-f16-f32-gives-f32", "add", (f(3, dtype=F16), f(3)), {}, lambda a, b: a.astype(F32) + b))
    add(
        Case(
            "add-int64-f16-gives-f16",
            "add",
            (i(3, dtype="int64"), f(3, dtype=F16)),
            {},
            lambda a, b: a.astype(F16) + b,
        )
    )
    add(Case("add-bool-int32-gives-int32", "add", (b(4), i(4)), {}, lambda a, b: a.astype(np.int32) + b))
    add(
        Case("multiply-int32-int-scalar-stays-int32", "multiply", (i(4), 3), {}, lambda a, s: a * np.int32(s))
    )
    add(
        Case(
            "multiply-bool-int-scalar-gives-int64",
            "multiply",
            (b(4), 3),
            {},
            lambda a, s: a.astype(np.int64) * s,
        )
    )
    add(
        Case(
            "multiply-int32-float-scalar-gives-f32",
            "multiply",
            (i(4), 0.5),
            {},
            lambda a, s: a.astype(F32) * np.float32(s),
        )
    )
    add(
        Case(
            "multiply-f16-float-scalar-stays-f16",
            "multiply",
            (f(4, dtype=F16), 0.1),
            {},
            lambda a, s: a * np.float16(s),
        )
    )
    add(Case("add-bool-scalar-to-float", "add", (f(3), True), {}, lambda a, s: a + np.float32(1)))
    add(Case("subtract-scalar-first", "subtract", (10.0, _x34), {}, lambda s, a: np.float32(s) - a))
    add(
        Case(
            "divide-ints-gives-f32",
            "divide",
            (i(5), np.array([1, 2, 3, 4, 7], np.int32)),
            {},
            lambda a, b: a.astype(F32) / b.astype(F32),
        )
    )
    add(
        Case(
            "divide-by-zero-gives-inf",
            "divide",
            (np.array([1.0, -1.0, 0.0], F32), 0.0),
            {},
            lambda a, s: np.array([np.inf, -np.inf, np.nan], F32),
        )
    )
    add(Case("pow-int32", "pow", (i(5, lo=-3, hi=4), np.array([0, 1, 2, 3, 2], np.int32)), {}, np.power))
    add(Case("pow-float-scalar", "pow", (_pos, 0.5), {}, lambda a, s: a ** np.float32(s)))
    nan = np.array([np.nan, 1.0, 2.0], F32)
    add(Case("maximum-propagates-nan", "maximum", (nan, np.array([0.0, np.nan, 3.0], F32)), {}, np.maximum))
    add(Case("maximum-bool", "maximum", (b(4), b(4)), {}, np.maximum))
    add(Case("less-int32-float-scalar", "less", (i(6), 0.5), {}, lambda a, s: a.astype(F32) < np.float32(s)))
    add(Case("equal-bool", "equal", (b(5), b(5)), {}, np.equal))
    add(Case("greater-int64-int32", "greater", (i(5, dtype="int64"), i(5)), {}, np.greater))
    add(Case("logical_and-bool", "logical_and", (b(3, 1), b(1, 4)), {}, np.logical_and))
    add(Case("logical_or-bool-scalar", "logical_or", (b(3), False), {}, lambda a, s: a | s))
    # select and cast
    add(
        Case(
            "where-tensor-and-scalar",
            "where",
            (b(3, 4), _x34, 0.0),
            {},
            lambda c, a, s: np.where(c, a, np.float32(0)),
        )
    )
    add(
        Case(
            "where-two-scalars-f32",
            "where",
            (b(2, 3), 1.0, 2),
            {},
            lambda c, a, s: np.where(c, np.float32(1), np.float32(2)),
        )
    )
    add(
        Case(
            "where-broadcast-promote",
            "where",
            (b(3, 1), i(1, 4), f(3, 4, dtype=F16)),
            {},
            lambda c, a, x: np.where(c, a.astype(F16), x),
        )
    )
    add(
        Case(
            "astype-f32-to-int32-truncates",
            "astype",
            (_x34,),
            {"dtype": "int32"},
            lambda x: x.astype(np.int32),
        )
    )
    add(
        Case(
            "astype-f32-to-bool",
            "astype",
            (np.array([0.0, -0.0, 0.5, np.inf], F32),),
            {"dtype": "bool"},
            lambda x: x.astype(bool),
        )
    )
    add(Case("astype-int-to-f16", "astype", (i(5),), {"dtype": F16}, lambda x: x.astype(F16)))
    add(Case("astype-bool-to-f32", "astype", (b(5),), {"dtype": F32}, lambda x: x.astype(F32)))
    # reductions
    x3 = f(2, 3, 4)
    add(Case("sum-all", "sum", (x3,), {}, lambda x: x.sum(dtype=F32)))
    add(
        Case(
            "sum-neg-axis-keepdims",
            "sum",
            (x3,),
            {"axis": -1, "keepdims": True},
            lambda x: x.sum(-1, keepdims=True),
        )
    )
    add(Case("sum-bool-gives-int64", "sum", (b(4, 5),), {"axis": 0}, lambda x: x.sum(0, dtype=np.int64)))
    add(Case("sum-int32-gives-int64", "sum", (i(4, 5),), {"axis": (0, 1)}, lambda x: x.sum(dtype=np.int64)))
    add(
        Case(
            "sum-f16-accumulates-wide",
            "sum",
            (f(300, dtype=F16, lo=0, hi=1),),
            {},
            lambda x: x.astype(F32).sum().astype(F16),
        )
    )
    add(Case("sum-empty-axis-tuple", "sum", (x3,), {"axis": ()}, lambda x: x))
    add(Case("mean-int32-gives-f32", "mean", (i(4, 5),), {"axis": 1}, lambda x: x.mean(1).astype(F32)))
    add(
        Case(
            "mean-axes-0-2", "mean", (x3,), {"axis": (0, 2)}, lambda x: x.astype(F64).mean((0, 2)).astype(F32)
        )
    )
    add(
        Case(
            "mean-f64",
            "mean",
            (f(5, 3, dtype=F64),),
            {"axis": -2, "keepdims": True},
            lambda x: x.mean(-2, keepdims=True),
        )
    )
    add(
        Case(
            "max-axis1-keepdims",
            "max",
            (x3,),
            {"axis": 1, "keepdims": True},
            lambda x: x.max(1, keepdims=True),
        )
    )
    add(Case("min-all-int64", "min", (i(4, 5, dtype="int64"),), {}, lambda x: x.min()))
    add(Case("max-bool", "max", (b(3, 4),), {"axis": 0}, lambda x: x.max(0)))
    add(Case("prod-f32", "prod", (f(3, 4, lo=0.5, hi=1.5),), {"axis": 0}, lambda x: x.prod(0)))
    add(
        Case(
            "prod-int32-gives-int64",
            "prod",
            (i(3, 4, lo=-3, hi=4),),
            {"axis": -1},
            lambda x: x.prod(-1, dtype=np.int64),
        )
    )
    add(Case("argmax-neg-axis", "argmax", (x3,), {"axis": -1}, lambda x: x.argmax(-1)))
    add(
        Case(
            "argmin-none-keepdims", "argmin", (x3,), {"keepdims": True}, lambda x: np.argmin(x, keepdims=True)
        )
    )
    add(Case("argmax-int32", "argmax", (i(6, 7),), {"axis": 0}, lambda x: x.argmax(0)))
    # linear algebra
    add(Case("matmul-2d", "matmul", (f(3, 4), f(4, 5)), {}, np.matmul))
    add(Case("matmul-1d-2d", "matmul", (f(4), f(4, 5)), {}, np.matmul))
    add(Case("matmul-2d-1d", "matmul", (f(3, 4), f(4)), {}, np.matmul))
    add(Case("matmul-batched-broadcast", "matmul", (f(2, 1, 3, 4), f(5, 4, 2)), {}, np.matmul))
    add(Case("matmul-int32", "matmul", (i(3, 4), i(4, 2)), {}, np.matmul))
    add(
        Case(
            "matmul-f16-f32-promotes",
            "matmul",
            (f(3, 4, dtype=F16), f(4, 2)),
            {},
            lambda a, b: a.astype(F32) @ b,
        )
    )
    add(
        Case(
            "matmul-f16",
            "matmul",
            (f(8, 16, dtype=F16), f(16, 4, dtype=F16)),
            {},
            lambda a, b: (a.astype(F32) @ b.astype(F32)).astype(F16),
        )
    )
    # shapes
    add(Case("reshape", "reshape", (x3,), {"shape": (4, 6)}, lambda x: x.reshape(4, 6)))
    add(Case("reshape-to-0d", "reshape", (f(1, 1),), {"shape": ()}, lambda x: x.reshape(())))
    add(Case("permute_dims-neg", "permute_dims", (x3,), {"axes": (2, -3, 1)}, lambda x: x.transpose(2, 0, 1)))
    add(
        Case(
            "broadcast_to",
            "broadcast_to",
            (_x41,),
            {"shape": (2, 4, 3)},
            lambda x: np.broadcast_to(x, (2, 4, 3)),
        )
    )
    add(Case("expand_dims-neg", "expand_dims", (_x34,), {"axis": -1}, lambda x: x[..., None]))
    add(Case("squeeze", "squeeze", (f(1, 3, 1),), {"axis": (0, -1)}, lambda x: x.reshape(3)))
    add(
        Case(
            "concat-neg-axis-promotes",
            "concat",
            (i(2, 3), f(2, 1)),
            {"axis": -1},
            lambda a, x: np.concatenate([a.astype(F32), x], -1),
        )
    )
    add(Case("concat-one", "concat", (_x34,), {}, lambda x: x))
    add(Case("stack-axis1", "stack", (_x34, _y34, _x34), {"axis": 1}, lambda *xs: np.stack(xs, 1)))
    # indexing
    key = (("s", 1, 5, 2), ("n",), ("i", 3))
    add(
        Case("getitem-slice-newaxis-int", "getitem", (f(5, 6, 7),), {"key": key}, lambda x: x[1:5:2, None, 3])
    )
    add(
        Case(
            "getitem-to-0d", "getitem", (_x34,), {"key": (("i", 2), ("i", 1))}, lambda x: np.asarray(x[2, 1])
        )
    )
    add(Case("getitem-empty-slice", "getitem", (_x34,), {"key": (("s", 3, 1, 1),)}, lambda x: x[3:1]))
    ggk = {"key": (("s", 1, 5, 2), ("n",), ("i", 3)), "shape": (5, 6, 7)}

    def gg(g: np.ndarray) -> np.ndarray:
        out = np.zeros((5, 6, 7), g.dtype)
        out[1:5:2, None, 3] = g
        return out

    add(Case("getitem_grad", "getitem_grad", (f(2, 1, 7),), ggk, gg))
    add(Case("take-axis1-2d-indices", "take", (_x34, _sidx), {"axis": 1}, lambda x, k: np.take(x, k, axis=1)))
    add(Case("take-flat", "take", (_x34, np.array([11, 0, -1], np.int64)), {}, lambda x, k: np.take(x, k)))
    add(
        Case(
            "take-negative-axis",
            "take",
            (f(2, 3, 5), np.array([4, -5], np.int64)),
            {"axis": -1},
            lambda x, k: np.take(x, k, axis=-1),
        )
    )
    add(
        Case(
            "scatter_add-repeats",
            "scatter_add",
            (_g, _sidx),
            {"axis": 1, "size": 4},
            lambda g, k: _scatter_add(g, k, 1, 4),
        )
    )
    add(
        Case(
            "scatter_add-neg-axis",
            "scatter_add",
            (f(3, 4), np.array([2, 2, 0, 1], np.int64)),
            {"axis": -1, "size": 3},
            lambda g, k: _scatter_add(g, k, 1, 3),
        )
    )
    add(
        Case(
            "scatter_add-flat",
            "scatter_add",
            (f(2, 3), _sidx),
            {"axis": None, "size": 5},
            lambda g, k: _scatter_add(g, k, None, 5),
        )
    )
    add(
        Case(
            "scatter_add-int64",
            "scatter_add",
            (i(6, dtype="int64"), np.array([0, 1, 0, 1, 2, 0])),
            {"axis": 0, "size": 3},
            lambda g, k: _scatter_add(g, k, 0, 3),
        )
    )
    # training
    add(Case("softmax-last", "softmax", (x3,), {}, lambda x: np.exp(_log_softmax(x, -1))))
    add(
        Case(
            "softmax-axis0-f64",
            "softmax",
            (f(4, 3, dtype=F64, lo=-50, hi=50),),
            {"axis": 0},
            lambda x: np.exp(_log_softmax(x, 0)),
        )
    )
    add(
        Case(
            "softmax-large-logits-stable",
            "softmax",
            (np.array([[1000.0, 1001.0, -1000.0]], F32),),
            {},
            lambda x: np.exp(_log_softmax(x, -1)),
        )
    )
    add(
        Case(
            "log_softmax-f16",
            "log_softmax",
            (f(3, 5, dtype=F16),),
            {"axis": -1},
            lambda x: _log_softmax(x, -1),
        )
    )
    add(
        Case(
            "log_softmax-int-gives-f32",
            "log_softmax",
            (i(3, 5),),
            {"axis": 1},
            lambda x: _log_softmax(x.astype(F32), 1),
        )
    )
    for red in ("mean", "sum", "none"):
        add(
            Case(
                f"cross_entropy-{red}",
                "cross_entropy",
                (_logits, _labels),
                {"reduction": red},
                lambda z, y, r=red: _cross_entropy(z, y, r),
            )
        )
    add(
        Case(
            "cross_entropy-f16",
            "cross_entropy",
            (f(6, 5, dtype=F16), _labels.astype(np.int32)),
            {},
            lambda z, y: _cross_entropy(z, y, "mean"),
        )
    )
    huge = np.array([[1e4, -1e4, 0.0], [0.0, 0.0, 0.0]], F32)
    add(
        Case(
            "cross_entropy-stable-for-huge-logits",
            "cross_entropy",
            (huge, np.array([1, 2])),
            {"reduction": "none"},
            lambda z, y: _cross_entropy(z, y, "none"),
        )
    )
    add(
        Case(
            "cross_entropy-bad-label-is-nan",
            "cross_entropy",
            (_logits[:2], np.array([0, 5])),
            {"reduction": "none"},
            lambda z, y: _cross_entropy(z, y, "none"),
        )
    )
    add(
        Case(
            "one_hot-f32",
            "one_hot",
            (_labels,),
            {"num_classes": 5, "dtype": F32},
            lambda y: np.eye(5, dtype=F32)[y],
        )
    )
    add(
        Case(
            "one_hot-bool-2d",
            "one_hot",
            (i(2, 3, lo=0, hi=4),),
            {"num_classes": 4, "dtype": "bool"},
            lambda y: np.eye(4, dtype=bool)[y],
        )
    )
    c.extend(_window_cases())
    return c


def _window_cases() -> list[Case]:
    """unfold and fold: kernel, stride, padding and dilation combinations, one block, dtypes."""
    c: list[Case] = []
    combos: list[tuple[str, tuple[int, int, int, int], dict[str, Any]]] = [
        ("k3", (2, 3, 5, 6), {"kernel_size": (3, 3)}),
        ("k2-s2", (1, 2, 6, 6), {"kernel_size": (2, 2), "stride": (2, 2)}),
        ("k3-pad1", (2, 2, 4, 5), {"kernel_size": (3, 3), "padding": (1, 1)}),
        ("k2x3-dil2-s2x1-pad1x2", (1, 3, 7, 6), {"kernel_size": (2, 3), "dilation": (2, 2),
                                                  "stride": (2, 1), "padding": (1, 2)}),
        ("k3-s2-overlap-pad1", (2, 1, 5, 5), {"kernel_size": (3, 3), "stride": (2, 2), "padding": (1, 1)}),
        ("k1", (2, 3, 2, 3), {"kernel_size": (1, 1)}),
        ("whole-image", (3, 2, 3, 4), {"kernel_size": (3, 4)}),
        ("s3-skips-pixels", (1, 1, 7, 7), {"kernel_size": (2, 2), "stride": (3, 3)}),
    ]  # fmt: skip
    for name, shape, attrs in combos:
        x = f(*shape)
        add_u = Case(f"unfold-{name}", "unfold", (x,), attrs, lambda x, a=attrs: unfold_ref(x, **a))
        cols = unfold_ref(x, **attrs)
        fattrs = {**attrs, "output_size": shape[2:]}
        add_f = Case(
            f"fold-{name}",
            "fold",
            (f(*cols.shape),),
            fattrs,
            lambda g, a=attrs, size=shape[2:]: fold_ref(g, size, **a),
        )
        c += [add_u, add_f]
    k3p1 = {"kernel_size": (3, 3), "padding": (1, 1)}
    c.append(Case("unfold-f16", "unfold", (f(1, 2, 4, 4, dtype=F16),), k3p1, lambda x: unfold_ref(x, **k3p1)))
    c.append(
        Case(
            "fold-f16-accumulates-wide",
            "fold",
            (f(1, 18, 16, dtype=F16),),
            {**k3p1, "output_size": (4, 4)},
            lambda g: fold_ref(g, (4, 4), **k3p1),
        )
    )
    c.append(Case("unfold-u8", "unfold", (i(1, 1, 4, 4, lo=0, hi=256, dtype="uint8"),), k3p1,
                  lambda x: unfold_ref(x, **k3p1)))  # fmt: skip
    c.append(
        Case(
            "fold-int32",
            "fold",
            (i(2, 9, 4),),
            {"kernel_size": (3, 3), "output_size": (4, 4), "stride": (1, 1), "padding": (1, 1),
             "dilation": (2, 2)},
            lambda g: fold_ref(g, (4, 4), (3, 3), (2, 2), (1, 1)),
        )
    )  # fmt: skip
    c.append(Case("unfold-f64-empty-batch", "unfold", (f(0, 2, 4, 4, dtype=F64),), k3p1,
                  lambda x: np.zeros((0, 18, 16))))  # fmt: skip
    return c


def _small_int_cases() -> list[Case]:
    """uint8, int8 and int16: the promotion lattice, reductions, casts, and indices of these dtypes."""
    u8 = np.array([[0, 7, 200], [255, 1, 128]], np.uint8)
    s8 = np.array([[-128, 5, 100], [127, -1, 0]], np.int8)
    s16 = np.array([[-300, 5, 1000], [32767, -1, 2]], np.int16)
    return [
        Case("add-u8-i8-gives-i16", "add", (u8, s8), {}, lambda a, b: a.astype(np.int16) + b),
        Case("subtract-u8-i16-gives-i16", "subtract", (u8, s16), {}, lambda a, b: a.astype(np.int16) - b),
        Case("multiply-u8-i32-gives-i32", "multiply", (u8, i(2, 3)), {}, lambda a, b: a.astype(np.int32) * b),
        Case("add-i8-i16-gives-i16", "add", (s8, s16), {}, lambda a, b: a.astype(np.int16) + b),
        Case("add-u8-wraps-as-uint8", "add", (u8, u8), {}, lambda a, b: a + b),
        Case("add-u8-int-scalar-stays-u8", "add", (u8, 100), {}, lambda a, s: a + np.uint8(s)),
        Case(
            "multiply-i8-float-scalar-gives-f32",
            "multiply",
            (s8, 0.5),
            {},
            lambda a, s: a.astype(F32) * np.float32(s),
        ),
        Case("add-u8-f16-gives-f16", "add", (u8, f(2, 3, dtype=F16)), {}, lambda a, b: a.astype(F16) + b),
        Case("less-u8-i8-compares-values", "less", (u8, s8), {}, lambda a, b: a.astype(np.int16) < b),
        Case(
            "maximum-i8-u8-gives-i16", "maximum", (s8, u8), {}, lambda a, b: np.maximum(a.astype(np.int16), b)
        ),
        Case("divide-u8-gives-f32", "divide", (u8, 255), {}, lambda a, s: a.astype(F32) / np.float32(s)),
        Case("negative-i8-wraps", "negative", (s8,), {}, np.negative),
        Case("abs-i16", "abs", (s16,), {}, np.abs),
        Case("sum-u8-gives-int64", "sum", (u8,), {"axis": 1}, lambda a: a.sum(axis=1, dtype=np.int64)),
        Case("prod-i8-gives-int64", "prod", (s8,), {"axis": 0}, lambda a: a.prod(axis=0, dtype=np.int64)),
        Case("mean-u8-gives-f32", "mean", (u8,), {}, lambda a: np.asarray(a.mean(dtype=np.float64), F32)),
        Case("max-i16-keeps-i16", "max", (s16,), {"axis": 0}, lambda a: a.max(axis=0)),
        Case("argmin-u8", "argmin", (u8,), {"axis": 1}, lambda a: a.argmin(axis=1).astype(np.int64)),
        Case("astype-u8-to-f32", "astype", (u8,), {"dtype": F32}, lambda a: a.astype(F32)),
        Case(
            "astype-f32-to-i8",
            "astype",
            (f(2, 3, lo=-100, hi=100),),
            {"dtype": "int8"},
            lambda a: a.astype(np.int8),
        ),
        Case("astype-i16-to-u8-wraps", "astype", (s16,), {"dtype": "uint8"}, lambda a: a.astype(np.uint8)),
        Case("matmul-i16", "matmul", (s16 // 8, s16.T // 8), {}, lambda a, b: a @ b),
        Case(
            "full-u8", "full", (255,), {"shape": (2,), "dtype": "uint8"}, lambda v: np.full(2, 255, np.uint8)
        ),
        Case(
            "take-u8-indices",
            "take",
            (f(300), np.array([255, 0, 17], np.uint8)),
            {"axis": 0},
            lambda x, k: x[k.astype(np.int64)],
        ),
        Case(
            "take-i16-indices",
            "take",
            (f(300), np.array([299, -300], np.int16)),
            {"axis": None},
            lambda x, k: x[k.astype(np.int64)],
        ),
        Case(
            "take-i8-negative-indices",
            "take",
            (f(4, 3), np.array([-1, 2], np.int8)),
            {"axis": 0},
            lambda x, k: x[k.astype(np.int64)],
        ),
        Case(
            "one_hot-u8-labels-past-255",
            "one_hot",
            (np.array([255, 0], np.uint8),),
            {"num_classes": 300, "dtype": F32},
            lambda y: np.eye(300, dtype=F32)[y.astype(np.int64)],
        ),
        Case(
            "cross_entropy-u8-labels",
            "cross_entropy",
            (_logits, _labels.astype(np.uint8)),
            {},
            lambda z, y: _cross_entropy(z, y.astype(np.int64), "mean"),
        ),
        Case(
            "scatter_add-i8-wraps",
            "scatter_add",
            (np.array([100, 100, 7], np.int8), np.array([1, 1, 0], np.uint8)),
            {"axis": 0, "size": 2},
            lambda g, k: np.array([7, -56], np.int8),
        ),
    ]


CASES: Sequence[Case] = _cases() + _small_int_cases()
CASE_IDS = [case.id for case in CASES]
assert len(set(CASE_IDS)) == len(CASE_IDS), "case ids must be unique"
