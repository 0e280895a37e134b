"""Tests of emberlink.transport."""
