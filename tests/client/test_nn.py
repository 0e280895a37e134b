"""emberlink.nn: modules, parameters, state dicts, layers, and training a model to a low loss."""

from __future__ import annotations

import math

import numpy as np
import pytest

import emberlink as el
from emberlink import Device, nn

F = nn.functional


def test_public_module_names_import() -> None:
    import emberlink.optim
    from emberlink.nn.functional import cross_entropy

    assert cross_entropy is el.nn.functional.cross_entropy
    assert emberlink.optim.SGD is el.optim.SGD


def test_linear_init_is_deterministic_per_seed_and_kaiming_bounded() -> None:
    a, b, c = nn.Linear(50, 20, seed=3), nn.Linear(50, 20, seed=3), nn.Linear(50, 20, seed=4)
    wa, wb, wc = (m.weight.numpy() for m in (a, b, c))
    np.testing.assert_array_equal(wa, wb)
    assert not np.array_equal(wa, wc)
    assert a.bias is not None  # Linear has a bias unless bias=False
    assert wa.shape == (50, 20) and wa.dtype == np.float32 and a.bias.shape == (20,)
    bound = 1 / math.sqrt(50)
    assert np.abs(wa).max() <= bound and np.abs(a.bias.numpy()).max() <= bound


def test_linear_forward_matches_numpy(dev: Device, rng) -> None:
    layer = nn.Linear(4, 3, seed=0).to(dev)
    x = rng.standard_normal((5, 4)).astype("float32")
    assert layer.bias is not None  # Linear has a bias unless bias=False
    w, b = layer.weight.numpy(), layer.bias.numpy()
    np.testing.assert_allclose(layer(dev.tensor(x)).numpy(), x @ w + b, rtol=1e-5)
    no_bias = nn.Linear(4, 3, bias=False, seed=0, device=dev)
    assert no_bias.bias is None and len(no_bias.parameters()) == 1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4, seed=0), nn.ReLU(), nn.Linear(4, 2, seed=1))
        self.head = nn.Linear(2, 2, seed=2)
        self.tied = self.head  # the same module twice: its parameters appear once
        self.scale = nn.Parameter(np.ones(2, dtype="float32"))

    def forward(self, x: el.Tensor) -> el.Tensor:
        y: el.Tensor = self.head(self.body(x))
        return y * self.scale


def test_named_parameters_are_dotted_attribute_paths_in_order() -> None:
    names = [n for n, _ in Block().named_parameters()]
    assert names == [
        "scale",
        "body.0.weight",
        "body.0.bias",
        "body.2.weight",
        "body.2.bias",
        "head.weight",
        "head.bias",
    ]


def test_to_moves_parameters_in_place(dev: Device) -> None:
    block = Block()
    params = block.parameters()
    assert block.to(dev) is block
    assert block.parameters() == params
    assert all(p.device is dev and p.requires_grad for p in params)
    assert block(dev.tensor(np.ones((1, 3), "float32"))).shape == (1, 2)


def test_state_dict_round_trip(dev: Device) -> None:
    src = Block().to(dev)
    state = src.state_dict()
    assert set(state) == {n for n, _ in src.named_parameters()}
    assert all(isinstance(a, np.ndarray) for a in state.values())
    dst = Block()
    for p in dst.parameters():
        p.assign(np.zeros(p.shape))
    dst.load_state_dict(state)
    dst.to(dev)
    for name, array in dst.state_dict().items():
        np.testing.assert_array_equal(array, state[name])
    dst.load_state_dict({k: v * 2 for k, v in state.items()})  # into placed parameters
    np.testing.assert_array_equal(dst.state_dict()["head.bias"], state["head.bias"] * 2)


def test_load_state_dict_refuses_missing_extra_and_misshapen_arrays() -> None:
    block = Block()
    state = block.state_dict()
    with pytest.raises(KeyError, match="missing"):
        block.load_state_dict({k: v for k, v in state.items() if k != "scale"})
    with pytest.raises(KeyError, match="unexpected"):
        block.load_state_dict({**state, "other": np.zeros(1)})
    with pytest.raises(el.ShapeError):
        block.load_state_dict({**state, "scale": np.zeros(3)})
    block.load_state_dict({"scale": np.full(2, 5.0)}, strict=False)
    np.testing.assert_array_equal(block.scale.numpy(), [5.0, 5.0])


def test_train_and_eval_switch_every_submodule() -> None:
    block = Block()
    assert block.eval() is block
    assert not any(m.training for _, m in block.named_modules())
    block.train()
    assert all(m.training for _, m in block.named_modules())


