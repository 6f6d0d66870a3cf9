"""Layer 1, what a layout is and how bytes move: the RaggedShard placement, the planner, granularities,
DBuffer and its collectives, ragged tensors and their meeting with torch's DTensor. No module state,
no hooks; imports nothing of the layers above (``vescale_zero/__init__.py`` draws the layers)."""
