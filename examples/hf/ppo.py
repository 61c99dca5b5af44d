"""The RFC's RLHF loop (Accelerate multi-model proposal): 4 models, ONE Accelerator, each with its own config.

    torchrun --standalone --nproc_per_node=2 examples/hf/ppo.py [--short] [--model ACTOR]
    accelerate launch --multi_gpu --num_processes 2 examples/hf/ppo.py

actor (Llama, ZeRO-2) and critic (Llama value head, ZeRO-3) are trained, each with its optimizer
and scheduler; the reference (frozen copy of the actor) and the reward model are ZeRO-3 and
frozen. Each model is prepared with its own config, given per call as the RFC proposes:
``accelerator.prepare(model, optimizer, scheduler, deepspeed_plugin=<config>)``. Per batch:
``actor.generate``, log-probs, reward, values; then PPO epochs with the RFC's
``accelerator.backward(loss); optimizer.step(); scheduler.step(); optimizer.zero_grad()`` per model.
The reward model here prefers a few target tokens, so the mean reward rises (the loss shown is its negative).
"""
import copy

import torch

import _common

_common.setup_env()
PROMPT, NEW, MICRO_BS, PPO_EPOCHS, CLIP, KL = 6, 6, 8, 2, 0.2, 0.05


def logprobs(logits, seq):
    return torch.log_softmax(logits[:, PROMPT - 1:-1].float(), -1).gather(-1, seq[:, PROMPT:, None]).squeeze(-1)


def main():
    args = _common.parser(__doc__, steps=40).parse_args()
    steps = 30 if args.short else args.steps
    from transformers import AutoModelForSequenceClassification
    actor_cfg = _common.launch_config(_common.ds_config(2, MICRO_BS, bf16=args.bf16))
    z3 = _common.ds_config(3, MICRO_BS, bf16=args.bf16)
    accel = _common.accelerator({"actor": actor_cfg})            # the default config
    torch.manual_seed(0)

    actor = _common.causal_lm(args.model, _common.tiny_llama())
    vocab = actor.config.vocab_size
    reference = copy.deepcopy(actor)
    scorer_cfg = _common.tiny_llama(vocab=vocab, num_labels=1)
    critic = AutoModelForSequenceClassification.from_config(scorer_cfg)
    reward_model = AutoModelForSequenceClassification.from_config(scorer_cfg)
    with torch.no_grad():      # a reward model with clear preferences: it scores the last token, and likes 10..14
        for layer in reward_model.model.layers:     # no attention/MLP output: each position keeps its embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = reward_model.model.embed_tokens.weight
        liked = torch.randn(emb.shape[1])
        emb[10:15] = liked
        reward_model.score.weight[0] = liked / liked.norm()

    opt_1 = torch.optim.AdamW(actor.parameters(), lr=3e-3)
    opt_2 = torch.optim.AdamW(critic.parameters(), lr=3e-3)
    sched_1 = torch.optim.lr_scheduler.LambdaLR(opt_1, lambda u: min(1.0, (u + 1) / 4))
    sched_2 = torch.optim.lr_scheduler.LambdaLR(opt_2, lambda u: min(1.0, (u + 1) / 4))
    actor, opt_1, sched_1 = accel.prepare(actor, opt_1, sched_1)              # the default config (ZeRO-2)
    critic, opt_2, sched_2 = accel.prepare(critic, opt_2, sched_2, deepspeed_plugin=z3)
    reference = accel.prepare(reference.requires_grad_(False), deepspeed_plugin=z3)
    reward_model = accel.prepare(reward_model.requires_grad_(False), deepspeed_plugin=z3)
    accel.print("actor ZeRO-%d, critic ZeRO-%d (trained); reference ZeRO-%d, reward ZeRO-%d (frozen); world size %d"
                % (actor.zero_optimization_stage(), critic.zero_optimization_stage(),
                   reference.zero_optimization_stage(), reward_model.zero_optimization_stage(), accel.num_processes))

    g = torch.Generator().manual_seed(accel.process_index)
    torch.manual_seed(1 + accel.process_index)      # generate() samples from the global generator
    rewards, critic_losses = [], []
    for _ in _common.progress(accel, steps, "ppo"):
        prompts = torch.randint(3, vocab, (MICRO_BS, PROMPT), generator=g).to(accel.device)
        with torch.no_grad():
            seq = actor.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=NEW,
                                 min_new_tokens=NEW, do_sample=True, top_k=0, pad_token_id=0)
            seq = seq.clamp(min=3)
            old_logp = logprobs(actor(input_ids=seq).logits, seq)
            ref_logp = logprobs(reference(input_ids=seq).logits, seq)
            score = reward_model(input_ids=seq).logits.squeeze(-1).float()
            values = critic(input_ids=seq).logits.squeeze(-1).float()
            returns = score - KL * (old_logp - ref_logp).sum(-1)
            adv = returns - values
            adv = (adv - adv.mean()) / (adv.std() + 1e-6)
        rewards.append(_common.mean_over_ranks(accel, score.mean().item()))
        for _ in range(PPO_EPOCHS):
            logp = logprobs(actor(input_ids=seq, use_cache=False).logits, seq)
            ratio = torch.exp(logp - old_logp).mean(-1)
            actor_loss = -torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()
            accel.backward(actor_loss)
            opt_1.step()
            sched_1.step()
            opt_1.zero_grad()

            critic_loss = ((critic(input_ids=seq).logits.squeeze(-1).float() - returns)**2).mean()
            accel.backward(critic_loss)
            opt_2.step()
            sched_2.step()
            opt_2.zero_grad()
        critic_losses.append(_common.mean_over_ranks(accel, critic_loss.item()))
    k = max(1, steps // 5)
    accel.print(f"critic loss: first {k} steps {sum(critic_losses[:k]) / k:.4f} -> last {k} steps "
                f"{sum(critic_losses[-k:]) / k:.4f}")
    _common.check_falling(accel, "PPO objective (minus the mean reward)", [-r for r in rewards], args.short)
    _common.end(accel)  # destroy the process group: gloo's threads can abort an exit without it


if __name__ == "__main__":
    main()
