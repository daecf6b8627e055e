"""Write docs/options.md from the MoE options' table (empanel_gguf/planning/options.py).

    python3 scripts/options_doc.py           # write it
    python3 scripts/options_doc.py --check   # exit 1 if it differs (tests/test_seams.py checks too)
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from empanel_gguf.planning.options import markdown  # noqa: E402


def main():
    path = REPO / "docs" / "options.md"
    text = markdown()
    if "--check" in sys.argv[1:]:
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is stale: python3 scripts/options_doc.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
