"""Integrations with the Hugging Face stack that are not Accelerate itself: building models under
ZeRO-3 (``zero_init``) and Transformers' view of a DeepSpeed config (``hf_config``). The
Accelerate integration is the public subpackage ``deepspeed_multi.accelerate``."""
