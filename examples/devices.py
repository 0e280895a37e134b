"""The `--device` argument every example takes and the Device it names; no data, no training."""

from __future__ import annotations

import argparse

import emberlink as el


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu, cuda:N, or a worker ticket (default: cpu)")


def open_device(spec: str) -> el.Device:
    """`cpu`, `cuda` or `cuda:N`, or a worker's ticket / a `nats://` relay address."""
    if spec == "cpu":
        return el.Device.cpu()
    if spec.startswith("cuda"):
        return el.Device.cuda(int(spec.partition(":")[2] or 0))
    return el.Device.remote(spec)
