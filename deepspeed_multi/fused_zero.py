"""The fused gradient-bucket ops (deepspeed_multi.ops) in DeepSpeed's ZeRO-2/3 reduction path."""


def install(optimizer) -> bool:
    """Route ``optimizer``'s bucket passes through the fused ops; return whether anything changed."""
    return False
