"""Plugging SSD into `model.generate`: `enable`, `disable`, the generate wrapper, and input validation.

`enable(model)` puts two instance attributes on the model and nothing else: a `generate` that accepts
`ssd_config=` and a `_get_candidate_generator` that builds the SSD generator while such a call is active.
transformers looks `_get_candidate_generator` up on the instance, so the class, other models and the
saved configs are untouched; `disable(model)` deletes both attributes.

The one class-level change: `GenerationMixin._validate_model_kwargs` is wrapped so that `ssd_config=` on a
model that was never enabled raises an error naming `hf_ssd.enable` instead of transformers' generic
"model_kwargs are not used". It changes nothing else (that call fails either way).
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
import types
import weakref

import torch
from transformers import GenerationMixin
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria

from .config import SSDConfig
from .drafting.kvcache import check_draft, stateful_reason
from .drafting.matmul import draft_matmul, verify_matmul
from .drafting.probe import probe_draft
from .layouts import resolve_layout, thread_settings
from .loop import batch as batch_loop
from .loop.assisted import SSDCandidateGenerator
from .scheduling.costs import cost_model_for
from .stats import SSDStats

logger = logging.getLogger("hf_ssd")

_MARK = "_hf_ssd_enabled"
_active = threading.local()  # .call: the SSD call in progress on this thread (model, config, layout, ...)
_last_stats: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> SSDStats
_stats_lock = threading.Lock()


class SSDUsageError(ValueError):
    """`generate` was called with an SSD setting it cannot honour; the message says what to change."""


def enable(model):
    """Let `model.generate` (and pipelines using it) accept `ssd_config=SSDConfig(...)`. Idempotent."""
    if not callable(getattr(model, "generate", None)) or not hasattr(model, "_get_candidate_generator"):
        raise SSDUsageError(
            f"hf_ssd.enable() needs a transformers model that can generate (a *ForCausalLM with "
            f"GenerationMixin); got {type(model).__name__}."
        )
    if getattr(model, _MARK, False):
        return model
    # Bound methods, not closures: copy.deepcopy rebinds them to the copy, so a copied model runs itself.
    model.generate = types.MethodType(_generate, model)
    model._get_candidate_generator = types.MethodType(_get_candidate_generator, model)
    setattr(model, _MARK, True)
    return model


@functools.wraps(GenerationMixin.generate)
def _generate(self, *args, ssd_config: SSDConfig | None = None, **kwargs):
    if ssd_config is None:
        return type(self).generate(self, *args, **kwargs)
    return _ssd_generate(self, ssd_config, args, kwargs)


def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                             assistant_model=None, **kwargs):
    call = getattr(_active, "call", None)
    if call is None or call["model"] is not self:
        return type(self)._get_candidate_generator(
            self, generation_config=generation_config, input_ids=input_ids, inputs_tensor=inputs_tensor,
            logits_processor=logits_processor, model_kwargs=model_kwargs, assistant_model=assistant_model, **kwargs,
        )
    config = call["config"]

    def costs(top_k: int):  # the estimates of this pair, kept across calls
        return cost_model_for(self, assistant_model, assistant_model.device, call["layout"],
                              bool(generation_config.do_sample), top_k, config.initial_acceptance,
                              config.draft_matmul, "stock")  # transformers' assisted loop: its own verify

    gen = SSDCandidateGenerator(
        assistant_model, config, generation_config, logits_processor, call["layout"],
        out_vocab=self.config.get_text_config().vocab_size, cpu_threads=call["cpu_threads"], hooks=call["hooks"],
        prompt_mask=model_kwargs.get("attention_mask"),  # the caller's padding, which the draft must honour too
        costs=costs,
    )
    call["generator"] = gen
    return gen


def _hint_enable(validate):
    @functools.wraps(validate)
    def checked(self, model_kwargs, *args, **kwargs):
        if "ssd_config" in model_kwargs and not getattr(self, _MARK, False):
            raise SSDUsageError(
                f"generate() got ssd_config, but this {type(self).__name__} was not enabled for SSD: call "
                "hf_ssd.enable(model) once before model.generate(..., ssd_config=...)."
            )
        return validate(self, model_kwargs, *args, **kwargs)

    checked._hf_ssd_hint = True
    return checked


if not getattr(GenerationMixin._validate_model_kwargs, "_hf_ssd_hint", False):
    GenerationMixin._validate_model_kwargs = _hint_enable(GenerationMixin._validate_model_kwargs)


def disable(model):
    """Undo `enable`: the model's generate is transformers' own again. Safe to call on any model."""
    if getattr(model, _MARK, False):
        for name in ("generate", "_get_candidate_generator", _MARK):
            model.__dict__.pop(name, None)
    return model


def is_enabled(model) -> bool:
    return bool(getattr(model, _MARK, False))


def last_stats(model) -> SSDStats | None:
    """Statistics of the latest SSD `generate` call on `model` (any thread)."""
    with _stats_lock:
        return _last_stats.get(model)


def _ssd_generate(model, config: SSDConfig, args, kwargs):
    start = time.perf_counter()  # what the caller waits for: the checks and a first call's draft probe too
    if not isinstance(config, SSDConfig):
        hint = " Build one from the dict: ssd_config=hf_ssd.SSDConfig(**d)." if isinstance(config, dict) else ""
        raise SSDUsageError(f"ssd_config must be an hf_ssd.SSDConfig, got {type(config).__name__}.{hint}")
    config.validate()
    draft = kwargs.get("assistant_model")
    hooks = kwargs.pop("_ssd_hooks", None)
    rows = _batch_size(args, kwargs)
    # Every batch size runs hf_ssd's loop (loop/batch.py), one prompt included. One prompt runs transformers'
    # assisted loop with hf_ssd's candidate generator (loop/assisted.py) only for what the loop lacks: the
    # one-prompt settings (`_one_prompt_config`: the static draft, CUDA graphs), the static draft a CUDA draft
    # gets by default (graphs: `_static_draft`), and a prompt ending in a masked column (`_right_padded`). The
    # `loop` hook picks a path ("batch" or "assisted"; tests, benchmarks).
    route = (hooks or {}).get("loop")
    batch_path = rows > 1 or route == "batch" or (route != "assisted" and not _one_prompt_config(config)
                                                  and not _static_draft(config, draft)
                                                  and not _right_padded(model, args, kwargs))
    _validate_call(model, draft, args, kwargs, batch_path)
    if not batch_path and config.verify_matmul == "transposed" and _one_prompt_config(config):
        # (A prompt ending in a masked column also runs that loop; its verify then keeps transformers' product.)
        raise SSDUsageError(
            "SSDConfig(verify_matmul='transposed') acts in hf_ssd's loop, and this call runs transformers' assisted "
            f"loop for one prompt ({', '.join(_one_prompt_config(config))}), whose verify keeps transformers' "
            "product. Remove verify_matmul or those settings.")
    layout = resolve_layout(config.layout, model, draft)
    if batch_path:
        _check_batch_config(config, rows)
        _check_padding(model, args, kwargs)
    probe_draft(draft)  # last: a few tiny draft forwards, once per draft model
    if batch_path:
        return _batched_generate(model, draft, config, args, kwargs, start, layout, hooks)
    call = {"model": model, "config": config, "layout": layout, "hooks": hooks, "generator": None,
            "cpu_threads": None}
    if getattr(_active, "call", None) is not None:
        raise SSDUsageError("generate(ssd_config=...) is not re-entrant on one thread.")
    with thread_settings(layout, config, model) as cpu_threads, draft_matmul(draft, config.draft_matmul, model):
        call["cpu_threads"] = cpu_threads
        _active.call = call
        setup = time.perf_counter() - start
        try:
            out = type(model).generate(model, *args, **kwargs)
        except BaseException as err:
            try:
                _close(call, raise_pending=False)
            except BaseException as close_err:  # noqa: BLE001 - the error already propagating is the one to report
                logger.error("hf_ssd: closing the speculator after %s also failed: %r", type(err).__name__, close_err)
            raise
        _close(call, raise_pending=True)  # a failure of the last (unused) speculation job still surfaces
    gen = call["generator"]
    stats = gen.stats if gen is not None else SSDStats(layout=layout)
    stats.setup_time = setup
    if gen is not None:
        stats.finalize((start, time.perf_counter()), gen.verify_intervals, gen.draft_intervals + gen.speculator.busy)
        stats.intervals = {
            "verify": gen.verify_intervals,
            "speculate": gen.speculator.busy,
            "fallback": gen.draft_intervals,
        }
    with _stats_lock:
        _last_stats[model] = stats
    _warn_hit_rate(config, stats)
    if hasattr(out, "sequences"):
        out.ssd_stats = stats
    return out


def _batched_generate(model, draft, config: SSDConfig, args, kwargs, start: float, layout: str, hooks):
    """hf_ssd's own loop (loop/batch.py), any batch size, as transformers' `custom_generate`: transformers
    prepares the inputs, processors and stopping criteria, and the loop runs AR, SD or SSD rounds over all rows."""
    stats = SSDStats(layout=layout, schedule=config.schedule, draft_path="batched")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("assistant_model", "assistant_tokenizer")}
    streamer = kwargs.pop("streamer", None)
    _stop_strings_as_criteria(model, kwargs)
    if getattr(_active, "call", None) is not None:
        raise SSDUsageError("generate(ssd_config=...) is not re-entrant on one thread.")
    stats.setup_time = time.perf_counter() - start
    _active.call = {"model": model}
    try:
        with thread_settings(layout, config, model) as cpu_threads, draft_matmul(draft, config.draft_matmul, model), \
                verify_matmul(model, config.verify_matmul):
            # transformers hands a callable neither the draft nor the streamer: the loop gets them bound.
            decode = functools.partial(batch_loop.decode, ssd_draft=draft, ssd_config=config, ssd_stats=stats,
                                       ssd_layout=layout, ssd_hooks=hooks, ssd_streamer=streamer,
                                       ssd_cpu_threads=cpu_threads)
            out = type(model).generate(model, *args, custom_generate=decode, **kwargs)
    finally:
        _active.call = None
    iv = stats.intervals  # the loop's (loop/batch.py `_record`) or plain decoding's
    stats.finalize((start, time.perf_counter()), iv.get("verify", []), iv.get("fallback", []) + iv.get("speculate", []))
    with _stats_lock:
        _last_stats[model] = stats
    _warn_hit_rate(config, stats)
    if hasattr(out, "sequences"):
        out.ssd_stats = stats
    return out


def _stop_strings_as_criteria(model, kwargs) -> None:
    """transformers gives a `custom_generate` callable's stopping criteria no tokenizer (it takes the caller's out
    before it builds them), so stop strings would fail there: they go in as the criterion transformers would build."""
    passed = kwargs.get("generation_config")
    strings = kwargs.get("stop_strings") or getattr(passed or model.generation_config, "stop_strings", None)
    if not strings or kwargs.get("tokenizer") is None:
        return  # none, or transformers' own error (stop strings need the tokenizer)
    kwargs["stopping_criteria"] = StoppingCriteriaList(
        [*(kwargs.get("stopping_criteria") or []), StopStringCriteria(kwargs["tokenizer"], strings)])
    kwargs.pop("stop_strings", None)
    if getattr(passed or model.generation_config, "stop_strings", None):
        kwargs["generation_config"] = copy.deepcopy(passed or model.generation_config)
        kwargs["generation_config"].stop_strings = None


def _warn_hit_rate(config: SSDConfig, stats: SSDStats) -> None:
    """The warning of a call whose speculation cache hit less than `config.hit_rate_warning` of its lookups."""
    if (
        config.hit_rate_warning > 0
        and stats.lookups >= 4
        and stats.hit_rate < config.hit_rate_warning
    ):
        if config.schedule == "auto":
            advice = (f"The scheduler measured this and ran: {stats.schedule_summary()} (rounds by option: "
                      f"{_option_rounds(stats)}). A draft closer to the target raises the hit rate.")
        else:
            advice = ("Try a larger fanout_budget, a smaller gamma, a draft closer to the target, or "
                      "schedule='auto' (the default), which picks the fan-out and falls back to plain speculative "
                      "decoding when speculation does not pay.")
        logger.warning(
            "hf_ssd: speculation cache hit rate %.0f%% is under %.0f%% (%d/%d). %s",
            100 * stats.hit_rate, 100 * config.hit_rate_warning, stats.cache_hits, stats.lookups, advice,
        )


def _option_rounds(stats: SSDStats) -> str:
    return ", ".join(f"{name} {rounds}" for name, rounds, _ in stats.option_shares())


def _close(call: dict, raise_pending: bool) -> None:
    """Stop the speculator (background work never outlives generate) and leave this thread's call."""
    _active.call = None
    gen = call["generator"]
    if gen is not None:
        try:
            gen.close()
        finally:
            pending = gen.speculator.take_pending()  # never left behind: the next call starts clean
        if raise_pending and pending is not None:
            raise pending


