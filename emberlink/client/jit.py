"""`emberlink.jit`: run a step eagerly once, trace it once, then replay its graph; never reads data.

Per input signature (the devices, dtypes, shapes and `requires_grad` of the tensor arguments, the
kinds of the scalar arguments, the values of every other argument), call 1 runs the function
eagerly (optimizer state such as Adam's moments is made then, as tinygrad's TinyJit does), call 2
traces it (client/trace.py), and every later call replays that trace: it binds the new arguments
and hands the device's executor one `(graph, gid, Call)`, with no recording, no segment building
and no canonical form (on a remote device: one Execute, which the session sends as a Repeat of
the previous step's batch). At most `max_signatures` signatures are kept per function; a new one
beyond that runs eagerly, with a warning the first time.

Pending work folded in: when a call's tensor arguments include values still pending on their device
(recorded, not yet flushed: the resident DataLoader's gather of the batch, or any eager op on
it), a signature that has run once traces "the pending segment, then the function" as one graph
(once per structure of that segment, `max_signatures` of them per function), and replays it in
place of a flush and a replay: one graph a step, one Execute on a remote device (measured in
emberlink/data.py's docstring). The pending values come out of that graph as a flush would
give them, so tensors the caller holds stay valid. Where that does not hold (no pending argument,
a pending argument that requires grad, a first call, the bound reached, the function reading
pending work it was not passed or a buffer the pending work reads too, state it reads pending
at the call), the pending work is flushed first as its own graph, as before.

Scalar arguments are passed to the tracing call as traced floats and ints that stay bindings; a
scalar argument the function also uses as a Python number (arithmetic, comparisons, `int()`)
would be baked into the trace, so that argument's value becomes part of the signature from then
on. Reads of tensor values are refused in every call, the eager one included.

Not thread-safe per device, like a Device. Calls that run Python (eager or tracing) are serialized
across threads by a lock; replays are not.
"""

from __future__ import annotations

import functools
import logging
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any, Generic, ParamSpec, TypeVar, cast, overload

import numpy as np

from emberlink.client import tensor as _tensor
from emberlink.client.device import Device
from emberlink.client.tensor import Scalar, Tensor, scalar
from emberlink.client.trace import Replay, Trace, build_result, finish, flatten_result, traced
from emberlink.errors import JitError

log = logging.getLogger("emberlink.jit")

P = ParamSpec("P")
R = TypeVar("R")

MAX_SIGNATURES = 8
"""Signatures a jitted function keeps a trace for (torch.compile's default cache size limit)."""

_TRACE_LOCK = threading.Lock()

# -- signatures -----------------------------------------------------------------------------------

_FLOAT, _INT = "float", "int"


class _Static:
    """An argument compared by value (wrapped so it can never equal a leaf's signature entry)."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return type(other) is _Static and type(self.value) is type(other.value) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)


def _number(x: object) -> Scalar | None:
    """A scalar argument (Python or NumPy int or float) as a Python int or float; None otherwise."""
    if isinstance(x, np.integer | np.floating):
        return scalar(x)
    return None


def _walk(x: Any, key: list[Any], leaves: list[Any], static: frozenset[int]) -> None:
    """Append `x`'s signature entries to `key` and its tensors and scalars to `leaves`."""
    t = type(x)
    if t is float or t is int:
        if static and len(leaves) in static:
            key.append(_Static(x.hex() if t is float else x))  # -0.0 and 0.0 differ as constants
        else:
            key.append(_FLOAT if t is float else _INT)
        leaves.append(x)
    elif isinstance(x, Tensor):
        v = x._v
        key.append((v.dev, v.spec, x._rg and (1 if x.grad is None else 2)))
        leaves.append(x)
    elif t is tuple or t is list:
        key.append((t, len(x)))
        for y in x:
            _walk(y, key, leaves, static)
    elif t is dict:
        key.append((dict, tuple(x)))
        for y in x.values():
            _walk(y, key, leaves, static)
    else:
        n = _number(x)
        if n is not None:
            _walk(n, key, leaves, static)
            leaves[-1] = x
            return
        try:
            key.append(_Static(x))
            hash(x)
        except TypeError:
            hint = " (pass a tensor: dev.tensor(array))" if isinstance(x, np.ndarray) else ""
            raise TypeError(
                f"emberlink.jit: an argument of type {t.__name__} is neither a Tensor, a Python number "
                f"nor hashable, so it cannot be part of a signature{hint}"
            ) from None


