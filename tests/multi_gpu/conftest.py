import os
import sys

# The scenario modules are imported by name in the spawned ranks, too.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
