"""Records a forward pass as one graph without running it: a Device whose executor keeps what it is
handed; no ONNX here, and nothing is ever computed.

The forward pass runs on a private Device over a `Recorder`, an Executor that stores each upload
and each flushed `(Graph, Call)` instead of running them. So the Graph handed over is exactly the
one a real flush would run (the op table's checks and inference included), built once, and a
forward pass longer than one segment (`MAX_PENDING` nodes) is as welcome as a short one: the
segments are joined into one `Program` over value ids, by the buffer ids that link them. A read
inside the forward pass (`float(t)`, `t.numpy()`) cannot be recorded and is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from emberlink.client.autograd import no_grad
from emberlink.client.device import Device
from emberlink.client.executor import Call, ExecutorStats
from emberlink.client.tensor import Tensor
from emberlink.errors import DeviceError, ExportError
from emberlink.graph_replay import ops
from emberlink.graph_replay.ir import AttrValue, Graph, Scalar, TensorSpec, binding_spec


@dataclass(frozen=True, slots=True)
class Step:
    """One node of a Program: `op` applied to value ids, producing value `out`."""

    out: int
    op: str
    inputs: tuple[int, ...]
    attrs: tuple[tuple[str, AttrValue], ...]


@dataclass
class Program:
    """A recorded forward pass: every value's spec, the uploaded arrays (parameters, inputs and
    constants made inside the forward pass), the bindings' values, the steps in order, which
    values are the inputs and which the outputs."""

    specs: dict[int, TensorSpec] = field(default_factory=dict)
    arrays: dict[int, np.ndarray] = field(default_factory=dict)
    scalars: dict[int, Scalar] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()

    def pruned(self) -> Program:
        """The same program without the steps, arrays and scalars no output depends on."""
        live = set(self.outputs)
        kept: list[Step] = []
        for step in reversed(self.steps):
            if step.out in live:
                kept.append(step)
                live.update(step.inputs)
        live.update(self.inputs)
        return Program(
            specs={v: s for v, s in self.specs.items() if v in live},
            arrays={v: a for v, a in self.arrays.items() if v in live},
            scalars={v: s for v, s in self.scalars.items() if v in live},
            steps=kept[::-1],
            inputs=self.inputs,
            outputs=self.outputs,
        )


class Recorder:
    """The Executor of the export device: keeps uploads and flushed graphs as one Program."""

    def __init__(self) -> None:
        self.program = Program()
        self._by_buf: dict[int, int] = {}
        self._next = 0

    def _new(self, spec: TensorSpec) -> int:
        vid = self._next
        self._next += 1
        self.program.specs[vid] = spec
        return vid

    def value_of(self, buf: int) -> int:
        return self._by_buf[buf]

    def upload(self, buf: int, array: np.ndarray) -> None:
        vid = self._new(TensorSpec(array.dtype.name, array.shape))
        self.program.arrays[vid] = array
        self._by_buf[buf] = vid

    def execute(self, graph: Graph, gid: bytes, call: Call) -> None:
        specs = ops.graph_specs(graph)
        local = [self._by_buf[buf] for buf in call.inputs]
        for kind, value in zip(graph.bindings, call.bindings, strict=True):
            vid = self._new(binding_spec(kind))
            self.program.scalars[vid] = value
            local.append(vid)
        for i, node in enumerate(graph.nodes):
            vid = self._new(specs[graph.node_value(i)])
            self.program.steps.append(Step(vid, node.op, tuple(local[v] for v in node.inputs), node.attrs))
            local.append(vid)
        for buf, v in zip(call.outputs, graph.outputs, strict=True):
            self._by_buf[buf] = local[v]

    def read(self, buf: int, wait: bool = False, after_sent: Callable[[], None] | None = None) -> Any:
        raise ExportError(
            "the forward pass reads a tensor's value (float(t), t.item(), t.numpy(), if on a tensor, ...): "
            "export records tensor ops only, so a result that depends on a value read in Python "
            "cannot be exported"
        )

    def drop(self, bufs: Sequence[int]) -> None:
        return None

    def send(self) -> None:
        return None

    def sync(self) -> None:
        return None

    def stats(self) -> ExecutorStats:
        uploaded = sum(a.nbytes for a in self.program.arrays.values())
        return {"bytes_sent": 0, "bytes_received": 0, "round_trips": 0, "bytes_uploaded": uploaded,
                "graphs_registered": 0, "graph_replays": 0}  # fmt: skip

    def memory_stats(self) -> dict[str, int]:
        return {"in_use_bytes": 0, "peak_bytes": 0, "pool_bytes": 0}

    def close(self) -> None:
        return None


@dataclass
class Traced:
    """A recorded forward pass and the value ids of the named tensors (parameters, buffers)."""

    program: Program
    names: dict[int, str]


def trace(
    fn: Callable[..., Any], named: Sequence[tuple[str, Tensor, np.ndarray]], inputs: Sequence[np.ndarray]
) -> Traced:
    """Record `fn(*inputs)` under `no_grad`, with each named tensor standing for its array.

    `named` holds `(name, tensor, array)`: while `fn` runs, `tensor` refers to `array` on the
    export device; its own value is put back afterwards, whatever happens.
    """
    recorder = Recorder()
    dev = Device(recorder, "onnx-export")
    saved = [(t, t._v) for _, t, _ in named]
    names: dict[int, str] = {}
    try:
        for name, t, array in named:
            t._v = dev.tensor(array)._v
            names[recorder.value_of(t._v.buf)] = name  # type: ignore[arg-type]
        xs = [dev.tensor(a) for a in inputs]
        recorder.program.inputs = tuple(recorder.value_of(x._v.buf) for x in xs)  # type: ignore[arg-type]
        with no_grad():
            try:
                result = fn(*xs)
            except DeviceError as e:
                raise ExportError(
                    f"the forward pass uses a tensor that is not the example input, a parameter "
                    f"(named_parameters()) or a buffer (named_buffers()) of the model: {e}"
                ) from e
        outs = _output_tensors(result)
        dev.flush()
        for i, t in enumerate(outs):
            if t._v.dev is not dev:
                raise ExportError(f"output {i} is on {t.device}, not computed from the example input")
        recorder.program.outputs = tuple(recorder.value_of(t._v.buf) for t in outs)  # type: ignore[arg-type]
    finally:
        for t, v in saved:
            t._v = v
        dev.close()
    return Traced(recorder.program.pruned(), names)


def _output_tensors(result: object) -> list[Tensor]:
    items = list(result) if isinstance(result, tuple | list) else [result]
    if not items:
        raise ExportError("the model returned no tensor")
    for i, t in enumerate(items):
        if not isinstance(t, Tensor):
            raise ExportError(
                f"the model must return a Tensor or a tuple of Tensors; output {i} is a {type(t).__name__}"
            )
    return items  # type: ignore[return-value]


__all__ = ["Program", "Recorder", "Step", "Traced", "trace"]
