"""A SYNTHETIC draft/target pair at realistic sizes, built from configs (no downloads), for timing layouts.

The models are Llamas with the shapes of real checkpoints (e.g. Llama-3.2-1B as the draft, Llama-3.1-8B as
the target), so every forward costs what the real one costs; the weights are random, so the text is
meaningless. Only speed and the SSD statistics of such a pair mean anything: every string that reports on it
says SYNTHETIC.

How the draft is made to agree with the target (`agreement`):

- Both models share one "bigram" backbone: the draft's token embedding E and LM head H (untied) are copied
  into the first `hidden_size(draft)` coordinates of the target's (the target's other embedding coordinates
  are zero, its head's other columns random). With every residual branch switched off, both models compute
  logits = H . rmsnorm(E[token]) up to a positive factor, so both pick the same argmax for every context.
- Every residual branch (attention `o_proj` and MLP `down_proj`) is scaled by `residual_scale / sqrt(layers)`:
  the branches make each model's prediction depend on the context, in a different, random way per model.
  At scale 0 the draft agrees with the target everywhere; as the scale grows the two drift apart towards
  chance (1 / vocab).
- `agreement` is the per-token probability that the draft's argmax equals the target's argmax, measured
  teacher-forced on random token contexts. `synthetic_pair` finds the `residual_scale` that gives it by
  bisection on log(scale) (a few batched forwards of each model; well under a second on a GPU for 1B/8B).
  In speculative decoding with draft length gamma, a per-token agreement p gives an expected acceptance rate
  (accepted / proposed) of about (p + p^2 + ... + p^gamma) / gamma if the tokens were independent.

The end-of-sequence, padding and beginning-of-sequence rows of the LM head are zero, so those tokens never win
the argmax: greedy runs always produce `max_new_tokens` tokens, which keeps timings comparable.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

LABEL = "SYNTHETIC"

# Shapes of real checkpoints (compute-faithful) plus two small ones for CPU.
SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),  # Llama-3.2-1B
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8),  # Llama-3.2-3B
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),  # Llama-3.1-8B
}
# Pair names used by scripts: "<draft>-<target>", or an alias.
PAIR_ALIASES = {"tiny": ("tiny", "small")}

PAD, BOS, EOS = 0, 1, 2
FIRST_TEXT_TOKEN = 3  # random prompts use ids from here on


@dataclass
class SyntheticInfo:
    """How a synthetic pair was built; attached to both models as `model.synthetic_info`."""

    target_shape: str
    draft_shape: str
    vocab_size: int
    dtype: str
    device: str
    seed: int
    requested_agreement: float | None
    measured_agreement: float
    residual_scale: float
    logit_scale: float
    init_seconds: float
    calibration_seconds: float

    def describe(self) -> str:
        req = "n/a" if self.requested_agreement is None else f"{self.requested_agreement:.2f}"
        return (
            f"{LABEL} pair (random weights, meaningless text; timing and SSD statistics only): "
            f"target {self.target_shape}, draft {self.draft_shape}, vocab {self.vocab_size}, {self.dtype} on "
            f"{self.device}; agreement requested {req}, measured {self.measured_agreement:.3f} "
            f"(teacher-forced greedy argmax on random tokens), residual scale {self.residual_scale:.4g}"
        )

    def to_dict(self) -> dict:
        return {"label": LABEL, **asdict(self)}


def parse_pair(name: str) -> tuple[str, str]:
    """"1b-8b" -> ("1b", "8b") as (draft shape, target shape); "tiny" -> ("tiny", "small")."""
    if name in PAIR_ALIASES:
        return PAIR_ALIASES[name]
    parts = name.split("-")
    if len(parts) != 2 or any(p not in SHAPES for p in parts):
        raise ValueError(
            f"Unknown synthetic pair {name!r}: use one of {sorted(PAIR_ALIASES)} or '<draft>-<target>' with shapes "
            f"from {sorted(SHAPES)} (e.g. '1b-8b')."
        )
    return parts[0], parts[1]


def shape_config(shape: str, vocab_size: int) -> LlamaConfig:
    if shape not in SHAPES:
        raise ValueError(f"Unknown synthetic shape {shape!r}; choose from {sorted(SHAPES)}.")
    return LlamaConfig(
        **SHAPES[shape],
        vocab_size=vocab_size,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,  # a tied head would make every token predict itself
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _no_init():
    """Skip transformers' own weight init: we overwrite every parameter anyway (it would double the time)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        return contextlib.nullcontext()
    return no_init_weights()


