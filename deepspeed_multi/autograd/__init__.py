"""The autograd boundary: boundary nodes on each engine's inputs and outputs (``boundary``), the
engine's region of the graph (``region``), direct parameter uses outside it (``outside_use``),
the gradient scale (``grad_scale``), output trees (``tree``) and the private autograd-engine
calls (``graph``). Nothing here imports DeepSpeed."""
