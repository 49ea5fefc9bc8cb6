#!/usr/bin/env python3
"""Fills the suite's download cache with the stand-ins, as its `ServerPreset.load_all()` would
leave it after downloading: `cache.py CACHE_DIR`.

Router-mode tests name models by their Hugging Face cache names (`ggml-org/tinygemma3-GGUF:Q8_0`),
which llama-server (and hmoe's `--models-dir`) read from a hub cache folder:
`models--OWNER--NAME/refs/main` holds a commit hash, `snapshots/COMMIT/FILE` the model. Each
entry of models.ini's `[cache]` section (`OWNER/NAME/FILE = fixture`) becomes such a folder with
FILE a link to the fixture; the commit is the SHA-1 of the repository id. Existing entries are
left as they are.
"""
import configparser
import hashlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    cache = sys.argv[1]
    ini = configparser.ConfigParser(delimiters=("=",))
    ini.optionxform = str
    ini.read(os.path.join(HERE, "models.ini"))
    fixtures = os.environ["HMOE_FIXTURES"]
    for key, fixture in ini["cache"].items():
        owner, name, file = key.split("/", 2)
        repo = os.path.join(cache, f"models--{owner}--{name}")
        commit = hashlib.sha1(f"{owner}/{name}".encode()).hexdigest()
        snapshot = os.path.join(repo, "snapshots", commit)
        os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
        os.makedirs(snapshot, exist_ok=True)
        with open(os.path.join(repo, "refs", "main"), "w") as f:
            f.write(commit)
        link = os.path.join(snapshot, file)
        if not os.path.lexists(link):
            os.symlink(os.path.join(fixtures, fixture), link)


if __name__ == "__main__":
    main()
