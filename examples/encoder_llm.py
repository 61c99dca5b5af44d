"""An encoder feeding a ZeRO-3 "LLM" under one loss (the RFC's seed shape), LLM trained or frozen.

    torchrun --standalone --nproc_per_node=2 examples/encoder_llm.py [--freeze-llm] [--steps 80] [--bf16]

* encoder: a small ZeRO-2 engine mapping "image features" to PREFIX soft tokens;
* LLM:     a ZeRO-3 engine (built under ``deepspeed_multi.zero_init``, so it is partitioned at
           construction) that reads [prefix tokens; text tokens] and predicts the text;
* one ``loss.backward()``: the gradient flows through the (partitioned) LLM into the encoder.
  With ``--freeze-llm`` the LLM engine has no optimizer and only the encoder learns (prefix
  tuning); otherwise both engines step.

Task: every sample has a class c (0..7) visible only in the features; its text is the token
sequence c, c+1, c+2, ... so the LLM can only predict the first tokens through the encoder.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import _util

D_FEAT, D, VOCAB, PREFIX, SEQ, MICRO_BS, CLASSES = 32, 64, 64, 2, 8, 16, 8


class TinyLLM(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.Sequential(*[_util.Block(D) for _ in range(layers)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, prefix, tokens):
        h = torch.cat([prefix.to(self.emb.weight.dtype), self.emb(tokens)], 1)
        return self.head(self.blocks(h)).float()


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _util.mlp(D_FEAT, 128, PREFIX * D)

    def forward(self, feats):
        return self.net(feats.to(self.net[0].weight.dtype)).view(-1, PREFIX, D)


def batch(step, rank, dev, class_dirs):
    g = torch.Generator().manual_seed(10_000 * rank + step)
    c = torch.randint(0, CLASSES, (MICRO_BS,), generator=g)
    feats = class_dirs[c] + 0.3 * torch.randn(MICRO_BS, D_FEAT, generator=g)
    text = (c[:, None] * 5 + torch.arange(SEQ)) % VOCAB
    return feats.to(dev), text.to(dev)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--freeze-llm", action="store_true")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()
    dev, rank, world = _util.setup()
    import deepspeed_multi
    dtype = "bf16" if args.bf16 else "fp32"
    class_dirs = torch.randn(CLASSES, D_FEAT, generator=torch.Generator().manual_seed(0))

    llm_cfg = _util.ds_config(3, MICRO_BS, dtype=dtype)
    with deepspeed_multi.zero_init(llm_cfg):
        llm = TinyLLM()
    if args.freeze_llm:
        llm.requires_grad_(False)
        llm_engine, *_ = deepspeed_multi.initialize(model=llm, config=llm_cfg)
    else:
        llm_engine, *_ = deepspeed_multi.initialize(model=llm, optimizer=torch.optim.AdamW(llm.parameters(), 2e-3),
                                                    config=llm_cfg)
    enc = Encoder()
    enc_engine, *_ = deepspeed_multi.initialize(model=enc, optimizer=torch.optim.AdamW(enc.parameters(), 2e-3),
                                                config=_util.ds_config(2, MICRO_BS, dtype=dtype))
    trained = [enc_engine] + ([] if args.freeze_llm else [llm_engine])
    _util.rank0_print(f"encoder: ZeRO-2 trained; LLM: ZeRO-3 {'FROZEN' if args.freeze_llm else 'trained'} "
                      f"({sum(p.ds_numel for p in llm.parameters()) / 1e3:.0f}K params, partitioned over {world} "
                      f"ranks); {dtype}")

    losses = []
    for step in _util.progress(args.steps, "encoder->llm"):
        feats, text = batch(step, rank, dev, class_dirs)
        logits = llm_engine(enc_engine(feats), text[:, :-1])
        # position PREFIX-1 (last prefix slot) predicts text[0], and so on
        loss = F.cross_entropy(logits[:, PREFIX - 1:].flatten(0, 1), text.flatten())
        loss.backward()                   # through the ZeRO-3 LLM into the ZeRO-2 encoder
        for e in trained:
            e.step()
        losses.append(_util.all_mean(loss.item()))
        if step % 20 == 0 or step == args.steps - 1:
            _util.rank0_print(f"\nstep {step:3d}: loss {losses[-1]:.4f}")
    k = max(1, len(losses) // 5)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    _util.rank0_print(f"loss: first {k} steps {first:.4f} -> last {k} steps {last:.4f} "
                      f"({'encoder only' if args.freeze_llm else 'encoder and LLM'} trained)")
    if not last < first:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
