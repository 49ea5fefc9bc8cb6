"""Pass/fail counting for the client check scripts: check(what, cond) records one check, and
report() prints 'N passed, M failed' and exits non-zero when any failed."""

import sys

_counts = {"passed": 0, "failed": 0}


def check(what, cond):
    if cond:
        _counts["passed"] += 1
    else:
        _counts["failed"] += 1
        print("FAILED:", what)


def report():
    print(f"{_counts['passed']} passed, {_counts['failed']} failed")
    sys.exit(1 if _counts["failed"] else 0)
