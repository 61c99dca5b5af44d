"""Failing loudly instead of hanging or drifting: the watchdog, the ZeRO-0/1 rank-agreement check,
skip groups, the misuse checks and data-parallel group checks, the engines of boundary-owning features
on DeepSpeed's managed path (refused where a backward reaches them beside another engine), and the
writes ``GatheredParameters`` discards."""
