"""Each model's DeepSpeed config under a Lightning strategy: the strategy's config, the model's own
over it, Lightning's precision, and the checks that keep them from contradicting each other.

[Note: a config per model under Lightning]
The strategy holds one config (its ``config=`` or Lightning's defaults from ``stage=`` and the
other DeepSpeedStrategy arguments). A model may have its own: ``with_config(model, cfg)`` before
``fabric.setup``, or ``configs={"ClassName": cfg}`` given to the strategy (the model's class
name). The model's config is merged over the strategy's, section by section, so it names only
what differs (usually ``zero_optimization``). Lightning's ``precision=`` fills the fp16/bf16
section of a config that has none, as Lightning's DeepSpeedStrategy does; a config whose own
section says otherwise is refused. The loop owns gradient accumulation ([Note: the caller owns
gradient accumulation] in integrations/engine_steps.py), so ``gradient_accumulation_steps`` must
stay 1; it clips where it calls ``fabric.clip_gradients``, so a config without
``gradient_clipping`` clips nothing (DeepSpeed's own default clips at 1.0); and a model's
micro-batch size may not differ from the strategy's: DeepSpeed's batch bookkeeping would then
describe another loop than the one that runs.
"""
import copy
import weakref

from ..config import enabled, load_config, merged

_OWN_CONFIGS = weakref.WeakKeyDictionary()   # module -> its config (with_config)
_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "train_batch_size")
_PRECISION_SECTIONS = {"16-mixed": "fp16", "16-true": "fp16", "bf16-mixed": "bf16", "bf16-true": "bf16",
                       "32-true": None}


def with_config(module, config):
    """Give ``module`` its own DeepSpeed config for the coming ``fabric.setup``.

    The config is merged over the strategy's ([Note: a config per model under Lightning]) and takes
    precedence over ``configs=``.

    Args:
        module (torch.nn.Module): the model.
        config (dict or str): its DeepSpeed config, a dict or a JSON path (read now).

    Returns:
        ``module`` itself, so ``fabric.setup(with_config(teacher, zero3), ...)`` reads as one call.
    """
    _OWN_CONFIGS[module] = load_config(config)
    return module


def own_config(module, by_class: dict):
    """The model's own config, or None: ``with_config``'s, else ``by_class[type(module).__name__]``."""
    if module in _OWN_CONFIGS:
        return copy.deepcopy(_OWN_CONFIGS[module])
    name = type(module).__name__
    return load_config(by_class[name]) if name in by_class else None


def check_by_class(configs) -> dict:
    if configs is None:
        return {}
    if not isinstance(configs, dict) or not all(isinstance(k, str) for k in configs):
        raise TypeError(f"configs= must map model class names to DeepSpeed configs (dict or JSON path), e.g. "
                        f"{{'Generator': {{'zero_optimization': {{'stage': 2}}}}}}; got {type(configs).__name__}.")
    return dict(configs)


def for_model(template, precision: str, own, model_name: str, trains: bool) -> dict:
    """``engine_config`` with the precision settings of ``template``, the Lightning DeepSpeedStrategy
    that holds the strategy's config (its fp16 loss-scale arguments)."""
    from lightning.fabric.strategies.deepspeed import _format_precision_config

    def fill_precision(config):
        _format_precision_config(config=config, precision=precision, loss_scale=template.loss_scale,
                                 loss_scale_window=template.loss_scale_window, min_loss_scale=template.min_loss_scale,
                                 initial_scale_power=template.initial_scale_power, hysteresis=template.hysteresis)
    return engine_config(template.config, own, model_name, precision, fill_precision, trains)


def engine_config(base: dict, own, model_name: str, precision: str, fill_precision, trains: bool) -> dict:
    """The config ``deepspeed_multi.initialize`` gets for one model (see the Note).

    ``fill_precision(config)`` is Lightning's precision formatting with the strategy's fp16 settings."""
    own = own or {}
    where = f"the DeepSpeed config of {model_name}"
    for cfg, name in ((base, "the strategy's DeepSpeed config"), (own, where)):
        gas = cfg.get("gradient_accumulation_steps", 1)
        if gas not in (1, "auto"):
            raise ValueError(
                f"{name} sets gradient_accumulation_steps={gas}. Under MultiDeepSpeedStrategy the loop owns "
                "accumulation, as under DDP: call optimizer.step() once per window (fabric.no_backward_sync(model) "
                "around the other micro-batches), divide the loss by the window if you want its mean, and leave "
                "gradient_accumulation_steps at 1.")
        if "optimizer" in cfg and (trains or cfg is own):
            raise ValueError(f"{name} has an \"optimizer\" section; pass the torch optimizer to fabric.setup(model, "
                             "optimizer) instead (one optimizer per model).")
    for key in _BATCH_KEYS:
        if key in own and key in base and own[key] != base[key]:
            raise ValueError(f"{where} sets {key}={own[key]} but the strategy's config {base[key]}: every model "
                             "sees the batches of the one loop. Drop the key from the model's config.")
    section = _PRECISION_SECTIONS.get(precision)
    for name in ("fp16", "bf16"):
        for cfg, label in ((own, where), (base, "the strategy's DeepSpeed config")):
            if name not in cfg:
                continue
            on = enabled(cfg[name])
            if on and section != name:
                raise ValueError(f"{label} enables {name} but Fabric runs with precision={precision!r}. Make them "
                                 f"agree: Fabric(precision=...) sets every model's precision; drop the {name} section "
                                 "or change the precision.")
            if not on and section == name and cfg[name].get("enabled") is False:
                raise ValueError(f"{label} disables {name} but Fabric runs with precision={precision!r}. Drop the "
                                 f"{name} section (the precision fills it) or change the precision.")
    config = merged(base, own)
    config["gradient_accumulation_steps"] = 1
    # DeepSpeed clips at 1.0 unless told otherwise; the loop written for DDP clips where it calls
    # fabric.clip_gradients, which needs the model's config to name the same value.
    config.setdefault("gradient_clipping", 0.0)
    config.setdefault("train_micro_batch_size_per_gpu", 1)
    if not trains:
        # A frozen model has no optimizer: the strategy's optimizer-side settings do not apply to it.
        config.pop("optimizer", None)
        config.pop("scheduler", None)
        config.get("zero_optimization", {}).pop("offload_optimizer", None)
    fill_precision(config)
    return config
