"""The trainer's checkpoints: the directory layout and its atomic commit, Megatron-LM's torch_dist format, and the files of expert-parallel layouts."""