def test_module_without_super_init_is_a_clear_error() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            self.layer = nn.Linear(1, 1)

    with pytest.raises(AttributeError, match="super"):
        Broken()


def test_relu_and_gelu_layers(dev: Device, rng) -> None:
    a = rng.standard_normal((3, 4))
    x = dev.tensor(a)
    np.testing.assert_allclose(nn.ReLU()(x).numpy(), np.maximum(a, 0))
    ref = 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a**3)))
    np.testing.assert_allclose(nn.GELU()(x).numpy(), ref, rtol=1e-12)


def test_dropout_masks_and_scales_in_training_and_is_identity_in_eval(dev: Device) -> None:
    drop = nn.Dropout(0.25, seed=5)
    x = dev.tensor(np.ones((100, 100), dtype="float32"))
    a, b = drop(x).numpy(), drop(x).numpy()
    assert set(np.unique(a)) <= {0.0, np.float32(1 / 0.75)}
    assert abs((a == 0).mean() - 0.25) < 0.02
    assert not np.array_equal(a, b)  # a new seed per call
    assert dev.stats()["graphs_built"] == 1  # ... which is a binding
    drop.eval()
    assert drop(x) is x
    assert F.dropout(x, 0.5, seed=1, training=False) is x
    np.testing.assert_array_equal(F.dropout(x, 1.0, seed=1).numpy(), np.zeros((100, 100)))


def test_embedding_takes_rows_and_accumulates_repeated_gradients(dev: Device) -> None:
    emb = nn.Embedding(5, 3, seed=0).to(dev)
    idx = dev.tensor(np.array([[1, 4], [1, 1]]))
    out = emb(idx)
    w = emb.weight.numpy()
    np.testing.assert_array_equal(out.numpy(), w[np.array([[1, 4], [1, 1]])])
    out.sum().backward()
    assert emb.weight.grad is not None  # set by the backward() above
    np.testing.assert_array_equal(emb.weight.grad.numpy()[:, 0], [0, 3, 0, 0, 1])


def test_layer_norm_normalizes_the_last_axes(dev: Device, rng) -> None:
    a = rng.standard_normal((4, 6)) * 3 + 1
    ln = nn.LayerNorm(6, eps=1e-5, dtype="float64").to(dev)
    mu, var = a.mean(-1, keepdims=True), a.var(-1, keepdims=True)
    np.testing.assert_allclose(ln(dev.tensor(a)).numpy(), (a - mu) / np.sqrt(var + 1e-5), rtol=1e-10)
    ln2 = nn.LayerNorm((2, 3), elementwise_affine=False, dtype="float64").to(dev)
    y = ln2(dev.tensor(a.reshape(4, 2, 3))).numpy()
    np.testing.assert_allclose(y.reshape(4, 6).mean(-1), 0, atol=1e-12)
    assert ln2.parameters() == []


def _blobs(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((4, 8)) * 3
    labels = rng.integers(0, 4, n)
    return (centers[labels] + rng.standard_normal((n, 8))).astype("float32"), labels


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_an_mlp_trains_to_a_low_loss(dev: Device, optimizer: str) -> None:
    x, y = _blobs(256)
    model = nn.Sequential(
        nn.Linear(8, 32, seed=0),
        nn.GELU(),
        nn.Dropout(0.1, seed=0),
        nn.LayerNorm(32),
        nn.Linear(32, 4, seed=1),
    ).to(dev)
    if optimizer == "sgd":
        opt: el.optim.Optimizer = el.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = el.optim.Adam(model.parameters(), lr=0.01)
    xt, yt = dev.tensor(x), dev.tensor(y)
    losses = []
    for _ in range(60):
        loss = F.cross_entropy(model(xt), yt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < 0.1 < losses[0]
    model.eval()
    accuracy = float((model(xt).argmax(axis=1) == yt).astype("float32").mean())
    assert accuracy > 0.97
    assert dev.stats()["graphs_built"] <= 3  # step 1 (new optimizer state), steps 2.., eval


def test_a_replaced_layer_keeps_its_place_in_a_sequential() -> None:
    model = nn.Sequential(nn.Linear(3, 4, seed=0), nn.ReLU(), nn.Linear(4, 2, seed=1))
    setattr(model, "0", nn.Linear(3, 4, seed=2))  # as nn.add_lora swaps a layer
    setattr(model, "2", nn.Linear(4, 2, seed=3))
    assert [name for name, _ in model.named_modules()] == ["", "0", "1", "2"]
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear"]
    assert [name for name, _ in model.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