def _signature(
    args: tuple[Any, ...], kwargs: dict[str, Any], static: frozenset[int]
) -> tuple[tuple[Any, ...], list[Any], Device | None]:
    """(signature key, leaves, the tensors' device) of one call."""
    if not kwargs and not static:  # the common call, flat tensors and numbers: the same key, faster
        key: list[Any] = [(tuple, len(args))]
        dev = None
        ids: list[int] = []
        for x in args:
            t = type(x)
            if t is Tensor:
                v = x._v
                if dev is None:
                    dev = v.dev
                elif v.dev is not dev:
                    break
                key.append((dev, v.spec, x._rg and (1 if x.grad is None else 2)))
                ids.append(id(v))
            elif t is float:
                key.append(_FLOAT)
            elif t is int:
                key.append(_INT)
            else:
                break
        else:
            # (a buffer passed twice is keyed below; a batch's x and y are two)
            if (len(ids) < 2 or len(set(ids)) == len(ids)) and (dev is None or isinstance(dev, Device)):
                return tuple(key), list(args), dev
    key = []
    leaves: list[Any] = []
    _walk(args, key, leaves, static)
    if kwargs:
        _walk(kwargs, key, leaves, static)
    dev = None
    tensors = [x for x in leaves if isinstance(x, Tensor)]
    for x in tensors:
        d = x._v.dev
        if dev is None:
            dev = d
        elif d is not dev:
            raise JitError(
                f"emberlink.jit: the arguments are on several devices ({dev} and {d}); a jitted "
                "function runs on one device"
            )
    if dev is not None and not isinstance(dev, Device):
        raise JitError(
            "emberlink.jit: a tensor argument is not on a device yet; call module.to(device) first"
        )
    if len(tensors) > 1:  # the same buffer passed twice is a different graph from two buffers
        ids = [id(x._v) for x in tensors]
        if len(set(ids)) < len(ids):
            key.append(_Static(tuple(ids.index(i) for i in ids)))
    return tuple(key), leaves, dev


def _map_leaves(x: Any, fn: Callable[[Any], Any], counter: list[int]) -> Any:
    """`x` with each leaf (in `_walk`'s order) replaced by `fn(leaf)`."""
    t = type(x)
    if t is float or t is int or isinstance(x, Tensor) or _number(x) is not None:
        counter[0] += 1
        return fn(x)
    if t is tuple or t is list:
        return t(_map_leaves(y, fn, counter) for y in x)
    if t is dict:
        return {k: _map_leaves(y, fn, counter) for k, y in x.items()}
    return x


def _detached(result: Any) -> Any:
    """The result with every tensor replaced by a history-free one (a jitted function's outputs)."""
    leaves: list[Any] = []
    tree = flatten_result(result, leaves)
    out = [Tensor(x._v) if isinstance(x, Tensor) else x for x in leaves]
    return build_result(tree, out, [0])


# -- the public wrapper -----------------------------------------------------------------------------------

_WARM = object()
"""A signature seen once (run eagerly): its next call traces."""

_UNFOLDED = object()
"""`_fold`'s answer where the device's pending work is not folded into the call."""


def pending_key(dev: Device) -> tuple[Any, ...]:
    """The structure of `dev`'s pending segment that a folded trace depends on: its entries, input
    specs, binding kinds and which of its values are still live (what Device._send_segment keys
    its graphs by); its buffers and binding values are bound at each replay."""
    return (tuple(dev._entries), tuple(dev._in_specs), tuple(dev._bind_kinds), tuple(_live(dev)))


def _live(dev: Device) -> list[int]:
    return [i for i, ref in enumerate(dev._weak) if ref() is not None]


class _Hot:
    """The folded trace a function's last folded call replayed, with what it was found by (its
    signature, pending_key's parts as lists, the pending arguments): a loop's next call, whose
    pending segment has the same structure, compares these lists instead of hashing the key.
    (Measured on the 2-core machine: 1-2 µs a step less, of a folded call's ~13; see emberlink/data.py.)"""

    __slots__ = ("bind_kinds", "entries", "in_specs", "key", "live", "nodes", "replay")

    def __init__(
        self, key: Any, pending: tuple[Any, ...], nodes: list[tuple[int, int]], replay: Replay
    ) -> None:
        self.key = key
        self.entries, self.in_specs, self.bind_kinds, self.live = (list(part) for part in pending)
        self.nodes = nodes
        self.replay = replay

    def matches(self, key: Any, nodes: list[tuple[int, int]], dev: Device) -> bool:
        return (
            nodes == self.nodes
            and key == self.key
            and dev._entries == self.entries
            and dev._in_specs == self.in_specs
            and dev._bind_kinds == self.bind_kinds
            and _live(dev) == self.live
        )


