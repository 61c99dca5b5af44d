"""Failing loudly instead of hanging or drifting: the watchdog, the ZeRO-0/1 rank-agreement check,
skip groups, the misuse checks and data-parallel group checks."""
