"""Bad input: every rejected input fails early with its documented error type and a message that says what to
change. One test per row of docs/errors.md; a last test checks that every key phrase tested here is in the doc.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, make_model, noisy_copy
from transformers import (
    GenerationConfig,
    LlamaModel,
    MambaConfig,
    MambaForCausalLM,
    StoppingCriteria,
    StoppingCriteriaList,
    T5Config,
    T5ForConditionalGeneration,
)
from transformers.generation.streamers import BaseStreamer

import hf_ssd
from hf_ssd import LayoutError, SSDConfig, SSDConfigError, SSDUsageError
from hf_ssd.drafting.drafter import UnsupportedDraftError
from hf_ssd.models.fetch import FetchError, verify_file

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
PROMPT = torch.tensor([[5, 6, 7, 8]])

# Key phrases of the messages not in the tables below (those are CONFIG_CASES and USAGE_CASES).
MESSAGES = {
    "mutated_gamma": "SSDConfig.gamma must be between 1 and 64",
    "mutated_fallback_gamma": "SSDConfig.fallback_gamma must be between 1 and 4",
    "mutated_cache_size": "SSDConfig.cache_size must be >= 1",
    "batch_keyword": "Batched SSD calls (here 3 sequences) return sequences, scores and logits only; remove "
                     "output_attentions",
    "no_draft": "ssd_config needs a draft model",
    "right_padded": "end in masked (padding) columns: the batch is right-padded",
    "vocab": "Draft and target vocabularies differ (draft 100 vs target 96 tokens)",
    "eos": "Draft and target disagree on the end-of-sequence token",
    "encoder_decoder": "encoder-decoder models are not supported",
    "reentrant": "not re-entrant on one thread",
    "enable": "hf_ssd.enable() needs a transformers model that can generate",
    "stateful_draft": "SSD needs a draft model whose KV cache it can crop and batch",
    "stateful_target": "is a stateful (recurrent / state-space) model",
    "vocab_hint": "pass it as generate(..., tokenizer=tokenizer)",
    "vocab_tokenizer": "more than the smaller model covers, so this is not just padding",
    "config_no_cache": "use_cache=False comes from the target's generation_config",
    "stream_cpu": "layout='stream' needs the draft on a CUDA device",
    "device_shared": "layout='device' needs the draft on a device of its own",
    "draft_split": "SSD needs the draft on one device",
    "thread_cuda": "layout='thread' runs the speculator on CPU cores, but the draft is on CUDA",
    "stream_split": "layout='stream' needs draft and target on the same GPU",
    "not_enabled": "was not enabled for SSD: call hf_ssd.enable(model) once",
    "no_cache": "remove use_cache=False",
    "sha256": "sha256 mismatch",
    "size": "size mismatch",
}


def expect(exc_type, phrase: str):
    return pytest.raises(exc_type, match=re.escape(phrase))


# ----- SSDConfig: each field, bad values and bad types -----------------------------------------------------------

CONFIG_CASES = [
    # (field values, key phrase of the message)
    ({"gamma": 0}, "SSDConfig.gamma must be between 1 and 64"),
    ({"gamma": 65}, "SSDConfig.gamma must be between 1 and 64"),
    ({"gamma": "4"}, "SSDConfig.gamma must be an int"),
    ({"gamma": 4.0}, "SSDConfig.gamma must be an int"),
    ({"gamma": True}, "SSDConfig.gamma must be an int"),
    ({"fanout": "uniform"}, "SSDConfig.fanout must be one of ['geometric', 'calibrated']"),
    ({"fanout": [2, 1]}, "SSDConfig.fanout as a list needs gamma + 1 = 5 entries"),
    ({"fanout": [2, 1, 1, 1, -1]}, "SSDConfig.fanout[4] must be >= 0"),
    ({"fanout": [2, 1, 1, 1, 0.5]}, "SSDConfig.fanout[4] must be an int"),
    ({"fanout": 3}, "SSDConfig.fanout must be 'geometric', 'calibrated' or a list of ints"),
    ({"fanout": None}, "SSDConfig.fanout must be 'geometric', 'calibrated' or a list of ints"),
    ({"fanout_budget": -1}, "SSDConfig.fanout_budget must be between 0 and 4096"),
    ({"fanout_budget": 4097}, "SSDConfig.fanout_budget must be between 0 and 4096"),
    ({"fanout_budget": "8"}, "SSDConfig.fanout_budget must be an int"),
    ({"max_outcomes": -1}, "SSDConfig.max_outcomes must be between 0 and 4096"),
    ({"max_outcomes": 2.5}, "SSDConfig.max_outcomes must be an int"),
    ({"cache_size": 0}, "SSDConfig.cache_size must be >= 1"),
    ({"cache_size": 2.5}, "SSDConfig.cache_size must be an int"),
    ({"pipeline_depth": 2}, "SSDConfig.pipeline_depth was removed in hf_ssd 0.2.0"),
    ({"draft_matmul": "fast"}, "SSDConfig.draft_matmul must be one of ['auto', 'transposed', 'half', 'stock']"),
    ({"verify_matmul": "fast"}, "SSDConfig.verify_matmul must be one of ['auto', 'transposed', 'stock']"),
    ({"verify_matmul": "half"}, "SSDConfig.verify_matmul must be one of ['auto', 'transposed', 'stock']"),
    ({"eviction": "lru"}, "SSDConfig.eviction was removed in hf_ssd 0.2.0"),
    ({"fallback": "beam"}, "SSDConfig.fallback must be one of ['sd', 'short', 'ar', 'ngram']"),
    ({"fallback_gamma": 0}, "SSDConfig.fallback_gamma must be between 1 and 4"),
    ({"gamma": 4, "fallback_gamma": 5}, "SSDConfig.fallback_gamma must be between 1 and 4"),
    ({"fallback_gamma": 2.0}, "SSDConfig.fallback_gamma must be an int"),
    ({"fallback": "sd", "fallback_gamma": 2}, "SSDConfig.fallback_gamma is the draft length of fallback='short', but fallback is 'sd'"),
    ({"ngram_size": 0}, "SSDConfig.ngram_size must be between 1 and 32"),
    ({"ngram_size": 33}, "SSDConfig.ngram_size must be between 1 and 32"),
    ({"ngram_size": "3"}, "SSDConfig.ngram_size must be an int"),
    ({"saguaro_c": 1.0}, "SSDConfig.saguaro_c must be in [0, 1)"),
    ({"saguaro_c": -0.1}, "SSDConfig.saguaro_c must be in [0, 1)"),
    ({"saguaro_c": math.nan}, "SSDConfig.saguaro_c must be in [0, 1)"),
    ({"saguaro_c": "0.5"}, "SSDConfig.saguaro_c must be a float in [0, 1) or None"),
    ({"saguaro_c": True}, "SSDConfig.saguaro_c must be a float in [0, 1) or None"),
    ({"warmup_budget": 0.0}, "SSDConfig.warmup_budget must be a float in (0, 1]"),
    ({"warmup_budget": 2.0}, "SSDConfig.warmup_budget must be a float in (0, 1]"),
    ({"warmup_budget": "0.03"}, "SSDConfig.warmup_budget must be a float in (0, 1]"),
    ({"initial_acceptance": 1.5}, "SSDConfig.initial_acceptance must be a float in [0, 1]"),
    ({"initial_acceptance": -0.1}, "SSDConfig.initial_acceptance must be a float in [0, 1]"),
    ({"initial_acceptance": math.nan}, "SSDConfig.initial_acceptance must be a float in [0, 1]"),
    ({"initial_acceptance": "0.7"}, "SSDConfig.initial_acceptance must be a float in [0, 1]"),
    ({"hit_rate_warning": 2.0}, "SSDConfig.hit_rate_warning must be a float in [0, 1]"),
    ({"hit_rate_warning": None}, "SSDConfig.hit_rate_warning must be a float in [0, 1]"),
    ({"layout": "gpu"}, "SSDConfig.layout must be one of ['auto', 'thread', 'stream', 'device', 'inline']"),
    ({"layout": None}, "SSDConfig.layout must be one of"),
    ({"cpu_threads": 0}, "SSDConfig.cpu_threads must be between 1 and 1024"),
    ({"cpu_threads": 2.0}, "SSDConfig.cpu_threads must be an int"),
    ({"record_timeline": 1}, "SSDConfig.record_timeline must be a bool"),
    ({"record_timeline": "yes"}, "SSDConfig.record_timeline must be a bool"),
    ({"static_draft": 1}, "SSDConfig.static_draft must be True, False or None"),
    ({"cuda_graphs": "auto"}, "SSDConfig.cuda_graphs must be True, False or None"),
    ({"cuda_graphs": True, "static_draft": False}, "SSDConfig.cuda_graphs=True needs the static draft path"),
    ({"schedule": "adaptive"}, "SSDConfig.schedule must be one of ['auto', 'fixed']"),
    ({"schedule": None}, "SSDConfig.schedule must be one of"),
]


@pytest.mark.parametrize("values,phrase", CONFIG_CASES, ids=[str(v) for v, _ in CONFIG_CASES])
def test_invalid_config_value(values, phrase):
    with expect(SSDConfigError, phrase):
        SSDConfig(**values)


def test_every_config_field_has_a_rejection_case():
    fields = set(SSDConfig.__dataclass_fields__)
    covered = {name for values, _ in CONFIG_CASES for name in values}
    assert fields <= covered, f"fields without a bad-input case: {sorted(fields - covered)}"


def test_unknown_config_field_is_a_type_error_that_suggests_the_field():
    with pytest.raises(TypeError, match="unexpected keyword argument 'gama'. Did you mean 'gamma'"):
        SSDConfig(gama=4)
    with pytest.raises(SSDConfigError, match="Did you mean 'fanout_budget'"):
        SSDConfig(fanout_budjet=4)
    with pytest.raises(SSDConfigError, match="The fields are: gamma, "):  # nothing close: list them all
        SSDConfig(zzzz=1)


@pytest.mark.parametrize(
    "mutate,phrase",
    [
        (lambda c: setattr(c, "gamma", 0), MESSAGES["mutated_gamma"]),
        (lambda c: setattr(c, "fallback_gamma", 9), MESSAGES["mutated_fallback_gamma"]),
        (lambda c: setattr(c, "cache_size", 0), MESSAGES["mutated_cache_size"]),
    ],
)
def test_config_mutated_after_construction_is_checked_at_generate(target, draft, mutate, phrase):
    config = SSDConfig(gamma=4)
    mutate(config)
    with expect(SSDConfigError, phrase):
        target.generate(PROMPT, assistant_model=draft, max_new_tokens=4, ssd_config=config)


# ----- generate() calls SSD cannot honour ------------------------------------------------------------------------


def _gen(target, draft, **kw):
    kw.setdefault("max_new_tokens", 4)
    prompt = kw.pop("prompt", PROMPT)
    return target.generate(prompt, assistant_model=draft, ssd_config=kw.pop("ssd_config", SSDConfig()), **kw)


USAGE_CASES = {
    "config_not_ssdconfig": (
        {"ssd_config": {"gamma": 4}}, "got dict. Build one from the dict: ssd_config=hf_ssd.SSDConfig(**d)",
    ),
    "beam_search": ({"num_beams": 2}, "beam search (num_beams > 1) is not supported"),
    "beam_search_in_generation_config": (
        {"generation_config": GenerationConfig(num_beams=3, max_new_tokens=4)},
        "beam search (num_beams > 1) is not supported",
    ),
    "group_beam_search": ({"num_beams": 2, "num_beam_groups": 2}, "beam search (num_beams > 1) is not supported"),
    "contrastive_search": ({"penalty_alpha": 0.6, "top_k": 4}, "Contrastive search (penalty_alpha) is not supported"),
    "num_return_sequences": (
        {"num_return_sequences": 2, "do_sample": True}, "set num_return_sequences=1",
    ),
    "prompt_lookup": ({"prompt_lookup_num_tokens": 3}, "use SSDConfig(fallback='ngram') instead"),
    "assistant_early_exit": ({"assistant_early_exit": 1}, "use SSDConfig(fallback='ngram') instead"),
    "assistant_tokenizer": (
        {"assistant_tokenizer": object(), "tokenizer": object()}, "remove assistant_tokenizer",
    ),
    "batch_with_streamer": (
        {"prompt": torch.tensor([[5, 6], [7, 8]]), "streamer": BaseStreamer()},
        "A streamer takes one sequence; this batch has 2. Remove streamer=",
    ),
    "transposed_verify_on_the_one_prompt_path": (
        {"ssd_config": SSDConfig(verify_matmul="transposed", static_draft=False)},
        "SSDConfig(verify_matmul='transposed') acts in hf_ssd's loop, and this call runs transformers' assisted loop",
    ),
}


@pytest.mark.parametrize("case", list(USAGE_CASES))
def test_unsupported_generate_call(target, draft, case):
    kwargs, phrase = USAGE_CASES[case]
    with expect(SSDUsageError, phrase):
        _gen(target, draft, **dict(kwargs))


def test_batch_of_three_as_keyword_with_attentions(target, draft):
    with expect(SSDUsageError, MESSAGES["batch_keyword"]):
        target.generate(input_ids=torch.tensor([[5], [6], [7]]), assistant_model=draft, max_new_tokens=4,
                        ssd_config=SSDConfig(), output_attentions=True, return_dict_in_generate=True)


def test_right_padded_batch(target, draft):
    ids, mask = torch.tensor([[5, 6, 7, 8], [5, 6, 0, 0]]), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with expect(SSDUsageError, MESSAGES["right_padded"]):
        target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=4, ssd_config=SSDConfig())


def test_ssd_config_without_assistant_model(target):
    with expect(SSDUsageError, MESSAGES["no_draft"]):
        target.generate(PROMPT, max_new_tokens=4, ssd_config=SSDConfig())


def test_mismatched_vocabulary(target):
    with expect(SSDUsageError, MESSAGES["vocab"]) as err:
        _gen(target, make_model(3, vocab_size=100))
    assert MESSAGES["vocab_hint"] in str(err.value)


class _Tokenizer:
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def test_mismatched_vocabulary_beyond_the_tokenizer(target):
    """A tokenizer with more ids than the smaller model has: a real mismatch, not embedding padding."""
    with expect(SSDUsageError, MESSAGES["vocab_tokenizer"]):
        _gen(target, make_model(3, vocab_size=100), tokenizer=_Tokenizer(98))


def test_mismatched_eos(target):
    with expect(SSDUsageError, MESSAGES["eos"]):
        _gen(target, make_model(3, eos=2))


def test_encoder_decoder_target():
    t5 = T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2, eos_token_id=1, pad_token_id=0,
        decoder_start_token_id=0,
    )).eval()
    hf_ssd.enable(t5)
    with expect(SSDUsageError, MESSAGES["encoder_decoder"]):
        t5.generate(PROMPT, assistant_model=t5, max_new_tokens=4, ssd_config=SSDConfig())


@pytest.mark.parametrize("rows", [1, 2])
def test_nested_ssd_generate_on_one_thread(target, draft, rows):
    class Nested(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            _gen(target, draft)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    with expect(SSDUsageError, MESSAGES["reentrant"]):
        _gen(target, draft, prompt=PROMPT.repeat(rows, 1), stopping_criteria=StoppingCriteriaList([Nested()]))
    assert torch.equal(_gen(target, draft), target.generate(PROMPT, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("model", ["linear", "base_model"])
def test_enable_on_a_model_that_cannot_generate(model):
    obj = torch.nn.Linear(2, 2) if model == "linear" else LlamaModel(make_model(0).config)
    with expect(SSDUsageError, MESSAGES["enable"]):
        hf_ssd.enable(obj)
    assert not hf_ssd.is_enabled(obj)


# ----- drafts the drafter cannot drive ---------------------------------------------------------------------------


def _mamba_draft():
    config = MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=1, eos_token_id=1,
                         bos_token_id=0, pad_token_id=0)
    return MambaForCausalLM(config).double().eval()


@pytest.mark.parametrize("fallback", ["sd", "ar"])  # refused up front whichever path drafts first
def test_draft_without_croppable_attention_cache(target, fallback):
    with expect(UnsupportedDraftError, MESSAGES["stateful_draft"]):
        _gen(target, _mamba_draft(), max_new_tokens=8, ssd_config=SSDConfig(fallback=fallback))


def _hybrid_target():
    """Attention layers mixed with linear-attention (recurrent) layers: transformers >= 5.25 no longer marks such
    classes stateful, so the refusal must come from the cache's layer types."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=0,
                             layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                             linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                             eos_token_id=1, bos_token_id=0, pad_token_id=0)
    return Qwen3NextForCausalLM(config).double().eval()


