"""Names users type on a command line: dtype spellings, and model paths that look like hub names.

Torch-free, so command lines can import it before their slow imports (the trainer's config does).
"""

from __future__ import annotations

import os
import re

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the canonical names, as train's --dtype spells them
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_HELP = "one of float32, bfloat16, float16 (or fp32, bf16, fp16)"

# owner/name, as the Hugging Face hub spells a repository: one slash, no leading dot or slash.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def canonical_dtype(name: str) -> str:
    """float32, bfloat16 or float16 for either spelling (bf16 -> bfloat16); any other value is
    returned unchanged, for the caller to refuse with its own message."""
    return DTYPE_ALIASES.get(name, name)


def hub_name_hint(path: str | os.PathLike) -> str:
    """For a model path that does not exist and looks like a hub name (Qwen/Qwen2.5-0.5B): the
    hint to append to "does not exist" (starting with "; "), that a local directory is needed
    and how to download one. Empty for any other path."""
    text = os.fspath(path)
    if os.path.exists(text) or not _HUB_NAME.fullmatch(text):
        return ""
    local = text.rsplit("/", 1)[1]
    return (f"; a local model directory is needed, not a hub name (nothing is downloaded): get one with "
            f"huggingface-cli download {text} --local-dir {local}, and pass that directory")
