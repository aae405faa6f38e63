"""The draft side: one draft KV cache (the trunk), sequential drafting, and batched tree pre-drafting.

The trunk cache holds the draft's keys/values for `ids`. Pre-drafting for several outcomes runs all branches in
one batch: row r holds the keys/values of its prefix (for the round in flight: context + the candidates branch r
accepts), right-aligned behind masked filler columns, so a 2D padding mask hides what a branch assumes rejected
and one draft forward per step serves every branch. Left padding is what every decoder-only model supports: the
model builds its own causal, sliding-window or ALiBi attention from the 2D mask and the position ids, exactly as
for a padded batch, so no 4D mask is needed (ALiBi models take none). Adopting a branch after a hit slices its
valid columns back into a single-row cache, so the next round starts where it left off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from ..speculation.outcomes import Outcome
from .kvcache import SequenceView, UnsupportedDraftError, forward_params, holds_tensors, new_cache

TopProbs = tuple[torch.Tensor, torch.Tensor]  # (probabilities, token ids), most likely first

# Warpers that look at the scores only (never at input_ids): they can run on all rows of a step at once.
CONTEXT_FREE = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
                "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper"}


__all__ = ["BranchState", "DraftResult", "Drafter", "TreeBatch", "UnsupportedDraftError"]


@dataclass
class DraftResult:
    tokens: list[int]
    logits: torch.Tensor | None  # [n, V] log-probabilities each token was sampled from; None in greedy mode


@dataclass
class TreeBatch:
    """Shared state of one batched pre-draft: the batched cache and the geometry of its rows.

    Row r's sequence starts at column offsets[r] and is contiguous: its prefix (the ids before its bonus), then
    the tokens fed here, from column `width` on. `prefix_top[r]` holds the draft's top lists for positions before
    len(prefix[r]) (a shared dict: entries at later positions are ignored).
    """

    cache: DynamicCache
    width: int  # columns before this batch's first step
    prefix: list[list[int]]
    prefix_top: list[dict[int, TopProbs]]
    offsets: list[int]  # row r's masked left columns
    mask: torch.Tensor  # [rows, columns so far] long, 1 = attended


@dataclass
class BranchState:
    batch: TreeBatch
    row: int
    outcome: Outcome
    top: dict[int, TopProbs] = field(default_factory=dict)
    fed: int = 0  # tokens fed into this row so far: the bonus, then the drafted tokens

    @property
    def start(self) -> int:
        """Sequence index of the row's bonus token."""
        return len(self.batch.prefix[self.row])


