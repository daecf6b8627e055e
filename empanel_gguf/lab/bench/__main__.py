"""`python -m empanel_gguf.lab.bench`: the benchmark's command line (the parent runs its children so)."""

import sys

from .cli import main

sys.exit(main())
