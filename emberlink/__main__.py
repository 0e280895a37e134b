"""`python -m emberlink` runs the `emberlink` command."""

from emberlink.cli import main

raise SystemExit(main())