@pytest.mark.parametrize("make", [_mamba_draft, _hybrid_target], ids=["mamba", "hybrid"])
def test_stateful_target(draft, make):
    target = hf_ssd.enable(make())
    with expect(SSDUsageError, MESSAGES["stateful_target"]):
        _gen(target, draft)


# ----- layouts ---------------------------------------------------------------------------------------------------


def test_stream_layout_without_cuda(target, draft):
    if torch.cuda.is_available():
        pytest.skip("CPU-only case")
    with expect(LayoutError, MESSAGES["stream_cpu"]):
        _gen(target, draft, ssd_config=SSDConfig(layout="stream"))


def test_device_layout_with_shared_device(target, draft):
    with expect(LayoutError, MESSAGES["device_shared"]):
        _gen(target, draft, ssd_config=SSDConfig(layout="device"))


def test_draft_spread_over_devices(target):
    split = noisy_copy(target, 0.0)
    split.lm_head.to("meta")  # a second device without needing a second accelerator
    with expect(LayoutError, MESSAGES["draft_split"]):
        _gen(target, split)


@pytest.mark.cuda
def test_thread_layout_with_draft_on_cuda(target):
    draft = noisy_copy(target, 0.0).to("cuda")
    with expect(LayoutError, MESSAGES["thread_cuda"]):
        _gen(target, draft, ssd_config=SSDConfig(layout="thread"))


