"""ZeRO-1/2: what MultiEngine changes in DeepSpeed's ``DeepSpeedZeroOptimizer``.

``bucket_pack``    gradients enter the reduction bucket in one fused pack per flush, not one copy each.
``grad_view``      the update reads this rank's gradient partition in place, not from a flattened copy.
``hook_count``     DeepSpeed's per-parameter gradient hook, with the used-parameter count cached.
``overflow``       bf16/fp16: the gradient norm's all-reduce also decides overflow; the flag's is not run.
``overlap_order``  ZeRO-1 only, with ``overlap_comm``: the update reduces in the order upstream's hooks do.
``reduce``         the bucket all-reduced where it lies, and the copies after it fused.
``round_robin``    ``round_robin_gradients``: each parameter linked to its own slice of the fp32 master.

Installed by ``deepspeed_multi.zero.install``; this package imports nothing itself.
"""
