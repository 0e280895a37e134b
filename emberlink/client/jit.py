"""`emberlink.jit`: run a step eagerly once, trace it once, then replay its graph; never reads data.

Per input signature (the devices, dtypes, shapes and `requires_grad` of the tensor arguments, the
kinds of the scalar arguments, the values of every other argument), call 1 runs the function
eagerly (optimizer state such as Adam's moments is made then, as tinygrad's TinyJit does), call 2
traces it, and every later call replays that trace: it binds the new arguments and hands the
device's executor one `(graph, gid, Call)`, with no recording, no segment building and no
canonical form (on a remote device: one Execute, which the session sends as a Repeat of the
previous step's batch). At most `max_signatures` signatures are kept per function; a new one
beyond that runs eagerly, with a warning the first time.

A trace records what the function touched, through two hooks in tensor.py (`apply`,
`Tensor.__init__`) and three in device.py (reads and flushes refused, the flush by size held
back, the trace's one flush handed to `_Trace.capture`):
- inputs: each buffer the step reads is an argument, a tensor that existed before the call
  (captured: held by the jit, its *current* value read at every replay), or a constant of the
  trace (a tensor uploaded inside the function);
- bindings: a scalar argument is passed in as a `_TracedFloat` / `_TracedInt` that stays a binding
  the trace can name; every other Python number is a constant of the trace. A scalar argument that
  the function also uses as a Python number (arithmetic, comparisons, `int()`, ...) would be baked
  in, so that argument's value becomes part of the signature from then on ("specialized");
- outputs: the returned tensors, the tensors that existed before the call and were rebound during
  it (`t._v = new._v`, as optimizers do), and the tensors made during it that are still alive
  (e.g. `p.grad`, held weakly). A replay rebinds the same Tensor objects to its new buffers.

Not thread-safe per device, like a Device. Traces of different threads are serialized by a lock.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Generic, ParamSpec, TypeVar, overload

import numpy as np

from emberlink.client import tensor as _tensor
from emberlink.client.device import Device, Value, _Memo
from emberlink.client.executor import Call
from emberlink.client.tensor import Scalar, Tensor, TracedScalar, scalar
from emberlink.errors import JitError
from emberlink.graph_replay.ir import Graph

log = logging.getLogger("emberlink.jit")

P = ParamSpec("P")
R = TypeVar("R")

MAX_SIGNATURES = 8
"""Signatures a jitted function keeps a trace for (torch.compile's default cache size limit)."""

_RANDOM_OPS = frozenset({"rand", "randn"})
_TRACE_LOCK = threading.Lock()

# -- scalar arguments while tracing ---------------------------------------------------------------

# Methods that do not turn the number into something the step's Python code can act on.
_NEUTRAL = frozenset({"__repr__", "__format__", "__getattribute__", "__getnewargs__", "__sizeof__"})


class _Traced(TracedScalar):
    _jit_trace: _Trace
    _jit_index: int

    def binding(self) -> Scalar:
        trace = self._jit_trace
        if trace.live and trace.thread == threading.get_ident():
            return self  # type: ignore[return-value]
        return self.plain()

    def plain(self) -> Scalar:
        raise NotImplementedError

    def _used(self) -> None:
        trace = self._jit_trace
        if trace.live and trace.thread == threading.get_ident():
            trace.concrete.add(self._jit_index)


class _TracedFloat(_Traced, float):
    kind = "float"

    def plain(self) -> float:
        return float.__float__(self)


class _TracedInt(_Traced, int):
    kind = "int"

    def plain(self) -> int:
        return int.__index__(self)


def _watch(cls: type, base: type) -> None:
    """Make every numeric method of `cls` report that the value was used as a Python number."""

    def watched(name: str, method: Any) -> Any:
        def fn(self: _Traced, *args: Any) -> Any:
            result = method(self, *args)
            if result is not NotImplemented:  # `lr * tensor` falls through to the Tensor: a binding
                self._used()
            return result

        fn.__name__ = fn.__qualname__ = name
        return fn

    for name, attr in vars(base).items():
        if name not in _NEUTRAL and isinstance(
            attr, types.WrapperDescriptorType | types.MethodDescriptorType
        ):
            setattr(cls, name, watched(name, attr))


_watch(_TracedFloat, float)
_watch(_TracedInt, int)
# Device._record names a binding's kind by its type's name.
_TracedFloat.__name__, _TracedInt.__name__ = "float", "int"


def _traced(value: Scalar, trace: _Trace, index: int) -> _Traced:
    out: _Traced = _TracedFloat(value) if type(value) is float else _TracedInt(value)
    out._jit_trace, out._jit_index = trace, index
    return out


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
        n_tensors = 0
        for x in args:
            t = type(x)
            if t is Tensor:
                v = x._v
                if dev is None:
                    dev = v.dev
                elif v.dev is not dev:
                    break
                key.append((dev, v.spec, x._rg and (1 if x.grad is None else 2)))
                n_tensors += 1
            elif t is float:
                key.append(_FLOAT)
            elif t is int:
                key.append(_INT)
            else:
                break
        else:
            if n_tensors < 2 and (dev is None or isinstance(dev, Device)):
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


# -- results ----------------------------------------------------------------------------------------


def _flatten_result(x: Any, leaves: list[Any]) -> Any:
    """The structure of a returned value (tuples, lists, dicts), its other leaves appended."""
    t = type(x)
    if t is tuple or t is list:
        return (t, tuple(_flatten_result(y, leaves) for y in x))
    if t is dict:
        return (dict, tuple(x), tuple(_flatten_result(y, leaves) for y in x.values()))
    leaves.append(x)
    return None


def _build_result(tree: Any, leaves: list[Any], pos: list[int]) -> Any:
    if tree is None:
        pos[0] += 1
        return leaves[pos[0] - 1]
    if tree[0] is dict:
        return dict(zip(tree[1], (_build_result(s, leaves, pos) for s in tree[2]), strict=True))
    return tree[0](_build_result(s, leaves, pos) for s in tree[1])


def _detached(result: Any) -> Any:
    """The result with every tensor replaced by a history-free one (a jitted function's outputs)."""
    leaves: list[Any] = []
    tree = _flatten_result(result, leaves)
    out = [Tensor(x._v) if isinstance(x, Tensor) else x for x in leaves]
    return _build_result(tree, out, [0])


# -- a trace ------------------------------------------------------------------------------------------

# Where a value comes from at replay: ("out", j) output j of the graph; ("arg", k) tensor leaf k of
# the call; ("cap", t) the current value of a tensor that existed before the trace; ("const", v) a
# value the trace made and the jit keeps; ("py", obj) a Python object returned as it was; ("num", k)
# scalar leaf k of the call.
Source = tuple[str, Any]
Spec = tuple[str, tuple[int, ...]]


class _Trace:
    """What one call of a jitted function did (the hooks in tensor.py and device.py report here).

    `eager` (call 1, and calls past the bound): reads are refused, nothing is captured.
    """

    def __init__(self, dev: Device | None, *, eager: bool) -> None:
        self.thread = threading.get_ident()
        self.eager = eager
        self.live = True
        self.dev = dev
        self.arg_bufs: dict[int, int] = {}  # buffer -> tensor leaf index
        self.arg_ids: dict[int, int] = {}  # id(tensor) -> leaf index
        self.arg_grads: dict[int, tuple[Tensor, Tensor | None]] = {}  # leaf -> (tensor, .grad before)
        self.seen: dict[int, tuple[Tensor, Value | None]] = {}  # pre-existing tensor -> first value
        self.bufs: dict[int, tuple[Tensor | None, Value]] = {}  # buffer read -> a pre-existing holder
        self.made_ids: set[int] = set()
        self.made: list[weakref.ref[Tensor]] = []
        self.concrete: set[int] = set()  # scalar leaves used as Python numbers
        self.captured: tuple[_Memo, Call, list[Value]] | None = None

    # -- hooks (tensor.py, device.py) -----------------------------------------------------------------

    def holds_this_thread(self) -> bool:
        return self.thread == threading.get_ident()

    def refuse(self, dev: Device, what: str) -> None:
        if self.thread != threading.get_ident():
            return
        raise JitError(
            f"a {what} of a tensor on {dev} inside a function compiled with emberlink.jit: a replayed "
            "call runs no Python, so nothing inside may depend on a tensor's value. Return the "
            "tensor and read it after the call (float(loss), t.numpy(), ...)"
        )

    def operands(self, dev: Device, args: Any) -> None:
        if self.thread != threading.get_ident():
            return
        if dev is not self.dev:
            self._bind(dev)
        if self.eager:
            return
        made = self.made_ids
        for a in args:
            if not isinstance(a, Tensor):
                continue
            v = a._v
            pre = id(a) not in made
            if pre and id(a) not in self.seen:
                self.seen[id(a)] = (a, v if v.node is None else None)
            if v.node is None:
                buf: int = v.buf  # type: ignore[assignment]
                held = self.bufs.get(buf)
                if held is None or (held[0] is None and pre):
                    self.bufs[buf] = (a if pre else None, v)

    def created(self, t: Tensor) -> None:
        if self.thread != threading.get_ident():
            return
        dev = t._v.dev
        if isinstance(dev, Device) and dev is not self.dev:
            self._bind(dev)
        if not self.eager:
            self.made_ids.add(id(t))
            self.made.append(weakref.ref(t))

    def _bind(self, dev: Device) -> None:
        if self.dev is None:
            self.dev = dev
            if not self.eager and dev._entries:  # work from before the call runs before the trace
                _tensor.JIT_TRACE = None
                try:
                    dev.flush()
                finally:
                    _tensor.JIT_TRACE = self
            return
        raise JitError(
            f"a function compiled with emberlink.jit used tensors on {self.dev} and on {dev}; it must "
            "run on one device (move data explicitly outside it)"
        )

    def close(self) -> None:
        """Forget everything: a traced scalar that outlives the call (e.g. `opt.lr`) keeps the trace."""
        self.live = False
        self.seen.clear()
        self.bufs.clear()
        self.made.clear()
        self.made_ids.clear()
        self.arg_bufs.clear()
        self.arg_ids.clear()
        self.arg_grads.clear()
        self.captured = None

    def capture(self, memo: _Memo, call: Call, values: list[Value]) -> Call:
        """The trace's own flush (Device._send_segment): keep the graph, un-mark the bindings."""
        self.captured = (memo, call, values)
        bindings = tuple(b.plain() if isinstance(b, _Traced) else b for b in call.bindings)
        return Call(call.inputs, bindings, call.outputs)

    # -- after the call -------------------------------------------------------------------------------

    def source(self, v: Value, out_of: dict[int, int]) -> Source:
        """Where a replay finds the value that `v` is in this trace."""
        j = out_of.get(id(v))
        if j is not None:
            return ("out", j)
        if v.dev is not self.dev or v.buf is None:
            raise JitError(f"emberlink.jit: a result or state tensor is on {v.dev}, not on {self.dev}")
        k = self.arg_bufs.get(v.buf)
        if k is not None:
            return ("arg", k)
        held = self.bufs.get(v.buf)
        if held is not None and held[0] is not None:
            return ("cap", held[0])
        return ("const", v)


class _Replay:
    """A finished trace, resolved into the plain lists a replay walks."""

    def __init__(self, dev: Device | None, tree: Any, returns: list[Source]) -> None:
        self.dev = dev
        self.tree = tree
        self.returns = returns
        self.early = any(s[0] in ("arg", "cap", "const") for s in returns)
        self.graph: Graph | None = None
        self.gid = b""
        self.n_out = 0
        self.out_specs: list[Spec] = []
        self.in_template: list[int] = []
        self.in_args: list[tuple[int, int]] = []  # (input slot, tensor leaf)
        self.in_caps: list[tuple[int, Tensor, Spec]] = []  # (input slot, tensor, spec when traced)
        self.consts: list[Value] = []  # held so their buffers live as long as the trace
        self.bind_template: list[Scalar] = []
        self.bind_args: list[tuple[int, int]] = []  # (binding, scalar leaf)
        self.keep: list[bool] = []
        self.kept: list[int] = []
        self.drop: list[int] = []
        self.single_out: int | None = None  # the result is output `single_out` alone
        self.sinks_cap: list[tuple[Tensor, int]] = []  # (tensor, output)
        self.sinks_weak: list[tuple[weakref.ref[Tensor], int]] = []
        self.sinks_other: list[tuple[Source, Source]] = []  # (target, source) of the rare kinds

    def set_graph(self, trace: _Trace) -> None:
        assert trace.captured is not None
        memo, call, values = trace.captured
        self.graph, self.gid = memo.graph, memo.gid
        self.n_out = len(call.outputs)
        self.out_specs = [v.spec for v in values]
        self.keep = [False] * self.n_out
        self.in_template = list(call.inputs)
        for slot, buf in enumerate(call.inputs):
            k = trace.arg_bufs.get(buf)
            holder, v = trace.bufs[buf]  # every input was an operand of an op
            if k is not None:
                self.in_args.append((slot, k))
            elif holder is not None:
                self.in_caps.append((slot, holder, v.spec))
            else:
                self.consts.append(v)
        for j, b in enumerate(call.bindings):
            if isinstance(b, _Traced):
                self.bind_args.append((j, b._jit_index))
                self.bind_template.append(b.plain())
            else:
                self.bind_template.append(b)

    def constant_seed(self) -> bool:
        """Whether a random op takes its seed from a constant binding (the same numbers every replay)."""
        graph = self.graph
        if graph is None:
            return False
        first, last = len(graph.inputs), len(graph.inputs) + len(graph.bindings)
        named = {first + j for j, _ in self.bind_args}
        return any(
            n.op in _RANDOM_OPS and first <= i < last and i not in named
            for n in graph.nodes
            for i in n.inputs
        )

    def add_sink(self, target: Source, src: Source) -> None:
        if src[0] == "out":
            self.keep[src[1]] = True
            if target[0] == "cap":
                self.sinks_cap.append((target[1], src[1]))
                return
            if target[0] == "weak":
                self.sinks_weak.append((target[1], src[1]))
                return
        self.sinks_other.append((target, src))

    def done(self) -> None:
        for s in self.returns:
            if s[0] == "out":
                self.keep[s[1]] = True
        self.kept = [j for j in range(self.n_out) if self.keep[j]]
        self.drop = [j for j in range(self.n_out) if not self.keep[j]]
        only = self.returns[0] if len(self.returns) == 1 else None
        self.single_out = only[1] if self.tree is None and only is not None and only[0] == "out" else None

    def run(self, leaves: list[Any]) -> Any:
        """One replay: bind this call's arguments, run the graph, rebind state, build the result."""
        dev = self.dev
        if dev is None:  # nothing on a device: the result is made of arguments and constants
            return self.result(leaves, [], None)
        if dev._closed:
            dev._check_open()
        if dev._entries:  # earlier work goes first (and pending arguments get their buffers)
            dev.flush()
        ins: list[Any] = self.in_template.copy()
        for slot, k in self.in_args:
            ins[slot] = leaves[k]._v.buf
        for slot, t, spec in self.in_caps:
            v = t._v
            if v.dev is not dev or (v.spec is not spec and v.spec != spec):
                raise JitError(
                    f"emberlink.jit: a tensor the function reads is now {v.spec[0]}{list(v.spec[1])} on "
                    f"{v.dev} but was {spec[0]}{list(spec[1])} on {dev} when traced; state moved to "
                    "another shape, dtype or device needs a new jitted function"
                )
            ins[slot] = v.buf
        binds: list[Any] = self.bind_template
        if self.bind_args:
            binds = binds.copy()
            for j, k in self.bind_args:
                binds[j] = scalar(leaves[k])
        # Values that come from arguments or captured state are read before anything is rebound.
        early = [_read_source(s, leaves) for s in self.returns] if self.early else None
        other = [_read_source(s, leaves) for _, s in self.sinks_other] if self.sinks_other else None
        vals: list[Value | None] = []
        graph = self.graph
        if graph is not None:
            n = self.n_out
            base = dev._next_buf
            dev._next_buf = base + n
            dev._executor.execute(
                graph, self.gid, Call(tuple(ins), tuple(binds), tuple(range(base, base + n)))
            )
            specs = self.out_specs
            vals = [None] * n
            for j in self.kept:
                vals[j] = Value(dev, base + j, None, specs[j])
            for t, j in self.sinks_cap:
                t._v = vals[j]  # type: ignore[assignment]
            for ref, j in self.sinks_weak:
                w = ref()
                if w is not None:
                    w._v = vals[j]  # type: ignore[assignment]
            if self.drop:
                dev._dropped += [base + j for j in self.drop]
        if other is not None:
            for (target, s), read in zip(self.sinks_other, other, strict=True):
                _assign(target, vals[s[1]] if read is None else read, leaves)
        dev._jit_replays += 1
        if dev._dropped:
            dev._send_drops()
        if self.single_out is not None:
            return Tensor(vals[self.single_out])  # type: ignore[arg-type]
        return self.result(leaves, vals, early)

    def result(self, leaves: list[Any], vals: list[Value | None], early: list[Any] | None) -> Any:
        out: list[Any] = []
        for i, (kind, x) in enumerate(self.returns):
            if kind == "out":
                out.append(Tensor(vals[x]))  # type: ignore[arg-type]
            elif kind == "py":
                out.append(x)
            elif kind == "num":
                out.append(leaves[x])
            else:
                now = early[i] if early is not None else _read_source((kind, x), leaves)
                out.append(Tensor(now))  # type: ignore[arg-type]  # a tensor source
        if self.tree is None:
            return out[0]
        return _build_result(self.tree, out, [0])


def _read_source(src: Source, leaves: list[Any]) -> Value | None:
    """The value a non-output source holds now (None for an output, a number or a Python object)."""
    kind, x = src
    v: Value | None = None
    if kind == "arg":
        v = leaves[x]._v
    elif kind == "cap":
        v = x._v
    elif kind == "const":
        v = x
    return v


def _assign(target: Source, v: Value | None, leaves: list[Any]) -> None:
    kind, x = target
    if kind == "arg":
        leaves[x]._v = v
    elif kind == "arg_grad":  # the call's tensor argument gets a new .grad, as backward gives it
        leaves[x].grad = Tensor(v)  # type: ignore[arg-type]
    elif kind == "cap":
        x._v = v
    else:
        t = x()
        if t is not None:
            t._v = v


def _finish(trace: _Trace, result: Any, name: str) -> tuple[_Replay, Any]:
    """Flush the trace's one segment; work out where each input comes from and each output goes.
    Returns the replay and this call's own result."""
    leaves: list[Any] = []
    tree = _flatten_result(result, leaves)
    del result
    # Keep the returned Values, not the Tensors: a Tensor object still alive after this is state.
    kept: list[Any] = [x._v if isinstance(x, Tensor) else x for x in leaves]
    is_tensor = [isinstance(x, Tensor) for x in leaves]
    del leaves
    dev = trace.dev
    if dev is not None and dev._entries:
        dev._jit_sink = trace.capture
        try:
            dev.flush()
        finally:
            dev._jit_sink = None
    replay = _Replay(dev, tree, [])
    out_of: dict[int, int] = {}  # id(Value) -> output index
    if trace.captured is not None:
        replay.set_graph(trace)
        out_of = {id(v): j for j, v in enumerate(trace.captured[2])}
        if replay.constant_seed():
            warnings.warn(
                f"emberlink.jit({name}): a random op inside has a constant seed, so every replayed "
                "call draws the same numbers (nn.Dropout counts its calls in Python, which a replay "
                "does not run); pass the seed as an argument, e.g. nn.functional.dropout(x, p, seed=seed)",
                RuntimeWarning,
                stacklevel=4,
            )
    now: list[Any] = []
    for x, is_t in zip(kept, is_tensor, strict=True):
        if is_t:
            replay.returns.append(trace.source(x, out_of))
            now.append(Tensor(x))
        elif isinstance(x, _Traced) and x._jit_trace is trace:
            replay.returns.append(("num", x._jit_index))
            now.append(x.plain())
        else:
            replay.returns.append(("py", x))
            now.append(x)
    replay.early = any(s[0] in ("arg", "cap", "const") for s in replay.returns)
    sunk: set[int] = set()
    arg_grads = _sink_argument_grads(replay, trace, out_of, name)
    for t, first in trace.seen.values():  # state rebound in place during the call
        if t._v is not first:
            k = trace.arg_ids.get(id(t))
            replay.add_sink(("arg", k) if k is not None else ("cap", t), trace.source(t._v, out_of))
            sunk.add(id(t._v))
    for ref in trace.made:  # tensors made during the call that something still holds
        c = ref()
        if c is not None and isinstance(c._v, Value) and c._v.dev is dev and id(c) not in arg_grads:
            src = trace.source(c._v, out_of)
            if src[0] != "const":
                replay.add_sink(("weak", ref), src)
                sunk.add(id(c._v))
    if trace.captured is not None:
        _sink_unseen(replay, trace.captured[2], sunk | {id(x) for x in kept})
        _check_not_replaced(replay, trace, name)
    replay.done()
    return replay, _build_result(tree, now, [0])


def _sink_argument_grads(replay: _Replay, trace: _Trace, out_of: dict[int, int], name: str) -> set[int]:
    """A tensor argument's new `.grad` goes to that argument of each call (not to the traced call's
    tensor); accumulating into a `.grad` it had before cannot follow the argument, so it is refused.
    Returns the ids of those gradient tensors."""
    grads: set[int] = set()
    for k, (x, before) in trace.arg_grads.items():
        g = x.grad
        if before is not None and id(before) in trace.seen:
            raise JitError(
                f"emberlink.jit({name}): backward() added into the .grad of tensor argument {k}, "
                "which a replay cannot do for another call's tensor; set its .grad to None before "
                "the call, or use the tensor from the enclosing scope instead of passing it in"
            )
        if g is not None and g is not before:
            replay.add_sink(("arg_grad", k), trace.source(g._v, out_of))
            grads.add(id(g))
    return grads


def _check_not_replaced(replay: _Replay, trace: _Trace, name: str) -> None:
    """Refuse a trace that reads a tensor nothing but the trace holds any more: the function replaced
    it by a new Tensor object (`self.ema = self.ema * 0.9 + x`), and every replay would read the old one."""
    caps = {id(t): t for _, t, _ in replay.in_caps}
    if not caps:
        return
    ours = {id(x) for x in (*trace.seen.values(), *trace.bufs.values(), *replay.in_caps)}
    ours |= {id(trace.seen), id(trace.bufs), id(replay.in_caps), id(caps)}
    held: set[int] = set()
    for r in gc.get_referrers(*caps.values()):
        if id(r) not in ours:
            held.update(id(x) for x in gc.get_referents(r) if id(x) in caps)
    lost = [t for k, t in caps.items() if k not in held]
    if lost:
        t = lost[0]
        raise JitError(
            f"emberlink.jit({name}): the function reads a {t.dtype}{list(t.shape)} tensor that nothing "
            "holds after the call: it was replaced by a new Tensor object (e.g. `self.ema = self.ema * "
            "0.9 + x`), and every replay would read the old one. Update it in place, as the "
            "optimizers do (`t._v = new._v`)"
        )


def _sink_unseen(replay: _Replay, values: list[Value], known: set[int]) -> None:
    """Outputs no known tensor holds: find the tensors that do (state rebound but never read)."""
    lost = [v for v in values if id(v) not in known]
    if not lost:
        return
    index = {id(v): j for j, v in enumerate(values)}
    for r in gc.get_referrers(*lost):
        if isinstance(r, Tensor) and id(r._v) in index and id(r._v) not in known:
            replay.add_sink(("cap", r), ("out", index[id(r._v)]))


# -- the public wrapper -----------------------------------------------------------------------------------

_WARM = object()
"""A signature seen once (run eagerly): its next call traces."""


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
        entry = self._entries.get(key)
        if type(entry) is _Replay:
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
                raise
        return self._trace(key, leaves, dev, args, kwargs)

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
            guard = _Trace(dev, eager=True)
            _tensor.JIT_TRACE = guard
            try:
                out = self.fn(*args, **kwargs)
            finally:
                _tensor.JIT_TRACE = None
                guard.live = False
        result: R = _detached(out)
        return result

    def _trace(self, key: Any, leaves: list[Any], dev: Device | None, args: Any, kwargs: Any) -> R:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        with _TRACE_LOCK:
            if dev is not None:
                dev._check_open()
                if dev._entries:
                    dev.flush()  # earlier work runs before the trace, never inside it
            trace = _Trace(dev, eager=False)
            for k, x in enumerate(leaves):
                if isinstance(x, Tensor):
                    trace.arg_bufs.setdefault(x._v.buf, k)  # type: ignore[arg-type]
                    trace.arg_ids[id(x)] = k
                    trace.seen.setdefault(id(x), (x, x._v))
                    if x._rg:
                        trace.arg_grads[k] = (x, x.grad)

            def mark(x: Any) -> Any:
                k = counter[0] - 1
                if isinstance(x, Tensor):
                    return x
                return _traced(scalar(x), trace, k)  # type: ignore[arg-type]

            counter = [0]
            margs = _map_leaves(args, mark, counter)
            mkwargs = _map_leaves(kwargs, mark, counter) if kwargs else {}
            _tensor.JIT_TRACE = trace
            try:
                out = self.fn(*margs, **mkwargs)
            except BaseException:
                self._entries.pop(key, None)
                trace.close()
                raise
            finally:
                _tensor.JIT_TRACE = None
            try:
                replay, result = _finish(trace, out, name)
            finally:
                trace.close()
            del out, margs, mkwargs
        if not trace.concrete <= self._static:  # scalar arguments that steer Python: keyed by value
            self._static = self._static | frozenset(trace.concrete)
            log.debug("%r: scalar arguments %s are used as Python numbers", self, sorted(self._static))
            self._entries.clear()  # traces keyed without those values could be wrong for others
        if trace.concrete:
            key, _, _ = _signature(args, kwargs, self._static)
        self._entries[key] = replay
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
    JitError; Python side effects run at calls 1 and 2 only. See README ("Compiled steps").
    """
    if fn is None:
        return lambda f: Jitted(f, max_signatures)
    return Jitted(fn, max_signatures)