@pytest.mark.cuda
def test_stream_layout_across_devices(target):
    draft = noisy_copy(target, 0.0).to("cuda")  # target stays on the CPU
    with expect(LayoutError, MESSAGES["stream_split"]):
        _gen(target, draft, ssd_config=SSDConfig(layout="stream"))


# ----- transformers' own checks, which SSD leaves in place --------------------------------------------------------


def test_ssd_config_on_a_model_not_enabled(draft):
    plain = make_model(0)
    with expect(SSDUsageError, MESSAGES["not_enabled"]):
        plain.generate(PROMPT, assistant_model=draft, max_new_tokens=4, ssd_config=SSDConfig())
    # Other unknown kwargs still get transformers' own check.
    with pytest.raises(ValueError, match="model_kwargs"):
        plain.generate(PROMPT, max_new_tokens=3, not_a_generate_kwarg=1)


def test_generate_without_cache(target, draft):
    with expect(SSDUsageError, MESSAGES["no_cache"]):
        _gen(target, draft, use_cache=False)


def test_generation_config_without_cache(draft):
    """use_cache=False from the model's own generation config (MptConfig's default) is named as such."""
    target = hf_ssd.enable(make_model(0))
    target.generation_config.use_cache = False
    with expect(SSDUsageError, MESSAGES["config_no_cache"]) as err:
        _gen(target, draft)
    assert "remove use_cache=False" not in str(err.value)
    assert torch.equal(_gen(target, draft, use_cache=True), target.generate(PROMPT, max_new_tokens=4, use_cache=True))


