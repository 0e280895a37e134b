"""The `emberlink` command: one small function per subcommand, registered on one subparsers object."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from emberlink.errors import ConfigError, EmberlinkError
from emberlink.graph_replay.backends import device_kinds
from emberlink.protocol.identity import Identity, default_key_path
from emberlink.protocol.ticket import Ticket

if TYPE_CHECKING:
    from emberlink.client.discovery import Seen
    from emberlink.client.trust import Trust

Handler = Callable[[argparse.Namespace], int]


def _add_client_key_file(p: argparse.ArgumentParser, flag: str) -> None:
    p.add_argument(
        flag,
        type=Path,
        default=None,
        help="key file (default: $EMBERLINK_KEY, else ~/.config/emberlink/client.key)",
    )


def add_keygen(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("keygen", help="write a new identity key (mode 0600) and print its NodeId")
    _add_client_key_file(p, "--out")
    p.add_argument("--force", action="store_true", help="overwrite an existing key file")
    p.set_defaults(run=keygen)


def keygen(args: argparse.Namespace) -> int:
    path: Path = args.out if args.out is not None else default_key_path()
    if path.exists() and not args.force:
        raise ConfigError(
            f"{path} already exists (`emberlink id --key {path}` prints its NodeId); "
            "pass --force to replace it (its NodeId changes)"
        )
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create directory {path.parent}: {e.strerror}") from e
    identity = Identity.generate(os.urandom)
    identity.save(path, overwrite=args.force)
    print(identity.node_id)
    print(f"wrote {path}", file=sys.stderr)
    return 0


def add_id(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("id", help="print the NodeId of an existing key file")
    _add_client_key_file(p, "--key")
    p.set_defaults(run=show_id)


def show_id(args: argparse.Namespace) -> int:
    path: Path = args.key if args.key is not None else default_key_path()
    if not path.exists():
        raise ConfigError(f"{path} does not exist; `emberlink keygen --out {path}` creates it")
    print(Identity.load(path).node_id)
    return 0


# -- worker, ping, demo ------------------------------------------------------------------------------
# Their modules import gRPC and the backends, so they are imported when the command runs, which
# keeps `emberlink keygen` fast.


def _byte_count(text: str) -> int:
    """A byte count: digits with an optional K, M, G or T suffix (powers of 1024), e.g. 512M."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    suffix = t[-1:] if t[-1:] in units else ""
    number = t[: len(t) - len(suffix)]
    if not number.isdigit():
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 1073741824, 512M, 4G)")
    return int(number) * units[suffix]


