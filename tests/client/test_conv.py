"""Convolution, pooling, batch norm and Flatten on every device kind: values against direct loops
written here (torch's definitions, one output element at a time), gradients against central
finite differences in float64; the CNN layers, module buffers and train/eval behaviour."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest

import emberlink as el
from emberlink import Device, nn
from tests.client.test_gradients import gradcheck
from tests.graph_replay.cases import fold_ref, unfold_ref

F = nn.functional


# -- references ------------------------------------------------------------------------------------


def conv2d_ref(
    x: np.ndarray,
    w: np.ndarray,
    b: np.ndarray | None,
    stride=(1, 1),
    padding=(0, 0),
    dilation=(1, 1),
    groups=1,
) -> np.ndarray:
    n, _, h, wd = x.shape
    o, cg, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((n, o, oh, ow))
    for bb, oo, r, q in np.ndindex(n, o, oh, ow):
        g = oo // (o // groups)
        total = 0.0 if b is None else float(b[oo])
        for ci, i, j in np.ndindex(cg, kh, kw):
            y, z = r * sh - ph + i * dh, q * sw - pw + j * dw
            if 0 <= y < h and 0 <= z < wd:
                total += x[bb, g * cg + ci, y, z] * w[oo, ci, i, j]
        out[bb, oo, r, q] = total
    return out


def pool_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's pooling_output_shape."""
    span = size + 2 * p - d * (k - 1) - 1
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def max_pool_ref(x: np.ndarray, k, s=None, p=(0, 0), d=(1, 1), ceil_mode=False) -> np.ndarray:
    s = k if s is None else s
    n, c, h, w = x.shape
    oh, ow = (pool_size(size, k[i], s[i], p[i], d[i], ceil_mode) for i, size in enumerate((h, w)))
    out = np.zeros((n, c, oh, ow), x.dtype)
    for bb, ch, r, q in np.ndindex(n, c, oh, ow):
        vals = [
            x[bb, ch, y, z]
            for i, j in np.ndindex(*k)
            if 0 <= (y := r * s[0] - p[0] + i * d[0]) < h and 0 <= (z := q * s[1] - p[1] + j * d[1]) < w
        ]
        out[bb, ch, r, q] = max(vals)
    return out


def avg_pool_ref(
    x: np.ndarray, k, s=None, p=(0, 0), ceil_mode=False, count_include_pad=True, divisor_override=None
) -> np.ndarray:
    """torch's avg_pool2d kernel: a window's size counts the padding (up to H + p), never the
    ceil_mode overhang past it."""
    s = k if s is None else s
    n, c, h, w = x.shape
    oh, ow = (pool_size(size, k[i], s[i], p[i], 1, ceil_mode) for i, size in enumerate((h, w)))
    out = np.zeros((n, c, oh, ow), x.dtype)
    for bb, ch, r, q in np.ndindex(n, c, oh, ow):
        h0, w0 = r * s[0] - p[0], q * s[1] - p[1]
        h1, w1 = min(h0 + k[0], h + p[0]), min(w0 + k[1], w + p[1])
        padded_size = (h1 - h0) * (w1 - w0)
        h0, w0, h1, w1 = max(h0, 0), max(w0, 0), min(h1, h), min(w1, w)
        total = x[bb, ch, h0:h1, w0:w1].astype(np.float64).sum()
        divisor = divisor_override or (padded_size if count_include_pad else (h1 - h0) * (w1 - w0))
        out[bb, ch, r, q] = total / divisor
    return out


def batch_norm_ref(x: np.ndarray, mean: np.ndarray, var: np.ndarray, w, b, eps: float) -> np.ndarray:
    shape = (1, -1, 1, 1)
    y: np.ndarray = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps)
    if w is not None:
        y = y * w.reshape(shape) + b.reshape(shape)
    return y


# -- conv2d ----------------------------------------------------------------------------------------

