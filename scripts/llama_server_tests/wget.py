"""Stand-in for the `wget` module the suite imports: this harness downloads nothing.

`download_file` in the suite's utils.py calls `wget.download` only for files that are not in its
tmp/ folder (LoRA adapters, draft models); those tests then fail with this error, for both
servers alike.
"""


def download(url, out=None):
    """Refuse: the harness runs offline."""
    raise RuntimeError(f"llama-server-tests harness: no downloads ({url})")
