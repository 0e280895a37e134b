"""emberlink.onnx.export: models and single ops written as ONNX, run in onnxruntime, compared with
emberlink's own results."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import emberlink as el
import emberlink.client.device
from emberlink import Device, ExportError, nn
from emberlink.graph_replay import ops
from emberlink.graph_replay.ir import TensorSpec
from emberlink.nn import functional as F
from emberlink.onnx import lowering
from emberlink.onnx.batch import static
from emberlink.onnx.model import build_model
from emberlink.onnx.trace import Program, Step, Traced, trace

REL_ERR = 1e-5


def run_onnx(path: Path, *inputs: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: x for i, x in zip(session.get_inputs(), inputs, strict=True)}
    return [np.asarray(y) for y in session.run(None, feeds)]


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|: the error relative to the output's scale."""
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    return float(np.max(np.abs(got - want))) / (scale or 1.0) if want.size else 0.0


def assert_matches(got: np.ndarray, want: np.ndarray) -> None:
    """Same dtype and shape; floats within REL_ERR of the output's scale (NaN where NaN), the rest equal."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if want.dtype.kind == "f":
        assert np.array_equal(np.isnan(got), np.isnan(want)), (got, want)
        finite = np.isfinite(want)
        assert np.array_equal(got[~finite], want[~finite], equal_nan=True), (got, want)
        assert rel_err(got[finite].astype(np.float64), want[finite].astype(np.float64)) <= REL_ERR, (
            got,
            want,
        )
    else:
        assert np.array_equal(got, want), (got, want)


@pytest.fixture
def cpu() -> Any:
    with Device.cpu() as device:
        yield device


def export_and_check(
    tmp_path: Path, model: Callable[..., Any], inputs: Sequence[np.ndarray], **options: Any
) -> onnx.ModelProto:
    """Export `model` on `inputs`, check the file, and return it loaded."""
    path = tmp_path / "model.onnx"
    el.onnx.export(model, tuple(inputs), path, **options)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    return proto


# -- models ----------------------------------------------------------------------------------------


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(12, 32, seed=1),
        nn.GELU(),
        nn.LayerNorm(32),
        nn.Dropout(0.3, seed=2),
        nn.ReLU(),
        nn.Linear(32, 5, seed=3),
    )


class SlicedCNN(nn.Module):
    """A 3x3 convolution as im2col by slices and one matmul, 2x2 max pooling, global mean pooling
    and a Linear head: the ops conv2d and pooling are made of."""

    def __init__(self, channels: int = 3, features: int = 6, classes: int = 4) -> None:
        super().__init__()
        rng = np.random.default_rng(7)
        self.weight = nn.Parameter((rng.standard_normal((channels * 9, features)) * 0.3).astype(np.float32))
        self.bias = nn.Parameter((rng.standard_normal(features) * 0.1).astype(np.float32))
        self.head = nn.Linear(features, classes, seed=8)
        self.features = features

    def forward(self, x: el.Tensor) -> el.Tensor:
        n, c, h, w = x.shape
        oh, ow = h - 2, w - 2
        taps = [x[:, :, i : i + oh, j : j + ow] for i in range(3) for j in range(3)]
        cols = el.stack(taps, axis=2).reshape(n, c * 9, oh * ow).permute(0, 2, 1)
        y = (cols @ self.weight + self.bias).relu()
        y = y.permute(0, 2, 1).reshape(n, self.features, oh // 2, 2, ow // 2, 2).max(axis=(3, 5))
        logits: el.Tensor = self.head(y.mean(axis=(2, 3)))
        return logits


class Block(nn.Module):
    """A pre-norm transformer block: causal multi-head self-attention and a GELU MLP, residuals."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, seed=11)
        self.proj = nn.Linear(dim, dim, seed=12)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim, seed=13), nn.GELU(), nn.Linear(4 * dim, dim, seed=14))
        self.drop = nn.Dropout(0.1, seed=15)

    def forward(self, x: el.Tensor) -> el.Tensor:
        b, t, d = x.shape
        dh = d // self.heads
        qkv = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, dh).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = (q @ k.mT) * (1.0 / math.sqrt(dh))
        causal = x.device.arange(t).reshape(t, 1) >= x.device.arange(t)
        weights = F.softmax(el.where(causal, scores, float("-inf")), axis=-1)
        y = (weights @ v).permute(0, 2, 1, 3).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        out: el.Tensor = x + self.drop(self.ff(self.ln2(x)))
        return out


class TinyLM(nn.Module):
    """Token ids (int64) -> embedding -> block -> logits."""

    def __init__(self, vocab: int = 11, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, seed=21)
        self.block = Block(dim)
        self.out = nn.Linear(dim, vocab, seed=22)

    def forward(self, ids: el.Tensor) -> el.Tensor:
        logits: el.Tensor = self.out(self.block(self.embed(ids)))
        return logits


