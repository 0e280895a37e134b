"""Conv and attention on a GPU: PyTorch eager against emberlink's Device.cuda, eager and jitted.

    python3 bench/gpu_models.py [--device cuda:0] [--steps 30] [--only conv,attention,cnn,transformer]
    .venv/bin/python bench/gpu_models.py --device cpu --quick      # try it without a GPU

Four steps, each timed as the median of its steps (after warm-up) with the loss read every step
(so every step ends synchronized, on both sides), the data resident on the device:
(a) conv: Conv2d(64, 64, 3, padding=1) on a 64x64x32x32 float32 batch, forward and backward of
    the outputs' sum (weight and bias gradients);
(b) cnn: Conv2d(3, 32, 3, p=1)-BatchNorm2d-ReLU-MaxPool2d(2)-Conv2d(32, 64, 3, p=1)-ReLU-
    MaxPool2d(2)-Flatten-Linear(4096, 10) on 128 3x32x32 images, cross-entropy, SGD (momentum 0.9);
(c) attention: scaled_dot_product_attention(q, k, v, is_causal=True), batch 32, 8 heads, length
    256, head dim 64, forward and backward of the outputs' sum (gradients of q, k and v);
(d) transformer: one TransformerEncoderLayer(256, 8, dropout=0, batch_first=True) training step
    on a 32x128x256 batch, MSE against a fixed target, SGD.

Columns: PyTorch eager (same shapes, the same initial weights copied from emberlink's; TF32 off,
as emberlink computes float32 without it); emberlink on the device with every step recorded and
run eagerly (`EMBERLINK_CAPTURE=0`); and the step compiled with `emberlink.jit`, which on a GPU
replays each plan as a captured CUDA graph after warm-up. For (a) and (c) on CuPy, the "reference
kernels" columns run the same with the CuPy backend's fast paths swapped for the reference
implementations they replaced (numpy_backend's `unfold`, `softmax`, `matmul` run on CuPy, and
cuBLAS reading every transposed operand from a copy), so one run shows before and after.
"agrees": every emberlink column's losses (and, for (a) and (c), gradients) match PyTorch's within
float32 tolerance; without torch, the jitted column is checked against the eager one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import emberlink as el
from emberlink import nn
from emberlink.graph_replay.captured import CAPTURE_ENV

F = nn.functional


@contextlib.contextmanager
def capture(on: bool) -> Iterator[None]:
    """Devices made inside replay captured graphs (`on`) or run every plan eagerly."""
    old = os.environ.get(CAPTURE_ENV)
    os.environ[CAPTURE_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[CAPTURE_ENV]
        else:
            os.environ[CAPTURE_ENV] = old


WARMUP = 5  # eager: compile and warm caches; jit: eager call, trace, first replay, capture, replay
LOSS_RTOL = 2e-4  # float32, different summation orders over up to 4M terms


@dataclass
class Case:
    """One step in both frameworks: `make(dev, jit)` builds emberlink's side (its step: no
    arguments, returns the loss tensor; jitted or not); `torch_make(state, device)` builds
    PyTorch's from `state()`, emberlink's initial weights (the same seeds) in torch's layout."""

    name: str
    label: str
    make: Callable[[el.Device, bool], EmberSide]
    torch_make: Callable[[dict[str, np.ndarray], str], TorchSide]
    state: Callable[[], dict[str, np.ndarray]] = dict  # emberlink's initial weights, torch's names
    reference_columns: bool = False


@dataclass
class EmberSide:
    step: Callable[[], el.Tensor]
    grads: Callable[[], dict[str, np.ndarray]] = dict
    scale: float = 0.0  # for a loss that sums many outputs: the sum of their magnitudes


@dataclass
class TorchSide:
    step: Callable[[], Any]
    grads: Callable[[], dict[str, np.ndarray]] = dict


@dataclass
class Result:
    ms: float
    losses: list[float]
    grads: dict[str, np.ndarray] = field(default_factory=dict)
    note: str = ""
    scale: float = 0.0


