"""TRL's GRPOTrainer with the reference and the reward model on their own DeepSpeed configs.

    torchrun --standalone --nproc_per_node=2 examples/trl/grpo.py [--short]

The policy (ZeRO-2) generates; the reference for the KL term (``beta`` > 0) and a reward model
(a sequence classifier, frozen) are ZeRO-3 through ``deepspeed_roles``, next to a rule reward:
the share of completion words that keep counting up from the prompt. The rule reward rises as
the policy learns to count. The one change from a plain TRL script is the trainer class,
``multi_engine_trainer(GRPOTrainer)``, and ``deepspeed_roles``.
"""
import os

import _common

_common.setup_env()


def prompts(n, seed=0):
    import torch
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)
    return Dataset.from_list([{"prompt": _common.counting(g, 4)} for _ in range(n)])


def counts_on(prompts, completions, **kw):
    """How close each completion word is to the count that continues the prompt (w7 w8 -> w9 w10
    ...): 1 for the right word, falling linearly with the distance in the vocabulary."""
    span = _common.VOCAB - 3
    scores = []
    for prompt, completion in zip(prompts, completions):
        last, words = int(prompt.split()[-1][1:]) - 3, completion.split()
        close = [1 - abs(int(w[1:]) - 3 - (last + 1 + i) % span) / span if w[1:].isdigit() else 0.0
                 for i, w in enumerate(words)]
        scores.append(sum(close) / max(1, len(close)))
    return scores


def main():
    args = _common.parser(__doc__).parse_args()
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from deepspeed_multi.transformers import multi_engine_trainer

    config = GRPOConfig(**_common.common_args(
        args, per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=8,
        max_completion_length=4, learning_rate=5e-3, beta=0.02, temperature=1.0, reward_weights=[1.0, 0.1],
        max_steps=20 if args.short else 60, deepspeed=_common.ds_config(2)))
    # GRPO loads the policy (and its reference) by path, as from the Hub: save tiny random ones first
    # (creating the config above started the process group; rank 0 writes).
    policy_dir, reward_dir = os.path.join(config.output_dir, "policy"), os.path.join(config.output_dir, "reward")
    torch.manual_seed(0)
    _common.tiny_llama().save_pretrained(policy_dir)
    _common.tiny_llama(num_labels=1).save_pretrained(reward_dir)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    z3 = {"zero_optimization": {"stage": 3}}
    trainer = multi_engine_trainer(GRPOTrainer)(
        model=policy_dir, reward_funcs=[counts_on, reward_dir], args=config, train_dataset=prompts(2000),
        processing_class=_common.tokenizer(), reward_processing_classes=[None, _common.tokenizer()],
        deepspeed_roles={"ref_model": z3, "reward_funcs": z3})
    reward = _common.watch(trainer, "rewards/counts_on/mean", falls=False)
    trainer.train()
    reward.check("GRPO")
    _common.end(trainer)


if __name__ == "__main__":
    main()
