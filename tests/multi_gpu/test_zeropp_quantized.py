"""ZeRO++ quantized weights and gradients (qwZ ``zero_quantized_weights``, qgZ
``zero_quantized_gradients``) in a multi-engine program, against plain PyTorch.

DeepSpeed's quantizer op has no CPU kernel, so this needs 2 GPUs (NCCL): skipped on the CPU box,
on the GPU list. Quantization is lossy by design (int8 weights in the all-gather, int4/int8
gradients in the reduction), so the update is compared as the 16-bit rows are: cosine > 0.99 and
norm within 5% of plain PyTorch's, not to 1e-5. The diamond of ``knob-*`` rows: a ZeRO-2 engine
feeding two ZeRO-3 engines, gas 1 and 2; the knob must reach DeepSpeed's ZeRO-3 engines.
"""
import functools

import pytest

import scenarios
from harness import run_distributed
from rank_launcher import use_gpu


def _quantized(gas):
    def took_effect(engines):
        for name, e in engines.items():
            if e.zero_optimization_stage() == 3:
                assert e.zero_quantized_weights() and e.zero_quantized_gradients(), (
                    f"engine {name!r}: qwZ/qgZ did not reach DeepSpeed")
    scenario = scenarios._knob(took_effect, stages=(2, 3, 3), gas=gas, zero_quantized_weights=True,
                               zero_quantized_gradients=True)
    scenario.dtype = "quantized"  # compared by the update's cosine and norm (common.compare)
    return scenario


ROWS = {f"knob-zeropp-qwz-qgz-z233-gas{gas}": functools.partial(_quantized, gas) for gas in (1, 2)}


def _check(names):
    scenarios.SCENARIOS.update(ROWS)
    scenarios.check_many(names)


@pytest.mark.skipif(not use_gpu(2), reason="ZeRO++ qwZ/qgZ: DeepSpeed's quantizer has no CPU kernel; needs 2 GPUs")
def test_zeropp_quantized_weights_and_gradients():
    run_distributed(_check, sorted(ROWS), fresh=True)
