"""Hugging Face Transformers' process-wide DeepSpeed config, set for one block and restored.

Transformers decides at model construction (``from_pretrained``/``from_config``) whether to
partition with ``deepspeed.zero.Init``, from one global weak reference to an ``HfDeepSpeedConfig``
(``transformers.integrations.deepspeed``). :func:`hf_deepspeed_config` points it at the config of
the model being built, or at nothing, for the duration of a ``with`` block, then puts back what
was there (an Accelerate plugin's config, say). It does nothing when transformers is not
installed: the core package does not need it.
"""
import contextlib
import importlib.util


def _hf_integration():
    # Transformers' DeepSpeed integration needs Accelerate too; without either there is nothing to set.
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None:
        return None
    import transformers.integrations.deepspeed as hf_ds
    return hf_ds


@contextlib.contextmanager
def hf_deepspeed_config(config):
    """Within the block, Transformers sees ``config`` (a dict) as its DeepSpeed config, or none if ``None``."""
    hf_ds = _hf_integration()
    if hf_ds is None:
        yield
        return
    previous_ref = hf_ds._hf_deepspeed_config_weak_ref
    previous = previous_ref() if previous_ref is not None else None
    # HfDeepSpeedConfig registers itself as the global config; keep it alive for the block.
    current = hf_ds.HfDeepSpeedConfig(config) if config is not None else None
    if current is None:
        hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if previous is not None:
            hf_ds.set_hf_deepspeed_config(previous)
        else:
            hf_ds.unset_hf_deepspeed_config()
        del current
