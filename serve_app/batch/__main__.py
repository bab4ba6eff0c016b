"""``python -m serve_app.batch`` still works for one release: it names the new command, runs it."""

from __future__ import annotations

import sys

from serve_app.offline.__main__ import main

NOTE = (
    "note: `python -m serve_app.batch` is now `python -m serve_app.offline`; "
    "the old name goes away in the next release"
)

if __name__ == "__main__":
    print(NOTE, file=sys.stderr, flush=True)
    sys.exit(main())
