"""Edges: EOS and length limits reached inside a cached draft, extreme prompt lengths, gamma beyond the tokens
left, stopping criteria (custom, stop strings, max_time), streamers, mixing SSD and plain calls, and dict outputs
with scores. Greedy SSD must equal the target alone in every case."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import VOCAB, noisy_copy
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    MaxTimeCriteria,
    PreTrainedTokenizerFast,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
    TextStreamer,
)
from transformers.generation.streamers import BaseStreamer

import hf_ssd
from hf_ssd import SSDConfig, SSDStats
from hf_ssd.drafting.drafter import Drafter
from hf_ssd.loop import batch as batch_loop
from hf_ssd.scheduling.costs import reset_estimates
from hf_ssd.speculation.cache import SpeculationCache

PROMPT = torch.tensor([[5, 6, 7, 8]])
QUIET = {"hit_rate_warning": 0.0}


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """An offline character-level tokenizer over the tiny models' vocabulary: ids 2..95 are the printable
    characters "!".."~" (id i is chr(31 + i)), 0 is "<pad>" and 1 is "</s>". Character-level, so transformers'
    stop-string matching (which re-tokenizes its own probe text) works with it."""
    vocab = {chr(31 + i): i for i in range(2, VOCAB)}
    vocab.update({"<pad>": 0, "</s>": 1})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="!"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="!",
        clean_up_tokenization_spaces=False,
    )


def text_of(ids: list[int]) -> str:
    return "".join(chr(31 + i) for i in ids)


@pytest.fixture(scope="module")
def twin(target):
    """A draft with the target's exact weights: every verification outcome is predicted, and with the inline
    layout every branch is drafted to full length, so limits are reached inside served cached drafts."""
    return noisy_copy(target, 0.0)


@pytest.fixture(scope="module")
def close_draft(target):
    return noisy_copy(target, 0.01)


def alone(target, prompt=PROMPT, **kw):
    return target.generate(prompt, do_sample=False, **kw)


def with_ssd(target, draft, prompt=PROMPT, config=None, **kw):
    config = config or SSDConfig(gamma=4, **QUIET)
    return target.generate(prompt, assistant_model=draft, do_sample=False, ssd_config=config, **kw)


@pytest.fixture
def served(monkeypatch):
    """Record every cache hit: (branch tokens, tokens actually proposed from it), on either path of one prompt."""
    log = {"branches": [], "adopted": []}
    get, adopt = SpeculationCache.get, Drafter.adopt

    def recording_get(self, *args):
        branch = get(self, *args)
        if branch is not None:
            log["branches"].append(list(branch.tokens))
        return branch

    def recording_adopt(self, state, tokens):
        log["adopted"].append((log["branches"][-1], list(tokens)))
        return adopt(self, state, tokens)

    def recording_propose(drafter, live, rnd, *args, **kwargs):  # hf_ssd's loop: a hit row's ready branch
        ready = [list(r.ready.tokens) if r.ready is not None else None for r in live]
        propose(drafter, live, rnd, *args, **kwargs)
        for branch, hit, used in zip(ready, rnd.hits, rnd.candidates):
            if hit:
                log["branches"].append(branch)
                log["adopted"].append((branch, list(used)))

    propose = batch_loop._propose
    monkeypatch.setattr(SpeculationCache, "get", recording_get)
    monkeypatch.setattr(Drafter, "adopt", recording_adopt)
    monkeypatch.setattr(batch_loop, "_propose", recording_propose)
    return log


# ----- limits reached inside a cached draft ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["inline", "thread"])
def test_eos_inside_cached_draft(target, twin, served, layout):
    """Inline, branches are always drafted to full length, so EOS surely falls inside a served branch; threaded,
    drafting stops when the outcome arrives, and the same cases must still be exact."""
    new = 30
    config = SSDConfig(gamma=4, layout=layout, **QUIET)
    free_run = alone(target, max_new_tokens=new)[0, PROMPT.shape[1]:].tolist()
    # EOS candidates: tokens whose first occurrence is deep enough in the output to be reached mid-draft.
    candidates = [t for i, t in enumerate(free_run) if free_run.index(t) == i and i >= 2][:8]
    assert len(candidates) >= 4
    eos_in_branch = 0
    for eos in candidates:
        ref = alone(target, max_new_tokens=new, eos_token_id=eos)
        assert int(ref[0, -1]) == eos
        before = len(served["branches"])
        out = with_ssd(target, twin, config=config, max_new_tokens=new, eos_token_id=eos)
        assert torch.equal(out, ref), f"eos={eos}"
        eos_in_branch += any(eos in b for b in served["branches"][before:])
    if layout == "inline":
        assert eos_in_branch > 0, "no case had EOS inside a served cached draft"


def test_eos_as_first_token(target, twin):
    first = int(alone(target, max_new_tokens=1)[0, -1])
    ref = alone(target, max_new_tokens=10, eos_token_id=first)
    assert ref.shape[1] == PROMPT.shape[1] + 1
    assert torch.equal(with_ssd(target, twin, max_new_tokens=10, eos_token_id=first), ref)


@pytest.mark.parametrize("layout", ["inline", "thread"])
@pytest.mark.parametrize("limit", ["max_new_tokens", "max_length"])
def test_length_limit_inside_cached_draft(target, twin, served, limit, layout):
    config = SSDConfig(gamma=4, layout=layout, **QUIET)
    truncated = 0
    for new in range(1, 15):
        kw = {"max_new_tokens": new} if limit == "max_new_tokens" else {"max_length": PROMPT.shape[1] + new}
        ref = alone(target, **kw)
        before = len(served["adopted"])
        out = with_ssd(target, twin, config=config, **kw)
        assert torch.equal(out, ref), f"{limit}: {new} new tokens"
        truncated += any(len(used) < len(branch) for branch, used in served["adopted"][before:])
    if layout == "inline":
        assert truncated > 0, "no case cut a served cached draft at the length limit"


@pytest.mark.parametrize("gamma", [8, 16, 64])
@pytest.mark.parametrize("new", [1, 2, 3])
def test_gamma_larger_than_tokens_left(target, twin, gamma, new):
    ref = alone(target, max_new_tokens=new)
    assert torch.equal(with_ssd(target, twin, config=SSDConfig(gamma=gamma, **QUIET), max_new_tokens=new), ref)


# ----- prompt lengths ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("token", [1, 2, 50, VOCAB - 1])  # not the pad id 0: a fully masked prompt gives NaN
def test_prompt_of_length_one(target, close_draft, token):
    prompt = torch.tensor([[token]])
    ref = alone(target, prompt, max_new_tokens=12)
    assert torch.equal(with_ssd(target, close_draft, prompt, max_new_tokens=12), ref)


@pytest.mark.parametrize("prompt_len,new", [(500, 12), (508, 4), (511, 1)])
def test_prompt_near_max_positions(target, close_draft, prompt_len, new):
    assert target.config.max_position_embeddings == 512
    g = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(2, VOCAB, (1, prompt_len), generator=g)
    ref = alone(target, prompt, max_new_tokens=new)
    out = with_ssd(target, close_draft, prompt, config=SSDConfig(gamma=8, **QUIET), max_new_tokens=new)
    assert out.shape[1] <= target.config.max_position_embeddings
    assert torch.equal(out, ref)


def test_masked_prompt_positions(target, close_draft):
    """Pad ids inside the prompt are masked for the target (transformers infers the mask); the draft sees them
    unmasked, which may cost acceptance but never exactness."""
    prompt = torch.tensor([[5, 0, 6, 0, 0, 7]])
    ref = alone(target, prompt, max_new_tokens=12)
    assert not torch.isnan(alone(target, prompt, max_new_tokens=1, output_scores=True,
                                 return_dict_in_generate=True).scores[0]).any()
    assert torch.equal(with_ssd(target, close_draft, prompt, max_new_tokens=12), ref)
    mask = torch.tensor([[1, 1, 1, 0, 1, 1]])  # an explicit mask is honoured the same way
    ref = alone(target, prompt, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(with_ssd(target, close_draft, prompt, attention_mask=mask, max_new_tokens=12), ref)


@pytest.mark.parametrize("seed", range(3))
def test_one_prompts_masked_columns_take_the_loop_unless_it_ends_in_one(target, close_draft, seed):
    """One prompt with a masked column inside runs hf_ssd's loop, which skips it as transformers does; one whose
    last column is masked (it ends in the pad token) runs the one-prompt path, since transformers continues it
    from that column's query. Both equal the target alone, over configs whose rounds reject and hit."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, VOCAB, (1, 9), generator=g)
    prompt[0, 3] = prompt[0, 5] = 0  # the pad token: masked where transformers infers the mask
    for ends_masked in (False, True):
        ids = torch.cat([prompt, torch.zeros(1, 1, dtype=torch.long)], dim=1) if ends_masked else prompt
        for config in (SSDConfig(gamma=4, **QUIET), SSDConfig(gamma=3, schedule="fixed", fanout_budget=4, **QUIET)):
            out = with_ssd(target, close_draft, ids, config=config, max_new_tokens=12, return_dict_in_generate=True)
            assert torch.equal(out.sequences, alone(target, ids, max_new_tokens=12)), (seed, ends_masked)
            assert (out.ssd_stats.draft_path == "batched") == (not ends_masked), out.ssd_stats.draft_path