CONV = [
    pytest.param((2, 3, 6, 5), (4, 3, 3, 3), {}, id="plain"),
    pytest.param((1, 2, 7, 6), (3, 2, 3, 2), {"stride": 2, "padding": 1}, id="stride2-pad1"),
    pytest.param((1, 2, 8, 7), (2, 2, 3, 3), {"dilation": 2, "padding": (2, 1)}, id="dilation2-pad2x1"),
    pytest.param((2, 4, 5, 5), (6, 2, 3, 3), {"groups": 2, "stride": (1, 2)}, id="groups2-stride1x2"),
    pytest.param((1, 3, 5, 6), (3, 1, 3, 3), {"groups": 3, "padding": 1}, id="depthwise"),
    pytest.param((2, 3, 4, 4), (5, 3, 1, 1), {}, id="1x1"),
    pytest.param((1, 2, 5, 6), (3, 2, 3, 3), {"padding": "same"}, id="same-odd-kernel"),
    pytest.param((1, 2, 5, 6), (3, 2, 2, 4), {"padding": "same", "dilation": (1, 2)}, id="same-even-kernel"),
    pytest.param((1, 2, 5, 6), (3, 2, 3, 3), {"padding": "valid"}, id="valid"),
]


def _same_pads(k: int, d: int) -> tuple[int, int]:
    total = d * (k - 1)
    return total // 2, total - total // 2


def _conv_expect(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, kw: dict[str, Any]) -> np.ndarray:
    pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)
    stride, dilation = pair(kw.get("stride", 1)), pair(kw.get("dilation", 1))
    padding = kw.get("padding", 0)
    if padding == "same":
        (t, bo), (le, r) = (_same_pads(w.shape[2 + i], dilation[i]) for i in range(2))
        x, padding = np.pad(x, ((0, 0), (0, 0), (t, bo), (le, r))), 0
    padding = pair(0 if padding == "valid" else padding)
    return conv2d_ref(x, w, b, stride, padding, dilation, kw.get("groups", 1))


@pytest.mark.parametrize(("xs", "ws", "kw"), CONV)
def test_conv2d_matches_a_direct_loop(dev: Device, rng, xs, ws, kw) -> None:
    x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ws[0])
    got = F.conv2d(dev.tensor(x), dev.tensor(w), dev.tensor(b), **kw)
    want = _conv_expect(x, w, b, kw)
    if kw.get("padding") == "same":
        assert got.shape[2:] == xs[2:]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


