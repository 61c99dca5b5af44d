"""The misuse catalogue ([Note: the misuse catalogue] in deepspeed_multi/misuse.py): each mistake
gets a clear error naming the engine and the fix, and the gradients stay exact. The fp16
overflow / skip-group cases are in test_api.py; engines reached on some ranks only in
test_watchdog.py and test_api.py::test_ranks_disagree_refused."""
import misuse_checks as checks
from harness import run_distributed


def test_misuse_catalogue():
    run_distributed(checks.all_misuse, [0, 1, 2, 3])


def test_engines_on_different_dp_groups():
    """Refused on every rank unless opted in; opted in with replicated data, exact at ZeRO 0-3,
    gas 1 and 2; the same data-parallel ranks need no opt-in."""
    run_distributed(checks.all_dp_groups, [0, 1, 2, 3], timeout_s=180)