# ----- stopping criteria ----------------------------------------------------------------------------------------


class StopAtLength(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


class StopOnToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids == self.token).any(dim=1)


def test_stopping_criteria(target, close_draft):
    """Criteria are checked once per round (as in transformers' assisted decoding): SSD stops in the round that
    satisfies them, and what it returns is the target's own continuation."""
    gamma, limit = 4, 40
    long_ref = alone(target, max_new_tokens=limit)[0].tolist()
    n_prompt = PROMPT.shape[1]
    for length in (n_prompt + 1, n_prompt + 7, n_prompt + 13):
        out = with_ssd(target, close_draft, max_new_tokens=limit,
                       stopping_criteria=StoppingCriteriaList([StopAtLength(length)]))[0].tolist()
        assert out == long_ref[: len(out)]
        assert length <= len(out) <= length + gamma
    token = long_ref[n_prompt + 9]
    out = with_ssd(target, close_draft, max_new_tokens=limit,
                   stopping_criteria=StoppingCriteriaList([StopOnToken(token)]))[0].tolist()
    assert out == long_ref[: len(out)]
    first = out.index(token, n_prompt)
    assert len(out) - first <= gamma + 1, "generation went on for more than one round after the stop token"


def test_stop_strings(target, twin):
    """Stop strings work with ssd_config. transformers matches them at the end of the sequence once per round (as
    in its own assisted decoding), so the stop string here is the token that ends a round: found with a first
    inline run (inline rounds on a fixed schedule are deterministic; the auto scheduler may pick other rounds in
    the second call), then generation must end exactly there."""
    tok = tiny_tokenizer()
    config = SSDConfig(gamma=4, layout="inline", schedule="fixed", record_timeline=True, **QUIET)
    limit, n = 40, PROMPT.shape[1]
    long_ref = alone(target, max_new_tokens=limit)[0].tolist()
    assert with_ssd(target, twin, config=config, max_new_tokens=limit)[0].tolist() == long_ref
    ends, length = [], n
    for event in hf_ssd.last_stats(target).timeline:
        length += event["accepted"] + 1
        ends.append(length)
    # The first round end (after the first two rounds) whose token has not appeared before it.
    end = next(e for e in ends[2:] if long_ref[e - 1] not in long_ref[n : e - 1])
    assert end < len(long_ref)
    out = with_ssd(target, twin, config=config, max_new_tokens=limit, stop_strings=[text_of([long_ref[end - 1]])],
                   tokenizer=tok)
    assert out[0].tolist() == long_ref[:end]


