"""The worker command's configuration: addresses, tickets, byte counts; no processes here."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
from pathlib import Path

import pytest

from emberlink.cli import _byte_count, build_parser
from emberlink.errors import ConfigError
from emberlink.protocol.identity import Identity
from emberlink.protocol.ticket import Ticket
from emberlink.server.daemon import (
    GC_THRESHOLDS,
    WorkerConfig,
    load_config,
    parse_host_port,
    settle_collector,
    tcp_address,
    ticket_for,
    write_ticket,
)
from emberlink.server.limits import Limits


def config(host: str, advertise: tuple[str, int] | None = None, relay: str | None = None) -> WorkerConfig:
    from emberlink.protocol.identity import AllowPolicy

    return WorkerConfig(
        identity=Identity.generate(os.urandom),
        allow=AllowPolicy.allow_any(),
        host=host,
        port=0,
        advertise=advertise,
        device="cpu",
        relay=relay,
        ticket_file=None,
        limits=Limits(),
        graph_cache_bytes=1 << 20,
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:0", ("127.0.0.1", 0)), ("[::1]:7443", ("::1", 7443)), ("gpu-box:80", ("gpu-box", 80))],
)
def test_listen_addresses_parse_host_and_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(text, "--listen") == expected


@pytest.mark.parametrize("text", ["7443", "host:", ":7443", "host:99999", "host:http"])
def test_malformed_listen_addresses_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="HOST:PORT"):
        parse_host_port(text, "--listen")


def test_ticket_names_the_picked_port_and_the_listening_host() -> None:
    cfg = config("127.0.0.1")
    assert Ticket.parse(str(ticket_for(cfg, 40123))).addrs == (("127.0.0.1", 40123),)


def test_wildcard_listen_without_advertise_puts_loopback_in_the_ticket_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="emberlink.server"):
        ticket = ticket_for(config("0.0.0.0"), 7443)
    assert ticket.addrs == (("127.0.0.1", 7443),)
    assert "--advertise" in caplog.text


def test_advertise_sets_the_address_in_the_ticket_and_relay_is_kept() -> None:
    cfg = config("0.0.0.0", advertise=("gpu-box.example", 9000), relay="nats://relay.example:4222")
    ticket = ticket_for(cfg, 7443)
    assert ticket.addrs == (("gpu-box.example", 9000),)
    assert ticket.relay == "nats://relay.example:4222"


def test_advertise_puts_the_tcp_listeners_port_on_the_advertised_host_and_warns_of_a_remapped_port(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = config("0.0.0.0", advertise=("gpu-box.example", 9000))
    with caplog.at_level(logging.WARNING, logger="emberlink.server"):
        ticket = ticket_for(cfg, 7443, 7444)
    assert (ticket.tcp, ticket.addrs) == ((("gpu-box.example", 7444),), (("gpu-box.example", 9000),))
    assert str(ticket).startswith(f"emberlink://{cfg.identity.node_id}@tcp:gpu-box.example:7444,")
    assert "tcp listener's own port 7444" in caplog.text and "--tcp-listen off" in caplog.text


def test_advertising_the_listen_port_puts_tcp_in_the_ticket_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = dataclasses.replace(config("0.0.0.0", advertise=("gpu-box.example", 7443)), port=7443)
    with caplog.at_level(logging.WARNING, logger="emberlink.server"):
        ticket = ticket_for(cfg, 7443, 7444)
    assert str(ticket) == f"emberlink://{cfg.identity.node_id}@tcp:gpu-box.example:7444,gpu-box.example:7443"
    assert caplog.text == ""


def worker_args(*flags: str, key: Path) -> argparse.Namespace:
    return build_parser().parse_args(["worker", "--key", str(key), "--allow-any", *flags])


@pytest.mark.parametrize(
    ("listen", "tcp"),
    [("0.0.0.0:7443", ("0.0.0.0", 7444)), ("127.0.0.1:0", ("127.0.0.1", 0)), ("[::1]:9000", ("::1", 9001))],
)
def test_raw_tcp_listens_on_the_listen_host_and_port_plus_one_by_default(
    tmp_path: Path, listen: str, tcp: tuple[str, int]
) -> None:
    key = tmp_path / "w.key"
    Identity.generate(os.urandom).save(key)
    assert load_config(worker_args("--listen", listen, key=key)).tcp == tcp


def test_tcp_listen_takes_an_address_of_its_own_and_off_serves_grpc_only(tmp_path: Path) -> None:
    key = tmp_path / "w.key"
    Identity.generate(os.urandom).save(key)
    own = worker_args("--listen", "0.0.0.0:7443", "--tcp-listen", "10.0.0.5:9999", key=key)
    assert load_config(own).tcp == ("10.0.0.5", 9999)
    assert load_config(worker_args("--listen", "0.0.0.0:7443", "--tcp-listen", "off", key=key)).tcp is None
    with pytest.raises(ConfigError, match="--tcp-listen must be HOST:PORT"):
        load_config(worker_args("--listen", "0.0.0.0:7443", "--tcp-listen", "7444", key=key))


def test_a_listen_port_of_65535_asks_for_tcp_listen() -> None:
    with pytest.raises(ConfigError, match="pass --tcp-listen HOST:PORT, or --tcp-listen off"):
        tcp_address(None, "0.0.0.0", 65535)
    assert tcp_address("127.0.0.1:1", "0.0.0.0", 65535) == ("127.0.0.1", 1)


@pytest.mark.parametrize(
    ("text", "n"), [("1024", 1024), ("512M", 512 << 20), ("4G", 4 << 30), ("2MiB", 2 << 20)]
)
def test_byte_counts_take_binary_suffixes(text: str, n: int) -> None:
    assert _byte_count(text) == n


def test_a_bad_byte_count_is_refused_by_the_parser() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        _byte_count("lots")


def test_allow_and_allow_any_are_exclusive_and_one_is_required(tmp_path: Path) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["worker", "--listen", "127.0.0.1:0", "--key", "k"])
    with pytest.raises(SystemExit):
        parser.parse_args(["worker", "--listen", "127.0.0.1:0", "--key", "k", "--allow", "a", "--allow-any"])


def test_load_config_reads_key_allow_and_flags(tmp_path: Path) -> None:
    key = tmp_path / "w.key"
    identity = Identity.generate(os.urandom)
    identity.save(key)
    allow = tmp_path / "allow"
    client = Identity.generate(os.urandom).node_id
    allow.write_text(f"# one client\n{client}\n")
    args = build_parser().parse_args(
        ["worker", "--listen", "0.0.0.0:0", "--key", str(key), "--allow", str(allow)]
        + ["--max-session-bytes", "1G", "--advertise", "box:7443", "--device", "cpu"]
    )
    cfg = load_config(args)
    assert cfg.identity.node_id == identity.node_id
    assert cfg.allow.admits(client) and not cfg.allow.admits(identity.node_id)
    assert (cfg.limits.max_session_bytes, cfg.advertise) == (1 << 30, ("box", 7443))


def test_governance_flags_reach_the_workers_limits(tmp_path: Path) -> None:
    key = tmp_path / "w.key"
    Identity.generate(os.urandom).save(key)
    args = build_parser().parse_args(
        ["worker", "--listen", "127.0.0.1:0", "--key", str(key), "--allow-any"]
        + ["--max-worker-bytes", "2G", "--max-graph-nodes", "1000", "--max-plan-elements", "64M"]
        + ["--max-plan-flops", "1G", "--reply-timeout", "2.5"]
        + ["--max-client-sessions", "3", "--max-client-detached", "1"]
    )
    assert load_config(args).limits == Limits(
        max_worker_bytes=2 << 30,
        max_graph_nodes=1000,
        max_plan_elements=64 << 20,
        max_plan_flops=1 << 30,
        reply_timeout=2.5,
        max_client_sessions=3,
        max_client_detached=1,
    )


@pytest.mark.parametrize(
    "flag", ["--max-worker-bytes", "--max-graph-nodes", "--reply-timeout", "--max-client-detached"]
)
def test_a_limit_that_is_not_positive_is_a_config_error(tmp_path: Path, flag: str) -> None:
    key = tmp_path / "w.key"
    Identity.generate(os.urandom).save(key)
    args = build_parser().parse_args(
        ["worker", "--listen", "127.0.0.1:0", "--key", str(key), "--allow-any", flag, "0"]
    )
    with pytest.raises(ConfigError, match=flag):
        load_config(args)


def test_unknown_device_is_a_config_error(tmp_path: Path) -> None:
    key = tmp_path / "w.key"
    Identity.generate(os.urandom).save(key)
    args = build_parser().parse_args(["worker", "--listen", "127.0.0.1:0", "--key", str(key), "--allow-any"])
    args.device = "tpu:0"
    with pytest.raises(ConfigError, match="cpu or cuda:N"):
        load_config(args)


def test_the_ticket_file_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "ticket"
    path.write_text("an old ticket that is much longer than the new one\n")
    write_ticket(path, "emberlink://x")
    assert path.read_text() == "emberlink://x\n"
    assert [p.name for p in tmp_path.iterdir()] == ["ticket"]


def test_the_default_cache_budget_grows_by_an_eighth_of_a_devices_free_memory() -> None:
    from emberlink.graph_replay.numpy_backend import NumpyBackend
    from emberlink.server.worker import DEFAULT_GRAPH_CACHE_BYTES, default_graph_cache_bytes

    class Gpu(NumpyBackend):
        def free_bytes(self) -> int:
            return 80 << 30

    assert default_graph_cache_bytes(NumpyBackend()) == DEFAULT_GRAPH_CACHE_BYTES  # host memory: plans only
    assert default_graph_cache_bytes(Gpu()) == DEFAULT_GRAPH_CACHE_BYTES + (10 << 30)  # captures too


def test_a_worker_process_freezes_start_up_out_of_the_collectors_scans() -> None:
    thresholds = gc.get_threshold()
    try:
        settle_collector()
        assert gc.get_freeze_count() > 0 and gc.get_threshold() == GC_THRESHOLDS
        assert GC_THRESHOLDS[0] > thresholds[0]
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