# ----- inputs rejected before generation starts ------------------------------------------------------------------


def test_inputs_embeds(target, draft):
    embeds = target.get_input_embeddings()(PROMPT)
    with pytest.raises(SSDUsageError, match="inputs_embeds"):
        target.generate(inputs_embeds=embeds, assistant_model=draft, max_new_tokens=4, ssd_config=SSDConfig())


def test_assistant_ensemble_weight(target, draft):
    with pytest.raises(SSDUsageError, match="Remove assistant_ensemble_weight"):
        target.generate(PROMPT, assistant_model=draft, max_new_tokens=4, do_sample=True,
                        assistant_ensemble_weight=0.5, ssd_config=SSDConfig())


# ----- fetch ----------------------------------------------------------------------------------------------------


def test_fetch_sha256_mismatch(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not the model")
    with expect(FetchError, MESSAGES["sha256"]):
        verify_file(path, "0" * 64, path.stat().st_size, progress=False)
    assert not (tmp_path / "model.gguf.sha256").exists()


def test_fetch_size_mismatch(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"short")
    with expect(FetchError, MESSAGES["size"]):
        verify_file(path, "0" * 64, 1000, progress=False)


# ----- the error types and the doc -------------------------------------------------------------------------------


def test_error_types_are_value_errors_and_exported():
    for exc in (SSDConfigError, SSDUsageError, LayoutError, UnsupportedDraftError):
        assert issubclass(exc, ValueError)
    for exc in (SSDConfigError, SSDUsageError, LayoutError):
        assert getattr(hf_ssd, exc.__name__) is exc


def test_doc_lists_every_tested_message():
    """docs/errors.md is the table of these cases: every key phrase asserted here must be in it."""
    phrases = [p for _, p in CONFIG_CASES] + [p for _, p in USAGE_CASES.values()] + list(MESSAGES.values())
    text = DOC.read_text(encoding="utf-8")
    missing = sorted({p for p in phrases if p not in text})
    assert not missing, f"docs/errors.md lacks: {missing}"
