"""Copy the committed classification table into the README, so the README shows the committed study's numbers.

Usage (from the repository root)::

    python tools/gen_readme_results.py            # rewrite the block between the markers in README.md
    python tools/gen_readme_results.py --check    # exit 1 if README.md's block differs from the committed table

The block between ``<!-- results:classify -->`` and ``<!-- /results:classify -->`` in ``README.md`` is
``docs/results/classify/table.md`` verbatim (written by ``ropekit experiment classify --out docs/results/classify``),
preceded by one line naming its source. Nothing else in the README is touched.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ropekit_studies.report import replace_marked_lines

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TABLE = ROOT / "docs" / "results" / "classify" / "table.md"
BEGIN, END = "<!-- results:classify -->", "<!-- /results:classify -->"


def block(table_text: str) -> list:
    """The README lines between the markers for ``table_text`` (the contents of the committed ``table.md``)."""
    source = ("*Copied from [docs/results/classify/table.md](docs/results/classify/table.md) by "
              "`tools/gen_readme_results.py`; regenerate with `ropekit experiment classify --out "
              "docs/results/classify`.*")
    return [source, "", *table_text.strip().split("\n")]


def render(readme_text: str, table_text: str) -> str:
    """``readme_text`` with its marked block replaced. Raises ``ValueError`` when the marker lines are missing."""
    try:
        return replace_marked_lines(readme_text, BEGIN, END, block(table_text))
    except ValueError as e:
        raise ValueError(f"README.md: {e}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if README.md is out of date")
    args = p.parse_args(argv)
    current = README.read_text()
    wanted = render(current, TABLE.read_text())
    if args.check:
        if wanted != current:
            print("README.md's results block differs from docs/results/classify/table.md: run "
                  "python tools/gen_readme_results.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
