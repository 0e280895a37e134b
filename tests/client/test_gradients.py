"""Every gradient rule against central finite differences in float64, plus autograd's mechanics."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import emberlink as el
from emberlink import Device
from emberlink.client.autograd import DIFFERENTIABLE
from emberlink.graph_replay.ops import names
from tests.graph_replay.cases import UNARY

F = el.nn.functional


def gradient(x: el.Tensor) -> el.Tensor:
    """`x.grad`, which the test's backward() must have set."""
    assert x.grad is not None, "backward() left no gradient"
    return x.grad


def gradcheck(
    dev: Device, fn: Callable[..., el.Tensor], *arrays: np.ndarray, eps: float = 1e-6, tol: float = 1e-6
) -> None:
    """Compare backward() of sum(fn(*xs) * w) (w fixed random) with central differences."""
    arrays = tuple(np.asarray(a, dtype="float64") for a in arrays)
    xs = [dev.tensor(a) for a in arrays]
    for x in xs:
        x.requires_grad = True
    out = fn(*xs)
    w = np.random.default_rng(0).uniform(0.5, 1.5, out.shape)
    (out * dev.tensor(w)).sum().backward()
    analytic = [gradient(x).numpy() for x in xs]

    def value(args: list[np.ndarray]) -> float:
        with el.no_grad():
            return float((fn(*[dev.tensor(a) for a in args]) * dev.tensor(w)).sum())

    for i, a in enumerate(arrays):
        numeric = np.zeros_like(a)
        for j in np.ndindex(a.shape):
            plus, minus = [b.copy() for b in arrays], [b.copy() for b in arrays]
            plus[i][j] += eps
            minus[i][j] -= eps
            numeric[j] = (value(plus) - value(minus)) / (2 * eps)
        np.testing.assert_allclose(analytic[i], numeric, rtol=tol, atol=tol, err_msg=f"input {i}")
        grad = gradient(xs[i])
        assert grad.shape == a.shape and grad.dtype == "float64"


def u(rng: np.random.Generator, *shape: int, lo: float = -2.0, hi: float = 2.0) -> np.ndarray:
    return rng.uniform(lo, hi, size=shape)


def away_from_zero(rng: np.random.Generator, *shape: int) -> np.ndarray:
    a = u(rng, *shape, lo=0.3, hi=2.0)
    signed: np.ndarray = a * rng.choice([-1.0, 1.0], size=shape)
    return signed


DIFFERENTIABLE_UNARY = [name for name in names("unary") if name in DIFFERENTIABLE]


def in_domain(rng: np.random.Generator, name: str) -> np.ndarray:
    """3x4 inputs inside unary op `name`'s domain (its case row), at least 0.3 away from 0 (the
    kinks of abs and relu) where the domain allows."""
    row = UNARY[name]
    a = away_from_zero(rng, 3, 4)
    clipped: np.ndarray = np.clip(np.abs(a) if row.lo >= 0 else a, row.lo, row.hi)
    return clipped


@pytest.mark.parametrize("name", DIFFERENTIABLE_UNARY)
def test_unary_gradient(dev: Device, rng, name: str) -> None:
    gradcheck(dev, lambda x: getattr(x, name)(), in_domain(rng, name))


@pytest.mark.gpu
@pytest.mark.parametrize("name", DIFFERENTIABLE_UNARY)
def test_unary_gradient_on_cuda(name: str) -> None:
    # Needs no fixture (the GPU machine runs it with --noconftest): the rules are the same
    # recorded ops, run by CuPy (fused where they fuse).
    pytest.importorskip("cupy")
    a = in_domain(np.random.default_rng(1234), name)
    with Device.cuda(0) as dev:
        gradcheck(dev, lambda x: getattr(x, name)(), a)


@pytest.mark.parametrize("name", ["floor", "ceil", "round", "trunc"])
def test_rounding_passes_a_zero_gradient_and_its_result_requires_grad(dev: Device, name: str) -> None:
    x = dev.tensor(np.array([-1.5, 0.25, 2.0]))
    x.requires_grad = True
    y = getattr(x, name)()
    assert y.requires_grad  # as in PyTorch: the result takes part in autograd, with gradient 0
    (y * 3.0 + x).sum().backward()
    np.testing.assert_array_equal(gradient(x).numpy(), [1.0, 1.0, 1.0])


@pytest.mark.parametrize("name", ["isnan", "isinf", "isfinite", "sign"])
def test_predicates_and_sign_pass_no_gradient(dev: Device, name: str) -> None:
    x = dev.tensor(np.array([1.0, np.inf]))
    x.requires_grad = True
    assert not getattr(x, name)().requires_grad


BINARY = ["add", "subtract", "multiply", "divide", "maximum", "minimum"]


@pytest.mark.parametrize(("sa", "sb"), [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 3), (4, 1)), ((), (2, 3))])
@pytest.mark.parametrize("name", BINARY)
def test_binary_gradient_with_broadcasting(dev: Device, rng, name: str, sa, sb) -> None:
    a, b = away_from_zero(rng, *sa), away_from_zero(rng, *sb)
    gradcheck(dev, getattr(el, name), a, b)