def saguaro_q(probs: torch.Tensor, cached, c: float) -> torch.Tensor:
    """Saguaro sampling's draft distribution over rows [R, V]: each row's `cached` likeliest tokens (an int for
    every row, or a list of one count per row), the bonuses the cache will hold should the target reject there,
    keep c of their mass, then the row is renormalised, so that a rejection's residual max(p - q, 0) falls on
    them. Exact because q is what the token is drawn from. A row whose cached tokens hold (almost) all the mass
    keeps the plain draft. The counts stay on the host: no device sync."""
    if isinstance(cached, int):
        width, factor = min(cached, probs.shape[-1]), c
    else:
        counts = torch.as_tensor(cached, dtype=torch.long)
        width = min(int(counts.max()), probs.shape[-1])
        factor = torch.where(torch.arange(width)[None, :] < counts[:, None], c, 1.0).to(probs.device, probs.dtype)
    idx = probs.topk(width, dim=-1).indices
    scaled = probs.scatter(1, idx, probs.gather(1, idx) * factor)
    total = scaled.sum(-1, keepdim=True)
    return torch.where(total > 1e-6, scaled / total, probs)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix: how much of the trunk a new context can keep."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Drafter:
    def __init__(
        self,
        model,
        logits_processor: Callable | None,
        do_sample: bool,
        top_k: int,
        saguaro_c: float | None = None,
        generator: torch.Generator | None = None,
        out_vocab: int | None = None,
        prompt_mask: torch.Tensor | None = None,
    ):
        self.model = model
        # Proposals must live in the target's vocabulary: a draft with a larger (padded) embedding never
        # proposes ids beyond it, and a smaller one gets zero probability on the ids it lacks.
        self.out_vocab = out_vocab or model.config.get_text_config().vocab_size
        self.device = model.device
        self.processor = logits_processor
        procs = list(logits_processor or [])
        self._procs = bool(procs)
        self._context_free = all(type(p).__name__ in CONTEXT_FREE for p in procs)
        self.do_sample = do_sample
        self.top_k = max(1, top_k)
        self.saguaro_c = saguaro_c if do_sample else None
        self.generator = generator
        params = forward_params(model)
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._pos_kw = "position_ids" in params  # ALiBi models (Bloom, MPT) take none: positions come from the mask
        self.view = SequenceView(prompt_mask, self.device)
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        # The target may emit ids of its padded embedding rows the draft lacks (a padded-vocabulary pair): the
        # draft reads them as id 0. That only costs acceptance; the output is the target's.
        self.in_vocab = getattr(emb, "num_embeddings", None)
        self.cache = self._new_cache()
        self.ids: list[int] = []
        self.top: dict[int, TopProbs] = {}  # position p -> draft's top probabilities for token p + 1
        self.forwards = 0
        self._last: tuple[int, torch.Tensor] | None = None  # (context length, probs) of the last sync
        self._keep_kw = "logits_to_keep" in params

    # ----- low level -------------------------------------------------------------------------------------
    def _new_cache(self) -> DynamicCache:
        return new_cache()

    def _ids(self, ids) -> torch.Tensor:
        t = torch.as_tensor(ids, dtype=torch.long, device=self.device)
        if self.in_vocab is not None:
            t = t.masked_fill(t >= self.in_vocab, 0)
        return t

    @torch.no_grad()
    def _forward(self, input_ids, position_ids, cache, attention_mask=None, keep_last: int = 1) -> torch.Tensor:
        kwargs = {self._cache_kw: cache}
        if self._keep_kw:
            kwargs["logits_to_keep"] = keep_last  # a long prompt's full logits would be V floats per token
        if self._pos_kw:
            kwargs["position_ids"] = position_ids
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **kwargs)
        self.forwards += 1
        return out.logits[:, -keep_last:, : self.out_vocab].float()

    def _process(self, context: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Apply the generation's logits processors (temperature, top-k/p, penalties) for this context."""
        scores = logits.view(1, -1)
        if self.processor is not None and len(self.processor) > 0:
            ids = torch.tensor([context], dtype=torch.long, device=logits.device)
            scores = self.processor(ids, scores.clone())
        return scores[0]

    def _probs_rows(self, contexts: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
        """`_probs_for` of every row of a batched step ([rows, V]) at once where the processors allow it: the
        per-row work of a wide tree step would otherwise sit between its forwards (and, after the last one, on
        the critical path)."""
        if not self._procs:
            return torch.softmax(logits, dim=-1)
        if self._context_free:
            ids = torch.zeros(logits.shape[0], 1, dtype=torch.long, device=logits.device)  # never read
            return torch.softmax(self.processor(ids, logits.clone()), dim=-1)
        return torch.stack([self._probs_for(c, row) for c, row in zip(contexts, logits)])

    def _top(self, probs: torch.Tensor) -> TopProbs:
        values, ids = probs.topk(min(self.top_k, probs.numel()))
        return values.cpu(), ids.cpu()

    def _choose(self, probs: torch.Tensor, n_cached: int) -> tuple[int, torch.Tensor | None]:
        """Pick the next draft token; when sampling also return the log-probabilities it was drawn from."""
        if not self.do_sample:
            return int(probs.argmax()), None
        q = probs
        if self.saguaro_c is not None and n_cached > 0:
            # Saguaro: shrink the draft mass of the tokens the cache will hold for a rejection here, so the
            # residual max(p - q, 0) of a rejection falls on them. Exact because q is what we sample from.
            q = saguaro_q(probs[None], n_cached, self.saguaro_c)[0]
        token = int(torch.multinomial(q, 1, generator=self.generator))
        logq = q.log()
        if logq.numel() < self.out_vocab:
            logq = torch.nn.functional.pad(logq, (0, self.out_vocab - logq.numel()), value=float("-inf"))
        return token, logq

    # ----- the trunk -------------------------------------------------------------------------------------
    def _crop(self, n: int) -> None:
        drop = len(self.ids) - n
        if drop > 0:
            self.cache.crop(-drop)
            del self.ids[n:]
            self._last = None
        # A record at position p describes the token after p: it is valid only while token p is held.
        for p in [p for p in self.top if p >= n or p < n - 1024]:
            del self.top[p]

    def sync(self, context: list[int], record_from: int | None = None) -> torch.Tensor:
        """Make the trunk hold `context`; return the processed draft probabilities for the next token.

        Positions from `record_from` on (default: the last) get their top probabilities recorded, which the
        outcome prediction of the round reads.
        """
        plan = self._sync_plan(context, record_from)
        if not isinstance(plan, tuple):
            return plan  # already synced: the cached probabilities
        keep, new, first = plan
        positions = self.view.positions(keep, len(context)).unsqueeze(0)
        mask = self.view.valid(len(context)).unsqueeze(0) if self.view.padded else None
        logits = self._forward(self._ids([new]), positions, self.cache, mask, keep_last=len(context) - first)[0]
        self.ids.extend(new)
        probs = None
        for i, pos in enumerate(range(first, len(context))):
            probs = self._probs_for(context[: pos + 1], logits[i])
            self.top[pos] = self._top(probs)
        self._last = (len(context), probs)
        return probs

    def _sync_plan(self, context: list[int], record_from: int | None):
        """The cached probabilities if the trunk already holds `context`; else crop the trunk to what it shares
        with `context` and return (kept length, tokens to feed, first position to record)."""
        last = len(context) - 1
        if self._last is not None and self._last[0] == len(context) and self.ids == context:
            return self._last[1]
        keep = min(common_prefix(self.ids, context), last)
        self._crop(keep)
        return keep, context[keep:], max(keep, last if record_from is None else min(record_from, last))

    def _probs_for(self, context: list[int], logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self._process(context, logits), dim=-1)

    def draft(self, context: list[int], n: int, fanout: list[int], stop_below: float = 0.0) -> DraftResult:
        """Plain sequential drafting of n tokens after `context` (the SD path, used by fallbacks).

        `stop_below` > 0: stop after the first token drawn where the draft's top probability is below it (that
        token is still proposed), the confidence stop of `fallback.draft_until_unsure`.
        """
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        seq = list(context)
        for j in range(n):
            probs = self.sync(seq)
            token, logq = self._choose(probs, fanout[j] if j < len(fanout) else 0)
            tokens.append(token)
            if logq is not None:
                rows.append(logq)
            seq.append(token)
            if stop_below > 0 and j < n - 1 and float(probs.max()) < stop_below:
                break
        return DraftResult(tokens, torch.stack(rows) if rows else None)

    def record(self, context: list[int], record_from: int) -> None:
        """Make sure the top probabilities at positions record_from.. of `context` are known (forward if not)."""
        if self.ids == context and all(p in self.top for p in range(record_from, len(context))):
            return  # e.g. an adopted branch that was fully fed during pre-drafting
        self.sync(context, record_from)

    def holds_but_last(self, context: list[int], candidates: list[int]) -> bool:
        """Whether the trunk holds `context` and every candidate but the last, with the draft's top lists from
        the context's last position on. Then a job needs no record forward: the last candidate is fed by a row of
        the first tree step (`tree_steps(last=...)`), in the same forward as the other branches."""
        n = len(context) + len(candidates) - 1
        return (bool(candidates) and len(self.ids) == n and self.ids == context + candidates[:-1]
                and all(p in self.top for p in range(len(context) - 1, n)))

    def candidate_tops(self, context_len: int, n: int) -> list[TopProbs]:
        """Top probabilities predicting candidates 1..n and the token after them (trunk must hold them)."""
        return [self.top[context_len - 1 + j] for j in range(n + 1)]

    # ----- batched pre-drafting ---------------------------------------------------------------------------
    # What the generator asks of a drafter, the same for both paths (static_draft.StaticDrafter overrides them).
    defers_record = True  # tree_steps(last=...): the static path records with a forward of its own
    path = "dynamic"  # named in the stats

    def release(self) -> None:
        """Give back what the call held (nothing here: the static path's buffers go back to their pool)."""

    def start_tree(self, context_len: int, outcomes: list[Outcome]) -> TreeBatch:
        """Rows for the outcomes of the round in flight: row r starts from the trunk's first L0 + k_r columns (one
        direct gather from the single-row trunk, on the critical path's clock)."""
        T = len(self.ids)
        width, offsets = T, [T - context_len - o.accepted for o in outcomes]
        shifted = torch.arange(T, device=self.device) - torch.tensor(offsets, device=self.device).unsqueeze(1)
        index = shifted.clamp(min=0)
        mask = self.view.valid(T)[index] * (shifted >= 0)
        cache = self._new_cache()
        for i, layer in enumerate(self.cache.layers):
            if holds_tensors(layer):
                k, v = layer.keys[0], layer.values[0]  # [heads, T, dim]
                cache.update(k[:, index].transpose(0, 1), v[:, index].transpose(0, 1), i)
        ids, top = list(self.ids), dict(self.top)
        prefix = [ids[: context_len + o.accepted] for o in outcomes]
        return TreeBatch(cache, width, prefix, [top] * len(outcomes), offsets, mask)

    def tree_steps(
        self,
        tree: TreeBatch,
        outcomes: list[Outcome],
        gamma: int,
        fanout: list[int],
        should_stop: Callable[[], bool],
        on_step: Callable[[int], None] | None = None,
        last: tuple[int, Callable[[TopProbs, int | None], tuple[float, list[Outcome]]]] | None = None,
    ) -> list[tuple[BranchState, DraftResult]]:
        """Draft up to gamma tokens for every outcome, one batched forward per token, stopping early on request.

        A last step feeds the gamma-th token too: it costs nothing on the critical path and gives the draft's
        distribution after the branch, which the next round's outcome prediction needs. Rows that are done
        before the others (the `last` rows left without an outcome) feed a filler token their state never reads.

        `last` = (r, extra, n): rows r .. r + n - 1 are the outcome (g - 1, c_g), g candidates with c_g the last:
        their prefix is the trunk and their first feed c_g, whose distribution predicts the bonus of outcome
        k = g (the record forward, riding in the first step). After that step row r goes on as the branch of
        (g, t), t its first drafted token (the same computation), and `extra(top, t)` returns (P(g, t), more
        outcomes (g, bonus)), which the other n - 1 rows take, feeding their bonus from the next step on (a row
        left without one drafts nothing).
        """
        states = [BranchState(tree, r, o) for r, o in enumerate(outcomes)]
        results = [DraftResult([], None) for _ in outcomes]
        rows: list[list] = [[] for _ in outcomes]  # sampling: each drafted token's log-probabilities
        contexts = [tree.prefix[r] + [o.bonus] for r, o in enumerate(outcomes)]
        pos = [len(tree.prefix[r]) for r in range(len(outcomes))]  # sequence index of each row's next feed
        while not should_stop() and any(st.fed < gamma + 1 for st in states):
            b = len(states)
            tree.mask = torch.cat([tree.mask, tree.mask.new_ones(b, 1)], dim=1)
            feed = self._ids([[c[-1]] for c in contexts])
            # Position ids: sequence index less the masked prompt columns.
            positions = (torch.tensor(pos, device=self.device) - self.view.shift()).unsqueeze(1)
            logits = self._forward(feed, positions, tree.cache, tree.mask)
            probs = self._probs_rows(contexts, logits[:, -1])
            values, ids = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)
            # One view per row at once (indexing row by row is two tensor creations per row between steps).
            vrows, irows = values.cpu().unbind(0), ids.cpu().unbind(0)
            greedy = None if self.do_sample else probs.argmax(-1).tolist()
            for r in range(b):
                pos[r] += 1
                if states[r].fed >= gamma + 1:  # done: a filler feed (its last token again), nothing recorded
                    continue
                states[r].top[pos[r] - 1] = (vrows[r], irows[r])
                states[r].fed += 1
                tokens = results[r].tokens
                if len(tokens) >= gamma:
                    continue
                if greedy is not None:
                    token, logq = greedy[r], None
                else:
                    token, logq = self._choose(probs[r], fanout[len(tokens)] if len(tokens) < len(fanout) else 0)
                tokens.append(token)
                if logq is not None:
                    rows[r].append(logq)
                contexts[r].append(token)
            if last is not None:
                self._rebase_last(tree, last, states, results, rows, contexts)
                last = None
            if on_step is not None:
                on_step(len(tree.mask[0]) - tree.width - 1)
        for r in range(len(states)):
            if rows[r]:
                results[r].logits = torch.stack(rows[r])
        return list(zip(states, results))

    def _rebase_last(self, tree: TreeBatch, last, states, results, rows, contexts) -> None:
        """After the first step: the `last` rows have fed c_g; the first becomes the branch of (g, its first
        drafted token), the others those of more likely (g, bonus) outcomes. See `tree_steps`."""
        r, extra, n = last
        st = states[r]
        top = st.top[len(tree.prefix[r])]  # after c_g: it predicts the bonus of k = g
        first = results[r].tokens[0] if results[r].tokens else None
        prob, more = extra(top, first)
        prefix = tree.prefix[r] + [st.outcome.bonus]
        # Row r is already the computation a row of (g, first) does (its bonus is fed next); the others feed
        # their own bonus next instead of the token they drew. Rows without an outcome sit out as fillers.
        new = [Outcome(st.outcome.accepted + 1, first, prob)] if first is not None else []
        new += list(more)
        for i in range(n):
            row = r + i
            state = states[row]
            if i >= len(new):  # (`extra` never returns `first` again)
                state.fed = 10**9  # never fed again, never recorded
                results[row].tokens, rows[row] = [], []
                continue
            tree.prefix[row] = list(prefix)
            state.outcome = new[i]
            state.fed = 0
            results[row].tokens, rows[row] = [], []
            contexts[row] = prefix + [new[i].bonus]

    def adopt(self, state: BranchState, tokens: list[int]) -> None:
        """Make the trunk the branch's cache: the row's prefix, then bonus + drafts.

        `tokens` are the candidates taken from the branch; of the fed columns, those up to the last
        candidate are kept.
        """
        tree, r, o = state.batch, state.row, state.outcome
        keep = state.start
        fed = min(state.fed, len(tokens) + 1)
        cache = self._new_cache()
        # The row's valid columns are contiguous: its prefix right-aligned, then the fed tokens.
        lo = tree.offsets[r]
        hi = lo + keep + fed
        for i, layer in enumerate(tree.cache.layers):
            if not holds_tensors(layer):
                continue
            cache.update(layer.keys[r : r + 1, :, lo:hi].clone(), layer.values[r : r + 1, :, lo:hi].clone(), i)
        self.cache = cache
        self.ids = tree.prefix[r] + [o.bonus] + tokens[: fed - 1]
        self.top = {p: t for p, t in tree.prefix_top[r].items() if p < keep}
        self.top.update({p: state.top[p] for p in range(keep, keep + fed)})
        self._last = None
