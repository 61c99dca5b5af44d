"""Which DeepSpeed config one ``prepare`` call uses: the RFC's per-call choice.

``prepare(..., deepspeed_plugin=X)`` accepts the name of a plugin given to the Accelerator, a
``DeepSpeedPlugin``, or a DeepSpeed config (dict or path to a JSON file). A new plugin or config
is registered in ``AcceleratorState.deepspeed_plugins`` under a fresh name, with the Accelerator's
``mixed_precision`` applied as to the plugins given at construction (see accelerator.py), and
selected for the call only; the plugin selected before comes back afterwards.

[Note: the launcher's settings are the default plugin's]
``accelerate launch --config_file <a DeepSpeed yaml>`` exports the yaml's DeepSpeed fields
(``ACCELERATE_DEEPSPEED_ZERO_STAGE``, ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, ... and their
list in ``ACCELERATE_CONFIG_DS_FIELDS``) for the plugin the Accelerator builds from the
environment. A config given to ``prepare`` is a plugin of its own: Accelerate would refuse it
beside those fields ("When using deepspeed_config_file, the following accelerate config
variables will be ignored"), or fill its ``"auto"`` entries from them. So the fields are hidden
while such a plugin is built: the launcher's settings stay the default plugin's, the config's
are its own, and the two never meet.
"""
import contextlib
import os

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
            with _launcher_settings_hidden():  # [Note: the launcher's settings are the default plugin's]
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


_LAUNCHER_PREFIXES = ("ACCELERATE_DEEPSPEED_", "ACCELERATE_GRADIENT_", "ACCELERATE_CONFIG_DS_FIELDS")


@contextlib.contextmanager
def _launcher_settings_hidden():
    """The launcher's DeepSpeed fields out of the environment for the block (see the Note)."""
    hidden = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(_LAUNCHER_PREFIXES)}
    try:
        yield
    finally:
        os.environ.update(hidden)


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
