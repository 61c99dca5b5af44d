"""One checkpoint for a set of engines, as DDP's holds every module's state.

- ``set_checkpoint``: :func:`save_checkpoint` / :func:`load_checkpoint`, atomic across engines and ranks;
- ``module_state``: what DeepSpeed's own checkpoint leaves out (the parameters of engines without an
  optimizer, content-addressed; every rank's buffers);
- ``tags``: which tags are complete, which to load, :func:`remove_checkpoint` / :func:`remove_incomplete`;
- ``disks``: one shared filesystem or a disk per node;
- ``resize``: a resume at another world size;
- ``files``: what the ranks decide and hash together.
"""
from .set_checkpoint import PHASES, load_checkpoint, save_checkpoint
from .tags import remove_checkpoint, remove_incomplete

__all__ = ["PHASES", "load_checkpoint", "remove_checkpoint", "remove_incomplete", "save_checkpoint"]
