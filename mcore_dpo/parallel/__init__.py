"""Devices and process groups: the platform (every device decision), megatron-core's parallel state (the mesh), free ports."""
