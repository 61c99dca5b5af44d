"""ZeRO-0: what MultiEngine changes in DeepSpeed's optimizers without ZeRO partitioning.

``fp16_norm``  fp16 with an unfused optimizer: the gradient norm the update keeps, unscaled.

Installed by ``deepspeed_multi.zero.install``; this package imports nothing itself.
"""
