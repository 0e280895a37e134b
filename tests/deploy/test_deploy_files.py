"""deploy/ agrees with the CLI: every worker command in the compose file, the Dockerfile and the systemd
unit is accepted by `emberlink`'s own parser, and the image's entry point runs."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import pytest

from emberlink.cli import build_parser
from emberlink.graph_replay.backends import parse_device
from emberlink.server.daemon import parse_host_port, tcp_address

yaml = pytest.importorskip("yaml", reason="PyYAML is in the dev extra; install it to check the compose file")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
_DEFAULTED = re.compile(r"\$\{(\w+):-([^}]*)\}")


def parse(argv: list[str]) -> argparse.Namespace:
    """What `emberlink ARGV` would run with; fails the test with argparse's complaint instead of exiting."""
    parser = build_parser()

    def error(message: str) -> NoReturn:
        raise AssertionError(f"emberlink {shlex.join(argv)}: {message}")

    for p in [parser, *_subparsers(parser)]:
        p.error = error  # type: ignore[method-assign]
    return parser.parse_args(argv)


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += [sub, *_subparsers(sub)]
    return found


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    return loaded


def workers() -> dict[str, dict[str, Any]]:
    return {
        name: svc for name, svc in compose()["services"].items() if svc.get("command", [None])[0] == "worker"
    }


def substitute(word: str) -> str:
    """Compose's `${VAR:-default}` with the default (what runs when VAR is unset)."""
    return _DEFAULTED.sub(lambda m: m.group(2), word)


def nats_conf() -> dict[str, str]:
    pairs = (line.split(":", 1) for line in (DEPLOY / "nats.conf").read_text().splitlines())
    return {
        k.strip(): value.strip().strip('"')
        for k, *rest in pairs
        if k.strip() and not k.startswith("#")
        for value in rest
    }


def check_worker_args(args: argparse.Namespace) -> None:
    """The values are well formed too, as the worker checks them at start-up (keys aside)."""
    assert args.run.__name__ == "worker"
    host, port = parse_host_port(args.listen, "--listen")
    tcp_address(args.tcp_listen, host, port)
    if args.advertise:
        parse_host_port(args.advertise, "--advertise")
    parse_device(args.device)
    assert args.relay is None or args.relay.startswith("nats://")


def test_compose_file_parses_into_a_nats_relay_and_workers():
    services = compose()["services"]
    assert "nats" in services
    assert len(workers()) >= 1


def test_every_compose_worker_command_is_accepted_by_the_cli():
    for name, svc in workers().items():
        args = parse([substitute(str(word)) for word in svc["command"]])
        check_worker_args(args)
        assert args.key.parent == Path("/etc/emberlink"), name
        assert any(v.endswith(":/etc/emberlink:ro") for v in svc["volumes"]), name


def test_compose_workers_reach_the_relay_service_and_advertise_their_published_ports():
    port = nats_conf()["port"]
    assert f"{port}:{port}" in compose()["services"]["nats"]["ports"]
    for name, svc in workers().items():
        args = parse([substitute(str(word)) for word in svc["command"]])
        assert args.relay == f"nats://nats:{port}", name
        host, listen_port = parse_host_port(args.listen, "--listen")
        _, advertised_port = parse_host_port(args.advertise, "--advertise")
        assert f"{advertised_port}:{listen_port}" in svc["ports"], name
        assert str(listen_port) in " ".join(svc["healthcheck"]["test"]), name
        tcp = tcp_address(args.tcp_listen, host, listen_port)
        assert tcp is not None, f"{name} serves raw TCP, the path clients try first"
        # The ticket carries the tcp listener's own port: it must be published under that number.
        assert f"{tcp[1]}:{tcp[1]}" in svc["ports"], name
        assert str(tcp[1]) in " ".join(svc["healthcheck"]["test"]), name


def test_compose_workers_publish_no_port_twice():
    published = [p.split(":")[0] for svc in workers().values() for p in svc["ports"]]
    assert len(published) == len(set(published)), published


def test_nats_healthcheck_uses_the_monitoring_port_of_nats_conf():
    check = " ".join(compose()["services"]["nats"]["healthcheck"]["test"])
    assert f"127.0.0.1:{nats_conf()['http_port']}/healthz" in check


def _dockerfile_instruction(name: str) -> list[str]:
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith(name + " "):
            words: list[str] = json.loads(line[len(name) + 1 :])
            return words
    raise AssertionError(f"Dockerfile has no {name}")


def test_dockerfile_entrypoint_and_cmd_are_accepted_by_the_cli():
    entrypoint, cmd = _dockerfile_instruction("ENTRYPOINT"), _dockerfile_instruction("CMD")
    assert entrypoint == ["emberlink"]
    check_worker_args(parse(cmd))


def test_dockerfile_exposes_the_grpc_and_raw_tcp_ports_its_cmd_serves():
    args = parse(_dockerfile_instruction("CMD"))
    host, port = parse_host_port(args.listen, "--listen")
    tcp = tcp_address(args.tcp_listen, host, port)
    assert tcp is not None
    (expose,) = [
        line.split()[1:]
        for line in (DEPLOY / "Dockerfile").read_text().splitlines()
        if line.startswith("EXPOSE ")
    ]
    assert sorted(expose) == sorted([str(port), str(tcp[1])])


def test_systemd_execstart_is_accepted_by_the_cli():
    lines = (DEPLOY / "emberlink-worker.service").read_text().splitlines()
    (exec_start,) = [line.partition("=")[2] for line in lines if line.startswith("ExecStart=")]
    program, *argv = shlex.split(exec_start)
    assert Path(program).name == "emberlink"
    check_worker_args(parse(argv))


def readme_commands() -> list[list[str]]:
    """The arguments of every `emberlink` (or `.../bin/emberlink`) run in the README's bash blocks."""
    text = (DEPLOY / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            lexer.commenters = "#"
            command: list[str] = []
            for word in [*lexer, ";"]:
                if word in (";", "&&", "||", "|", ">", ">>"):
                    commands += _emberlink_args(command)
                    command = [] if word not in (">", ">>") else ["#redirected"]
                elif command[:1] != ["#redirected"]:
                    command.append(word)
    return commands


def _emberlink_args(words: list[str]) -> list[list[str]]:
    for i, word in enumerate(words):
        program = word == "emberlink" or word.endswith("/bin/emberlink")
        if program and (i == 0 or not words[i - 1].startswith("-")) and i + 1 < len(words):
            return [words[i + 1 :]]
    return []


def test_readme_emberlink_commands_are_accepted_by_the_cli():
    commands = readme_commands()
    assert ["cluster", "ls", "--nats", "nats://gpu-box.example:4222"] in commands
    for argv in commands:
        parse(argv)


@pytest.mark.parametrize("argv", [["--help"], ["worker", "--help"], ["cluster", "ls", "--help"]])
def test_image_entry_point_runs(argv):
    done = subprocess.run(
        [sys.executable, "-m", "emberlink", *argv], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "usage: emberlink" in done.stdout