def test_conv2d_without_bias_and_unbatched_input(dev: Device, rng) -> None:
    x, w = (
        rng.standard_normal((2, 5, 4)).astype("float32"),
        rng.standard_normal((3, 2, 2, 2)).astype("float32"),
    )
    got = F.conv2d(dev.tensor(x), dev.tensor(w), stride=(1, 2))
    assert got.shape == (3, 4, 2) and got.dtype == "float32"
    np.testing.assert_allclose(got.numpy(), conv2d_ref(x[None], w, None, (1, 2))[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kw",
    [{}, {"stride": 2, "padding": 1}, {"groups": 2, "dilation": (2, 1)}, {"padding": "same"}],
    ids=["plain", "stride2-pad1", "groups2-dilation2x1", "same"],
)
def test_conv2d_gradients_match_finite_differences(dev: Device, rng, kw) -> None:
    x, w, b = (
        rng.standard_normal((1, 2, 5, 4)),
        rng.standard_normal((2, 2 // kw.get("groups", 1), 3, 2)),
        rng.standard_normal(2),
    )
    gradcheck(dev, lambda x, w, b: F.conv2d(x, w, b, **kw), x, w, b)


# -- unfold and fold -------------------------------------------------------------------------------


def test_unfold_and_fold_follow_torch_and_accept_ints_or_pairs(dev: Device, rng) -> None:
    x = rng.standard_normal((2, 3, 6, 5))
    kw: dict[str, Any] = {"kernel_size": (3, 2), "dilation": (1, 2), "padding": 1, "stride": (2, 1)}
    pairs = {k: (v, v) if isinstance(v, int) else v for k, v in kw.items()}
    cols = F.unfold(dev.tensor(x), **kw)
    np.testing.assert_array_equal(cols.numpy(), unfold_ref(x, **pairs))
    g = rng.standard_normal(cols.shape)
    np.testing.assert_allclose(
        F.fold(dev.tensor(g), (6, 5), **kw).numpy(), fold_ref(g, (6, 5), **pairs), rtol=1e-12
    )
    unbatched = F.unfold(dev.tensor(x[0]), **kw)
    assert unbatched.shape == cols.shape[1:]
    assert F.fold(unbatched, (6, 5), **kw).shape == (3, 6, 5)


def test_fold_is_the_adjoint_of_unfold(dev: Device, rng) -> None:
    # <unfold(x), y> == <x, fold(y)>: what makes each the other's gradient
    x, kw = rng.standard_normal((2, 2, 5, 6)), {"kernel_size": 3, "stride": 2, "padding": 1, "dilation": 1}
    y = rng.standard_normal(F.unfold(dev.tensor(x), **kw).shape)
    lhs = float((F.unfold(dev.tensor(x), **kw) * dev.tensor(y)).sum())
    rhs = float((dev.tensor(x) * F.fold(dev.tensor(y), (5, 6), **kw)).sum())
    assert lhs == pytest.approx(rhs, rel=1e-12)


def test_unfold_and_fold_gradients_match_finite_differences(dev: Device, rng) -> None:
    kw = {"kernel_size": (2, 3), "stride": (2, 1), "padding": (1, 1), "dilation": (1, 2)}
    gradcheck(dev, lambda x: F.unfold(x, **kw), rng.standard_normal((1, 2, 4, 5)))
    blocks = F.unfold(dev.zeros((1, 2, 4, 5), dtype="float64"), **kw).shape
    gradcheck(dev, lambda g: F.fold(g, (4, 5), **kw), rng.standard_normal(blocks))


# -- pooling ---------------------------------------------------------------------------------------

MAX_POOL = [
    pytest.param((2, 2, 6, 6), {"kernel_size": 2}, id="tiles"),
    pytest.param((1, 2, 7, 5), {"kernel_size": 2}, id="tiles-with-leftover-rows"),
    pytest.param((1, 2, 7, 6), {"kernel_size": 3, "stride": 2, "padding": 1}, id="k3-s2-pad1"),
    pytest.param((1, 1, 6, 7), {"kernel_size": (2, 3), "stride": 1}, id="overlapping"),
    pytest.param((1, 2, 8, 8), {"kernel_size": 2, "dilation": 2, "stride": 2}, id="dilation2"),
    pytest.param((1, 2, 5, 6), {"kernel_size": 2, "ceil_mode": True}, id="ceil-overhang"),
    pytest.param(
        (1, 1, 5, 5), {"kernel_size": 2, "stride": 2, "padding": 1, "ceil_mode": True}, id="ceil-drops-window"
    ),
    pytest.param(
        (1, 2, 6, 5), {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True}, id="ceil-pad1"
    ),
]


def _pool_args(kw: dict[str, Any], with_dilation: bool = True) -> dict[str, Any]:
    pair = lambda v: (v, v) if isinstance(v, int) else v
    k = pair(kw["kernel_size"])
    out = {
        "k": k,
        "s": pair(kw.get("stride", k)),
        "p": pair(kw.get("padding", 0)),
        "ceil_mode": kw.get("ceil_mode", False),
    }
    if with_dilation:
        out["d"] = pair(kw.get("dilation", 1))
    return out


@pytest.mark.parametrize(("xs", "kw"), MAX_POOL)
def test_max_pool2d_matches_a_direct_loop(dev: Device, rng, xs, kw) -> None:
    x = rng.standard_normal(xs).astype("float32")
    got = F.max_pool2d(dev.tensor(x), **kw)
    np.testing.assert_array_equal(got.numpy(), max_pool_ref(x, **_pool_args(kw)))
    layer = nn.MaxPool2d(**kw)
    np.testing.assert_array_equal(layer(dev.tensor(x)).numpy(), got.numpy())


def test_max_pool2d_pads_with_minus_infinity(dev: Device, rng) -> None:
    x = -rng.uniform(1, 2, (1, 1, 4, 4))  # all negative: a zero from padding would win every edge window
    got = F.max_pool2d(dev.tensor(x), 3, stride=1, padding=1, ceil_mode=True).numpy()
    assert (got < 0).all()
    np.testing.assert_array_equal(got, max_pool_ref(x, (3, 3), (1, 1), (1, 1), ceil_mode=True))
    ints = np.array([[[[-5, -7], [-9, -3]]]], dtype=np.int32)
    np.testing.assert_array_equal(
        F.max_pool2d(dev.tensor(ints), 2, 1, 1).numpy().ravel(), [-5, -5, -7, -5, -3, -3, -9, -3, -3]
    )


AVG_POOL = [
    pytest.param((2, 2, 6, 6), {"kernel_size": 2}, id="tiles"),
    pytest.param((1, 2, 7, 6), {"kernel_size": 3, "stride": 2, "padding": 1}, id="pad1-counts-padding"),
    pytest.param(
        (1, 2, 7, 6),
        {"kernel_size": 3, "stride": 2, "padding": 1, "count_include_pad": False},
        id="pad1-excludes-padding",
    ),
    pytest.param((1, 2, 5, 6), {"kernel_size": 2, "ceil_mode": True}, id="ceil-overhang"),
    pytest.param(
        (1, 1, 6, 5), {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True}, id="ceil-pad1"
    ),
    pytest.param(
        (1, 1, 6, 5),
        {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True, "count_include_pad": False},
        id="ceil-pad1-excludes",
    ),
    pytest.param(
        (1, 2, 6, 6),
        {"kernel_size": (2, 3), "stride": 1, "padding": (1, 1), "divisor_override": 4},
        id="divisor-override",
    ),
]


@pytest.mark.parametrize(("xs", "kw"), AVG_POOL)
def test_avg_pool2d_matches_a_direct_loop(dev: Device, rng, xs, kw) -> None:
    x = rng.standard_normal(xs)
    ref_kw = {**_pool_args(kw, with_dilation=False), "count_include_pad": kw.get("count_include_pad", True),
              "divisor_override": kw.get("divisor_override")}  # fmt: skip
    got = F.avg_pool2d(dev.tensor(x), **kw)
    np.testing.assert_allclose(got.numpy(), avg_pool_ref(x, **ref_kw), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(nn.AvgPool2d(**kw)(dev.tensor(x)).numpy(), got.numpy(), rtol=1e-15)


@pytest.mark.parametrize(
    ("pool", "kw"),
    [
        ("max", {"kernel_size": 2}),
        ("max", {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True}),
        ("max", {"kernel_size": 2, "stride": 1, "dilation": 2}),
        ("avg", {"kernel_size": 2}),
        ("avg", {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True, "count_include_pad": False}),
    ],
    ids=["max-tiles", "max-pad-ceil", "max-dilation", "avg-tiles", "avg-pad-ceil-excludes"],
)
def test_pool_gradients_match_finite_differences(dev: Device, rng, pool: str, kw) -> None:
    fn = F.max_pool2d if pool == "max" else F.avg_pool2d
    gradcheck(dev, lambda x: fn(x, **kw), rng.standard_normal((1, 2, 5, 6)))


# -- batch norm ------------------------------------------------------------------------------------


def test_batch_norm_training_normalizes_by_the_batch_and_updates_running_stats_in_place(
    dev: Device, rng
) -> None:
    x, w, b = rng.standard_normal((4, 3, 5, 2)) * 2 + 1, rng.standard_normal(3), rng.standard_normal(3)
    rm, rv = dev.tensor(np.full(3, 0.5)), dev.tensor(np.full(3, 2.0))
    before = rm._v
    y = F.batch_norm(
        dev.tensor(x), rm, rv, dev.tensor(w), dev.tensor(b), training=True, momentum=0.3, eps=1e-3
    )
    mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3))
    np.testing.assert_allclose(y.numpy(), batch_norm_ref(x, mean, var, w, b, 1e-3), rtol=1e-12, atol=1e-12)
    assert rm._v is not before  # the same Tensor object, rebound to its new value
    np.testing.assert_allclose(rm.numpy(), 0.7 * 0.5 + 0.3 * mean, rtol=1e-12)
    np.testing.assert_allclose(rv.numpy(), 0.7 * 2.0 + 0.3 * x.var((0, 2, 3), ddof=1), rtol=1e-12)
    evald = F.batch_norm(dev.tensor(x), rm, rv, dev.tensor(w), dev.tensor(b), training=False, eps=1e-3)
    np.testing.assert_allclose(
        evald.numpy(), batch_norm_ref(x, rm.numpy(), rv.numpy(), w, b, 1e-3), rtol=1e-12
    )


def test_batch_norm_gradients_match_finite_differences(dev: Device, rng) -> None:
    x, w, b = rng.standard_normal((3, 2, 2, 3)), rng.standard_normal(2), rng.standard_normal(2)
    gradcheck(dev, lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), x, w, b)
    rm, rv = dev.tensor(rng.standard_normal(2)), dev.tensor(rng.uniform(0.5, 2, 2))
    gradcheck(dev, lambda x, w, b: F.batch_norm(x, rm, rv, w, b, training=False), x, w, b)


def test_batchnorm2d_switches_between_batch_and_running_statistics(dev: Device, rng) -> None:
    bn = nn.BatchNorm2d(3, momentum=0.2, dtype="float64").to(dev)
    rm, rv, count = bn.running_mean, bn.running_var, bn.num_batches_tracked
    assert rm is not None and rv is not None and count is not None
    xs = [rng.standard_normal((4, 3, 3, 3)) * (k + 1) + k for k in range(3)]
    want_mean, want_var = np.zeros(3), np.ones(3)
    for x in xs:  # training (the default): batch statistics, running ones updated
        y = bn(dev.tensor(x)).numpy()
        np.testing.assert_allclose(
            y, batch_norm_ref(x, x.mean((0, 2, 3)), x.var((0, 2, 3)), None, None, 1e-5), atol=1e-12
        )
        want_mean = 0.8 * want_mean + 0.2 * x.mean((0, 2, 3))
        want_var = 0.8 * want_var + 0.2 * x.var((0, 2, 3), ddof=1)
    assert bn.running_mean is rm and bn.running_var is rv and bn.num_batches_tracked is count
    np.testing.assert_allclose(rm.numpy(), want_mean, rtol=1e-12)
    np.testing.assert_allclose(rv.numpy(), want_var, rtol=1e-12)
    assert int(count) == 3 and count.dtype == "int64"
    bn.eval()
    x = rng.standard_normal((2, 3, 3, 3))
    np.testing.assert_allclose(
        bn(dev.tensor(x)).numpy(), batch_norm_ref(x, want_mean, want_var, None, None, 1e-5), rtol=1e-12
    )
    np.testing.assert_allclose(rm.numpy(), want_mean, rtol=1e-12)  # eval leaves them alone
    assert int(count) == 3


def test_batchnorm2d_momentum_none_keeps_a_cumulative_average(dev: Device, rng) -> None:
    bn = nn.BatchNorm2d(2, momentum=None, affine=False, dtype="float64").to(dev)
    assert bn.parameters() == []
    xs = [rng.standard_normal((3, 2, 2, 2)) + k for k in range(4)]
    for x in xs:
        bn(dev.tensor(x))
    np.testing.assert_allclose(
        np.asarray(bn.running_mean), np.mean([x.mean((0, 2, 3)) for x in xs], axis=0), rtol=1e-12
    )


def test_batchnorm2d_without_running_stats_uses_the_batch_in_eval_too(dev: Device, rng) -> None:
    bn = nn.BatchNorm2d(2, track_running_stats=False, dtype="float64").to(dev).eval()
    assert bn.running_mean is None and bn.buffers() == []
    x = rng.standard_normal((3, 2, 2, 2))
    want = batch_norm_ref(x, x.mean((0, 2, 3)), x.var((0, 2, 3)), None, None, 1e-5)
    np.testing.assert_allclose(bn(dev.tensor(x)).numpy(), want, atol=1e-12)


# -- layers, buffers, state ------------------------------------------------------------------------


def test_conv2d_init_is_deterministic_per_seed_and_kaiming_bounded() -> None:
    a, b, c = (
        nn.Conv2d(4, 6, 3, groups=2, seed=1),
        nn.Conv2d(4, 6, 3, groups=2, seed=1),
        nn.Conv2d(4, 6, 3, groups=2, seed=2),
    )
    assert a.bias is not None
    assert a.weight.shape == (6, 2, 3, 3) and a.bias.shape == (6,) and a.weight.dtype == "float32"
    np.testing.assert_array_equal(a.weight.numpy(), b.weight.numpy())
    assert not np.array_equal(a.weight.numpy(), c.weight.numpy())
    bound = 1 / np.sqrt(2 * 3 * 3)  # fan_in = in_channels / groups * kh * kw
    assert np.abs(a.weight.numpy()).max() <= bound and np.abs(a.bias.numpy()).max() <= bound
    assert np.abs(a.weight.numpy()).max() > 0.8 * bound
    assert nn.Conv2d(1, 2, (1, 2), bias=False).bias is None


def test_conv2d_layer_runs_functional_conv2d(dev: Device, rng) -> None:
    layer = nn.Conv2d(2, 4, (3, 2), stride=(2, 1), padding=1, dilation=(1, 2), groups=2, seed=0).to(dev)
    x = rng.standard_normal((2, 2, 6, 5)).astype("float32")
    want = conv2d_ref(x, layer.weight.numpy(), np.asarray(layer.bias), (2, 1), (1, 1), (1, 2), 2)
    np.testing.assert_allclose(layer(dev.tensor(x)).numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("start", "end", "shape"),
    [(1, -1, (2, 60)), (0, -1, (120,)), (1, 2, (2, 12, 5)), (-2, -1, (2, 3, 20)), (2, 2, (2, 3, 4, 5))],
)
def test_flatten_merges_the_axes_from_start_to_end(dev: Device, start: int, end: int, shape) -> None:
    a = np.arange(120.0).reshape(2, 3, 4, 5)
    out = nn.Flatten(start, end)(dev.tensor(a))
    np.testing.assert_array_equal(out.numpy(), a.reshape(shape))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1, seed=0)
        self.bn = nn.BatchNorm2d(2)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * 4 * 4, 3, seed=1))
        self.register_buffer("scratch", np.zeros(2, "float32"), persistent=False)

    def forward(self, x: el.Tensor) -> el.Tensor:
        out: el.Tensor = self.head(F.max_pool2d(self.bn(self.conv(x)).relu(), 2))
        return out


