"""The shims both sides of Accelerate's DeepSpeed tests need on a CPU machine without a hub, and, on the "ours"
sides, ``accelerate.Accelerator`` bound to deepspeed_multi's (tools/accelerate_suite/run.py says which run when).

Every Python process of a run imports this file at start-up (it is first on PYTHONPATH): the pytest process and
the ranks ``accelerate launch`` starts. It runs tools/drop_in/sitecustomize.py first (the ``deepspeed.initialize``
swap, by DSM_DROP_IN_SIDE), then patches modules as they are imported. Each shim prints one line,
``[accelerate-suite-shim] ...``, the first time it acts in a process. Without DSM_ACC_SUITE_ASSETS it does nothing
more than the swap hook.
"""
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_DROP_IN = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "drop_in", "sitecustomize.py")
with open(_DROP_IN) as _f:
    exec(compile(_f.read(), _DROP_IN, "exec"))  # noqa: S102  (the swap hook, in this module's namespace)

ASSETS = os.environ.get("DSM_ACC_SUITE_ASSETS")
_said = set()


def _say(what):
    if what not in _said:
        _said.add(what)
        print(f"[accelerate-suite-shim] {what}", file=sys.stderr, flush=True)  # (stdout may be a program's output)


def _local(name):
    """A hub id -> the local tiny stand-in built by run.py (None for a local path or an unknown id)."""
    if not isinstance(name, (str, os.PathLike)):
        return None
    with open(os.path.join(ASSETS, "models.json")) as f:
        models = json.load(f)
    found = models.get(str(name))
    if found:
        _say(f"hub id {name} -> local tiny stand-in")
    return found


def _redirect(owner, name="from_pretrained"):
    """``owner.from_pretrained(<hub id>, ...)`` loads the id's local stand-in instead."""
    original = getattr(owner, name).__func__

    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        return original(cls, _local(pretrained_model_name_or_path) or pretrained_model_name_or_path, *args, **kwargs)
    setattr(owner, name, classmethod(from_pretrained))


def _patch_auto_models(module):
    _redirect(module._BaseAutoModelClass)


def _patch_modeling_utils(module):
    _redirect(module.PreTrainedModel)


def _patch_auto_tokenizer(module):
    _redirect(module.AutoTokenizer)


def _patch_auto_config(module):
    _redirect(module.AutoConfig)


def _patch_datasets(datasets):
    original = datasets.load_dataset

    def load_dataset(path, name=None, *args, **kwargs):
        if str(path).split("/")[-1] == "glue" and name == "mrpc":
            _say("load_dataset glue/mrpc -> a synthetic local MRPC")
            return datasets.load_from_disk(os.path.join(ASSETS, "mrpc"))
        return original(path, name, *args, **kwargs)
    datasets.load_dataset = load_dataset


def _patch_testing(testing):
    """The gates that only choose a device: a CPU run takes the test as a GPU run does."""
    for gate in ("require_non_cpu", "require_multi_device"):
        def lifted(test_case, gate=gate):
            _say(f"@{gate} lifted (CPU ranks stand in for the devices)")
            return test_case
        setattr(testing, gate, lifted)


def _patch_distributed(module):
    """A script that names NCCL (test_zero3_integration.py) gets gloo where torch has no CUDA."""
    original = module.init_process_group

    def init_process_group(*args, **kwargs):
        import torch
        if kwargs.get("backend") == "nccl" and not torch.cuda.is_available():
            _say("init_process_group(backend='nccl') -> gloo (no CUDA)")
            kwargs["backend"] = "gloo"
        return original(*args, **kwargs)
    module.init_process_group = init_process_group


def _patch_launch(module):
    """``accelerate launch --num_processes=N`` without a config starts N processes where there are N devices:
    on CPU, N ranks through the same torchrun launcher."""
    original = module._validate_launch_command

    def _validate_launch_command(args):
        args, defaults, mp_from_config = original(args)
        chosen = [args.multi_gpu, args.use_deepspeed, args.use_fsdp, args.tpu, args.cpu]
        if (args.num_processes or 1) > 1 and not any(chosen) and defaults is None:
            _say("accelerate launch --num_processes>1 on CPU: the multi-process launcher, as with devices")
            args.multi_gpu = True
        return args, defaults, mp_from_config
    module._validate_launch_command = _validate_launch_command


