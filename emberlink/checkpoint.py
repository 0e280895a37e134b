"""Checkpoints in the safetensors format: `save(state, path)` and `load(path, device=None)`; no network code.

The format (https://huggingface.co/docs/safetensors): 8 bytes of little-endian header length N,
N bytes of JSON `{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...}`
(plus an optional `"__metadata__"` map of strings) padded with spaces to a multiple of 8, then
every tensor's little-endian bytes back to back, at offsets relative to the end of the header.

Both directions stream tensor by tensor, so a checkpoint larger than the client's memory still
moves: `save` writes the header first (sizes follow from shapes and dtypes) and then each tensor
as it is read from its device; `load` maps the file and hands each tensor's view of the mapping to
the device, which for a remote device only keeps a reference until the worker acknowledges the
bytes. That is why the header is parsed here: the safetensors package's NumPy API reads whole
tensors into memory. The tests check both directions against that package.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, overload

import numpy as np

from emberlink.client.device import Device
from emberlink.client.tensor import Tensor
from emberlink.errors import CheckpointError, DTypeError
from emberlink.protocol.dtypes import DTYPES

_ALL_CODES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
}
CODES = {name: code for name, code in _ALL_CODES.items() if name in DTYPES}
"""emberlink dtype name -> safetensors dtype code, for the dtypes emberlink holds."""
_NAMES = {code: name for name, code in CODES.items()}

_OTHER_CODES = {
    "BF16": "bfloat16",
    "F8_E4M3": "float8 (e4m3)",
    "F8_E5M2": "float8 (e5m2)",
    "F8_E8M0": "float8 (e8m0)",
    "F6_E2M3": "float6 (e2m3)",
    "F6_E3M2": "float6 (e3m2)",
    "F4": "float4",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "C64": "complex64",
}
"""Codes other tools write that emberlink may not hold, by what they are (for the error message)."""

MAX_HEADER = 100_000_000
"""The safetensors package's own limit on the JSON header, in bytes."""
_METADATA = "__metadata__"


@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor of a checkpoint: where its bytes are (`begin` counts from the start of the file)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    nbytes: int


# -- save ------------------------------------------------------------------------------------------