def _empty_model(shape: str, vocab_size: int, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    config = shape_config(shape, vocab_size)
    # Parameters are allocated directly on the device in the final dtype: an 8B model never touches CPU RAM.
    with _no_init(), torch.device(device), _default_dtype(dtype):
        model = LlamaForCausalLM(config)
    if any(p.dtype != dtype or p.device != device for p in model.parameters()):
        model.to(device=device, dtype=dtype)  # only if the context managers were ignored
    model.eval()
    model.config.name_or_path = f"{LABEL}-llama-{shape}"
    model.generation_config.pad_token_id = PAD
    model.generation_config.bos_token_id = BOS
    model.generation_config.eos_token_id = EOS
    return model


def _is_branch_out(name: str) -> bool:
    return name.endswith("o_proj.weight") or name.endswith("down_proj.weight")


@torch.no_grad()
def _init_layers(model, gen: torch.Generator) -> None:
    """Unit-gain random init of the decoder layers; norms at 1; branch outputs at scale 1 (rescaled later)."""
    for p in model.model.layers.parameters():
        if p.dim() == 1:
            p.fill_(1.0)  # RMSNorm weights
        else:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=gen)
    model.model.norm.weight.fill_(1.0)


def _set_residual_scale(model, old: float, new: float) -> None:
    """Rescale every residual branch output from total scale `old` to `new` (both / sqrt(layers))."""
    if old == new:
        return
    with torch.no_grad():
        for name, p in model.model.layers.named_parameters():
            if _is_branch_out(name):
                p.mul_(new / old)


@torch.no_grad()
def measure_agreement(target, draft, n_seqs: int = 8, seq_len: int = 64, seed: int = 0) -> float:
    """Share of positions where draft and target pick the same greedy token, teacher-forced on random tokens."""
    device = next(target.parameters()).device
    vocab = target.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(FIRST_TEXT_TOKEN, vocab, (n_seqs, seq_len), generator=g).to(device)
    d_ids = ids.to(next(draft.parameters()).device)
    t_arg = target(input_ids=ids, use_cache=False).logits.argmax(-1)
    d_arg = draft(input_ids=d_ids, use_cache=False).logits.argmax(-1).to(t_arg.device)
    return float((t_arg == d_arg).float().mean())


