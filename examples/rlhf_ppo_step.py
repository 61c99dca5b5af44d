"""PPO-style RLHF with four engines and ONE backward per step (generation-free toy).

    torchrun --standalone --nproc_per_node=2 examples/rlhf_ppo_step.py [--steps 40]

Engines (each with its own config and ZeRO stage):
  actor     - policy, trained,  ZeRO-2
  critic    - value model, trained, ZeRO-3
  reference - frozen copy of the initial actor, ZeRO-3 (KL anchor), forward under no_grad
  reward    - frozen reward model, ZeRO-3, forward under no_grad

"Generation" is one sampling step: for each prompt position the actor's logits over a small
vocabulary are sampled once. The reward model scores the sampled tokens; PPO's clipped
objective for the actor and the value loss for the critic are added and sent through one
``loss.backward()``, then ``actor.step()`` and ``critic.step()``. The mean reward goes up.
"""
import argparse
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import _util

D, VOCAB, SEQ, MICRO_BS = 32, 16, 8, 16
CLIP, KL_COEF, VF_COEF, PPO_EPOCHS = 0.2, 0.05, 0.5, 2


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _util.mlp(D, 64, VOCAB)

    def forward(self, prompts):                      # (B, T, D) -> logits (B, T, V)
        return self.body(prompts)


class TokenScorer(nn.Module):
    """Reward model / critic: a score per sequence from the prompt (+ tokens, for the reward)."""

    def __init__(self, with_tokens):
        super().__init__()
        self.with_tokens = with_tokens
        self.emb = nn.Embedding(VOCAB, D) if with_tokens else None
        self.body = _util.mlp(D, 64, 1)

    def forward(self, prompts, tokens=None):
        h = prompts + self.emb(tokens) if self.with_tokens else prompts
        return self.body(h).squeeze(-1).mean(-1)     # (B,)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    dev, rank, world = _util.setup()
    import deepspeed_multi

    policy = Policy()
    ref_model = copy.deepcopy(policy)                # the frozen reference starts as the actor
    reward_model = TokenScorer(with_tokens=True)
    with torch.no_grad():                            # a reward model with clear preferences
        reward_model.emb.weight.mul_(3.0)
    actor, *_ = deepspeed_multi.initialize(model=policy, optimizer=torch.optim.Adam(policy.parameters(), 3e-3),
                                           config=_util.ds_config(2, MICRO_BS))
    critic_model = TokenScorer(with_tokens=False)
    critic, *_ = deepspeed_multi.initialize(model=critic_model,
                                            optimizer=torch.optim.Adam(critic_model.parameters(), 3e-3),
                                            config=_util.ds_config(3, MICRO_BS))
    ref_model.requires_grad_(False)
    reference, *_ = deepspeed_multi.initialize(model=ref_model, config=_util.ds_config(3, MICRO_BS))
    reward_model.requires_grad_(False)
    reward, *_ = deepspeed_multi.initialize(model=reward_model, config=_util.ds_config(3, MICRO_BS))
    _util.rank0_print("engines: actor ZeRO-2 (trained), critic ZeRO-3 (trained), reference ZeRO-3 (frozen), "
                      f"reward ZeRO-3 (frozen); world size {world}; {PPO_EPOCHS} PPO epochs per batch")

    g = torch.Generator().manual_seed(rank)
    rewards = []
    for step in _util.progress(args.steps, "ppo"):
        prompts = torch.randn(MICRO_BS, SEQ, D, generator=g).to(dev)
        # --- rollout: sample, score, old log-probs, reference log-probs (no gradients)
        with torch.no_grad():
            logits = actor(prompts)
            tokens = torch.distributions.Categorical(logits=logits).sample()
            old_logp = F.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1).sum(-1)
            ref_logp = F.log_softmax(reference(prompts), -1).gather(-1, tokens[..., None]).squeeze(-1).sum(-1)
            score = reward(prompts, tokens)
            returns = score - KL_COEF * (old_logp - ref_logp)          # KL-penalised reward
            advantage = returns - critic(prompts)
            advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-6)
        rewards.append(_util.all_mean(score.mean().item()))
        # --- PPO epochs: actor and critic losses through ONE backward
        for _ in range(PPO_EPOCHS):
            logp = F.log_softmax(actor(prompts), -1).gather(-1, tokens[..., None]).squeeze(-1).sum(-1)
            ratio = torch.exp(logp - old_logp)
            actor_loss = -torch.min(ratio * advantage, ratio.clamp(1 - CLIP, 1 + CLIP) * advantage).mean()
            critic_loss = F.mse_loss(critic(prompts), returns)
            (actor_loss + VF_COEF * critic_loss).backward()
            actor.step()
            critic.step()
        if step % 10 == 0 or step == args.steps - 1:
            _util.rank0_print(f"\nstep {step:3d}: mean reward {rewards[-1]:+.3f}  actor loss "
                              f"{actor_loss.item():+.4f}  critic loss {critic_loss.item():.4f}")
    k = max(1, len(rewards) // 5)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    _util.rank0_print(f"mean reward: first {k} steps {first:+.3f} -> last {k} steps {last:+.3f}")
    if not last > first:
        raise SystemExit("the policy did not improve")


if __name__ == "__main__":
    main()
