"""emberlink.transport."""