def test_buffers_are_in_state_dict_in_torch_order_but_not_in_parameters() -> None:
    net = Net()
    assert [n for n, _ in net.named_buffers()] == [
        "scratch", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked",
    ]  # fmt: skip
    assert list(net.state_dict()) == [
        "conv.weight", "conv.bias", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var",
        "bn.num_batches_tracked", "head.1.weight", "head.1.bias",
    ]  # fmt: skip
    assert all(not any(p is b for b in net.buffers()) for p in net.parameters())
    assert len(net.parameters()) == 6


def test_to_moves_buffers_in_place_and_state_dict_round_trips_them(dev: Device, rng) -> None:
    src = Net()
    mean = src.bn.running_mean
    assert mean is not None
    assert src.to(dev) is src and src.bn.running_mean is mean and mean.device is dev
    src(dev.tensor(rng.standard_normal((4, 1, 8, 8)).astype("float32")))  # training: stats move
    state = src.state_dict()
    assert state["bn.num_batches_tracked"] == 1 and state["bn.num_batches_tracked"].dtype == np.int64
    assert not np.array_equal(state["bn.running_mean"], np.zeros(2))
    dst = Net()
    dst.load_state_dict(state)  # into host buffers, then moved
    dst.to(dev)
    for name, array in dst.state_dict().items():
        np.testing.assert_array_equal(array, state[name], err_msg=name)
    dst.load_state_dict({**state, "bn.running_var": state["bn.running_var"] * 3})  # into placed buffers
    var = dst.bn.running_var
    assert var is not None and var.device is dev
    np.testing.assert_allclose(var.numpy(), state["bn.running_var"] * 3)
    with pytest.raises(KeyError, match="missing"):
        dst.load_state_dict({k: v for k, v in state.items() if k != "bn.running_mean"})
    with pytest.raises(el.ShapeError):
        dst.load_state_dict({**state, "bn.running_mean": np.zeros(3)})
    x = dev.tensor(rng.standard_normal((2, 1, 8, 8)).astype("float32"))
    src.eval()
    dst.eval()
    dst.load_state_dict(state)
    np.testing.assert_array_equal(src(x).numpy(), dst(x).numpy())


