"""From logits to the loss: per-sequence log-probs, the loss family's formulas and options, and one step's loss over a rank's microbatches."""