def _validate_call(model, draft, args, kwargs, batch_path: bool) -> None:
    if draft is None:
        raise SSDUsageError(
            "ssd_config needs a draft model: call generate(..., assistant_model=draft, ssd_config=...). "
            "SSD pre-drafts with the assistant model while the target verifies."
        )
    atok = kwargs.get("assistant_tokenizer")
    if atok is not None and not _same_tokenizer(atok, kwargs.get("tokenizer"), model, draft):
        raise SSDUsageError(
            "SSD needs the draft and the target to share one tokenizer; remove assistant_tokenizer (universal "
            "assisted generation across tokenizers is not supported with ssd_config)."
        )
    if kwargs.get("inputs_embeds") is not None:
        raise SSDUsageError(
            "SSD drafts from token ids; pass input_ids instead of inputs_embeds (the draft has its own embeddings)."
        )
    gen_config = kwargs.get("generation_config") or model.generation_config
    merged = {k: kwargs.get(k, getattr(gen_config, k, None)) for k in (
        "num_beams", "num_return_sequences", "penalty_alpha", "prompt_lookup_num_tokens", "num_beam_groups",
        "do_sample", "assistant_early_exit", "assistant_ensemble_weight", "use_cache",
    )}
    if merged["use_cache"] is False:
        if kwargs.get("use_cache") is False:
            raise SSDUsageError("SSD verifies and drafts with KV caches; remove use_cache=False.")
        # Not the caller's argument: the generation config says so (e.g. MptConfig defaults to use_cache=False),
        # and transformers' assisted decoding would stop with "Assisted decoding requires a cache".
        if kwargs.get("generation_config") is not None:
            where = "the generation_config passed"
        elif getattr(model.config, "use_cache", None) is False:
            where = f"the target's generation_config (from {type(model.config).__name__}, whose use_cache is False)"
        else:
            where = "the target's generation_config (model.generation_config.use_cache)"
        raise SSDUsageError(
            f"SSD verifies and drafts with KV caches, but use_cache=False comes from {where}; pass use_cache=True "
            "to generate (or set model.generation_config.use_cache = True)."
        )
    if (merged["num_beams"] or 1) > 1:
        raise SSDUsageError("SSD supports greedy and sampling only; beam search (num_beams > 1) is not supported.")
    if (merged["num_return_sequences"] or 1) > 1:
        raise SSDUsageError("SSD returns one sequence per call; set num_return_sequences=1 (or loop over calls).")
    if merged["penalty_alpha"]:
        raise SSDUsageError("Contrastive search (penalty_alpha) is not supported with ssd_config.")
    if merged["prompt_lookup_num_tokens"] or merged["assistant_early_exit"]:
        raise SSDUsageError(
            "prompt_lookup_num_tokens / assistant_early_exit pick another candidate generator; for n-gram "
            "lookup use SSDConfig(fallback='ngram') instead."
        )
    if merged["assistant_ensemble_weight"] is not None:
        raise SSDUsageError(
            "assistant_ensemble_weight relaxes verification (not lossless); SSD keeps the target's exact output. "
            "Remove assistant_ensemble_weight."
        )
    rows = _batch_size(args, kwargs)
    if rows > 1 and kwargs.get("streamer") is not None:
        raise SSDUsageError(f"A streamer takes one sequence; this batch has {rows}. Remove streamer= (or "
                            "generate the prompts one at a time to stream each).")
    if rows > 1:
        asked = _internals_asked(model, kwargs)
        if asked:
            raise SSDUsageError(f"Batched SSD calls (here {rows} sequences) return sequences, scores and logits "
                                f"only; remove {', '.join(asked)} (or generate one prompt at a time, which returns "
                                "them).")
    if model.config.is_encoder_decoder:
        raise SSDUsageError("SSD supports decoder-only models; encoder-decoder models are not supported.")
    why = stateful_reason(model)
    if why is not None:
        raise SSDUsageError(f"SSD cannot use this target: {why}. Use a transformer (attention) target.")
    check_draft(draft)
    if _check_vocab(model, draft, kwargs.get("tokenizer")):
        # transformers' generate only lets vocabularies of two sizes through with both tokenizers given (it
        # then expects universal assisted decoding, which SSD's generator replaces): the draft's is the same one.
        kwargs.setdefault("assistant_tokenizer", kwargs["tokenizer"])
    t_eos, d_eos = _eos(model), _eos(draft)
    if t_eos and d_eos and t_eos.isdisjoint(d_eos):
        raise SSDUsageError(
            f"Draft and target disagree on the end-of-sequence token (draft {sorted(d_eos)}, target "
            f"{sorted(t_eos)}): they do not share a tokenizer. Pick a draft of the same model family."
        )


