"""Tests of emberlink.server."""
