#!/usr/bin/env python3
"""`python scripts/bench.py ...`: `empanel-gguf bench ...` (empanel_gguf/commands/bench.py) on the
working tree's package and build, as the tests use them, not an older installed copy, with issue
4's targets (bench_targets.py, kept out of the shipped package) printed after the tables.
EMPANEL_BENCH_INSTALLED=1 measures the installed package instead."""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if not os.environ.get("EMPANEL_BENCH_INSTALLED") and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_targets import TITLE, targets  # noqa: E402
from empanel_gguf.commands.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], reports=[(TITLE, targets)]))