# SSDConfig fields that only single-prompt calls use (the static draft path and its CUDA graphs), with their
# defaults: a batch refuses other values rather than ignore them.
_ONE_PROMPT_ONLY = {"static_draft": None, "cuda_graphs": None}


def _one_prompt_config(config: SSDConfig) -> list[str]:
    """The settings of `config` that only the single-prompt path serves."""
    return [f"{name}={getattr(config, name)!r}" for name, default in _ONE_PROMPT_ONLY.items()
            if getattr(config, name) != default]


def _static_draft(config: SSDConfig, draft) -> bool:
    """Whether one prompt's draft takes the static path (and CUDA graphs), which only the single-prompt path
    drafts with: by default a CUDA draft, where eager steps are bound by kernel launches and the interpreter."""
    device = getattr(draft, "device", None)
    return config.resolved_draft_path(getattr(device, "type", None) == "cuda")[0]


def _internals_asked(model, kwargs) -> list[str]:
    """Per-step model internals asked for, which one prompt returns and batches refuse (a padded batch's padding
    columns and finished rows hold what transformers' own loop computes there, which hf_ssd's never computes)."""
    gen_config = kwargs.get("generation_config") or model.generation_config
    return [k for k in ("output_attentions", "output_hidden_states") if kwargs.get(k, getattr(gen_config, k, False))]


