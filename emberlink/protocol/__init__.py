"""emberlink.protocol."""
