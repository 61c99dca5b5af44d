"""transformers.Trainer on deepspeed_multi: the model at ZeRO-3, gradient accumulation 2.

    torchrun --standalone --nproc_per_node=2 examples/trl/trainer.py [--short]

The one change from a plain Trainer script is the import of ``Trainer``. The Trainer owns
gradient accumulation and clipping as it does under DDP, and the result is the DDP Trainer's
(tests/multi_gpu/test_trainer.py). The model learns to count (``w7 w8 w9 ...``); the loss falls.
"""
import _common

_common.setup_env()


class Counting:
    def __init__(self, n, length=12, seed=0):
        import torch
        g = torch.Generator().manual_seed(seed)
        tok = _common.tokenizer()
        self.rows = [tok(_common.counting(g, length), return_tensors="pt")["input_ids"][0] for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main():
    args = _common.parser(__doc__).parse_args()
    import torch
    from transformers import TrainingArguments

    from deepspeed_multi.transformers import Trainer   # instead of: from transformers import Trainer

    torch.manual_seed(0)
    config = _common.ds_config(3)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True  # save_model writes weights
    training = TrainingArguments(**_common.common_args(
        args, per_device_train_batch_size=8, gradient_accumulation_steps=2, learning_rate=1e-2,
        max_steps=12 if args.short else 80, deepspeed=config))
    trainer = Trainer(model=_common.tiny_llama(), args=training, train_dataset=Counting(4000))
    loss = _common.watch(trainer, "loss", falls=True)
    trainer.train()
    loss.check("Trainer")
    trainer.save_model(training.output_dir + "/final")   # loads with AutoModelForCausalLM.from_pretrained
    _common.end(trainer)


if __name__ == "__main__":
    main()
