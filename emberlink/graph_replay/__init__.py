"""emberlink.graph_replay."""
