#!/usr/bin/env python3
"""Regenerates gptoss-fa-f16kv.llamacpp.json: llama.cpp's own flash attention with an f16 KV cache
on the synthetic gpt-oss fixtures, teacher-forced with the greedy tokens of the f16-KV goldens.

Needs a CPU build of llama.cpp whose `llama-eval-callback` reads the token ids from HMOE_TOKENS,
decodes the first HMOE_SPLIT of them as one batch and the rest one at a time, and writes every
f32 tensor to HMOE_DUMP/NNNN_<name>.bin (as the fixture machine's patched build does).

usage: make_fa_f16_reference.py LLAMA_EVAL_CALLBACK FIXTURES_DIR OUT_JSON
"""
import glob
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

MODELS = ["gptoss-tiny", "gptoss-small"]


def top10(logits):
    x = logits.astype(np.float64)
    p = np.exp(x - x.max())
    p /= p.sum()
    ids = sorted(range(len(p)), key=lambda i: (-p[i], i))[:10]
    return [[int(i), float("%.9g" % p[i])] for i in ids]


def main():
    exe, fixtures, out_path = sys.argv[1:4]
    out = {"source": "llama.cpp CPU build (ggml 0.18.1, AVX2/FMA/F16C/AVX512/VNNI, GGML_NATIVE=OFF), "
                     "llama-eval-callback, n_ctx 512, n_batch = n_ubatch = 512, 2 threads, "
                     "type_k = type_v = f16, flash_attn on; teacher-forced with the greedy tokens of "
                     "NAME.golden-f16kv.json", "models": {}}
    for name in MODELS:
        golden = json.load(open(os.path.join(fixtures, "gpt-oss", name + ".golden-f16kv.json")))
        cases = []
        for case in golden["cases"]:
            prompt, greedy = case["prompt_tokens"], case["greedy_tokens"]
            tokens = prompt + greedy[:-1]
            with tempfile.TemporaryDirectory() as dump:
                env = dict(os.environ, HMOE_TOKENS=",".join(map(str, tokens)),
                           HMOE_SPLIT=str(len(prompt)), HMOE_DUMP=dump)
                subprocess.run([exe, "-m", os.path.join(fixtures, "gpt-oss", name + ".gguf"), "-c", "512",
                                "-b", "512", "-ub", "512", "-t", "2", "-ctk", "f16", "-ctv", "f16",
                                "-fa", "on", "-p", "x"], env=env, check=True, capture_output=True)
                files = sorted(glob.glob(os.path.join(dump, "*_result_output.bin")))
                steps = [np.fromfile(f, dtype=np.float32).reshape(-1, 1024)[-1] for f in files]
            assert len(steps) == len(greedy), (len(steps), len(greedy))
            cases.append({"prompt_tokens": prompt, "greedy_tokens": greedy,
                          "top_probs": [top10(s) for s in steps],
                          "prompt_logits_last": [float("%.9g" % v) for v in steps[0]]})
        out["models"][name] = {"model": name + ".gguf", "cases": cases}
    with open(out_path, "w") as f:
        json.dump(out, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
