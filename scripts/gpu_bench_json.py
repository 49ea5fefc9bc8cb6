#!/usr/bin/env python3
"""Assembles and validates the result file of scripts/gpu-bench.sh.

    gpu_bench_json.py assemble --runs RUNS.tsv [--cache-runs CACHE.tsv] --machine MACHINE.json \
        --date DATE --tests pp512,tg128,... -o OUT.json
    gpu_bench_json.py validate OUT.json [--tests pp512,...]
    gpu_bench_json.py table OUT.json...

`table` prints each file's runs as a Markdown table, hmoe beside llama.cpp: per (config, kv,
test) both t/s, their ratio and both peak VRAM figures (what a closing note quotes).

RUNS.tsv has one line per bench invocation: engine, config, kv, vram_mib (or "null"), and the
path of that invocation's JSON output (`hmoe bench -o json` or `llama-bench -o json`; both are a
list of llama-bench records with n_prompt, n_gen, n_depth and avg_ts). Each record becomes one run
`{"engine", "config", "kv", "test", "t_s", "vram_mib"}`, the test named `pp<n_prompt>` (at depth
0), `tg<n_gen>` or `tg<n_gen>@d<depth>`; records of other shapes (a prompt test at a depth) are
left out. hmoe's records may carry the device expert cache's hit rate (`moe_cache_hit_rate`),
kept on the run as `moe_cache_hit_rate`.

CACHE.tsv (hmoe's device expert cache) has one line per invocation: `MODEL:STATE`
(MODEL `random` or `locality`, the file written with `--routing-locality`; STATE `off` or `on`),
vram_mib and the JSON path; its records become `moe_cache_runs` entries `{"model", "moe_cache",
"test", "t_s", "hit_rate", "vram_mib"}` (hit_rate null with the cache off).

The result: `{"machine": {...}, "date": "YYYY-MM-DD...", "runs": [...]}`
(plus `moe_cache_runs` when there were any).
`validate` checks that shape: engine in {hmoe, llama.cpp}, config in {cpu-moe, ncmoe-half,
all-gpu}, kv in {f16, q8_0}, test among `--tests` (default: pp512, pp2048, tg128, tg128@d4096),
t_s a positive number, vram_mib a number or null; and that every test of every (engine, config,
kv) that has runs is there. Python 3 standard library only.
"""

import argparse
import json
import sys

ENGINES = ("hmoe", "llama.cpp")
CONFIGS = ("cpu-moe", "ncmoe-half", "all-gpu")
KVS = ("f16", "q8_0")
DEFAULT_TESTS = ("pp512", "pp2048", "tg128", "tg128@d4096")
RUN_KEYS = {"engine", "config", "kv", "test", "t_s", "vram_mib"}
OPTIONAL_RUN_KEYS = {"moe_cache_hit_rate", "stddev_t_s"}


def test_name(rec):
    """The schema's name of a llama-bench record, or None for a shape the schema has not."""
    p, g, d = int(rec.get("n_prompt", 0)), int(rec.get("n_gen", 0)), int(rec.get("n_depth", 0))
    if p > 0 and g == 0 and d == 0:
        return f"pp{p}"
    if p == 0 and g > 0:
        return f"tg{g}" if d == 0 else f"tg{g}@d{d}"
    return None


