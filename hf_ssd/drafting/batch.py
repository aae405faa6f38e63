"""The draft model over the live rows of a batch: per drafted position one batched forward for all rows.

Columns the draft fed for this round's candidates carry a tag (candidate j: tag j) until verification says how
many each row keeps (`RaggedCache.settle`). Each drafted position also records the draft's top tokens, from
which the speculator predicts the round's outcomes (speculate.py).
"""

from __future__ import annotations

import torch

from ..loop.ragged import JobBuffers, RaggedCache
from .drafter import CONTEXT_FREE, saguaro_q


class BatchDrafter:
    def __init__(self, model, out_vocab: int, do_sample: bool, processors, pad: int, top_k: int = 8,
                 generator: torch.Generator | None = None, saguaro_c: float | None = None):
        own = model.config.get_text_config().vocab_size
        self._kv = RaggedCache(model, out_vocab=min(own, out_vocab))
        self._adopting: list | None = None  # the sources of an adoption not copied yet (`adopt`)
        self.vocab = out_vocab  # the target's: q rows are compared with the target's p
        self.do_sample = do_sample
        procs = list(processors or [])
        # Context-free warpers (temperature, top-k/p) shape the draft's q as they shape the target's p, which
        # raises acceptance; others (penalties) would need each row's context every step: q is then the raw
        # distribution (still exact: q is whatever the candidates were drawn from).
        self.processors = procs if procs and all(type(p).__name__ in CONTEXT_FREE for p in procs) else None
        self.pad = pad
        self.top_k = min(top_k, out_vocab)  # a tiny vocabulary has fewer tops than the widest fan-out ranks
        self.generator = generator  # the draft's own draws (also on the speculator's thread)
        self.spare = JobBuffers()  # the speculation jobs' copies of the rows, reused (`RaggedCache.branch`)
        self.saguaro_c = saguaro_c if do_sample else None  # `draw`

    @property
    def kv(self) -> RaggedCache:
        """The draft's cache of the live rows; an adoption still pending (`adopt`) is copied first."""
        if self._adopting is not None:
            sources, self._adopting = self._adopting, None
            self._kv = self._kv.gather(sources)
            self._kv.maybe_compact()
        return self._kv

    @property
    def forwards(self) -> int:
        return self._kv.forwards

    def adopt(self, sources: list[tuple[RaggedCache, int]]) -> None:
        """Row r's draft state becomes row sources[r][1] of cache sources[r][0] (`RaggedCache.gather`): a hit
        row's branch of the last job, or its own row. The copy waits for the next use of the cache, which is
        usually the next job's, beside its verify: on the caller's path it took 0.4-0.6 ms a round (simulated
        device, B = 8, 128 branches). Until then the sources stay as they are: a job's copies are overwritten
        only by the next job's, which reads `kv` first."""
        self._adopting = sources

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (finished rows leave)."""
        if self._adopting is not None:
            self._adopting = [self._adopting[i] for i in rows]
        else:
            self._kv.select(rows)

    def compact(self) -> None:
        if self._adopting is None:  # else the copy compacts (`kv`)
            self._kv.maybe_compact()

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] < self.vocab:
            logits = torch.nn.functional.pad(logits, (0, self.vocab - logits.shape[-1]), value=float("-inf"))
        if self.processors is not None:
            ids = torch.zeros(logits.shape[0], 1, dtype=torch.long, device=logits.device)  # never read
            for p in self.processors:
                logits = p(ids, logits)
        return torch.softmax(logits, dim=-1)

    def choose(self, probs: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0] if self.do_sample else probs.argmax(-1)

    def draw(self, probs: torch.Tensor, cached) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's token, the distribution q it was drawn from): with Saguaro sampling (`saguaro_c`), q scales
        row i's `cached[i]` likeliest tokens, the bonuses a job will hold there (`saguaro_q`)."""
        if self.saguaro_c is None or max(cached, default=0) <= 0:
            return self.choose(probs), probs
        q = saguaro_q(probs, cached, self.saguaro_c)
        return self.choose(q), q

    def top_table(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, top_k] probabilities and ids of each row's most likely tokens, on the CPU."""
        values, ids = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)
        return values.cpu(), ids.cpu()

    def tops(self, probs: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        values, ids = self.top_table(probs)
        return [(values[i], ids[i]) for i in range(probs.shape[0])]

    def propose(self, rows, n: list[int], stop: float = 0.0,
                cached: list[int] = ()) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Up to n[i] candidates for row i; rows with n[i] = 0 take no part (their columns are masked filler).

        All taking part draft max(n) tokens and keep their first n[i]; per row it records the tokens fed as
        confirmed (`draft_feed`), the candidate columns fed (`tagged`), the draft's top tokens at every position
        it drafted (`tops`), and when sampling returns the distribution each candidate was drawn from.

        `stop` > 0 (confidence-stopped SD): a row's candidates end after the first token at which the draft's top
        probability is below `stop` (that token kept), as `Drafter.draft(stop_below=)` does for one prompt: the
        decision reads only the row's own draft distribution, so the verification stays exact (fallback.py,
        `draft_until_unsure`). Rows that stopped draft on while others go on (a batched step costs the rows it
        holds) and so keep the draft's distribution after their last candidate; drafting ends when every row
        has stopped. `cached[j]`: the bonuses the next job will hold for a rejection of candidate j (`draw`)."""
        n = list(n)
        steps = max(n)
        active = [k > 0 for k in n]
        feeds = [row.real[row.draft_fed:] if a else [] for row, a in zip(rows, active)]
        nxt = torch.tensor([[len(row.real)] for row in rows])
        on = torch.tensor(active, dtype=torch.long)[:, None]
        logits = self.kv.forward(*self._feed(rows, feeds), keep_last=1)[:, -1]
        tokens, dists, tops = [], [], []
        for j in range(steps):
            probs = self.probs(logits)
            token, q = self.draw(probs, [cached[j]] * len(rows) if j < len(cached) else ())
            tokens.append(token)
            tops.append(self.tops(probs))
            if self.do_sample:
                dists.append(q)
            if stop > 0:
                for i, (values, _) in enumerate(tops[j]):
                    if n[i] > j + 1 and float(values[0]) < stop:
                        n[i] = j + 1
            if j >= max(n) - 1:
                break  # the last candidate is fed by the speculator, or next round if it is accepted
            logits = self.kv.forward(token[:, None], on, nxt + j, keep_last=1, tag=j + 1)[:, -1]
        steps = len(tokens)
        drafted = torch.stack(tokens, dim=1).tolist()
        out, q = [], []
        for i, row in enumerate(rows):
            if not active[i]:
                out.append([])
                q.append(None)
                continue
            row.draft_feed, row.tagged = len(feeds[i]), steps - 1
            row.tops = [t[i] for t in tops[: n[i]]] + ([tops[n[i]][i]] if n[i] < steps else [None])
            out.append(drafted[i][: n[i]])
            q.append(torch.stack([d[i] for d in dists])[: n[i]] if self.do_sample else None)
        return out, q

    def prefill(self, rows) -> int:
        """Feed every row's prompt while the target's prefill yields the first token. Each row's `tops` then hold
        the draft's top tokens after its prompt: the prefill round's job ranks the first token (the bonus it
        pre-drafts for) from them instead of from a step of its own, so its branches hold a token more in the steps
        that fit beside the target's prefill. Returns the tokens fed."""
        feeds = [row.real[row.draft_fed:] for row in rows]
        if not all(feeds):  # a row without a token to read (it has read all): the first drafting round feeds it
            return self.catch_up(rows, rows)
        logits = self.kv.forward(*self._feed(rows, feeds), keep_last=1)[:, -1]
        values, ids = self.top_table(self.probs(logits))
        for i, (row, feed) in enumerate(zip(rows, feeds)):
            row.draft_fed += len(feed)
            row.tops = [(values[i], ids[i])]
        return sum(map(len, feeds))

    def catch_up(self, rows, lagging) -> int:
        """Feed the rows of `lagging` (some of `rows`) what they have not read but their last token, in one batched
        forward; the others take no part. Returns the tokens fed (none where the draft has read nothing and some
        row has nothing to feed: a first block must hold a token of every row, and the drafting round feeds it)."""
        which = {id(r) for r in lagging}
        feeds = [row.real[row.draft_fed : len(row.real) - 1] if id(row) in which else [] for row in rows]
        if not any(feeds) or (self.kv.mask is None and not all(feeds)):
            return 0
        self.kv.forward(*self._feed(rows, feeds), keep_last=1)
        for row, feed in zip(rows, feeds):
            row.draft_fed += len(feed)
        return sum(map(len, feeds))

    def _feed(self, rows, feeds: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, valid, positions) of each row's tokens `feeds[i]` after its `draft_fed` ones, right-aligned: every
        feeding row's last column is real."""
        width = max(len(f) for f in feeds)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.long)
        pos = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (row, feed) in enumerate(zip(rows, feeds)):
            if feed:
                ids[i, width - len(feed):] = torch.tensor(feed)
                valid[i, width - len(feed):] = 1
                pos[i, width - len(feed):] = torch.arange(row.draft_fed, row.draft_fed + len(feed))
        return ids, valid, pos

    def commit(self, rows, accepted: list[int]) -> None:
        """After verification: row i keeps the candidate columns it accepted (tags <= k); what it kept is
        confirmed, the next round feeds the rest of its tokens."""
        self.kv.settle(torch.tensor(accepted))
        for row, k in zip(rows, accepted):
            row.draft_fed += row.draft_feed + min(k, row.tagged)
            row.draft_feed = row.tagged = 0
