"""Fused elementwise chains: which steps may join one, and the CUDA source of one; no CuPy import.

`plan.compile_plan(..., fusion=...)` groups the steps (see plan.py); this module decides what is
fusable and writes the body of a `cupy.ElementwiseKernel` for a fused step, as plain strings, so
the generator is tested without a GPU. Each op's C expression is its op-table entry's `expr`
(ops.py); an op without one never fuses. The CuPy backend builds and caches the kernels.

Rules (what makes a kernel compute what the NumPy reference computes):
- Only ops whose meaning is one C expression per element, in float32, float64 and bool, join a
  chain. Every operand is cast to the step's `operand_dtype` first, as the reference does, and
  every inner value is stored in its own spec's dtype, so rounding happens where it happens there.
- Bindings become scalar kernel parameters already cast to the dtype each use needs (one
  parameter per binding and dtype), exactly as `numpy_backend.host_scalar` casts them.
- `maximum`/`minimum`/`relu` propagate NaN as NumPy does (`(a > b || a != a) ? a : b`), not as
  C's fmax does; on a tie they give the second operand, as NumPy's SIMD loops do (it decides
  the sign of `maximum(-0.0, 0.0)`).
- Math functions are CUDA's (exp, log, ...), which may differ from the host's in the last bit;
  GPU tests compare against NumPy with the same tolerance as single ops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from emberlink.graph_replay.ir import TensorSpec
from emberlink.graph_replay.ops import OPS
from emberlink.graph_replay.plan import Step

CTYPES: dict[str, str] = {"float32": "float", "float64": "double", "bool": "bool"}
"""Dtypes a fused chain may touch, and their C types."""

FUSABLE_OPS = frozenset(name for name, d in OPS.items() if d.expr is not None)
"""Ops a fused chain may contain: those with a kernel expression in the op table."""


def expression(op: str, operands: Sequence[str], ctype: str) -> str:
    """Op `op`'s C expression over `operands` (C expressions already of the operand dtype, whose
    C type is `ctype`), from its op-table entry."""
    expr = OPS[op].expr
    if expr is None:
        raise KeyError(f"{op} has no kernel expression")
    return expr.format(*operands, t=ctype)


def _dtype_ok(spec: TensorSpec) -> bool:
    return spec.weak or spec.dtype in CTYPES


def fusable(step: Step) -> bool:
    """Whether `step` may join a fused chain: a fusable op on float32/float64/bool values only."""
    if step.op not in FUSABLE_OPS or not _dtype_ok(step.out_spec):
        return False
    if step.operand_dtype is not None and step.operand_dtype not in CTYPES:
        return False
    return all(_dtype_ok(s) for s in step.in_specs)


@dataclass(frozen=True, slots=True)
class KernelSource:
    """An ElementwiseKernel's parts, and how to call it.

    `params[k]` says what kernel argument `k` is: `(i, None)` the fused step's input `i` (an
    array), or `(i, dtype)` its input `i` (a binding) as a scalar of `dtype`.
    """

    in_params: str
    out_params: str
    body: str
    name: str
    params: tuple[tuple[int, str | None], ...]


def kernel_source(step: Step) -> KernelSource:
    """The ElementwiseKernel source of a fused step (`step.chain` in order, `step.out` the result)."""
    position = {v: i for i, v in enumerate(step.inputs)}
    params: list[tuple[int, str | None]] = []
    decls: list[str] = []
    names: dict[tuple[int, str | None], str] = {}

    def array_param(v: int) -> str:
        key = (v, None)
        if key not in names:
            i = position[v]
            names[key] = f"in{len(params)}"
            params.append((i, None))
            decls.append(f"{step.in_specs[i].dtype} {names[key]}")
        return names[key]

    def binding_param(v: int, dtype: str) -> str:
        key = (v, dtype)
        if key not in names:
            names[key] = f"in{len(params)}"
            params.append((position[v], dtype))
            decls.append(f"{dtype} {names[key]}")
        return names[key]

    local: dict[int, tuple[str, str]] = {}  # inner value -> (C name, dtype)
    lines: list[str] = []

    def operand(v: int, want: str | None, spec: TensorSpec) -> str:
        """Value `v` as an operand of dtype `want` (None: as it is)."""
        if v in local:
            name, dtype = local[v]
        elif spec.weak:
            dtype = want if want is not None else "bool" if spec.dtype == "bool" else _weak_default(spec)
            return binding_param(v, dtype)
        else:
            name, dtype = array_param(v), spec.dtype
        if want is None or want == dtype:
            return name
        return f"(({CTYPES[want]}){name})"

    for k, m in enumerate(step.chain):
        t = m.operand_dtype
        # Every operand is cast to the operand dtype, but a where's condition, which stays bool.
        wants = [("bool" if m.op == "where" and i == 0 else t) for i in range(len(m.inputs))]
        args = [operand(v, want, spec) for v, want, spec in zip(m.inputs, wants, m.in_specs, strict=True)]
        expr = expression(m.op, args, CTYPES[t if t is not None else m.out_spec.dtype])
        out_dtype = m.out_spec.dtype
        name = f"t{k}"  # by position, so the same chain in any plan has the same source
        local[m.out] = (name, out_dtype)
        lines.append(f"{CTYPES[out_dtype]} {name} = ({CTYPES[out_dtype]}){expr};")
    lines.append(f"out0 = {local[step.out][0]};")
    ops = "_".join(dict.fromkeys(m.op for m in step.chain))
    return KernelSource(
        in_params=", ".join(decls),
        out_params=f"{step.out_spec.dtype} out0",
        body="\n".join(lines),
        name=f"emberlink_fused_{ops}"[:100],
        params=tuple(params),
    )


def _weak_default(spec: TensorSpec) -> str:
    # A binding used where the op has no operand dtype (not the case for fusable ops, which all
    # cast their operands); kept total so the generator never guesses silently.
    raise ValueError(f"a binding of kind {spec.dtype} needs an operand dtype in a fused chain")


def call_args(source: KernelSource, args: Sequence[Any], scalar: Callable[[Any, str], Any]) -> list[Any]:
    """The kernel's arguments from the fused step's args: arrays as they are, bindings through
    `scalar(value, dtype)` (numpy_backend.host_scalar)."""
    return [args[i] if dtype is None else scalar(args[i], dtype) for i, dtype in source.params]


__all__ = ["CTYPES", "FUSABLE_OPS", "KernelSource", "call_args", "expression", "fusable", "kernel_source"]
