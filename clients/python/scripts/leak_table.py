#!/usr/bin/env python3
"""Prints the closing table: framework × failure class, leaked effects without and with estop.

    ESTOP_BIN=target/debug/estop clients/python/.venv/bin/python clients/python/scripts/leak_table.py [--trials 20]

Starts a real `estop serve` on a temp dir, runs every scenario of tests/scenarios `--trials`
times without estop (the framework alone) and with its estop adapter, and prints, per cell,
"trials that leaked / trials (effects leaked)". Exits 1 if anything leaked with estop.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "src"))

from estop.testing import Daemon  # noqa: E402
from tests.conftest import POLICY  # noqa: E402
from tests.scenarios.common import CLASSES, EXTRA_CLASSES, new_trial  # noqa: E402
from tests.test_failure_classes import FRAMEWORKS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--framework", action="append", help="only these (repeatable)")
    ap.add_argument("--klass", action="append", help="only these failure classes (repeatable)")
    a = ap.parse_args()
    frameworks = a.framework or list(FRAMEWORKS)
    classes = a.klass or CLASSES + EXTRA_CLASSES
    rows = []
    t0 = time.monotonic()
    with Daemon(policy=POLICY) as d:
        for fw in frameworks:
            mod = importlib.import_module(FRAMEWORKS[fw])
            for k in classes:
                if k not in mod.SCENARIOS:
                    continue  # a framework-specific class this framework does not have
                cell = {}
                for guarded in (False, True):
                    leaked_trials = leaked = 0
                    for _ in range(a.trials):
                        n = mod.SCENARIOS[k](new_trial(d, fw, k), guarded)
                        leaked += n
                        leaked_trials += n > 0
                    cell[guarded] = (leaked_trials, leaked)
                rows.append((fw, k, cell))
                print(f"  {fw:22} {k:14} without {cell[False][0]:>3}/{a.trials}  with {cell[True][0]:>3}/{a.trials}", file=sys.stderr, flush=True)
    print()
    print(f"Leaks over {a.trials} trials per cell: trials that leaked / trials (leaked effects).")
    print()
    print("| framework | failure class | without estop | with estop |")
    print("|---|---|---|---|")
    for fw, k, cell in rows:
        w, g = cell[False], cell[True]
        print(f"| {fw} | {k} | {w[0]}/{a.trials} ({w[1]}) | {g[0]}/{a.trials} ({g[1]}) |")
    print()
    print(f"({time.monotonic() - t0:.0f} s)")
    return 1 if any(cell[True][1] for _, _, cell in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
