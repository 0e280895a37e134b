"""End-to-end tests of the `emberlink` command in separate processes."""
