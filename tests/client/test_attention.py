"""Attention: scaled_dot_product_attention, MultiheadAttention and TransformerEncoderLayer against
NumPy references written here, gradients against finite differences (float64), and against torch
on the GPU machine (`-m gpu`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import emberlink as el
from emberlink import Device, nn

from .test_gradients import gradcheck

F = nn.functional
Array = np.ndarray[Any, Any]


# -- NumPy references ----------------------------------------------------------------------------------


def np_softmax(s: Array) -> Array:
    e = np.exp(s - s.max(-1, keepdims=True))
    return np.asarray(e / e.sum(-1, keepdims=True))


def np_masked(s: Array, mask: Array | None, masked_if: bool) -> Array:
    """Scores with `mask` applied: bool entries equal to `masked_if` become -inf; floats are added."""
    if mask is None:
        return s
    return np.where(mask == masked_if, -np.inf, s) if mask.dtype == bool else s + mask


def np_sdpa(
    q: Array, k: Array, v: Array, mask: Array | None = None, causal: bool = False, scale: float | None = None
) -> Array:
    s = (q @ np.swapaxes(k, -1, -2)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    s = np_masked(s, mask, False)  # this function's bool masks: True = take part
    if causal:
        s = np_masked(s, np.tril(np.ones(s.shape[-2:], bool)), False)
    return np_softmax(s) @ v


def np_mha(
    q: Array,
    k: Array,
    v: Array,
    p: dict[str, Array],
    heads: int,
    attn_mask: Array | None = None,
    kpm: Array | None = None,
    causal: bool = False,
) -> tuple[Array, Array]:
    """Batch-first (N, L, E) multi-head attention with torch's layer masks (bool True = masked)
    and emberlink-layout parameters `p` (x @ W). Returns the output and per-head weights."""
    n, tgt, e = q.shape
    src, d = k.shape[1], e // heads
    if "in_proj_weight" in p:
        w = p["in_proj_weight"]
        wq, wk, wv = w[:, :e], w[:, e : 2 * e], w[:, 2 * e :]
    else:
        wq, wk, wv = p["q_proj_weight"], p["k_proj_weight"], p["v_proj_weight"]
    b = p.get("in_proj_bias", np.zeros(3 * e))

    def split(x: Array) -> Array:
        return x.reshape(n, -1, heads, d).transpose(0, 2, 1, 3)

    qh, kh, vh = split(q @ wq + b[:e]), split(k @ wk + b[e : 2 * e]), split(v @ wv + b[2 * e :])
    s = qh @ kh.transpose(0, 1, 3, 2) / math.sqrt(d)
    if attn_mask is not None and attn_mask.ndim == 3:
        attn_mask = attn_mask.reshape(n, heads, tgt, src)
    s = np_masked(s, attn_mask, True)
    s = np_masked(s, None if kpm is None else kpm[:, None, None, :], True)
    if causal:
        s = np_masked(s, ~np.tril(np.ones((tgt, src), bool)), True)
    w = np_softmax(s)
    out = (w @ vh).transpose(0, 2, 1, 3).reshape(n, tgt, e) @ p["out_proj.weight"]
    return out + p.get("out_proj.bias", 0.0), w


def np_layer_norm(x: Array, w: Array, b: Array, eps: float) -> Array:
    mu = x.mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    return np.asarray(y * w + b)


def np_gelu(x: Array) -> Array:
    return np.asarray(0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))))


def np_encoder_layer(
    x: Array,
    p: dict[str, Array],
    heads: int,
    norm_first: bool,
    act: Callable[[Array], Array],
    eps: float = 1e-5,
    **masks: Any,
) -> Array:
    sa_p = {k.removeprefix("self_attn."): v for k, v in p.items() if k.startswith("self_attn.")}

    def sa(y: Array) -> Array:
        return np_mha(y, y, y, sa_p, heads, **masks)[0]

    def ff(y: Array) -> Array:
        return act(y @ p["linear1.weight"] + p["linear1.bias"]) @ p["linear2.weight"] + p["linear2.bias"]

    def ln(i: int, y: Array) -> Array:
        return np_layer_norm(y, p[f"norm{i}.weight"], p[f"norm{i}.bias"], eps)

    if norm_first:
        x = x + sa(ln(1, x))
        return x + ff(ln(2, x))
    x = ln(1, x + sa(x))
    return ln(2, x + ff(x))


def randomize(module: nn.Module, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Give every parameter random values (zero biases and unit norms test too little); the state."""
    for _, p in module.named_parameters():
        p.assign(rng.uniform(-0.5, 0.5, p.shape))
    return module.state_dict()


