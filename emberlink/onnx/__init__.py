"""emberlink.onnx: `export(model, example_input, path)` writes a model's forward pass as an ONNX file.

Export works on emberlink's op graph, not per layer class: the forward pass is recorded (never run)
on a private device, and every op of the recorded graph is mapped to ONNX nodes (lowering.py), so
anything written with emberlink's ops exports, layers of your own included. Needs the `onnx`
package (`pip install 'emberlink[onnx]'`), imported on the first export only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from emberlink.client.future import ArrayFuture
from emberlink.client.tensor import Tensor
from emberlink.errors import EmberlinkError, ExportError
from emberlink.onnx.batch import RECORDINGS, compare, static
from emberlink.onnx.trace import Program, trace

DEFAULT_OPSET = 18
"""The ONNX opset written (18: reductions take their axes as an input)."""

_EXTERNAL_DATA_BYTES = 1 << 30
"""Past this many bytes of parameters, they go to a `<path>.data` file beside the model (a protobuf
message cannot pass 2 GiB)."""


def export(
    model: Callable[..., Any],
    example_input: Any,
    path: str | Path,
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    dynamic_batch: bool = True,
    opset_version: int = DEFAULT_OPSET,
) -> None:
    """Write `model`'s forward pass on `example_input` to `path` as an ONNX model.

    `model` is a Module (its parameters, and buffers if it has `named_buffers()`, become
    initializers under their dotted names) or any function of tensors. `example_input` is a Tensor
    or NumPy array, or a tuple of them for a model of several inputs; it is read once, as are the
    parameters, so a model on any device (a remote one too) exports. The forward pass is recorded
    under `no_grad` and never run. With `dynamic_batch`, axis 0 of every input is the batch, of
    any size in the ONNX model. Inputs are named `input` (`input_0`, ... for several), outputs
    `output` likewise, unless `input_names` / `output_names` say otherwise.

    ExportError when the forward pass uses an op with no ONNX form (named in the message), draws
    random numbers (dropout in training mode: call `model.eval()` first), or reads a value in
    Python; with `dynamic_batch`, also when the graph depends on the batch size otherwise than
    through its shapes.
    """
    try:
        import onnx

        from emberlink.onnx.lowering import check_program
        from emberlink.onnx.model import build_model
    except ImportError as e:
        raise ExportError(
            f"emberlink.onnx.export needs the onnx package: pip install 'emberlink[onnx]' ({e})"
        ) from e
    if opset_version < DEFAULT_OPSET:
        raise ExportError(f"opset_version must be at least {DEFAULT_OPSET}, got {opset_version}")
    inputs = _host_inputs(example_input)
    named = _named_tensors(model)
    traced = trace(model, named, inputs)
    check_program(traced.program)
    if dynamic_batch:
        programs, batches = _trace_batches(model, named, inputs)
        sym = compare([traced.program, *programs], [inputs[0].shape[0], *batches])
    else:
        sym = static(traced.program)
    proto = build_model(
        traced,
        sym,
        input_names=_names(input_names, "input", len(inputs)),
        output_names=_names(output_names, "output", len(traced.program.outputs)),
        opset=opset_version,
        dynamic_batch=dynamic_batch,
    )
    onnx.checker.check_model(proto)
    big = sum(a.nbytes for a in traced.program.arrays.values()) > _EXTERNAL_DATA_BYTES
    target = Path(path)
    onnx.save_model(proto, target, save_as_external_data=big, location=f"{target.name}.data")


def _trace_batches(
    model: Callable[..., Any], named: Sequence[tuple[str, Tensor, np.ndarray]], inputs: Sequence[np.ndarray]
) -> tuple[list[Program], list[int]]:
    """The forward pass recorded at the example's batch and at its multiples, to see which sizes
    follow it (batch.py)."""
    sizes = {x.shape[0] if x.ndim else None for x in inputs}
    if len(sizes) != 1 or None in sizes or 0 in sizes:
        shapes = ", ".join(str(x.shape) for x in inputs)
        raise ExportError(
            f"dynamic_batch needs inputs of one batch size > 0 along axis 0, got shapes {shapes}; "
            "export with dynamic_batch=False"
        )
    batch = inputs[0].shape[0]
    programs, batches = [], []
    for k in range(2, RECORDINGS + 1):
        try:
            programs.append(trace(model, named, [np.concatenate([x] * k) for x in inputs]).program)
        except EmberlinkError as e:
            raise ExportError(
                f"the forward pass fails at {k} times the example's batch size ({e}); "
                "export with dynamic_batch=False"
            ) from e
        batches.append(k * batch)
    return programs, batches


def _host_inputs(example_input: Any) -> list[np.ndarray]:
    items = list(example_input) if isinstance(example_input, tuple | list) else [example_input]
    if not items:
        raise ExportError("example_input holds no tensor")
    futures: list[ArrayFuture | None] = []
    for i, x in enumerate(items):
        if isinstance(x, Tensor):
            futures.append(x.read_async())
        elif isinstance(x, np.ndarray):
            futures.append(None)
        else:
            raise ExportError(
                f"example_input must be Tensors or NumPy arrays; item {i} is a {type(x).__name__}"
            )
    return [np.ascontiguousarray(x if f is None else f.result()) for x, f in zip(items, futures, strict=True)]


def _named_tensors(model: object) -> list[tuple[str, Tensor, np.ndarray]]:
    """The model's parameters and buffers, each with its value read once (all reads sent first)."""
    found: list[tuple[str, Tensor]] = []
    seen: set[int] = set()
    for method in ("named_parameters", "named_buffers"):
        listing = getattr(model, method, None)
        if not callable(listing):
            continue
        for name, t in listing():
            if isinstance(t, Tensor) and id(t) not in seen:
                seen.add(id(t))
                found.append((name, t))
    futures = [t.read_async() for _, t in found]
    return [(name, t, f.result()) for (name, t), f in zip(found, futures, strict=True)]


def _names(given: Sequence[str] | None, stem: str, n: int) -> list[str]:
    if given is not None:
        return list(given)
    return [stem] if n == 1 else [f"{stem}_{i}" for i in range(n)]


__all__ = ["DEFAULT_OPSET", "export"]
