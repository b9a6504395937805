"""One rank of a worker group and the parts it is composed of: the reference source, the step's MoE part, the evaluator, the checkpointer, metrics across ranks."""
