"""The DeepSpeed configs other projects ship (shipped_configs.py: axolotl, LLaMA-Factory, TRL, the
Transformers guide, DeepSpeed-Chat's and OpenRLHF's builders), each distinct one through deepspeed_multi
and through upstream on the same job, bit for bit, and through deepspeed_multi beside a frozen ZeRO-3
reference under one loss.backward() against plain PyTorch (shipped_config_checks.py says what each check
compares). One pool function per group runs every config of the group; the known failures on
deepspeed_multi are shipped_config_checks.EXPECTED_FAILURES, strict."""
import pytest

pytest.importorskip("transformers")

import shipped_config_checks as checks  # noqa: E402
import shipped_configs as table  # noqa: E402
from harness import run_distributed  # noqa: E402

TRAINER_CONFIGS = [e.name for e in table.distinct() if e.driver in (table.TRAINER, table.ACCELERATE)]
INITIALIZE_CONFIGS = [e.name for e in table.distinct() if e.driver == table.INITIALIZE]


@pytest.fixture(scope="module")
def cpu_adam():
    """DeepSpeedCPUAdam's op, built once here before the ranks start (both ranks would otherwise wait on one
    JIT build inside the run's deadline; the build is cached with the environment's extensions)."""
    from deepspeed.ops.op_builder import CPUAdamBuilder
    CPUAdamBuilder().load()


def _run(names):
    results = run_distributed(checks.run_group, names, timeout_s=900)
    print("\n" + checks.summary(results[0]))
    # Each rank compares its own records (a builder job's losses are the rank's own micro-batches), so the
    # texts differ between ranks; what each check concluded must not.
    verdicts = [{n: {k: checks.verdict(v) for k, v in o.items() if "seconds" not in k} for n, o in r.items()}
                for r in results]
    for r, theirs in enumerate(verdicts[1:], 1):
        assert theirs == verdicts[0], f"rank {r} concluded otherwise than rank 0:\n{checks.summary(results[r])}"
    bad = [f"rank {r}: {b}" for r, res in enumerate(results) for b in checks.judge(res)]
    assert not bad, f"{len(bad)} unexpected outcome(s) of shipped configs:\n" + "\n".join(bad)


def test_table():
    """Every entry names its sources as owner/repo@<40-hex commit>:<path>, names are unique, the distinct
    entries cover every source once, and what cannot run on CPU says why."""
    import re
    names = [e.name for e in table.SHIPPED]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for e in table.SHIPPED:
        assert e.driver in (table.TRAINER, table.ACCELERATE, table.INITIALIZE), e.name
        assert e.dtype in ("fp32", "bf16", "fp16"), e.name
        for s in e.sources:
            assert re.match(r"^[\w.-]+/[\w.-]+@[0-9a-f]{40}:\S+", s), f"{e.name}: source {s!r}"
    sources = [s for e in table.distinct() for s in e.sources]
    assert sorted(sources) == sorted(s for e in table.SHIPPED for s in e.sources)
    assert all(e.not_on_cpu is None or len(e.not_on_cpu) > 20 for e in table.SHIPPED)


def test_trainer_configs(cpu_adam):
    """axolotl's, LLaMA-Factory's and the Transformers guide's "auto" configs and TRL's Accelerate configs:
    deepspeed_multi.transformers.Trainer against transformers.Trainer (losses, grad_norm, learning rates,
    final weights bit-identical), and the config as the Trainer filled it in a two-engine program."""
    _run(TRAINER_CONFIGS)


def test_initialize_configs(cpu_adam):
    """DeepSpeed-Chat's and OpenRLHF's builders at their defaults, per stage and offload: deepspeed_multi
    .initialize against deepspeed.initialize with engine.backward/step (or forwards, for eval configs),
    bit-identical, and each in a two-engine program."""
    _run(INITIALIZE_CONFIGS)
