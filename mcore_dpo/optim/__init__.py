"""The optimizer step: AdamW with clipping and its learning-rate schedule, replicated or sharded over data-parallel ranks (ZeRO-1)."""
