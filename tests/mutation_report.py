"""The mutation score per decision module, and the survivors: run after `mutmut run`.

    .venv/bin/python -m tests.mutation_report

Reads `mutmut results --all true` (one `module.x_function__mutmut_N: status`
line per mutant). A mutant counts as killed when a test failed or timed out on
it; survived and "no tests" (no selected test reaches the function) count
against the score.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*(?P<name>(?P<module>[\w.]+)\.x(?:_[A-Za-z0-9]+ǁ)?_?(?P<func>\w+?)__mutmut_\d+): "
                  r"(?P<status>.+)$")
KILLED = {"killed", "timeout"}


def main() -> int:
    mutmut = Path(sys.executable).with_name("mutmut")
    out = subprocess.run([str(mutmut), "results", "--all", "true"], capture_output=True, text=True, check=True).stdout
    per: dict[str, Counter[str]] = defaultdict(Counter)
    survivors: list[str] = []
    for line in out.splitlines():
        m = LINE.match(line)
        if m is None:
            continue
        status = m["status"].strip()
        per[m["module"]][status] += 1
        if status not in KILLED:
            survivors.append(f"{m['name']}: {status}")
    total_k = total = 0
    print(f"{'module':<34} {'killed':>7} {'of':>5} {'score':>7}")
    for module in sorted(per):
        c = per[module]
        k, n = sum(c[s] for s in KILLED), sum(c.values())
        total_k, total = total_k + k, total + n
        print(f"{module:<34} {k:>7} {n:>5} {100 * k / n:>6.1f}%")
    if total:
        print(f"{'all':<34} {total_k:>7} {total:>5} {100 * total_k / total:>6.1f}%")
    print(f"\nsurvivors ({len(survivors)}); `mutmut show NAME` prints the diff:")
    for s in survivors:
        print("  " + s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
