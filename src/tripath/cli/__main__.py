"""``python -m tripath.cli``: the ``tripath`` command."""

from tripath.cli import main

raise SystemExit(main())
