"""Rotary tables at given positions: megatron-core's rotary embeddings take a length, not
positions, so a packed or shared-prompt row's table (model/builder.py `_rope_at_positions`,
model/mla.py) is handed to them for one forward."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def rope_returning(rope: torch.nn.Module, value):
    """megatron-core's rotary embedding `rope` returns `value` whatever length it is asked for."""

    def forward(*_args, **_kwargs):
        return value

    rope.forward = forward
    try:
        yield
    finally:
        del rope.forward  # back to the class's (cached) forward
