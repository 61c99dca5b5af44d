"""Tiny Transformers models from configs (random weights; nothing is downloaded)."""
import torch

VOCAB, HIDDEN = 64, 16


def llama_config(**kw):
    from transformers import LlamaConfig
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, attention_dropout=0.0)
    base.update(kw)
    return LlamaConfig(**base)


def causal_lm(**kw):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(llama_config(**kw))


def scorer(**kw):
    """A value/reward model: Llama with a one-output sequence-classification head."""
    from transformers import AutoModelForSequenceClassification
    return AutoModelForSequenceClassification.from_config(llama_config(num_labels=1, **kw))


def vit_encoder():
    from transformers import ViTConfig, ViTModel
    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=32, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    return ViTModel(cfg, add_pooling_layer=False)


def tokens(g, batch, length):
    """Token ids that avoid the pad id (0), so sequence-classification heads read the last token."""
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def is_partitioned(model) -> bool:
    """Every parameter's local partition (ds_tensor) holds fewer elements than the full parameter."""
    params = list(model.parameters())
    return bool(params) and all(hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel for p in params)