@pytest.fixture(scope="module")
def long_reference(target):
    return alone(target, max_new_tokens=150)


def test_max_time(target, close_draft, long_reference):
    start = time.perf_counter()
    out = with_ssd(target, close_draft, max_new_tokens=150, max_time=0.02)
    took = time.perf_counter() - start
    assert torch.equal(out, long_reference[:, : out.shape[1]])
    assert out.shape[1] < long_reference.shape[1], "max_time did not stop generation early"
    assert took < 0.02 + 1.0


def test_max_time_criteria_object(target, close_draft, long_reference):
    out = with_ssd(target, close_draft, max_new_tokens=150,
                   stopping_criteria=StoppingCriteriaList([MaxTimeCriteria(max_time=0.02)]))
    assert torch.equal(out, long_reference[:, : out.shape[1]])
    assert out.shape[1] < long_reference.shape[1]


# ----- streamers ------------------------------------------------------------------------------------------------


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value):
        assert self.ended == 0, "put after end"
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("eos", [None, "mid"])
def test_streamer_receives_exactly_the_returned_tokens(target, twin, eos):
    kw = {"max_new_tokens": 20}
    if eos == "mid":
        kw["eos_token_id"] = int(alone(target, max_new_tokens=11)[0, -1])
    streamer = RecordingStreamer()
    out = with_ssd(target, twin, streamer=streamer, **kw)
    assert torch.equal(out, alone(target, **kw))
    streamed = [t for chunk in streamer.puts for t in chunk]
    assert streamed == out[0].tolist()  # the prompt first, then each round's accepted tokens, nothing else
    assert streamer.puts[0] == PROMPT[0].tolist()
    assert streamer.ended == 1


def test_text_iterator_streamer(target, close_draft):
    tok = tiny_tokenizer()
    prompt = tok(text_of([5, 6, 7, 8]), return_tensors="pt").input_ids
    assert prompt.tolist() == [[5, 6, 7, 8]]
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    out = with_ssd(target, close_draft, prompt, streamer=streamer, max_new_tokens=16)
    assert torch.equal(out, alone(target, prompt, max_new_tokens=16))
    assert "".join(streamer) == tok.decode(out[0, prompt.shape[1]:])


