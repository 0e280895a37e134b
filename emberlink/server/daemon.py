"""`emberlink worker`: configuration, listeners, the ticket, signals; the worker process's main.

Start-up errors (a missing or unreadable key, a malformed allow file, a bad flag) are reported
in one line and exit with status 2. The ticket is the first line of stdout, flushed at once,
so a parent process can read it; logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emberlink.errors import ConfigError, DeviceError, EmberlinkError, TransportError
from emberlink.graph_replay.backends import parse_device
from emberlink.protocol.cluster import Certificate
from emberlink.protocol.identity import AllowPolicy, Identity
from emberlink.protocol.ticket import Ticket, format_addr
from emberlink.server.detached import DEFAULT_RESUME_WINDOW
from emberlink.server.limits import Limits
from emberlink.server.worker import Worker
from emberlink.transport.grpc import GrpcListener
from emberlink.transport.loop import new_event_loop
from emberlink.transport.malloc import tune_malloc
from emberlink.transport.tcp import TcpListener

log = logging.getLogger("emberlink.server")

DRAIN_GRACE = 10.0


@dataclass(frozen=True)
class WorkerConfig:
    identity: Identity
    allow: AllowPolicy
    host: str
    port: int
    advertise: tuple[str, int] | None
    device: str
    relay: str | None
    ticket_file: Path | None
    limits: Limits
    graph_cache_bytes: int | None  # None: the device's default (server.worker.default_graph_cache_bytes)
    nats_creds: Path | None = None
    nats_ca: Path | None = None
    cluster_cert: Certificate | None = None
    resume_window: float = DEFAULT_RESUME_WINDOW
    tcp: tuple[str, int] | None = None  # where raw TCP (transport/tcp.py) listens; None: --tcp-listen off


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port`; ConfigError otherwise."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigError(f"{what} must be HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_text)


TCP_OFF = "off"
"""`--tcp-listen off`: serve gRPC only."""


def tcp_address(flag: str | None, host: str, port: int) -> tuple[str, int] | None:
    """Where raw TCP listens: `--tcp-listen HOST:PORT`; without it, --listen's host and port + 1 (port 0
    stays 0: the system picks one); None for `--tcp-listen off`."""
    if flag is None:
        if port == 65535:
            raise ConfigError(
                "--listen's port is 65535, so raw TCP has no port + 1 to take: "
                f"pass --tcp-listen HOST:PORT, or --tcp-listen {TCP_OFF} to serve gRPC only"
            )
        return host, port + 1 if port else 0
    if flag.strip().lower() == TCP_OFF:
        return None
    return parse_host_port(flag, "--tcp-listen")


def load_config(args: argparse.Namespace) -> WorkerConfig:
    """Everything the worker needs from its flags and files; ConfigError or DeviceError if unusable."""
    identity = Identity.load(args.key)
    allow = AllowPolicy.allow_any() if args.allow_any else AllowPolicy.from_file(args.allow)
    host, port = parse_host_port(args.listen, "--listen")
    advertise = parse_host_port(args.advertise, "--advertise") if args.advertise else None
    tcp = tcp_address(args.tcp_listen, host, port)
    device = str(parse_device(args.device))
    if args.relay is not None and not args.relay.startswith("nats://"):
        raise ConfigError(f"--relay must be nats://HOST:PORT, got {args.relay!r}")
    nats_creds, nats_ca, cert_path = args.nats_creds, args.nats_ca, args.cluster_cert
    if args.relay is None and (nats_creds or nats_ca or cert_path):
        raise ConfigError("--nats-creds, --nats-ca and --cluster-cert are for a worker with --relay")
    cluster_cert = Certificate.load(cert_path) if cert_path is not None else None
    if cluster_cert is not None:
        check_certificate(cluster_cert, identity.node_id, time.time())
    resume_window = DEFAULT_RESUME_WINDOW if args.resume_window is None else args.resume_window
    if not 0 <= resume_window <= 86400:
        raise ConfigError(f"--resume-window must be 0..86400 seconds, got {resume_window:g}")
    limits = Limits(
        max_session_bytes=args.max_session_bytes,
        max_worker_bytes=args.max_worker_bytes,
        max_graph_nodes=args.max_graph_nodes,
        max_plan_elements=args.max_plan_elements,
        max_plan_flops=args.max_plan_flops,
        reply_timeout=args.reply_timeout,
        max_client_sessions=args.max_client_sessions,
        max_client_detached=args.max_client_detached,
        max_session_tensors=args.max_session_tensors,
    )
    for flag, value in (
        ("--max-session-bytes", limits.max_session_bytes),
        ("--max-worker-bytes", limits.max_worker_bytes),
        ("--max-graph-nodes", limits.max_graph_nodes),
        ("--max-plan-elements", limits.max_plan_elements),
        ("--max-plan-flops", limits.max_plan_flops),
        ("--reply-timeout", limits.reply_timeout),
        ("--max-client-sessions", limits.max_client_sessions),
        ("--max-client-detached", limits.max_client_detached),
        ("--max-session-tensors", limits.max_session_tensors),
    ):
        if value is not None and not value > 0:
            raise ConfigError(f"{flag} must be positive")
    return WorkerConfig(
        identity=identity,
        allow=allow,
        host=host,
        port=port,
        advertise=advertise,
        device=device,
        relay=args.relay,
        ticket_file=args.ticket_file,
        limits=limits,
        graph_cache_bytes=args.graph_cache_bytes,
        nats_creds=nats_creds,
        nats_ca=nats_ca,
        cluster_cert=cluster_cert,
        resume_window=resume_window,
        tcp=tcp,
    )


def check_certificate(cert: Certificate, node_id: str, now: float) -> None:
    """ConfigError unless `cert` is for this worker and in date."""
    if cert.worker_id != node_id:
        raise ConfigError(f"--cluster-cert is for worker {cert.worker_id}, not this one ({node_id})")
    if cert.not_after and now > cert.not_after:
        raise ConfigError(
            f"--cluster-cert expired at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(cert.not_after))}: "
            "sign a new one with `emberlink cluster sign`"
        )


def worker_command(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config = load_config(args)
    except (ConfigError, DeviceError) as e:
        print(f"emberlink worker: error: {e}", file=sys.stderr)
        return 2
    tune_malloc()
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            return runner.run(serve(config))
    except (ConfigError, DeviceError) as e:
        print(f"emberlink worker: error: {e}", file=sys.stderr)
        return 2
    except EmberlinkError as e:
        print(f"emberlink worker: error: {e}", file=sys.stderr)
        return 1


def ticket_for(config: WorkerConfig, port: int, tcp_port: int | None = None) -> Ticket:
    """The ticket clients use: the advertised address, else the listening one (0.0.0.0 → 127.0.0.1);
    with `tcp_port`, also `tcp:` that host and port (the raw TCP listener's)."""
    if config.advertise is not None:
        host, adv_port = config.advertise
        port = adv_port or port
    else:
        host = config.host
        if host in ("0.0.0.0", "::", ""):
            log.warning(
                "listening on %s but no --advertise given: the ticket says 127.0.0.1, which only this "
                "machine can use",
                host or "all interfaces",
            )
            host = "127.0.0.1"
    tcp = ((host, tcp_port),) if tcp_port is not None else ()
    if tcp and config.advertise is not None and config.advertise[1] not in (0, config.port):
        log.warning(
            "--advertise gives gRPC port %d, not the --listen port %d, but the ticket's tcp address keeps "
            "the tcp listener's own port %d: make that port reach this worker too (forward or publish "
            "it under the same number), or pass --tcp-listen %s",
            config.advertise[1],
            config.port,
            tcp_port,
            TCP_OFF,
        )
    return Ticket(config.identity.node_id, ((host, port),), relay=config.relay, tcp=tcp)


GC_THRESHOLDS = (20_000, 20, 10)
"""The cycle collector's thresholds in a worker process (CPython's defaults: 700, 10, 10). A
client sending 100,000 Syncs a blob (bench/fuzz.py --stall syncs) makes the worker allocate
millions of short-lived objects; at the defaults, those alive across a young collection (a batch
being applied, a reply being sent) were promoted until full collections ran about 5 times a
second, 25-110 ms each, pausing every session (the honest client's p99 latency: 130-190 ms).
With these thresholds and start-up frozen (`settle_collector`), one full collection ran in 10 s,
and the honest p99 was 27 ms. Sessions do not rely on the collector: what one held is freed
when it ends, without it (tests/server/test_governance.py)."""


def settle_collector() -> None:
    """Freeze what start-up made (modules, the backend, the listeners) out of the cycle collector's
    scans, and collect young objects less often (GC_THRESHOLDS)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def serve(config: WorkerConfig) -> int:
    """Run the worker until SIGTERM or SIGINT, then drain; returns the exit status."""
    worker = Worker(
        config.identity,
        config.allow,
        device=config.device,
        limits=config.limits,
        graph_cache_bytes=config.graph_cache_bytes,
        resume_window=config.resume_window,
    )
    listeners: list[Any] = []
    try:
        grpc_listener = GrpcListener(config.host, config.port, worker.handle)
        port = await grpc_listener.start()
        listeners.append(grpc_listener)
        tcp_port = await start_tcp(worker, config, listeners)
        ticket = ticket_for(config, port, tcp_port)
        if config.relay is not None:
            listeners.append(await start_relay(worker, config, ticket))
        # The file first: a parent that reads the first stdout line may look for the file at once.
        if config.ticket_file is not None:
            write_ticket(config.ticket_file, str(ticket))
        settle_collector()
        print(ticket, flush=True)
        log.info("worker %s serving %s on %s:%d", worker.node_id, config.device, config.host, port)
        await wait_for_signal()
        log.info("draining: finishing queued work, then closing %d session(s)", len(worker.sessions))
        await worker.drain()
        worker.log_stats()
    finally:
        for listener in listeners:
            await listener.stop(DRAIN_GRACE)
        worker.close()
    log.info("worker %s stopped", worker.node_id)
    return 0


async def start_tcp(worker: Worker, config: WorkerConfig, listeners: list[Any]) -> int | None:
    """Serve raw TCP where `config.tcp` says (appended to `listeners`); its port, or None when off.
    A port that cannot be had is a ConfigError that says what to pass instead."""
    if config.tcp is None:
        return None
    host, want = config.tcp
    listener = TcpListener(host, want, worker.handle)
    try:
        port = await listener.start()
    except TransportError as e:
        cause = e.__cause__
        why = os.strerror(cause.errno) if isinstance(cause, OSError) and cause.errno else str(e)
        raise ConfigError(
            f"cannot serve raw TCP on {format_addr(host, want)} (--tcp-listen; by default --listen's port + 1): {why}. "
            f"Pass --tcp-listen HOST:PORT to serve it on a free port, or --tcp-listen {TCP_OFF} to serve "
            "gRPC only"
        ) from e
    listeners.append(listener)
    log.info("worker %s also serving raw tcp on %s:%d", worker.node_id, config.tcp[0], port)
    return port


async def start_relay(worker: Worker, config: WorkerConfig, ticket: Ticket) -> Any:
    """Serve through the NATS relay and publish presence (server/relay.py)."""
    assert config.relay is not None
    try:
        from emberlink.server.relay import RelayService
        from emberlink.transport.nats_access import RelayAccess
    except ImportError as e:  # nats-py missing: transport.nats raises ImportError saying so
        raise ConfigError(f"--relay needs the NATS transport: pip install 'emberlink[nats]' ({e})") from e
    access = RelayAccess(config.nats_creds, config.nats_ca)
    access.connect_options()  # a credentials file or CA bundle that cannot be used stops start-up here
    if config.nats_creds is not None:
        log.info("logging in to the relay as %s (credentials from %s)", access.user(), config.nats_creds)
    if config.cluster_cert is not None:
        log.info("presence carries the certificate of cluster %s", config.cluster_cert.cluster_id)
    service = RelayService(worker, config.relay, ticket, access=access, certificate=config.cluster_cert)
    await service.start()  # a relay that is down now is retried in the background
    return service


def write_ticket(path: Path, ticket: str) -> None:
    """Write the ticket atomically (a reader never sees a half-written file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(ticket + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        raise ConfigError(f"cannot write ticket file {path}: {e.strerror}") from e


async def wait_for_signal() -> None:
    """Return on SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not on this platform, or not the main thread
            signal.signal(sig, lambda *_: loop.call_soon_threadsafe(stop.set))
    await stop.wait()
