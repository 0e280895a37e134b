"""What one call of an `emberlink.jit` function did, and its replay; no public API here.

The hooks in tensor.py (`apply`, `create`, `Tensor.__init__`, `scalar()`) and device.py (reads,
flushes, the flush by size, the trace's one flush) report to the `Trace` in `tensor.JIT_TRACE`.
`finish` turns a finished trace into a `Replay`: plain lists saying where each input buffer,
binding and output goes, so that a replay is one `executor.execute` and a few assignments.

Where a value comes from at replay (a `Source`): ("out", j) output j of the graph; ("arg", k)
tensor leaf k of the call; ("cap", t) the current value of tensor `t`, which existed before the
trace; ("const", v) a value the trace made and the replay keeps; ("py", obj) a Python object
returned as it was; ("num", k) scalar leaf k of the call.

A folded trace (`Trace.fold`) starts with the device's pending segment still recorded (work
recorded before the call that the call's arguments come from, e.g. the resident DataLoader's
gather): the trace's one segment is that work and then the function's, one graph. Its replay
binds the pending segment of the call (same structure, new buffers and binding values) in place
of a flush, and hands that segment's live values the buffers the graph makes for them.
"""

from __future__ import annotations

import gc
import threading
import types
import warnings
import weakref
from sys import getrefcount
from typing import Any

from emberlink.client import tensor as _tensor
from emberlink.client.device import Device, _Memo
from emberlink.client.executor import Call
from emberlink.client.tensor import Scalar, Tensor, TracedScalar, scalar
from emberlink.client.value import Value
from emberlink.errors import JitError
from emberlink.graph_replay.ir import Graph

RANDOM_OPS = frozenset({"rand", "randn"})


class _Holder:
    __slots__ = ("_v",)

    _v: object


def _references_when_alone() -> int:
    """What `sys.getrefcount` reports in `Replay.run` for a state tensor's Value that nothing but
    the tensor holds (read into a local from its slot): measured, not assumed, so the
    interpreter's counting conventions cancel out (as server/store.py's `_ALONE`)."""
    holder = _Holder()
    holder._v = object()
    old = holder._v
    return getrefcount(old)


_ALONE = _references_when_alone()

# -- scalar arguments while tracing ---------------------------------------------------------------

# Methods that do not turn the number into something the step's Python code can act on.
_NEUTRAL = frozenset({"__repr__", "__format__", "__getattribute__", "__getnewargs__", "__sizeof__"})


class _Traced(TracedScalar):
    _jit_trace: Trace
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


def traced(value: Scalar, trace: Trace, index: int) -> _Traced:
    out: _Traced = _TracedFloat(value) if type(value) is float else _TracedInt(value)
    out._jit_trace, out._jit_index = trace, index
    return out


# -- results ----------------------------------------------------------------------------------------


def flatten_result(x: Any, leaves: list[Any]) -> Any:
    """The structure of a returned value (tuples, lists, dicts), its other leaves appended."""
    t = type(x)
    if t is tuple or t is list:
        return (t, tuple(flatten_result(y, leaves) for y in x))
    if t is dict:
        return (dict, tuple(x), tuple(flatten_result(y, leaves) for y in x.values()))
    leaves.append(x)
    return None


def build_result(tree: Any, leaves: list[Any], pos: list[int]) -> Any:
    if tree is None:
        pos[0] += 1
        return leaves[pos[0] - 1]
    if tree[0] is dict:
        return dict(zip(tree[1], (build_result(s, leaves, pos) for s in tree[2]), strict=True))
    return tree[0](build_result(s, leaves, pos) for s in tree[1])


# -- a trace ------------------------------------------------------------------------------------------

Source = tuple[str, Any]
Spec = tuple[str, tuple[int, ...]]


class Trace:
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
        # A folded trace (`fold`): the pending segment's live values (id -> (entry, Value)), held
        # for the call; how many input buffers and bindings that segment had; the pending values
        # the call's arguments hold (by id); and the other tensors holding a pending value that
        # the function read (by id), which a replay could not find (it binds by position).
        self.pending: dict[int, tuple[int, Value]] = {}
        self.pend_in = 0
        self.pend_bind = 0
        self.pend_args: set[int] = set()
        self.pend_reads: dict[int, Tensor] = {}

    def fold(self, dev: Device) -> None:
        """Start this trace on top of `dev`'s pending segment (recorded before the call), which
        becomes the first part of the trace's graph instead of a graph of its own."""
        for i, ref in enumerate(dev._weak):
            v = ref()
            if v is not None:
                self.pending[id(v)] = (i, v)
        self.pend_in = len(dev._in_bufs)
        self.pend_bind = len(dev._bind_vals)

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
        if dev is not self.dev and isinstance(dev, Device):  # (not placed: recording says so)
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
                pend = v.node is not None and id(v) in self.pending
                self.seen[id(a)] = (a, v if v.node is None or pend else None)
                if pend and id(v) not in self.pend_args:
                    self.pend_reads[id(a)] = a
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
        self.pending.clear()
        self.pend_args.clear()
        self.pend_reads.clear()
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


