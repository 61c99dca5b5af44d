import copy, json
import fuzz
from common import run_engines, run_reference, compare
def run(seed, mods, which="ours"):
    import deepspeed.comm as dist, deepspeed_multi, deepspeed
    out = {}
    for label, mod in mods.items():
        spec = fuzz.draw(seed, "fp32", True)
        exec(mod, {"spec": spec})
        sc = fuzz.build(spec)
        try:
            eng = run_engines(sc, deepspeed.initialize if which == "upstream" else deepspeed_multi.initialize)
            compare(eng, run_reference(sc), sc.members, "fp32"); out[label] = "ok"
        except Exception as e:
            out[label] = f"FAIL {type(e).__name__}: {str(e)[:120]}"
    if dist.get_rank() == 0:
        json.dump(out, open("/tmp/fz.json", "w"), indent=1)
