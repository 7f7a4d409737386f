"""psld.torch: PyTorch integration (DistributedOptimizer, a DDP communication hook, broadcasts)."""
