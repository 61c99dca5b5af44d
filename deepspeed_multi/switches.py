"""Every ``DSM_*`` environment switch the package reads, read here and nowhere else.

User-facing options are config keys (``config.MultiOptions``, under ``"deepspeed_multi"``);
these switches are for diagnostics, A/B benchmarks and build locations. Each is read when it is
needed (not cached at import), so a test or a benchmark may set it per engine.
"""
import os

# Fast paths (each "0" keeps DeepSpeed's own method; see deepspeed_multi/zero/).
FUSED_ZERO = "DSM_FUSED_ZERO"  # the fused bucket passes (deepspeed_multi.zero.FUSED)
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


# What each switch does: its default and meaning, in Markdown as docs/options.md shows them (that page's
# table of switches is generated from this: tools/docs/reference.py).
DOCS = {
    FUSED_ZERO: ('`1`',
        '`0` turns the fused bucket passes off (a diagnostic twin of `fused_reduce: false`)'),
    ZERO12_GRAD_VIEW: ('`1`',
        "ZeRO-1/2 without offload: the update's gradient is a view of this rank's partition in DeepSpeed's "
        '`grads_in_partition`, not a flattened copy, and the bf16/fp16 overflow check tests that view once per '
        "group (`zero/stage12/grad_view.py`); `0` keeps the flatten and DeepSpeed's per-tensor check (for A/B "
        'runs)'),
    ZERO3_GRAD_VIEW: ('`1`',
        "ZeRO-3 without offload: the optimizer's fp32 gradient is a view of DeepSpeed's gradient buffer, not a "
        'flattened copy (`zero/stage3/grad_view.py`); `0` keeps the copy (for A/B runs)'),
    ZERO12_OVERFLOW_BY_NORM: ('`1`',
        "ZeRO-1/2 bf16/fp16 with `compute_grad_norm` on (DeepSpeed's default): the gradient norm's all-reduce "
        "decides overflow and the overflow flag's all-reduce is not run (`zero/stage12/overflow.py`); `0` keeps "
        'both collectives (for A/B runs)'),
    BUCKET_SIZE: ('`1`',
        "ZeRO-1/2/3 with contiguous gradients: bucket buffers of min(`reduce_bucket_size`, the engine's trainable "
        "elements), same flushes, ZeRO-3's allocated for each backward only (`zero/bucket_size.py`); `0` keeps "
        "DeepSpeed's buffers of `reduce_bucket_size` elements (for A/B runs)"),
    MASTER_ALIAS: ('`1`',
        "fp32 ZeRO-1/2/3 without optimizer offload: the optimizer's fp32 master partition is this rank's "
        'parameter partition instead of a clone of it, same updates (`zero/master_alias.py`); `0` keeps '
        "DeepSpeed's clone (for A/B runs)"),
    ZERO3_LAZY_GRADS: ('`1`',
        "ZeRO-3 without optimizer offload: each sub-group's gradient partition is allocated when its first "
        'gradient is reduced and dropped after the update, instead of one buffer held for the whole run; same '
        "updates (`zero/stage3/lazy_grads.py`); `0` keeps DeepSpeed's buffer (for A/B runs)"),
    ZERO3_RANK_ORDER: ('`1`',
        'ZeRO-3 with the fused bucket passes: each gradient enters the bucket already cut into the '
        "reduce-scatter's per-rank chunks, so a flush reduce-scatters the bucket where it lies instead of copying "
        'it into a second buffer of its size; same updates (`zero/stage3/rank_order.py`); `0` packs the second '
        'buffer at each flush (for A/B runs)'),
    ZERO3_CAST_ON_GATHER: ('`1`',
        'bf16/fp16 ZeRO-3 without offload, hpZ or quantized weights: no 16-bit copy of the parameter partition '
        "beside the fp32 master; each gather casts the master's slice, same values and updates "
        "(`zero/stage3/cast_on_gather.py`); `0` keeps DeepSpeed's copy (for A/B runs)"),
    ZERO3_JOINED_FETCH: ('`1`',
        'ZeRO-3 engines under one loss (same process group; no NVMe, hpZ or quantized weights): the parameters '
        "each engine's forward gathers first are gathered for all of them in one all-gather at the first engine's "
        'start of forward, up to its `stage3_prefetch_bucket_size` and `stage3_max_live_parameters` (one block of '
        'its model each when the config leaves them unset), same values (`zero/stage3/joined_fetch.py`); `0` lets '
        'each engine gather its own (for A/B runs)'),
    ZERO3_RELEASE_BETWEEN: ('`1`',
        "ZeRO-3 engines beside other engines: when an engine's forward starts, the parameters another ZeRO-3 "
        'engine keeps gathered from its own forward for its backward are released (not persistent ones, none in '
        'use or held by a `GatheredParameters` context, none inside a backward), where the starting engine has '
        "more parameters than that engine's `stage3_max_reuse_distance`; its backward gathers them again, same "
        'values (`zero/stage3/release_between.py`); `0` keeps them gathered (for A/B runs)'),
    BLOCK_SIZES: ('`1`',
        'ZeRO-1/2/3: the bucket and prefetch sizes a config leaves unset or `"auto"` (`reduce_bucket_size`, '
        '`allgather_bucket_size`; at ZeRO-3 `stage3_prefetch_bucket_size`, `stage3_max_live_parameters` (one '
        "block: DeepSpeed's prefetch slides by layer), `stage3_max_reuse_distance`, and with SGD/Adam/AdamW "
        "`sub_group_size`) are the model's block's (grouped by `min_block_elements`), never above DeepSpeed's "
        "defaults; written values are kept (`zero/block_sizes.py`); `0` keeps DeepSpeed's defaults (for A/B runs)"),
    TRIM_AFTER_BUILD: ('`1`',
        "after each `initialize`, the C heap's free pages (the construction's temporary host copies, which glibc "
        'keeps resident) are handed back to the system with `malloc_trim(0)`; glibc only (`host_memory.py`); `0` '
        'keeps them (for A/B runs)'),
    MUON_COMPILE_AT_FIRST_CALL: ('`1`',
        "DeepSpeed's Muon kernels, which DeepSpeed imports while building any ZeRO or bf16 optimizer (to ask "
        'whether it is Muon) and decorates with `torch.compile` at import, are imported before the first engine '
        "is built with `torch.compile` applied at each kernel's first call instead: a process that never runs "
        'Muon does not import Inductor (about 43 MiB resident per rank and seconds of construction); a Muon '
        'engine compiles the same graphs at its first step (`host_memory.py`); `0` imports them as DeepSpeed does '
        '(for A/B runs)'),
    CHECK_RANK_AGREEMENT: ('`1`',
        'ZeRO 0/1: one tiny all-reduce per update, launched asynchronously when `step()` starts and waited for '
        'right before the first gradient collective (`reliability/rank_agreement.py`), that refuses the step on '
        'every rank when ranks ran different numbers of backward passes through the engine; its cost, on / off '
        'beside upstream: `python benchmarks/overhead.py --rank-agreement` (on / off at ZeRO-1 on 2 CPU ranks, '
        'fp32: 1.013, inside its interquartile range 0.99-1.04; '
        '[PERFORMANCE.md](../benchmarks/PERFORMANCE.md#watchdog-and-rank-meeting-cost))'),
    ALLOW_UNSUPPORTED_DEEPSPEED: ('`0`',
        '`1` runs on a DeepSpeed outside the supported window (see [Supported DeepSpeed '
        'releases](supported_releases.md)) with every fast path off, after checking that the methods correctness '
        'needs exist; without it such a DeepSpeed is refused at `initialize`'),
    ALLOW_UNTESTED_TRAINERS: ('`0`',
        '`1` runs `deepspeed_multi.transformers` with a Transformers/TRL release other than the tested 5.23.x or '
        '5.24.x / 1.16.x (refused otherwise, when the trainer class is built)'),
    ALLOW_UNTESTED_LIGHTNING: ('`0`',
        '`1` runs `deepspeed_multi.lightning` with a Lightning release other than the tested 2.6.x (refused '
        'otherwise, when a strategy is built)'),
    FUSED_REDUCE_BACKEND: ('`auto`',
        '`ext` forces the compiled extension, `ref` the PyTorch reference'),
    BUILD_DIR: ("`~/.cache/deepspeed_multi/<torch>/<name>-<key>` (key: the environment's `sys.prefix`, the "
                "sources' path and bytes)",
        'JIT build cache; ranks meet on an `flock` in it, so a build killed midway is taken over by the next '
        'process and a waiter says what it waits on'),
    BUILD_WAIT_REPORT_SECONDS: ('`5`',
        "how long a process waits on another's build before saying so (then at doubling intervals)"),
}


def switch_on(name: str, default: bool = True) -> bool:
    """A boolean switch: "0" is off, "1" is on, unset (or empty) is ``default``."""
    value = os.environ.get(name, "").strip()
    return default if value == "" else value != "0"


def value(name: str, default: str = "") -> str:
    """A switch's text (stripped), or ``default`` when unset or empty."""
    return os.environ.get(name, "").strip() or default
