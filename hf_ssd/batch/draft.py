"""The draft model over the live rows of a batch: per drafted position one batched forward for all rows."""

from __future__ import annotations

import torch

from ..drafter import CONTEXT_FREE
from .ragged import RaggedCache


class BatchDrafter:
    def __init__(self, model, out_vocab: int, do_sample: bool, processors, pad: int):
        own = model.config.get_text_config().vocab_size
        self.kv = RaggedCache(model, out_vocab=min(own, out_vocab))
        self.vocab = out_vocab  # the target's: q rows are compared with the target's p
        self.do_sample = do_sample
        procs = list(processors or [])
        # Context-free warpers (temperature, top-k/p) shape the draft's q as they shape the target's p, which
        # raises acceptance; others (penalties) would need each row's context every step: q is then the raw
        # distribution (still exact: q is whatever the candidates were drawn from).
        self.processors = procs if procs and all(type(p).__name__ in CONTEXT_FREE for p in procs) else None
        self.pad = pad
        self._drafted = 0  # draft columns of the last `propose`, after its feed block
        self._fed: list[int] = []  # tokens of each row that block fed

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] < self.vocab:
            logits = torch.nn.functional.pad(logits, (0, self.vocab - logits.shape[-1]), value=float("-inf"))
        if self.processors is not None:
            ids = torch.zeros(logits.shape[0], 1, dtype=torch.long, device=logits.device)  # never read
            for p in self.processors:
                logits = p(ids, logits)
        return torch.softmax(logits, dim=-1)

    def propose(self, rows, n: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Up to n[i] candidates for row i (all rows draft max(n) tokens; a row keeps its first n[i]), and when
        sampling the distribution each was drawn from ([n[i], V] per row)."""
        steps = max(n)
        feeds = [row.real[row.draft_fed:] for row in rows]
        width = max(len(f) for f in feeds)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.long)
        pos = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (row, feed) in enumerate(zip(rows, feeds)):  # right-aligned: every row's last column is real
            ids[i, width - len(feed):] = torch.tensor(feed)
            valid[i, width - len(feed):] = 1
            pos[i, width - len(feed):] = torch.arange(row.draft_fed, row.draft_fed + len(feed))
        nxt = pos[:, -1:] + 1
        logits = self.kv.forward(ids, valid, pos, keep_last=1)[:, -1]
        tokens, dists = [], []
        for j in range(steps):
            probs = self._probs(logits)
            token = torch.multinomial(probs, 1)[:, 0] if self.do_sample else probs.argmax(-1)
            tokens.append(token)
            if self.do_sample:
                dists.append(probs)
            if j == steps - 1:
                break  # the last candidate is fed next round, if it is accepted
            logits = self.kv.forward(token[:, None], torch.ones(len(rows), 1), nxt + j, keep_last=1)[:, -1]
        self._drafted, self._fed = max(0, steps - 1), [len(f) for f in feeds]
        drafted = torch.stack(tokens, dim=1).tolist()
        q = [torch.stack([d[i] for d in dists])[: n[i]] if self.do_sample and n[i] else None for i in range(len(rows))]
        return [drafted[i][: n[i]] for i in range(len(rows))], q

    def commit(self, rows, accepted: list[int]) -> None:
        """After verification: row i keeps its drafted columns up to its accepted count k (candidate j was fed at
        drafted column j - 1; the last one never was)."""
        if self._drafted:
            cols = torch.arange(self._drafted)
            self.kv.keep(self._drafted, cols[None, :] < torch.tensor(accepted)[:, None])
        for row, f, k in zip(rows, self._fed, accepted):
            row.draft_fed += f + min(k, self._drafted)
        self._drafted, self._fed = 0, []