@pytest.mark.parametrize("name", [*BINARY, "pow"])
def test_binary_gradient_with_a_python_scalar_on_each_side(dev: Device, rng, name: str) -> None:
    a = u(rng, 2, 3, lo=0.5)
    op = getattr(el, name)
    gradcheck(dev, lambda x: op(x, 1.7), a)
    gradcheck(dev, lambda x: op(1.3, x), a)


def test_pow_gradient_for_both_tensor_operands(dev: Device, rng) -> None:
    gradcheck(dev, lambda x, y: x**y, u(rng, 2, 3, lo=0.5), u(rng, 3, lo=-1.0, hi=2.0))


def test_where_gradient_goes_to_the_chosen_operand(dev: Device, rng) -> None:
    c = dev.tensor(rng.random((3, 4)) < 0.5)
    gradcheck(dev, lambda x, y: el.where(c, x, y), u(rng, 3, 4), u(rng, 4))
    gradcheck(dev, lambda x: el.where(c, x, 0.0), u(rng, 3, 4))


def test_astype_gradient_is_cast_back(dev: Device, rng) -> None:
    gradcheck(dev, lambda x: (x.astype("float32") * 2.0).astype("float64"), u(rng, 5), eps=1e-2, tol=1e-3)


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", [None, 0, -1, (0, 2)])
@pytest.mark.parametrize("name", ["sum", "mean", "max", "min", "prod"])
def test_reduction_gradient(dev: Device, rng, name: str, axis, keepdims: bool) -> None:
    a = u(rng, 2, 3, 2, lo=0.5, hi=1.5)  # distinct values: no ties at max/min
    gradcheck(dev, lambda x: getattr(x, name)(axis=axis, keepdims=keepdims), a)


def test_max_gradient_is_shared_between_ties(dev: Device) -> None:
    x = dev.tensor(np.array([1.0, 3.0, 3.0, 2.0]))
    x.requires_grad = True
    x.max().backward()
    np.testing.assert_allclose(gradient(x).numpy(), [0.0, 0.5, 0.5, 0.0])


@pytest.mark.parametrize(
    ("sa", "sb"),
    [
        ((3, 4), (4, 5)),
        ((4,), (4, 5)),
        ((3, 4), (4,)),
        ((4,), (4,)),
        ((2, 3, 4), (4, 5)),
        ((2, 1, 3, 4), (2, 4, 2)),
    ],
)
def test_matmul_gradient(dev: Device, rng, sa, sb) -> None:
    gradcheck(dev, el.matmul, u(rng, *sa), u(rng, *sb))


def test_shape_op_gradients(dev: Device, rng) -> None:
    a = u(rng, 2, 3, 1)
    gradcheck(dev, lambda x: x.reshape(3, -1), a)
    gradcheck(dev, lambda x: x.permute(2, 0, 1), a)
    gradcheck(dev, lambda x: x.T, a)
    gradcheck(dev, lambda x: x.broadcast_to(4, 2, 3, 5), a)
    gradcheck(dev, lambda x: x.expand_dims(1), a)
    gradcheck(dev, lambda x: x.squeeze(), a)


def test_concat_and_stack_gradients(dev: Device, rng) -> None:
    gradcheck(dev, lambda x, y: el.concat([x, y, x], axis=1), u(rng, 2, 3), u(rng, 2, 1))
    gradcheck(dev, lambda x, y: el.stack([x, y], axis=-1), u(rng, 2, 3), u(rng, 2, 3))


@pytest.mark.parametrize(
    "key",
    [
        1,
        -1,
        slice(1, None),
        (slice(None, None, -1), 0),
        (None, Ellipsis, slice(0, 3, 2)),
        (1, slice(2, 0, -1)),
    ],
)
def test_getitem_gradient(dev: Device, rng, key) -> None:
    gradcheck(dev, lambda x: x[key], u(rng, 3, 4))


def test_take_gradient_adds_up_repeated_indices(dev: Device, rng) -> None:
    idx = dev.tensor(np.array([2, 0, 2, 2]))
    gradcheck(dev, lambda x: x[idx], u(rng, 3, 2))
    gradcheck(dev, lambda x: x.take(idx, axis=1), u(rng, 2, 3))
    gradcheck(dev, lambda x: x.take(idx, axis=None), u(rng, 2, 2))


@pytest.mark.parametrize("axis", [0, -1])
def test_softmax_and_log_softmax_gradients(dev: Device, rng, axis: int) -> None:
    gradcheck(dev, lambda x: F.softmax(x, axis), u(rng, 3, 4))
    gradcheck(dev, lambda x: F.log_softmax(x, axis), u(rng, 3, 4))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_gradient(dev: Device, rng, reduction: str) -> None:
    labels = dev.tensor(np.array([0, 2, 1, 2]))
    gradcheck(dev, lambda z: F.cross_entropy(z, labels, reduction=reduction), u(rng, 4, 3))


