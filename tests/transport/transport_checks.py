"""Checks every transport must pass, written once against the Link interface; no transport specifics."""

from __future__ import annotations

import asyncio
import os

from emberlink.transport.base import Link


async def echo(link: Link) -> None:
    """A worker handler that sends every blob straight back until the client goes away."""
    while True:
        await link.send(await link.recv())


def blobs(sizes: list[int]) -> list[bytes]:
    return [os.urandom(n) for n in sizes]


async def ping_pong(link: Link, sent: list[bytes]) -> list[bytes]:
    got = []
    for blob in sent:
        await link.send(blob)
        got.append(await link.recv())
    return got


async def pipelined(link: Link, sent: list[bytes]) -> list[bytes]:
    """Send everything while receiving concurrently: order and wholeness under load."""

    async def sender() -> None:
        for blob in sent:
            await link.send(blob)

    task = asyncio.create_task(sender())
    got = [await link.recv() for _ in sent]
    await task
    return got
