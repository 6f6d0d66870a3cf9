"""Layer 2, one group's life through forward, backward and the step: its buffers and parameters
(``param_group``), how it gathers (``param_gather``) and reduces (``grad_reduce``, ``grad_shard``),
where it stands (``group_progress``), the one reduce-scatter order (``scheduler``) and the module
hooks that drive it all (``hooks``). Imports only :mod:`vescale_zero.primitives` below it."""
