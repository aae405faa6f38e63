"""A model's KV cache for a batch whose rows advance by different amounts each round.

Every forward appends the same number of columns to every row (a block); columns a row does not own (padding
of a shorter block, candidates the target rejected) stay in the cache but are masked out of attention for
good, and each row's tokens get explicit positions (its own count of real tokens so far), so a row sees exactly
the keys it would see alone. When masked columns pile up, `compact` moves every row's attended columns to the
right end (RoPE is already applied to cached keys, so moving a column changes nothing it computes).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..drafting.kvcache import forward_params, holds_tensors, new_cache

COMPACT_WASTE = 0.25  # compact when masked columns exceed this share of the cache (and at least COMPACT_MIN)
COMPACT_MIN = 32
SPARE_COLUMNS = 64  # a job buffer's columns beyond what its first job needs (`RaggedCache.branch`)
# A job buffer's rows are a multiple of this: the next job's copies often number a few more (a row's outcomes vary),
# and a buffer one row short is allocated anew, its memory's page faults paid again (simulated device, B = 8: a
# second job's copy took 11-14 ms where 125 copies were followed by 127).
SPARE_ROWS = 32
_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
_LINEAGES = itertools.count()  # `RaggedCache.lineage`: unique over the process, so no two calls' rows share one


@dataclass
class JobBuffers:
    """The buffers speculation jobs copy rows into (`RaggedCache.branch`), kept from one job to the next: per layer
    (keys, values), and per buffer row the (lineage, columns) of the row it holds a copy of, or None. `grown`:
    whether the last `branch` allocated them anew (its copies then paid fresh memory's page faults once)."""

    layers: dict = field(default_factory=dict)
    slots: list = field(default_factory=list)
    grown: bool = False


class RaggedCache:
    def __init__(self, model, out_vocab: int | None = None):
        self.model = model
        self.device = model.device
        params = forward_params(model)
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" in params
        self._pos_kw = "position_ids" in params
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self.in_vocab = getattr(emb, "num_embeddings", None)  # ids past the embedding (a padded pair) read as 0
        self.out_vocab = out_vocab
        self.cache = new_cache()
        self.mask: torch.Tensor | None = None  # [rows, columns] long: 1 where the row attends
        # [rows, columns] long: j >= 1 where a column holds this round's candidate j (the row keeps it only if it
        # accepts j: `settle`), 0 for confirmed columns.
        self.tag: torch.Tensor | None = None
        # Per row, an id of its columns' history (None: not given yet, `_lineages`). A row's keys and values are
        # only ever appended to, so two rows of one lineage agree on their common columns; compacting starts a
        # new one. A job's copy of a row then needs only the columns added since the last job copied it (`branch`).
        self.lineage: list[int] | None = None
        self.forwards = 0
        # `output_attentions` / `output_hidden_states` asked of each forward (one prompt's `return_dict_in_generate`);
        # the last forward's (attentions, hidden_states) are kept in `internals`.
        self.ask: dict = {}
        self.internals: tuple | None = None
        # A sliding window counts columns, not positions: such a model needs each row's attended columns
        # contiguous (compacted after every round that masked some), or its windows would reach too far back.
        try:
            layers = DynamicCache(config=model.config).layers
        except Exception:  # noqa: BLE001 - a config DynamicCache cannot describe: assume windows
            layers = [None]
        self.sliding = any(type(layer) is not DynamicLayer for layer in layers)
        # A padded first block runs as one batched forward where the attention gives a padding query with nothing
        # to attend to a finite output (SDPA since torch 2.5, flash attention: what transformers' own batched
        # generate relies on); eager attention makes it NaN, so there each row's prompt runs alone (`_prefill`).
        # Batched, the real pair's 8-prompt prefill took 14.0-14.8 s against 16.4-16.8 s row by row.
        attn = getattr(model.config, "_attn_implementation", None) or "eager"
        self.batched_prefill = (attn == "sdpa" and _TORCH >= (2, 5)) or attn.startswith("flash_attention")

    @property
    def columns(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def block(self, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
              tag: int | torch.Tensor = 0) -> tuple:
        """The next block ([rows, W] ids, valid flags, positions, candidate tags) on the model's device, with the
        cache's mask and tags extended by it, ready for `run` (no other block may run in between). A caller builds
        it before it starts a speculation job: each tensor op waits for the interpreter lock, which the job's
        Python holds in turns (simulated device, B = 8: these ops took 1.4-2.3 ms a round beside a starting job,
        0.16 ms alone)."""
        valid = valid.to(device=self.device, dtype=torch.long)
        tags = (torch.zeros_like(valid) + torch.as_tensor(tag, device=self.device)) * valid
        ids = ids.to(self.device)
        if self.in_vocab is not None:
            ids = ids.masked_fill(ids >= self.in_vocab, 0)
        prefill = self.mask is None and not bool(valid.all()) and not self.batched_prefill
        mask = valid if self.mask is None or prefill else torch.cat([self.mask, valid], dim=1)
        tag_after = tags if self.tag is None else torch.cat([self.tag, tags], dim=1)
        return ids, valid, positions.to(self.device), mask, tag_after, prefill, self.columns

    def forward(self, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, keep_last: int,
                tag: int | torch.Tensor = 0) -> torch.Tensor:
        """Append a block ([rows, W] ids, valid flags, positions, candidate tags); float logits of its last
        `keep_last` columns."""
        return self.run(self.block(ids, valid, positions, tag), keep_last)

    @torch.no_grad()
    def run(self, block: tuple, keep_last: int, launched: Callable[[], None] | None = None) -> torch.Tensor:
        """`forward` of a block built by `block` on the cache as it was then; `launched` is called just before
        the model's forward."""
        ids, valid, positions, mask, tag, prefill, columns = block
        if columns != self.columns:
            raise RuntimeError("hf_ssd internal error: a block ran on a cache that changed after it was built")
        if prefill:
            if launched is not None:
                launched()
            logits = self._prefill(ids, valid, keep_last)
        else:
            self.mask = mask
            if launched is not None:
                launched()
            logits = self._model(ids, mask, positions, self.cache, keep_last).logits
            logits = logits[:, -keep_last:].float()
        self.tag = tag
        return logits

    def _model(self, ids, mask, positions, cache, keep_last: int):
        kwargs = {self._cache_kw: cache}
        if self._keep_kw:
            kwargs["logits_to_keep"] = keep_last
        if self._pos_kw:
            kwargs["position_ids"] = positions
        out = self.model(input_ids=ids, attention_mask=mask, use_cache=True, **kwargs, **self.ask)
        self.forwards += 1
        if self.ask:
            self.internals = (getattr(out, "attentions", None), getattr(out, "hidden_states", None))
        if self.out_vocab is not None:
            out.logits = out.logits[..., : self.out_vocab]
        return out

    def _prefill(self, ids: torch.Tensor, valid: torch.Tensor, keep_last: int) -> torch.Tensor:
        """The first block of a padded batch: each row's tokens alone, then the caches stitched, left-padded with
        masked zero columns. (Padding queries with nothing to attend to would make eager attention produce NaN
        states, which reach every later query through the masked columns' values.)"""
        width = ids.shape[1]
        counts = valid.sum(dim=1).tolist()
        if not bool((valid == (torch.arange(width, device=self.device)[None, :] >= width - valid.sum(1, keepdim=True)))
                    .all()) or min(counts) < keep_last:
            raise ValueError("hf_ssd internal error: a first block must be right-aligned and hold keep_last tokens")
        caches, logits = [], []
        for row, n in enumerate(counts):
            cache = new_cache()
            out = self._model(ids[row : row + 1, width - n:], None, torch.arange(n, device=self.device)[None, :],
                              cache, keep_last)
            caches.append(cache)
            logits.append(out.logits[:, -keep_last:].float())
        self.cache = caches[0]
        for i, layer in enumerate(self.cache.layers):
            if holds_tensors(layer):
                for name in ("keys", "values"):
                    parts = [getattr(c.layers[i], name) for c in caches]
                    setattr(layer, name, torch.cat([torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0))
                                                    for t in parts]))
        self.mask, self.lineage = valid, None
        return torch.cat(logits)

    def settle(self, accepted: torch.Tensor) -> None:
        """Verification done: row i keeps the candidate columns it accepted (tags <= accepted[i]); all confirmed."""
        if self.mask is None:
            return
        self.mask = self.mask.masked_fill(self.tag > accepted.to(self.device)[:, None], 0)
        self.tag = torch.zeros_like(self.tag)

    def gather(self, sources: list[tuple[RaggedCache, int]]) -> RaggedCache:
        """A new cache (of this model) whose row r is row sources[r][1] of cache sources[r][0]; narrower caches'
        rows are right-padded with masked columns. Used to copy rows for speculation and to adopt them."""
        caches = list({id(c): c for c, _ in sources}.values())
        width = max(c.columns for c in caches)
        # Only the rows taken are copied: adopting 8 rows out of a job's 128 copies must not copy all 128.
        groups = {id(c): [i for i, (src, _) in enumerate(sources) if src is c] for c in caches}
        picks = [torch.tensor([sources[i][1] for i in groups[id(c)]], device=self.device) for c in caches]
        # The concatenation holds the picks grouped by cache; `order` puts them back in the order of `sources`.
        order = None if len(caches) == 1 else torch.argsort(
            torch.tensor([i for c in caches for i in groups[id(c)]], device=self.device))

        def stack(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
            parts = []
            for t, pick in zip(tensors, picks):
                t = t.index_select(0, pick)
                if t.shape[dim] < width:
                    t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1 - dim) + (0, width - t.shape[dim]))
                parts.append(t)
            return parts[0] if order is None else torch.cat(parts)[order]

        out = copy.copy(self)
        out.cache = new_cache()
        for i, layer in enumerate(self.cache.layers):
            if holds_tensors(layer):
                keys = stack([c.cache.layers[i].keys for c in caches], 2)
                values = stack([c.cache.layers[i].values for c in caches], 2)
                # The layer is created by an empty update and then holds the copies: `update` would concatenate
                # them to its empty tensors, copying every branch's rows a second time.
                out.cache.update(keys[:, :, :0], values[:, :, :0], i)
                out.cache.layers[i].keys, out.cache.layers[i].values = keys, values
        out.mask = stack([c.mask for c in caches], 1)
        out.tag = stack([c.tag for c in caches], 1)
        lineages = {id(c): c._lineages() for c in caches}
        out.lineage, seen = [], set()
        for c, i in sources:  # a row taken twice forks: its second copy starts a lineage of its own
            out.lineage.append(lineages[id(c)][i] if (id(c), i) not in seen else next(_LINEAGES))
            seen.add((id(c), i))
        return out

    def slot_order(self, rows: list[int], spare: JobBuffers) -> list[int]:
        """An order of copies of `rows` (row rows[i] for copy i) for `branch`: order[s] is the copy to put in
        buffer row s. A copy goes where the last job left a copy of the same lineage, so that `branch` copies only
        its new columns; the rest fill the other buffer rows in their order. (In the given order, a row's copies
        follow those of the rows before it, and a branch more or less for one row moved every later row's
        copies: later jobs reused 66-124 of their 121-128 copies.)"""
        lineage = self._lineages()
        waiting: dict[int, list[int]] = {}
        for i in reversed(range(len(rows))):
            waiting.setdefault(lineage[rows[i]], []).append(i)  # popped from the end: in the given order
        order: list[int | None] = [None] * len(rows)
        for slot, held in enumerate(spare.slots[: len(rows)]):
            if held is not None and waiting.get(held[0]):
                order[slot] = waiting[held[0]].pop()
        placed = {i for i in order if i is not None}
        rest = iter(i for i in range(len(rows)) if i not in placed)
        return [next(rest) if i is None else i for i in order]

    def branch(self, rows: list[int], room: int, spare: JobBuffers) -> RaggedCache:
        """A new cache whose row r is a copy of row rows[r] of this one, with room for `room` more columns, for a
        speculation job: its steps then write their columns in place, where a `DynamicLayer` would copy all its
        rows at every step. The copies go into `spare`'s buffers (kept by the caller from one job to the next and
        grown as needed): fresh memory costs its page faults again each time (tiny pair on CPU, 128 copies of 250
        columns: 1.4 ms a copy into new memory, 0.2 ms into a used buffer), and one job's copies are never read
        once the next starts (the rows taken from it are copied out, `gather`). A buffer row that already holds a
        copy of the same lineage (`lineage`: the last job gave it the same row) gets only the columns added since:
        a row grows by a few columns a round, so a job copies those of each of its copies, not all of them."""
        width = self.columns
        lineage = self._lineages()
        shapes = {}
        for i, layer in enumerate(self.cache.layers):
            if holds_tensors(layer):
                shapes[i] = [(len(rows), t.shape[1], width + room, t.shape[3]) for t in (layer.keys, layer.values)]
        fits = all(_fits(old, t, shape) for i, layer in enumerate(self.cache.layers) if i in shapes
                   for t, old, shape in zip((layer.keys, layer.values), spare.layers.get(i, (None, None)), shapes[i]))
        spare.grown = not fits
        if not fits:  # a new buffer holds no copies
            spare.slots = []
        spare.slots += [None] * (len(rows) - len(spare.slots))
        # Per first column to copy (where the buffer row's copy of the same lineage ends, else 0): its buffer rows
        # and the rows they copy.
        starts: dict[int, tuple[list[int], list[int]]] = {}
        for slot, r in enumerate(rows):
            held = spare.slots[slot]
            start = held[1] if held is not None and held[0] == lineage[r] and held[1] <= width else 0
            starts.setdefault(start, ([], []))
            starts[start][0].append(slot)
            starts[start][1].append(r)
            spare.slots[slot] = (lineage[r], width)
        index = {start: tuple(torch.tensor(x, device=self.device) for x in pair) for start, pair in starts.items()
                 if start < width}
        out = copy.copy(self)
        out.cache = new_cache()
        for i, layer in enumerate(self.cache.layers):
            if i not in shapes:
                continue
            bufs = []
            for t, old, shape in zip((layer.keys, layer.values), spare.layers.get(i, (None, None)), shapes[i]):
                if not fits:
                    # Headroom, so that a call's growing rows reuse one buffer for many rounds.
                    rows_held = -(-max(shape[0], 0 if old is None else old.shape[0]) // SPARE_ROWS) * SPARE_ROWS
                    old = t.new_empty((rows_held, shape[1], shape[2] + SPARE_COLUMNS, shape[3]))
                bufs.append(old)
            spare.layers[i] = tuple(bufs)
            out.cache.update(layer.keys[:, :, :0], layer.values[:, :, :0], i)  # creates layer i (any version)
            out.cache.layers[i] = _RoomyLayer(*(b[: len(rows), :, : width + room] for b in bufs), width)
            for t, b in zip((layer.keys, layer.values), bufs):
                for start, (slots, picks) in index.items():
                    b[:, :, start:width].index_copy_(0, slots, t[:, :, start:width].index_select(0, picks))
        pick = torch.tensor(rows, device=self.device)
        out.mask = self.mask.index_select(0, pick)
        out.tag = self.tag.index_select(0, pick)
        out.lineage = [lineage[r] for r in rows]
        return out

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (finished rows stop costing work)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            if holds_tensors(layer):
                layer.keys, layer.values = layer.keys[index], layer.values[index]
        if self.mask is not None:
            self.mask, self.tag = self.mask[index], self.tag[index]
        if self.lineage is not None:
            self.lineage = [self.lineage[r] for r in rows]

    def _lineages(self) -> list[int]:
        """Each row's lineage (`lineage`), new ones given where it has none."""
        if self.lineage is None or len(self.lineage) != self.mask.shape[0]:
            self.lineage = [next(_LINEAGES) for _ in range(self.mask.shape[0])]
        return self.lineage

    def maybe_compact(self) -> None:
        """Drop masked columns once they are a large share of the cache (memory and attention time), or at once
        where a sliding window needs each row contiguous."""
        if self.mask is None:
            return
        cols = self.mask.shape[1]
        counts = self.mask.sum(dim=1)
        need = int(counts.max())
        if self.sliding:
            first = torch.where(counts > 0, self.mask.argmax(dim=1), cols)  # each row's first attended column
            if bool((counts == cols - first).all()):
                return  # every row contiguous up to the last column
        elif cols - need < max(COMPACT_MIN, COMPACT_WASTE * cols):
            return
        # Per row: its attended columns in order, right-aligned; the columns left of them are masked filler.
        order = torch.argsort(self.mask, dim=1, stable=True)[:, cols - need:]  # masked first, then attended
        for layer in self.cache.layers:
            if holds_tensors(layer):
                base = order[:, None, :, None]
                layer.keys = layer.keys.gather(2, base.expand(*layer.keys.shape[:2], need, layer.keys.shape[-1]))
                layer.values = layer.values.gather(
                    2, base.expand(*layer.values.shape[:2], need, layer.values.shape[-1]))
        self.mask = self.mask.gather(1, order)
        self.tag = self.tag.gather(1, order)
        self.lineage = None  # columns moved: every row starts a new lineage


def _fits(old: torch.Tensor | None, t: torch.Tensor, shape: tuple) -> bool:
    """Whether buffer `old` can hold `shape` copies of layer tensor `t`'s rows."""
    return not (old is None or old.dtype != t.dtype or old.device != t.device or old.shape[1] != shape[1]
                or old.shape[3] != shape[3] or old.shape[0] < shape[0] or old.shape[2] < shape[2])


class _RoomyLayer(DynamicLayer):
    """A layer over preallocated [rows, heads, columns, dim] buffers whose first `length` columns are filled:
    `update` writes the new columns in place (past the room, it concatenates as a `DynamicLayer` does). `keys`
    and `values` are views of the filled columns, as a `DynamicLayer`'s tensors are read."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.buffers, self.length = (keys, values), length
        self.device, self.is_initialized = keys.device, True
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self.buffers[0].shape[2]:
            self.buffers = (torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2))
        else:
            self.buffers[0][:, :, self.length : end] = key_states
            self.buffers[1][:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self.buffers[0][:, :, :end], self.buffers[1][:, :, :end]
        return self.keys, self.values