# -- shapes ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    conv_batch: int = 64
    cnn_batch: int = 128
    attn_batch: int = 32
    tf_batch: int = 32

    @classmethod
    def quick(cls) -> Sizes:
        return cls(conv_batch=4, cnn_batch=16, attn_batch=2, tf_batch=2)


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _torch_state(module: nn.Module) -> dict[str, np.ndarray]:
    """emberlink's parameters and buffers by name, 2-D weights transposed to torch's (out, in)."""
    return {k: (v.T.copy() if v.ndim == 2 else v) for k, v in module.state_dict().items()}


# -- (a) one conv layer ----------------------------------------------------------------------------


def conv_case(sizes: Sizes) -> Case:
    x = _rng(1).standard_normal((sizes.conv_batch, 64, 32, 32), dtype=np.float32)

    def make(dev: el.Device, jit: bool) -> EmberSide:
        conv = nn.Conv2d(64, 64, 3, padding=1, seed=0).to(dev)
        xd = dev.tensor(x)

        def step(x: el.Tensor) -> el.Tensor:
            conv.zero_grad()
            loss: el.Tensor = conv(x).sum()
            loss.backward()
            return loss

        run = el.jit(step) if jit else step

        def grads() -> dict[str, np.ndarray]:
            return {n: p.grad.numpy() for n, p in (("weight", conv.weight), ("bias", conv.bias))}  # type: ignore[union-attr]

        with el.no_grad():
            scale = float(conv(xd).abs().sum())
        return EmberSide(lambda: run(xd), grads, scale)

    def torch_make(state: dict[str, np.ndarray], device: str) -> TorchSide:
        import torch

        conv = torch.nn.Conv2d(64, 64, 3, padding=1).to(device)
        _load(conv, state)
        xt = torch.from_numpy(x).to(device)

        def step() -> Any:
            conv.zero_grad(set_to_none=True)
            loss = conv(xt).sum()
            loss.backward()
            return loss

        return TorchSide(step, lambda: {"weight": _np(conv.weight.grad), "bias": _np(conv.bias.grad)})

    label = f"(a) Conv2d 64->64 3x3, {sizes.conv_batch}x64x32x32, fwd+bwd"
    state = lambda: _torch_state(nn.Conv2d(64, 64, 3, padding=1, seed=0))
    return Case("conv", label, make, torch_make, state, reference_columns=True)


# -- (b) a small CNN training step -----------------------------------------------------------------


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1, seed=0),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1, seed=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 10, seed=2),
    )


def cnn_case(sizes: Sizes) -> Case:
    rng = _rng(2)
    batches = [
        (
            rng.standard_normal((sizes.cnn_batch, 3, 32, 32), dtype=np.float32),
            rng.integers(0, 10, sizes.cnn_batch),
        )
        for _ in range(4)
    ]

    def make(dev: el.Device, jit: bool) -> EmberSide:
        model = _cnn().to(dev)
        opt = el.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        data = [(dev.tensor(x), dev.tensor(y)) for x, y in batches]

        def step(x: el.Tensor, y: el.Tensor) -> el.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss

        run = el.jit(step) if jit else step
        return EmberSide(_cycle(run, data))

    def torch_make(state: dict[str, np.ndarray], device: str) -> TorchSide:
        import torch

        tnn = torch.nn
        model = tnn.Sequential(
            tnn.Conv2d(3, 32, 3, padding=1),
            tnn.BatchNorm2d(32),
            tnn.ReLU(),
            tnn.MaxPool2d(2),
            tnn.Conv2d(32, 64, 3, padding=1),
            tnn.ReLU(),
            tnn.MaxPool2d(2),
            tnn.Flatten(),
            tnn.Linear(64 * 8 * 8, 10),
        ).to(device)
        _load(model, state)
        opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        data = [(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)) for x, y in batches]

        def step(x: Any, y: Any) -> Any:
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss

        return TorchSide(_cycle(step, data))

    label = f"(b) small CNN training step, {sizes.cnn_batch}x3x32x32, SGD"
    return Case("cnn", label, make, torch_make, lambda: _torch_state(_cnn()))


# -- (c) scaled dot-product attention --------------------------------------------------------------