class Jitted(Generic[P, R]):
    """A function compiled with `emberlink.jit`; call it as the function itself."""

    def __init__(self, fn: Callable[P, R], max_signatures: int = MAX_SIGNATURES) -> None:
        if not callable(fn):
            raise TypeError(f"emberlink.jit needs a function, got {type(fn).__name__}")
        if max_signatures < 1:
            raise ValueError(f"max_signatures must be at least 1, got {max_signatures}")
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.max_signatures = max_signatures
        self._entries: dict[tuple[Any, ...], Any] = {}
        self._folded: dict[tuple[Any, ...], Replay | None] = {}  # (key, pending_key) -> folded trace
        self._hot: _Hot | None = None  # reset wherever _entries or _folded lose an entry
        self._static: frozenset[int] = frozenset()
        self._warned = False

    def __repr__(self) -> str:
        return f"emberlink.jit({getattr(self.fn, '__qualname__', self.fn)!r})"

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else types.MethodType(self, obj)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        trace = _tensor.JIT_TRACE
        if trace is not None and trace.thread == threading.get_ident():
            return self.fn(*args, **kwargs)  # called from a function being traced: part of its trace
        key, leaves, dev = _signature(args, kwargs, self._static)
        if dev is not None and dev._entries:  # pending work: maybe folded into this call's graph
            folded = self._fold(key, leaves, dev, args, kwargs)
            if folded is not _UNFOLDED:
                return cast(R, folded)
        entry = self._entries.get(key)
        if type(entry) is Replay:
            result: R = entry.run(leaves)
            return result
        if entry is None:
            if len(self._entries) >= self.max_signatures:
                self._warn_bound()
                return self._eager(dev, args, kwargs)
            self._entries[key] = _WARM
            try:
                return self._eager(dev, args, kwargs)
            except BaseException:
                self._entries.pop(key, None)
                self._hot = None
                raise
        return self._trace(key, leaves, dev, args, kwargs)

    def _fold(self, key: Any, leaves: list[Any], dev: Device, args: Any, kwargs: Any) -> Any:
        """The call with `dev`'s pending segment folded into its graph (replayed, or traced once per
        structure of that segment), or _UNFOLDED: the pending work is then flushed on its own."""
        nodes: list[tuple[int, int]] = []  # (leaf, its pending node): part of the folded key
        for k, x in enumerate(leaves):
            if isinstance(x, Tensor) and x._v.node is not None:
                if x._rg:  # its history is pending work's autograd graph: left to the plain path
                    return _UNFOLDED
                nodes.append((k, x._v.node))
        if not nodes:
            return _UNFOLDED
        hot = self._hot
        if hot is not None and hot.matches(key, nodes, dev):
            replay: Any = hot.replay
        else:
            if self._entries.get(key) is None:  # (a first call runs eagerly, joining the pending work)
                return _UNFOLDED
            pending = pending_key(dev)
            fkey = (key, (pending, tuple(nodes)))
            replay = self._folded.get(fkey, _UNFOLDED)
            if type(replay) is Replay:
                self._hot = _Hot(key, pending, nodes, replay)
        if type(replay) is Replay:
            for _, t, _ in replay.in_caps:
                if t._v.node is not None:  # state it reads is pending work too: flushed first
                    return _UNFOLDED
            return replay.run(leaves, folded=True)
        if replay is None or len(self._folded) >= self.max_signatures:
            return _UNFOLDED  # not foldable, or the bound reached: flushed, then replayed or traced
        return self._trace(key, leaves, dev, args, kwargs, fold=fkey)

    def _warn_bound(self) -> None:
        if self._warned:
            return
        self._warned = True
        why = ""
        if self._static:
            why = (
                f" Scalar arguments {sorted(self._static)} (in flattened order) are used as Python "
                "numbers inside, so each of their values is a signature of its own; pass values "
                "derived from them as arguments instead."
            )
        warnings.warn(
            f"{self!r} has seen more than {self.max_signatures} signatures (argument shapes, dtypes, "
            f"devices, scalar kinds); calls with a new one run eagerly from now on.{why}",
            RuntimeWarning,
            stacklevel=3,
        )

    def _eager(self, dev: Device | None, args: Any, kwargs: Any) -> R:
        with _TRACE_LOCK:
            guard = Trace(dev, eager=True)
            _tensor.JIT_TRACE = guard
            try:
                out = self.fn(*args, **kwargs)
            finally:
                _tensor.JIT_TRACE = None
                guard.live = False
        result: R = _detached(out)
        return result

    def _trace(
        self,
        key: Any,
        leaves: list[Any],
        dev: Device | None,
        args: Any,
        kwargs: Any,
        fold: tuple[Any, Any] | None = None,
    ) -> R:
        """Trace a call (`fold`: its (key, pending_key), the device's pending segment folded in)."""
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        with _TRACE_LOCK:
            trace = Trace(dev, eager=False)
            if dev is not None:
                dev._check_open()
                if fold is not None:
                    trace.fold(dev)  # earlier work is the first part of the trace
                elif dev._entries:
                    dev.flush()  # earlier work runs before the trace, never inside it
            for k, x in enumerate(leaves):
                if isinstance(x, Tensor):
                    if x._v.node is None:
                        trace.arg_bufs.setdefault(x._v.buf, k)  # type: ignore[arg-type]
                    elif fold is not None:
                        trace.pend_args.add(id(x._v))
                    trace.arg_ids[id(x)] = k
                    trace.seen.setdefault(id(x), (x, x._v))
                    if x._rg:
                        trace.arg_grads[k] = (x, x.grad)

            def mark(x: Any) -> Any:
                k = counter[0] - 1
                if isinstance(x, Tensor):
                    return x
                return traced(scalar(x), trace, k)  # type: ignore[arg-type]

            counter = [0]
            margs = _map_leaves(args, mark, counter)
            mkwargs = _map_leaves(kwargs, mark, counter) if kwargs else {}
            _tensor.JIT_TRACE = trace
            try:
                out = self.fn(*margs, **mkwargs)
            except BaseException:
                if fold is None:
                    self._entries.pop(key, None)
                    self._hot = None
                trace.close()
                raise
            finally:
                _tensor.JIT_TRACE = None
            try:
                replay, result = finish(trace, out, name)
            finally:
                trace.close()
            del out, margs, mkwargs
        if not trace.concrete <= self._static:  # scalar arguments that steer Python: keyed by value
            self._static = self._static | frozenset(trace.concrete)
            log.debug("%r: scalar arguments %s are used as Python numbers", self, sorted(self._static))
            self._entries.clear()  # traces keyed without those values could be wrong for others
            self._folded.clear()
            self._hot = None
        if trace.concrete:
            key, _, _ = _signature(args, kwargs, self._static)
        if fold is None:
            self._entries[key] = replay
        else:
            self._entries.setdefault(key, _WARM)
            self._folded[(key, fold[1])] = replay if replay.folded else None
            if not replay.folded:
                log.debug("%r: the pending work cannot be folded into its trace", self)
        out_result: R = result
        return out_result


