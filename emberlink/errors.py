"""The one exception tree of emberlink; every error a user can meet is one of these.

Failures cross the wire as data (a code and a message, see `RemoteError.from_wire`), never as
exception objects. Third-party exceptions are translated where they occur (`raise X from e`).
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """The code of an `Error` message on the wire; each names the RemoteError subclass it raises.

    A member is its string (`ErrorCode.QUOTA == "quota"`), so the wire form is the plain string.
    """

    REMOTE = "remote"
    EXECUTION = "execution"
    OUT_OF_MEMORY = "out_of_memory"
    QUOTA = "quota"
    LIMIT = "limit"
    UNKNOWN_TENSOR = "unknown_tensor"
    WORKER_LOST = "worker_lost"
    GOING_AWAY = "going_away"
    REFUSED = "refused"


class EmberlinkError(Exception):
    """Base of every error emberlink raises on purpose."""


class ConfigError(EmberlinkError):
    """A local setting is wrong: a key file others can read, a malformed allow file, a bad flag."""


class ShapeError(EmberlinkError, ValueError):
    """Operand shapes do not fit the op; raised on the client at the line that recorded it."""


class DTypeError(EmberlinkError, TypeError):
    """An operand's dtype is not allowed for the op, or a dtype name is unknown."""


class CheckpointError(EmberlinkError):
    """A checkpoint cannot be read or written: missing, truncated or not safetensors, or a state
    entry that is not a tensor."""


class ExportError(EmberlinkError):
    """A model cannot be exported (emberlink.onnx.export): an op with no ONNX form, random numbers in
    the forward pass (dropout in training mode), a value read in Python during it, or the `onnx`
    package missing."""


class DeviceError(EmberlinkError):
    """A local device problem: no CUDA, unknown device, an op on a closed device."""


class JitError(EmberlinkError, RuntimeError):
    """A function compiled with `emberlink.jit` did something a replay cannot repeat: it read a
    tensor's value, flushed or synced a device, or used tensors of several devices."""


class ProtocolError(EmberlinkError):
    """A message is malformed, oversized, of the wrong version, or sent out of turn."""


class AuthError(ProtocolError):
    """A bad signature or tag, an unknown or unexpected peer, a replayed frame."""


class TransportError(EmberlinkError):
    """Connecting, sending or receiving failed."""


class TransportTimeout(TransportError, TimeoutError):
    """A transport operation ran past its deadline."""


class RemoteError(EmberlinkError):
    """The worker refused or failed a request. `code` is the wire code, `message` its text.

    A code this version does not know (from a newer worker) stays a plain string on a RemoteError.
    """

    code: str = ErrorCode.REMOTE

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    @staticmethod
    def from_wire(code: str, message: str) -> RemoteError:
        """Build the exception that a wire `Error(code, message)` stands for."""
        cls = _BY_CODE.get(code, RemoteError)
        if cls is RemoteError:
            return RemoteError(message, code=code)
        return cls(message)


class ExecutionError(RemoteError):
    """The worker's backend failed running a graph (shape, dtype, numeric or internal failure)."""

    code = ErrorCode.EXECUTION


class OutOfMemory(ExecutionError):
    """The worker's device ran out of memory running a graph or storing an upload."""

    code = ErrorCode.OUT_OF_MEMORY


class QuotaExceeded(RemoteError):
    """The session asked to keep more bytes on the worker than its quota allows."""

    code = ErrorCode.QUOTA


class LimitExceeded(RemoteError):
    """A request passed one of the worker's per-session limits on work: a graph with too many
    nodes, a plan touching too many elements or doing too many FLOPs (`emberlink worker --help`)."""

    code = ErrorCode.LIMIT


class UnknownTensor(RemoteError):
    """A request named a tensor id the worker does not hold (never uploaded, or dropped)."""

    code = ErrorCode.UNKNOWN_TENSOR


class WorkerLost(RemoteError):
    """The connection to the worker died: killed, unreachable, or the relay went away."""

    code = ErrorCode.WORKER_LOST


class GoingAway(WorkerLost):
    """The worker is shutting down (SIGTERM) and closed the session after finishing its work."""

    code = ErrorCode.GOING_AWAY


class Refused(RemoteError):
    """The worker refused the request as malformed or not allowed (its side of a ProtocolError)."""

    code = ErrorCode.REFUSED


_BY_CODE: dict[str, type[RemoteError]] = {
    cls.code: cls
    for cls in (
        ExecutionError,
        OutOfMemory,
        QuotaExceeded,
        LimitExceeded,
        UnknownTensor,
        WorkerLost,
        GoingAway,
        Refused,
    )
}

__all__ = [
    "AuthError",
    "CheckpointError",
    "ConfigError",
    "DTypeError",
    "DeviceError",
    "EmberlinkError",
    "ErrorCode",
    "ExecutionError",
    "ExportError",
    "GoingAway",
    "JitError",
    "LimitExceeded",
    "OutOfMemory",
    "ProtocolError",
    "QuotaExceeded",
    "Refused",
    "RemoteError",
    "ShapeError",
    "TransportError",
    "TransportTimeout",
    "UnknownTensor",
    "WorkerLost",
]