def save(
    state: Mapping[str, Tensor | np.ndarray],
    path: str | os.PathLike[str],
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `state` (name -> Tensor or NumPy array, e.g. `model.state_dict()`) to a safetensors file,
    with `metadata` (strings, as safetensors' `save_file` takes them; e.g. `{"format": "pt"}`,
    which Hugging Face transformers asks for) in its header.

    Tensors on a remote device are read one at a time and written as they arrive, so the client
    never holds more than about one tensor. The file appears complete or not at all: it is written
    beside `path` and renamed over it. Over 64 MiB, a progress bar shows on a terminal.
    """
    if not isinstance(state, Mapping):
        raise CheckpointError(
            f"save takes a mapping of names to tensors (e.g. model.state_dict()), got {type(state).__name__}"
        )
    entries, values = _layout(state)
    header = _header(entries, _metadata(metadata))
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    bar = _bar(sum(e.nbytes for e in entries), f"save {path.name}")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            for entry, value in zip(entries, values, strict=True):
                _write_tensor(f, entry, value)
                if bar is not None:
                    bar.update(entry.nbytes)
        os.replace(tmp, path)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {path}: {e.strerror or e}") from e
    finally:
        tmp.unlink(missing_ok=True)
        if bar is not None:
            bar.close()


def _layout(state: Mapping[str, Any]) -> tuple[list[_Entry], list[Tensor | np.ndarray]]:
    """Every entry checked (before anything is read or written) and placed: wider dtypes first,
    so each tensor starts at a multiple of its item size, as the safetensors package lays them out."""
    described = [_describe(name, value) for name, value in state.items()]
    described.sort(key=lambda d: -np.dtype(d[1]).itemsize)  # stable: the caller's order within a width
    entries, values, offset = [], [], 0
    for name, dtype, shape, value in described:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        entries.append(_Entry(name, dtype, shape, offset, nbytes))
        values.append(value)
        offset += nbytes
    return entries, values


def _describe(name: object, value: object) -> tuple[str, str, tuple[int, ...], Tensor | np.ndarray]:
    if not isinstance(name, str):
        raise CheckpointError(f"checkpoint names must be strings, got {type(name).__name__} {name!r}")
    if name == _METADATA:
        raise CheckpointError(
            f"the name {_METADATA!r} is reserved by the safetensors format for metadata; rename that entry"
        )
    if isinstance(value, Tensor):
        dtype, shape = value.dtype, value.shape
    elif isinstance(value, np.ndarray):
        dtype, shape = value.dtype.name, value.shape
    else:
        raise CheckpointError(
            f"state[{name!r}] is a {type(value).__name__}, not a Tensor or NumPy array: a safetensors "
            "file holds tensors only (keep other values, e.g. a step count, in a file of their own)"
        )
    if dtype not in CODES:
        raise DTypeError(
            f"state[{name!r}] has dtype {dtype}, which a checkpoint cannot hold; "
            f"supported: {', '.join(CODES)}"
        )
    return name, dtype, tuple(shape), value


def _metadata(metadata: Mapping[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointError(f"checkpoint metadata must map strings to strings, got {metadata!r}")
    return dict(metadata)


def _header(entries: list[_Entry], metadata: dict[str, str] | None) -> bytes:
    table: dict[str, Any] = {} if metadata is None else {_METADATA: metadata}
    for e in entries:
        offsets = [e.begin, e.begin + e.nbytes]
        table[e.name] = {"dtype": CODES[e.dtype], "shape": list(e.shape), "data_offsets": offsets}
    text = json.dumps(table, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the tensors start 8-byte aligned
    if len(text) > MAX_HEADER:
        raise CheckpointError(f"the checkpoint's header would be {len(text)} bytes, over the format's limit")
    return len(text).to_bytes(8, "little") + text


def _write_tensor(f: BinaryIO, entry: _Entry, value: Tensor | np.ndarray) -> None:
    array = value.numpy() if isinstance(value, Tensor) else value
    if array.shape != entry.shape or array.dtype.name != entry.dtype:
        raise CheckpointError(  # a device answered with other data than the tensor says it holds
            f"state[{entry.name!r}] read back as {array.dtype.name}{list(array.shape)}, "
            f"expected {entry.dtype}{list(entry.shape)}"
        )
    little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    if little.size:
        f.write(little.reshape(-1).view(np.uint8).data)


# -- load ------------------------------------------------------------------------------------------


@overload
def load(path: str | os.PathLike[str], device: None = None) -> dict[str, np.ndarray]: ...
@overload
def load(path: str | os.PathLike[str], device: Device) -> dict[str, Tensor]: ...
def load(path: str | os.PathLike[str], device: Device | None = None) -> dict[str, Any]:
    """Read a safetensors file: name -> NumPy array when `device` is None, else name -> Tensor on
    `device` (what `model.load_state_dict` takes).

    The file is mapped, not read: each tensor goes from its view of the mapping to the device, so
    loading onto a remote device needs about one tensor of client memory whatever the file's size,
    and returns once the worker holds every tensor. Over 64 MiB, a progress bar shows on a terminal.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            entries = _read_header(f, path, size)
            total = sum(e.nbytes for e in entries)
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if total else None
    except FileNotFoundError as e:
        raise CheckpointError(f"no checkpoint at {path}: file not found") from e
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror or e}") from e
    bar = _bar(total, f"load {path.name}") if device is not None else None
    try:
        out = dict(_place(entries, mapping, device, bar))
        if device is not None:
            device.sync()  # the worker holds everything; no upload still refers to the mapping
    finally:
        if bar is not None:
            bar.close()
    return out


def _place(
    entries: list[_Entry], mapping: mmap.mmap | None, device: Device | None, bar: Any
) -> Iterator[tuple[str, Any]]:
    # A remote executor only sends an upload's bytes (keeping a reference until acknowledged), so it
    # takes the mapping's view itself; a local one keeps what it is given, so it gets a copy.
    sends_bytes = device is not None and _sends_bytes(device)
    for e in entries:
        if mapping is None or e.nbytes == 0:
            view = np.zeros(e.shape, e.dtype)
        else:
            count = math.prod(e.shape)
            view = np.frombuffer(mapping, np.dtype(e.dtype).newbyteorder("<"), count, e.begin).reshape(
                e.shape
            )
        if device is None:
            yield e.name, view.astype(e.dtype)  # a writable array of its own, in native byte order
        elif sends_bytes:
            yield e.name, Tensor(device._upload(view))
        else:
            yield e.name, device.tensor(view)
        if bar is not None:
            bar.update(e.nbytes)


def _sends_bytes(device: Device) -> bool:
    remote = sys.modules.get("emberlink.client.remote")  # not imported: no device can be remote
    return remote is not None and isinstance(device._executor, remote.RemoteExecutor)


