"""Keeping torch out of the processes that only handle text and HTTP (decision 10).

The gateway and the tokenizer never run a model; importing torch would cost them hundreds
of MB and seconds of start-up. transformers imports torch whenever it can find it, even to
load a tokenizer, so these processes make it unfindable before anything else runs:

    forbid_torch()      # first thing in the service's main()

After that `import torch` raises ModuleNotFoundError and transformers takes its torch-free
paths (tokenizers and configs only). Work that needs torch (reading a GGUF file's
metadata) runs in a child process (`meshserve.shared.gguf_export`).
"""

from __future__ import annotations

import sys


def forbid_torch() -> None:
    """Make `torch` unimportable in this process; fails if it is already imported."""
    loaded = sys.modules.get("torch")
    assert loaded is None, "torch was imported before forbid_torch(); find the import"
    # A None entry in sys.modules makes `import torch` raise and find_spec return None.
    sys.modules["torch"] = None  # type: ignore[assignment]


def torch_forbidden() -> bool:
    """Whether forbid_torch() ran in this process."""
    return "torch" in sys.modules and sys.modules["torch"] is None
