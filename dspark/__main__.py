"""`python -m dspark ...`: the same command line as the `dspark` script (dspark/cli.py)."""

from __future__ import annotations

import sys

from dspark.cli import main

if __name__ == "__main__":
    sys.exit(main())
