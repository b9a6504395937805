"""Tools around training: the per-device memory estimate, and the Megatron model runner that `checkpoint_convert verify` uses."""