def param_gradcheck(
    module: nn.Module, loss: Callable[[], el.Tensor], eps: float = 1e-6, tol: float = 1e-6
) -> None:
    """Every parameter's backward() gradient of `loss()` against central finite differences."""
    module.zero_grad()
    loss().backward()
    for name, p in module.named_parameters():
        assert p.grad is not None, name
        base, analytic = p.numpy(), p.grad.numpy()
        numeric = np.zeros_like(base)
        with el.no_grad():
            for j in np.ndindex(base.shape):
                for sign in (1, -1):
                    a = base.copy()
                    a[j] += sign * eps
                    p.assign(a)
                    numeric[j] += sign * float(loss()) / (2 * eps)
        p.assign(base)
        np.testing.assert_allclose(analytic, numeric, rtol=tol, atol=tol, err_msg=name)


# -- scaled_dot_product_attention ---------------------------------------------------------------------


@pytest.mark.parametrize("mask", ["none", "bool", "float", "causal", "broadcast-bool"])
def test_sdpa_matches_numpy_for_each_kind_of_mask(dev: Device, rng: np.random.Generator, mask: str) -> None:
    q, k, v = (
        rng.standard_normal((2, 3, 4, 8)),
        rng.standard_normal((2, 3, 5, 8)),
        rng.standard_normal((2, 3, 5, 6)),
    )
    m: Array | None = None
    if mask == "bool":
        m = rng.random((2, 3, 4, 5)) < 0.6
        m[..., 0] = True  # every query keeps a key
    elif mask == "broadcast-bool":
        m = rng.random((4, 5)) < 0.6
        m[:, 0] = True
    elif mask == "float":
        m = rng.standard_normal((2, 1, 4, 5))
    tq, tk, tv = (dev.tensor(a.astype("float32")) for a in (q, k, v))
    tm = None if m is None else dev.tensor(m if m.dtype == bool else m.astype("float32"))
    out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, is_causal=mask == "causal")
    assert out.shape == (2, 3, 4, 6) and out.dtype == "float32"
    np.testing.assert_allclose(out.numpy(), np_sdpa(q, k, v, m, mask == "causal"), rtol=1e-5, atol=1e-5)


def test_sdpa_scale_replaces_one_over_sqrt_e_and_leading_axes_broadcast(
    dev: Device, rng: np.random.Generator
) -> None:
    q, k, v = rng.standard_normal((2, 4, 8)), rng.standard_normal((5, 8)), rng.standard_normal((5, 3))
    out = F.scaled_dot_product_attention(dev.tensor(q), dev.tensor(k), dev.tensor(v), scale=0.3)
    np.testing.assert_allclose(out.numpy(), np_sdpa(q, k, v, scale=0.3), rtol=1e-12)


@pytest.mark.parametrize("mask", ["bool", "float", "causal"])
def test_sdpa_gradients_match_finite_differences(dev: Device, rng: np.random.Generator, mask: str) -> None:
    q, k, v = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 4, 4)), rng.standard_normal((2, 4, 2))
    m = (
        np.array([[1, 0, 1, 1], [0, 1, 0, 1], [1, 1, 0, 0]], bool)
        if mask == "bool"
        else rng.standard_normal((3, 4))
    )
    tm = None if mask == "causal" else dev.tensor(m)
    gradcheck(
        dev, lambda a, b, c: F.scaled_dot_product_attention(a, b, c, tm, is_causal=mask == "causal"), q, k, v
    )


