"""The ``speechbrain-fl`` console script moved to :mod:`speechbrain_fl.cli`; re-exported here.

``python -m speechbrain_fl.privacy.cli`` keeps working.
"""

from __future__ import annotations

from speechbrain_fl.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