def test_register_buffer_refuses_bad_names_and_values() -> None:
    m = nn.Module()
    with pytest.raises(KeyError):
        m.register_buffer("a.b", np.zeros(1))
    with pytest.raises(TypeError):
        m.register_buffer("a", [1, 2])  # type: ignore[arg-type]
    m.register_buffer("a", None)
    assert m.buffers() == [] and vars(m)["a"] is None
    with pytest.raises(TypeError, match="buffer 'a'"):
        m.a = 3
    m.p = nn.Parameter(np.zeros(1, "float32"))
    with pytest.raises(KeyError, match="already"):
        m.register_buffer("p", np.zeros(1))


def test_a_small_cnn_trains_and_keeps_one_graph_per_step(dev: Device) -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 48)
    x = rng.standard_normal((48, 1, 8, 8)).astype("float32") * 0.3
    for k in range(3):  # each class lights up one band of rows
        x[y == k, 0, 2 * k : 2 * k + 3] += 1.0
    net = Net().to(dev)
    opt = el.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    xt, yt = dev.tensor(x), dev.tensor(y)
    losses = []
    for _ in range(15):
        loss = F.cross_entropy(net(xt), yt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < 0.2 * losses[0]
    assert int(dev.stats()["graphs_built"]) <= 3  # step 1 (new momentum state), steps 2.., and nothing more
    net.eval()
    assert float((net(xt).argmax(axis=1) == yt).astype("float32").mean()) > 0.95


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "exc", "message"),
    [
        (
            lambda d: F.conv2d(d.zeros((1, 3, 5, 5)), d.zeros((2, 2, 3, 3))),
            el.ShapeError,
            "do not fit groups=1",
        ),
        (
            lambda d: F.conv2d(d.zeros((1, 4, 5, 5)), d.zeros((3, 2, 3, 3)), groups=2),
            el.ShapeError,
            "divisible",
        ),
        (
            lambda d: F.conv2d(d.zeros((1, 1, 5, 5)), d.zeros((1, 1, 3, 3)), stride=2, padding="same"),
            el.ShapeError,
            "stride 1",
        ),
        (lambda d: F.conv2d(d.zeros((1, 1, 2, 2)), d.zeros((1, 1, 3, 3))), el.ShapeError, "no window fits"),
        (
            lambda d: F.conv2d(d.zeros((1, 1, 5, 5)), d.zeros((1, 1, 3, 3)), padding="full"),
            el.ShapeError,
            "'same' or 'valid'",
        ),
        (lambda d: F.conv2d(d.zeros((1, 1, 5, 5)), d.zeros((1, 1, 3, 3)), d.zeros(2)), el.ShapeError, "bias"),
        (lambda d: F.conv2d(d.zeros((5, 5)), d.zeros((1, 1, 3, 3))), el.ShapeError, "3-D or 4-D"),
        (lambda d: F.max_pool2d(d.zeros((1, 1, 5, 5)), 0), el.ShapeError, "kernel_size"),
        (lambda d: F.max_pool2d(d.zeros((1, 1, 5, 5)), 2, padding=2), el.ShapeError, "at most half"),
        (lambda d: F.max_pool2d(d.zeros((1, 1, 5, 5), dtype="bool"), 2), el.DTypeError, "numeric"),
        (lambda d: F.avg_pool2d(d.zeros((1, 1, 5, 5), dtype="int32"), 2), el.DTypeError, "float"),
        (lambda d: F.avg_pool2d(d.zeros((1, 1, 1, 5)), 2), el.ShapeError, "too small"),
        (lambda d: F.unfold(d.zeros((1, 1, 5, 5)), (2, 2, 2)), el.ShapeError, "two ints"),
        (lambda d: F.fold(d.zeros((1, 8, 5)), (3, 3), 2), el.ShapeError, "blocks"),
        (
            lambda d: F.batch_norm(d.zeros((1, 2, 1, 1)), None, None, training=True),
            el.ShapeError,
            "more than 1 value",
        ),
        (
            lambda d: F.batch_norm(d.zeros((2, 2, 1, 1)), None, None),
            el.ShapeError,
            "running_mean and running_var",
        ),
        (
            lambda d: F.batch_norm(d.zeros((2, 2, 3)), d.zeros(3), d.ones(3)),
            el.ShapeError,
            "running_mean must be",
        ),
        (lambda d: nn.BatchNorm2d(2).to(d)(d.zeros((2, 2, 3))), el.ShapeError, "4-D"),
    ],
)
def test_bad_arguments_are_clear_errors(dev: Device, call, exc: type, message: str) -> None:
    with pytest.raises(exc, match=message):
        call(dev)


