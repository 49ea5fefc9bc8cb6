#!/usr/bin/env python3
"""The server binary llama.cpp's server test suite starts (its LLAMA_SERVER_BIN_PATH).

Rewrites `--hf-repo`/`--hf-file` (and their short spellings) to `--model FILE` from models.ini,
drops `--offline`, then execs the server under test: `$SUITE_SERVER serve ARGS` when
SUITE_KIND=hmoe, else `$SUITE_SERVER ARGS` (llama-server). SUITE_EXTRA_ARGS (split on spaces) is
appended to every start: the opt-ins a run chooses, which the results table names.

A start with no model (or only `--models-preset`) is llama-server's router mode, which always
lists its download cache ($LLAMA_CACHE, which the suite sets to its tmp/ folder; cache.py fills
it with the stand-ins); hmoe's router needs the folder named, so for hmoe the shim adds
`--models-dir $LLAMA_CACHE`.
"""
import configparser
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_FLAGS = {"-hf", "-hfr", "--hf-repo"}
FILE_FLAGS = {"-hff", "--hf-file"}
MODEL_FLAGS = {"-m", "--model", "--models-dir"}


def stand_in(repo, hf_file):
    """The fixture file that stands in for a repo (and file), or exit as an offline server."""
    ini = configparser.ConfigParser(delimiters=("=",))
    ini.optionxform = str
    ini.read(os.path.join(HERE, "models.ini"))
    models = ini["models"]
    key = f"{repo}/{hf_file}" if hf_file else repo
    if key not in models:
        sys.exit(f"llama-server-tests shim: no stand-in for {key} (offline)")
    return os.path.join(os.environ["HMOE_FIXTURES"], models[key])


def rewrite(argv):
    """The command line with the HF arguments replaced by --model."""
    out, repo, hf_file = [], None, None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in REPO_FLAGS and i + 1 < len(argv):
            repo, i = argv[i + 1], i + 2
        elif a in FILE_FLAGS and i + 1 < len(argv):
            hf_file, i = argv[i + 1], i + 2
        elif a == "--offline":
            i += 1
        else:
            out.append(a)
            i += 1
    if repo is not None:
        out = ["--model", stand_in(repo, hf_file)] + out
    return out


def main():
    server = os.environ["SUITE_SERVER"]
    args = rewrite(sys.argv[1:]) + os.environ.get("SUITE_EXTRA_ARGS", "").split()
    if os.environ.get("SUITE_KIND") == "hmoe":
        if not MODEL_FLAGS.intersection(args):
            cache = os.environ.get("LLAMA_CACHE", "tmp")
            os.makedirs(cache, exist_ok=True)
            args += ["--models-dir", cache]
        args = ["serve"] + args
    sys.stdout.flush()
    os.execv(server, [server] + args)


if __name__ == "__main__":
    main()
