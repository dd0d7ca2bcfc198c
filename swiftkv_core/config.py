"""SwiftKV settings inside a Hugging Face Llama config.

Field and type names follow Snowflake's published checkpoints (`model_type: llama_swiftkv`,
`architectures: ["LlamaSwiftKVForCausalLM"]`), so those load unchanged:

- `num_key_value_layers` (l): layers `0..l-1` compute their own KV; layers `l..L-1` take their KV from
  `norm_swiftkv(residual stream after layer l-1)` (SingleInputKV). Default L (SwiftKV off).
- `key_value_group_size` (g): consecutive later layers share one KV projection and cache (AcrossKV).
- `swiftkv`: the training-time switch between the student (True) and the teacher (False) forward.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, LlamaConfig

MODEL_TYPE = "llama_swiftkv"
ARCHITECTURE = "LlamaSwiftKVForCausalLM"


class SwiftKVConfigError(ValueError):
    """A SwiftKV setting is out of range or not supported; the message names the field and what is allowed.

    The one error class for SwiftKV settings, raised for a config's layout and by the vLLM engine-config hook alike.
    `field`: the setting at fault, where there is one (callers answering a request name it)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def default_num_key_value_layers(num_hidden_layers: int) -> int:
    """l when none is given: half the layers, the paper's main setting (prefill compute falls by about half)."""
    return num_hidden_layers // 2


def check_swiftkv_layout(num_hidden_layers: int, num_key_value_layers: int, key_value_group_size: int,
                         require_swiftkv_layers: bool = False) -> None:
    """Raise SwiftKVConfigError unless 1 <= l <= L and g >= 1 divides L - l. `require_swiftkv_layers`: l < L as
    well, so at least one layer takes its KV from layer l (a distillation has something to train)."""
    L, l, g = num_hidden_layers, num_key_value_layers, key_value_group_size
    top = L - 1 if require_swiftkv_layers else L
    if not isinstance(l, int) or isinstance(l, bool) or not 1 <= l <= top:
        why = "; at least one later layer must take its KV from layer l" if require_swiftkv_layers else ""
        raise SwiftKVConfigError(
            f"num_key_value_layers must be an integer in [1, {top}] (num_hidden_layers = {L}{why}), got {l!r}",
            field="num_key_value_layers",
        )
    if not isinstance(g, int) or isinstance(g, bool) or g < 1 or (L - l) % g != 0:
        allowed = [d for d in range(1, L - l + 1) if (L - l) % d == 0] or [1]
        raise SwiftKVConfigError(
            f"key_value_group_size must divide num_hidden_layers - num_key_value_layers = {L - l}; "
            f"allowed values: {allowed}, got {g!r}",
            field="key_value_group_size",
        )


@strict
class LlamaSwiftKVConfig(LlamaConfig):
    model_type = MODEL_TYPE

    swiftkv: bool = False
    num_key_value_layers: int | None = None
    key_value_group_size: int = 1
    # A dual-mode engine serves the base model too, per request (swiftkv_core/dual_mode.py; set by hf_overrides).
    swiftkv_dual_mode: bool = False
    # Adapters trained on the later layers were merged into their o_proj/MLP: the checkpoint no longer holds its base
    # model whole, so it cannot serve base mode.
    later_layers_adapted: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.num_key_value_layers is None:
            self.num_key_value_layers = self.num_hidden_layers
        if not self.architectures:
            self.architectures = [ARCHITECTURE]

    def validate_architecture(self):
        super().validate_architecture()
        check_swiftkv_layout(self.num_hidden_layers, self.num_key_value_layers, self.key_value_group_size)

    # Derived layout, used by the reference model, the vLLM model and the analysis.
    @property
    def swiftkv_layers(self) -> range:
        """Indices of the layers whose KV comes from the SwiftKV projection."""
        return range(self.num_key_value_layers, self.num_hidden_layers)

    def kv_group_leader(self, layer_idx: int) -> int:
        """The first layer of `layer_idx`'s AcrossKV group (the one holding k/v_proj_swiftkv)."""
        l, g = self.num_key_value_layers, self.key_value_group_size
        if layer_idx < l:
            return layer_idx
        return l + (layer_idx - l) // g * g

    @property
    def num_kv_caches(self) -> int:
        """How many distinct per-layer KV caches the model needs: l + (L - l) / g."""
        return self.num_key_value_layers + (self.num_hidden_layers - self.num_key_value_layers) // self.key_value_group_size


def swiftkv_config_from_base(base: LlamaConfig, num_key_value_layers: int, key_value_group_size: int = 1) -> LlamaSwiftKVConfig:
    """A SwiftKV config with every field of a base Llama config plus the SwiftKV layout."""
    check_swiftkv_layout(base.num_hidden_layers, num_key_value_layers, key_value_group_size)
    fields = base.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "auto_map"):
        fields.pop(key, None)
    return LlamaSwiftKVConfig(
        **fields,
        architectures=[ARCHITECTURE],
        num_key_value_layers=num_key_value_layers,
        key_value_group_size=key_value_group_size,
        swiftkv=False,
    )


def register_auto_config() -> None:
    """Make `AutoConfig` (and so vLLM) understand `model_type: llama_swiftkv`. Idempotent."""
    try:
        AutoConfig.register(MODEL_TYPE, LlamaSwiftKVConfig)
    except ValueError:
        pass  # already registered


register_auto_config()