def test_sdpa_dropout_drops_attention_weights_with_the_given_seed(
    dev: Device, rng: np.random.Generator
) -> None:
    q, k, v = (dev.tensor(rng.standard_normal((3, 6, 4)).astype("float32")) for _ in range(3))
    a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.4, seed=7)
    expected = F.dropout(F.softmax((q * 0.5) @ k.mT), 0.4, seed=7) @ v  # 0.5 = 1 / sqrt(4)
    np.testing.assert_allclose(a.numpy(), expected.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.4, seed=7).numpy(), a.numpy()
    )
    assert not np.allclose(F.scaled_dot_product_attention(q, k, v, dropout_p=0.4, seed=8).numpy(), a.numpy())


def test_sdpa_refuses_bad_arguments_with_specific_errors(dev: Device) -> None:
    q = dev.zeros((2, 4, 8))
    with pytest.raises(ValueError, match="seed="):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="not both"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=dev.ones((4, 4), "bool"), is_causal=True)
    with pytest.raises(el.DTypeError, match="bool or float32"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=dev.ones((4, 4), "int64"))
    with pytest.raises(el.ShapeError, match="does not broadcast"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=dev.ones((3, 4), "bool"))
    with pytest.raises(el.ShapeError, match="key features"):
        F.scaled_dot_product_attention(q, dev.zeros((2, 4, 7)), q)
    with pytest.raises(el.ShapeError, match="value length"):
        F.scaled_dot_product_attention(q, q, dev.zeros((2, 3, 8)))
    with pytest.raises(el.DTypeError, match="value is float64"):
        F.scaled_dot_product_attention(q, q, dev.zeros((2, 4, 8), "float64"))
    with pytest.raises(el.DTypeError, match="must be float"):
        F.scaled_dot_product_attention(dev.zeros((4, 8), "int64"), q, q)


def test_sdpa_query_with_no_key_allowed_is_nan(dev: Device) -> None:
    q = dev.ones((1, 2, 4))
    keep = dev.tensor(np.array([[True, True], [False, False]]))
    out = F.scaled_dot_product_attention(q, q, q, attn_mask=keep).numpy()
    assert np.isfinite(out[0, 0]).all() and np.isnan(out[0, 1]).all()


# -- MultiheadAttention --------------------------------------------------------------------------------


