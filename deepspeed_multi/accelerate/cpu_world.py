"""Accelerate's process count in DeepSpeed mode on machines without an accelerator.

[Note: Accelerate's DeepSpeed mode on CPU]
On a CPU-only machine (``DS_ACCELERATOR=cpu``, gloo), Accelerate 1.15 starts DeepSpeed's process
group with all ranks, but its own state picks no backend and records ``num_processes=1`` and
``process_index=0`` on every rank: every rank is "main" (prints, saves), ``reduce(...,"mean")``
divides a sum by 1, a prepared DataLoader is not sharded, and a scheduler wrapper steps once
where it would step ``num_processes`` times on GPUs. Our Accelerator puts the real world size and
ranks of the running process group into Accelerate's shared state after construction, so CPU
runs behave as GPU runs do. Nothing else changes, and it does nothing where the counts agree.
"""
import os

import torch.distributed as tdist


def sync_world_size(state):
    if not (tdist.is_available() and tdist.is_initialized()):
        return
    world, rank = tdist.get_world_size(), tdist.get_rank()
    if state.num_processes == world and state.process_index == rank:
        return
    from accelerate.state import AcceleratorState, PartialState
    values = {"num_processes": world, "process_index": rank,
              "local_process_index": int(os.environ.get("LOCAL_RANK", rank))}
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        if shared:
            shared.update(values)