def _prompt_mask(model, args, kwargs) -> torch.Tensor | None:
    """The prompt's attention mask as transformers will use it (bool [rows, columns]): the one passed, else inferred
    from pad tokens where transformers infers it (a pad token in the inputs that is not an EOS token); None where
    every column is attended."""
    inputs = kwargs.get("input_ids", args[0] if args else kwargs.get("inputs"))
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2:
        return None
    mask = kwargs.get("attention_mask")
    if mask is not None:
        return mask.bool()
    gen_config = kwargs.get("generation_config") or model.generation_config
    pad = kwargs.get("pad_token_id", getattr(gen_config, "pad_token_id", None))
    eos = kwargs.get("eos_token_id", getattr(gen_config, "eos_token_id", None))
    if pad is None:
        return None
    pad = int(torch.as_tensor(pad).flatten()[0])
    if eos is not None and pad in torch.as_tensor(eos).flatten().tolist():
        return None
    return inputs != pad


def _right_padded(model, args, kwargs) -> list[int]:
    """The rows whose last column the prompt's attention mask (`_prompt_mask`) masks after an attended one (right
    padding, or a prompt ending in the pad token). transformers continues such a row from that masked column's
    query; the loop drops masked columns, which is exact for a masked column inside a prompt (both skip it), not
    for a last one."""
    mask = _prompt_mask(model, args, kwargs)
    if mask is None:
        return []
    return [i for i, row in enumerate(mask.tolist()) if any(row) and not row[-1]]


