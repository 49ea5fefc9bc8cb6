#!/usr/bin/env python3
"""The server part of the GPU check: starts `hmoe serve` on a model with the given
placement flags and 4 slots, and checks on it:

- 4 concurrent greedy requests return exactly what each returns alone (batch invariance);
- the GPU memory the server process holds (nvidia-smi, its peak while a prompt of about 1000
  tokens is prefilled, so that op offload's expert uploads and full micro-batches count) against
  the estimate of /props (weights + K/V + compute of the device): within 5% + 300 MiB;
- aggregate decode speed with 1 stream and with 4 concurrent streams (generated tokens over
  wall time), and their ratio.

    serve_check.py --hmoe BIN --model FILE --name NAME [--port 8617] [--flags "-ngl all --cpu-moe"]
                   [--n-predict 64] [--json OUT.json]

Prints one summary line and, with --json, writes the figures. Exit status 0 when the server
answered, the 4 streams equal the solo runs and the memory is within bounds (the memory check is
skipped, and says so, without nvidia-smi). Python 3 standard library only.
"""

import argparse
import json
import shlex
import subprocess
import sys
import threading
import time
import urllib.request

PROMPTS = [
    "The history of the printing press begins",
    "A recipe for bread needs flour, water,",
    "In mathematics, a prime number is",
    "The best way to learn a new language is",
]


def post(base, path, body, timeout=300):
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get(base, path, timeout=10):
    with urllib.request.urlopen(base + path, timeout=timeout) as r:
        body = r.read()
        try:
            return json.loads(body)
        except ValueError:
            return body.decode(errors="replace")


def complete(base, prompt, n):
    """One greedy /completion: (text, generated tokens)."""
    r = post(base, "/completion", {
        "prompt": prompt, "n_predict": n, "temperature": 0, "cache_prompt": False, "seed": 1,
    })
    return r["content"], int(r.get("timings", {}).get("predicted_n", r.get("tokens_predicted", 0)))


def concurrent(base, prompts, n):
    out = [None] * len(prompts)
    errs = []

    def one(i):
        try:
            out[i] = complete(base, prompts[i], n)
        except Exception as e:  # reported below
            errs.append(f"stream {i}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.time() - t0, errs


def peak_gpu_mib(pid, base, prompt):
    """The largest GPU memory of `pid` (MiB) sampled while `prompt` is prefilled, or None."""
    peak = [gpu_mib(pid)]
    done = threading.Event()

    def sample():
        while not done.is_set():
            m = gpu_mib(pid)
            if m is not None and (peak[0] is None or m > peak[0]):
                peak[0] = m
            done.wait(0.1)

    t = threading.Thread(target=sample)
    t.start()
    try:
        complete(base, prompt, 1)
    finally:
        done.set()
        t.join()
    return peak[0]


def gpu_mib(pid):
    """GPU memory of process `pid` (MiB) from nvidia-smi, or None without it."""
    try:
        q = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in q.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return float(parts[1])
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hmoe", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--port", type=int, default=8617)
    ap.add_argument("--flags", default="-ngl all")
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--json")
    a = ap.parse_args()
    base = f"http://127.0.0.1:{a.port}"
    cmd = [a.hmoe, "serve", "-m", a.model, "--port", str(a.port), "-np", "4", "-c", "8192",
           "--metrics", "--log-disable"] + shlex.split(a.flags)
    print(f"serve_check {a.name}: {' '.join(cmd)}", flush=True)
    srv = subprocess.Popen(cmd, stdout=sys.stdout, stderr=sys.stdout)
    res = {"name": a.name, "flags": a.flags, "ok": False}
    try:
        for _ in range(600):
            try:
                if get(base, "/health", timeout=2):
                    break
            except OSError:
                pass
            if srv.poll() is not None:
                print(f"serve_check {a.name}: the server exited with {srv.returncode}")
                return 1
            time.sleep(0.5)
        else:
            print(f"serve_check {a.name}: no /health after 300 s")
            return 1
        props = get(base, "/props")
        devices = props.get("placement", {}).get("devices", [])
        gpu = [d for d in devices if d.get("name", "").startswith(("CUDA", "REF"))]
        est = sum(d["weight_bytes"] + d["kv_bytes"] + d["compute_bytes"] for d in gpu) / 2**20
        res["engine"] = props.get("placement", {}).get("engine")
        res["estimate_mib"] = round(est, 1)
        # Solo: each prompt alone (the first also warms up), then 1-stream speed.
        solo = [complete(base, p, a.n_predict) for p in PROMPTS]
        t0 = time.time()
        _, n1 = complete(base, PROMPTS[0], a.n_predict)
        res["tps_1_stream"] = round(n1 / (time.time() - t0), 2)
        together, wall, errs = concurrent(base, PROMPTS, a.n_predict)
        if errs:
            print(f"serve_check {a.name}: " + "; ".join(errs))
            return 1
        res["tps_4_streams"] = round(sum(n for _, n in together) / wall, 2)
        res["speedup_4_vs_1"] = round(res["tps_4_streams"] / res["tps_1_stream"], 3)
        same = [s[0] == t[0] for s, t in zip(solo, together)]
        res["four_equal_solo"] = all(same)
        # About 1000 tokens: two micro-batches, past op offload's threshold.
        long_prompt = " ".join([PROMPTS[1]] * 110)
        used = peak_gpu_mib(srv.pid, base, long_prompt)
        res["vram_mib"] = used
        if used is None:
            res["vram_within_bound"] = None
            print(f"serve_check {a.name}: no nvidia-smi figure for pid {srv.pid}: memory unchecked")
        else:
            res["vram_within_bound"] = abs(used - est) <= 0.05 * est + 300
        metrics = get(base, "/metrics")
        if isinstance(metrics, str):
            res["metrics_moe_cache"] = [l for l in metrics.splitlines()
                                        if l.startswith("hmoe:moe_cache")]
            res["metrics_device"] = [l for l in metrics.splitlines()
                                     if l.startswith("hmoe:device_memory_used_bytes")]
        res["ok"] = res["four_equal_solo"] and res["vram_within_bound"] is not False
        print(f"serve_check {a.name}: {json.dumps(res)}", flush=True)
        if not res["four_equal_solo"]:
            for i, (s, t) in enumerate(zip(solo, together)):
                if s[0] != t[0]:
                    print(f"  stream {i}: solo {s[0]!r}\n            4x   {t[0]!r}")
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                json.dump(res, f, indent=1)
        return 0 if res["ok"] else 1
    finally:
        srv.terminate()
        try:
            srv.wait(timeout=20)
        except subprocess.TimeoutExpired:
            srv.kill()


if __name__ == "__main__":
    sys.exit(main())
