import functools, json, scenarios
from scenarios import _knob, _each, _OFFLOAD_OPT, _two_backward, _knobs, _single
def variants():
    from scenarios import _outside_call, _twice
    off = lambda sc: _knobs(sc, {"zero_force_ds_cpu_optimizer": False}, offload_optimizer={"device": "cpu"})
    return {
      "outside-call-z2-off": lambda: off(_outside_call(2)),
      "outside-call-z1-off": lambda: off(_outside_call(1)),
      "outside-call-z2-off-gas1": lambda: off(_outside_call(2, gas=1)),
      "twice-nested-z2-off": lambda: off(_twice(2)),
      "twice-sum-z2-off": lambda: off(_twice(2, False)),
    }
def run(which):
    import deepspeed, deepspeed.comm as dist
    init = deepspeed.initialize if which == "upstream" else None
    out = {}
    for name, fn in variants().items():
        scenarios.SCENARIOS[name] = fn
        try:
            scenarios.check(name, initialize=init); out[name] = "ok"
        except Exception as e:
            out[name] = f"FAIL {type(e).__name__}: {str(e)[:150]}"
    if dist.get_rank() == 0:
        json.dump(out, open(f"/tmp/off_{which}.json", "w"), indent=1)
