"""Running a program nobody here wrote on our engines, unchanged: ``deepspeed.initialize`` swapped for ours, and the
environment ``accelerate launch`` gives the program's ranks (shared by the Trainer, TRL and shipped-config checks)."""
import contextlib
import os
import tempfile

import deepspeed

import deepspeed_multi


@contextlib.contextmanager
def initialize_swapped(ours: bool = True):
    """``deepspeed.initialize`` is ours inside (``ours``), as a program's own swap or the drop-in hook makes it."""
    upstream = deepspeed.initialize
    if ours:
        deepspeed.initialize = deepspeed_multi.initialize
    try:
        yield
    finally:
        deepspeed.initialize = upstream


def launcher_env(config, num_processes=2, mixed_precision=None) -> dict:
    """The ACCELERATE_* variables ``accelerate launch --config_file <config> --num_processes N`` exports to its ranks
    (``config``: a yaml path or its dict; ``mixed_precision``: the launcher's flag, None for the yaml's), computed by
    Accelerate's own launch functions as its ``launch_command`` does before it starts them."""
    import yaml
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env
    with tempfile.TemporaryDirectory() as tmp:
        if isinstance(config, dict):
            path = os.path.join(tmp, "accelerate.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(config, f)
            config = path
        argv = ["--config_file", config, "--num_processes", str(num_processes)]
        argv += ["--mixed_precision", mixed_precision] if mixed_precision else []
        args, defaults, mp_from_config = _validate_launch_command(launch_command_parser().parse_args(argv + ["x.py"]))
    fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = prepare_deepspeed_cmd_env(args)
    return {k: v for k, v in env.items() if k.startswith("ACCELERATE_")}
