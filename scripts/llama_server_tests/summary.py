#!/usr/bin/env python3
"""Per-file pass counts from pytest JUnit XML files: `summary.py NAME=FILE.xml ...`.

Prints one Markdown table: a row per test file, a column per run (passed/total, skipped tests
not counted in the total), and with two runs a list of the tests that pass in the second run
but not in the first.
"""
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def outcomes(path):
    """{(file, test name): 'pass' | 'fail' | 'skip'} for one JUnit XML file."""
    result = {}
    for case in ET.parse(path).iter("testcase"):
        file = case.get("classname", "").split(".")[-1]
        kinds = {child.tag for child in case}
        if "skipped" in kinds:
            state = "skip"
        elif kinds & {"failure", "error"}:
            state = "fail"
        else:
            state = "pass"
        result[(file, case.get("name"))] = state
    return result


def main():
    runs = [arg.split("=", 1) for arg in sys.argv[1:]]
    results = [(name, outcomes(path)) for name, path in runs]
    files = sorted({f for _, r in results for f, _ in r})
    print("| file | " + " | ".join(name for name, _ in results) + " |")
    print("|---|" + "---|" * len(results))
    totals = [[0, 0] for _ in results]
    for file in files:
        cells = []
        for k, (_, r) in enumerate(results):
            states = [s for (f, _), s in r.items() if f == file and s != "skip"]
            passed = states.count("pass")
            totals[k][0] += passed
            totals[k][1] += len(states)
            cells.append(f"{passed}/{len(states)}")
        print(f"| {file} | " + " | ".join(cells) + " |")
    print("| **total** | " + " | ".join(f"**{p}/{t}**" for p, t in totals) + " |")
    if len(results) == 2:
        (a_name, a), (b_name, b) = results
        diff = defaultdict(list)
        for key, state in b.items():
            if state == "pass" and a.get(key) != "pass":
                diff[key[0]].append(key[1])
        print(f"\nPass in {b_name}, not in {a_name}:")
        for file in sorted(diff):
            print(f"- {file}: " + ", ".join(sorted(diff[file])))


if __name__ == "__main__":
    main()
