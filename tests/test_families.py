"""Coverage matrix over transformers' decoder-only families: each one as target and draft, greedy SSD output
token-identical to the target alone, long enough for speculation cache hits and, for sliding-window models, well
past the window; sampling exactness on a few; padding masks, padded vocabularies; refused families with their
messages.

Models are tiny random configs (float64, eager attention; a few SDPA). The draft is a near-copy of the target
(`noisy_copy`), so acceptance and hits are high; an exact copy must accept (almost) everything, which only holds
when the draft's windowed masks and positions match what the model computes alone.
"""

from __future__ import annotations

import copy
import inspect
import re
from pathlib import Path

import pytest
import test_sampling
import torch
import transformers as tf
from conftest import noisy_copy, slow_cases
from test_sampling import GEN, assert_matches_target, exact_joint

import hf_ssd
from hf_ssd import SSDConfig, SSDUsageError, UnsupportedDraftError
from hf_ssd.drafting.drafter import Drafter
from hf_ssd.models.simulated import DeviceCost, simulate_device, unsimulate
from hf_ssd.speculation.outcomes import Outcome

V = 96
W = 8  # sliding window of the "past the window" cases: prompt 6 + 40 new tokens is almost 6 windows
PROMPT = [5, 17, 23, 42, 8, 61]
NEW = 40
COMMON = dict(vocab_size=V, bos_token_id=0, eos_token_id=1, pad_token_id=0, initializer_range=0.2)
LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=512)
HYBRID = dict(sliding_window=W, layer_types=["sliding_attention", "full_attention"])