def _check_padding(model, args, kwargs) -> None:
    """A batch must be left-padded: a right-padded row (`_right_padded`) is continued by transformers from its
    padding column's query, and differently by the same row alone, so no output can equal both. (One such prompt
    alone runs the one-prompt path, which repeats transformers.)"""
    right = _right_padded(model, args, kwargs)
    if right:
        raise SSDUsageError(
            f"Rows {right} of this batch end in masked (padding) columns: the batch is right-padded, and a decoder-only "
            "model continues each row from its last column. Pad on the left: tokenizer.padding_side = 'left' "
            "(pipelines do so themselves)."
        )


def _check_batch_config(config: SSDConfig, rows: int) -> None:
    odd = _one_prompt_config(config)
    if odd:
        raise SSDUsageError(
            f"{', '.join(odd)}: {'this setting serves' if len(odd) == 1 else 'these settings serve'} one prompt at "
            f"a time, and this call has a batch of {rows}. Leave {'it' if len(odd) == 1 else 'them'} at the default "
            "for batches (gamma, the fan-out, max_outcomes, cache_size, fallback, saguaro_c, layout and schedule "
            "apply), or generate the prompts one at a time."
        )


def _batch_size(args, kwargs) -> int:
    inputs = kwargs.get("input_ids", args[0] if args else kwargs.get("inputs"))
    return int(inputs.shape[0]) if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 else 1