def check_model_export(
    tmp_path: Path, dev: Device, model: nn.Module, example: np.ndarray, other: np.ndarray
) -> None:
    """Export `model` (on `dev`, eval mode) at `example`; onnxruntime matches emberlink at the
    example's batch and at `other`'s (another batch size)."""
    model.to(dev).eval()
    proto = export_and_check(tmp_path, model, [example])
    names = {init.name for init in proto.graph.initializer}
    assert {name for name, _ in model.named_parameters()} <= names
    for x in (example, other):
        (got,) = run_onnx(tmp_path / "model.onnx", x)
        assert_matches(got, model(dev.tensor(x)).numpy())


def test_mlp_exports_and_onnxruntime_matches_it(tmp_path, dev, rng):
    example = rng.standard_normal((6, 12)).astype(np.float32)
    other = rng.standard_normal((17, 12)).astype(np.float32)
    check_model_export(tmp_path, dev, mlp(), example, other)


def test_cnn_made_of_slices_matmul_and_pooling_exports(tmp_path, dev, rng):
    example = rng.standard_normal((2, 3, 10, 10)).astype(np.float32)
    other = rng.standard_normal((5, 3, 10, 10)).astype(np.float32)
    check_model_export(tmp_path, dev, SlicedCNN(), example, other)


def cnn() -> nn.Module:
    """The layers a CNN is made of: convolutions (padding, stride, groups), batch norm in eval,
    max and average pooling (padding, ceil_mode), Flatten and a Linear head."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, seed=31),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2, ceil_mode=True),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2, seed=32),
        nn.ReLU(),
        nn.AvgPool2d(2, padding=1, count_include_pad=False),
        nn.Flatten(),
        nn.Linear(8 * 2 * 2, 4, seed=33),
    )


def test_cnn_of_conv_batchnorm_and_pooling_layers_exports(tmp_path, dev, rng):
    model = cnn().to(dev).train()
    for _ in range(3):  # forward passes in training, so the running statistics are not the defaults
        model(dev.tensor(rng.standard_normal((4, 3, 9, 9)).astype(np.float32)))
    example = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
    other = rng.standard_normal((5, 3, 9, 9)).astype(np.float32)
    check_model_export(tmp_path, dev, model, example, other)


def test_transformer_block_exports_with_causal_attention(tmp_path, dev, rng):
    example = rng.standard_normal((3, 7, 16)).astype(np.float32)
    other = rng.standard_normal((1, 7, 16)).astype(np.float32)
    check_model_export(tmp_path, dev, Block(), example, other)


def test_language_model_on_token_ids_exports(tmp_path, dev, rng):
    example = rng.integers(0, 11, (2, 5)).astype(np.int64)
    other = rng.integers(0, 11, (4, 5)).astype(np.int64)
    check_model_export(tmp_path, dev, TinyLM(), example, other)


class CausalEncoder(nn.Module):
    """Two nn.TransformerEncoderLayers (post-norm ReLU, pre-norm GELU), causal, batch first."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.post = nn.TransformerEncoderLayer(dim, 4, dim_feedforward=32, batch_first=True, seed=31)
        self.pre = nn.TransformerEncoderLayer(
            dim, 2, dim_feedforward=24, activation="gelu", batch_first=True, norm_first=True, seed=32
        )

    def forward(self, x: el.Tensor) -> el.Tensor:
        y: el.Tensor = self.pre(self.post(x, is_causal=True), is_causal=True)
        return y


class PaddedAttention(nn.Module):
    """nn.MultiheadAttention over a padded batch: the output and the head-averaged weights."""

    def __init__(self, dim: int = 12) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, 3, batch_first=True, seed=41)

    def forward(self, x: el.Tensor, padding: el.Tensor) -> tuple[el.Tensor, el.Tensor]:
        out, weights = self.attention(x, x, x, key_padding_mask=padding)
        return out, weights


def test_transformer_encoder_layers_export(tmp_path, dev, rng):
    example = rng.standard_normal((2, 6, 16)).astype(np.float32)
    other = rng.standard_normal((7, 6, 16)).astype(np.float32)
    check_model_export(tmp_path, dev, CausalEncoder(), example, other)


def test_multihead_attention_with_a_padding_mask_exports_both_outputs(tmp_path, cpu, rng):
    model = PaddedAttention().to(cpu).eval()

    def batch(n: int) -> tuple[np.ndarray, np.ndarray]:
        padding = np.zeros((n, 5), bool)
        padding[:, 3:] = rng.random((n, 2)) < 0.5  # some keys of some rows are padding
        return rng.standard_normal((n, 5, 12)).astype(np.float32), padding

    export_and_check(tmp_path, model, batch(3), output_names=["out", "weights"])
    for x, padding in (batch(3), batch(8)):
        got = run_onnx(tmp_path / "model.onnx", x, padding)
        want = model(cpu.tensor(x), cpu.tensor(padding))
        for g, w in zip(got, want, strict=True):
            assert_matches(g, w.numpy())


