"""Elementwise kernels that move four float32 values a thread (16-byte loads and stores); no CuPy import.

CuPy's elementwise kernels (its ufuncs and `ElementwiseKernel`, which fused chains compile to)
load and store one value a thread through a general indexer. On the H200 that leaves a large
elementwise op at a third of the bandwidth PyTorch's vectorized kernels reach: measured
(`bench/gpu_step.py`'s big MLP, 1024x4096 float32, µs a launch) ReLU 23.8 against 8.0 for the same
expression four values a thread, the bias add 23.8 against 7.6, ReLU's backward 25.1 against 13.3,
and the SGD update of a 4096x4096 weight 83.7 against 50.4. In that step's captured graph these
ops were ~270 µs of the GPU's ~4.1 ms.

This module writes such a kernel from a fused chain's `KernelSource` (fusion.py: a single op is a
chain of one), for one *layout* of its arguments, and decides the layout from the arguments'
shapes; the CuPy backend compiles, caches and launches it (cupy_backend.py), and falls back to
the `ElementwiseKernel` where `layout` says no. A layout is one letter per kernel argument:

- `F` (full): a C-contiguous float32 array of the output's shape, read at the same index;
- `P` (period): a C-contiguous float32 array whose shape is the output's trailing dims (a bias
  row broadcast over a batch), with a size divisible by 4: element e reads its element e % size;
- `S` (scalar array): a float32 array of one element (a binding's slot in a captured graph, or a
  0-d array), read once;
- `V` (value): a host scalar (a binding on the eager path), passed by value as float32.

Every array, the output included, must start on a 16-byte boundary and the output's size must
be divisible by 4; anything else (another dtype, a strided view, another broadcast) keeps the
`ElementwiseKernel`. The body is the chain's own C text, run once per lane, so each value is
computed by the same expression, in the same order and the same precision, as the
`ElementwiseKernel` computes it (the GPU tests compare the two bit for bit).
"""

from __future__ import annotations

from collections.abc import Sequence

from emberlink.graph_replay.fusion import KernelSource

FULL, PERIOD, SCALAR, VALUE = "F", "P", "S", "V"
LANES = ("x", "y", "z", "w")
MIN_BYTES = 1 << 18
"""Outputs smaller than this keep the ElementwiseKernel: launch cost rules there, and the layout
check would be Python time for nothing on an eager step's many small ops."""
ALIGN = 16


def float32_only(source: KernelSource) -> bool:
    """Whether every parameter and the output of `source` is float32 (what this module covers)."""
    decls = [d for d in source.in_params.split(", ") if d]
    return all(d.split(" ")[0] == "float32" for d in decls) and source.out_params.split(" ")[0] == "float32"


def layout(
    out_shape: tuple[int, ...], args: Sequence[tuple[tuple[int, ...], bool, int] | None]
) -> str | None:
    """The layout of a call, or None if it has none: `args` gives each kernel argument as
    `(shape, C-contiguous, address)` for an array (all float32, checked by the caller) or None
    for a host scalar; the output must be float32 too."""
    size = 1
    for d in out_shape:
        size *= d
    if size % 4 or size * 4 < MIN_BYTES:
        return None
    letters = []
    for arg in args:
        if arg is None:
            letters.append(VALUE)
            continue
        shape, contiguous, address = arg
        n = 1
        for d in shape:
            n *= d
        if n == 1:
            letters.append(SCALAR)
            continue
        if not contiguous or address % ALIGN:
            return None
        core = tuple(shape)
        while core and core[0] == 1:
            core = core[1:]
        if n == size and len(core) <= len(out_shape) and out_shape[len(out_shape) - len(core) :] == core:
            letters.append(FULL)
        elif n % 4 == 0 and core and out_shape[len(out_shape) - len(core) :] == core:
            letters.append(PERIOD)
        else:
            return None
    return "".join(letters)


def kernel_name(source: KernelSource, letters: str) -> str:
    return f"{source.name}_v4_{letters}"[:120]


def kernel_code(source: KernelSource, letters: str) -> str:
    """The CUDA source of `source` for the call layout `letters` (see the module doc). Its
    parameters: the kernel arguments in order (arrays as pointers, values as float), the output,
    the output's size in float4s, then one period (in float4s) per `P` argument."""
    if len(letters) != len(source.params):
        raise ValueError(f"a layout of {len(letters)} arguments for a kernel of {len(source.params)}")
    params: list[str] = []
    periods: list[str] = []
    loads: list[str] = []
    ones: list[str] = []
    lane_names: list[tuple[str, str]] = []  # (kernel argument name, its float4 local)
    for k, letter in enumerate(letters):
        name = f"in{k}"
        if letter == VALUE:
            params.append(f"const float {name}")
        elif letter == SCALAR:
            params.append(f"const float* {name}_")
            ones.append(f"    const float {name} = *{name}_;")
        elif letter == FULL:
            params.append(f"const float4* {name}_")
            loads.append(f"        const float4 v{k} = {name}_[i];")
            lane_names.append((name, f"v{k}"))
        elif letter == PERIOD:
            params.append(f"const float4* {name}_")
            periods.append(f"const long long p{k}")
            loads.append(f"        const float4 v{k} = {name}_[i % p{k}];")
            lane_names.append((name, f"v{k}"))
        else:
            raise ValueError(f"unknown layout letter {letter!r}")
    body = "\n".join(f"            {line}" for line in source.body.splitlines())
    lanes = []
    for lane in LANES:
        own = "".join(f" const float {name} = {local}.{lane};" for name, local in lane_names)
        lanes.append(
            f"        {{{own}\n            float out0;\n{body}\n            r.{lane} = out0;\n        }}"
        )
    signature = ", ".join([*params, "float4* out0_", "const long long n4", *periods])
    return "\n".join(
        [
            f'extern "C" __global__ void {kernel_name(source, letters)}({signature}) {{',
            *ones,
            "    const long long stride = (long long)gridDim.x * blockDim.x;",
            "    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += stride) {",
            *loads,
            "        float4 r;",
            *lanes,
            "        out0_[i] = r;",
            "    }",
            "}",
        ]
    )


__all__ = ["MIN_BYTES", "float32_only", "kernel_code", "kernel_name", "layout"]
