"""``deepspeed_multi.initialize``: ``deepspeed.initialize`` that builds a MultiEngine."""
import contextlib
import copy
import functools
import inspect
import logging
import threading

import deepspeed
import torch
from deepspeed.runtime.zero.partition_parameters import Init
from . import compat, host_memory
from .config import OPTIONS_KEY, load_config, prepare_engine_config, zero_stage
from .engine import MultiEngine
from .parts.plan import declared_submodules
from .reliability import discarded_writes, managed_path
from .reliability.misuse import refuse_engine_as_model, refuse_parameters_of_live_engine
from .zero import block_sizes, torch_autocast, zero_dim
from .zero.stage3 import counters as stage3_counters
from .zero.stage3 import generation as stage3_generation
from .zero.stage3 import hpz_group

# Reentrant: parts/build.py builds one engine per part through initialize() again.
_ENGINE_CLASS_LOCK = threading.RLock()
logger = logging.getLogger(__name__)


def _upstream_initialize():
    """DeepSpeed's own ``initialize``, whatever ``deepspeed.initialize`` is bound to now.

    [Note: deepspeed.initialize swapped for ours]
    A program (or a harness's import hook) may bind ``deepspeed.initialize`` to ours, so that code it
    did not write (Accelerate's ``prepare``, the Trainer) builds our engines. Calling
    ``deepspeed.initialize`` from here would then call ourselves. DeepSpeed's function is the one
    defined in ``deepspeed``'s own module, found through any ``functools.wraps`` wrappers; it
    resolves ``DeepSpeedEngine`` from that module's globals, which is where we swap the class in."""
    fn = inspect.unwrap(deepspeed.initialize)
    return fn if getattr(fn, "__module__", None) == "deepspeed" else _DEEPSPEED_INITIALIZE