def test_export_leaves_the_models_parameters_on_their_device(tmp_path, dev, rng):
    model = mlp().to(dev).eval()
    x = dev.tensor(rng.standard_normal((3, 12)).astype(np.float32))
    before = model(x).numpy()
    el.onnx.export(model, x, tmp_path / "model.onnx")
    assert all(p.device is dev for p in model.parameters())
    np.testing.assert_array_equal(model(x).numpy(), before)


def test_parameters_of_a_model_never_placed_on_a_device_export(tmp_path, rng):
    model = mlp().eval()  # parameters still host arrays
    x = rng.standard_normal((4, 12)).astype(np.float32)
    export_and_check(tmp_path, model, [x])
    with Device.cpu() as dev:
        want = model.to(dev)(dev.tensor(x)).numpy()
    assert_matches(run_onnx(tmp_path / "model.onnx", x)[0], want)


class Shifted(nn.Module):
    """A Linear plus a fixed table that is no parameter: a registered buffer if `listed`, else a plain
    attribute the module does not list."""

    table: el.Tensor

    def __init__(self, table: el.Tensor, listed: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3, seed=51)
        if listed:
            self.register_buffer("table", table)
        else:
            object.__setattr__(self, "table", table)  # hidden from Module's bookkeeping

    def forward(self, x: el.Tensor) -> el.Tensor:
        y: el.Tensor = self.linear(x) + self.table
        return y


def test_buffers_export_as_initializers_by_name(tmp_path, dev, rng):
    model = Shifted(dev.tensor(rng.standard_normal(3).astype(np.float32)), listed=True).to(dev)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    proto = export_and_check(tmp_path, model, [x])
    assert {"table", "linear.weight", "linear.bias"} <= {i.name for i in proto.graph.initializer}
    assert_matches(run_onnx(tmp_path / "model.onnx", x)[0], model(dev.tensor(x)).numpy())


def test_a_tensor_the_model_does_not_list_is_refused(tmp_path, cpu, rng):
    model = Shifted(cpu.tensor(rng.standard_normal(3).astype(np.float32)), listed=False).to(cpu)
    with pytest.raises(ExportError, match=r"not the example input, a parameter .* or a buffer"):
        el.onnx.export(model, rng.standard_normal((5, 4)).astype(np.float32), tmp_path / "m.onnx")


def test_a_forward_pass_longer_than_one_segment_exports(tmp_path, cpu, rng, monkeypatch):
    monkeypatch.setattr(emberlink.client.device, "MAX_PENDING", 5)  # flushes mid-forward
    model = Block().to(cpu).eval()
    x = rng.standard_normal((2, 4, 16)).astype(np.float32)
    export_and_check(tmp_path, model, [x])
    assert_matches(run_onnx(tmp_path / "model.onnx", x)[0], model(cpu.tensor(x)).numpy())


def test_several_inputs_and_outputs_keep_their_names(tmp_path, cpu, rng):
    def two_way(a: el.Tensor, b: el.Tensor) -> tuple[el.Tensor, el.Tensor]:
        return a @ b.mT, (a - b).abs().sum(axis=1)

    a, b = (rng.standard_normal((3, 4)).astype(np.float32) for _ in range(2))
    proto = export_and_check(
        tmp_path, two_way, [a, b], input_names=["left", "right"], output_names=["prod", "dist"]
    )
    assert [i.name for i in proto.graph.input] == ["left", "right"]
    assert [o.name for o in proto.graph.output] == ["prod", "dist"]
    got = run_onnx(tmp_path / "model.onnx", a, b)
    want = two_way(cpu.tensor(a), cpu.tensor(b))
    for g, w in zip(got, want, strict=True):
        assert_matches(g, w.numpy())


def test_the_batch_axis_is_symbolic_only_with_dynamic_batch(tmp_path, rng):
    x = rng.standard_normal((4, 12)).astype(np.float32)
    model = mlp().eval()
    dynamic = export_and_check(tmp_path, model, [x])
    assert dynamic.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    fixed = export_and_check(tmp_path, model, [x], dynamic_batch=False)
    assert fixed.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 4


def test_large_parameters_go_to_an_external_data_file(tmp_path, cpu, rng, monkeypatch):
    monkeypatch.setattr(el.onnx, "_EXTERNAL_DATA_BYTES", 1000)
    model = mlp().to(cpu).eval()
    x = rng.standard_normal((2, 12)).astype(np.float32)
    el.onnx.export(model, x, tmp_path / "model.onnx")
    assert (tmp_path / "model.onnx.data").stat().st_size > 1000
    assert_matches(run_onnx(tmp_path / "model.onnx", x)[0], model(cpu.tensor(x)).numpy())


