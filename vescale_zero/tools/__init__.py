"""Layer 5, tools at the top: the ``vescale-zero`` command (``cli``), model shapes for planning
(``model_shapes``) and the GPU check (``gpu_check``, run as ``python -m vescale_zero.gpu_check``)."""