def _refuse_mics(config):
    """MiCS cannot be checked here, so it is refused rather than trusted: DeepSpeed 0.19.8 removed
    it (its config refuses ``mics_shard_size``), and on 0.19.4-0.19.7 its parameter gather
    (``all_gather_coalesced`` under a coalescing manager) needs NCCL: gloo has no
    ``startCoalescing``, so no CPU run of a MiCS engine exists to compare with plain PyTorch."""
    shard = (config.get("zero_optimization") or {}).get("mics_shard_size", -1)
    if isinstance(shard, int) and shard > 0:
        raise NotImplementedError(
            f"deepspeed_multi does not support MiCS (zero_optimization.mics_shard_size={shard}): DeepSpeed 0.19.8 "
            "removed it, and on earlier releases its gradients under deepspeed_multi are untested (its parameter "
            "gather needs NCCL coalescing, which gloo lacks). For ZeRO-3 partitions kept within a node use hpZ "
            "(zero_optimization.zero_hpz_partition_size = ranks per node), tested exact on 2 nodes.")


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    """Build a :class:`~deepspeed_multi.MultiEngine`: ``deepspeed.initialize`` with the same arguments and 4-tuple.

    The engine runs DeepSpeed's backward prologue and epilogue from autograd hooks, so one plain
    ``loss.backward()`` through any number of engines gives the gradients plain PyTorch would; under
    ``engine.backward(loss)`` / ``engine.step()`` it gives upstream's bits. A config that uses a feature
    owning DeepSpeed's accumulation boundary (DeepCompile, ZenFlow, SuperOffload, the hybrid engine, a
    ``PipelineModule``) builds upstream's engine class on its managed path instead ([Note: the drop-in
    rule]). A config that declares submodules at other ZeRO stages (``"deepspeed_multi": {"submodules":
    ...}``) builds one engine per part (docs/parts.md). The ``"deepspeed_multi"`` config section holds
    this package's options (docs/options.md); DeepSpeed never sees it.

    Args:
        args: an object with ``deepspeed_config`` (and ``local_rank``), as DeepSpeed's; optional with ``config``.
        model (torch.nn.Module): the model, before any wrapper.
        optimizer: an optimizer, or a callable taking the parameters and returning one; overrides the
            config's ``"optimizer"`` section. None and no section: a frozen engine (at ZeRO-1/2 built at
            stage 0, which is what such an engine is).
        model_parameters: the tensors or parameter groups to optimize.
        training_data (torch.utils.data.Dataset, optional): DeepSpeed builds a data loader over it.
        lr_scheduler: a scheduler, or a callable taking the optimizer and returning one.
        distributed_port (int, optional): the rendezvous port, as DeepSpeed's.
        mpu: a model-parallel unit (``get_{model,data}_parallel_{rank,group,world_size}()``).
        dist_init_required (bool, optional): None initializes ``torch.distributed`` where needed.
        collate_fn: the data loader's collate function.
        config (dict or str): the DeepSpeed config, or a path to its JSON file.
        mesh_param: DeepSpeed's device-mesh shape (``(data_parallel, sequence_parallel)``).
        config_params: the same as ``config``, kept by DeepSpeed for old code.

    Returns:
        tuple: ``(engine, optimizer, training_dataloader, lr_scheduler)``, as ``deepspeed.initialize``.

    Raises:
        ValueError: no config; an unknown ``"deepspeed_multi"`` key or a value of the wrong type; a
            ``"deepspeed_multi"`` section beside a feature on DeepSpeed's managed path; a config the installed
            DeepSpeed release gets wrong (the message names the key and the release that fixes it).
        TypeError: ``model`` is already an engine.
        RuntimeError: ``model`` holds parameters a live trainable engine owns.
        NotImplementedError: MiCS (``mics_shard_size``); a trained ZeRO-0 engine under sequence parallelism.
        deepspeed_multi.compat.UnsupportedDeepSpeed: a DeepSpeed release outside the supported window.
    """
    compat.check_deepspeed()  # a DeepSpeed outside the supported window: a clear error first
    refuse_engine_as_model(model, "deepspeed_multi.initialize")
    if config is None and config_params is not None:
        config = config_params
    if config is None and getattr(args, "deepspeed_config", None) is not None:
        config, args = args.deepspeed_config, copy.copy(args)
        args.deepspeed_config = None
    if config is None:
        raise ValueError("deepspeed_multi.initialize needs a DeepSpeed config: pass config=<dict or path> "
                         "(or args.deepspeed_config).")
    config = load_config(config)
    kwargs = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                  training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                  dist_init_required=dist_init_required, collate_fn=collate_fn, mesh_param=mesh_param)
    if distributed_port is not None:
        kwargs["distributed_port"] = distributed_port
    feature = managed_path.feature_of(model, config)
    if feature is not None:  # [Note: the drop-in rule]
        return _initialize_managed(feature, config, kwargs)
    declared = declared_submodules(config)
    if declared is not None:  # one model, several ZeRO stages (parts/plan.py)
        from .parts.build import initialize_parts
        extra = {} if distributed_port is None else {"distributed_port": distributed_port}
        return initialize_parts(initialize, model, config, declared, optimizer=optimizer,
                                model_parameters=model_parameters, lr_scheduler=lr_scheduler,
                                training_data=training_data, args=args, mpu=mpu, dist_init_required=dist_init_required,
                                collate_fn=collate_fn, mesh_param=mesh_param, **extra)
    config, user_managed, options = prepare_engine_config(config)
    if optimizer is None and "optimizer" not in config and zero_stage(config) in (1, 2):
        # ZeRO-1/2 partition optimizer states and gradients; an inference-only engine has
        # neither, so it is exactly a stage-0 engine (DeepSpeed refuses stage 1/2 without one).
        logger.info("deepspeed_multi: no optimizer given for a ZeRO stage %d config: building an "
                    "inference-only engine at stage 0.", zero_stage(config))
        config["zero_optimization"]["stage"] = 0
        config["zero_optimization"].pop("overlap_comm", None)  # [Note: overlap_comm below ZeRO-2]
    _refuse_mics(config)
    block_sizes.fill(config, model, optimizer, options.min_block_elements)  # [Note: sizes from the model's block]
    trains = optimizer is not None or "optimizer" in config
    refuse_parameters_of_live_engine(model, trains, "deepspeed_multi.initialize")
    if zero_stage(config) == 3 and isinstance(model, torch.nn.Module):
        stage3_counters.forget(model)  # left by an engine dropped without destroy(): not this one's to reuse

    kwargs["config"] = config
    engine_class = functools.partial(MultiEngine, user_managed_boundary=user_managed, options=options)
    # deepspeed.initialize resolves the engine class from its module globals; swapping it for
    # the duration of the call reuses all of its argument handling without copying it.
    # ZeRO-3's conversion takes 0-dim parameters too ([Note: 0-dim parameters in DeepSpeed's broadcast]).
    zero_init_param = zero_dim.zero3_init_param(Init._zero_init_param)
    with _ENGINE_CLASS_LOCK, compat.swapped(deepspeed, "DeepSpeedEngine", engine_class), \
            compat.swapped(Init, "_zero_init_param", zero_init_param), torch_autocast.scoped(config), \
            hpz_group.for_config(config):  # [Note: hpZ's group is the config's]
        host_memory.import_muon_kernels()  # [Note: Muon's kernels compiled at their first call]
        built = _upstream_initialize()(**kwargs)  # [Note: deepspeed.initialize swapped for ours]
    torch_autocast.keep_own_comm_dtype(built[0], config)  # [Note: torch_autocast is per engine]
    _refuse_sequence_parallel_zero0(built[0])
    if built[0].zero_optimization_stage() == 3:
        discarded_writes.install(built[0])  # [Note: writes that GatheredParameters discards]
        stage3_generation.install(built[0])  # [Note: generation from a ZeRO-3 engine]
    host_memory.release_free_heap()  # [Note: construction's free heap]
    return built


