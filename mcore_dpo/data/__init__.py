"""Preference pairs: loading and tokenizing them, global batches, and cutting them into padded or packed microbatches."""
