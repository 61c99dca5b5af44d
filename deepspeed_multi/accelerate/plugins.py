"""Which DeepSpeed config one ``prepare`` call uses: the RFC's per-call choice.

``prepare(..., deepspeed_plugin=X)`` accepts the name of a plugin given to the Accelerator, a
``DeepSpeedPlugin``, or a DeepSpeed config (dict or path to a JSON file). A new plugin or config
is registered in ``AcceleratorState.deepspeed_plugins`` under a fresh name, with the Accelerator's
``mixed_precision`` applied as to the plugins given at construction (see accelerator.py), and
selected for the call only; the plugin selected before comes back afterwards.
"""
import contextlib

from accelerate.utils import DeepSpeedPlugin


def _as_dict(state):
    """Accelerate keeps a single plugin unnamed; name it "default" so that others can sit beside it."""
    plugins = state.deepspeed_plugins
    if not isinstance(plugins, dict):
        state.deepspeed_plugins = {"default": plugins}
    return state.deepspeed_plugins


def _selected_name(plugins):
    return next((name for name, plugin in plugins.items() if plugin.selected), None)


def resolve(state, choice, mixed_precision):
    """Return the registered name of ``choice`` (registering it if new)."""
    plugins = _as_dict(state)
    if isinstance(choice, str) and choice in plugins:
        return choice
    if isinstance(choice, DeepSpeedPlugin):
        for name, plugin in plugins.items():
            if plugin is choice:
                return name
        plugin = choice
    elif isinstance(choice, (dict, str)):
        try:
            plugin = DeepSpeedPlugin(hf_ds_config=choice)
        except ValueError as e:
            raise ValueError(f"prepare(deepspeed_plugin={choice!r}): expected the name of one of the Accelerator's "
                             f"plugins {sorted(plugins)}, a DeepSpeedPlugin, or a DeepSpeed config dict or path to a "
                             f"JSON file; reading it as a config failed: {e}") from e
    else:
        raise TypeError(f"prepare(deepspeed_plugin=...): expected a plugin name (one of {sorted(plugins)}), a "
                        f"DeepSpeedPlugin, or a DeepSpeed config dict/path; got {type(choice).__name__}.")
    plugin.set_mixed_precision(mixed_precision)
    name = f"prepare_{len(plugins)}"
    while name in plugins:
        name += "_"
    plugins[name] = plugin
    return name


@contextlib.contextmanager
def selected(state, name):
    """Select plugin ``name`` for the block; re-select the one selected before on exit."""
    plugins = _as_dict(state)
    before = _selected_name(plugins)
    state.select_deepspeed_plugin(name)
    try:
        yield plugins[name]
    finally:
        if before is not None and before != name:
            state.select_deepspeed_plugin(before)
