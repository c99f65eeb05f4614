"""SASS fingerprints of a kernel family's launches, compiled for sm_90a on any machine (no GPU:
`code_size.compiled_launches`). One line a launch: case, kernel, a hash of its SASS (instruction
addresses stripped; with --loose also the parameter offsets), registers, instructions. A refactor that must
not change the kernels prints the same lines before and after (run it at both trees and diff):

    PYTHONPATH=src python3 benchmarks/kernels/sass.py kda_step moe [--loose] [--json PATH] > after.txt

The families are the modules of `sass_cases/` (`all` for every one); run it without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import pkgutil
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import code_size
import sass_cases

ENCODING = re.compile(r"/\* 0x[0-9a-f]{16} \*/")


def sass_hash(cubin: bytes, loose: bool) -> str:
    """A hash of the cubin's SASS, instruction addresses stripped (and parameter offsets if `loose`)."""
    lines = [code_size.INSTRUCTION.sub("", line).strip() for line in code_size.sass_instructions(cubin)]
    if loose:  # the offset is in the operand and in the instruction's encoding
        lines = [re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "P", ENCODING.sub("", line)) for line in lines]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def families() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(sass_cases.__path__))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="+", choices=[*families(), "all"], metavar="FAMILY")
    parser.add_argument("--loose", action="store_true", help="also strip parameter offsets")
    parser.add_argument("--json", help="also write every launch's figures here")
    args = parser.parse_args()
    resources = code_size.resources
    code_size.resources = lambda cubin: {**resources(cubin), "sass": sass_hash(cubin, args.loose)}
    report = {}
    for family in families() if "all" in args.families else args.families:
        cases = importlib.import_module(f"sass_cases.{family}")
        code_size._as_dependents(*cases.MODULES)
        for name, call in cases.CASES.items():
            report[f"{family}.{name}"] = launches = code_size.compiled_launches(call)
            for launch in launches:
                fields = (launch["sass"], launch["registers"], launch["instructions"])
                print(f"{family}.{name}", launch["kernel"], *fields, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
