"""Generation from ZeRO-3 engines inside training loops (rank functions for test_generation.py).

[Note: generation from a ZeRO-3 engine] (zero/stage3/generation.py): each rank generates a number of
tokens of its own (rank 0 three, rank 1 nine: sequences that end at different lengths, as sampling with
an EOS gives), greedily, and the outputs must equal the same model's unsharded ``generate``; every check
then runs a collective of another engine (a ZeRO-2 update), which a rank still waiting in a gather
would never reach. Frozen and trained ZeRO-3 engines, beside a ZeRO-2 engine; with the generation mode
(the default) and without it (``generation_gather_bytes: 0``: gathered module by module, synced).
"""
import torch

import deepspeed
import deepspeed.comm as dist

import deepspeed_multi
from common import MLP, default_batch, ds_config
from hf_models import causal_lm

LAYERS = 2
PROMPT = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(1))


def new_tokens(rank=None) -> int:
    return 3 if (dist.get_rank() if rank is None else rank) == 0 else 9


def _greedy(module, n=None, **kw):
    n = new_tokens() if n is None else n
    return module.generate(PROMPT.clone(), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


def unsharded(n=None):
    torch.manual_seed(0)
    return _greedy(causal_lm(num_hidden_layers=LAYERS), n)


def zero3_config(bound=None, **extra):
    cfg = ds_config(3, **extra)
    if bound is not None:
        cfg["deepspeed_multi"] = {"generation_gather_bytes": bound}
    return cfg


def _zero2_beside():
    model = MLP(seed=3)
    engine, *_ = deepspeed_multi.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                            config=ds_config(2))
    return engine


def _train_zero2(engine, step=0):
    batch = default_batch(step, dist.get_rank())
    (engine(batch["x"]) - batch["y"]).pow(2).mean().backward()
    engine.step()


def uneven_lengths_own_loop():
    """engine.module.generate and engine.generate, frozen and trained ZeRO-3 engines beside a ZeRO-2 engine,
    with the generation mode and without it: every rank returns its own length, equal to unsharded, and the
    ZeRO-2 update after it completes on every rank. Transformers' generate is given synced_gpus=False here,
    as in an own loop it would be (no process-wide ZeRO-3 config): the engine's generate decides."""
    want = unsharded()
    other = _zero2_beside()
    for trained in (False, True):
        for bound in (None, 0):
            torch.manual_seed(0)
            model = causal_lm(num_hidden_layers=LAYERS)
            kw = {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)} if trained else {}
            engine, *_ = deepspeed_multi.initialize(model=model, config=zero3_config(bound), **kw)
            for generate in (engine.module.generate, engine.generate):
                got = generate(PROMPT.clone(), max_new_tokens=new_tokens(), min_new_tokens=new_tokens(),
                               do_sample=False, pad_token_id=0, synced_gpus=False)
                assert torch.equal(got, want), (trained, bound, got, want)
                _train_zero2(other)
            engine.destroy()
            assert "generate" not in vars(model), "destroy() leaves the module's own generate"
    other.destroy()
    return dist.get_rank()


