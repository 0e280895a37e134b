"""Normalizes Python subscripts into the getitem key of docs/internals.md section 2; no recording.

A key item is `("s", start, stop, step)` (concrete, in range, step > 0), `("i", index)` (in range,
drops the axis) or `("n",)` (a new axis). Ellipsis becomes whole slices, and whole slices at the
end are dropped, so `x[0]`, `x[0, :]` and `x[0, ...]` are one key and one graph.

A slice with a negative step is taken as the positive-step slice over the same elements, then
reversed along its output axis (`Plan.flips`), which the caller records as a take.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from emberlink.graph_replay.ir import Key, KeyItem


@dataclass(frozen=True, slots=True)
class Plan:
    key: Key
    flips: tuple[tuple[int, int], ...]  # (output axis, length) to reverse after the getitem


def _index(item: object) -> int:
    try:
        return operator.index(item)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"tensor indices must be ints, slices, None, Ellipsis or an integer Tensor, "
            f"got {type(item).__name__}"
        ) from None


def normalize_key(key: object, shape: tuple[int, ...]) -> Plan:
    """The normalized key of `x[key]` for `x` of `shape`; IndexError when an index is out of range."""
    items = key if isinstance(key, tuple) else (key,)
    n_ellipsis = sum(1 for it in items if it is Ellipsis)
    if n_ellipsis > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    n_consuming = sum(1 for it in items if it is not None and it is not Ellipsis)
    if n_consuming > len(shape):
        raise IndexError(f"too many indices for shape {shape}: {n_consuming} were given")
    out: list[KeyItem] = []
    item_axis: list[int] = []  # the input axis of each "s" or "i" item (-1 for "n")
    flips: list[tuple[int, int]] = []
    axis = 0  # input axis the next item applies to
    out_axis = 0
    for it in items:
        if it is None:
            out.append(("n",))
            item_axis.append(-1)
            out_axis += 1
        elif it is Ellipsis:
            for _ in range(len(shape) - n_consuming):
                out.append(("s", 0, shape[axis], 1))
                item_axis.append(axis)
                axis += 1
                out_axis += 1
        elif isinstance(it, slice):
            out.append(_slice_item(it, shape[axis], out_axis, flips))
            item_axis.append(axis)
            axis += 1
            out_axis += 1
        else:
            dim = shape[axis]
            i = _index(it)
            if not -dim <= i < dim:
                raise IndexError(f"index {i} is out of range for axis {axis} with size {dim} (shape {shape})")
            out.append(("i", i + dim if i < 0 else i))
            item_axis.append(axis)
            axis += 1
    # Whole slices at the end say nothing: drop them so equal meanings give one key.
    while out and out[-1] == ("s", 0, shape[item_axis[-1]], 1):
        out.pop()
        item_axis.pop()
    return Plan(tuple(out), tuple(flips))


def _slice_item(it: slice, dim: int, out_axis: int, flips: list[tuple[int, int]]) -> KeyItem:
    start, stop, step = it.indices(dim)
    if step > 0:
        return ("s", start, max(start, stop), step)
    r = range(start, stop, step)
    if len(r) == 0:
        return ("s", 0, 0, 1)
    if len(r) > 1:
        flips.append((out_axis, len(r)))
    return ("s", r[-1], r[0] + 1, -step)


def tensor_axis(items: tuple[object, ...], ndim: int, tensor_type: type) -> int | None:
    """For a key of one index tensor and otherwise only `:` and `...`: the axis it takes along."""
    pos = [i for i, it in enumerate(items) if isinstance(it, tensor_type)]
    if len(pos) != 1 or len(items) - sum(1 for it in items if it is Ellipsis) > ndim:
        return None
    p = pos[0]
    for i, it in enumerate(items):
        if i != p and not (it is Ellipsis or (isinstance(it, slice) and it == slice(None))):
            return None
    if any(it is Ellipsis for it in items[:p]):
        return ndim - (len(items) - p)
    return p
