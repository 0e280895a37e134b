"""Tickets: who a worker is and where to reach it, as one string; parsing only, no name resolution.

Form: `emberlink://<node-id>@addr[,addr...][?relay=nats://host:port]`.
- `<node-id>` is a canonical NodeId (see identity.py).
- Each address is `host:port` (gRPC) or `tcp:host:port` (the raw TCP transport); an IPv6 host is
  written in brackets (`[::1]:7443`, `tcp:[::1]:7444`); ports are 1..65535. `tcp:` marks raw TCP only
  when an address with its own port follows, so a gRPC host named `tcp` (`tcp:7443`) keeps its
  meaning and every ticket written before raw TCP existed parses as it did.
- The canonical form lists the tcp addresses first, then the gRPC ones, each kind in its given order.
- A ticket with only a relay keeps the `@` and has no address: `emberlink://<node-id>@?relay=nats://h:4222`.
- `relay` is the only query key, at most once, and must be `nats://host:port`.
- `str(ticket)` gives the canonical form, which parses back to an equal ticket.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl

from emberlink.errors import ProtocolError
from emberlink.protocol.identity import public_from_node_id

SCHEME = "emberlink://"
TCP_PREFIX = "tcp:"
_HOSTNAME = re.compile(
    r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?\Z"
)
_PORT = re.compile(r"[0-9]{1,5}\Z")


@dataclass(frozen=True, slots=True)
class Ticket:
    """A worker's NodeId, its direct gRPC addresses (host, port), an optional NATS relay URL, and its
    raw TCP addresses (host, port)."""

    node_id: str
    addrs: tuple[tuple[str, int], ...]
    relay: str | None = None
    tcp: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        try:
            public_from_node_id(self.node_id)
        except ProtocolError as e:
            raise ProtocolError(f"ticket: {e}") from e
        for host, port in self.addrs + self.tcp:
            _check_host(host)
            if type(port) is not int or not 1 <= port <= 65535:
                raise ProtocolError(f"ticket: port {port!r} is not in 1..65535")
        if self.relay is not None:
            _parse_relay(self.relay)
        if not self.addrs and not self.tcp and self.relay is None:
            raise ProtocolError("ticket: no address and no relay; give host:port or ?relay=nats://host:port")

    @classmethod
    def parse(cls, text: str) -> Ticket:
        """The ticket in text; ProtocolError naming the malformed part."""
        text = text.strip()
        if not text.startswith(SCHEME):
            raise ProtocolError(f"ticket must start with {SCHEME!r}: {text[:40]!r}")
        rest = text[len(SCHEME) :]
        if "#" in rest:
            raise ProtocolError("ticket must not have a #fragment")
        rest, _, query = rest.partition("?")
        if "@" not in rest:
            raise ProtocolError("ticket needs <node-id>@host:port (or <node-id>@?relay=...)")
        node_id, _, addr_text = rest.partition("@")
        grpc: list[tuple[str, int]] = []
        tcp: list[tuple[str, int]] = []
        for text_addr in addr_text.split(",") if addr_text else ():
            if _is_tcp(text_addr):
                tcp.append(_parse_addr(text_addr[len(TCP_PREFIX) :]))
            else:
                grpc.append(_parse_addr(text_addr))
        return cls(node_id, tuple(grpc), _parse_query(query), tuple(tcp))

    def __str__(self) -> str:
        addrs = ",".join(
            [TCP_PREFIX + format_addr(host, port) for host, port in self.tcp]
            + [format_addr(host, port) for host, port in self.addrs]
        )
        relay = f"?relay={self.relay}" if self.relay is not None else ""
        return f"{SCHEME}{self.node_id}@{addrs}{relay}"


def _is_tcp(text: str) -> bool:
    """`tcp:host:port` or `tcp:[v6]:port`, not a gRPC address whose host is named `tcp`."""
    if not text.startswith(TCP_PREFIX):
        return False
    rest = text[len(TCP_PREFIX) :]
    return rest.startswith("[") or ":" in rest


def format_addr(host: str, port: int) -> str:
    """`host:port`, an IPv6 host in brackets (as a ticket writes it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_host(host: str) -> None:
    if type(host) is not str or not host:
        raise ProtocolError(f"ticket: empty or non-string host {host!r}")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError as e:
            raise ProtocolError(f"ticket: bad IPv6 address {host!r}") from e
    elif not _HOSTNAME.match(host):
        raise ProtocolError(f"ticket: bad host name {host!r}")


def _parse_addr(text: str) -> tuple[str, int]:
    if text.startswith("["):
        host, bracket, port_text = text[1:].partition("]")
        if not bracket or not port_text.startswith(":"):
            raise ProtocolError(f"ticket: IPv6 address must look like [::1]:7443, got {text!r}")
        port_text = port_text[1:]
        if ":" not in host:
            raise ProtocolError(f"ticket: brackets are only for IPv6 addresses, got {text!r}")
    else:
        host, colon, port_text = text.rpartition(":")
        if not colon:
            raise ProtocolError(f"ticket: address {text!r} has no port; write host:port")
        if ":" in host:
            raise ProtocolError(f"ticket: write an IPv6 address in brackets, like [{host}]:{port_text}")
    _check_host(host)
    return host, _parse_port(port_text, text)


def _parse_port(port_text: str, context: str) -> int:
    if not _PORT.match(port_text) or not 1 <= int(port_text) <= 65535:
        raise ProtocolError(f"ticket: port {port_text!r} in {context!r} is not a number in 1..65535")
    return int(port_text)


def _parse_query(query: str) -> str | None:
    if not query:
        return None
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError as e:
        raise ProtocolError(f"ticket: malformed query {query!r}") from e
    relay: str | None = None
    for key, value in pairs:
        if key != "relay":
            raise ProtocolError(f"ticket: unknown query key {key!r}; only relay is allowed")
        if relay is not None:
            raise ProtocolError("ticket: relay given twice")
        relay = value
    return relay


def _parse_relay(relay: str) -> tuple[str, int]:
    if type(relay) is not str or not relay.startswith("nats://"):
        raise ProtocolError(f"ticket: relay must be nats://host:port, got {relay!r}")
    return _parse_addr(relay[len("nats://") :])
