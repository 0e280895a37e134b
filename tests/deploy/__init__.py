"""Tests of the deploy/ files."""
