"""The module state that a Trainer checkpoint leaves out, for trainers built by ``deepspeed_multi.transformers``:
the parameters of the role engines (reference, reward, teacher models) and this rank's buffers.

[Note: role models in Trainer checkpoints]
A Trainer checkpoint holds the policy (its DeepSpeed checkpoint), never the reference, reward or
teacher models: "frozen" is taken to mean "unchanged". They do change: ``sync_ref_model=True`` mixes
the policy into DPO's reference every ``ref_model_sync_steps`` (TR-DPO), and a teacher may be an EMA.
A resumed TRL run (DDP or upstream DeepSpeed) then goes on with the reference the script builds,
the initial policy's weights, and leaves the uninterrupted run at the next step that reads it. Here
each role engine prepared without an optimizer (``ref_model``, ``teacher_model``,
``reward_funcs_<i>``) saves its parameters (at ZeRO-3 each rank's partitions) and this rank's
buffers into ``<checkpoint-N>/dsm_module_state/<role>/`` after the policy's checkpoint and before
``trainer_state.json``, and ``train(resume_from_checkpoint=...)`` loads them after the policy's
(checkpoint/module_state.py, same number of ranks). The policy's engine adds this rank's buffers
there (``model/``) when its module has persistent ones: DeepSpeed's checkpoint gives every rank
rank 0's ([Note: buffers rank by rank]); a model in parts saves them in its own set checkpoint. A
checkpoint without that folder (an earlier release) resumes as before, with a warning. The hooks are
``_save_optimizer_and_scheduler`` and ``_load_optimizer_and_scheduler`` (deepspeed_multi/transformers.py),
which Trainer calls only there, with the checkpoint's folder.
"""
import glob
import logging
import os

from ..engine import MultiEngine

logger = logging.getLogger("deepspeed_multi.transformers")  # the integration's own logger: its users listen there

STATE_DIR = "dsm_module_state"


def state_engines(trainer, roles) -> dict:
    """The engines whose module state a Trainer checkpoint leaves out (see the Note).

    Args:
        trainer: a trainer built by ``multi_engine_trainer``.
        roles: the trainer attributes that may hold role engines (``ref_model``, ``reward_funcs``,
            ``teacher_model``).

    Returns:
        dict: name (``ref_model``, ``teacher_model``, ``reward_funcs_<i>``, ``model``) -> engine: the role
            engines without an optimizer, and the policy's engine if its module has persistent buffers.
    """
    out = {}
    for role in roles:
        value = getattr(trainer, role, None)
        items = enumerate(value) if role == "reward_funcs" and isinstance(value, (list, tuple)) else [(None, value)]
        for i, engine in items:
            if isinstance(engine, MultiEngine) and not engine.has_optimizer:
                out[role if i is None else f"{role}_{i}"] = engine
    policy = trainer.model_wrapped
    if isinstance(policy, MultiEngine) and policy.has_optimizer:
        from ..checkpoint import module_state
        if module_state.persistent_buffers(policy.module):
            out["model"] = policy
    return out


def save_state(trainer, output_dir, roles) -> None:
    """Save the state of each engine :func:`state_engines` names into ``<output_dir>/dsm_module_state/<name>/``.

    Args:
        trainer: a trainer built by ``multi_engine_trainer``.
        output_dir (str): the checkpoint's folder, as the Trainer passes it to ``_save_optimizer_and_scheduler``.
        roles: as for :func:`state_engines`.
    """
    from ..checkpoint import module_state
    for name, engine in state_engines(trainer, roles).items():
        module_state.save_engine_state(engine, os.path.join(output_dir, STATE_DIR, name))


def load_state(trainer, checkpoint, roles) -> None:
    """Load what :func:`save_state` saved into ``checkpoint`` back into the trainer's engines.

    A checkpoint without the folder (an earlier release) is warned about on rank 0 and its engines resume
    as the script built them; one saved on another number of ranks leaves the policy with rank 0's
    buffers, with a warning.

    Args:
        trainer: a trainer built by ``multi_engine_trainer``.
        checkpoint (str or None): the checkpoint's folder, as the Trainer passes it to
            ``_load_optimizer_and_scheduler``; None loads nothing.
        roles: as for :func:`state_engines`.

    Raises:
        RuntimeError: on every rank, when any rank could not load an engine's state (e.g. a role saved by
            another number of ranks); the message names the checkpoint and the engine.
    """
    engines = state_engines(trainer, roles) if checkpoint is not None else {}
    if not engines:
        return
    from ..checkpoint import module_state
    from ..checkpoint.files import raise_if_any
    import deepspeed.comm as dist
    saved = {n: os.path.join(checkpoint, STATE_DIR, n) for n in engines}
    missing = [n for n, d in saved.items() if not os.path.isdir(d)]
    # DeepSpeed's load gave every rank rank 0's buffers; on another number of ranks the policy keeps those.
    other_world = [n for n, d in saved.items() if n == "model" and n not in missing
                   and len(glob.glob(os.path.join(d, "dsm_module_state_rank*.pt"))) != dist.get_world_size()]
    if (missing or other_world) and dist.get_rank() == 0:
        if missing:
            logger.warning("deepspeed_multi: %s holds no state of %s (%s is missing: saved by an earlier release); "
                           "they resume as this script built them.", checkpoint, missing, STATE_DIR)
        if other_world:
            logger.warning("deepspeed_multi: %s was saved on another number of ranks; every rank of the trained "
                           "model resumes with rank 0's buffers.", checkpoint)
    error = None
    for name, engine in engines.items():
        if error is None and name not in missing + other_world:
            error = module_state.load_engine_state(engine, saved[name], name)
    raise_if_any(f"deepspeed_multi: resume_from_checkpoint={checkpoint!r}: {error}" if error else None)
