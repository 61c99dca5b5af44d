"""The extra models of TRL's trainers (reference, reward, teacher), each with its own DeepSpeed config,
for trainers built by ``deepspeed_multi.transformers.multi_engine_trainer``.

[Note: a config per TRL role]
TRL's trainers build their extra models (the reference of DPO/GRPO/RLOO/KTO, GRPO's and RLOO's
reward models, the distillation teachers) with ``trl.models.prepare_deepspeed``, which copies
the policy's config, forces stage 0 unless the policy is at ZeRO-3 and calls
``deepspeed.initialize`` itself, so no role can have its own stage. A trainer built by
:func:`multi_engine_trainer` takes ``deepspeed_roles={"ref_model" | "reward_funcs" |
"teacher_model": config}``; while its ``__init__`` runs, the ``prepare_deepspeed`` that its TRL
module calls is swapped (``compat.swapped``, nothing copied) for one that prepares the model of a
named role through this Accelerator, frozen and without an optimizer, with the policy's config
(less its optimizer, scheduler and optimizer offload) under the role's. The engine then stays in
the Accelerator for the whole run (``free_memory`` keeps it). A model whose role is not named
gets TRL's own treatment. Where TRL then asks whether "DeepSpeed" is at ZeRO-3, the answer is the
model's own ([Note: TRL's one-config checks] in integrations/trl_stages.py).
"""
import copy

from ..config import enabled, load_config, merged

ROLES = ("ref_model", "reward_funcs", "teacher_model")


def role_of(trainer, model) -> str:
    """The role of ``model`` in ``trainer``: ``"ref_model"``, ``"reward_funcs"``, ``"model"`` or ``"teacher_model"``.

    Args:
        trainer: a trainer built by ``multi_engine_trainer``, in its ``__init__``.
        model: the model TRL's ``prepare_deepspeed`` was called with.

    Returns:
        str: the role's name (``"model"``: the policy); a model that is none of the others is the teacher
            (the distillation trainers prepare it before assigning it).
    """
    if model is getattr(trainer, "ref_model", None):
        return "ref_model"
    if any(model is f for f in getattr(trainer, "reward_funcs", None) or ()):
        return "reward_funcs"
    if model is getattr(trainer, "model", None):
        return "model"
    return "teacher_model"  # the distillation trainers pass it before assigning it


_FROZEN_ONLY = ("optimizer", "scheduler")           # a role model is prepared without an optimizer
_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_PRECISIONS = ("fp16", "bf16")


def role_config(accelerator, given: dict, role: str = "ref_model") -> dict:
    """The DeepSpeed config of a TRL role's model: the policy's without its training-only sections, the role's over it.

    A role may name its own stage, precision, offload of parameters, bucket sizes. Refused, before
    any step: sections that only a trained model uses (the role is frozen), a batch geometry other
    than the policy's (the trainer feeds every model the same micro-batches), and fp16 and bf16
    both on. A role that turns one precision on runs in it alone: the policy's other one is dropped.

    Args:
        accelerator: the trainer's Accelerator; its selected plugin's ``deepspeed_config`` is the policy's.
        given (dict or str): the role's config (``deepspeed_roles[role]``), a dict or a JSON path; its
            batch keys set to ``"auto"`` take the policy's values.
        role (str): the role's name (``"ref_model"``, ``"reward_funcs"`` or ``"teacher_model"``), for the messages.

    Returns:
        dict: a fresh config: the policy's without ``optimizer``, ``scheduler`` and
            ``zero_optimization.offload_optimizer`` (nor its other precision when the role enables one),
            with the role's sections merged over it; neither input is changed.

    Raises:
        ValueError: when the role's config sets ``optimizer``, ``scheduler`` or
            ``zero_optimization.offload_optimizer``, sets ``train_batch_size``,
            ``train_micro_batch_size_per_gpu`` or ``gradient_accumulation_steps`` to another value than
            the policy's, or enables both fp16 and bf16; the message names ``deepspeed_roles[role]`` and the keys.
    """
    given = copy.deepcopy(load_config(given))
    policy = accelerator.state.deepspeed_plugin.deepspeed_config
    for key in _BATCH:  # "auto" in a role: the policy's (the trainer has filled them in)
        if given.get(key) == "auto":
            given.pop(key)
    where = f"deepspeed_roles[{role!r}]"
    frozen_only = [k for k in _FROZEN_ONLY if k in given]
    frozen_only += ["zero_optimization.offload_optimizer"] * ("offload_optimizer" in given.get("zero_optimization", {}))
    if frozen_only:
        raise ValueError(f"{where} sets {frozen_only}: the trainer's {role} is frozen (prepared without an optimizer), "
                         "so these would do nothing. Drop them from the role's config; the policy's optimizer "
                         "settings belong in TrainingArguments(deepspeed=...).")
    for key in _BATCH:
        mine, theirs = given.get(key, "auto"), policy.get(key, "auto")
        if mine != "auto" and theirs != "auto" and mine != theirs:
            raise ValueError(f"{where} sets {key}={mine!r} but the policy's config has {key}={theirs!r}: the trainer "
                             f"feeds the {role} the policy's micro-batches. Drop {key} from the role's config.")
    precisions = [p for p in _PRECISIONS if enabled(given.get(p))]
    if len(precisions) > 1:
        raise ValueError(f"{where} enables both fp16 and bf16; a model runs in one. Enable one of them.")
    base = copy.deepcopy(policy)
    for key in _FROZEN_ONLY:
        base.pop(key, None)
    base.get("zero_optimization", {}).pop("offload_optimizer", None)
    for other in set(_PRECISIONS) - set(precisions) if precisions else ():
        base.pop(other, None)
    return merged(base, given)


def prepare_role(trainer, original):
    """TRL's ``prepare_deepspeed`` for a trainer built with ``deepspeed_roles`` (see the Note).

    Args:
        trainer: the trainer being built; its ``_dsm_roles`` holds ``deepspeed_roles``.
        original: the ``prepare_deepspeed`` of the TRL module, for the models of roles not named.

    Returns:
        The function swapped in for ``prepare_deepspeed(model, accelerator)``: a named role's model, frozen,
            is prepared by ``accelerator`` with :func:`role_config`'s config and returned as its engine.
    """
    def prepare_deepspeed(model, accelerator):
        role = role_of(trainer, model)
        given = trainer._dsm_roles.get(role)
        if given is None:
            return original(model, accelerator)
        model.requires_grad_(False)
        engine = accelerator.prepare(model, deepspeed_plugin=role_config(accelerator, given, role))
        engine._dsm_role = role
        engine.eval()
        return engine
    return prepare_deepspeed