def _patch_accelerate(accelerate):
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import dataclasses

    def recording_the_world(cls):
        original_init = cls.__init__

        def __init__(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            from deepspeed_multi.accelerate.cpu_world import sync_world_size
            before = self.num_processes
            sync_world_size(self)
            if self.num_processes != before:
                _say(f"{cls.__name__}: the real world size recorded on CPU, as on GPUs")
        cls.__init__ = __init__

    recording_the_world(PartialState)  # (TrainingArguments reads it)
    recording_the_world(AcceleratorState)

    original_post_init = dataclasses.DeepSpeedPlugin.__post_init__

    def __post_init__(self):
        config = self.hf_ds_config
        if isinstance(config, str) and config != "none" and not os.path.exists(config) and \
                os.path.join("tests", "deepspeed") in config:
            self.hf_ds_config = os.path.join(os.environ["DSM_ACC_SUITE_SRC"], "tests", "deepspeed",
                                             os.path.basename(config))
            _say("a script's tests/deepspeed config path -> the Accelerate checkout's")
        original_post_init(self)
    dataclasses.DeepSpeedPlugin.__post_init__ = __post_init__

    if os.environ.get("DSM_ACC_SUITE_ACCELERATOR") == "ours":
        import deepspeed_multi.accelerate as ours
        accelerate.Accelerator = ours.Accelerator
        sys.modules["accelerate.accelerator"].Accelerator = ours.Accelerator
        _say("accelerate.Accelerator -> deepspeed_multi.accelerate.Accelerator")
    record = os.environ.get("DSM_ACC_SUITE_RECORD_ROOT")
    if record:
        _record_backward(accelerate.Accelerator, record)


def _rng_digest():
    """A short digest of torch's CPU RNG state: where two sides' random draws part, it tells when."""
    import hashlib

    import torch
    return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:12]


def _record_backward(accelerator_cls, root):
    """Each rank appends the loss of every backward() to <root>/<test>/rank<R>.jsonl (the test: pytest's current
    one, which the ranks a test launches inherit)."""
    original = accelerator_cls.backward

    def backward(self, loss, **kwargs):
        test = os.environ.get("PYTEST_CURRENT_TEST", "-").split("::")[-1].split(" ")[0]
        folder = os.path.join(root, test)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
            f.write(json.dumps({"loss": float(loss.detach().float()), "rng": _rng_digest()}) + "\n")
        return original(self, loss, **kwargs)
    accelerator_cls.backward = backward


def _patch_evaluate():
    """``evaluate`` is not installed here, and ``evaluate.load`` fetches a metric from the hub: a local accuracy/F1."""
    import types

    class Metric:
        def __init__(self):
            self.predictions, self.references = [], []

        def add_batch(self, predictions, references):
            self.predictions += [int(p) for p in predictions]
            self.references += [int(r) for r in references]

        def compute(self):
            pairs = list(zip(self.predictions, self.references))
            tp = sum(1 for p, r in pairs if p == r == 1)
            fp = sum(1 for p, r in pairs if p == 1 and r == 0)
            fn = sum(1 for p, r in pairs if p == 0 and r == 1)
            self.predictions, self.references = [], []
            return {"accuracy": sum(p == r for p, r in pairs) / max(1, len(pairs)),
                    "f1": 2 * tp / max(1, 2 * tp + fp + fn)}

    module = types.ModuleType("evaluate")

    def load(*args, **kwargs):
        _say("evaluate.load -> a local accuracy/F1 metric")
        return Metric()
    module.load = load
    sys.modules["evaluate"] = module


class _AfterImport:
    """Meta-path finder: the named modules import as usual, then their shim runs."""

    PATCHES = {"transformers.models.auto.auto_factory": _patch_auto_models,
               "transformers.modeling_utils": _patch_modeling_utils,
               "transformers.models.auto.tokenization_auto": _patch_auto_tokenizer,
               "transformers.models.auto.configuration_auto": _patch_auto_config, "datasets": _patch_datasets,
               "accelerate.test_utils.testing": _patch_testing, "accelerate": _patch_accelerate,
               "accelerate.commands.launch": _patch_launch, "torch.distributed": _patch_distributed}

    def find_spec(self, name, path=None, target=None):
        patch = self.PATCHES.get(name)
        # spec_then: tools/drop_in/sitecustomize.py's, executed into this module above.
        return None if patch is None else spec_then(self, name, path, target, patch)  # noqa: F821


def _seed(seed):
    """The multi-model script names a seed (42) it never applies, and torch seeds each process at random: without
    this, the script is not the same program twice, upstream against upstream. Each library is seeded as it is
    imported (a process that never imports torch does not pay for it)."""
    import random
    random.seed(seed)

    def seed_numpy(numpy):
        numpy.random.seed(seed)

    def seed_torch(torch):
        torch.manual_seed(seed)
        _say(f"torch, numpy and random seeded with {seed} at start-up")
    _AfterImport.PATCHES.update({"numpy": seed_numpy, "torch": seed_torch})


if ASSETS:
    os.environ.setdefault("RUN_SLOW", "1")
    if os.environ.get("DSM_ACC_SUITE_SEED"):
        _seed(int(os.environ["DSM_ACC_SUITE_SEED"]))
    try:
        import evaluate  # noqa: F401  (installed: its own load is used)
    except ImportError:
        _patch_evaluate()
    sys.meta_path.insert(0, _AfterImport())
