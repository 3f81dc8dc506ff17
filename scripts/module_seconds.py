"""Write tests/module_seconds.txt from a pytest `--durations=0` log: each test module's total seconds (setup +
call + teardown), slowest first. tests/conftest.py sends the slowest modules to the xdist workers first, so the
two workers finish together instead of one running a long module alone at the end.

    scripts/test.sh --durations=0 > durations.log; python scripts/module_seconds.py durations.log
"""
from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

LINE = re.compile(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S+?)::")
MIN_SECONDS = 3.0  # faster modules keep their collection order, after the listed ones


def module_seconds(log: str) -> dict[str, float]:
    totals: collections.Counter[str] = collections.Counter()
    for line in log.splitlines():
        if m := LINE.match(line):
            totals[m.group(2)] += float(m.group(1))
    return dict(totals)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    totals = module_seconds(Path(argv[0]).read_text())
    rows = [f"{s:.0f} {m}" for m, s in sorted(totals.items(), key=lambda kv: -kv[1]) if s >= MIN_SECONDS]
    out = Path(__file__).resolve().parent.parent / "tests" / "module_seconds.txt"
    out.write_text("# seconds per test module (scripts/module_seconds.py): the order xdist hands modules out\n"
                   + "\n".join(rows) + "\n")
    print(f"{out}: {len(rows)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
