"""The bench/ scripts at toy sizes (no GPU, no training)."""
