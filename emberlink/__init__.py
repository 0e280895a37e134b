"""emberlink: use a GPU on another machine as if it were local."""

from emberlink import errors

__all__ = ["errors"]
