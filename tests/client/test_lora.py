"""nn.add_lora / nn.merge_lora on every device kind: what trains, what stays frozen, what merging keeps."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import emberlink as el
from emberlink import Device, nn
from emberlink.errors import DTypeError
from emberlink.nn.lora import quantize_int8

F = nn.functional


def mlp(dev: Device | None = None) -> nn.Sequential:
    model = nn.Sequential(nn.Linear(12, 24, seed=0), nn.ReLU(), nn.Linear(24, 3, seed=1))
    if dev is not None:
        model.to(dev)
    return model


def batch(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((16, 12)).astype(np.float32), rng.integers(0, 3, 16)


def train(model: nn.Module, dev: Device, steps: int, lr: float = 0.05) -> el.optim.Adam:
    opt = el.optim.Adam(model.parameters(), lr=lr)
    for k in range(steps):
        x, y = batch(k)
        loss = F.cross_entropy(model(dev.tensor(x)), dev.tensor(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_adapted_model_starts_equal_to_the_base_model(dev: Device) -> None:
    x, _ = batch()
    base = mlp(dev)(dev.tensor(x)).numpy()
    adapted = nn.add_lora(mlp(dev), rank=4)
    np.testing.assert_array_equal(adapted(dev.tensor(x)).numpy(), base)


def test_add_lora_wraps_the_targets_and_freezes_every_other_parameter(dev: Device) -> None:
    model = nn.add_lora(mlp(dev), rank=4, alpha=8.0, targets=["2"])
    assert isinstance(model[0], nn.Linear) and isinstance(model[2], nn.LoRALinear)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["2.lora_A", "2.lora_B"]
    layer = model[2]
    assert isinstance(layer, nn.LoRALinear)
    assert layer.lora_A.shape == (24, 4) and layer.lora_B.shape == (4, 3) and layer.scaling == 2.0
    np.testing.assert_array_equal(layer.lora_B.numpy(), np.zeros((4, 3), np.float32))
    bound = 1 / np.sqrt(24)
    a = layer.lora_A.numpy()
    assert np.abs(a).max() <= bound and np.abs(a).max() > bound / 2  # PEFT's Kaiming-uniform A


def test_targets_follow_peft_target_modules_matching(dev: Device) -> None:
    def wrapped(targets: str | list[str] | None) -> list[str]:
        model = nn.add_lora(
            nn.Sequential(mlp(), nn.Sequential(nn.Linear(3, 3, seed=2))).to(dev), targets=targets
        )
        return [name for name, m in model.named_modules() if isinstance(m, nn.LoRALinear)]

    assert wrapped(None) == ["0.0", "0.2", "1.0"]
    assert wrapped(["0"]) == ["0.0", "1.0"]  # a name matches itself or a dotted suffix
    assert wrapped(r"0\.\d") == ["0.0", "0.2"]  # a string is a regex the whole name must match
    with pytest.raises(ValueError, match="match no Linear layer"):
        wrapped(["q_proj"])


def test_base_weights_get_no_gradient_and_adapters_do(dev: Device) -> None:
    model = nn.add_lora(mlp(dev), rank=4)
    train(model, dev, 1)  # B leaves zero, so A's gradient is non-zero from the second step
    x, y = batch(1)
    F.cross_entropy(model(dev.tensor(x)), dev.tensor(y)).backward()
    for layer in (model[0], model[2]):
        assert isinstance(layer, nn.LoRALinear)
        assert layer.weight.grad is None and layer.bias is not None and layer.bias.grad is None
        for p in (layer.lora_A, layer.lora_B):
            assert p.grad is not None and np.abs(p.grad.numpy()).max() > 0


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_optimizer_updates_only_the_adapters_and_keeps_state_only_for_them(
    dev: Device, quantize: str | None
) -> None:
    model = nn.add_lora(mlp(dev), rank=4, quantize=quantize)
    frozen = {name: p.numpy() for name, p in model.named_parameters() if not p.requires_grad}
    adapters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    before = {name: p.numpy() for name, p in adapters.items()}
    opt = train(model, dev, 3)
    assert set(opt.state) == {id(p) for p in adapters.values()}
    for name, p in model.named_parameters():
        if name in frozen:
            np.testing.assert_array_equal(p.numpy(), frozen[name])
    assert not np.array_equal(adapters["0.lora_B"].numpy(), before["0.lora_B"])


def test_fine_tuning_lowers_the_loss_on_a_new_task(dev: Device) -> None:
    model = nn.add_lora(mlp(dev), rank=4)
    x, y = batch(7)
    first = float(F.cross_entropy(model(dev.tensor(x)), dev.tensor(y)))
    opt = el.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(30):
        loss = F.cross_entropy(model(dev.tensor(x)), dev.tensor(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert float(loss) < 0.5 * first


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_merge_lora_gives_plain_linears_with_the_adapted_outputs(dev: Device, quantize: str | None) -> None:
    model = nn.add_lora(mlp(dev), rank=4, quantize=quantize)
    train(model, dev, 3)
    x, _ = batch(9)
    want = model(dev.tensor(x)).numpy()
    merged = nn.merge_lora(model)
    assert merged is model
    assert [type(m).__name__ for m in merged.children()] == ["Linear", "ReLU", "Linear"]
    assert all(p.dtype == "float32" and p.requires_grad for p in merged.parameters())
    np.testing.assert_allclose(merged(dev.tensor(x)).numpy(), want, rtol=1e-5, atol=1e-5)


def test_lora_on_a_model_still_on_the_host_uploads_with_it(dev: Device) -> None:
    x, _ = batch()
    base = mlp(dev)(dev.tensor(x)).numpy()
    host = nn.add_lora(mlp(), rank=4, quantize="int8")  # quantized on the host, before any device
    layer = host[0]
    assert isinstance(layer, nn.LoRALinear) and layer.weight.dtype == "int8"
    host.to(dev)
    np.testing.assert_allclose(host(dev.tensor(x)).numpy(), base, rtol=0.05, atol=0.02)
    merged = nn.merge_lora(nn.add_lora(mlp(), rank=2))  # merging on the host too
    np.testing.assert_allclose(merged.to(dev)(dev.tensor(x)).numpy(), base, rtol=1e-6, atol=1e-6)


def test_int8_weights_are_within_half_a_step_and_a_quarter_of_the_bytes(dev: Device) -> None:
    w = np.random.default_rng(3).standard_normal((64, 32)).astype(np.float32)
    w[:, 5] = 0.0  # an all-zero output channel gets scale 1, not a division by zero
    q, scale = quantize_int8(dev.tensor(w))
    assert q.dtype == "int8" and q.shape == (64, 32) and scale.dtype == "float32" and scale.shape == (32,)
    assert not q.requires_grad and not scale.requires_grad
    qn, sn = q.numpy(), scale.numpy()
    np.testing.assert_allclose(sn, np.where(np.abs(w).max(0) == 0, 1, np.abs(w).max(0) / 127), rtol=1e-6)
    assert np.abs(qn).max() == 127
    assert np.all(np.abs(qn * sn - w) <= sn / 2 * (1 + 1e-5))
    assert qn.nbytes + sn.nbytes <= 0.3 * w.nbytes


def test_add_lora_refuses_bad_arguments(dev: Device) -> None:
    with pytest.raises(ValueError, match="rank"):
        nn.add_lora(mlp(dev), rank=0)
    with pytest.raises(DTypeError, match="nf4"):
        nn.add_lora(mlp(dev), quantize="nf4")
    twice = nn.add_lora(mlp(dev))
    with pytest.raises(ValueError, match="already has LoRA"):
        nn.add_lora(twice)


def test_a_bare_linear_is_refused_since_it_cannot_replace_itself(dev: Device) -> None:
    with pytest.raises(TypeError, match="holding Linear layers"):
        nn.add_lora(nn.Linear(5, 2, seed=0, device=dev), rank=2)


def test_frozen_parameter_may_be_int_but_a_trainable_one_may_not() -> None:
    frozen = nn.Parameter(np.zeros(3, np.int8), requires_grad=False)
    assert frozen.dtype == "int8" and not frozen.requires_grad
    with pytest.raises(DTypeError, match="requires grad must be float"):
        nn.Parameter(np.zeros(3, np.int8))


@pytest.mark.gpu
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_lora_on_cuda_trains_and_merges_as_on_the_cpu(quantize: str | None) -> None:
    pytest.importorskip("cupy")
    results = []
    for make in (Device.cpu, lambda: Device.cuda(0)):
        with make() as dev:
            model = nn.add_lora(mlp(dev), rank=4, quantize=quantize)
            opt = train(model, dev, 3)
            assert set(opt.state) == {id(p) for p in model.parameters() if p.requires_grad}
            x, _ = batch(9)
            adapted = model(dev.tensor(x)).numpy()
            merged = nn.merge_lora(model)(dev.tensor(x)).numpy()
            np.testing.assert_allclose(merged, adapted, rtol=1e-5, atol=1e-5)
            results.append(adapted)
    np.testing.assert_allclose(results[1], results[0], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_qlora_on_cuda_holds_base_weights_in_under_0_3_of_float32() -> None:
    pytest.importorskip("cupy")
    with Device.cuda(0) as dev:
        start = dev.memory_stats()["in_use_bytes"]
        model = nn.Sequential(nn.Linear(1024, 4096, seed=0), nn.ReLU(), nn.Linear(4096, 1024, seed=1))
        model.to(dev)
        dev.sync()
        f32 = dev.memory_stats()["in_use_bytes"] - start
        nn.add_lora(model, rank=8, quantize="int8")
        gc.collect()
        dev.sync()
        adapters = sum(p.size * 4 for p in model.parameters() if p.requires_grad)
        assert dev.memory_stats()["in_use_bytes"] - start - adapters <= 0.3 * f32