def synthetic_pair(
    target_shape: str = "8b",
    draft_shape: str = "1b",
    agreement: float | None = 0.8,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    seed: int = 0,
    vocab_size: int = 32000,
    residual_scale: float = 1.0,
    logit_scale: float = 4.0,
    calibration_tokens: int | None = None,
) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """Build a SYNTHETIC (target, draft) pair of LlamaForCausalLM with the given shapes and agreement.

    Args:
        target_shape, draft_shape: keys of `SHAPES` ("tiny", "small", "1b", "3b", "8b"); the draft may not be
            wider than the target.
        agreement: per-token greedy agreement to calibrate to, in (0, 1]; `None` keeps `residual_scale`.
        dtype, device: where the weights are created (directly, without a CPU copy).
        seed: all weights and the calibration contexts derive from it.
        vocab_size: shared vocabulary size (>= 4).
        residual_scale: total residual-branch scale when `agreement` is None (ignored otherwise).
        logit_scale: standard deviation of the backbone's logits (how peaked the distributions are).
        calibration_tokens: teacher-forced positions per calibration measurement (default 1024 on GPU, 256 on
            CPU, where a measurement of the 'small' target takes a fraction of a second).

    Both models get `synthetic_info` (a `SyntheticInfo`; `.describe()` is a one-line SYNTHETIC label).
    """
    if vocab_size < 4:
        raise ValueError("vocab_size must be at least 4 (pad, bos, eos and one text token).")
    if agreement is not None and not 0.0 < agreement <= 1.0:
        raise ValueError(f"agreement must be in (0, 1] or None, got {agreement}.")
    for shape in (target_shape, draft_shape):
        if shape not in SHAPES:
            raise ValueError(f"Unknown synthetic shape {shape!r}; choose from {sorted(SHAPES)}.")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    hd, ht = SHAPES[draft_shape]["hidden_size"], SHAPES[target_shape]["hidden_size"]
    if hd > ht:
        raise ValueError(f"The draft ({draft_shape}, hidden {hd}) must not be wider than the target "
                         f"({target_shape}, hidden {ht}).")
    t0 = time.perf_counter()
    target = _empty_model(target_shape, vocab_size, dtype, device)
    draft = _empty_model(draft_shape, vocab_size, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        # The shared backbone: draft embedding and head, copied into the target's first hd coordinates.
        e_d, h_d = draft.model.embed_tokens.weight, draft.lm_head.weight
        e_d.normal_(0.0, 1.0, generator=gen)
        h_d.normal_(0.0, logit_scale / math.sqrt(hd), generator=gen)
        h_d[[PAD, BOS, EOS]] = 0.0  # never the argmax: runs are never cut short
        e_t, h_t = target.model.embed_tokens.weight, target.lm_head.weight
        e_t.zero_()
        e_t[:, :hd] = e_d
        # rmsnorm over ht of [e, 0] is sqrt(ht / hd) times rmsnorm over hd of e: scale the head to match.
        h_t.normal_(0.0, logit_scale / math.sqrt(ht), generator=gen)
        h_t[:, :hd] = h_d * math.sqrt(hd / ht)
        h_t[[PAD, BOS, EOS]] = 0.0
        _init_layers(draft, gen)
        _init_layers(target, gen)
    # Branch outputs are at unit gain per layer; bring them to residual_scale / sqrt(layers).
    for m in (target, draft):
        _set_residual_scale(m, 1.0, residual_scale / math.sqrt(m.config.num_hidden_layers))
    scale = residual_scale
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t1 = time.perf_counter()

    if calibration_tokens is None:
        calibration_tokens = 1024 if device.type == "cuda" else 256
    n_seqs = max(1, calibration_tokens // 64)

    def rescale(new: float) -> float:
        nonlocal scale
        for m in (target, draft):
            layers = math.sqrt(m.config.num_hidden_layers)
            _set_residual_scale(m, scale / layers, new / layers)
        scale = new
        return measure_agreement(target, draft, n_seqs=n_seqs, seq_len=64, seed=seed + 1)

    if agreement is None:
        measured = measure_agreement(target, draft, n_seqs=n_seqs, seq_len=64, seed=seed + 1)
    else:
        # Agreement falls as the scale grows: bisect log(scale) between "identical" and "independent".
        lo, hi = math.log(1e-4), math.log(100.0)
        measured = rescale(math.exp(hi))
        if measured < agreement:
            for _ in range(10):  # log-scale precision 14 / 2^10: about 1.4% in scale
                mid = 0.5 * (lo + hi)
                if rescale(math.exp(mid)) >= agreement:
                    lo = mid
                else:
                    hi = mid
            measured = rescale(math.exp(lo))  # the largest scale that still reaches the agreement
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    info = SyntheticInfo(
        target_shape=target_shape, draft_shape=draft_shape, vocab_size=vocab_size,
        dtype=str(dtype).replace("torch.", ""), device=str(device), seed=seed, requested_agreement=agreement,
        measured_agreement=measured, residual_scale=scale, logit_scale=logit_scale,
        init_seconds=t1 - t0, calibration_seconds=t2 - t1,
    )
    target.synthetic_info = info
    draft.synthetic_info = info
    return target, draft


def random_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[torch.Tensor]:
    """n random prompts of `length` text tokens each, as [1, length] LongTensors on CPU."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(FIRST_TEXT_TOKEN, vocab_size, (1, length), generator=g) for _ in range(n)]
