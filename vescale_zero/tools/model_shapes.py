"""Parameter shapes of public models, per FSDP group, as data.

Each model is described by its distinct *layer kinds* (one FSDP group each: the unit
that ``fully_shard`` gathers together). Shapes follow the published configurations:

* Llama-3-8B / 70B: GQA attention (q, k, v, o), SwiGLU MLP (gate, up, down), RMSNorms.
* DeepSeek-V3-671B: MLA attention (q_a, q_b, kv_a, kv_b, o + norms); first 3 layers dense
  (FFN 18432), then MoE (256 routed experts of 2048 + 1 shared expert, router 256x7168);
  one tensor per expert projection.
* GPT-OSS-120B: GQA attention with biases and sinks; 128 experts *fused* into one tensor
  per projection (gate_up [128, 2880, 5760], down [128, 2880, 2880]) with biases.
* Qwen3-30B-A3B (MoE): GQA with q/k norms; 128 experts of 768, one tensor per projection.

Biases and small norms are included where the model has them; their effect on padding is
negligible either way.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

from ..primitives.granularity import preset_granularity
from ..primitives.planner import TensorSpec

__all__ = ["MODEL_NAMES", "Group", "layer_groups", "group_counts", "granularity", "group_specs", "fsdp2_padding",
           "zero3_padding", "megatron_fsdp_padding", "load_shapes"]

Shape = Tuple[int, ...]
Group = List[Tuple[str, Shape]]


def _llama(hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> Dict[str, Group]:
    hd = hidden // heads
    layer = [
        ("input_layernorm.weight", (hidden,)),
        ("self_attn.q_proj.weight", (heads * hd, hidden)),
        ("self_attn.k_proj.weight", (kv_heads * hd, hidden)),
        ("self_attn.v_proj.weight", (kv_heads * hd, hidden)),
        ("self_attn.o_proj.weight", (hidden, heads * hd)),
        ("post_attention_layernorm.weight", (hidden,)),
        ("mlp.gate_proj.weight", (ffn, hidden)),
        ("mlp.up_proj.weight", (ffn, hidden)),
        ("mlp.down_proj.weight", (hidden, ffn)),
    ]
    return {
        "embedding": [("embed_tokens.weight", (vocab, hidden))],
        "decoder_layer": layer,
        "head": [("norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))],
    }


def _deepseek_v3() -> Dict[str, Group]:
    h, heads, q_rank, kv_rank, nope, rope, v = 7168, 128, 1536, 512, 128, 64, 128
    attn = [
        ("input_layernorm.weight", (h,)),
        ("self_attn.q_a_proj.weight", (q_rank, h)),
        ("self_attn.q_a_layernorm.weight", (q_rank,)),
        ("self_attn.q_b_proj.weight", (heads * (nope + rope), q_rank)),
        ("self_attn.kv_a_proj_with_mqa.weight", (kv_rank + rope, h)),
        ("self_attn.kv_a_layernorm.weight", (kv_rank,)),
        ("self_attn.kv_b_proj.weight", (heads * (nope + v), kv_rank)),
        ("self_attn.o_proj.weight", (h, heads * v)),
        ("post_attention_layernorm.weight", (h,)),
    ]

    def mlp(prefix: str, ffn: int) -> Group:
        return [
            (f"{prefix}.gate_proj.weight", (ffn, h)),
            (f"{prefix}.up_proj.weight", (ffn, h)),
            (f"{prefix}.down_proj.weight", (h, ffn)),
        ]

    moe = [("mlp.gate.weight", (256, h))]
    for i in range(256):
        moe += mlp(f"mlp.experts.{i}", 2048)
    moe += mlp("mlp.shared_experts", 2048)
    return {
        "embedding": [("embed_tokens.weight", (129280, h))],
        "dense_layer": attn + mlp("mlp", 18432),
        "moe_layer": attn + moe,
        "head": [("norm.weight", (h,)), ("lm_head.weight", (129280, h))],
    }


def _gpt_oss_120b() -> Dict[str, Group]:
    h, heads, kv, hd, experts, ffn = 2880, 64, 8, 64, 128, 2880
    layer = [
        ("input_layernorm.weight", (h,)),
        ("self_attn.q_proj.weight", (heads * hd, h)),
        ("self_attn.q_proj.bias", (heads * hd,)),
        ("self_attn.k_proj.weight", (kv * hd, h)),
        ("self_attn.k_proj.bias", (kv * hd,)),
        ("self_attn.v_proj.weight", (kv * hd, h)),
        ("self_attn.v_proj.bias", (kv * hd,)),
        ("self_attn.o_proj.weight", (h, heads * hd)),
        ("self_attn.o_proj.bias", (h,)),
        ("self_attn.sinks", (heads,)),
        ("post_attention_layernorm.weight", (h,)),
        ("mlp.router.weight", (experts, h)),
        ("mlp.router.bias", (experts,)),
        ("mlp.experts.gate_up_proj", (experts, h, 2 * ffn)),
        ("mlp.experts.gate_up_proj_bias", (experts, 2 * ffn)),
        ("mlp.experts.down_proj", (experts, ffn, h)),
        ("mlp.experts.down_proj_bias", (experts, h)),
    ]
    return {
        "embedding": [("embed_tokens.weight", (201088, h))],
        "decoder_layer": layer,
        "head": [("norm.weight", (h,)), ("lm_head.weight", (201088, h))],
    }


def _qwen3_30b_a3b() -> Dict[str, Group]:
    h, heads, kv, hd, experts, ffn = 2048, 32, 4, 128, 128, 768
    layer = [
        ("input_layernorm.weight", (h,)),
        ("self_attn.q_proj.weight", (heads * hd, h)),
        ("self_attn.k_proj.weight", (kv * hd, h)),
        ("self_attn.v_proj.weight", (kv * hd, h)),
        ("self_attn.o_proj.weight", (h, heads * hd)),
        ("self_attn.q_norm.weight", (hd,)),
        ("self_attn.k_norm.weight", (hd,)),
        ("post_attention_layernorm.weight", (h,)),
        ("mlp.gate.weight", (experts, h)),
    ]
    for i in range(experts):
        layer += [
            (f"mlp.experts.{i}.gate_proj.weight", (ffn, h)),
            (f"mlp.experts.{i}.up_proj.weight", (ffn, h)),
            (f"mlp.experts.{i}.down_proj.weight", (h, ffn)),
        ]
    return {
        "embedding": [("embed_tokens.weight", (151936, h))],
        "decoder_layer": layer,
        "head": [("norm.weight", (h,)), ("lm_head.weight", (151936, h))],
    }


_MODELS = {
    "llama3-8b": lambda: _llama(4096, 32, 8, 14336, 128256),
    "llama3-70b": lambda: _llama(8192, 64, 8, 28672, 128256),
    "deepseek-v3-671b": _deepseek_v3,
    "gpt-oss-120b": _gpt_oss_120b,
    "qwen3-30b-a3b": _qwen3_30b_a3b,
}
MODEL_NAMES: Tuple[str, ...] = tuple(_MODELS)


def layer_groups(model: str) -> Dict[str, Group]:
    """``{group name: [(parameter name, shape), ...]}`` for ``model`` (see MODEL_NAMES)."""
    try:
        return _MODELS[model.lower()]()
    except KeyError:
        raise KeyError(f"unknown model {model!r}; known models: {', '.join(MODEL_NAMES)}") from None


_COUNTS = {  # instances of each group in the model (the decoder layers of the published configurations)
    "llama3-8b": {"decoder_layer": 32},
    "llama3-70b": {"decoder_layer": 80},
    "deepseek-v3-671b": {"dense_layer": 3, "moe_layer": 58},
    "gpt-oss-120b": {"decoder_layer": 36},
    "qwen3-30b-a3b": {"decoder_layer": 48},
}


def group_counts(model: str) -> Dict[str, int]:
    """``{group name: instances in the model}`` for ``model`` (1 for embedding and head)."""
    groups = layer_groups(model)
    return {name: _COUNTS[model.lower()].get(name, 1) for name in groups}


def granularity(shape: Sequence[int], policy: str) -> int:
    """Block size in elements of a tensor of ``shape`` under a preset: ``"element"`` (1),
    ``"row"`` (``numel // shape[0]``; 1 for 1-D) or ``"<N>rows"`` (N rows; if N does not
    divide ``shape[0]``, the largest divisor of ``shape[0]`` that is <= N, so blocks tile
    the tensor). The rules are those of :func:`vescale_zero.primitives.granularity.preset_granularity`."""
    return preset_granularity(shape, policy)


def group_specs(group: Group, policy: str) -> List[TensorSpec]:
    """The planner's input for ``group`` under a granularity preset ('element', 'row', '16rows')."""
    return [TensorSpec(_numel(shape), granularity(shape, policy), name) for name, shape in group]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def fsdp2_padding(group: Group, world_size: int) -> int:
    """Elements PyTorch FSDP2 pads: each parameter's dim 0 up to a multiple of world_size."""
    pad = 0
    for _, shape in group:
        rows = shape[0]
        pad += (-rows % world_size) * (_numel(shape) // rows)
    return pad


def zero3_padding(group: Group, world_size: int) -> int:
    """Elements DeepSpeed ZeRO-3 / FSDP1 pad: the flat concatenation up to a multiple of world_size."""
    return -sum(_numel(s) for _, s in group) % world_size


def megatron_fsdp_padding(group: Group, world_size: int, keep_rows: bool) -> int:
    """Elements Megatron-FSDP pads a group's buffer: to a multiple of ``world_size * chunk``,
    with ``chunk`` = 1 for element sharding or, when rows stay whole, the LCM of the row
    sizes, each tensor also rounded up to ``chunk`` (its gap filling by small tensors is
    not modelled, so this is an upper bound)."""
    chunk = 1
    if keep_rows:
        for _, shape in group:
            chunk = math.lcm(chunk, _numel(shape) // shape[0] if len(shape) > 1 else 1)
    laid = sum(-(-_numel(s) // chunk) * chunk for _, s in group)
    unit = world_size * chunk
    return -(-laid // unit) * unit - sum(_numel(s) for _, s in group)


def load_shapes(path: str) -> Tuple[Dict[str, Group], Dict[str, int]]:
    """A user's own model description, ``(groups, counts)`` as :func:`layer_groups` and
    :func:`group_counts` give them for a preset. JSON: ``{"group": [["param name", [dims...]],
    ...], ...}``; a group repeated in the model (its layers) may say how often:
    ``{"layer": {"count": 32, "params": [["w1", [4096, 1024]], ...]}}`` (default 1)."""
    import json

    with open(path) as f:
        raw = json.load(f)
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{path}: expected a JSON object {{group name: [[parameter name, shape], ...]}}")
    groups: Dict[str, Group] = {}
    counts: Dict[str, int] = {}
    for gname, params in raw.items():
        counts[gname] = 1
        if isinstance(params, dict):
            count = params.get("count", 1)
            if isinstance(count, bool) or not isinstance(count, int) or count < 1 or set(params) - {"count", "params"}:
                raise ValueError(f"{path}: group {gname!r} must be [[parameter name, [dims...]], ...] or "
                                 '{"count": N >= 1, "params": [[parameter name, [dims...]], ...]}')
            counts[gname], params = count, params.get("params")
        try:
            groups[gname] = [(str(n), tuple(int(d) for d in shape)) for n, shape in params]
        except (TypeError, ValueError):
            raise ValueError(f"{path}: group {gname!r} must be a list of [parameter name, [dims...]] pairs") from None
        if any(not shape or min(shape) < 1 for _, shape in groups[gname]):
            raise ValueError(f"{path}: group {gname!r} has an empty or non-positive shape")
    return groups, counts
