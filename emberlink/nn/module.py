"""Module and Parameter: named, nested containers of parameters and buffers that move between
devices; no math."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Self

import numpy as np

from emberlink.client.device import Device
from emberlink.client.tensor import Tensor
from emberlink.client.value import HostValue
from emberlink.errors import DTypeError, ShapeError
from emberlink.protocol.dtypes import FLOAT_DTYPES


class Parameter(Tensor):
    """A leaf tensor a Module owns and an optimizer updates.

    Made from a NumPy array it lives in host memory until `Module.to(device)` (or `Parameter.to_`)
    places it; made from a Tensor it shares that tensor's value and device. As in PyTorch,
    `requires_grad=False` makes a frozen parameter (it may then be an int, e.g. a quantized
    weight): it is still listed by `parameters()`, gets no gradient, and optimizers skip it.
    """

    __slots__ = ()

    def __init__(self, data: np.ndarray | Tensor, requires_grad: bool = True) -> None:
        if isinstance(data, Tensor):
            super().__init__(data._v)
        else:
            super().__init__(HostValue(np.array(data, order="C", copy=True)))
        if requires_grad and self.dtype not in FLOAT_DTYPES:
            raise DTypeError(f"a Parameter that requires grad must be float, got {self.dtype}")
        self._rg = bool(requires_grad)

    def to_(self, device: Device) -> Parameter:
        """Move this parameter (and its grad) to `device` in place; the object stays the same."""
        if self._v.dev is not device:
            self._v = device.tensor(self.numpy())._v
            if self.grad is not None:
                self.grad = self.grad.to(device)
        return self

    def assign(self, array: np.ndarray | Tensor) -> None:
        """Replace the data with a copy of `array` (same shape; cast to this parameter's dtype).

        A Tensor on this parameter's device is taken as it is, without a round trip (tensors are
        immutable, so sharing its value is safe): `model.load_state_dict(el.load(path, device=dev))`.
        """
        assign(self, array)

    def __repr__(self) -> str:
        return "Parameter" + super().__repr__().removeprefix("Tensor")


def assign(t: Tensor, array: np.ndarray | Tensor) -> None:
    """Replace `t`'s data in place (the object stays the same) with `array`, cast to `t`'s dtype;
    shapes must match. `t` keeps its place: on its device, or in host memory if unplaced."""
    dev = t._v.dev
    on_dev = isinstance(dev, Device) and isinstance(array, Tensor) and array.device is dev
    a = array if on_dev else np.asarray(array)
    if a.shape != t.shape:
        raise ShapeError(f"cannot assign shape {a.shape} to a tensor of shape {t.shape}")
    if isinstance(a, Tensor):
        t._v = a.astype(t.dtype)._v
    elif isinstance(dev, Device):
        t._v = dev.tensor(a, dtype=t.dtype)._v
    else:
        t._v = HostValue(np.array(a, dtype=t.dtype, order="C", copy=True))


def _move(t: Tensor, device: Device) -> None:
    """Move `t` to `device` in place."""
    if t._v.dev is not device:
        t._v = device.tensor(t.numpy())._v


class Module:
    """Base class of layers and models: assign Parameters and Modules as attributes in __init__,
    write `forward`, and call the module. Parameters are found by attribute name, in order.

    Buffers (`register_buffer`) are tensors a module keeps that are not parameters: batch norm's
    running statistics. They are in `state_dict()` (unless registered with `persistent=False`),
    move with `.to()`, take no gradient and are not in `parameters()`. A layer that updates a
    buffer rebinds the same Tensor object to the new value (`buf._v = new._v`), as optimizers
    update parameters, so whoever holds the buffer (an optimizer, `emberlink.jit`) sees the update.
    """

    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "training", True)

    def __setattr__(self, name: str, value: Any) -> None:
        params: dict[str, Parameter] | None = self.__dict__.get("_parameters")
        if params is None:
            raise AttributeError(f"{type(self).__name__}.__init__ must call super().__init__() first")
        modules: dict[str, Module] = self.__dict__["_modules"]
        buffers: dict[str, Tensor | None] = self.__dict__["_buffers"]
        if name in buffers and not isinstance(value, Parameter | Module):
            # A registered buffer stays one when reassigned (torch's rule): a Tensor or None.
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(
                    f"cannot assign a {type(value).__name__} to buffer {name!r} (a Tensor or None)"
                )
            buffers[name] = value
            object.__setattr__(self, name, value)
            return
        buffers.pop(name, None)
        # A replaced parameter or module keeps its place (dict order), as in torch: a Sequential
        # whose layer is swapped (e.g. by nn.add_lora) still runs its layers in the same order.
        if not isinstance(value, Parameter):
            params.pop(name, None)
        if not isinstance(value, Module):
            modules.pop(name, None)
        if isinstance(value, Parameter):
            params[name] = value
        elif isinstance(value, Module):
            modules[name] = value
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        self.__dict__["_parameters"].pop(name, None)
        self.__dict__["_modules"].pop(name, None)
        self.__dict__["_buffers"].pop(name, None)
        self.__dict__["_non_persistent"].discard(name)
        object.__delattr__(self, name)

    def register_buffer(self, name: str, tensor: Tensor | np.ndarray | None, persistent: bool = True) -> None:
        """Keep `tensor` as buffer `name` (also the attribute `self.name`). A NumPy array is copied
        into host memory until `.to(device)`; None reserves the name (a buffer not in use).
        `persistent=False` leaves it out of `state_dict()`."""
        if "_buffers" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}.__init__ must call super().__init__() first")
        if not name.isidentifier() or "." in name:
            raise KeyError(f"buffer name must be an identifier without dots, got {name!r}")
        if name in self.__dict__["_parameters"] or name in self.__dict__["_modules"]:
            raise KeyError(f"attribute {name!r} is already a parameter or module")
        if isinstance(tensor, np.ndarray):
            tensor = Tensor(HostValue(np.array(tensor, order="C", copy=True)))
        elif tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(f"a buffer is a Tensor, a NumPy array or None, got {type(tensor).__name__}")
        if isinstance(tensor, Parameter):
            raise TypeError(f"buffer {name!r} cannot be a Parameter (assign it as an attribute instead)")
        self.__dict__["_buffers"][name] = tensor
        if persistent:
            self.__dict__["_non_persistent"].discard(name)
        else:
            self.__dict__["_non_persistent"].add(name)
        object.__setattr__(self, name, tensor)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        yield prefix, self
        for name, m in self.__dict__["_modules"].items():
            yield from m.named_modules(f"{prefix}.{name}" if prefix else name)

    def children(self) -> Iterator[Module]:
        yield from self.__dict__["_modules"].values()

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        """(dotted name, parameter) pairs; a parameter shared by two modules appears once."""
        seen: set[int] = set()
        for prefix, m in self.named_modules():
            for name, p in m.__dict__["_parameters"].items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{prefix}.{name}" if prefix else name), p

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def named_buffers(self) -> Iterator[tuple[str, Tensor]]:
        """(dotted name, buffer) pairs of every buffer in use (not None); a shared one appears once."""
        seen: set[int] = set()
        for prefix, m in self.named_modules():
            for name, b in m.__dict__["_buffers"].items():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    yield (f"{prefix}.{name}" if prefix else name), b

    def buffers(self) -> list[Tensor]:
        return [b for _, b in self.named_buffers()]

    def _named_state(self) -> Iterator[tuple[str, Tensor]]:
        """What `state_dict` holds, in torch's order: each module's parameters, then its persistent
        buffers, modules in the order of `named_modules`; each tensor once."""
        seen: set[int] = set()
        for prefix, m in self.named_modules():
            skip = m.__dict__["_non_persistent"]
            own: list[tuple[str, Tensor | None]] = [
                *m.__dict__["_parameters"].items(),
                *((n, b) for n, b in m.__dict__["_buffers"].items() if n not in skip),
            ]
            for name, t in own:
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    yield (f"{prefix}.{name}" if prefix else name), t

    def to(self, device: Device) -> Self:
        """Move every parameter and buffer to `device` (in place: optimizers keep their references)."""
        for p in self.parameters():
            p.to_(device)
        for b in self.buffers():
            _move(b, device)
        return self

    def train(self, mode: bool = True) -> Self:
        for _, m in self.named_modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> Self:
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every parameter and persistent buffer as a NumPy array (a copy), by dotted name."""
        return {name: t.numpy() for name, t in self._named_state()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Copy arrays into the parameters and buffers of the same names (shapes must match; each
        keeps its dtype)."""
        targets = dict(self._named_state())
        if strict:
            missing = sorted(set(targets) - set(state))
            unexpected = sorted(set(state) - set(targets))
            if missing or unexpected:
                raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for name, array in state.items():
            if name in targets:
                assign(targets[name], array)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={m!r}" for n, m in self.__dict__["_modules"].items())
        return f"{type(self).__name__}({inner})"
