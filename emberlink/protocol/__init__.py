"""Sans-IO protocol: identities, tickets, handshake, frames, messages; no sockets, asyncio, clocks or global randomness."""