def attention_case(sizes: Sizes) -> Case:
    shape = (sizes.attn_batch, 8, 256, 64)
    rng = _rng(3)
    qkv = [rng.standard_normal(shape, dtype=np.float32) for _ in range(3)]

    def make(dev: el.Device, jit: bool) -> EmberSide:
        q, k, v = (dev.tensor(a) for a in qkv)
        for t in (q, k, v):
            t.requires_grad = True

        def step(q: el.Tensor, k: el.Tensor, v: el.Tensor) -> el.Tensor:
            loss = F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()
            loss.backward()
            return loss

        run = el.jit(step) if jit else step

        def call() -> el.Tensor:
            q.grad = k.grad = v.grad = None
            return run(q, k, v)

        def grads() -> dict[str, np.ndarray]:
            return {n: t.grad.numpy() for n, t in (("q", q), ("k", k), ("v", v))}  # type: ignore[union-attr]

        with el.no_grad():
            scale = float(F.scaled_dot_product_attention(q, k, v, is_causal=True).abs().sum())
        return EmberSide(call, grads, scale)

    def torch_make(state: dict[str, np.ndarray], device: str) -> TorchSide:
        import torch

        q, k, v = (torch.from_numpy(a).to(device).requires_grad_() for a in qkv)

        def step() -> Any:
            q.grad = k.grad = v.grad = None
            loss = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()
            loss.backward()
            return loss

        return TorchSide(step, lambda: {"q": _np(q.grad), "k": _np(k.grad), "v": _np(v.grad)})

    label = f"(c) scaled_dot_product_attention, causal, {sizes.attn_batch}x8x256x64, fwd+bwd"
    return Case("attention", label, make, torch_make, reference_columns=True)


# -- (d) a transformer encoder layer ---------------------------------------------------------------


def _encoder_layer() -> nn.Module:
    return nn.TransformerEncoderLayer(256, 8, dropout=0.0, batch_first=True, seed=0)


def transformer_case(sizes: Sizes) -> Case:
    rng = _rng(4)
    x = rng.standard_normal((sizes.tf_batch, 128, 256), dtype=np.float32)
    target = rng.standard_normal((sizes.tf_batch, 128, 256), dtype=np.float32)

    def make(dev: el.Device, jit: bool) -> EmberSide:
        layer = _encoder_layer().to(dev)
        opt = el.optim.SGD(layer.parameters(), lr=0.01)
        xd, yd = dev.tensor(x), dev.tensor(target)

        def step(x: el.Tensor, y: el.Tensor) -> el.Tensor:
            opt.zero_grad()
            loss = F.mse_loss(layer(x), y)
            loss.backward()
            opt.step()
            return loss

        run = el.jit(step) if jit else step
        return EmberSide(lambda: run(xd, yd))

    def torch_make(state: dict[str, np.ndarray], device: str) -> TorchSide:
        import torch

        layer = torch.nn.TransformerEncoderLayer(256, 8, dropout=0.0, batch_first=True).to(device)
        _load(layer, state)
        opt = torch.optim.SGD(layer.parameters(), lr=0.01)
        xt, yt = torch.from_numpy(x).to(device), torch.from_numpy(target).to(device)

        def step() -> Any:
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(layer(xt), yt)
            loss.backward()
            opt.step()
            return loss

        return TorchSide(step)

    label = f"(d) TransformerEncoderLayer(256, 8) training step, {sizes.tf_batch}x128x256, SGD"
    return Case("transformer", label, make, torch_make, lambda: _torch_state(_encoder_layer()))


# -- running ---------------------------------------------------------------------------------------


def _cycle(step: Callable[..., Any], data: list[tuple[Any, Any]]) -> Callable[[], Any]:
    count = [0]

    def call() -> Any:
        x, y = data[count[0] % len(data)]
        count[0] += 1
        return step(x, y)

    return call


