#!/usr/bin/env python3
"""Greedy generation of small Qwen3-MoE stand-ins with IQ experts: hmoe on the CPU against
llama.cpp's llama-server (CPU build), token for token and top-10 probabilities.

For each architecture (`--archs`, default qwen3moe) and IQ type: `hmoe make-test-model --arch A
--embd 256 --ff 256 --expert-type T`,
then for each prompt `hmoe run --json --top-k-probs 10` (greedy, f32 K/V, no flash attention)
and, teacher-forced on hmoe's tokens, llama-server's /completion for one token after the prompt
and each prefix of hmoe's output (temperature 0, n_probs 10, same settings): its token must be
hmoe's, and after the bare prompt (both sides then evaluate the same batch) its top-10
probabilities hmoe's within --tol. Later steps' probabilities are reported, not checked: llama
evaluates the prefix as one batch where hmoe decoded token by token, and on these random
stand-ins (IQ1 most) that changes probabilities by up to 1e-2, so a later step may also pick
the other token of a near tie (llama's probabilities within 1e-2; counted). llama-server answers 500 when the
random model's token is text its output parser rejects (tool-call markers of the stand-in's
vocabulary), and leaves out the probabilities of a token that ends in an incomplete UTF-8
sequence; such steps are skipped and counted.

Prints one line per type and a JSON summary last; exits 1 when a greedy token differs, a
probability differs by more than --tol, or a type had no step to compare. Standard library only.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

TYPES = ["iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq4_nl", "iq4_xs"]
PROMPTS = [
    [46, 77, 344, 510, 261], [100, 200, 300], [17, 99, 123, 45, 67, 89, 90], [5, 6, 7],
    [400, 12, 33], [250, 251, 252, 253], [9, 8, 7, 6, 5], [321, 123, 213], [77, 88, 99, 111],
    [3, 30, 300], [42], [500, 400, 300, 200, 100],
]
# A later step may pick another token where llama's two candidates are this close in probability.
NEAR_TIE = 1e-2
COMMON = ["-t", "2", "-c", "512", "-fa", "off", "-ctk", "f32", "-ctv", "f32"]


def next_token(port, tokens):
    """llama-server's next token after `tokens` with its top 10, or None when it answers 500."""
    body = {"prompt": tokens, "n_predict": 1, "temperature": 0, "n_probs": 10, "cache_prompt": False}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            d = json.load(r)
            # A token that ends in an incomplete UTF-8 sequence comes without probabilities.
            probs = d.get("completion_probabilities") or [None]
            return probs[0]
    except urllib.error.HTTPError as e:
        if e.code == 500:
            return None
        raise


def hmoe_runs(hmoe, model, n):
    runs = []
    for prompt in PROMPTS:
        out = subprocess.run([hmoe, "run", "-m", model, "--prompt-tokens", ",".join(map(str, prompt)),
                              "-n", str(n), "--temp", "0", "--json", "--top-k-probs", "10"] + COMMON,
                             capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout))
    return runs


def llama_steps(server, model, port, runs):
    log = open(os.path.join(os.path.dirname(model), "llama-server.log"), "w")
    srv = subprocess.Popen([server, "-m", model, "--port", str(port), "-np", "1",
                            "--reasoning-format", "none"] + COMMON, stdout=log, stderr=log)
    try:
        for _ in range(120):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.5)
        return [[next_token(port, p + h["generated_tokens"][:i]) for i in range(len(h["generated_tokens"]))]
                for p, h in zip(PROMPTS, runs)]
    finally:
        srv.terminate()
        srv.wait()


def compare(runs, steps_per_prompt):
    same = total = skipped = near_ties = 0
    worst = later = 0.0
    mismatches = []
    for prompt, h, steps in zip(PROMPTS, runs, steps_per_prompt):
        for i, s in enumerate(steps):
            if s is None:
                skipped += 1
                continue
            total += 1
            if h["generated_tokens"][i] != s["id"]:
                lp = {t["id"]: math.exp(t["logprob"]) for t in s["top_logprobs"]}
                gap = lp[s["id"]] - lp.get(h["generated_tokens"][i], 0.0)
                if i == 0 or gap > NEAR_TIE:
                    mismatches.append({"prompt": prompt, "step": i, "llama": s["id"],
                                       "hmoe": h["generated_tokens"][i], "gap": gap})
                else:
                    near_ties += 1
                continue
            same += 1
            hp = {t: p for t, p in h["top_probs"][i]}
            for t in s["top_logprobs"]:
                if t["id"] in hp:
                    dp = abs(math.exp(t["logprob"]) - hp[t["id"]])
                    if i == 0:
                        worst = max(worst, dp)
                    else:
                        later = max(later, dp)
    return same, total, skipped, near_ties, worst, later, mismatches


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hmoe", required=True)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--seed", default="42", help="make-test-model's --seed (its default: 42)")
    ap.add_argument("--archs", default="qwen3moe", help="qwen3moe, deepseek2, gpt-oss (comma-separated)")
    ap.add_argument("--port", type=int, default=18400)
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    summary, ok = {}, True
    with tempfile.TemporaryDirectory() as d:
        for arch, ty in [(arch, ty) for arch in a.archs.split(",") for ty in a.types.split(",")]:
            model = os.path.join(d, f"{arch}-{ty}.gguf")
            subprocess.run([a.hmoe, "make-test-model", "--arch", arch, "--embd", "256", "--ff", "256",
                            "--expert-type", ty, "--seed", a.seed, "-o", model], check=True, capture_output=True)
            runs = hmoe_runs(a.hmoe, model, a.n)
            steps = llama_steps(a.llama_server, model, a.port, runs)
            same, total, skipped, ties, worst, later, bad = compare(runs, steps)
            good = not bad and total > 0 and worst <= a.tol
            ok &= good
            name = f"{arch} {ty}"
            summary[name] = {"tokens": total, "identical": same, "skipped": skipped, "near_ties": ties,
                           "max_prob_diff_first": worst, "max_prob_diff_later": later, "mismatches": bad}
            print(f"{name}: {same}/{total} greedy tokens identical ({ties} near ties, {skipped} skipped), max |dp| "
                  f"{worst:.2e} after the prompt, {later:.2e} later"
                  + ("" if good else "  FAIL"), flush=True)
    print(json.dumps(summary))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
