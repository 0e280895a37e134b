"""Counter-based random numbers over any array module (NumPy or CuPy); no state, no global randomness.

Element `i` of `rand(seed, shape)` is a pure function of `(seed, i)`: the `i + 1`-th output of
splitmix64 started at `seed` (that is, `mix(seed + (i + 1) * GAMMA)` in uint64 arithmetic). The
top bits of that word, scaled by a power of two, give a uniform number in [0, 1) that is exact in
the target dtype (11, 24 or 53 bits), so NumPy and CuPy agree bit for bit. `randn` takes words
`2i` and `2i + 1` as two 53-bit uniforms and applies Box-Muller in float64, then casts.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1
MANTISSA_BITS = {"float16": 11, "float32": 24, "float64": 53}


def splitmix64(xp: Any, seed: Any, count: int) -> Any:
    """Words `1..count` of splitmix64 from `seed` (taken modulo 2**64), as a uint64 array.

    `seed` is a Python int, or a 0-d uint64 array of `xp` already reduced modulo 2**64 (a captured
    graph reads its seed from device memory, so that each replay can bring a new one).
    """
    start = np.uint64(seed & MASK64) if isinstance(seed, int) else seed
    z = xp.arange(1, count + 1, dtype=np.uint64) * np.uint64(GAMMA) + start
    z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
    return z ^ (z >> np.uint64(31))


def _unit(xp: Any, words: Any, bits: int) -> Any:
    """The top `bits` bits of each word as a float64 in [0, 1)."""
    return (words >> np.uint64(64 - bits)).astype(np.float64) * math.ldexp(1.0, -bits)


def uniform(xp: Any, seed: Any, shape: tuple[int, ...], dtype: str) -> Any:
    """Uniform numbers in [0, 1), exact in `dtype` (float16, float32 or float64)."""
    count = math.prod(shape)
    u = _unit(xp, splitmix64(xp, seed, count), MANTISSA_BITS[dtype])
    return u.astype(dtype).reshape(shape)


def normal(xp: Any, seed: Any, shape: tuple[int, ...], dtype: str) -> Any:
    """Standard normal numbers by Box-Muller on two 53-bit uniforms per element."""
    count = math.prod(shape)
    words = splitmix64(xp, seed, 2 * count)
    u1 = _unit(xp, words[0::2], 53)
    u2 = _unit(xp, words[1::2], 53)
    r = xp.sqrt(-2.0 * xp.log1p(-u1))  # log(1 - u1): u1 < 1, so finite
    return (r * xp.cos((2.0 * math.pi) * u2)).astype(dtype).reshape(shape)


__all__ = ["normal", "splitmix64", "uniform"]