def _np(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy()  # type: ignore[no-any-return]


def _load(module: Any, state: dict[str, np.ndarray]) -> None:
    import torch

    own = module.state_dict()
    missing = set(own) - set(state)
    if missing:
        raise SystemExit(f"no emberlink value for torch's {sorted(missing)}")
    # np.array, not np.ascontiguousarray: that makes a 0-d buffer (num_batches_tracked) 1-d.
    module.load_state_dict({k: torch.from_numpy(np.array(state[k], order="C")) for k in own})


def _time(step: Callable[[], float], steps: int, budget_s: float) -> tuple[float, list[float]]:
    """Median ms of `steps` timed steps (at least 5, fewer when `budget_s` runs out) after the
    warm-up; every step's loss, warm-up included."""
    losses = [step() for _ in range(WARMUP)]
    times: list[float] = []
    end = time.perf_counter() + budget_s
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
        if len(times) >= 5 and time.perf_counter() > end:
            break
    return statistics.median(times) * 1e3, losses


def run_emberlink(
    case: Case, device: str, jit: bool, steps: int, budget_s: float, fast: bool = True
) -> Result:
    with capture(jit), local_device(device, fast) as dev:
        side = case.make(dev, jit)
        ms, losses = _time(lambda: float(side.step()), steps, budget_s)
        grads = side.grads()
        stats = dev.stats()
    note = f"{stats.get('captured_replays', 0)} captured replays" if jit and device != "cpu" else ""
    return Result(ms, losses, grads, note, side.scale)


def run_torch(case: Case, device: str, steps: int, budget_s: float) -> Result | str:
    try:
        import torch
    except ImportError:
        return "torch not importable"
    dev = "cpu" if device == "cpu" else device
    if dev != "cpu" and not torch.cuda.is_available():
        return "torch sees no CUDA device"
    how = _float32_without_tf32(torch)
    side = case.torch_make(case.state(), dev)
    ms, losses = _time(lambda: float(side.step().item()), steps, budget_s)
    return Result(ms, losses, side.grads(), f"torch {torch.__version__}, TF32 off ({how})")


def _float32_without_tf32(torch: Any) -> str:
    """float32 convolutions and matmuls in full float32, as emberlink computes them (cuDNN uses
    TF32 for convolutions by default), by the newer switches where this torch has them (mixing
    them with the older ones is an error there); returns which were set."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if hasattr(conv, "fp32_precision") and hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        conv.fp32_precision = "ieee"  # type: ignore[union-attr]
        return "fp32_precision = 'ieee'"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return "allow_tf32 = False"


@contextlib.contextmanager
def local_device(device: str, fast: bool = True) -> Iterator[el.Device]:
    """Device.cpu() or Device.cuda(n); `fast=False`: a CUDA device whose CuPy backend runs the
    reference kernels in place of its fast paths (CupyBackend's `fast` option)."""
    if device == "cpu":
        dev = el.Device.cpu()
    elif fast:
        dev = el.Device.cuda(int(device.partition(":")[2] or 0))
    else:
        from emberlink.client.local import LocalExecutor
        from emberlink.graph_replay.cupy_backend import CupyBackend

        dev = el.Device(LocalExecutor(CupyBackend(int(device.partition(":")[2] or 0), fast=False)), device)
    with dev:
        yield dev


def agreement(results: list[Result], ref: Result, loss_scale: float) -> str:
    """'yes', or what differs: losses within LOSS_RTOL of `ref`'s (relative to `loss_scale` where
    a loss is a sum of many terms), gradients within 1e-3 of the largest gradient entry."""
    problems = []
    for r in results:
        n = min(len(r.losses), len(ref.losses), WARMUP + 3)
        got, want = np.array(r.losses[:n]), np.array(ref.losses[:n])
        err = np.max(np.abs(got - want) / np.maximum(np.abs(want), loss_scale))
        if not err <= LOSS_RTOL:
            problems.append(f"loss rel. err {err:.1e}")
        for name, g in r.grads.items():
            w = ref.grads.get(name)
            if w is None:
                continue
            gerr = float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-30))
            if not gerr <= 1e-3:
                problems.append(f"grad {name} rel. err {gerr:.1e}")
    return "yes" if not problems else "NO: " + "; ".join(problems)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu to try the script without a GPU")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per column (at most)")
    parser.add_argument(
        "--budget", type=float, default=2.0, help="seconds of timed steps per column (at least 5 steps)"
    )
    parser.add_argument("--quick", action="store_true", help="small batches (to check the script on a CPU)")
    parser.add_argument("--only", default="conv,attention,cnn,transformer")
    parser.add_argument(
        "--deadline",
        type=float,
        default=0.0,
        help="stop starting new columns after this many seconds (0: none)",
    )
    args = parser.parse_args()
    sizes = Sizes.quick() if args.quick else Sizes()
    cases = {
        c.name: c for c in (conv_case(sizes), cnn_case(sizes), attention_case(sizes), transformer_case(sizes))
    }
    wanted = [cases[n] for n in args.only.split(",")]
    gpu = args.device != "cpu"
    start = time.perf_counter()
    kind = "Device.cuda" if gpu else "Device.cpu"

    print(f"# {_versions(args.device)}", flush=True)

    def late() -> bool:
        return bool(args.deadline) and time.perf_counter() - start > args.deadline

    header = (
        f"| step | PyTorch eager ({args.device}) | {kind} eager, reference kernels | {kind} eager "
        f"| jit, reference kernels | jit | jit / PyTorch | agrees |"
    )
    rows: list[str] = []
    notes: list[str] = []
    for case in wanted:
        cells: dict[str, Result | str] = {}
        columns = [("torch", None), ("eager", False), ("jit", True)]
        if gpu and case.reference_columns:
            columns[1:1] = [("eager_ref", False)]
            columns.insert(3, ("jit_ref", True))
        for col, jit in columns:
            if late():
                cells[col] = "skipped (deadline)"
                continue
            t0 = time.perf_counter()
            try:
                if col == "torch":
                    cells[col] = run_torch(case, args.device, args.steps, args.budget)
                elif col.endswith("_ref"):
                    cells[col] = run_emberlink(
                        case, args.device, bool(jit), args.steps, args.budget, fast=False
                    )
                else:
                    cells[col] = run_emberlink(case, args.device, bool(jit), args.steps, args.budget)
            except Exception as e:  # noqa: BLE001 - a column that fails is reported, the others still run
                cells[col] = f"failed: {type(e).__name__}: {e}"
                traceback.print_exc(limit=-6, file=sys.stdout)
            cell = cells[col]
            shown = f"{cell.ms:.3f} ms" if isinstance(cell, Result) else cell
            print(f"# {case.name} {col}: {shown} ({time.perf_counter() - t0:.1f} s)", flush=True)
        rows.append(_row(case, cells))
        for col, cell in cells.items():
            if isinstance(cell, Result) and cell.note:
                notes.append(f"{case.name} {col}: {cell.note}")
            elif isinstance(cell, str):
                notes.append(f"{case.name} {col}: {cell}")
    print()
    print(header)
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        print(row)
    print()
    for note in notes:
        print(note)
    print(f"total {time.perf_counter() - start:.1f} s")