@overload
def jit(fn: Callable[P, R], *, max_signatures: int = MAX_SIGNATURES) -> Jitted[P, R]: ...


@overload
def jit(
    fn: None = None, *, max_signatures: int = MAX_SIGNATURES
) -> Callable[[Callable[P, R]], Jitted[P, R]]: ...


def jit(fn: Callable[P, R] | None = None, *, max_signatures: int = MAX_SIGNATURES) -> Any:
    """Compile `fn` into a step that is traced once and replayed as one graph (`@emberlink.jit`).

    Call 1 of each input signature runs `fn` eagerly, call 2 traces it, later calls replay the
    trace: the new tensor and scalar arguments are bound, the graph runs, state rebound inside `fn`
    (parameters, optimizer state, `.grad`) is rebound to the new values, and the results come back
    as new tensors without autograd history. A signature is the device, dtype, shape and
    `requires_grad` of each tensor argument, the kind (int or float) of each scalar argument, and
    the value of every other argument (bools, strings, modules, ...: they must be hashable). At most
    `max_signatures` are kept; a call with a new signature past that runs eagerly (warned once).

    Inside `fn`, reading a value (`float(t)`, `t.numpy()`, `t.item()`, `dev.sync()`) raises
    JitError; Python side effects run at calls 1 and 2 only, and at the first call with each new
    kind of pending work folded in (see the module docstring). See README ("Compiled steps").
    """
    if fn is None:
        return lambda f: Jitted(f, max_signatures)
    return Jitted(fn, max_signatures)
