"""Assembles an ONNX model from a recorded forward pass: graph inputs, initializers, the lowered
steps and the outputs; no tracing, no file I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import metadata

import onnx
from onnx import helper

from emberlink.errors import ExportError
from emberlink.graph_replay.ir import TensorSpec
from emberlink.onnx.batch import Affine, Dim, Symbolic
from emberlink.onnx.builder import Builder, onnx_dtype
from emberlink.onnx.lowering import Arg, Site, lower
from emberlink.onnx.trace import Traced


def _dim_name(d: Affine) -> str:
    if d == Affine(1, 0):
        return "batch"
    scaled = "batch" if d.scale == 1 else f"{d.scale}*batch"
    return scaled if d.offset == 0 else f"{scaled}{d.offset:+d}"


def _value_info(name: str, spec: TensorSpec, dims: Sequence[Dim]) -> onnx.ValueInfoProto:
    shape = [_dim_name(d) if isinstance(d, Affine) else d for d in dims]
    return helper.make_tensor_value_info(name, onnx_dtype(spec.dtype), shape)


def _reserve(b: Builder, names: Sequence[str], what: str) -> list[str]:
    out = []
    for name in names:
        if b.fresh(name) != name:
            raise ExportError(f"{what} name {name!r} is used twice")
        out.append(name)
    return out


def build_model(
    traced: Traced,
    sym: Symbolic,
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    opset: int,
    dynamic_batch: bool,
) -> onnx.ModelProto:
    """The ONNX model of `traced`; its parameters are initializers by their dotted names."""
    program = traced.program
    if len(input_names) != len(program.inputs) or len(output_names) != len(program.outputs):
        raise ExportError(
            f"{len(input_names)} input names and {len(output_names)} output names for a model of "
            f"{len(program.inputs)} inputs and {len(program.outputs)} outputs"
        )
    b = Builder()
    names: dict[int, str] = dict(zip(program.inputs, _reserve(b, input_names, "input"), strict=True))
    outputs = _reserve(b, output_names, "output")
    if dynamic_batch:
        b.batch_source = names[program.inputs[0]]
    for vid, array in program.arrays.items():
        if vid not in names:
            name = traced.names.get(vid)
            names[vid] = b.const(array, "constant") if name is None else b.initializer(array, name)
    for step in program.steps:
        args = tuple(
            Arg(names.get(v), sym.scalars.get(v), program.specs[v], sym.dims.get(v, ())) for v in step.inputs
        )
        site = Site(step.op, args, sym.attrs[step.out], program.specs[step.out], sym.dims[step.out])
        names[step.out] = lower(b, site)
    for vid, name in zip(program.outputs, outputs, strict=True):
        b.nodes.append(helper.make_node("Identity", [names[vid]], [name], name=name))
    graph = helper.make_graph(
        b.nodes,
        "emberlink",
        [_value_info(names[v], program.specs[v], sym.dims[v]) for v in program.inputs],
        [
            _value_info(n, program.specs[v], sym.dims[v])
            for v, n in zip(program.outputs, outputs, strict=True)
        ],
        initializer=b.initializers,
    )
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(
        graph, opset_imports=opsets, producer_name="emberlink", producer_version=_version()
    )
    model.ir_version = helper.find_min_ir_version_for(opsets)
    return model


def _version() -> str:
    try:
        return metadata.version("emberlink")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


__all__ = ["build_model"]
