"""checkpoint_convert: Hugging Face <-> megatron-core checkpoints for any tp/pp (see mapping.py, gather.py, io.py, convert.py, verify.py)."""
