"""One rank of DeepSpeed-Chat's step-3 main.py, run unchanged after the shims its environment needs.

    torchrun ... launch.py --main <DeepSpeed-Chat>/training/step3_rlhf_finetuning/main.py
                           [--fix-zero3-micro-step] [--one-backward] -- <main.py's arguments>

run.py starts this under torchrun on both sides; tools/drop_in/sitecustomize.py (first on
PYTHONPATH) has already armed the ``deepspeed.initialize`` swap before this file runs. Every shim
and patch prints one ``[dschat-shim] ...`` / ``[dschat-patch] ...`` line (with the rank) when it
acts, so a run's log says what was changed around the program.

Shims (both sides; none changes the arithmetic, each makes the program run where it would
otherwise stop):
  local_rank     torchrun passes LOCAL_RANK in the environment; main.py reads ``--local_rank``
                 (the deepspeed launcher's way) and without it never calls init_distributed.
  tensorboard    main.py imports ``torch.utils.tensorboard`` at the top, which needs the
                 tensorboard package; the runs never enable it, so a stand-in module is installed
                 when the package is missing (SummaryWriter refuses if it were ever used).
  no_init_weights  Transformers 5 moved it from ``transformers.modeling_utils`` to
                 ``transformers.initialization``; model_utils.py imports the old name.
  save_vocabulary  a tokenizer built from a ``tokenizers`` object (ours, from a local vocabulary)
                 has no ``vocab_file``; Transformers 5's ``save_vocabulary`` then fails on
                 ``os.path.abspath(None)`` when save_hf_format saves it. It writes tokenizer.json.
  zero3_cast     DeepSpeed 0.19.8 casts parameters to bf16 only when the model is not ZeRO-Init'd;
                 older DeepSpeed cast the whole module (``module.bfloat16()``). DeepSpeed-Chat's
                 ZeRO-3 critic/reward is a ZeRO-Init'd Llama plus a ``v_head`` made outside
                 zero.Init, which stays fp32 and fails in the bf16 forward. The shim casts the
                 parameters not yet ZeRO-3's (no ``ds_id``) as the old cast did; ZeRO-3's own are
                 already bf16.
  cuda_on_cpu    none needed: DeepSpeed-Chat's accelerator calls are all get_accelerator()'s
                 (device_name, set_device, current_device_name, manual_seed_all, device_count),
                 which the CPU accelerator answers, and ``torch.device("cpu", local_rank)`` is
                 accepted. A check prints any ``torch.cuda``/``.cuda()`` call it finds in dschat/
                 (a later checkout may add one); it patches nothing.

Patches (options, one side each):
  --fix-zero3-micro-step  upstream only: DeepSpeedEngine.backward first calls
                 ``optimizer.clear_backward_seen_flag()``. DeepSpeed counts ZeRO's micro-steps (and
                 at ZeRO-1/2 clears grad_accum) in that call at the start of ``engine.forward``;
                 DeepSpeed-Chat's critic runs ``engine.forward_value`` (the module's method,
                 around engine.forward), so at ZeRO-3 with gradient accumulation the second
                 micro-batch's gradient overwrites the first instead of adding to it.
  --one-backward  ours only: train_rlhf's two ``engine.backward(loss)`` calls become ONE
                 ``(actor_loss + critic_loss).backward()``; both engines step as before. The
                 program's train_rlhf runs unchanged: for its duration the two engines' backward
                 (and the actor's step, which comes between them) are replaced on the instances so
                 that the actor's loss is kept, the critic's backward backpropagates the sum, and
                 the actor then steps.
"""
import argparse
import os
import runpy
import sys

RANK = os.environ.get("RANK", "?")


def say(kind, what):
    print(f"[dschat-{kind}] rank {RANK}: {what}", flush=True)


# ------------------------------------------------------------------------------------------ shims
def shim_local_rank(argv):
    if any(a == "--local_rank" or a.startswith("--local_rank=") for a in argv):
        return argv
    local = os.environ.get("LOCAL_RANK")
    if local is None:
        return argv
    say("shim", f"local_rank: --local_rank={local} from LOCAL_RANK (torchrun), as the deepspeed launcher passes it")
    return argv + [f"--local_rank={local}"]


def shim_tensorboard():
    try:
        import tensorboard  # noqa: F401
        return
    except ImportError:
        pass
    import types

    class SummaryWriter:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("tensorboard is not installed; the harness's stand-in cannot write logs")

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = SummaryWriter
    sys.modules["torch.utils.tensorboard"] = module
    say("shim", "tensorboard: package missing, torch.utils.tensorboard is a stand-in (never enabled here)")


def shim_no_init_weights():
    import transformers.modeling_utils as modeling_utils
    if hasattr(modeling_utils, "no_init_weights"):
        return
    from transformers.initialization import no_init_weights
    modeling_utils.no_init_weights = no_init_weights
    say("shim", "no_init_weights: transformers.modeling_utils.no_init_weights = transformers.initialization's")


def shim_save_vocabulary():
    from transformers import PreTrainedTokenizerFast
    upstream = PreTrainedTokenizerFast.save_vocabulary

    def save_vocabulary(self, save_directory, filename_prefix=None):
        if getattr(self, "vocab_file", None) is not None:
            return upstream(self, save_directory, filename_prefix)
        path = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + "tokenizer.json")
        self.backend_tokenizer.save(path)
        say("shim", f"save_vocabulary: tokenizer without vocab_file, wrote {path}")
        return (path,)

    PreTrainedTokenizerFast.save_vocabulary = save_vocabulary


