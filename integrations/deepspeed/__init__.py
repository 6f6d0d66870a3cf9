"""DeepSpeed adapter: `"zero_optimization": {"stage": "ragged"}` (in progress, see issue 3)."""