def add_worker(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("worker", help="serve this machine's CPU or GPU to allowed clients")
    p.add_argument(
        "--listen", required=True, metavar="HOST:PORT", help="where to serve gRPC (port 0 picks one)"
    )
    p.add_argument(
        "--tcp-listen",
        metavar="HOST:PORT|off",
        help="where to serve the raw TCP transport, which clients prefer to gRPC (default: --listen's "
        "host and port + 1; port 0 when --listen's is 0); the ticket gets a tcp: address on the "
        "advertised host with this listener's port; 'off' serves gRPC only",
    )
    p.add_argument(
        "--key", required=True, type=Path, metavar="FILE", help="the worker's key file (mode 0600)"
    )
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--allow", type=Path, metavar="FILE", help="allowed client NodeIds, one a line")
    who.add_argument("--allow-any", action="store_true", help="admit every client (logged loudly)")
    p.add_argument("--device", default="cpu", help=f"{device_kinds()} (default: cpu)")
    p.add_argument("--ticket-file", type=Path, metavar="FILE", help="also write the ticket to this file")
    p.add_argument("--max-session-bytes", type=_byte_count, metavar="N", help="bytes one session may hold")
    limits = p.add_argument_group("limits", "governance (defaults scale to the device; see server/limits.py)")
    limits.add_argument(
        "--max-worker-bytes",
        type=_byte_count,
        metavar="N",
        help="bytes all sessions together may hold (default: 3/4 of the device's memory)",
    )
    limits.add_argument("--max-graph-nodes", type=_byte_count, metavar="N", help="nodes of one graph (16384)")
    limits.add_argument(
        "--max-plan-elements", type=_byte_count, metavar="N", help="elements one graph run may touch"
    )
    limits.add_argument("--max-plan-flops", type=_byte_count, metavar="N", help="FLOPs one graph run may do")
    limits.add_argument(
        "--reply-timeout",
        type=float,
        metavar="SECONDS",
        help="end a session whose replies go unread this long (30)",
    )
    limits.add_argument(
        "--max-client-sessions", type=int, metavar="N", help="sessions one client NodeId may have open (16)"
    )
    limits.add_argument(
        "--max-client-detached",
        type=int,
        metavar="N",
        help="sessions of one client NodeId kept detached for a resume; past it the oldest ends (4)",
    )
    limits.add_argument(
        "--max-session-tensors",
        type=int,
        metavar="N",
        help="tensor ids one session may hold at once; past it the session ends (16384)",
    )
    p.add_argument(
        "--graph-cache-bytes",
        type=_byte_count,
        metavar="N",
        help="graph cache budget of each client, captured CUDA graphs included (default 64M, plus an "
        "eighth of a GPU's free memory on one; at most 64 clients keep one)",
    )
    p.add_argument(
        "--advertise",
        metavar="HOST:PORT",
        help="the gRPC address put in the ticket; its host also goes with the tcp: address",
    )
    p.add_argument("--relay", metavar="nats://HOST:PORT", help="also serve through this NATS relay")
    p.add_argument(
        "--resume-window",
        type=float,
        metavar="SECONDS",
        help="how long a session whose link dropped keeps its tensors for its client to resume "
        "(default 30; 0: a dropped link ends the session)",
    )
    p.add_argument(
        "--nats-creds",
        type=Path,
        metavar="FILE",
        help="the relay login: nkey seed file (`emberlink cluster nats-user`) or .creds file, mode 0600",
    )
    p.add_argument(
        "--nats-ca", type=Path, metavar="FILE", help="CA bundle to verify a relay that requires TLS"
    )
    p.add_argument(
        "--cluster-cert",
        type=Path,
        metavar="FILE",
        help="this worker's cluster certificate (`emberlink cluster sign`), carried in its presence",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(run=worker)


def worker(args: argparse.Namespace) -> int:
    from emberlink.server.daemon import worker_command

    return worker_command(args)


def add_ping(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("ping", help="time the handshake and round trips to a worker")
    p.add_argument("ticket", help="the worker's ticket (emberlink://...)")
    p.add_argument(
        "--key",
        type=Path,
        default=None,
        help="client key file (default: $EMBERLINK_KEY, else ~/.config/emberlink/client.key)",
    )
    p.add_argument("--count", type=int, default=10, help="round trips to time (default 10)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the worker (default 10)")
    p.set_defaults(run=ping)


def ping(args: argparse.Namespace) -> int:
    from emberlink.client.ping import ping as run_ping

    result = run_ping(args.ticket, key=args.key, count=args.count, timeout=args.timeout)
    print(f"worker {result.worker} via {result.path}")
    print(f"handshake: {result.handshake_s * 1e3:.2f} ms (including the admission round trip)")
    print(f"round trip: median {result.median_s * 1e3:.3f} ms over {len(result.round_trips_s)}")
    return 0


def add_demo(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("demo", help="train a small classifier through an in-process worker")
    p.add_argument("--epochs", type=int, default=30, help="passes over the training set (default 30)")
    p.set_defaults(run=demo)


def demo(args: argparse.Namespace) -> int:
    import logging

    from emberlink.server.demo import run_demo

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    result = run_demo(epochs=args.epochs)
    return 0 if result["accuracy"] > 0.9 else 1


def add_cluster(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("cluster", help="workers on a NATS relay, and the keys that make them trusted")
    actions = p.add_subparsers(title="actions", metavar="ACTION")
    ls = actions.add_parser("ls", help="list the workers whose presence the relay carries")
    ls.add_argument("--nats", required=True, metavar="URL", help="the relay, nats://HOST:PORT")
    ls.add_argument("--window", type=float, default=2.5, help="seconds to listen at most (default 2.5)")
    ls.set_defaults(run=cluster_ls)

    init = actions.add_parser("init", help="create a cluster key (mode 0600) and print its cluster id")
    init.add_argument("--out", required=True, type=Path, metavar="FILE", help="where to write the key")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.set_defaults(run=cluster_init)

    sign = actions.add_parser("sign", help="certify a worker's NodeId with the cluster key")
    sign.add_argument("--cluster-key", required=True, type=Path, metavar="FILE", help="the cluster key")
    sign.add_argument(
        "--worker-id", required=True, metavar="NODEID", help="the worker's NodeId (`emberlink id`)"
    )
    sign.add_argument(
        "--out", required=True, type=Path, metavar="FILE", help="where to write the certificate"
    )
    sign.add_argument(
        "--days", type=int, default=0, help="days the certificate is good for (default 0: no end)"
    )
    sign.add_argument("--force", action="store_true", help="overwrite an existing file")
    sign.set_defaults(run=cluster_sign)

    user = actions.add_parser("nats-user", help="create a relay login and the NATS permissions of its role")
    user.add_argument("--role", required=True, choices=["worker", "client"], help="who logs in with it")
    user.add_argument("--worker-id", metavar="NODEID", help="the worker's NodeId (role worker)")
    user.add_argument("--out", required=True, type=Path, metavar="FILE", help="where to write the nkey seed")
    user.add_argument(
        "--users-conf", type=Path, metavar="FILE", help="also add the user to this nats-server users file"
    )
    user.add_argument("--force", action="store_true", help="overwrite an existing seed file")
    user.set_defaults(run=cluster_nats_user)

    def usage(_args: argparse.Namespace) -> int:
        p.print_help(sys.stderr)
        return 2

    p.set_defaults(run=usage)


def cluster_ls(args: argparse.Namespace) -> int:
    from emberlink.client.discovery import survey
    from emberlink.client.trust import Trust

    trust = Trust.load()
    seen = survey(args.nats, window=args.window)
    if not seen:
        print(f"no worker seen on {args.nats} within {args.window} s", file=sys.stderr)
        return 1
    print(cluster_table(seen, trust, time.time()))
    return 0


def cluster_init(args: argparse.Namespace) -> int:
    path: Path = args.out
    if path.exists() and not args.force:
        raise ConfigError(f"{path} already exists; pass --force to replace it (its cluster id changes)")
    cluster = Identity.generate(os.urandom)
    cluster.save(path, overwrite=args.force)
    print(cluster.node_id)
    print(
        f"wrote {path}; certify workers with `emberlink cluster sign --cluster-key {path} ...`, and have "
        f"clients trust the cluster: EMBERLINK_CLUSTER={cluster.node_id}, or the line "
        f"`@cluster {cluster.node_id}` in their known_workers file",
        file=sys.stderr,
    )
    return 0


def cluster_sign(args: argparse.Namespace) -> int:
    from emberlink.errors import ProtocolError
    from emberlink.protocol.cluster import issue

    if args.days < 0:
        raise ConfigError("--days must be 0 (no end) or more")
    cluster = Identity.load(args.cluster_key)
    not_after = int(time.time()) + args.days * 86400 if args.days else 0
    try:
        cert = issue(cluster, args.worker_id, not_after)
    except ProtocolError as e:
        raise ConfigError(f"--worker-id: {e}") from e
    cert.save(args.out, overwrite=args.force)
    until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(not_after)) if not_after else "no end"
    print(f"worker {cert.worker_id} certified by cluster {cert.cluster_id} until {until}")
    print(f"wrote {args.out}; start the worker with --cluster-cert {args.out}", file=sys.stderr)
    return 0


def cluster_nats_user(args: argparse.Namespace) -> int:
    from emberlink.transport.nats_access import create_user_seed
    from emberlink.transport.nats_permissions import Role, add_user, user_entry

    role = Role(args.role)
    if (role is Role.WORKER) != (args.worker_id is not None):
        raise ConfigError("--worker-id is needed for --role worker, and only then")
    if args.worker_id is not None:
        from emberlink.errors import ProtocolError
        from emberlink.protocol.identity import public_from_node_id

        try:
            public_from_node_id(args.worker_id)
        except ProtocolError as e:
            raise ConfigError(f"--worker-id: {e}") from e
    conf = ""
    if args.users_conf is not None and args.users_conf.exists():
        conf = _read_text(args.users_conf)
    public = create_user_seed(args.out, overwrite=args.force)
    entry = user_entry(role, public, args.worker_id)
    print(entry)
    print(f"wrote {args.out} (relay user {public}; keep it secret, mode 0600)", file=sys.stderr)
    if args.users_conf is not None:
        try:
            updated = add_user(conf, entry)
        except ValueError as e:
            raise ConfigError(f"{args.users_conf}: {e}") from e
        try:
            args.users_conf.write_text(updated, encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot write {args.users_conf}: {e.strerror}") from e
        print(f"added it to {args.users_conf}", file=sys.stderr)
    return 0


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e


def cluster_table(seen: Sequence[Seen], trust: Trust | None = None, now: float = 0.0) -> str:
    """One row per worker: short NodeId, device, free memory, load, direct addresses, relay, admits,
    and whether this client trusts it (and why)."""
    header = ("node", "device", "free", "load", "addresses", "relay", "admits", "trusted")
    rows = [header]
    for s in seen:
        p = s.presence
        own = Ticket.parse(p.ticket)
        why = trust.why(p, now) if trust is not None else None
        rows.append(
            (
                s.node_id[:12],
                p.device + (" (draining)" if p.draining else ""),
                _bytes_text(p.free_bytes),
                f"{p.sessions} session{'' if p.sessions == 1 else 's'}, {p.queued} queued",
                _addresses_text(own),
                own.relay or "-",
                "anyone" if p.admits_anyone else "allow list",
                (why[: len("cluster ") + 12] if why else "no"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def _addresses_text(ticket: Ticket) -> str:
    """The ticket's direct addresses as it writes them: tcp ones first, then gRPC; "-" if none."""
    text = str(ticket).partition("@")[2].partition("?")[0]
    return text or "-"


def _bytes_text(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


# Each subcommand module adds itself here: a function that registers a parser whose defaults
# set `run` to the handler.
COMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    add_keygen,
    add_id,
    add_worker,
    add_ping,
    add_demo,
    add_cluster,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="emberlink", description="Use a GPU on another machine as if it were local."
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Handler | None = getattr(args, "run", None)
    if run is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return run(args)
    except EmberlinkError as e:
        print(f"emberlink: error: {e}", file=sys.stderr)
        return 1
