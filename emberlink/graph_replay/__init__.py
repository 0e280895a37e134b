"""The graph IR, op table, canonical form, plans, graph cache and backends; imports no transport, server or client.

Import the modules directly (`emberlink.graph_replay.ops`, `.plan`, `.numpy_backend`, ...); this
package imports nothing on its own, so a client never loads a backend it does not use.
"""