# -- refusals --------------------------------------------------------------------------------------


def test_dropout_in_training_mode_is_refused_naming_eval(tmp_path, rng):
    model = mlp()  # training mode: Dropout draws random numbers
    with pytest.raises(ExportError, match=r"rand: .*model\.eval\(\)"):
        el.onnx.export(model, rng.standard_normal((2, 12)).astype(np.float32), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_an_op_without_a_lowering_is_refused_by_name(tmp_path, rng, monkeypatch):
    monkeypatch.delitem(lowering.LOWERINGS, "matmul")
    with pytest.raises(ExportError, match="matmul: no ONNX form"):
        el.onnx.export(mlp().eval(), rng.standard_normal((2, 12)).astype(np.float32), tmp_path / "m.onnx")


def test_reading_a_value_inside_the_forward_pass_is_refused(tmp_path, rng):
    def data_dependent(x: el.Tensor) -> el.Tensor:
        return x * 2.0 if float(x.sum()) > 0 else x

    with pytest.raises(ExportError, match="reads a tensor's value"):
        el.onnx.export(data_dependent, rng.standard_normal((2, 3)).astype(np.float32), tmp_path / "m.onnx")


def test_a_graph_that_changes_with_the_batch_size_needs_a_fixed_batch(tmp_path, cpu, rng):
    def first_half(x: el.Tensor) -> el.Tensor:
        return x[: x.shape[0] // 2 + 1] * 2.0

    x = rng.standard_normal((4, 3)).astype(np.float32)
    with pytest.raises(ExportError, match="dynamic_batch=False"):
        el.onnx.export(first_half, x, tmp_path / "m.onnx")
    export_and_check(tmp_path, first_half, [x], dynamic_batch=False)
    assert_matches(run_onnx(tmp_path / "model.onnx", x)[0], first_half(cpu.tensor(x)).numpy())


def test_a_size_that_grows_faster_than_the_batch_needs_a_fixed_batch(tmp_path, cpu, rng):
    def pairs(x: el.Tensor) -> el.Tensor:
        return (x @ x.mT).reshape(-1)  # batch * batch values

    x = rng.standard_normal((3, 4)).astype(np.float32)
    with pytest.raises(ExportError, match="9, 36, 81 at batches 3, 6, 9: not scale"):
        el.onnx.export(pairs, x, tmp_path / "m.onnx")
    export_and_check(tmp_path, pairs, [x], dynamic_batch=False)
    assert_matches(run_onnx(tmp_path / "model.onnx", x)[0], pairs(cpu.tensor(x)).numpy())


def test_a_model_that_fails_at_another_batch_size_needs_a_fixed_batch(tmp_path, rng):
    def fixed_size(x: el.Tensor) -> el.Tensor:
        return x.reshape(3, 4).sum(axis=1)

    with pytest.raises(ExportError, match="fails at 2 times the example's batch size.*dynamic_batch=False"):
        el.onnx.export(fixed_size, rng.standard_normal((6, 2)).astype(np.float32), tmp_path / "m.onnx")


def test_a_model_is_restored_when_its_export_fails(tmp_path, cpu, rng):
    model = mlp().to(cpu)  # training mode: refused
    weights = {name: p._v for name, p in model.named_parameters()}
    with pytest.raises(ExportError):
        el.onnx.export(model, rng.standard_normal((2, 12)).astype(np.float32), tmp_path / "m.onnx")
    assert {name: p._v for name, p in model.named_parameters()} == weights


def test_export_is_refused_below_opset_18(tmp_path, rng):
    with pytest.raises(ExportError, match="opset_version must be at least 18"):
        el.onnx.export(
            mlp().eval(), rng.standard_normal((2, 12)).astype(np.float32), tmp_path / "m", opset_version=17
        )


def test_importing_emberlink_does_not_import_onnx():
    code = "import sys, emberlink; assert 'onnx' not in sys.modules; emberlink.onnx.export"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- every op --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One op on small inputs: `fn` records `op` (and maybe a few others) on tensors of `inputs`."""

    op: str
    fn: Callable[..., el.Tensor]
    inputs: tuple[np.ndarray, ...]
    id: str
    dynamic: bool


_R = np.random.default_rng(99)
F32 = _R.standard_normal((3, 4)).astype(np.float32)
POS = (np.abs(_R.standard_normal((3, 4))) + 0.1).astype(np.float32)
SPECIAL = np.array(
    [[np.nan, np.inf, -np.inf, 1.5], [0.0, -2.5, 2.5, -0.5], [3.5, -1e30, 1e-30, 7.0]], np.float32
)
I8 = np.array([[-128, -3, 0, 127], [5, -7, 100, -100], [1, 2, 3, 4]], np.int8)
U8 = np.array([[0, 3, 200, 255], [17, 128, 1, 2], [9, 8, 7, 6]], np.uint8)
I32 = _R.integers(-9, 10, (3, 4)).astype(np.int32)
I64 = _R.integers(-9, 10, (3, 4)).astype(np.int64)
BOOL = _R.random((3, 4)) < 0.5
F16 = _R.standard_normal((3, 4)).astype(np.float16)
LABELS = np.array([2, 0, 3], np.int64)


def _c(
    op: str, fn: Callable[..., el.Tensor], *inputs: np.ndarray, id: str = "", dynamic: bool = True
) -> Case:
    """A case; `dynamic=False` where axis 0 of the inputs is no batch (it is tried where they agree)."""
    return Case(op, fn, inputs, id or op, dynamic)


def _unary_cases() -> list[Case]:
    cases = []
    for op in ("negative", "abs", "square", "sign", "relu", "floor", "ceil", "round", "trunc", "exp", "expm1",
               "tanh", "sigmoid", "sin", "cos", "sinh", "cosh", "arctan"):  # fmt: skip
        cases.append(_c(op, getattr(el, op), F32 * 2.7))
    for op in ("log", "log1p", "sqrt"):
        cases.append(_c(op, getattr(el, op), POS))
    cases += [
        _c("negative", el.negative, I8, id="negative-int8"),
        _c("negative", el.negative, U8, id="negative-uint8"),
        _c("abs", el.abs, I8, id="abs-int8"),
        _c("square", el.square, U8, id="square-uint8"),
        _c("sign", el.sign, I32, id="sign-int32"),
        _c("relu", el.relu, I64, id="relu-int64"),
        _c("floor", el.floor, I32, id="floor-int32"),
        _c("trunc", el.trunc, SPECIAL, id="trunc-special"),
        _c("round", el.round, np.array([[0.5, 1.5, 2.5, -0.5]], np.float32), id="round-half-even"),
        _c("relu", el.relu, SPECIAL, id="relu-nan"),
        _c("exp", el.exp, I32, id="exp-int32"),
        _c("exp", el.exp, F16, id="exp-float16"),
        _c("sqrt", el.sqrt, F32.astype(np.float64) ** 2, id="sqrt-float64"),
        _c(
            "expm1", el.expm1, np.array([[1e-8, -3e-6, 1e-3, -0.7, 12.0, -40.0]], np.float32), id="expm1-tiny"
        ),
        _c("log1p", el.log1p, np.array([[1e-8, -3e-6, 1e-3, -0.7, 1e6, -1.0]], np.float32), id="log1p-tiny"),
        _c("isnan", el.isnan, SPECIAL),
        _c("isinf", el.isinf, SPECIAL),
        _c("isfinite", el.isfinite, SPECIAL),
        _c("isfinite", el.isfinite, I32, id="isfinite-int32"),
        _c("isnan", el.isnan, F16, id="isnan-float16"),
        _c("logical_not", el.logical_not, BOOL),
    ]
    return cases


def _binary_cases() -> list[Case]:
    cases = []
    for op in ("add", "subtract", "multiply", "divide", "maximum", "minimum", "equal", "not_equal", "less",
               "less_equal", "greater", "greater_equal"):  # fmt: skip
        cases.append(_c(op, getattr(el, op), F32, np.round(F32 * 2) / 2))
    cases += [
        _c("add", lambda x: x + 2, F32, id="add-int-scalar"),
        _c("add", lambda x, y: x + y, F32, F32[0], id="add-broadcast"),
        _c("add", lambda x, y: x + y, U8, I8, id="add-uint8-int8-promotes"),
        _c("subtract", lambda x: 3 - x, U8, id="subtract-uint8-wraps"),
        _c("multiply", lambda x, y: x * y, I8, I8, id="multiply-int8-wraps"),
        _c("multiply", lambda x: x * 0.5, I64, id="multiply-int-by-float-scalar"),
        _c("divide", lambda x, y: x / y, I32, I32 + 20, id="divide-ints"),
        _c("pow", lambda x: x**1.5, POS, id="pow-float"),
        _c("pow", lambda x, y: x**y, I64, np.abs(I64) % 4, id="pow-int"),
        _c("maximum", el.maximum, SPECIAL, F32, id="maximum-nan"),
        _c("minimum", el.minimum, F32, SPECIAL, id="minimum-nan"),
        _c("maximum", el.maximum, BOOL, ~BOOL, id="maximum-bool"),
        _c("less", el.less, BOOL, ~BOOL, id="less-bool"),
        _c("equal", lambda x: x == 3, I8, id="equal-int8-scalar"),
        _c("greater", lambda x: x > 0.25, F16, id="greater-float16"),
        _c("logical_and", el.logical_and, BOOL, ~BOOL[::-1].copy()),
        _c("logical_or", el.logical_or, BOOL, BOOL[::-1].copy()),
        _c("add", lambda x, y: x + y, F16, F16, id="add-float16"),
    ]
    return cases


def _structural_cases() -> list[Case]:
    return [
        _c("zeros", lambda x: x + x.device.zeros(x.shape), F32),
        _c("ones", lambda x: x * x.device.ones((4,), dtype="int32"), I64),
        _c("full", lambda x: x.device.full(x.shape, 2.5) - x, F32),
        _c("full", lambda x: x.device.full((2,), True) & x[0, :2], BOOL, id="full-bool"),
        _c("arange", lambda x: x + x.device.arange(4), F32),
        _c("arange", lambda x: x * x.device.arange(0.5, 2.5, 0.5), F32, id="arange-float"),
        _c("arange", lambda x: x + x.device.arange(x.shape[0]).reshape(-1, 1), F32, id="arange-batch"),
        _c("eye", lambda x: x @ x.device.eye(4, 5, k=1), F32),
        _c("where", lambda x: el.where(x > 0, x, 0.0), F32),
        _c("where", lambda c, x, y: el.where(c, x, y), BOOL, I8, U8, id="where-small-ints"),
        _c("where", lambda c, x: el.where(c, x, False), BOOL, ~BOOL, id="where-bool"),
        _c("astype", lambda x: x.astype("int32"), F32 * 10),
        _c("astype", lambda x: x.astype("bool"), SPECIAL, id="astype-bool"),
        _c("astype", lambda x: x.astype("float16"), I64, id="astype-float16"),
        _c("sum", lambda x: x.sum(), F32),
        _c("sum", lambda x: x.sum(axis=1, keepdims=True), F32, id="sum-keepdims"),
        _c("sum", lambda x: x.sum(axis=0), BOOL, id="sum-bool"),
        _c("sum", lambda x: x.sum(axis=1), I8, id="sum-int8"),
        _c("sum", lambda x: x.sum(axis=0), F16, id="sum-float16"),
        _c("mean", lambda x: x.mean(axis=0), F32),
        _c("mean", lambda x: x.mean(), I32, id="mean-int32"),
        _c("max", lambda x: x.max(axis=1), F32),
        _c("max", lambda x: x.max(axis=(0, 1), keepdims=True), I8, id="max-int8"),
        _c("max", lambda x: x.max(axis=1), SPECIAL, id="max-nan"),
        _c("max", lambda x: x.any(axis=1), BOOL, id="any-bool"),
        _c("min", lambda x: x.min(axis=0), F32),
        _c("min", lambda x: x.all(axis=0), BOOL, id="all-bool"),
        _c("prod", lambda x: x.prod(axis=1), F32),
        _c("prod", lambda x: x.prod(axis=0), I64, id="prod-int64"),
        _c("argmax", lambda x: x.argmax(axis=1), F32),
        _c("argmax", lambda x: x.argmax(keepdims=True), I8, id="argmax-all-keepdims"),
        _c("argmin", lambda x: x.argmin(axis=0), U8),
        _c("matmul", lambda x, y: x @ y, F32, F32.T.copy()),
        _c("matmul", lambda x, y: x @ y, np.stack([F32, F32 * 2]), F32.T.copy(), id="matmul-batched"),
        _c("matmul", lambda x, y: x @ y, F32[0], F32.T.copy(), id="matmul-vector", dynamic=False),
        _c("matmul", lambda x, y: x @ y, I64, I64.T.copy(), id="matmul-int64"),
        _c("matmul", lambda x, y: x @ y, I8, I8.T.copy(), id="matmul-int8"),
        _c("matmul", lambda x, y: x @ y, F16, F16.T.copy(), id="matmul-float16"),
        _c("reshape", lambda x: x.reshape(-1, 2, 2), F32),
        _c("reshape", lambda x: x.reshape(2, 6), F32, id="reshape-fixed", dynamic=False),
        _c("reshape", lambda x: x.reshape(-1), F32, id="reshape-flat"),
        _c("reshape", lambda x: x[:0].reshape(0, 2, 2), F32, id="reshape-empty"),
        _c("permute_dims", lambda x: x.reshape(-1, 2, 2).permute(2, 0, 1), F32),
        _c("broadcast_to", lambda x: x[:, None, :].broadcast_to(x.shape[0], 2, 4), F32),
        _c("expand_dims", lambda x: x.expand_dims(-1), F32),
        _c("squeeze", lambda x: x[:, :1].squeeze(1), F32),
        _c("concat", lambda x, y: el.concat([x, y], axis=-1), F32, I8),
        _c("stack", lambda x, y: el.stack([x, y], axis=1), F32, F32 * 2),
        _c("getitem", lambda x: x[1], F32),
        _c("getitem", lambda x: x[:, 1:3], F32, id="getitem-slice"),
        _c("getitem", lambda x: x[:, 1::2], F32, id="getitem-step"),
        _c("getitem", lambda x: x[::2, ::3], F32, id="getitem-step-on-batch", dynamic=False),
        _c("getitem", lambda x: x[None, 1:, ..., None], F32, id="getitem-new-axes"),
        _c("getitem", lambda x: x[-1, 2], F32, id="getitem-last"),
        _c("getitem", lambda x: x[::-1, 1], F32, id="getitem-reversed"),
        _c("take", lambda x, i: x.take(i, axis=0), F32, np.array([2, 0, -1, 1], np.int64)),
        _c("take", lambda x, i: x.take(i, axis=1), F32, np.array([[3, 0], [1, 1]], np.int8), id="take-int8"),
        _c("take", lambda x, i: x.take(i, axis=None), F32, np.array([11, 0, 5], np.int32), id="take-flat"),
        _c("softmax", lambda x: F.softmax(x, axis=-1), F32 * 3),
        _c("softmax", lambda x: F.softmax(x, axis=0), I32, id="softmax-int32"),
        _c("log_softmax", lambda x: F.log_softmax(x, axis=0), F32 * 3),
        _c("cross_entropy", lambda x, y: F.cross_entropy(x, y), F32, LABELS),
        _c("cross_entropy", lambda x, y: F.cross_entropy(x, y, reduction="sum"), F32, LABELS, id="ce-sum"),
        _c(
            "cross_entropy",
            lambda x, y: F.cross_entropy(x, y, reduction="none"),
            F32,
            np.array([1, -1, 4]),
            id="ce-invalid-labels",
        ),
        _c("one_hot", lambda y: F.one_hot(y, 4), np.array([[0, 3], [-1, 4]], np.int64)),
        _c("one_hot", lambda y: F.one_hot(y, 3, dtype="bool"), LABELS % 3, id="one_hot-bool"),
    ]


CASES = _unary_cases() + _binary_cases() + _structural_cases()


def _batched(inputs: Sequence[np.ndarray]) -> bool:
    """Whether every input has one size along axis 0, so the batch may be dynamic."""
    return len({x.shape[0] if x.ndim else None for x in inputs} - {0}) == 1 and all(x.ndim for x in inputs)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_each_op_matches_emberlink_in_onnxruntime(tmp_path, cpu, case):
    dynamic = case.dynamic and _batched(case.inputs)
    export_and_check(tmp_path, case.fn, case.inputs, dynamic_batch=dynamic)
    want = case.fn(*(cpu.tensor(x) for x in case.inputs)).numpy()
    assert_matches(run_onnx(tmp_path / "model.onnx", *case.inputs)[0], want)
    if dynamic:  # another batch size than the two recorded
        more = [np.concatenate([x, x, x[:1]]) for x in case.inputs]
        want = case.fn(*(cpu.tensor(x) for x in more)).numpy()
        assert_matches(run_onnx(tmp_path / "model.onnx", *more)[0], want)


def test_expm1_and_log1p_are_exact_to_rounding_near_zero(tmp_path, cpu):
    x = np.array([1e-30, -1e-20, 1e-8, -3e-6, 9.9e-6, 1.1e-5, 1e-3], np.float32)
    for fn, ref in ((el.expm1, np.expm1), (el.log1p, np.log1p)):
        export_and_check(tmp_path, fn, [x])
        np.testing.assert_allclose(run_onnx(tmp_path / "model.onnx", x)[0], ref(x), rtol=3e-7, atol=0)


HANDWRITTEN = {"unfold", "fold"}
"""Ops tested by the handwritten-graph tests below rather than by CASES."""


def test_every_op_is_exported_or_refused_and_every_exported_op_has_a_case():
    assert set(ops.OPS) <= set(lowering.LOWERINGS) | set(lowering.REFUSED)
    assert not set(lowering.LOWERINGS) & set(lowering.REFUSED)
    tested = {c.op for c in CASES} | HANDWRITTEN
    assert set(lowering.LOWERINGS) <= tested


def test_cases_record_the_op_they_name():
    """Each case's forward pass records its op (so the coverage test above means what it says)."""
    for case in CASES:
        recorded = trace(case.fn, [], case.inputs).program.steps
        assert case.op in {step.op for step in recorded}, case.id


# -- unfold and fold on handwritten graphs (the ops conv2d and pooling are built from) -------------


def im2col(
    x: np.ndarray, k: tuple[int, int], d: tuple[int, int], p: tuple[int, int], s: tuple[int, int]
) -> np.ndarray:
    """PyTorch's nn.functional.unfold, by loops: (N, C, H, W) -> (N, C*kh*kw, L)."""
    n, c, h, w = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1])))
    oh = (h + 2 * p[0] - d[0] * (k[0] - 1) - 1) // s[0] + 1
    ow = (w + 2 * p[1] - d[1] * (k[1] - 1) - 1) // s[1] + 1
    out = np.zeros((n, c, k[0], k[1], oh, ow), x.dtype)
    for i in range(k[0]):
        for j in range(k[1]):
            rows = slice(i * d[0], i * d[0] + s[0] * (oh - 1) + 1, s[0])
            cols = slice(j * d[1], j * d[1] + s[1] * (ow - 1) + 1, s[1])
            out[:, :, i, j] = xp[:, :, rows, cols]
    return out.reshape(n, c * k[0] * k[1], oh * ow)


