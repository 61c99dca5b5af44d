# The benchmarks are standalone scripts (python benchmarks/<name>.py), not tests.
collect_ignore_glob = ["*.py"]
