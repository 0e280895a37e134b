"""The gRPC transport: one bidirectional stream of raw byte messages per session; never looks inside a blob."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import grpc
import grpc.aio

from emberlink.errors import TransportError, TransportTimeout
from emberlink.transport.base import MAX_BLOB, Blob, Handler, check_blob
from emberlink.transport.sessions import SessionSet

SERVICE = "emberlink.Link"
METHOD = f"/{SERVICE}/Session"

# gRPC's default receive limit is exactly 4 MiB; blobs may be up to MAX_BLOB plus a little framing.
_MESSAGE_LIMIT = MAX_BLOB + 64 * 1024

# Keepalive: a frozen or partitioned peer (no FIN, no RST) is noticed after one unanswered ping,
# at most KEEPALIVE_MS + PING_TIMEOUT_MS of silence. grpc-core waits 60 s for a ping ack unless
# grpc.http2.ping_timeout_ms is set too. Incoming data also counts as life, so bulk transfers
# on a slow link do not trip it.
KEEPALIVE_MS = 300
PING_TIMEOUT_MS = 1000

#: How long close() waits to half-close politely before it cuts the call.
_CLOSE_WAIT_S = 1.0

_COMMON_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", _MESSAGE_LIMIT),
    ("grpc.max_receive_message_length", _MESSAGE_LIMIT),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", PING_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS: list[tuple[str, Any]] = _COMMON_OPTIONS + [
    # Accept the clients' frequent pings instead of answering GOAWAY "too_many_pings".
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
    # Two workers must not share a port silently.
    ("grpc.so_reuseport", 0),
]
CLIENT_OPTIONS: list[tuple[str, Any]] = _COMMON_OPTIONS + [
    # Each session gets its own TCP connection, so closing one never disturbs another.
    ("grpc.use_local_subchannel_pool", 1),
]


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _rpc_error_text(e: grpc.RpcError) -> str:
    code = e.code() if isinstance(e, grpc.aio.AioRpcError) else None
    details = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
    return f"{code.name if code else 'error'}: {details}"


def _spurious_cancel(task: asyncio.Task[Any] | None) -> bool:
    """Whether a CancelledError came out of a dead call (grpc.aio does that) rather than task.cancel()."""
    return task is not None and task.cancelling() == 0


class GrpcClientLink:
    """The client end of a session: a channel and its one bidirectional call."""

    def __init__(self, channel: grpc.aio.Channel, call: grpc.aio.StreamStreamCall, peer: str) -> None:
        self._channel = channel
        self._call = call
        self.peer = peer
        self._closed = False

    async def send(self, blob: Blob) -> None:
        blob = check_blob(blob)
        if self._closed:
            raise TransportError(f"link to {self.peer} is closed")
        try:
            await self._call.write(blob)
        except grpc.RpcError as e:
            raise TransportError(f"send to {self.peer} failed: {_rpc_error_text(e)}") from e
        except asyncio.InvalidStateError as e:
            raise TransportError(f"send to {self.peer} failed: the session has ended") from e
        except asyncio.CancelledError:
            if self._closed and _spurious_cancel(asyncio.current_task()):
                raise TransportError(f"link to {self.peer} is closed") from None
            raise

    async def recv(self) -> bytes:
        if self._closed:
            raise TransportError(f"link to {self.peer} is closed")
        try:
            msg = await self._call.read()
        except grpc.RpcError as e:
            raise TransportError(f"receive from {self.peer} failed: {_rpc_error_text(e)}") from e
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError from read() on a call cancelled by close().
            if self._closed and _spurious_cancel(asyncio.current_task()):
                raise TransportError(f"link to {self.peer} is closed") from None
            raise
        if msg is grpc.aio.EOF:
            raise TransportError(f"peer {self.peer} closed the session")
        return cast(bytes, msg)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # Half-close first so the worker reads a clean end of stream after our last blob; bounded,
            # because a worker that stopped reading must not make close() hang.
            if not self._call.done():
                await asyncio.wait_for(self._call.done_writing(), _CLOSE_WAIT_S)
        except (grpc.RpcError, asyncio.InvalidStateError, TimeoutError):
            pass
        await self._channel.close(None)


class GrpcServerLink:
    """The worker end of a session, on the servicer context of its call."""

    def __init__(self, context: grpc.aio.ServicerContext[bytes, bytes], peer: str) -> None:
        self._context = context
        self.peer = peer
        self._closed = False
        self._gone: str | None = None
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def _check_open(self) -> None:
        if self._gone is not None:
            raise TransportError(self._gone)
        if self._closed:
            raise TransportError(f"link to {self.peer} is closed")

    async def send(self, blob: Blob) -> None:
        blob = check_blob(blob)
        self._check_open()
        try:
            await self._context.write(blob)
        except asyncio.CancelledError:
            if self._gone is not None and _spurious_cancel(asyncio.current_task()):
                raise TransportError(self._gone) from None
            raise
        except Exception as e:  # grpc.aio raises several unrelated types on a dead call
            if self._gone is not None:
                raise TransportError(self._gone) from e
            raise TransportError(f"send to {self.peer} failed: the call is over ({type(e).__name__})") from e

    async def recv(self) -> bytes:
        self._check_open()
        try:
            msg = await self._context.read()
        except asyncio.CancelledError:
            if self._gone is not None and _spurious_cancel(asyncio.current_task()):
                raise TransportError(self._gone) from None
            raise
        except Exception as e:
            if self._gone is not None:
                raise TransportError(self._gone) from e
            raise TransportError(f"receive from {self.peer} failed: {type(e).__name__}: {e}") from e
        if msg is grpc.aio.EOF:
            self._gone = f"peer {self.peer} closed the session"
            raise TransportError(self._gone)
        return cast(bytes, msg)

    async def close(self) -> None:
        self._closed = True
        if not self.finished.done():
            self.finished.set_result(None)

    def _call_ended(self, why: str) -> None:
        if self._gone is None:
            self._gone = why
        if not self.finished.done():
            self.finished.set_result(None)


class GrpcListener:
    """Serves `handler` for every session opened on `host:port` (port 0 picks a free one)."""

    def __init__(self, host: str, port: int, handler: Handler) -> None:
        self.host = host
        self.port = port
        self._sessions = SessionSet(handler, "grpc")
        self._server: grpc.aio.Server | None = None
        self._accepting = False

    async def start(self) -> int:
        """Bind and serve; returns the bound port."""
        server = grpc.aio.server(options=SERVER_OPTIONS)
        method = grpc.stream_stream_rpc_method_handler(self._serve)  # no (de)serializers: raw bytes
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Session": method}),))
        address = _target(self.host, self.port)
        try:
            port = int(server.add_insecure_port(address))
        except RuntimeError as e:
            await server.stop(None)
            raise TransportError(f"cannot listen on {address}: {e}") from e
        await server.start()
        self._server, self.port, self._accepting = server, port, True
        return port

    async def _serve(self, requests: object, context: grpc.aio.ServicerContext[bytes, bytes]) -> None:
        if not self._accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is shutting down")
        # Sent at once, so the client's connect() learns the session is open without a round trip of data.
        await context.send_initial_metadata(())
        link = GrpcServerLink(context, context.peer())
        self._sessions.spawn(link)
        try:
            await link.finished
        except asyncio.CancelledError:
            # grpc cancels the servicer when the peer resets the call (or on server stop). The handler
            # is not cancelled: its next recv or send raises TransportError, as the contract says.
            link._call_ended(f"session with {link.peer} was cancelled by the peer")
            raise

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new sessions, give running ones `grace` seconds, then close them and the port."""
        self._accepting = False
        await self._sessions.stop(grace)
        if self._server is not None:
            # Sessions are over by now; a grace (not None) makes grpc send a polite GOAWAY, which
            # spares still-connected clients a "Got goaway ... Cancelling all calls" log line.
            await self._server.stop(0.5)
            self._server = None


async def connect(host: str, port: int, *, timeout: float = 10.0) -> GrpcClientLink:
    """Open a session to the worker at `host:port`; fails fast when nothing listens there."""
    target = _target(host, port)
    channel = grpc.aio.insecure_channel(target, options=CLIENT_OPTIONS)
    # No wait_for_ready: a refused connection fails the call at once instead of retrying until timeout.
    call = channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)()
    try:
        await asyncio.wait_for(call.initial_metadata(), timeout)
    except TimeoutError:
        call.cancel()
        await channel.close(None)
        raise TransportTimeout(f"no answer from grpc worker at {target} within {timeout} s") from None
    except BaseException:
        await channel.close(None)
        raise
    if call.done():
        code, details = await call.code(), await call.details()
        await channel.close(None)
        raise TransportError(f"cannot open a session with grpc worker at {target}: {code.name}: {details}")
    return GrpcClientLink(channel, call, f"grpc:{target}")
