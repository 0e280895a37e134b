"""The backend registry: device kinds to their Backend classes, and device strings parsed; no I/O.

A device string is a kind, with `:N` for an indexed kind: `cpu`, `cuda`, `cuda:1` (`cuda` means
`cuda:0`). Every place that turns a device string into a backend (the worker's device thread,
`Device.local`, `Device.cpu`/`cuda`, the CLI's `--device`) asks this module, so a new backend is
its own module plus one `register` line below. A registered class is imported only when a device
of its kind is created, so a client never loads a backend it does not use.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from emberlink.errors import ConfigError, DeviceError

if TYPE_CHECKING:
    from emberlink.graph_replay.backend import Backend
    from emberlink.graph_replay.cupy_backend import CupyBackend
    from emberlink.graph_replay.numpy_backend import NumpyBackend

BackendClass: TypeAlias = "Callable[..., Backend]"
"""A Backend class: an indexed kind's is called with the device index, another's with no argument."""

_KIND = re.compile(r"^[a-z][a-z0-9_]*$")
_DEVICE = re.compile(r"^([a-z][a-z0-9_]*)(?::(\d{1,3}))?$")


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """A parsed device string: its kind and, for an indexed kind, the index (else None)."""

    kind: str
    index: int | None = None

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


@dataclass(slots=True)
class _Entry:
    target: str | BackendClass  # "module:Class", imported on first use, or the class itself
    indexed: bool


_REGISTRY: dict[str, _Entry] = {}


def register(kind: str, backend: str | BackendClass, *, indexed: bool = False) -> None:
    """Make device strings of `kind` run on `backend`: a class, or "package.module:Class" to import
    when the first such device is created. `indexed` kinds take `kind:N` and call the class with N.
    ConfigError for a malformed or already registered kind."""
    if not _KIND.match(kind):
        raise ConfigError(f"device kind must be lowercase letters, digits and _, got {kind!r}")
    if kind in _REGISTRY:
        raise ConfigError(f"device kind {kind!r} is already registered")
    if isinstance(backend, str) and backend.count(":") != 1:
        raise ConfigError(f"backend must be a class or 'package.module:Class', got {backend!r}")
    _REGISTRY[kind] = _Entry(backend, indexed)


def unregister(kind: str) -> None:
    """Forget `kind` (a no-op if it is not registered)."""
    _REGISTRY.pop(kind, None)


def device_kinds() -> str:
    """The accepted device strings in words, e.g. "cpu or cuda:N" (for help texts and errors)."""
    forms = [f"{kind}:N" if entry.indexed else kind for kind, entry in _REGISTRY.items()]
    return forms[0] if len(forms) == 1 else f"{', '.join(forms[:-1])} or {forms[-1]}"


def parse_device(text: str) -> DeviceSpec:
    """A device string as a DeviceSpec; ConfigError naming what is accepted otherwise."""
    m = _DEVICE.match(text)
    entry = _REGISTRY.get(m.group(1)) if m is not None else None
    if m is None or entry is None or (m.group(2) is not None and not entry.indexed):
        raise ConfigError(f"device must be {device_kinds()}, got {text!r}")
    if not entry.indexed:
        return DeviceSpec(m.group(1))
    return DeviceSpec(m.group(1), int(m.group(2) or 0))


def create_backend(device: DeviceSpec | str) -> Backend:
    """A new backend for `device`; ConfigError for an unknown kind, DeviceError from the backend
    when the device is unusable here (no CuPy, no GPU, no such index)."""
    spec = parse_device(device) if isinstance(device, str) else device
    entry = _REGISTRY.get(spec.kind)
    if entry is None:
        raise ConfigError(f"device must be {device_kinds()}, got {str(spec)!r}")
    if entry.indexed != (spec.index is not None):
        raise ConfigError(f"device {spec.kind} {'needs an' if entry.indexed else 'takes no'} index")
    cls = _load(spec, entry)
    try:
        return cls() if spec.index is None else cls(spec.index)
    except DeviceError as e:  # say which device, e.g. in the worker's one-line start-up error
        raise DeviceError(f"device {spec}: {e}") from e


def _load(spec: DeviceSpec, entry: _Entry) -> BackendClass:
    if not isinstance(entry.target, str):
        return entry.target
    module_name, _, attr = entry.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise DeviceError(f"device {spec}: cannot import its backend {entry.target}: {e}") from e
    cls: BackendClass = getattr(module, attr)  # a name from this registry, never from the wire
    return cls


register("cpu", "emberlink.graph_replay.numpy_backend:NumpyBackend")
register("cuda", "emberlink.graph_replay.cupy_backend:CupyBackend", indexed=True)

if TYPE_CHECKING:  # mypy checks the classes registered by name above against the Backend protocol
    _CHECKED: tuple[BackendClass, ...] = (NumpyBackend, CupyBackend)


__all__ = [
    "BackendClass",
    "DeviceSpec",
    "create_backend",
    "device_kinds",
    "parse_device",
    "register",
    "unregister",
]
