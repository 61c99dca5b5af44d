"""TRL's DPOTrainer with the policy at ZeRO-2 and the reference at ZeRO-3.

    torchrun --standalone --nproc_per_node=2 examples/trl/dpo.py [--short]

The one change from a plain TRL script: the trainer class is ``multi_engine_trainer(DPOTrainer)``
and the reference gets its own DeepSpeed config with ``deepspeed_roles`` (TRL alone would give it
stage 0 beside a ZeRO-2 policy). Preference pairs: the "chosen" answer keeps counting up from the
prompt, the "rejected" one is random words; the DPO loss falls from log 2 as the policy learns it.
"""
import _common

_common.setup_env()


def pairs(n, seed=0):
    import torch
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        words = _common.counting(g, 8).split()
        rows.append({"prompt": " ".join(words[:4]), "chosen": " ".join(words[4:]),
                     "rejected": _common.random_words(g, 4)})
    return Dataset.from_list(rows)


def main():
    args = _common.parser(__doc__).parse_args()
    import torch
    from trl import DPOConfig, DPOTrainer

    from deepspeed_multi.transformers import multi_engine_trainer

    torch.manual_seed(0)  # the same starting weights on every rank
    policy, reference = _common.tiny_llama(), _common.tiny_llama()
    reference.load_state_dict(policy.state_dict())
    config = DPOConfig(**_common.common_args(
        args, per_device_train_batch_size=8, gradient_accumulation_steps=1, learning_rate=5e-3, beta=0.5,
        max_steps=10 if args.short else 60, deepspeed=_common.ds_config(2)))
    trainer = multi_engine_trainer(DPOTrainer)(
        model=policy, ref_model=reference, args=config, train_dataset=pairs(2000),
        processing_class=_common.tokenizer(),
        deepspeed_roles={"ref_model": {"zero_optimization": {"stage": 3}}})
    loss = _common.watch(trainer, "loss", falls=True)
    trainer.train()
    loss.check("DPO")
    _common.end(trainer)


if __name__ == "__main__":
    main()
