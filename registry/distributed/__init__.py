"""Rank-consistent loading over torch.distributed; may import the ops layer and everything below it."""
