"""Tests of emberlink.protocol."""
