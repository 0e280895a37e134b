"""emberlink.server."""