class Replay:
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
        self.bind_template: tuple[Scalar, ...] = ()  # one tuple, passed as it is when no binding varies
        self.bind_args: list[tuple[int, int]] = []  # (binding, scalar leaf)
        self.keep: list[bool] = []
        self.kept: list[int] = []
        self.made: list[int] = []  # the kept outputs given a new Value before any is rebound
        self.drop: list[int] = []
        self.single_out: int | None = None  # the result is output `single_out` alone
        self.sinks_cap: list[tuple[Tensor, int]] = []  # (tensor, output)
        self.sinks_weak: list[tuple[weakref.ref[Tensor], int]] = []
        self.sinks_other: list[tuple[Source, Source]] = []  # (target, source) of the rare kinds
        # A folded trace's: the pending segment's parts, bound at each replay from the call's own
        # pending segment (same structure): (input slot, its input), (binding, its binding),
        # (its entry, output). `folded` is False where the trace cannot be replayed folded.
        self.folded = False
        self.pend_in: list[tuple[int, int]] = []
        self.pend_bind: list[tuple[int, int]] = []
        self.pend_out: list[tuple[int, int]] = []

    def set_graph(self, trace: Trace) -> None:
        assert trace.captured is not None
        memo, call, values = trace.captured
        self.graph, self.gid = memo.graph, memo.gid
        self.n_out = len(call.outputs)
        self.out_specs = [v.spec for v in values]
        self.keep = [False] * self.n_out
        self.in_template = list(call.inputs)
        in_slots, bind_slots = memo.input_slots, memo.binding_slots
        if trace.pending:
            self.folded = not trace.pend_reads
            for j, v in enumerate(values):
                held = trace.pending.get(id(v))
                if held is not None:
                    self.pend_out.append((held[0], j))
                    self.keep[j] = True
            if len(self.pend_out) != len(trace.pending):
                self.folded = False  # (cannot happen: the trace holds them) replayed unfolded
        for slot, buf in enumerate(call.inputs):
            if trace.pending and (slot if in_slots is None else in_slots[slot]) < trace.pend_in:
                # The pending segment's input: the call's own pending segment says which buffer.
                # If the function reads that buffer too, a replay could not tell the two apart.
                self.pend_in.append((slot, slot if in_slots is None else in_slots[slot]))
                if buf in trace.arg_bufs or buf in trace.bufs:
                    self.folded = False
                continue
            k = trace.arg_bufs.get(buf)
            holder, v = trace.bufs[buf]  # every input was an operand of an op
            if k is not None:
                self.in_args.append((slot, k))
            elif holder is not None:
                self.in_caps.append((slot, holder, v.spec))
            else:
                self.consts.append(v)
        template: list[Scalar] = []
        for j, b in enumerate(call.bindings):
            at = j if bind_slots is None else bind_slots[j]
            if trace.pending and at < trace.pend_bind:
                self.pend_bind.append((j, at))
                template.append(b)
            elif isinstance(b, _Traced):
                self.bind_args.append((j, b._jit_index))
                template.append(b.plain())
            else:
                template.append(b)
        self.bind_template = tuple(template)

    def constant_seed(self) -> bool:
        """Whether a random op takes its seed from a constant binding (the same numbers every replay)."""
        graph = self.graph
        if graph is None:
            return False
        first, last = len(graph.inputs), len(graph.inputs) + len(graph.bindings)
        named = {first + j for j, _ in (*self.bind_args, *self.pend_bind)}
        return any(
            n.op in RANDOM_OPS and first <= i < last and i not in named for n in graph.nodes for i in n.inputs
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
        pend = {j for _, j in self.pend_out}  # the pending values themselves get these buffers
        self.kept = [j for j in range(self.n_out) if self.keep[j] and j not in pend]
        # Outputs only state tensors take (the parameters a step updates): made as they are
        # rebound (`run`), where the state's own Value may take the buffer.
        state = {j for _, j in self.sinks_cap}
        needed = {s[1] for s in self.returns if s[0] == "out"}
        needed |= {j for _, j in self.sinks_weak}
        needed |= {src[1] for _, src in self.sinks_other if src[0] == "out"}
        self.made = [j for j in self.kept if j not in state or j in needed]
        self.drop = [j for j in range(self.n_out) if not self.keep[j]]
        only = self.returns[0] if len(self.returns) == 1 else None
        self.single_out = only[1] if self.tree is None and only is not None and only[0] == "out" else None

    def run(self, leaves: list[Any], folded: bool = False) -> Any:
        """One replay: bind this call's arguments, run the graph, rebind state, build the result.
        `folded`: a folded trace's replay, in place of the device's pending segment (which has the
        structure the trace had: the caller checked)."""
        dev = self.dev
        if dev is None:  # nothing on a device: the result is made of arguments and constants
            return self.result(leaves, [], None)
        if dev._closed:
            dev._check_open()
        if folded:
            seg_in, seg_bind, seg_weak = dev._in_bufs, dev._bind_vals, dev._weak
        elif dev._entries:  # earlier work goes first (and pending arguments get their buffers)
            dev.flush()
        ins: list[Any] = self.in_template.copy()
        if folded:
            for slot, at in self.pend_in:
                ins[slot] = seg_in[at]
        for slot, k in self.in_args:
            ins[slot] = leaves[k]._v.buf
        v: Value | None  # (one name for the Values held below: rebinding it lets the last go)
        for slot, t, spec in self.in_caps:
            v = t._v
            if v.dev is not dev or (v.spec is not spec and v.spec != spec):
                raise JitError(
                    f"emberlink.jit: a tensor the function reads is now {v.spec[0]}{list(v.spec[1])} on "
                    f"{v.dev} but was {spec[0]}{list(spec[1])} on {dev} when traced; state moved to "
                    "another shape, dtype or device needs a new jitted function"
                )
            ins[slot] = v.buf
        binds = self.bind_template  # the same tuple each call: the executor may reuse what it made of it
        if self.bind_args:
            bound: list[Any] = list(binds)
            for j, k in self.bind_args:
                bound[j] = scalar(leaves[k])
            binds = tuple(bound)
        if folded and self.pend_bind:
            bound = list(binds)
            for j, b in self.pend_bind:
                bound[j] = seg_bind[b]
            binds = tuple(bound)
        # Values that come from arguments or captured state are read before anything is rebound.
        early = [_read_source(s, leaves) for s in self.returns] if self.early else None
        other = [_read_source(s, leaves) for _, s in self.sinks_other] if self.sinks_other else None
        vals: list[Value | None] = []
        graph = self.graph
        if folded:  # the pending segment is this graph's now, as a flush would take it
            dev._nodes_recorded += len(dev._entries)
            dev._new_segment()
        if graph is not None:
            n = self.n_out
            base = dev._next_buf
            dev._next_buf = base + n
            dev._executor.execute(graph, self.gid, Call(tuple(ins), binds, tuple(range(base, base + n))))
            specs = self.out_specs
            vals = [None] * n
            for j in self.made:
                vals[j] = Value(dev, base + j, None, specs[j])
            if folded:
                for i, j in self.pend_out:  # pending values get their buffers, as a flush gives them
                    pv = seg_weak[i]()
                    if pv is None:
                        dev._dropped.append(base + j)
                    else:
                        pv.node = None
                        pv.buf = base + j
                        vals[j] = pv
            for t, j in self.sinks_cap:
                v = vals[j]  # (also lets go of the last Value the loops above held)
                if v is None:  # an output only state takes: its last Value, if only it holds that
                    old = t._v
                    if (
                        type(old) is Value
                        and old.dev is dev
                        and old.buf is not None
                        and getrefcount(old) == _ALONE
                    ):
                        # The Value takes the new buffer, and its old one is dropped as its
                        # __del__ would drop it here: no Value made and none let go a state tensor
                        # (the small MLP's SGD step, 6 of them: its replay over an executor that
                        # runs nothing, `bench/remote_step.py --loader-client 5`, two runs each,
                        # 5.3-5.4 -> 4.9-5.0 µs a step on batches uploaded beforehand).
                        dev._dropped.append(old.buf)
                        old.buf = base + j
                        old.spec = specs[j]
                        vals[j] = old
                        continue
                    v = vals[j] = Value(dev, base + j, None, specs[j])
                t._v = v
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
        return build_result(self.tree, out, [0])


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


def finish(trace: Trace, result: Any, name: str) -> tuple[Replay, Any]:
    """Flush the trace's one segment; work out where each input comes from and each output goes.
    Returns the replay and this call's own result."""
    leaves: list[Any] = []
    tree = flatten_result(result, leaves)
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
    replay = Replay(dev, tree, [])
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
        _sink_unseen(replay, trace.captured[2], sunk | {id(x) for x in kept} | set(trace.pending))
        _check_not_replaced(replay, trace, name)
    replay.done()
    return replay, build_result(tree, now, [0])


def _sink_argument_grads(replay: Replay, trace: Trace, out_of: dict[int, int], name: str) -> set[int]:
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


def _check_not_replaced(replay: Replay, trace: Trace, name: str) -> None:
    """Refuse a trace that reads a tensor nothing but the trace holds any more: the function replaced
    it by a new Tensor object (`self.ema = self.ema * 0.9 + x`), and every replay would read the old one."""
    caps = {id(t): t for _, t, _ in replay.in_caps}
    caps.update(trace.pend_reads)  # (a folded trace's: read pending, then replaced, alike)
    if not caps:
        return
    ours = {id(x) for x in (*trace.seen.values(), *trace.bufs.values(), *replay.in_caps)}
    ours |= {id(trace.seen), id(trace.bufs), id(replay.in_caps), id(caps), id(trace.pend_reads)}
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


def _sink_unseen(replay: Replay, values: list[Value], known: set[int]) -> None:
    """Outputs no known tensor holds: find the tensors that do (state rebound but never read)."""
    lost = [v for v in values if id(v) not in known]
    if not lost:
        return
    index = {id(v): j for j, v in enumerate(values)}
    for r in gc.get_referrers(*lost):
        if isinstance(r, Tensor) and id(r._v) in index and id(r._v) not in known:
            replay.add_sink(("cap", r), ("out", index[id(r._v)]))
