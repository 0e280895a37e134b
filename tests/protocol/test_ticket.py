"""Tickets: the canonical form round-trips, every malformed part is a clear ProtocolError."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emberlink.errors import ProtocolError
from emberlink.protocol.identity import Identity
from emberlink.protocol.ticket import Ticket

NODE = Identity.from_seed(bytes(32)).node_id


@pytest.mark.parametrize(
    ("text", "addrs", "relay"),
    [
        (f"emberlink://{NODE}@gpu-box:7443", (("gpu-box", 7443),), None),
        (
            f"emberlink://{NODE}@10.0.0.2:1,gpu.example.com:65535",
            (("10.0.0.2", 1), ("gpu.example.com", 65535)),
            None,
        ),
        (f"emberlink://{NODE}@[::1]:7443", (("::1", 7443),), None),
        (f"emberlink://{NODE}@[fe80::1]:7443,h:2", (("fe80::1", 7443), ("h", 2)), None),
        (f"emberlink://{NODE}@h:7443?relay=nats://relay:4222", (("h", 7443),), "nats://relay:4222"),
        (f"emberlink://{NODE}@?relay=nats://relay:4222", (), "nats://relay:4222"),
        (f"emberlink://{NODE}@?relay=nats://[::1]:4222", (), "nats://[::1]:4222"),
    ],
)
def test_good_ticket_parses_and_prints_back(
    text: str, addrs: tuple[tuple[str, int], ...], relay: str | None
) -> None:
    ticket = Ticket.parse(text)
    assert ticket == Ticket(NODE, addrs, relay)
    assert str(ticket) == text
    assert Ticket.parse(str(ticket)) == ticket


@pytest.mark.parametrize(
    ("text", "addrs", "tcp"),
    [
        (f"emberlink://{NODE}@tcp:h:7444", (), (("h", 7444),)),
        (f"emberlink://{NODE}@tcp:h:7444,h:7443", (("h", 7443),), (("h", 7444),)),
        (
            f"emberlink://{NODE}@tcp:[::1]:7444,tcp:b:2,[::1]:7443",
            (("::1", 7443),),
            (("::1", 7444), ("b", 2)),
        ),
        (f"emberlink://{NODE}@tcp:tcp:7444,tcp:7443", (("tcp", 7443),), (("tcp", 7444),)),
    ],
)
def test_ticket_with_tcp_addresses_parses_and_prints_back(
    text: str, addrs: tuple[tuple[str, int], ...], tcp: tuple[tuple[str, int], ...]
) -> None:
    ticket = Ticket.parse(text)
    assert ticket == Ticket(NODE, addrs, None, tcp)
    assert str(ticket) == text
    assert Ticket.parse(str(ticket)) == ticket


def test_tcp_addresses_print_first_whatever_order_they_were_given_in() -> None:
    ticket = Ticket.parse(f"emberlink://{NODE}@h:7443,tcp:h:7444?relay=nats://r:4222")
    assert (ticket.addrs, ticket.tcp, ticket.relay) == ((("h", 7443),), (("h", 7444),), "nats://r:4222")
    assert str(ticket) == f"emberlink://{NODE}@tcp:h:7444,h:7443?relay=nats://r:4222"


def test_grpc_host_named_tcp_keeps_its_meaning() -> None:
    assert Ticket.parse(f"emberlink://{NODE}@tcp:7443") == Ticket(NODE, (("tcp", 7443),))


def test_surrounding_whitespace_is_ignored() -> None:
    assert Ticket.parse(f"  emberlink://{NODE}@h:1\n") == Ticket(NODE, (("h", 1),))


def test_percent_encoded_relay_is_accepted() -> None:
    ticket = Ticket.parse(f"emberlink://{NODE}@h:1?relay=nats%3A%2F%2Fr%3A4222")
    assert ticket.relay == "nats://r:4222"


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        (f"http://{NODE}@h:1", "emberlink://"),
        (f"EMBERLINK://{NODE}@h:1", "emberlink://"),
        (f"emberlink:/{NODE}@h:1", "emberlink://"),
        ("emberlink://notbase32!@h:1", "NodeId"),
        (f"emberlink://{NODE[:-1]}1@h:1", "base32"),
        (f"emberlink://{NODE[:-2]}@h:1", "52"),
        (f"emberlink://{NODE}aa@h:1", "52"),
        (f"emberlink://{NODE.upper()}@h:1", "lowercase"),
        (f"emberlink://{NODE}h:1", "@"),
        (f"emberlink://{NODE}@", "no address"),
        (f"emberlink://{NODE}@h", "no port"),
        (f"emberlink://{NODE}@h:", "port"),
        (f"emberlink://{NODE}@h:0", "port"),
        (f"emberlink://{NODE}@h:65536", "port"),
        (f"emberlink://{NODE}@h:-1", "port"),
        (f"emberlink://{NODE}@h:+1", "port"),
        (f"emberlink://{NODE}@h:1x", "port"),
        (f"emberlink://{NODE}@h:1,", "host"),
        (f"emberlink://{NODE}@:1", "host"),
        (f"emberlink://{NODE}@bad_host:1", "host"),
        (f"emberlink://{NODE}@a b:1", "host"),
        (f"emberlink://{NODE}@::1:7443", "brackets"),
        (f"emberlink://{NODE}@[::1]7443", r"\[::1\]:7443"),
        (f"emberlink://{NODE}@[::1:7443", r"\[::1\]:7443"),
        (f"emberlink://{NODE}@[gggg::1]:7443", "IPv6"),
        (f"emberlink://{NODE}@[10.0.0.1]:7443", "IPv6"),
        (f"emberlink://{NODE}@h:1?relay=http://r:4222", "nats://"),
        (f"emberlink://{NODE}@h:1?relay=nats://r", "port"),
        (f"emberlink://{NODE}@h:1?relay=", "nats://"),
        (f"emberlink://{NODE}@h:1?relay=nats://r:1&relay=nats://s:1", "twice"),
        (f"emberlink://{NODE}@h:1?token=abc", "unknown query key"),
        (f"emberlink://{NODE}@h:1?relay", "query"),
        (f"emberlink://{NODE}@h:1#frag", "fragment"),
        (f"emberlink://{NODE}@?", "no address"),
        (f"emberlink://{NODE}@tcp:h:0", "port"),
        (f"emberlink://{NODE}@tcp:h:x", "port"),
        (f"emberlink://{NODE}@tcp::1", "host"),
        (f"emberlink://{NODE}@tcp:[::1]", r"\[::1\]:7443"),
        (f"emberlink://{NODE}@tcp:bad_host:1", "host"),
    ],
)
def test_malformed_ticket_is_refused_clearly(text: str, complaint: str) -> None:
    with pytest.raises(ProtocolError, match=complaint):
        Ticket.parse(text)


def test_ticket_built_in_code_is_validated() -> None:
    with pytest.raises(ProtocolError):
        Ticket(NODE, (("h", 0),))
    with pytest.raises(ProtocolError):
        Ticket("x", (("h", 1),))
    with pytest.raises(ProtocolError):
        Ticket(NODE, ())
    with pytest.raises(ProtocolError):
        Ticket(NODE, (), tcp=(("h", 70000),))
    assert Ticket(NODE, (), tcp=(("h", 1),)).tcp == (("h", 1),)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=120))
def test_arbitrary_text_raises_only_protocol_error(text: str) -> None:
    for candidate in (text, f"emberlink://{text}", f"emberlink://{NODE}@{text}"):
        try:
            ticket = Ticket.parse(candidate)
        except ProtocolError:
            continue
        assert Ticket.parse(str(ticket)) == ticket