def shim_zero3_cast():
    from deepspeed.runtime.engine import DeepSpeedEngine
    upstream = DeepSpeedEngine._cast_module_mixed_precision

    def cast(self, param_dtype, buffer_dtype, is_zero_init_model, keep_pattern=None):
        if param_dtype is not None and is_zero_init_model:
            cast_names = []
            for name, p in self.module.named_parameters():
                if not hasattr(p, "ds_id") and p.is_floating_point() and p.dtype != param_dtype:
                    p.data = p.data.to(param_dtype)
                    cast_names.append(name)
            if cast_names:
                say("shim", f"zero3_cast: {', '.join(cast_names)} (not ZeRO-Init'd) cast to {param_dtype}")
        return upstream(self, param_dtype, buffer_dtype, is_zero_init_model, keep_pattern)

    DeepSpeedEngine._cast_module_mixed_precision = cast


def report_cuda_calls():
    """torch.cuda.* in the DeepSpeed-Chat sources main.py imports: printed, not patched."""
    import re
    here = list(sys.modules["dschat"].__path__)[0]  # a namespace package: no __init__.py, no __file__
    found = []
    for root, _, files in os.walk(here):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(root, f)) as fh:
                    for i, line in enumerate(fh, 1):
                        if re.search(r"torch\.cuda\.|\.cuda\(", line.split("#")[0]):
                            found.append(f"{os.path.relpath(os.path.join(root, f), here)}:{i}")
    if found:
        say("shim", f"cuda_on_cpu: torch.cuda calls found (not patched): {', '.join(found)}")


# ---------------------------------------------------------------------------------------- patches
def patch_fix_zero3_micro_step():
    """Upstream only: the micro-step count (clear_backward_seen_flag) at the start of backward."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    upstream = DeepSpeedEngine.backward
    said = set()

    def backward(self, loss, *args, **kwargs):
        clear = getattr(self.optimizer, "clear_backward_seen_flag", None)
        if clear is not None:
            clear()
            if id(self) not in said:  # once per engine: the line says the patch acted, not how often
                said.add(id(self))
                say("patch", f"fix-zero3-micro-step: {type(self.optimizer).__name__}.clear_backward_seen_flag() "
                    "at the start of DeepSpeedEngine.backward (further calls not printed)")
        return upstream(self, loss, *args, **kwargs)

    DeepSpeedEngine.backward = backward


def patch_one_backward():
    """Ours only: one loss.backward() for the actor's and the critic's loss in train_rlhf."""
    from dschat.rlhf.ppo_trainer import DeepSpeedPPOTrainer
    train_rlhf = DeepSpeedPPOTrainer.train_rlhf
    said = []

    def one_backward_train_rlhf(self, inputs):
        actor, critic = self.actor_model, self.critic_model
        kept = {}

        def actor_backward(loss, *args, **kwargs):
            kept["actor_loss"] = loss  # backpropagated with the critic's, below

        def actor_step(*args, **kwargs):
            kept["actor_step"] = (args, kwargs)  # after the joint backward

        def critic_backward(loss, *args, **kwargs):
            (kept["actor_loss"] + loss).backward()
            a, k = kept.pop("actor_step")
            type(actor).step(actor, *a, **k)

        actor.backward, actor.step, critic.backward = actor_backward, actor_step, critic_backward
        try:
            out = train_rlhf(self, inputs)
        finally:
            for engine, name in ((actor, "backward"), (actor, "step"), (critic, "backward")):
                del engine.__dict__[name]
        if not said:
            said.append(True)
            say("patch", "one-backward: train_rlhf backpropagates actor_loss + critic_loss with one loss.backward(), "
                "then steps the actor and the critic (further steps not printed)")
        return out

    DeepSpeedPPOTrainer.train_rlhf = one_backward_train_rlhf


SHIMS = {"local_rank": shim_local_rank, "tensorboard": shim_tensorboard, "no_init_weights": shim_no_init_weights,
         "save_vocabulary": shim_save_vocabulary, "zero3_cast": shim_zero3_cast}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--main", required=True, help="DeepSpeed-Chat's training/step3_rlhf_finetuning/main.py")
    ap.add_argument("--fix-zero3-micro-step", action="store_true")
    ap.add_argument("--one-backward", action="store_true")
    ap.add_argument("--no-shim", action="append", default=[], choices=list(SHIMS),
                    help="leave a shim out (to see that it is needed)")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    side = os.environ.get("DSM_DROP_IN_SIDE")
    if args.fix_zero3_micro_step and side != "upstream":
        raise SystemExit("--fix-zero3-micro-step is an upstream-only patch")
    if args.one_backward and side != "ours":
        raise SystemExit("--one-backward runs on ours only (upstream's engine.backward needs its own call)")

    on = [name for name in SHIMS if name not in args.no_shim]
    for name in args.no_shim:
        say("shim", f"{name}: left out (--no-shim)")
    argv = shim_local_rank(rest) if "local_rank" in on else rest
    if "tensorboard" in on:
        shim_tensorboard()
    import deepspeed  # noqa: F401  (imported here: the drop-in swap arms as it finishes importing)
    for name in ("no_init_weights", "save_vocabulary", "zero3_cast"):
        if name in on:
            SHIMS[name]()
    import dschat  # noqa: F401  (from the DeepSpeed-Chat checkout, on PYTHONPATH)
    report_cuda_calls()
    if args.fix_zero3_micro_step:
        patch_fix_zero3_micro_step()
    if args.one_backward:
        patch_one_backward()

    sys.argv = [args.main] + argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.main)))
    runpy.run_path(args.main, run_name="__main__")


if __name__ == "__main__":
    main()
