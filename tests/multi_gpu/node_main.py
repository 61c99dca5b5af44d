"""One rank of a simulated-nodes run (tests/multi_gpu/nodes.py, [Note: simulated nodes]).

torchrun starts it as ``node_main.py module:function '{"args": [...], "disk": path}'``: it sends
its output to ``$DSM_NODES_LOG/rank<r>.attempt<n>.log``, writes its pid, joins the process group
(gloo, env:// from torchrun), calls ``function(*args, disk=path)``, and writes what it returned
(or its traceback) to ``result.rank<r>.json``.
"""
import importlib
import json
import os
import sys
import traceback


def main():
    program, spec = sys.argv[1], json.loads(sys.argv[2])
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    logs = os.environ["DSM_NODES_LOG"]
    log = open(os.path.join(logs, f"rank{rank}.attempt{attempt}.g{os.environ['DSM_SIM_NODE']}.log"), "a",
               buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    with open(os.path.join(logs, f"pid.rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    os.environ["DSM_TEST_WORLD_SIZE"] = os.environ["WORLD_SIZE"]  # the scenarios' reference world size
    record = {"rank": rank, "group_rank": int(os.environ["GROUP_RANK"]), "sim_node": int(os.environ["DSM_SIM_NODE"]),
              "local_rank": int(os.environ["LOCAL_RANK"]), "attempt": attempt, "result": None, "error": None}
    import faulthandler
    faulthandler.register(__import__("signal").SIGUSR1, file=log)
    code = 0
    try:
        import torch
        torch.set_num_threads(1)
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        module, function = program.split(":")
        record["result"] = getattr(importlib.import_module(module), function)(*spec["args"], disk=spec["disk"])
        import deepspeed.comm as dist
        dist.barrier()
    except BaseException:  # noqa: BLE001 - the harness shows it
        record["error"] = traceback.format_exc()
        sys.excepthook(*sys.exc_info())  # as for an uncaught exception (the watchdog's hook may end the rank)
        code = 1
    with open(os.path.join(logs, f"result.rank{rank}.json.tmp"), "w") as f:
        json.dump(record, f)
    os.replace(os.path.join(logs, f"result.rank{rank}.json.tmp"), os.path.join(logs, f"result.rank{rank}.json"))
    import torch
    if code == 0 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(code)  # a failed rank must not wait in gloo's teardown for peers that are still running


if __name__ == "__main__":
    main()