# family -> (config class, kwargs); "+sw" variants have a sliding window W, "+long_sw" one never reached.
FAMILIES: dict[str, tuple[type, dict]] = {
    "llama": (tf.LlamaConfig, LLAMA_LIKE),
    "qwen2": (tf.Qwen2Config, LLAMA_LIKE),
    "qwen2+sw": (tf.Qwen2Config, {**LLAMA_LIKE, "use_sliding_window": True, "sliding_window": W,
                                  "max_window_layers": 1}),
    "qwen3": (tf.Qwen3Config, {**LLAMA_LIKE, "head_dim": 16}),
    "mistral": (tf.MistralConfig, {**LLAMA_LIKE, "sliding_window": None}),
    "mistral+sw": (tf.MistralConfig, {**LLAMA_LIKE, "sliding_window": W}),
    "mistral+long_sw": (tf.MistralConfig, {**LLAMA_LIKE, "sliding_window": 64}),
    "gemma": (tf.GemmaConfig, {**LLAMA_LIKE, "head_dim": 16}),
    "gemma2": (tf.Gemma2Config, {**LLAMA_LIKE, "head_dim": 16, **HYBRID}),
    "gemma2+long_sw": (tf.Gemma2Config, {**LLAMA_LIKE, "head_dim": 16, **HYBRID, "sliding_window": 64}),
    "gemma3_text": (tf.Gemma3TextConfig, {**LLAMA_LIKE, "head_dim": 16, **HYBRID}),
    "gemma3n_text": (tf.Gemma3nTextConfig, {**LLAMA_LIKE, "num_hidden_layers": 4, "head_dim": 16, **HYBRID,
                                            "layer_types": HYBRID["layer_types"] * 2, "num_kv_shared_layers": 2,
                                            "altup_num_inputs": 2, "laurel_rank": 8, "hidden_size_per_layer_input": 8,
                                            "vocab_size_per_layer_input": V, "activation_sparsity_pattern": [0.0] * 4}),
    "gpt_oss": (tf.GptOssConfig, {**LLAMA_LIKE, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  **HYBRID}),
    "cohere2": (tf.Cohere2Config, {**LLAMA_LIKE, **HYBRID}),
    "phi3": (tf.Phi3Config, LLAMA_LIKE),
    "phi3+sw": (tf.Phi3Config, {**LLAMA_LIKE, "sliding_window": W}),
    "gpt2": (tf.GPT2Config, dict(n_embd=32, n_layer=2, n_head=2, n_positions=512)),
    "gpt_neox": (tf.GPTNeoXConfig, dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=512)),
    "opt": (tf.OPTConfig, dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
                               word_embed_proj_dim=32, max_position_embeddings=512)),
    "falcon": (tf.FalconConfig, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, alibi=False)),
    "falcon+alibi": (tf.FalconConfig, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, alibi=True)),
    "bloom": (tf.BloomConfig, dict(hidden_size=32, n_layer=2, n_head=2)),
    "mpt": (tf.MptConfig, dict(d_model=32, n_layers=2, n_heads=2, max_seq_len=512)),
    "starcoder2": (tf.Starcoder2Config, {**LLAMA_LIKE, "sliding_window": W}),
    "olmo2": (tf.Olmo2Config, LLAMA_LIKE),
    "olmo3": (tf.Olmo3Config, {**LLAMA_LIKE, **HYBRID}),
    "mixtral": (tf.MixtralConfig, {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "mixtral+sw": (tf.MixtralConfig, {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2,
                                      "sliding_window": W}),
    "llama4_text": (tf.Llama4TextConfig, {**LLAMA_LIKE, "head_dim": 16, "num_local_experts": 2,
                                          "num_experts_per_tok": 1, "intermediate_size_mlp": 64,
                                          "attention_chunk_size": W, "no_rope_layers": [1, 0]}),
    "deepseek_v3": (tf.DeepseekV3Config, {**LLAMA_LIKE, "num_key_value_heads": 2, "kv_lora_rank": 16,
                                          "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                                          "v_head_dim": 16, "n_routed_experts": 4, "n_shared_experts": 1,
                                          "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                          "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    "ministral": (tf.MinistralConfig, {**LLAMA_LIKE, "head_dim": 16, **HYBRID}),
    "qwen2_moe": (tf.Qwen2MoeConfig, {**LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
}
THREAD = {"mistral+sw", "gemma3_text", "bloom", "falcon+alibi", "gpt_oss"}  # also run with the thread layout


def build(family: str, seed: int = 0, dtype=torch.float64, attn: str = "eager", **overrides):
    cls, kwargs = FAMILIES[family]
    torch.manual_seed(seed)
    config = cls(**{**COMMON, **kwargs, **overrides})
    config._attn_implementation = attn
    config._experts_implementation = "eager"  # grouped_mm MoE kernels take no float64
    model = tf.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # every run generates all NEW tokens (EOS: test_exactness)
    model.generation_config.use_cache = True  # MptConfig defaults to False
    return model


def window(model) -> int | None:
    return getattr(model.config.get_text_config(), "sliding_window", None) or None


def run(target, draft, layout="inline", prompt=PROMPT, **kw):
    ids = torch.tensor([prompt])
    ref = target.generate(ids, max_new_tokens=NEW, do_sample=False, **kw)
    config = SSDConfig(gamma=4, layout=layout, hit_rate_warning=0)
    # Threaded, the speculator races the verifier: a 10 ms (sleeping) target forward gives it time whatever the
    # machine's load, so the hit assertions do not depend on it (the outputs are the model's either way).
    if layout == "thread":
        simulate_device(target, DeviceCost(0.01))
    try:
        out = target.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft, ssd_config=config,
                              **kw)
    finally:
        unsimulate(target)
    assert out.tolist() == ref.tolist()
    assert out.shape[1] == len(prompt) + NEW, "the target ended early: too short to test the window"
    return hf_ssd.last_stats(target)


_PAIRS: dict = {}


def pair(family: str):
    """Target (enabled) with an exact copy and a near copy as drafts, built once per family."""
    if family not in _PAIRS:
        target = hf_ssd.enable(build(family))
        _PAIRS[family] = (target, noisy_copy(target, 0.0), noisy_copy(target, 0.003))
    return _PAIRS[family]


CASES = [(f, "inline") for f in FAMILIES] + [(f, "thread") for f in sorted(THREAD)]


@pytest.mark.parametrize(("family", "layout"), CASES, ids=[f"{f}-{lay}" for f, lay in CASES])
def test_greedy_identical_to_target(family, layout):
    target, same, near = pair(family)
    sw = window(target)
    if sw is not None and sw < 64:
        assert len(PROMPT) + NEW > 3 * sw  # well past the window
    stats = run(target, near, layout)
    # With a thread, a hit needs the job to finish within the verify: on a machine where it rarely does (the
    # 2-vCPU Xeon of 2026-12-03, gemma3_text: 0 of 8), the output checks still run and the case then skips.
    timed_out = layout == "thread" and stats.cache_hits == 0
    assert timed_out or stats.cache_hits > 0, (stats.cache_hits, stats.cache_misses)
    exact = run(target, same, layout)
    # An exact copy proposes the target's own greedy tokens: a draft mask or position that differs from what the
    # model computes alone (window, ALiBi, rotary) shows up as rejections here.
    assert exact.accepted_tokens >= 0.9 * exact.proposed_tokens, (exact.accepted_tokens, exact.proposed_tokens)
    timed_out = timed_out or (layout == "thread" and exact.cache_hits == 0)
    assert timed_out or exact.cache_hits > 0
    if timed_out:
        pytest.skip(f"{family}: no cache hits with the thread layout on this machine (outputs checked, exact)")


@pytest.mark.parametrize("family", ["mistral+sw", "gemma3_text", "gpt2", "qwen2+sw"])
def test_greedy_identical_with_sdpa(family):
    """The same with SDPA attention, which gets the 2D masks as boolean masks (eager adds them as floats)."""
    target = hf_ssd.enable(build(family, attn="sdpa"))
    stats = run(target, noisy_copy(target, 0.0))
    assert stats.cache_hits > 0 and stats.accepted_tokens >= 0.9 * stats.proposed_tokens


def test_wrong_window_is_detected():
    """Power of the acceptance check above: a draft attending past its window (full attention) is rejected
    often, so the matrix would notice a drafter that ignored the window."""
    target, _, _ = pair("mistral+sw")
    full = build("mistral")  # the same weights (same seed and shapes), no window
    assert all(torch.equal(a, b) for a, b in zip(full.parameters(), target.parameters()))
    stats = run(target, full)
    assert stats.accepted_tokens < 0.8 * stats.proposed_tokens, (stats.accepted_tokens, stats.proposed_tokens)


@torch.no_grad()
def alone(model, seq: list[int], pads: int = 0) -> torch.Tensor:
    """The model's next-token probabilities after `seq`, computed alone: one forward, no cache."""
    kw = {}
    if pads:
        mask = torch.tensor([[0] * pads + [1] * (len(seq) - pads)])
        kw = {"attention_mask": mask}
        if "position_ids" in inspect.signature(model.forward).parameters:
            kw["position_ids"] = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    return torch.softmax(model(torch.tensor([seq]), **kw).logits[0, -1].double(), -1)


TREE_FAMILIES = ["llama", "mistral+sw", "gemma2", "gemma3_text", "gemma3n_text", "llama4_text", "gpt_oss", "cohere2", "bloom", "falcon+alibi",
                 "mpt", "gpt2", "opt", "starcoder2", "olmo3", "phi3+sw", "qwen2+sw"]


@pytest.mark.parametrize("pads", [0, 5], ids=["no_pads", "left_pads"])
@pytest.mark.parametrize("family", TREE_FAMILIES)
def test_tree_rows_and_adoption_match_the_model_alone(family, pads):
    """Every pre-drafted branch (k = 0..g accepted, then a bonus) sees what the model alone sees on that branch's
    sequence, step after step, past the window; an adopted branch then drafts on like the model alone."""
    dtype = torch.float32 if pads else torch.float64  # float64 eager NaNs on fully masked pad rows (transformers)
    model = build(family, dtype=dtype)
    tol = 1e-4 if pads else 1e-6  # the drafter's probabilities are float32
    g, gamma = 4, 5
    gen = torch.Generator().manual_seed(7)
    context = [3] * pads + torch.randint(2, V, (2 * W + 3,), generator=gen).tolist()
    cands = torch.randint(2, V, (g,), generator=gen).tolist()
    mask = torch.tensor([[0] * pads + [1] * (len(context) - pads)]) if pads else None
    drafter = Drafter(model, None, do_sample=False, top_k=3, prompt_mask=mask)
    drafter.sync(context + cands, record_from=len(context) - 1)
    outcomes = [Outcome(k, int(torch.randint(2, V, (1,), generator=gen))) for k in range(g + 1)]
    tree = drafter.start_tree(len(context), outcomes)
    drafted = drafter.tree_steps(tree, outcomes, gamma, [0] * (gamma + 1), lambda: False)
    for state, result in drafted:
        o = state.outcome
        seq = context + cands[: o.accepted] + [o.bonus]
        for j in range(gamma + 1):
            ref = alone(model, seq, pads)
            values, ids = state.top[len(context) + o.accepted + j]
            assert torch.allclose(values.double(), ref[ids], atol=tol), (family, o, j, values, ref[ids])
            if j < gamma:
                assert result.tokens[j] == int(ref.argmax()), (family, o, j)
                seq = seq + [result.tokens[j]]
    state, result = drafted[1]  # one candidate accepted: the trunk drops g - 1 candidates' columns
    drafter.adopt(state, result.tokens)
    seq = list(drafter.ids)
    for _ in range(W + 2):  # keep drafting on the adopted trunk, past another window
        probs = drafter.sync(seq)
        assert torch.allclose(probs.double(), alone(model, seq, pads), atol=tol), (family, len(seq))
        seq = seq + [int(probs.argmax())]


# ----- the caller's attention_mask ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gemma2", "bloom", "gpt2"])
def test_left_padding_is_honoured_by_the_draft(family):
    """Masked left pads: same output as the target alone, and the exact-copy draft still accepts (almost) all.
    float32: float64 eager attention turns fully masked pad rows into NaN in transformers itself."""
    target = hf_ssd.enable(build(family, dtype=torch.float32))
    same = noisy_copy(target, 0.0).float()
    pads = 6
    prompt = [3] * pads + PROMPT
    mask = torch.tensor([[0] * pads + [1] * len(PROMPT)])
    stats = run(target, same, prompt=prompt, attention_mask=mask)
    plain = run(target, same)
    assert stats.accepted_tokens >= 0.9 * stats.proposed_tokens, (stats.accepted_tokens, stats.proposed_tokens)
    assert stats.cache_hits > 0 and stats.accepted_tokens >= plain.accepted_tokens - 2


# ----- padded vocabularies ------------------------------------------------------------------------------------


def resized_copy(target, noise: float, d_vocab: int, seed: int = 1):
    """A near copy with its own config (noisy_copy shares the target's) and d_vocab embedding rows."""
    draft = noisy_copy(target, noise, seed=seed)
    draft.config = copy.deepcopy(target.config)
    draft.resize_token_embeddings(d_vocab)
    assert draft.config.vocab_size == d_vocab and target.config.vocab_size != d_vocab
    return draft


class Tokenizer:
    """Stands in for the shared tokenizer: SSD only reads its length."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize(("t_vocab", "d_vocab"), [(100, 96), (96, 100)], ids=["target_padded", "draft_padded"])
def test_padded_vocabulary_with_tokenizer(t_vocab, d_vocab):
    """Embeddings that differ only by padding rows beyond the tokenizer: accepted, and still exact. The prompt holds
    ids of the target's padding rows, which a smaller draft lacks and reads as id 0 (the sampling case below
    has the target sample such an id)."""
    target = hf_ssd.enable(build("llama", vocab_size=t_vocab))
    draft = resized_copy(target, 0.003, d_vocab)
    tok = Tokenizer(min(t_vocab, d_vocab))
    prompt = [t_vocab - 1, t_vocab - 3] + PROMPT
    stats = run(target, draft, prompt=prompt, tokenizer=tok)
    assert stats.cache_hits > 0
    # Also as transformers' own check for two vocabulary sizes wants it: both tokenizers, here the same one.
    assert run(target, draft, prompt=prompt, tokenizer=tok, assistant_tokenizer=tok).cache_hits > 0


# ----- sampling -----------------------------------------------------------------------------------------------

# Vocabulary, new tokens, samples and prompt of test_sampling, whose exact_joint this uses.
SV, SL, SN, SAMPLE_PROMPT = test_sampling.V, test_sampling.L, test_sampling.N, test_sampling.PROMPT


SAMPLING = [("gemma2", "inline", None), ("bloom", "inline", None), ("mistral+sw", "thread", None), ("llama", "inline", 5)]


# The families' own caches are proven by their greedy tests; by default one sampled family (a draft vocabulary
# the target pads) runs, the others with HF_SSD_SLOW=1.
@pytest.mark.parametrize(("family", "layout", "d_vocab"), slow_cases(SAMPLING, SAMPLING[:3]),
                         ids=["gemma2", "bloom", "mistral_sw-thread", "llama_padded_vocab"])
def test_sampling_matches_target_distribution(family, layout, d_vocab):
    """A window of 3 tokens is passed inside the 6-token sequences; Bloom drafts with ALiBi; a draft lacking the
    target's last id (which the target does sample here) keeps the target's distribution."""
    overrides = {"vocab_size": SV, "eos_token_id": None, "bos_token_id": None, "pad_token_id": None}
    if window(build(family)) is not None:
        overrides["sliding_window"] = 3
    target = hf_ssd.enable(build(family, seed=3, **overrides))
    target.generation_config.eos_token_id = None
    draft = noisy_copy(target, 0.3, seed=5) if d_vocab is None else resized_copy(target, 0.3, d_vocab, seed=5)
    extra = {} if d_vocab is None else {"tokenizer": Tokenizer(d_vocab)}
    joint = exact_joint(target)
    config = SSDConfig(gamma=2, layout=layout, hit_rate_warning=0)
    torch.manual_seed(1234)
    samples, hits = [], 0
    if layout == "thread":  # a job drafts within the verify's time: the tiny target's left it none in some runs
        simulate_device(target, DeviceCost(0.012))
    for _ in range(SN):
        out = target.generate(torch.tensor([SAMPLE_PROMPT]), max_new_tokens=SL, assistant_model=draft, ssd_config=config,
                              **GEN, **extra)
        samples.append(tuple(out[0, len(SAMPLE_PROMPT):].tolist()))
        hits += hf_ssd.last_stats(target).cache_hits
    assert hits > 0
    assert_matches_target(samples, joint, family)


# ----- refused families ---------------------------------------------------------------------------------------

STATEFUL = {
    "mamba": lambda: tf.MambaConfig(hidden_size=32, state_size=4, num_hidden_layers=1, **COMMON),
    "rwkv": lambda: tf.RwkvConfig(hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                                  intermediate_size=64, context_length=64, **COMMON),
    "jamba": lambda: tf.JambaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, num_experts=2, mamba_d_state=4, mamba_expand=1,
                                    attn_layer_period=2, attn_layer_offset=1, **COMMON),
}
DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
STATEFUL_DRAFT = "SSD needs a draft model whose KV cache it can crop and batch"
STATEFUL_MODEL = "is a stateful (recurrent / state-space) model"


def _stateful(name: str):
    model = tf.AutoModelForCausalLM.from_config(STATEFUL[name]()).double().eval()
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("name", list(STATEFUL))
def test_stateful_family_refused_as_draft(name):
    target, _, _ = pair("llama")
    with pytest.raises(UnsupportedDraftError, match=re.escape(STATEFUL_DRAFT)) as err:
        target.generate(torch.tensor([PROMPT]), max_new_tokens=4, assistant_model=_stateful(name),
                        ssd_config=SSDConfig(layout="inline"))
    assert STATEFUL_MODEL in str(err.value) and type(_stateful(name)).__name__ in str(err.value)


@pytest.mark.parametrize("name", list(STATEFUL))
def test_stateful_family_refused_as_target(name):
    target = hf_ssd.enable(_stateful(name))
    _, _, draft = pair("llama")
    with pytest.raises(SSDUsageError, match=re.escape(STATEFUL_MODEL)):
        target.generate(torch.tensor([PROMPT]), max_new_tokens=4, assistant_model=draft,
                        ssd_config=SSDConfig(layout="inline"))


def test_conv_state_draft_refused():
    """LFM2's short-convolution layers keep a rolling state, not per-token keys: it serves as a target (transformers
    crops it), but the drafter cannot batch branches over it, so as a draft it is refused up front."""
    config = tf.Lfm2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, layer_types=["conv", "full_attention"], **COMMON)
    draft = tf.AutoModelForCausalLM.from_config(config).double().eval()
    target, _, _ = pair("llama")
    with pytest.raises(UnsupportedDraftError, match=re.escape(STATEFUL_DRAFT)):
        target.generate(torch.tensor([PROMPT]), max_new_tokens=4, assistant_model=draft,
                        ssd_config=SSDConfig(layout="inline"))


class BatchShy(tf.LlamaForCausalLM):
    """Stands in for architectures that build their own masks and fail on a batch (CPM-Ant)."""

    def forward(self, input_ids=None, **kwargs):
        if input_ids is not None and input_ids.shape[0] > 1:
            raise RuntimeError("this model takes one sequence at a time")
        return super().forward(input_ids=input_ids, **kwargs)

    forward.__signature__ = inspect.signature(tf.LlamaForCausalLM.forward)  # what the drafter inspects


class PositionBlind(tf.LlamaForCausalLM):
    """Stands in for architectures that take positions from the cache length, not from position_ids (TrOCR)."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        return super().forward(input_ids=input_ids, **kwargs)

    forward.__signature__ = inspect.signature(tf.LlamaForCausalLM.forward)


def _twin(cls, target):
    model = cls(target.config).double().eval()
    model.load_state_dict(target.state_dict())
    model.generation_config.pad_token_id = 0
    return model


def test_draft_failing_on_the_batched_step_is_refused_up_front():
    target = hf_ssd.enable(build("llama"))
    calls = []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(UnsupportedDraftError, match=re.escape("fails on the drafter's batched step")):
            target.generate(torch.tensor([PROMPT]), max_new_tokens=8, assistant_model=_twin(BatchShy, target),
                            ssd_config=SSDConfig(layout="inline"))
    finally:
        handle.remove()
    assert not calls, "the target ran before the draft was refused"


def test_draft_disagreeing_with_itself_in_a_batch_is_served_with_a_warning(caplog):
    target, _, _ = pair("llama")
    with caplog.at_level("WARNING", logger="hf_ssd"):
        stats = run(target, _twin(PositionBlind, target))
    assert "computes branch tokens differently in a batch than alone" in caplog.text
    assert stats.proposed_tokens > 0  # exact (checked in run), only slower


def test_mpt_default_use_cache_is_named():
    """MptConfig's default use_cache=False: the message says where it comes from and what to pass."""
    target = hf_ssd.enable(build("mpt"))
    target.generation_config.use_cache = tf.MptConfig().use_cache
    assert target.generation_config.use_cache is False
    with pytest.raises(SSDUsageError, match=re.escape("use_cache=False comes from the target's generation_config "
                                                      "(from MptConfig")):
        target.generate(torch.tensor([PROMPT]), max_new_tokens=4, assistant_model=noisy_copy(target, 0.0),
                        ssd_config=SSDConfig())


def test_doc_lists_the_families():
    text = DOC.read_text(encoding="utf-8")
    for phrase in (STATEFUL_DRAFT, STATEFUL_MODEL):
        assert phrase in text
    for family in {f.split("+")[0] for f in FAMILIES} | set(STATEFUL):
        assert f"`{family}`" in text, f"docs/errors.md does not list {family}"