def test_mha_parameter_names_and_shapes_follow_torch_with_x_at_weight_layout() -> None:
    mha = nn.MultiheadAttention(8, 2)
    assert {n: p.shape for n, p in mha.named_parameters()} == {
        "in_proj_weight": (8, 24),
        "in_proj_bias": (24,),
        "out_proj.weight": (8, 8),
        "out_proj.bias": (8,),
    }
    cross = nn.MultiheadAttention(8, 2, bias=False, kdim=3, vdim=5)
    assert {n: p.shape for n, p in cross.named_parameters()} == {
        "q_proj_weight": (8, 8),
        "k_proj_weight": (3, 8),
        "v_proj_weight": (5, 8),
        "out_proj.weight": (8, 8),
    }
    assert mha.in_proj_bias is not None and mha.in_proj_weight is not None
    np.testing.assert_array_equal(mha.in_proj_bias.numpy(), 0)  # torch's initial values
    bound = math.sqrt(6 / 32)
    assert 0.5 * bound < np.abs(mha.in_proj_weight.numpy()).max() <= bound


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ["none", "bool", "float", "per-head", "causal+padding"])
def test_mha_self_attention_matches_numpy(
    dev: Device, rng: np.random.Generator, batch_first: bool, masks: str
) -> None:
    n, length, e, heads = 2, 5, 8, 2
    mha = nn.MultiheadAttention(e, heads, batch_first=batch_first, dtype="float64", device=dev)
    p = randomize(mha, rng)
    x = rng.standard_normal((n, length, e))
    kw: dict[str, Any] = {}
    if masks == "bool":
        kw["attn_mask"] = rng.random((length, length)) < 0.4
        np.fill_diagonal(kw["attn_mask"], False)
    elif masks == "float":
        kw["attn_mask"] = rng.standard_normal((length, length))
    elif masks == "per-head":
        kw["attn_mask"] = rng.standard_normal((n * heads, length, length))
    elif masks == "causal+padding":
        kw["kpm"] = np.array([[False] * 5, [False, False, False, True, True]])
        kw["causal"] = True
    ref_out, ref_w = np_mha(x, x, x, p, heads, **kw)
    tx = dev.tensor(x if batch_first else x.transpose(1, 0, 2))
    mask = kw.get("attn_mask")
    kpm = kw.get("kpm")
    out, w = mha(
        tx,
        tx,
        tx,
        key_padding_mask=None if kpm is None else dev.tensor(kpm),
        attn_mask=None if mask is None else dev.tensor(mask),
        is_causal=bool(kw.get("causal")),
    )
    got = out.numpy() if batch_first else out.numpy().transpose(1, 0, 2)
    np.testing.assert_allclose(got, ref_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(w.numpy(), ref_w.mean(1), rtol=1e-10, atol=1e-12)
    _, per_head = mha(tx, tx, tx, average_attn_weights=False, is_causal=bool(kw.get("causal")))
    assert per_head.shape == (n, heads, length, length)
    assert mha(tx, tx, tx, need_weights=False)[1] is None


def test_mha_cross_attention_with_kdim_vdim_and_a_float_padding_mask_matches_numpy(
    dev: Device, rng: np.random.Generator
) -> None:
    mha = nn.MultiheadAttention(6, 3, kdim=4, vdim=5, batch_first=True, dtype="float64", device=dev)
    p = randomize(mha, rng)
    q, k, v = rng.standard_normal((2, 3, 6)), rng.standard_normal((2, 7, 4)), rng.standard_normal((2, 7, 5))
    kpm = rng.standard_normal((2, 7))
    out, w = mha(dev.tensor(q), dev.tensor(k), dev.tensor(v), key_padding_mask=dev.tensor(kpm))
    ref_out, ref_w = np_mha(q, k, v, p, 3, kpm=kpm)
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(w.numpy(), ref_w.mean(1), rtol=1e-10, atol=1e-12)


def test_mha_unbatched_input_is_one_batch_of_one(dev: Device, rng: np.random.Generator) -> None:
    mha = nn.MultiheadAttention(4, 2, dtype="float64", device=dev)
    p = randomize(mha, rng)
    x = rng.standard_normal((3, 4))
    kpm = np.array([False, True, False])
    out, w = mha(dev.tensor(x), dev.tensor(x), dev.tensor(x), key_padding_mask=dev.tensor(kpm))
    ref_out, ref_w = np_mha(x[None], x[None], x[None], p, 2, kpm=kpm[None])
    assert out.shape == (3, 4) and w.shape == (3, 3)
    np.testing.assert_allclose(out.numpy(), ref_out[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(w.numpy(), ref_w.mean(1)[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["self-causal-padding", "cross-bool-mask"])
def test_mha_gradients_match_finite_differences(dev: Device, rng: np.random.Generator, case: str) -> None:
    if case == "self-causal-padding":
        mha = nn.MultiheadAttention(4, 2, batch_first=True, dtype="float64", device=dev)
        x = dev.tensor(rng.standard_normal((2, 3, 4)))
        kpm = dev.tensor(np.array([[False, False, True], [False, False, False]]))
        args: tuple[el.Tensor, ...] = (x, x, x)
        kw = {"key_padding_mask": kpm, "is_causal": True}
    else:
        mha = nn.MultiheadAttention(4, 2, kdim=3, vdim=2, dtype="float64", device=dev)
        args = tuple(dev.tensor(rng.standard_normal(s)) for s in ((2, 1, 4), (3, 1, 3), (3, 1, 2)))
        kw = {"attn_mask": dev.tensor(np.array([[False, True, False], [True, False, False]]))}
    randomize(mha, rng)
    wo = dev.tensor(rng.uniform(0.5, 1.5, mha(*args, **kw)[0].shape))
    ww = dev.tensor(rng.uniform(0.5, 1.5, mha(*args, **kw)[1].shape))

    def loss() -> el.Tensor:
        out, w = mha(*args, **kw)
        assert w is not None  # need_weights defaults to True
        total: el.Tensor = (out * wo).sum() + (w * ww).sum()
        return total

    param_gradcheck(mha, loss)
    gradcheck(dev, lambda q, k, v: mha(q, k, v, **kw)[0], *(a.numpy() for a in args))


def test_mha_dropout_drops_weights_in_training_with_a_new_seed_each_call_and_not_in_eval(
    dev: Device, rng: np.random.Generator
) -> None:
    mha = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True, seed=3, device=dev)
    x = dev.tensor(rng.standard_normal((2, 16, 8)).astype("float32"))
    mha.eval()
    _, ref = mha(x, x, x, average_attn_weights=False)
    ref_w = ref.numpy()
    mha.train()
    w1, w2 = (mha(x, x, x, average_attn_weights=False)[1].numpy() for _ in range(2))
    for w in (w1, w2):
        kept = w != 0
        assert 0.4 < 1 - kept.mean() < 0.6  # about half the weights dropped ...
        np.testing.assert_allclose(w[kept], ref_w[kept] / 0.5, rtol=1e-5)  # ... the rest scaled
    assert not np.array_equal(w1, w2)
    built = dev.stats()["graphs_built"]
    mha(x, x, x)[0].numpy()
    mha(x, x, x)[0].numpy()
    assert dev.stats()["graphs_built"] == built + 1  # the seed is a binding: one graph for both calls


def test_mha_refuses_bad_sizes_and_masks(dev: Device) -> None:
    with pytest.raises(ValueError, match="multiple of num_heads"):
        nn.MultiheadAttention(10, 3)
    mha = nn.MultiheadAttention(8, 2, batch_first=True, device=dev)
    x = dev.zeros((2, 5, 8))
    with pytest.raises(el.ShapeError, match="this layer takes 8, 8, 8"):
        mha(dev.zeros((2, 5, 6)), x, x)
    with pytest.raises(el.ShapeError, match="all be 3-D"):
        mha(x, dev.zeros((5, 8)), x)
    with pytest.raises(el.ShapeError, match=r"attn_mask must have shape \(5, 5\) or \(4, 5, 5\)"):
        mha(x, x, x, attn_mask=dev.ones((2, 5, 5), "bool"))
    with pytest.raises(el.ShapeError, match=r"key_padding_mask must have shape \(2, 5\)"):
        mha(x, x, x, key_padding_mask=dev.ones((5, 2), "bool"))
    with pytest.raises(el.DTypeError, match="bool or float32"):
        mha(x, x, x, key_padding_mask=dev.ones((2, 5), "int64"))


# -- TransformerEncoderLayer ---------------------------------------------------------------------------


def test_encoder_layer_submodule_and_parameter_names_follow_torch() -> None:
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16)
    assert [n for n, _ in layer.named_modules()][1:] == [
        "self_attn",
        "self_attn.out_proj",
        "linear1",
        "dropout",
        "linear2",
        "norm1",
        "norm2",
        "dropout1",
        "dropout2",
    ]
    assert [n for n, _ in layer.named_parameters()] == [
        "self_attn.in_proj_weight",
        "self_attn.in_proj_bias",
        "self_attn.out_proj.weight",
        "self_attn.out_proj.bias",
        "linear1.weight",
        "linear1.bias",
        "linear2.weight",
        "linear2.bias",
        "norm1.weight",
        "norm1.bias",
        "norm2.weight",
        "norm2.bias",
    ]
    no_bias = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, bias=False)
    assert [n for n, _ in no_bias.named_parameters()] == [
        "self_attn.in_proj_weight",
        "self_attn.out_proj.weight",
        "linear1.weight",
        "linear2.weight",
        "norm1.weight",
        "norm2.weight",
    ]
    with pytest.raises(ValueError, match="'relu', 'gelu' or a function"):
        nn.TransformerEncoderLayer(8, 2, activation="swish")


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize(("norm_first", "activation"), [(False, "relu"), (True, "gelu")])
def test_encoder_layer_in_eval_matches_numpy(
    dev: Device, rng: np.random.Generator, norm_first: bool, activation: str, batch_first: bool
) -> None:
    layer = nn.TransformerEncoderLayer(
        8, 2, 16, 0.3, activation, batch_first=batch_first, norm_first=norm_first, dtype="float64", device=dev
    ).eval()
    p = randomize(layer, rng)
    x = rng.standard_normal((2, 5, 8))
    kpm = np.array([[False] * 5, [False, False, False, False, True]])
    act = np_gelu if activation == "gelu" else (lambda a: np.maximum(a, 0))
    ref = np_encoder_layer(x, p, 2, norm_first, act, kpm=kpm, causal=True)
    tx = dev.tensor(x if batch_first else x.transpose(1, 0, 2))
    out = layer(tx, src_key_padding_mask=dev.tensor(kpm), is_causal=True).numpy()
    np.testing.assert_allclose(out if batch_first else out.transpose(1, 0, 2), ref, rtol=1e-10, atol=1e-12)
    mask = rng.standard_normal((5, 5))
    out = layer(tx, src_mask=dev.tensor(mask)).numpy()
    ref = np_encoder_layer(x, p, 2, norm_first, act, attn_mask=mask)
    np.testing.assert_allclose(out if batch_first else out.transpose(1, 0, 2), ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_gradients_match_finite_differences(
    dev: Device, rng: np.random.Generator, norm_first: bool
) -> None:
    layer = nn.TransformerEncoderLayer(
        4, 2, 6, batch_first=True, norm_first=norm_first, activation="gelu", dtype="float64", device=dev
    ).eval()
    randomize(layer, rng)
    x = rng.standard_normal((2, 3, 4))
    w = dev.tensor(rng.uniform(0.5, 1.5, x.shape))
    tx = dev.tensor(x)
    param_gradcheck(layer, lambda: (layer(tx, is_causal=True) * w).sum())
    gradcheck(dev, lambda a: layer(a, is_causal=True), x)


def test_encoder_layer_dropout_in_training_changes_each_step_but_keeps_one_graph(
    dev: Device, rng: np.random.Generator
) -> None:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.2, batch_first=True, seed=1, device=dev)
    x = dev.tensor(rng.standard_normal((2, 5, 8)).astype("float32"))
    opt = el.optim.SGD(layer.parameters(), lr=0.0)  # a full step, values unchanged
    outs, built = [], []
    for _ in range(3):
        out = layer(x, is_causal=True)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append(out.numpy())
        built.append(dev.stats()["graphs_built"])
    assert not np.allclose(outs[0], outs[1]) and not np.allclose(outs[1], outs[2])
    assert built[1] == built[2]  # the same graph every step after the first
    layer.eval()
    np.testing.assert_array_equal(layer(x, is_causal=True).numpy(), layer(x, is_causal=True).numpy())


# -- against torch (the GPU machine has it; it must be there) ------------------------------------------


def _torch_state(module: Any) -> dict[str, Array]:
    """A torch state dict as emberlink holds it: each 2-D weight transposed (x @ W)."""
    return {
        k: (v.T if v.ndim == 2 else v)
        for k, v in ((k, t.detach().cpu().numpy()) for k, t in module.state_dict().items())
    }


def _gpu_devices() -> list[Device]:
    return [Device.cpu(), Device.cuda(0)]


@pytest.mark.gpu
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_matches_torch_values_and_gradients(norm_first: bool) -> None:
    import torch

    torch.manual_seed(0)
    ref = torch.nn.TransformerEncoderLayer(
        16, 4, 32, 0.0, lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
        batch_first=True, norm_first=norm_first, dtype=torch.float64,
    )  # fmt: skip
    x = np.random.default_rng(0).standard_normal((3, 7, 16))
    kpm = np.zeros((3, 7), bool)
    kpm[1, 5:] = True
    causal = torch.ones(7, 7, dtype=torch.bool).triu(1)  # True = masked; bool like the padding mask
    tx = torch.tensor(x, requires_grad=True)
    want = ref(tx, src_mask=causal, src_key_padding_mask=torch.tensor(kpm), is_causal=True)
    want.square().sum().backward()
    grads = {k: (p.grad.numpy().T if p.ndim == 2 else p.grad.numpy()) for k, p in ref.named_parameters()}
    for dev in _gpu_devices():
        with dev:
            layer = nn.TransformerEncoderLayer(
                16, 4, 32, 0.0, "gelu", batch_first=True, norm_first=norm_first, dtype="float64", device=dev
            )
            layer.load_state_dict(_torch_state(ref))
            ex = dev.tensor(x)
            ex.requires_grad = True
            got = layer(ex, src_key_padding_mask=dev.tensor(kpm), is_causal=True)
            got.square().sum().backward()
            np.testing.assert_allclose(got.numpy(), want.detach().numpy(), rtol=1e-9, atol=1e-10)
            assert ex.grad is not None and tx.grad is not None
            np.testing.assert_allclose(ex.grad.numpy(), tx.grad.numpy(), rtol=1e-8, atol=1e-9)
            for name, p in layer.named_parameters():
                assert p.grad is not None, name
                np.testing.assert_allclose(p.grad.numpy(), grads[name], rtol=1e-8, atol=1e-9, err_msg=name)


@pytest.mark.gpu
def test_mha_and_sdpa_match_torch_in_float32() -> None:
    import torch

    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(32, 4, kdim=24, vdim=20)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s).astype("float32") for s in ((9, 2, 32), (11, 2, 24), (11, 2, 20)))
    mask = rng.random((9, 11)) < 0.3
    mask[:, 0] = False
    want, want_w = ref(*(torch.tensor(a) for a in (q, k, v)), attn_mask=torch.tensor(mask))
    sq, sk, sv = (
        rng.standard_normal(s).astype("float32") for s in ((2, 3, 9, 8), (2, 3, 11, 8), (2, 3, 11, 5))
    )
    want_sdpa = torch.nn.functional.scaled_dot_product_attention(
        *(torch.tensor(a) for a in (sq, sk, sv)), attn_mask=torch.tensor(~mask)
    )
    for dev in _gpu_devices():
        with dev:
            mha = nn.MultiheadAttention(32, 4, kdim=24, vdim=20, device=dev)
            mha.load_state_dict(_torch_state(ref))
            got, got_w = mha(dev.tensor(q), dev.tensor(k), dev.tensor(v), attn_mask=dev.tensor(mask))
            np.testing.assert_allclose(got.numpy(), want.detach().numpy(), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(got_w.numpy(), want_w.detach().numpy(), rtol=1e-5, atol=1e-6)
            got_sdpa = F.scaled_dot_product_attention(
                dev.tensor(sq), dev.tensor(sk), dev.tensor(sv), attn_mask=dev.tensor(~mask)
            )
            np.testing.assert_allclose(got_sdpa.numpy(), want_sdpa.numpy(), rtol=1e-5, atol=1e-5)
