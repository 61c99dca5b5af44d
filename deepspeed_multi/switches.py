"""Every ``DSM_*`` environment switch the package reads, read here and nowhere else.

User-facing options are config keys (``config.MultiOptions``, under ``"deepspeed_multi"``);
these switches are for diagnostics, A/B benchmarks and build locations. Each is read when it is
needed (not cached at import), so a test or a benchmark may set it per engine.
"""
import os

# Fast paths (each "0" keeps DeepSpeed's own method; see deepspeed_multi/zero/).
FUSED_ZERO = "DSM_FUSED_ZERO"  # the fused bucket passes (stage12_reduce, stage12_bucket_pack, stage3_*)
ZERO12_GRAD_VIEW = "DSM_ZERO12_GRAD_VIEW"  # ZeRO-1/2 update reads its gradient partition in place
ZERO3_GRAD_VIEW = "DSM_ZERO3_GRAD_VIEW"  # ZeRO-3 update reads its fp32 gradient in place
ZERO12_OVERFLOW_BY_NORM = "DSM_ZERO12_OVERFLOW_BY_NORM"  # the norm's all-reduce also decides overflow
BUCKET_SIZE = "DSM_BUCKET_SIZE"  # gradient bucket buffers no larger than the engine's parameters
MASTER_ALIAS = "DSM_MASTER_ALIAS"  # fp32 ZeRO-1/2/3: the optimizer updates the parameter partition, no clone
ZERO3_LAZY_GRADS = "DSM_ZERO3_LAZY_GRADS"  # ZeRO-3 gradient partitions per sub-group, from first gradient to update
ZERO3_RANK_ORDER = "DSM_ZERO3_RANK_ORDER"  # ZeRO-3 bucket laid out in the reduce-scatter's rank order, no second buffer
ZERO3_CAST_ON_GATHER = "DSM_ZERO3_CAST_ON_GATHER"  # bf16/fp16 ZeRO-3: no 16-bit partition copy, cast at each gather
ZERO3_JOINED_FETCH = "DSM_ZERO3_JOINED_FETCH"  # ZeRO-3: several engines' first forward fetches as one all-gather
ZERO3_RELEASE_BETWEEN = "DSM_ZERO3_RELEASE_BETWEEN"  # ZeRO-3: what an engine keeps gathered, released when another runs
TRIM_AFTER_BUILD = "DSM_TRIM_AFTER_BUILD"  # the host heap a construction freed handed back to the system
MUON_COMPILE_AT_FIRST_CALL = "DSM_MUON_COMPILE_AT_FIRST_CALL"  # DeepSpeed's Muon kernels: torch.compile at first call
BLOCK_SIZES = "DSM_BLOCK_SIZES"  # bucket and prefetch sizes a config leaves unset: the model's block, not 5e8
# Reliability.
CHECK_RANK_AGREEMENT = "DSM_CHECK_RANK_AGREEMENT"  # ZeRO-0/1 per-update backward-count comparison
# DeepSpeed outside the supported window: run anyway, every fast path off (compat.check_deepspeed).
ALLOW_UNSUPPORTED_DEEPSPEED = "DSM_ALLOW_UNSUPPORTED_DEEPSPEED"
# Transformers/TRL releases other than the tested ones under deepspeed_multi.transformers: run anyway.
ALLOW_UNTESTED_TRAINERS = "DSM_ALLOW_UNTESTED_TRAINERS"
# Lightning releases other than the tested ones under deepspeed_multi.lightning: run anyway.
ALLOW_UNTESTED_LIGHTNING = "DSM_ALLOW_UNTESTED_LIGHTNING"
# The fused ops (deepspeed_multi.ops): backend "auto" | "extension" | "reference", and build directory.
FUSED_REDUCE_BACKEND = "DSM_FUSED_REDUCE"
BUILD_DIR = "DSM_BUILD_DIR"
BUILD_WAIT_REPORT_SECONDS = "DSM_BUILD_WAIT_REPORT_SECONDS"  # a rank waiting on another's build says so after this

ALL = (FUSED_ZERO, ZERO12_GRAD_VIEW, ZERO3_GRAD_VIEW, ZERO12_OVERFLOW_BY_NORM, BUCKET_SIZE, MASTER_ALIAS,
       ZERO3_LAZY_GRADS, ZERO3_RANK_ORDER, ZERO3_CAST_ON_GATHER, ZERO3_JOINED_FETCH, ZERO3_RELEASE_BETWEEN,
       BLOCK_SIZES, TRIM_AFTER_BUILD, MUON_COMPILE_AT_FIRST_CALL,
       CHECK_RANK_AGREEMENT, ALLOW_UNSUPPORTED_DEEPSPEED, ALLOW_UNTESTED_TRAINERS, ALLOW_UNTESTED_LIGHTNING,
       FUSED_REDUCE_BACKEND, BUILD_DIR, BUILD_WAIT_REPORT_SECONDS)


def switch_on(name: str, default: bool = True) -> bool:
    """A boolean switch: "0" is off, "1" is on, unset (or empty) is ``default``."""
    value = os.environ.get(name, "").strip()
    return default if value == "" else value != "0"


def value(name: str, default: str = "") -> str:
    """A switch's text (stripped), or ``default`` when unset or empty."""
    return os.environ.get(name, "").strip() or default