def test_text_streamer(target, close_draft, capsys):
    tok = tiny_tokenizer()
    prompt = tok(text_of([9, 10, 11]), return_tensors="pt").input_ids
    out = with_ssd(target, close_draft, prompt, streamer=TextStreamer(tok, skip_prompt=True), max_new_tokens=12)
    assert capsys.readouterr().out.strip() == tok.decode(out[0, prompt.shape[1]:]).strip()


# ----- mixing calls, outputs ------------------------------------------------------------------------------------


def test_alternating_ssd_and_plain_calls(target, close_draft):
    ref = alone(target, max_new_tokens=16)
    stats = []
    for i in range(6):
        kind = ("ssd", "plain", "assisted")[i % 3]
        if kind == "ssd":
            out = with_ssd(target, close_draft, max_new_tokens=16)
            stats.append(hf_ssd.last_stats(target))
        elif kind == "plain":
            out = alone(target, max_new_tokens=16)
            assert hf_ssd.last_stats(target) is stats[-1], "a call without ssd_config replaced the SSD stats"
        else:  # transformers' own assisted generation, through the enabled model
            out = target.generate(PROMPT, assistant_model=close_draft, max_new_tokens=16, do_sample=False)
        assert torch.equal(out, ref), f"call {i} ({kind})"
    assert stats[0] is not stats[1]


def test_return_dict_with_scores(target, close_draft):
    kw = {"max_new_tokens": 12, "return_dict_in_generate": True, "output_scores": True, "output_logits": True}
    ref = alone(target, **kw)
    out = with_ssd(target, close_draft, config=SSDConfig(gamma=4, record_timeline=True, **QUIET), **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 12
    assert len(out.logits) == 12
    for s, r in zip(out.scores, ref.scores):
        assert s.shape == r.shape
        torch.testing.assert_close(s, r, rtol=1e-4, atol=1e-4)
    assert isinstance(out.ssd_stats, SSDStats)
    assert out.ssd_stats is hf_ssd.last_stats(target)
    assert out.ssd_stats.new_tokens == 12
    assert len(out.ssd_stats.timeline) == out.ssd_stats.rounds > 0


def test_plain_tensor_output_has_no_stats_attribute(target, close_draft):
    out = with_ssd(target, close_draft, max_new_tokens=4)
    assert isinstance(out, torch.Tensor)
    assert not hasattr(out, "ssd_stats")


@pytest.mark.parametrize("schedule", ["fixed", "auto"])
@pytest.mark.parametrize("layout", ["inline", "thread"])
def test_seeded_sampling_is_valid(target, close_draft, layout, schedule):
    kw = {"max_new_tokens": 16, "do_sample": True, "temperature": 1.0, "top_k": 20}

    def run():
        torch.manual_seed(0)
        # fanout="geometric": the calibrated predictor carries what it learned into the next call (by design),
        # so two seeded calls would pre-draft different outcomes and draw different (equally exact) samples. So
        # does the pair's acceptance estimate, which splits a job's branches over k: each run starts without it.
        reset_estimates(target)
        config = SSDConfig(layout=layout, schedule=schedule, fanout="geometric", **QUIET)
        return target.generate(PROMPT, assistant_model=close_draft, ssd_config=config, **kw)

    a, b = run(), run()
    for out in (a, b):
        assert torch.equal(out[:, : PROMPT.shape[1]], PROMPT)
        assert PROMPT.shape[1] < out.shape[1] <= PROMPT.shape[1] + 16
        assert int(out.min()) >= 0 and int(out.max()) < VOCAB
    # No timing and no carried state in play: a seed fixes the output. (The auto schedule decides from measured
    # times, so which option drew the samples, and hence the seeded sample, can differ; its distribution cannot.)
    if layout == "inline" and schedule == "fixed":
        assert torch.equal(a, b), "the same seed gave different samples"


def test_draft_is_the_target_itself(target):
    ref = alone(target, max_new_tokens=16)
    assert torch.equal(with_ssd(target, target, max_new_tokens=16), ref)


def test_draft_in_another_dtype(target):
    draft32 = noisy_copy(target, 0.0).float()
    assert torch.equal(with_ssd(target, draft32, max_new_tokens=16), alone(target, max_new_tokens=16))


def test_a_prompt_ending_in_the_pad_token_is_exact(target, close_draft):
    """transformers masks the pad token it finds in a prompt but still predicts the first new token from that
    column's query; hf_ssd's loop drops masked columns, so such a prompt runs the one-prompt path (found by
    tests/test_fuzz.py: [1, 1, 0] gave another continuation in the loop)."""
    for ids in ([[1, 1, 0]], [[5, 0, 7, 0]], [[9, 0, 4]]):
        x = torch.tensor(ids)
        assert torch.equal(with_ssd(target, close_draft, prompt=x, max_new_tokens=6), alone(target, x, max_new_tokens=6))