# -- against PyTorch on the GPU machine ------------------------------------------------------------


def _torch_pair(fn: Any, arrays: list[np.ndarray], ref: Any) -> None:
    """Values and gradients of fn (emberlink on Device.cuda) and ref (torch on cuda), float64."""
    torch = importlib.import_module("torch")
    rng = np.random.default_rng(7)
    with Device.cuda(0) as dev:
        xs = [dev.tensor(a) for a in arrays]
        for x in xs:
            x.requires_grad = True
        out = fn(*xs)
        w = rng.standard_normal(out.shape)
        (out * dev.tensor(w)).sum().backward()
        ts = [torch.tensor(a, device="cuda", requires_grad=True) for a in arrays]
        tout = ref(*ts)
        (tout * torch.tensor(w, device="cuda")).sum().backward()
        np.testing.assert_allclose(out.numpy(), tout.detach().cpu().numpy(), rtol=1e-10, atol=1e-10)
        for x, t in zip(xs, ts, strict=True):
            np.testing.assert_allclose(np.asarray(x.grad), t.grad.cpu().numpy(), rtol=1e-9, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kw", [{}, {"stride": 2, "padding": 1}, {"dilation": 2, "groups": 2}, {"padding": "same"}]
)
def test_conv2d_values_and_gradients_match_torch_on_cuda(kw) -> None:
    torch = importlib.import_module("torch")  # the GPU machine has it: missing, this fails, no skip

    rng = np.random.default_rng(3)
    x, w, b = (
        rng.standard_normal((2, 4, 9, 8)),
        rng.standard_normal((6, 4 // kw.get("groups", 1), 3, 3)),
        rng.standard_normal(6),
    )
    _torch_pair(lambda x, w, b: F.conv2d(x, w, b, **kw), [x, w, b],
                lambda x, w, b: torch.nn.functional.conv2d(x, w, b, **kw))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("pool", "kw"),
    [
        ("max", {"kernel_size": 2}),
        ("max", {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True}),
        ("avg", {"kernel_size": 3, "stride": 2, "padding": 1, "ceil_mode": True, "count_include_pad": False}),
        ("avg", {"kernel_size": 2, "ceil_mode": True}),
    ],
)
def test_pools_match_torch_on_cuda(pool: str, kw) -> None:
    torch = importlib.import_module("torch")
    x = np.random.default_rng(4).standard_normal((2, 3, 9, 7))
    ours, theirs = (
        (F.max_pool2d, torch.nn.functional.max_pool2d)
        if pool == "max"
        else (F.avg_pool2d, torch.nn.functional.avg_pool2d)
    )
    _torch_pair(lambda x: ours(x, **kw), [x], lambda x: theirs(x, **kw))


@pytest.mark.gpu
def test_batch_norm_matches_torch_on_cuda() -> None:
    torch = importlib.import_module("torch")
    rng = np.random.default_rng(5)
    x, w, b = rng.standard_normal((4, 3, 5, 5)) * 2 + 1, rng.standard_normal(3), rng.standard_normal(3)
    _torch_pair(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), [x, w, b],
                lambda x, w, b: torch.nn.functional.batch_norm(x, None, None, w, b, training=True))  # fmt: skip
    rm, rv = rng.standard_normal(3), rng.uniform(0.5, 2, 3)
    with Device.cuda(0) as dev:
        ours_m, ours_v = dev.tensor(rm), dev.tensor(rv)
        F.batch_norm(dev.tensor(x), ours_m, ours_v, training=True, momentum=0.3)
        tm, tv = torch.tensor(rm, device="cuda"), torch.tensor(rv, device="cuda")
        torch.nn.functional.batch_norm(torch.tensor(x, device="cuda"), tm, tv, training=True, momentum=0.3)
        np.testing.assert_allclose(ours_m.numpy(), tm.cpu().numpy(), rtol=1e-12)
        np.testing.assert_allclose(ours_v.numpy(), tv.cpu().numpy(), rtol=1e-12)


