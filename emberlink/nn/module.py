"""Module and Parameter: named, nested parameter containers that move between devices; no math."""

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
        dev = self._v.dev
        on_dev = isinstance(dev, Device) and isinstance(array, Tensor) and array.device is dev
        a = array if on_dev else np.asarray(array)
        if a.shape != self.shape:
            raise ShapeError(f"cannot assign shape {a.shape} to a parameter of shape {self.shape}")
        if isinstance(a, Tensor):
            self._v = a.astype(self.dtype)._v
            return
        if isinstance(dev, Device):
            self._v = dev.tensor(a, dtype=self.dtype)._v
        else:
            self._v = HostValue(np.array(a, dtype=self.dtype, order="C", copy=True))

    def __repr__(self) -> str:
        return "Parameter" + super().__repr__().removeprefix("Tensor")


class Module:
    """Base class of layers and models: assign Parameters and Modules as attributes in __init__,
    write `forward`, and call the module. Parameters are found by attribute name, in order."""

    training: bool

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        object.__setattr__(self, "training", True)

    def __setattr__(self, name: str, value: Any) -> None:
        params: dict[str, Parameter] | None = self.__dict__.get("_parameters")
        if params is None:
            raise AttributeError(f"{type(self).__name__}.__init__ must call super().__init__() first")
        modules: dict[str, Module] = self.__dict__["_modules"]
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
        object.__delattr__(self, name)

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

    def to(self, device: Device) -> Self:
        """Move every parameter to `device` (in place: optimizers keep their references)."""
        for p in self.parameters():
            p.to_(device)
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
        """Every parameter as a NumPy array (a copy), by dotted name."""
        return {name: p.numpy() for name, p in self.named_parameters()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Copy arrays into the parameters of the same names (shapes must match)."""
        params = dict(self.named_parameters())
        if strict:
            missing = sorted(set(params) - set(state))
            unexpected = sorted(set(state) - set(params))
            if missing or unexpected:
                raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for name, array in state.items():
            if name in params:
                params[name].assign(array)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={m!r}" for n, m in self.__dict__["_modules"].items())
        return f"{type(self).__name__}({inner})"
