#!/usr/bin/env python3
"""Teacher-forced top-10 probabilities of the GPU executor against the CPU device and the
goldens, for every fixture in the given folders (gpt-oss, Qwen3-MoE, DeepSeek-V3:
any architecture the device executor runs). Python 3 standard library only.

For each fixture FILE.gguf with a golden FILE.golden-f16kv.json (split models: the first
shard, golden named after the stem without -00001-of-0000N), and each golden case (a prompt
and the golden greedy tokens), it runs

    hmoe run -m FILE --prompt-tokens P --teacher-tokens G --top-k-probs 10 --json -c 512

once on the CPU (-dev none -fa off: the row kernel, which the CUDA attention also runs for f16
K/V under -fa off; under -fa on both run the chunked flash kernel, whose bits differ from the row
kernel's, which on these MXFP4 files can flip an expert choice, see ../shared/fixtures/README.md)
and once
per GPU configuration (-ngl all; -ngl all --cpu-moe;
-ngl all --cpu-moe --moe-cache 1; -ngl all --n-cpu-moe 1), checks from stderr that the GPU
executor ran (its start-up line "hmoe: ARCH on CUDA…"), and prints per
fixture and configuration the largest |dp| over the reference's top-10 ids at every step
against the CPU run and against the golden. An id missing from the other run's top 10 counts
as p_ref - (that run's 10th probability), a lower bound of its true |dp|.

Strict and reported fixtures: the GPU kernels convert activations as ggml's CPU backend does
(Q8_0 blocks for Q8_0/MXFP4 weights, f16/bf16 for F16/BF16) and follow the CPU device's
summation orders, so hmoe-cuda's reference backend reproduces the CPU device bit for bit on
every fixture (crates/cuda/tests/gpu_gpt_oss.rs). Every fixture matching --strict (default:
all) is held to --tol; others are printed against --sanity (default 1, bounds nothing).
Known sources of GPU-only differences: cuBLAS sums batches of 16+ tokens with F16/BF16
weights in its own order, and the GPU's cosf/sinf/expf may differ in the last bit.

The runs are independent and go --jobs at a time (default 4), each with --threads CPU
threads (default: hmoe's own choice), so that a short GPU lease is not spent waiting on one
process at a time.

With --device REF0 the same comparison runs on the reference device instead of a GPU (a dry
run of this script that CI does: crates/cli/tests/gpu_compare_script.rs); --only picks fixtures.

usage: gpu_compare.py --hmoe PATH --fixtures DIR [--fixtures DIR ...] [--device CUDA|REF0]
                      [--only REGEX] [--tol 5e-3] [--strict REGEX] [--sanity 1]
                      [--jobs 4] [--threads N]
Exit status 0 when every GPU run used the GPU and every number is within its bound.
"""

import argparse
import concurrent.futures
import glob
import json
import os
import re
import subprocess
import sys

# --cpu-moe without the device expert cache (which CUDA turns on by default) is the host round
# trip; with a 1 MiB cache, hits run on the GPU and misses on the CPU in the same layer.
CONFIGS = [
    ("-ngl all", ["-ngl", "all"]),
    ("-ngl all --cpu-moe", ["-ngl", "all", "--cpu-moe", "--moe-cache", "0"]),
    ("-ngl all --cpu-moe --moe-cache 1", ["-ngl", "all", "--cpu-moe", "--moe-cache", "1"]),
    ("-ngl all --n-cpu-moe 1", ["-ngl", "all", "--n-cpu-moe", "1", "--moe-cache", "0"]),
]

def gpu_mark(device):
    """The start-up line of the device executor on `device` (CUDA: any CUDA GPU)."""
    return re.compile(r"^hmoe: \S+ on %s" % re.escape(device), re.M)