def _versions(device: str) -> str:
    """What the numbers were measured with."""
    found = [f"numpy {np.__version__}"]
    if device != "cpu":
        try:
            import cupy

            props = cupy.cuda.runtime.getDeviceProperties(int(device.partition(":")[2] or 0))
            found += [props["name"].decode(), f"cupy {cupy.__version__}"]
        except Exception as e:  # noqa: BLE001 - a description, not a requirement
            found.append(f"cupy: {type(e).__name__}: {e}")
        try:
            import nvmath

            found.append(f"nvmath-python {nvmath.__version__}")
        except ImportError:
            found.append("no nvmath-python: the jit columns run eagerly")
    return ", ".join(found)


def _row(case: Case, cells: dict[str, Result | str]) -> str:
    def ms(col: str) -> str:
        cell = cells.get(col)
        return f"{cell.ms:.3f}" if isinstance(cell, Result) else "–"

    torch_r, jit_r = cells.get("torch"), cells.get("jit")
    ratio = (
        f"{jit_r.ms / torch_r.ms:.2f}x" if isinstance(torch_r, Result) and isinstance(jit_r, Result) else "–"
    )
    ours = [c for k, c in cells.items() if k != "torch" and isinstance(c, Result)]
    ref = torch_r if isinstance(torch_r, Result) else cells.get("eager")
    if not isinstance(ref, Result) or not ours:
        agree = "–"
    else:
        ours = [c for c in ours if c is not ref]
        agree = agreement(ours, ref, max(c.scale for c in ours))
        if ref is not torch_r:
            agree += " (vs eager)"
    return f"| {case.label} | {ms('torch')} | {ms('eager_ref')} | {ms('eager')} | {ms('jit_ref')} | {ms('jit')} | {ratio} | {agree} |"


if __name__ == "__main__":
    main()
