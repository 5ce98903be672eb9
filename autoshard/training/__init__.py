"""The training layer: Paddle's shard_layer / shard_optimizer / shard_dataloader / to_static and
distributed checkpoints, on top of the compiler."""
