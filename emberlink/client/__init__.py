"""emberlink.client."""