def _same_tokenizer(a, b, model, draft) -> bool:
    """assistant_tokenizer is only served when it is the target's tokenizer and the sizes differ by padding."""
    if b is None or model.config.get_text_config().vocab_size == draft.config.get_text_config().vocab_size:
        return False  # equal sizes: transformers refuses assistant_tokenizer too; say it first
    if a is b:
        return True
    try:
        return len(a) == len(b) and a.get_vocab() == b.get_vocab()
    except (AttributeError, TypeError):
        return False


def _check_vocab(model, draft, tokenizer) -> bool:
    """Equal vocabulary sizes (False), or sizes that differ only by embedding padding beyond the caller's
    tokenizer (True); anything else is refused."""
    t_vocab = model.config.get_text_config().vocab_size
    d_vocab = draft.config.get_text_config().vocab_size
    if t_vocab == d_vocab:
        return False
    # Checkpoints often pad the embedding to a multiple of 64/128 (Qwen2.5-7B: 152064 rows, 0.5B: 151936). The
    # configs alone cannot tell padding from another vocabulary; the shared tokenizer can: every id it produces
    # is below both sizes, so both models cover the same ids.
    n_tok = len(tokenizer) if tokenizer is not None and hasattr(tokenizer, "__len__") else None
    if n_tok is not None and n_tok <= min(t_vocab, d_vocab):
        return True
    if n_tok is None:
        hint = (
            "If both use one tokenizer and only the embedding padding differs (e.g. Qwen2.5-7B vs 0.5B), pass it "
            "as generate(..., tokenizer=tokenizer); otherwise pick a draft of the same model family."
        )
    else:
        hint = (
            f"The tokenizer passed has {n_tok} tokens, more than the smaller model covers, so this is not just "
            "padding. Pick a draft of the same model family."
        )
    raise SSDUsageError(
        f"Draft and target vocabularies differ (draft {d_vocab} vs target {t_vocab} tokens): SSD needs a draft "
        f"that shares the target's tokenizer. {hint}"
    )


def _eos(model) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