def col2im(cols: np.ndarray, size: tuple[int, int], k: tuple[int, int], d: tuple[int, int],
           p: tuple[int, int], s: tuple[int, int]) -> np.ndarray:  # fmt: skip
    """PyTorch's nn.functional.fold, by loops: the adjoint of im2col (overlaps add up)."""
    n = cols.shape[0]
    c = cols.shape[1] // (k[0] * k[1])
    h, w = size
    oh = (h + 2 * p[0] - d[0] * (k[0] - 1) - 1) // s[0] + 1
    ow = (w + 2 * p[1] - d[1] * (k[1] - 1) - 1) // s[1] + 1
    blocks = cols.reshape(n, c, k[0], k[1], oh, ow)
    out = np.zeros((n, c, h + 2 * p[0], w + 2 * p[1]), cols.dtype)
    for i in range(k[0]):
        for j in range(k[1]):
            for r in range(oh):
                for q in range(ow):
                    out[:, :, i * d[0] + r * s[0], j * d[1] + q * s[1]] += blocks[:, :, i, j, r, q]
    return out[:, :, p[0] : p[0] + h, p[1] : p[1] + w]


WINDOWS = [
    ((3, 3), (1, 1), (1, 1), (1, 1)),
    ((2, 2), (1, 1), (0, 0), (2, 2)),  # max/avg pooling's windows
    ((3, 2), (2, 1), (2, 0), (1, 2)),
]


