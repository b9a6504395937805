"""The megatron-core model of one pipeline stage, LoRA adapters on it, and the MoE routers' auxiliary loss."""
