"""``python -m serve_app.batch`` still works for one release: it says the new name and runs it."""

from __future__ import annotations

import sys

from serve_app.offline.__main__ import main

if __name__ == "__main__":
    print(
        "note: `python -m serve_app.batch` is now `python -m serve_app.offline`; "
        "the old name goes away in the next release.",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(main())
