"""A copy of `src/` with text replacements, for A/B runs of code variants in one device call.

    python3 benchmarks/device/variant_tree.py DEST 'RELPATH|||OLD|||NEW' [...]
    PYTHONPATH=DEST python3 benchmarks/device/rank_e2e.py ...   # the variant; PYTHONPATH=src the tree

RELPATH is relative to `src/hylo/`; `\\n` in OLD and NEW stands for a newline. Each OLD must occur exactly
once in its file (else the copy is removed and the script exits non-zero, so a run never times an unpatched
copy as the variant). The package's assets (the demo model) are not copied.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    dest, root = Path(sys.argv[1]), Path(__file__).resolve().parents[2] / "src"
    shutil.copytree(root, dest, ignore=shutil.ignore_patterns("assets", "__pycache__"))
    for spec in sys.argv[2:]:
        rel, old, new = (part.replace("\\n", "\n") for part in spec.split("|||"))
        path = dest / "hylo" / rel
        text = path.read_text()
        if text.count(old) != 1:
            shutil.rmtree(dest)
            sys.exit(f"variant_tree: {rel} has {text.count(old)} occurrences of {old!r}, not one")
        path.write_text(text.replace(old, new))
    print(f"variant tree at {dest}")


if __name__ == "__main__":
    main()