def test_batch_norm_keeps_the_input_dtype_with_float32_statistics(dev: Device, rng) -> None:
    x = rng.standard_normal((4, 2, 3, 3)).astype("float16")
    bn = nn.BatchNorm2d(2).to(dev)  # float32 parameters and buffers
    for mode in ("train", "eval"):
        getattr(bn, mode)()
        y = bn(dev.tensor(x))
        assert y.dtype == "float16", mode
    x64 = x.astype(np.float64)  # eval: the statistics one training step left
    mean, var = 0.1 * x64.mean((0, 2, 3)), 0.9 + 0.1 * x64.var((0, 2, 3), ddof=1)
    np.testing.assert_allclose(
        y.numpy(), batch_norm_ref(x64, mean, var, None, None, 1e-5), rtol=1e-2, atol=1e-2
    )


def test_a_checkpoint_carries_the_running_statistics(dev: Device, rng, tmp_path) -> None:
    src = Net().to(dev)
    x = dev.tensor(rng.standard_normal((4, 1, 8, 8)).astype("float32"))
    src(x)  # one training step's statistics
    el.save(src.state_dict(), tmp_path / "cnn.safetensors")
    dst = Net().to(dev)
    dst.load_state_dict(el.load(tmp_path / "cnn.safetensors", device=dev))
    assert int(dst.state_dict()["bn.num_batches_tracked"]) == 1
    np.testing.assert_array_equal(src.eval()(x).numpy(), dst.eval()(x).numpy())