def load_records(path):
    """The records of one bench output: a JSON list (llama-bench and hmoe `-o json`), or JSON
    lines (`-o jsonl`)."""
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if not text:
        return []
    if text.startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def cache_runs(tsv):
    """The expert-cache runs of CACHE.tsv."""
    out = []
    with open(tsv, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            what, vram, path = line.rstrip("\n").split("\t")
            model, state = what.split(":")
            for rec in load_records(path):
                name = test_name(rec)
                if name is None:
                    continue
                rate = rec.get("moe_cache_hit_rate")
                out.append({
                    "model": model,
                    "moe_cache": state,
                    "test": name,
                    "t_s": float(rec["avg_ts"]),
                    "hit_rate": None if rate is None else float(rate),
                    "vram_mib": None if vram in ("", "null") else float(vram),
                })
    return out


def assemble(runs_tsv, machine_json, date):
    with open(machine_json, encoding="utf-8") as f:
        machine = json.load(f)
    runs = []
    with open(runs_tsv, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            engine, config, kv, vram, path = line.rstrip("\n").split("\t")
            vram_mib = None if vram in ("", "null") else float(vram)
            for rec in load_records(path):
                name = test_name(rec)
                if name is None:
                    continue
                run = {
                    "engine": engine,
                    "config": config,
                    "kv": kv,
                    "test": name,
                    "t_s": float(rec["avg_ts"]),
                    "vram_mib": vram_mib,
                }
                if "stddev_ts" in rec:
                    run["stddev_t_s"] = float(rec["stddev_ts"])
                if "moe_cache_hit_rate" in rec:
                    run["moe_cache_hit_rate"] = float(rec["moe_cache_hit_rate"])
                runs.append(run)
    return {"machine": machine, "date": date, "runs": runs}


def validate(doc, tests):
    """A list of what is wrong with `doc` (empty: valid)."""
    errs = []
    if not isinstance(doc, dict):
        return ["the document is not an object"]
    for key in ("machine", "date", "runs"):
        if key not in doc:
            errs.append(f"missing {key!r}")
    if errs:
        return errs
    if not isinstance(doc["machine"], dict):
        errs.append("machine is not an object")
    if not isinstance(doc["date"], str) or len(doc["date"]) < 10:
        errs.append(f"date {doc['date']!r} is not a date string")
    runs = doc["runs"]
    if not isinstance(runs, list) or not runs:
        return errs + ["runs is not a non-empty list"]
    seen = {}
    for i, r in enumerate(runs):
        where = f"runs[{i}]"
        if not isinstance(r, dict):
            errs.append(f"{where} is not an object")
            continue
        missing = RUN_KEYS - r.keys()
        extra = r.keys() - RUN_KEYS - OPTIONAL_RUN_KEYS
        if missing:
            errs.append(f"{where}: missing {sorted(missing)}")
            continue
        if extra:
            errs.append(f"{where}: unknown keys {sorted(extra)}")
        for key, allowed in (("engine", ENGINES), ("config", CONFIGS), ("kv", KVS), ("test", tests)):
            if r[key] not in allowed:
                errs.append(f"{where}: {key} {r[key]!r} not in {list(allowed)}")
        t_s = r["t_s"]
        if isinstance(t_s, bool) or not isinstance(t_s, (int, float)) or not t_s > 0:
            errs.append(f"{where}: t_s {t_s!r} is not a positive number")
        v = r["vram_mib"]
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
            errs.append(f"{where}: vram_mib {v!r} is neither null nor a number")
        key = (r["engine"], r["config"], r["kv"])
        seen.setdefault(key, set()).add(r["test"])
    for key, got in sorted(seen.items()):
        lacking = [t for t in tests if t not in got]
        if lacking:
            errs.append(f"{'/'.join(key)}: no run of {lacking}")
    for i, r in enumerate(doc.get("moe_cache_runs", [])):
        where = f"moe_cache_runs[{i}]"
        keys = {"model", "moe_cache", "test", "t_s", "hit_rate", "vram_mib"}
        if not isinstance(r, dict) or r.keys() != keys:
            errs.append(f"{where}: not an object of {sorted(keys)}")
            continue
        if r["model"] not in ("random", "locality") or r["moe_cache"] not in ("off", "on"):
            errs.append(f"{where}: model {r['model']!r} / moe_cache {r['moe_cache']!r}")
        if not isinstance(r["t_s"], (int, float)) or not r["t_s"] > 0:
            errs.append(f"{where}: t_s {r['t_s']!r}")
        rate = r["hit_rate"]
        if r["moe_cache"] == "on" and not (isinstance(rate, (int, float)) and 0 <= rate <= 1):
            errs.append(f"{where}: hit_rate {rate!r} with the cache on")
    return errs


def table(doc, name):
    """The runs of `doc` as Markdown lines: hmoe against llama.cpp per (config, kv, test)."""
    by = {}
    for r in doc["runs"]:
        by.setdefault((r["config"], r["kv"], r["test"]), {})[r["engine"]] = r
    model = doc.get("machine", {}).get("model", "?")
    gpu = doc.get("machine", {}).get("gpu", "?")
    lines = [f"{name}: {model} on {gpu}", "",
             "| config | kv | test | hmoe t/s | llama.cpp t/s | ratio | hmoe MiB | llama.cpp MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for (config, kv, test), e in sorted(by.items()):
        h, l = e.get("hmoe"), e.get("llama.cpp")
        ratio = f"{h['t_s'] / l['t_s']:.2f}x" if h and l else "-"
        cell = lambda r, k, f: (f.format(r[k]) if r and r[k] is not None else "-")
        lines.append(f"| {config} | {kv} | {test} | {cell(h, 't_s', '{:.1f}')} | "
                     f"{cell(l, 't_s', '{:.1f}')} | {ratio} | {cell(h, 'vram_mib', '{}')} | "
                     f"{cell(l, 'vram_mib', '{}')} |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("assemble")
    a.add_argument("--runs", required=True)
    a.add_argument("--cache-runs")
    a.add_argument("--machine", required=True)
    a.add_argument("--date", required=True)
    a.add_argument("--tests", default=",".join(DEFAULT_TESTS))
    a.add_argument("-o", "--out", required=True)
    v = sub.add_parser("validate")
    v.add_argument("file")
    v.add_argument("--tests", default=",".join(DEFAULT_TESTS))
    t = sub.add_parser("table")
    t.add_argument("files", nargs="+")
    args = ap.parse_args()
    if args.cmd == "table":
        for path in args.files:
            with open(path, encoding="utf-8") as f:
                print("\n".join(table(json.load(f), path)) + "\n")
        return
    tests = tuple(t for t in args.tests.split(",") if t)
    if args.cmd == "assemble":
        doc = assemble(args.runs, args.machine, args.date)
        if args.cache_runs:
            extra = cache_runs(args.cache_runs)
            if extra:
                doc["moe_cache_runs"] = extra
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    else:
        with open(args.file, encoding="utf-8") as f:
            doc = json.load(f)
    errs = validate(doc, tests)
    for e in errs:
        print(f"gpu_bench_json: {e}", file=sys.stderr)
    if errs:
        sys.exit(1)
    print(f"gpu_bench_json: {len(doc['runs'])} runs valid", file=sys.stderr)


if __name__ == "__main__":
    main()