def one_op_model(tmp_path: Path, op: str, x: np.ndarray, out: tuple[int, ...], attrs: dict[str, Any]) -> Path:
    """A model of the single step `op(x)` written as the recorder would write it."""
    program = Program(
        specs={0: TensorSpec(x.dtype.name, x.shape), 1: TensorSpec(x.dtype.name, out)},
        steps=[Step(1, op, (0,), tuple(sorted(attrs.items())))],
        inputs=(0,),
        outputs=(1,),
    )
    proto = build_model(
        Traced(program, {}), static(program), input_names=["input"], output_names=["output"], opset=18,
        dynamic_batch=False,
    )  # fmt: skip
    onnx.checker.check_model(proto, full_check=True)
    path = tmp_path / f"{op}.onnx"
    onnx.save_model(proto, str(path))
    return path


@pytest.mark.parametrize("k, d, p, s", WINDOWS)
@pytest.mark.parametrize("dtype", ["float32", "int64", "float16"])
def test_unfold_matches_pytorchs_im2col(tmp_path, k, d, p, s, dtype):
    x = (np.random.default_rng(3).standard_normal((2, 3, 7, 6)) * 10).astype(dtype)
    want = im2col(x, k, d, p, s)
    attrs = {"kernel_size": k, "dilation": d, "padding": p, "stride": s}
    path = one_op_model(tmp_path, "unfold", x, want.shape, attrs)
    (got,) = run_onnx(path, x)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_unfold_keeps_infinities_and_nans_in_place(tmp_path):
    x = np.arange(2 * 1 * 4 * 4, dtype=np.float32).reshape(2, 1, 4, 4)
    x[0, 0, 1, 2], x[1, 0, 3, 3] = np.inf, np.nan
    attrs = {"kernel_size": (2, 2), "dilation": (1, 1), "padding": (1, 1), "stride": (1, 1)}
    want = im2col(x, (2, 2), (1, 1), (1, 1), (1, 1))
    (got,) = run_onnx(one_op_model(tmp_path, "unfold", x, want.shape, attrs), x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("k, d, p, s", WINDOWS)
def test_fold_matches_pytorchs_col2im(tmp_path, k, d, p, s):
    size = (7, 6)
    shape = im2col(np.zeros((2, 3, *size), np.float32), k, d, p, s).shape
    cols = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    want = col2im(cols, size, k, d, p, s)
    attrs = {"output_size": size, "kernel_size": k, "dilation": d, "padding": p, "stride": s}
    (got,) = run_onnx(one_op_model(tmp_path, "fold", cols, want.shape, attrs), cols)
    assert got.dtype == want.dtype
    assert rel_err(got, want) <= REL_ERR