def _read_header(f: BinaryIO, path: Path, size: int) -> list[_Entry]:
    """The tensors a file holds, checked as the safetensors package checks them; the data is not read."""
    first = f.read(8)
    if len(first) < 8:
        raise CheckpointError(f"{path} is not a safetensors file: it holds only {size} bytes")
    n = int.from_bytes(first, "little")
    if n > size - 8 and n <= MAX_HEADER and f.read(1) == b"{":
        raise CheckpointError(
            f"{path} is truncated: its header alone is {n} bytes, the file holds {size} "
            "(an interrupted copy or download?)"
        )
    if n > size - 8 or n > MAX_HEADER:
        raise CheckpointError(
            f"{path} is not a safetensors file{_looks_like(first)}: its first 8 bytes "
            f"are not the length of a header ({n} bytes claimed, file has {size})"
        )
    twice: list[str] = []
    try:
        table = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=lambda pairs: _object(pairs, twice))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path} is not a safetensors file: its header is not JSON ({e})") from e
    if not isinstance(table, dict):
        raise CheckpointError(f"{path} is not a safetensors file: its header is not a JSON object")
    if twice:
        raise CheckpointError(f"{path} is corrupt: its header names {twice[0]!r} twice (which one is meant?)")
    table.pop(_METADATA, None)
    base = 8 + n
    entries = sorted((_entry(path, name, spec, base) for name, spec in table.items()), key=lambda e: e.begin)
    end = base
    for entry in entries:
        if entry.begin != end:
            raise CheckpointError(
                f"{path} is corrupt: tensor {entry.name!r} starts at byte {entry.begin - base} of the "
                f"data, expected {end - base} (tensors must lie back to back)"
            )
        end += entry.nbytes
    if end > size:
        raise CheckpointError(
            f"{path} is truncated: its header describes {end - base} bytes of tensors, the file holds "
            f"{size - base} (an interrupted copy or download?)"
        )
    if end < size:
        raise CheckpointError(f"{path} is corrupt: {size - end} bytes follow the last tensor")
    return entries


def _entry(path: Path, name: str, spec: Any, base: int) -> _Entry:
    if not (isinstance(spec, dict) and {"dtype", "shape", "data_offsets"} <= spec.keys()):
        raise CheckpointError(f"{path} is corrupt: entry {name!r} lacks dtype, shape or data_offsets")
    code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise CheckpointError(f"{path} is corrupt: tensor {name!r} has shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise CheckpointError(f"{path} is corrupt: tensor {name!r} has data_offsets {offsets!r}")
    dtype = _dtype(path, name, code)
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if offsets[1] - offsets[0] != nbytes or offsets[0] < 0:
        raise CheckpointError(
            f"{path} is corrupt: tensor {name!r} ({code}{shape}) needs {nbytes} bytes, "
            f"its data_offsets {offsets} give {offsets[1] - offsets[0]}"
        )
    return _Entry(name, dtype, tuple(shape), base + offsets[0], nbytes)


def _dtype(path: Path, name: str, code: Any) -> str:
    dtype = _NAMES.get(code) if isinstance(code, str) else None
    if dtype is not None:
        return dtype
    what = _OTHER_CODES.get(code) if isinstance(code, str) else None
    if what is None:
        raise CheckpointError(f"{path} is corrupt: tensor {name!r} has unknown dtype {code!r}")
    hint = (
        "convert it to float32 (or float16) with the tool that wrote it, e.g. in PyTorch "
        "`{k: v.float() for k, v in state.items()}` before safetensors.torch.save_file"
        if code in ("BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4")
        else "convert it with the tool that wrote it"
    )
    raise DTypeError(
        f"{path}: tensor {name!r} is {what} ({code}), which emberlink cannot hold "
        f"(it holds {', '.join(CODES)}); {hint}"
    )


def _object(pairs: list[tuple[str, Any]], twice: list[str]) -> dict[str, Any]:
    """A JSON object as a dict; a key it repeats goes to `twice` (json keeps the last one silently)."""
    table = dict(pairs)
    if len(table) < len(pairs):
        twice.extend(k for k, count in Counter(k for k, _ in pairs).items() if count > 1)
    return table


def _looks_like(first: bytes) -> str:
    if first.startswith(b"PK\x03\x04"):
        return " (it is a zip archive, as torch.save writes: load it in PyTorch and save it with safetensors)"
    if first[:1] == b"\x80":
        return " (it looks like a Python pickle: load it with the tool that wrote it and save it with safetensors)"
    return ""


def _bar(total: int, what: str) -> Any:
    from emberlink.client.session import _progress  # the remote transfers' bar: same threshold, same look

    return _progress(total, what)
