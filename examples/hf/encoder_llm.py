"""Encoders feeding an LLM under one loss (DeepSpeed issue 6642, seed 001), in ONE Accelerator.

    torchrun --standalone --nproc_per_node=2 examples/hf/encoder_llm.py [--short] [--freeze-llm] [--model LLM]
    accelerate launch --multi_gpu --num_processes 2 examples/hf/encoder_llm.py

A ViT encoder (ZeRO-2) and a projector (ZeRO-1) turn an image into "visual tokens" that a Llama
(ZeRO-3) reads through ``inputs_embeds``; the LLM is trained too, or frozen with ``--freeze-llm``
(prepared without an optimizer: an inference-only engine, still in the gradient path). One
``accelerator.backward(loss)`` reaches all three engines. Task: name the image's class, whose
images are noisy versions of one pattern per class, as a short token sequence.
"""
import torch
import torch.nn as nn

import _common

_common.setup_env()
MICRO_BS, CLASSES, ANSWER, IMG = 8, 8, 3, 16


def batch(g, patterns, device):
    cls = torch.randint(0, CLASSES, (MICRO_BS,), generator=g)
    images = patterns[cls] + 0.5 * torch.randn(MICRO_BS, 3, IMG, IMG, generator=g)
    labels = 10 + 3 * cls[:, None] + torch.arange(ANSWER)            # class k -> tokens 10+3k, 11+3k, 12+3k
    return images.to(device), labels.to(device)


def main():
    ap = _common.parser(__doc__, steps=60)
    ap.add_argument("--freeze-llm", action="store_true")
    args = ap.parse_args()
    steps = 15 if args.short else args.steps
    from transformers import ViTConfig, ViTModel
    accel = _common.accelerator({
        "encoder": _common.launch_config(_common.ds_config(2, MICRO_BS, bf16=args.bf16)),
        "projector": _common.ds_config(1, MICRO_BS, bf16=args.bf16),
        "llm": _common.ds_config(3, MICRO_BS, bf16=args.bf16),
    })
    torch.manual_seed(0)                    # the same random models on every run
    accel.state.select_deepspeed_plugin("llm")
    llm = _common.causal_lm(args.model, _common.tiny_llama())                   # partitioned at construction
    accel.state.select_deepspeed_plugin("encoder")
    encoder = ViTModel(ViTConfig(image_size=IMG, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64), add_pooling_layer=False)
    projector = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, llm.config.hidden_size))

    prepared = {}
    for name, model, lr in (("encoder", encoder, 1e-3), ("projector", projector, 1e-3), ("llm", llm, 1e-3)):
        accel.state.select_deepspeed_plugin(name)
        if name == "llm" and args.freeze_llm:
            prepared[name] = (accel.prepare(model.requires_grad_(False)), None, None)
            continue
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: min(1.0, (u + 1) / 5))
        prepared[name] = accel.prepare(model, opt, sched)
    (encoder, _, _), (projector, _, _), (llm, _, _) = prepared["encoder"], prepared["projector"], prepared["llm"]
    trained = [(opt, sched) for _, opt, sched in prepared.values() if opt is not None]
    accel.print(f"encoder ZeRO-{encoder.zero_optimization_stage()}, projector ZeRO-{projector.zero_optimization_stage()}"
                f", LLM ZeRO-{llm.zero_optimization_stage()} ({'frozen' if args.freeze_llm else 'trained'}); "
                f"world size {accel.num_processes}")

    patterns = torch.randn(CLASSES, 3, IMG, IMG, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(100 + accel.process_index)
    history = []
    for _ in _common.progress(accel, steps, "encoder->llm"):
        images, answer = batch(g, patterns, accel.device)
        visual = projector(encoder(pixel_values=images).last_hidden_state)     # (B, 1 + patches, H)
        # The LLM reads the visual tokens, then answers; only the answer positions are scored.
        prefix = torch.full((MICRO_BS, visual.shape[1]), -100, device=accel.device)
        answer_in = llm.module.get_input_embeddings().weight.new_zeros(MICRO_BS, ANSWER, visual.shape[-1])
        out = llm(inputs_embeds=torch.cat([visual, answer_in.to(visual.dtype)], 1),
                  labels=torch.cat([prefix, answer], 1))
        accel.backward(out.loss)         # one backward through projector, encoder and the LLM
        for opt, sched in trained:
            opt.step()
            sched.step()
            opt.zero_grad()
        history.append(_common.mean_over_ranks(accel, out.loss.item()))
    _common.check_falling(accel, "answer cross-entropy", history, args.short)
    _common.end(accel)  # destroy the process group: gloo's threads can abort an exit without it


if __name__ == "__main__":
    main()
