"""DPO with a frozen ZeRO-3 reference (as TRL does), in ONE Accelerator.

    torchrun --standalone --nproc_per_node=2 examples/hf/dpo.py [--short] [--model POLICY]
    accelerate launch --multi_gpu --num_processes 2 examples/hf/dpo.py

The policy (Llama, ZeRO-2) is trained with its optimizer and scheduler; the reference is a frozen
copy of the policy's starting weights, loaded after ``select_deepspeed_plugin("reference")`` so
that Transformers partitions it (ZeRO-3). Preference pairs: "chosen" continuations count upwards
from the prompt, "rejected" ones are random; the DPO loss falls as the policy learns the preference.
"""
import torch
import torch.nn.functional as F

import _common

_common.setup_env()
PROMPT, ANSWER, MICRO_BS, BETA = 6, 6, 8, 0.5


def pairs(g, vocab, device):
    start = torch.randint(3, vocab, (MICRO_BS, 1), generator=g)
    counting = 3 + (start - 3 + torch.arange(PROMPT + ANSWER)) % (vocab - 3)
    rejected = torch.cat([counting[:, :PROMPT], torch.randint(3, vocab, (MICRO_BS, ANSWER), generator=g)], 1)
    return counting.to(device), rejected.to(device)


def answer_logp(model, seq):
    logits = model(input_ids=seq).logits[:, PROMPT - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, seq[:, PROMPT:, None]).squeeze(-1).sum(-1)


def main():
    args = _common.parser(__doc__, steps=60).parse_args()
    steps = 12 if args.short else args.steps
    accel = _common.accelerator({
        "policy": _common.launch_config(_common.ds_config(2, MICRO_BS, bf16=args.bf16)),
        "reference": _common.ds_config(3, MICRO_BS, bf16=args.bf16),
    })
    torch.manual_seed(0)                    # the same starting weights on every rank, for both copies
    policy = _common.causal_lm(args.model, _common.tiny_llama())
    start = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    accel.state.select_deepspeed_plugin("reference")
    reference = _common.causal_lm(args.model, policy.config)             # partitioned at construction
    if not args.model:
        import deepspeed
        params = list(reference.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            reference.load_state_dict(start, strict=False)
    accel.state.select_deepspeed_plugin("policy")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: min(1.0, (u + 1) / 5))
    policy, optimizer, scheduler = accel.prepare(policy, optimizer, scheduler)
    accel.state.select_deepspeed_plugin("reference")
    reference = accel.prepare(reference.requires_grad_(False))
    accel.print(f"policy ZeRO-{policy.zero_optimization_stage()} (trained), reference "
                f"ZeRO-{reference.zero_optimization_stage()} (frozen); world size {accel.num_processes}")

    vocab = policy.module.config.vocab_size
    g = torch.Generator().manual_seed(accel.process_index)
    history = []
    for _ in _common.progress(accel, steps, "dpo"):
        chosen, rejected = pairs(g, vocab, accel.device)
        with torch.no_grad():
            ref_margin = answer_logp(reference, chosen) - answer_logp(reference, rejected)
        margin = answer_logp(policy, chosen) - answer_logp(policy, rejected)
        loss = -F.logsigmoid(BETA * (margin - ref_margin)).mean()
        accel.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        history.append(_common.mean_over_ranks(accel, loss.item()))
    _common.check_falling(accel, "DPO loss", history, args.short)
    _common.end(accel)  # destroy the process group: gloo's threads can abort an exit without it


if __name__ == "__main__":
    main()