def fixtures(folder):
    """(model path, golden path, name) of every fixture in folder with an f16-KV golden."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "*.gguf"))):
        base = os.path.basename(path)
        m = re.match(r"(.*)-(\d{5})-of-(\d{5})\.gguf$", base)
        if m and m.group(2) != "00001":
            continue
        stem = m.group(1) if m else base[: -len(".gguf")]
        golden = os.path.join(folder, stem + ".golden-f16kv.json")
        if os.path.exists(golden):
            out.append((path, golden, stem))
    return out


def run(hmoe, model, case, extra, mark):
    """top_probs of one teacher-forced run, and whether the GPU executor ran."""
    prompt = ",".join(str(t) for t in case["prompt_tokens"])
    teacher = ",".join(str(t) for t in case["greedy_tokens"][: len(case["top_probs"])])
    cmd = [
        hmoe, "run", "-m", model, "--prompt-tokens", prompt, "--teacher-tokens", teacher,
        "--top-k-probs", "10", "--json", "-c", "512", "--temp", "0",
    ] + extra
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), p.returncode, p.stderr[-2000:]))
    out = json.loads(p.stdout.strip().splitlines()[-1])
    return out["top_probs"], bool(mark.search(p.stderr)), p.stderr


def worst_dp(ref_steps, got_steps):
    """Largest |dp| over the reference's top ids at every step (see the module doc)."""
    worst = 0.0
    for ref, got in zip(ref_steps, got_steps):
        gp = {int(i): float(p) for i, p in got}
        floor = min(gp.values()) if gp else 0.0
        for i, p in ref:
            p = float(p)
            d = abs(p - gp[int(i)]) if int(i) in gp else max(0.0, p - floor)
            worst = max(worst, d)
    if len(ref_steps) != len(got_steps):
        worst = float("inf")
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hmoe", required=True)
    ap.add_argument("--fixtures", required=True, action="append",
                    help="a folder of fixtures (repeat for several)")
    ap.add_argument("--tol", type=float, default=5e-3)
    ap.add_argument("--strict", default=".",
                    help="regex of the fixtures held to --tol (the others to --sanity)")
    ap.add_argument("--sanity", type=float, default=1.0)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="CUDA",
                    help="CUDA (the default: whichever GPU hmoe picks), or REF0 for a dry run "
                         "of this script on the reference device, which equals the CPU bit "
                         "for bit")
    ap.add_argument("--only", default=".", help="regex of the fixtures to run")
    a = ap.parse_args()
    found = [f for folder in a.fixtures for f in fixtures(folder) if re.search(a.only, f[2])]
    if not found:
        print("gpu_compare: no fixture with a .golden-f16kv.json in %s" % ", ".join(a.fixtures))
        return 1
    # -fa off everywhere: the CPU's row kernel, which the CUDA attention runs for f16 K/V
    # under -fa off (and REF0 under -fa off).
    common = ["-fa", "off"] + (["-t", str(a.threads)] if a.threads > 0 else [])
    on_device = [] if a.device == "CUDA" else ["-dev", a.device]
    mark = gpu_mark(a.device)
    goldens = {}
    for model, golden_path, name in found:
        with open(golden_path) as f:
            goldens[name] = json.load(f)["cases"]
    # Every (fixture, configuration, case) run, started together; results read in order below.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs))
    pending = {}
    for model, _, name in found:
        runs = [("cpu", ["-dev", "none"])] + [(l, x + on_device) for l, x in CONFIGS]
        for label, extra in runs:
            pending[(name, label)] = [
                pool.submit(run, a.hmoe, model, c, extra + common, mark)
                for c in goldens[name]
            ]

    def results(name, label):
        return [f.result() for f in pending[(name, label)]]

    ok = True
    rows = []
    for model, golden_path, name in found:
        cases = goldens[name]
        try:
            cpu = [r[0] for r in results(name, "cpu")]
        except RuntimeError as e:
            print("gpu_compare: %s CPU: %s" % (name, e))
            ok = False
            continue
        cpu_vs_golden = max(worst_dp(c["top_probs"], r) for c, r in zip(cases, cpu))
        strict = re.search(a.strict, name) is not None
        bound = a.tol if strict else a.sanity
        rows.append((name, "CPU (-dev none -fa off)", "-", cpu_vs_golden, "cpu", "-"))
        for label, _ in CONFIGS:
            try:
                runs = results(name, label)
            except RuntimeError as e:
                print("gpu_compare: %s %s: %s" % (name, label, e))
                rows.append((name, label, float("inf"), float("inf"), "failed", bound))
                ok = False
                continue
            on_gpu = all(r[1] for r in runs)
            vs_cpu = max(worst_dp(c, r[0]) for c, r in zip(cpu, runs))
            vs_golden = max(worst_dp(c["top_probs"], r[0]) for c, r in zip(cases, runs))
            engine = a.device if on_gpu else "NOT ON " + a.device
            if not on_gpu:
                print("gpu_compare: %s %s did not run on the GPU; stderr:\n%s"
                      % (name, label, runs[0][2][-1500:]))
            rows.append((name, label, vs_cpu, vs_golden, engine, bound))
            ok = ok and on_gpu and vs_cpu <= bound and vs_golden <= bound
    print()
    print("%-28s %-26s %-12s %-12s %-8s %-10s %s" % (
        "fixture", "config", "max|dp| CPU", "max|dp| gold", "bound", "engine", "within 5e-3"))
    for name, label, vs_cpu, vs_golden, engine, bound in rows:
        fmt = lambda v: v if isinstance(v, str) else "%.3e" % v
        within = "-" if isinstance(vs_cpu, str) else ("yes" if max(vs_cpu, vs_golden) <= a.tol else "no")
        print("%-28s %-26s %-12s %-12s %-8s %-10s %s" % (
            name, label, fmt(vs_cpu), fmt(vs_golden), fmt(bound), engine, within))
    pool.shutdown()
    print("gpu_compare: %s (--tol %.0e for /%s/, --sanity %.2g for the others)"
          % ("PASS" if ok else "FAIL", a.tol, a.strict, a.sanity))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