def _full_state(engine):
    """Everything the next update depends on, as this rank holds it: the partitions, the fp32 masters and
    the optimizer state of this rank, and the gradients pending in the window (ZeRO-3's partitions)."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_grad, safe_get_local_optimizer_state

    from deepspeed_multi.zero.stage3.cast_on_gather import partition_value
    state = {}
    for n, p in engine.module.named_parameters():
        state[f"partition/{n}"] = partition_value(p).detach().clone()  # (bf16: the master's cast, as gathered)
        state[f"master/{n}"] = safe_get_local_fp32_param(p).detach().clone()
        grad = safe_get_local_grad(p)
        state[f"grad/{n}"] = None if grad is None else grad.detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            try:
                value = safe_get_local_optimizer_state(p, key)
            except KeyError:  # (no state before the first update)
                value = None
            state[f"{key}/{n}"] = None if value is None else value.detach().clone()
    return state


def _same_state(got, want, what):
    assert got.keys() == want.keys(), what
    for key, w in want.items():
        g = got[key]
        assert (g is None) == (w is None) and (w is None or torch.equal(g, w)), f"{what}: {key} differs"


def _window_run(dtype, generate_at):
    """A trained ZeRO-3 Llama, gas 2, two windows; a generation in the mode before micro-steps ``generate_at``
    (0: a window's start, 1: its middle, between the two backward passes). Returns the state after each
    micro-step and the outputs of each generation."""
    torch.manual_seed(0)
    model = causal_lm(num_hidden_layers=LAYERS)
    engine, *_ = deepspeed_multi.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                            config=zero3_config(gradient_accumulation_steps=2, **(
                                                {"bf16": {"enabled": True}} if dtype == "bf16" else {})))
    states, outputs = [], []
    for step in range(4):
        if step % 2 in generate_at:
            before = _full_state(engine)
            with engine.generation_mode() as module:
                outputs.append(_greedy(module, synced_gpus=False))
            _same_state(_full_state(engine), before, f"{dtype} generation at micro-step {step}")
        ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        engine(input_ids=ids, labels=ids).loss.backward()
        engine.step()
        states.append(_full_state(engine))
    engine.destroy()
    return states, outputs


def update_after_generation_is_unchanged():
    """The generation mode at a window's start and in its middle (between the micro-steps of TRL's GRPO):
    partitions, fp32 masters, pending gradients and optimizer state unchanged by it, and every micro-step
    after it bit-identical to the run without it (fp32 and bf16, AdamW)."""
    for dtype in ("fp32", "bf16"):
        want, _ = _window_run(dtype, ())
        for generate_at in ((0, ), (1, )):
            got, outputs = _window_run(dtype, generate_at)
            for step, (g, w) in enumerate(zip(got, want)):
                _same_state(g, w, f"{dtype}, generation at micro-step {generate_at}: after micro-step {step}")
            assert outputs and all(o.shape[1] == PROMPT.shape[1] + new_tokens() for o in outputs), outputs
    return dist.get_rank()


def upstream_generate_hangs_without_synced_gpus():
    """The reference: upstream's ZeRO-3 engine needs synced_gpus=True for uneven lengths (without it one rank
    would wait in a gather), and with it returns the unsharded outputs too."""
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=causal_lm(num_hidden_layers=LAYERS), config=zero3_config())
    got = _greedy(engine.module, synced_gpus=True)
    engine.destroy()
    assert torch.equal(got, unsharded()), got
    return dist.get_rank()


def accelerate_with_another_plugin_selected():
    """The RFC's loop: a ZeRO-2 default plugin, the generating model prepared under a ZeRO-3 plugin, the default
    selected again before generate (so Transformers' is_deepspeed_zero3_enabled() says no): generate through
    accelerator.unwrap_model(model) with uneven lengths, frozen and trained, equal to unsharded; then a ZeRO-2
    update."""
    from accelerate.utils import DeepSpeedPlugin

    from deepspeed_multi.accelerate import Accelerator
    from hf_common import reset_accelerate
    want = unsharded()
    for trained in (False, True):
        reset_accelerate()
        accelerator = Accelerator(deepspeed_plugins={"default": DeepSpeedPlugin(hf_ds_config=ds_config(2)),
                                                     "llm": DeepSpeedPlugin(hf_ds_config=ds_config(3))})
        student = MLP(seed=3)
        student, opt = accelerator.prepare(student, torch.optim.SGD(student.parameters(), lr=0.1))
        torch.manual_seed(0)
        llm = causal_lm(num_hidden_layers=LAYERS)
        if trained:
            llm, _ = accelerator.prepare(llm, torch.optim.SGD(llm.parameters(), lr=0.1), deepspeed_plugin="llm")
        else:
            llm = accelerator.prepare(llm.requires_grad_(False), deepspeed_plugin="llm")
        accelerator.state.select_deepspeed_plugin("default")
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
        assert not is_deepspeed_zero3_enabled()
        got = _greedy(accelerator.unwrap_model(llm))
        assert torch.equal(got, want), (trained, got, want)
        batch = default_batch(0, dist.get_rank())
        accelerator.backward((student(batch["x"]) - batch["y"]).pow(2).mean())
        opt.step()
        accelerator.free_memory()
    return dist.get_rank()


def generation_gather_bytes_bounds_the_mode():
    """A bound below the model's bytes: generate gathers module by module, synced (no mode), equal to
    unsharded; the option refuses a bad value."""
    from common import expect_error
    from deepspeed_multi.zero.stage3 import generation as stage3_generation
    torch.manual_seed(0)
    model = causal_lm(num_hidden_layers=LAYERS)
    engine, *_ = deepspeed_multi.initialize(model=model, config=zero3_config(bound=1024))
    assert not stage3_generation.fits(engine)
    assert torch.equal(_greedy(engine.module), unsharded())
    engine.destroy()
    expect_error(ValueError, lambda: deepspeed_multi.initialize(model=MLP(), config=zero3_config(bound=-1)),
                 "generation_gather_bytes must be a number of bytes")
    return dist.get_rank()


def lightning_fabric_loop():
    """A Fabric loop: a ZeRO-2 student and a frozen ZeRO-3 teacher (MultiDeepSpeedStrategy, the teacher's own
    config), the teacher generating greedily through the module fabric.setup returned, each rank its own
    length, equal to unsharded; then the student's update."""
    from lightning_checks import done, multi
    want = unsharded()
    fabric = multi(configs={"LlamaForCausalLM": {"zero_optimization": {"stage": 3}}}, config=ds_config(2))
    torch.manual_seed(0)
    teacher = fabric.setup(causal_lm(num_hidden_layers=LAYERS).requires_grad_(False))
    assert [e.zero_optimization_stage() for e in fabric.strategy.engines] == [3]
    student = MLP(seed=3)
    student, opt = fabric.setup(student, torch.optim.SGD(student.parameters(), lr=0.1))
    got = _greedy(teacher)
    assert torch.equal(got, want), (got, want)
    batch = default_batch(0, dist.get_rank())
    fabric.backward((student(batch["x"]) - batch["y"]).pow(2).mean())
    opt.step()
    done(fabric)
    return dist.get_rank()


def _grpo(trainer_cls, policy_dir, deepspeed, gather, roles=None):
    """TRL's GRPO, 2 updates, each rank generating up to a length of its own (its generation_kwargs: rank 0
    stops after 2 new tokens, rank 1 runs 6), so completions end at rank-dependent lengths."""
    from trl import GRPOConfig

    import trainer_checks as tc
    tc._fresh_process_state()
    lengths = {"max_new_tokens": 2} if dist.get_rank() == 0 else {"min_new_tokens": 6, "max_new_tokens": 6}
    args = tc._trl_args(GRPOConfig, 1, deepspeed, per_device_train_batch_size=4, num_generations=4,
                        max_completion_length=6, dataloader_drop_last=False, beta=0.0, temperature=1.0, max_steps=2,
                        ds3_gather_for_generation=gather, generation_kwargs=lengths)
    kw = {} if roles is None else {"deepspeed_roles": roles}
    trainer = trainer_cls(model=policy_dir, reward_funcs=[tc._reward_small_ids], args=args,
                          train_dataset=tc._prompts(), processing_class=tc.word_tokenizer(), **kw)
    return tc._train(trainer)


def trl_grpo_uneven_lengths():
    """GRPO with a ZeRO-3 policy, rank-dependent completion lengths, with TRL's gather for generation
    (unwrap_model_for_generation) and without it (the engine's generate: the generation mode): no hang, and the
    run equals the same job under DDP (losses, grad_norm, learning rate, weights)."""
    import trainer_checks as tc
    from trl import GRPOTrainer

    from deepspeed_multi.transformers import multi_engine_trainer
    policy_dir, _ = tc._saved_policy_and_reward()
    want = _grpo(GRPOTrainer, policy_dir, None, True)
    for gather in (True, False):
        logs, weights, _ = _grpo(multi_engine_trainer(GRPOTrainer), policy_dir, tc.ds_config(3, 1, None), gather)
        tc.compare((logs, weights), want[:2], f"GRPO, policy ZeRO-3, ds3_gather_for_generation={gather}")
    return dist.get_rank()
