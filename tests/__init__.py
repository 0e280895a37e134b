"""emberlink's test suite; a package, so that every test module has its own dotted name."""
