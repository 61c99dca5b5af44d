"""Knowledge distillation, as in Accelerate's multi-model DeepSpeed guide, in ONE Accelerator.

    torchrun --standalone --nproc_per_node=2 examples/hf/distillation.py [--short] [--model TEACHER]
    accelerate launch --multi_gpu --num_processes 2 examples/hf/distillation.py

The student (a small Llama, ZeRO-2, trained with its optimizer and scheduler) learns next-token
prediction and the teacher's distribution; the teacher (ZeRO-3, frozen) is loaded after
``select_deepspeed_plugin("teacher")``, so Transformers partitions it as it is built.
"""
import torch
import torch.nn.functional as F

import _common

_common.setup_env()
SEQ, MICRO_BS = 16, 8


def batch(step, rank, vocab, device):
    """Counting sequences mod vocab from a random start: an easy next-token task."""
    g = torch.Generator().manual_seed(10_000 * rank + step)
    start = torch.randint(3, vocab, (MICRO_BS, 1), generator=g)
    ids = 3 + (start - 3 + torch.arange(SEQ)) % (vocab - 3)
    return ids.to(device)


def main():
    args = _common.parser(__doc__, steps=60).parse_args()
    steps = 12 if args.short else args.steps
    student_cfg = _common.ds_config(2, MICRO_BS, bf16=args.bf16)
    teacher_cfg = _common.ds_config(3, MICRO_BS, bf16=args.bf16)
    accel = _common.accelerator({"student": _common.launch_config(student_cfg), "teacher": teacher_cfg})

    torch.manual_seed(0)                    # the same random models on every run
    accel.state.select_deepspeed_plugin("teacher")
    teacher = _common.causal_lm(args.model, _common.tiny_llama(layers=3))          # partitioned at construction
    vocab = teacher.config.vocab_size
    accel.state.select_deepspeed_plugin("student")
    student = _common.causal_lm(None, _common.tiny_llama(vocab=vocab, hidden=32, layers=1))
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: min(1.0, (u + 1) / 5))
    student, optimizer, scheduler = accel.prepare(student, optimizer, scheduler)
    accel.state.select_deepspeed_plugin("teacher")
    teacher = accel.prepare(teacher.requires_grad_(False))
    accel.print(f"student ZeRO-{student.zero_optimization_stage()} (trained), teacher "
                f"ZeRO-{teacher.zero_optimization_stage()} (frozen); world size {accel.num_processes}")

    teacher.eval()
    student.train()
    history = []
    for step in _common.progress(accel, steps, "distill"):
        ids = batch(step, accel.process_index, vocab, accel.device)
        with torch.no_grad():
            t = teacher(input_ids=ids)
        s = student(input_ids=ids, labels=ids)
        kd = F.kl_div(F.log_softmax(s.logits.float(), -1), F.log_softmax(t.logits.float(), -1), log_target=True,
                      reduction="batchmean") / SEQ
        loss = 0.5 * s.loss + 0.5 * kd
        accel.backward(loss)            # one backward; steps nothing
        optimizer.step()                # the student's engine updates
        scheduler.step()                # once per update
        optimizer.zero_grad()
        history.append(_common.mean_over_ranks(accel, s.loss.item()))
    _common.check_falling(accel, "student cross-entropy", history, args.short)
    _common.end(accel)  # destroy the process group: gloo's threads can abort an exit without it


if __name__ == "__main__":
    main()
