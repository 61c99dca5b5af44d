"""ZeRO-3: what MultiEngine changes in DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3`` and its parameters.

``cast_on_gather``   bf16/fp16: a parameter's 16-bit partition is cast from the fp32 master when gathered.
``counters``         the per-module backward counters, so a retained graph can be backpropagated again.
``generation``       engines that generate inside a training loop: no hang on uneven lengths.
``grad_view``        the update reads its fp32 gradient in place, not from a flattened copy of it.
``hpz_group``        an engine without hpZ is built without another engine's hpZ group.
``joined_fetch``     the first parameter fetch of several engines' forwards, as one all-gather.
``lazy_grads``       a sub-group's gradient partition exists from its first gradient to the update only.
``partition``        the reduced gradient partitions copied or added into their buffers in fused runs.
``predivide``        gradient averaging when ``gradient_predivide_factor`` equals the data-parallel size.
``prefetch``         prefetches that no forward will consume, drained where none can be.
``rank_order``       gradients enter the bucket in the reduce-scatter's rank order (no second buffer).
``release_between``  what an engine keeps gathered after its forward, released when another's forward runs.
``scatter``          the reduce-scatter input built in one fused pass, not one slice per parameter per rank.

Installed (or called) by ``deepspeed_multi.zero``, the engine and ``initialize``; this package imports
nothing itself.
"""