def _initialize_managed(feature, config, kwargs):
    """An engine of a boundary-owning feature, built as upstream builds it ([Note: the drop-in rule]).

    Our own options do not apply on DeepSpeed's managed path: a "deepspeed_multi" section is refused."""
    if OPTIONS_KEY in config:
        raise ValueError(f"deepspeed_multi.initialize: this config uses {feature}, whose engine runs on DeepSpeed's "
                         f"managed path as upstream builds it, where deepspeed_multi's own options do not apply; "
                         f"remove its \"{OPTIONS_KEY}\" section {sorted(config[OPTIONS_KEY])}.")
    _refuse_mics(config)
    kwargs["config"] = config
    with _ENGINE_CLASS_LOCK, contextlib.ExitStack() as swaps:
        for name, cls in managed_path.engine_classes(feature).items():
            if hasattr(deepspeed, name):
                swaps.enter_context(compat.swapped(deepspeed, name, cls))
        return _upstream_initialize()(**kwargs)


_DEEPSPEED_INITIALIZE = inspect.unwrap(deepspeed.initialize)  # at import, before a program rebinds it


def _refuse_sequence_parallel_zero0(engine) -> None:
    """A trained ZeRO-0 engine under sequence parallelism averages its gradients over the sequence-data-
    parallel group divided by dp/sp, not by its size: every update is sp times too large (upstream too).
    ZeRO-1/2/3 are corrected (zero/sequence_parallel.py); ZeRO-0's reduction is the engine's own."""
    sp = getattr(engine, "sequence_parallel_size", 1) or 1
    if sp > 1 and engine.zero_optimization_stage() == 0 and engine.trains:
        engine.destroy()
        raise NotImplementedError(
            f"deepspeed_multi.initialize: {type(engine.module).__name__} is trained at ZeRO stage 0 with sequence "
            f"parallelism (sequence_parallel_size {sp}): DeepSpeed's ZeRO-0 reduction divides the gradients summed "
            f"over the {sp}-way sequence-parallel group by the data-parallel size only, so every update would be "
            f"{sp}x the full-sequence one (upstream DeepSpeed does this too). Use ZeRO stage 1, 2 or 3 for this "
            "engine (each is exact under sequence parallelism); an engine without an optimizer (a reference "
            "model) is fine at stage 0.")