def test_composite_layers_gradients(dev: Device, rng) -> None:
    gradcheck(dev, F.gelu, u(rng, 3, 4))
    gradcheck(dev, lambda p, t: F.mse_loss(p, t), u(rng, 3, 2), u(rng, 3, 2))
    ln = el.nn.LayerNorm(4, dtype="float64").to(dev)
    gradcheck(dev, ln, u(rng, 2, 4))


# -- autograd mechanics -----------------------------------------------------------------------------


def test_implicit_seed_of_a_scalar_loss(dev: Device) -> None:
    x = dev.tensor([1.0, 2.0, 3.0])
    x.requires_grad = True
    x.sum().backward()
    np.testing.assert_array_equal(gradient(x).numpy(), [1.0, 1.0, 1.0])
    y = dev.tensor([1.0, 2.0])
    y.requires_grad = True
    (y * y).mean().backward()
    np.testing.assert_allclose(gradient(y).numpy(), [1.0, 2.0])


def test_backward_of_a_non_scalar_needs_a_gradient(dev: Device) -> None:
    x = dev.tensor([1.0, 2.0])
    x.requires_grad = True
    y = x * 3.0
    with pytest.raises(el.ShapeError, match="one-element"):
        y.backward()
    y.backward(dev.tensor([1.0, 10.0]))
    np.testing.assert_array_equal(gradient(x).numpy(), [3.0, 30.0])


def test_gradients_accumulate_across_backward_calls_until_cleared(dev: Device) -> None:
    x = dev.tensor([2.0])
    x.requires_grad = True
    (x * x).sum().backward()
    (x * 3.0).sum().backward()
    np.testing.assert_array_equal(gradient(x).numpy(), [7.0])
    x.grad = None
    (x * 1.0).sum().backward()
    np.testing.assert_array_equal(gradient(x).numpy(), [1.0])


def test_a_tensor_used_twice_gets_both_contributions(dev: Device) -> None:
    x = dev.tensor([3.0])
    x.requires_grad = True
    y = x * 2.0
    (y * y + y).sum().backward()  # d/dx (4x^2 + 2x) = 8x + 2
    np.testing.assert_array_equal(gradient(x).numpy(), [26.0])


def test_no_grad_and_detach_stop_history(dev: Device) -> None:
    x = dev.tensor([1.0])
    x.requires_grad = True
    with el.no_grad():
        y = x * 2.0
    assert not y.requires_grad
    z = (x * 2.0).detach()
    assert not z.requires_grad and z.is_leaf

    @el.no_grad()
    def f(t: el.Tensor) -> el.Tensor:
        return t * 2.0

    assert not f(x).requires_grad
    assert (x * 2.0).requires_grad


def test_backward_twice_through_freed_history_is_an_error(dev: Device) -> None:
    x = dev.tensor([1.0])
    x.requires_grad = True
    y = x * 2.0
    z = y * 3.0
    z.sum().backward()
    with pytest.raises(RuntimeError, match="second time"):
        (z * 1.0).sum().backward()


def test_backward_without_a_leaf_that_requires_grad_is_an_error(dev: Device) -> None:
    with pytest.raises(RuntimeError, match="does not require grad"):
        dev.tensor([1.0]).sum().backward()


def test_only_float_tensors_can_require_grad(dev: Device) -> None:
    with pytest.raises(el.DTypeError, match="float"):
        dev.tensor([1, 2]).requires_grad = True


def test_non_differentiable_results_do_not_require_grad(dev: Device) -> None:
    x = dev.tensor([1.0, -1.0])
    x.requires_grad = True
    assert not (x > 0).requires_grad
    assert not x.argmax().requires_grad
    assert not x.sign().requires_grad


def test_leaf_used_in_float16_gets_a_gradient_of_its_own_dtype(dev: Device) -> None:
    x = dev.tensor(np.array([1.0, 2.0], dtype="float16"))
    x.requires_grad = True
    y = dev.tensor(np.array([3.0, 4.0], dtype="float32"))
    (x * y).sum().backward()
    assert gradient(x).dtype == "float16"
    np.testing.assert_array_equal(gradient(x).numpy(), [3.0, 4.0])


def test_no_grad_in_one_thread_leaves_other_threads_recording(dev: Device) -> None:
    import threading

    inside, release = threading.Event(), threading.Event()

    def hold_no_grad() -> None:
        with el.no_grad():
            inside.set()
            release.wait(10)

    other = threading.Thread(target=hold_no_grad)
    other.start()
    try:
        assert inside.wait(10)
        x = dev.tensor([1.0, 2.0, 3.0])
        x.requires_grad = True
        (x * x).sum().backward()  # would find no history if no_grad were process-wide
        np.testing.assert_allclose(gradient(x).numpy(), [2.0, 4.0, 6.0])
    finally:
        release.set()
        other.join()
