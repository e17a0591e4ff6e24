"""Sharded checkpoints on torch.distributed.checkpoint, loadable at any world size or stage."""
