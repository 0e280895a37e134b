"""Tests of emberlink.graph_replay."""
