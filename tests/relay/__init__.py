"""Tests through a NATS relay: relayed sessions, presence, discovery, loss of the relay."""
