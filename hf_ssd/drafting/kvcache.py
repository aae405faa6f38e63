"""Which models the drafter can drive, decided before generation starts, and the draft's view of the sequence.

The drafter keeps every draft layer's keys and values for the whole sequence in plain `DynamicLayer`s, also for
sliding-window layers: a sliding layer is then just a full layer whose mask hides keys outside its window, and
the model builds that windowed mask itself from a 2D padding mask, the same way it does when it runs alone.
Cropping, batching and branch adoption are then the same column slices for every layer kind. What cannot be
driven this way (recurrent, linear-attention or convolution state, ...) is refused here with one clear error.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, cache_utils


class UnsupportedDraftError(ValueError):
    """The draft model cannot be driven by the SSD drafter (e.g. its state cannot be cropped or batched)."""


# Cache layers whose tensors are plain [batch, heads, seq, dim] keys/values for every token (a sliding layer
# only drops old columns, which the drafter keeps instead and masks).
# `DummyLayer`: a layer that stores nothing (MLP-only layers, or KV-sharing consumers such as Gemma 3n's last
# layers, which reuse a producer layer's keys within the same forward): nothing to crop or batch there.
_DRIVABLE_LAYERS = tuple(
    getattr(cache_utils, name)
    for name in ("DynamicLayer", "DynamicSlidingWindowLayer", "DummyLayer")
    if hasattr(cache_utils, name)
)


def holds_tensors(layer) -> bool:
    """False for a layer that stores nothing (created lazily between two producers, or a dummy)."""
    keys = getattr(layer, "keys", None)
    return isinstance(keys, torch.Tensor) and keys.dim() == 4


# Families whose recurrent state lives in the modules, not in a cache layer transformers can describe.
_MODULE_STATE_FAMILIES = ("recurrent_gemma", "rwkv", "xlstm")


def _has_recurrent_layers(model) -> bool:
    """True if the model's cache holds a recurrent / linear-attention state (transformers >= 5.25 describes it
    by layer type; earlier versions marked such classes `_is_stateful`)."""
    if getattr(type(model), "_is_stateful", False):
        return True
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) in _MODULE_STATE_FAMILIES:
        return True
    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    if mixin is None or config is None:
        return False
    try:
        layers = DynamicCache(config=config).layers
    except Exception:  # a config DynamicCache cannot describe: check_draft says so for a draft
        return False
    return any(isinstance(layer, mixin) for layer in layers)


def stateful_reason(model) -> str | None:
    """Why `model` keeps a recurrent state that cannot be rolled back to a prefix (None if it does not)."""
    if _has_recurrent_layers(model):
        return (
            f"{type(model).__name__} is a stateful (recurrent / state-space) model: its state cannot be rolled back "
            "to the accepted prefix after a rejection, so speculative decoding cannot verify with it "
            "(transformers' assisted generation refuses it too)"
        )
    return None


def forward_params(model) -> set[str]:
    """The keyword arguments `model`'s forward takes.

    A forward replaced by a pass-through wrapper (`*args, **kwargs`: profilers, latency shims, some hooks) hides
    the model's own; then the class's forward, which the wrapper ends up calling, says what it takes."""
    own = inspect.signature(model.forward).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in own.values()):
        return set(own)
    named = {n for n, p in own.items() if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}
    return named | (set(inspect.signature(type(model).forward).parameters) - {"self"})


def check_draft(model) -> None:
    """Raise UnsupportedDraftError unless the drafter can crop, batch and mask `model`'s KV cache."""
    name = type(model).__name__
    why = stateful_reason(model)
    if why is None:
        params = forward_params(model)
        supports = getattr(model, "_supports_default_dynamic_cache", None)
        if not ({"cache", "past_key_values"} & set(params)) or (callable(supports) and not supports()):
            why = f"{name} does not take a transformers DynamicCache"
        elif "attention_mask" not in params:
            why = f"{name}'s forward takes no attention_mask (the drafter masks the columns each branch hides)"
        else:
            try:
                layers = DynamicCache(config=model.config).layers
            except Exception as exc:  # a config DynamicCache cannot describe
                layers, why = [], f"its DynamicCache cannot be built from its config ({exc})"
            odd = sorted({type(layer).__name__ for layer in layers if type(layer) not in _DRIVABLE_LAYERS})
            if odd:
                why = (
                    f"{name}'s cache has {', '.join(odd)} layers (only full-attention and sliding-window KV layers "
                    "can be cropped and batched)"
                )
    if why is not None:
        raise UnsupportedDraftError(
            f"SSD needs a draft model whose KV cache it can crop and batch (full-attention or sliding-window "
            f"layers); {why}. Use a transformer draft of the target's family (e.g. Llama, Qwen, Mistral, Gemma)."
        )


def new_cache() -> DynamicCache:
    """A cache of plain full layers (sliding layers included: their window lives in the mask, see above)."""
    return DynamicCache()


class SequenceView:
    """The draft's view of the caller's `attention_mask`: which prompt columns are masked, and positions.

    Positions follow transformers' rule for generate (`cumsum(mask) - 1`), so with left padding the draft sees
    the same positions as the target. Tokens after the prompt are never masked.
    """

    def __init__(self, prompt_mask: torch.Tensor | None, device):
        self.device = device
        mask = None if prompt_mask is None else prompt_mask.reshape(-1).to(device=device, dtype=torch.long)
        if mask is not None and bool(mask.all()):
            mask = None  # nothing masked: plain positions, no mask needed on the trunk
        self.prompt = mask
        self.n_masked = 0 if mask is None else int((mask == 0).sum())

    @property
    def padded(self) -> bool:
        return self.prompt is not None

    def valid(self, n: int) -> torch.Tensor:
        """[n] long: 1 for columns the draft attends to, 0 for the caller's masked prompt columns."""
        out = torch.ones(n, dtype=torch.long, device=self.device)
        if self.prompt is not None:
            m = min(n, self.prompt.numel())
            out[:m] = self.prompt[:m]
        return out

    def positions(self, start: int, stop: int) -> torch.Tensor:
        """[stop - start] long position ids of sequence indices start..stop-1."""
        if self.prompt is None:
            return torch.arange(start, stop, device=self.device)
        valid = self.valid(stop)
        pos = valid.cumsum(0) - 1
        return pos.masked_fill(valid == 0, 1)[start:stop]

    def shift(self) -> int:
        """Position = sequence index - shift, for every index after the prompt."""
        return self.n_masked
