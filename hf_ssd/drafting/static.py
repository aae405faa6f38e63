"""The static-shape draft path: preallocated KV caches, fixed one-token step shapes, no host sync in a step.

`StaticDrafter` has `Drafter`'s interface (it subclasses it) and produces the same candidates, but:

- the trunk (batch 1) and the tree (batch = the most outcomes a round can predict) each own a KV cache of a
  fixed maximum length, allocated once per draft model and reused across rounds and calls; a step writes its
  column in place (`index_copy_` at a column held in a device tensor), so every one-token step has one shape;
- step inputs (token ids, positions, the 4D mask, the column written) are preallocated tensors updated in
  place, so on CUDA each step is captured once as a CUDA graph and replayed (graphs.py);
- drafted tokens stay on the device until the round's tokens are needed (one pinned copy at the end): greedy
  picks with argmax, sampling with the exponential race (argmax q / E, E ~ Exp(1), an exact draw from q), and
  the top probabilities for outcome prediction are moved to the host once per round.

Column = position in the trunk. A tree row holds the trunk's columns [0, T) (context + candidates) and its own
drafted tokens in columns T, T+1, ...; its mask hides the candidates it assumes rejected. Multi-token feeds
(the prompt, a partly fed branch) run as one eager forward into the same static cache.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from ..speculation.outcomes import Outcome
from .drafter import BranchState, Drafter, DraftResult, saguaro_q
from .graphs import GraphCaptureError, StepRunner, host_list, to_device, to_host
from .kvcache import forward_params

logger = logging.getLogger("hf_ssd")

_ALIBI_TYPES = {"bloom", "mpt", "jais", "baichuan"}
_ATTENTION = ("eager", "sdpa")


def static_support(model) -> str | None:
    """None if the static path can drive `model`; otherwise why not (the dynamic path is used instead)."""
    config = model.config.get_text_config()
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in _ATTENTION:
        return f"attention implementation {impl!r} (the static path needs 'eager' or 'sdpa' for its 4D masks)"
    if getattr(config, "alibi", False) or getattr(config, "model_type", "") in _ALIBI_TYPES:
        return "ALiBi position biases"
    params = forward_params(model)
    if "position_ids" not in params or "attention_mask" not in params:
        return "a forward without position_ids/attention_mask"
    try:
        layers = DynamicCache(config=model.config).layers
    except Exception as err:  # noqa: BLE001 - any failure means: not a plain cache
        return f"its cache ({type(err).__name__})"
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return "a cache that is not plain full attention (sliding-window, linear or hybrid layers)"
    return None


# ----- the static cache ---------------------------------------------------------------------------------------
class _SlotLayer(CacheLayerMixin):
    """One layer of a preallocated cache: `update` writes the new keys/values at `rows.cols`, returns it all."""

    is_compileable = True
    is_sliding = False

    def __init__(self, rows: _Rows, index: int):
        super().__init__()
        self.rows, self.index = rows, index
        self.keys, self.values = rows.keys[index], rows.values[index]
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # preallocated: nothing to do
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        cols = self.rows.cols
        self.keys.index_copy_(2, cols, key_states)
        self.values.index_copy_(2, cols, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return self.rows.length

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class _Rows:
    """Preallocated buffers of one step shape: `batch` rows x one token, a cache of `max_len` columns."""

    def __init__(self, batch: int, max_len: int, kv: list[tuple], dtype, device):
        self.batch, self.max_len = batch, max_len
        self.neg = torch.finfo(dtype).min
        self.keys = [torch.zeros(batch, h, max_len, dk, dtype=dt, device=device) for h, dk, _, dt in kv]
        self.values = [torch.zeros(batch, h, max_len, dv, dtype=dt, device=device) for h, _, dv, dt in kv]
        self.step_cols = torch.zeros(1, dtype=torch.long, device=device)
        self.cols = self.step_cols  # what the layers write at; a chunk forward swaps in its own columns
        self.input_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.mask = torch.full((batch, 1, 1, max_len), self.neg, dtype=dtype, device=device)
        self.ids = torch.zeros(batch, max_len, dtype=torch.long, device=device)  # token by position (processors)
        self.length = 0
        # As a tree: rows [0, valid_rows) hold the trunk's columns [0, valid_cols) (kept by the drafter).
        self.valid_rows = self.valid_cols = 0
        self.cache = Cache(layers=[_SlotLayer(self, i) for i in range(len(kv))])


class _State:
    """Everything one draft model needs for the static path: buffers and step runners, reused across calls.

    One trunk (batch 1) and one tree per batch size in use (normally one: the most outcomes a round can
    predict; a round asking for more gets a larger tree, captured when first used).
    """

    def __init__(self, model, rows: int, max_len: int, cache_kw: str, keep_kw: bool, out_vocab: int, graphs: bool,
                 strict: bool):
        # Weakly: `_states` is keyed on the model, so a strong reference here would keep the model (and these
        # buffers, and on CUDA their graphs) alive until the process ends.
        self._model = weakref.ref(model)
        self.max_len, self.graphs, self.strict = max_len, graphs, strict
        self.cache_kw, self.keep_kw, self.out_vocab = cache_kw, keep_kw, out_vocab
        self.device, self.dtype = model.device, model.dtype
        self.kv = _probe_kv(model, cache_kw)
        self.arange = torch.arange(max_len, device=self.device)
        self._owner = None  # weak reference to the drafter using the buffers: a dropped drafter frees them
        self.trunk, self.trunk_step = self._rows(1, "trunk (batch 1)")
        self.trees: dict[int, tuple[_Rows, StepRunner]] = {}
        self.tree_for(rows)

    @property
    def model(self):
        return self._model()

    @property
    def busy(self) -> bool:
        return self._owner is not None and self._owner() is not None

    def take(self, owner) -> None:
        self._owner = weakref.ref(owner)

    def release(self) -> None:
        self._owner = None

    @property
    def rows(self) -> int:
        return max(self.trees)

    def _rows(self, batch: int, name: str) -> tuple[_Rows, StepRunner]:
        # Normal tensors even when generate runs under torch.inference_mode() (pipelines, the CLI): the
        # speculator thread, outside that mode, updates them in place, which inference tensors refuse.
        with torch.inference_mode(False):
            rows = _Rows(batch, self.max_len, self.kv, self.dtype, self.device)
        fn = _step_fn(self.model, rows, self.cache_kw, self.keep_kw, self.out_vocab)
        return rows, StepRunner(fn, self.graphs, self.strict, name, self.device)

    def tree_for(self, b: int) -> tuple[_Rows, StepRunner]:
        fitting = [n for n in self.trees if n >= b]
        if not fitting:
            self.trees[b] = self._rows(b, f"tree (batch {b})")
            fitting = [b]
        return self.trees[min(fitting)]

    def capture(self, strict: bool) -> None:
        """Capture the steps now (before the first round), so no capture runs next to a verification.

        `strict` (cuda_graphs=True) is this call's: a step whose capture failed in an earlier call raises too."""
        for rows, runner in [(self.trunk, self.trunk_step), *self.trees.values()]:
            runner.strict = strict
            if runner.failed is not None and strict:
                raise GraphCaptureError(f"hf_ssd could not capture the draft step {runner.name!r} as a CUDA graph "
                                        f"({runner.failed}). Use SSDConfig(cuda_graphs=None) to fall back to eager "
                                        "steps, or cuda_graphs=False.")
            if runner.captured or not self.graphs:
                continue
            rows.step_cols.zero_()
            rows.mask[..., 0].fill_(0.0)  # warm-up writes column 0 with a finite row (reset before use)
            with torch.no_grad():
                runner.capture()
            rows.mask.fill_(rows.neg)

    def fits(self, model, rows: int, max_len: int, out_vocab: int, graphs: bool) -> bool:
        return (self.rows >= rows and self.max_len >= max_len and self.graphs == graphs and self.out_vocab == out_vocab
                and self.device == model.device and self.dtype == model.dtype)


def _probe_kv(model, cache_kw: str) -> list[tuple]:
    """(heads, key dim, value dim, dtype) per layer, read from a one-token forward into a DynamicCache."""
    probe = DynamicCache(config=model.config)
    ids = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    with torch.no_grad():
        model(input_ids=ids, position_ids=ids, use_cache=True, **{cache_kw: probe})
    return [(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1], layer.keys.dtype)
            for layer in probe.layers]


def _step_fn(model, rows: _Rows, cache_kw: str, keep_kw: bool, out_vocab: int):
    kwargs = {cache_kw: rows.cache}
    if keep_kw:
        kwargs["logits_to_keep"] = 1
    ref = weakref.ref(model)  # the closure lives in `_states[model]`: it must not keep its key alive

    def step() -> torch.Tensor:
        out = ref()(input_ids=rows.input_ids, position_ids=rows.position_ids, attention_mask=rows.mask,
                    use_cache=True, **kwargs)
        return out.logits[:, -1, :out_vocab].float()

    return step


# draft model -> {graphs: _State}, reused across calls (one per graphs setting: switching never recaptures)
_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()


def _acquire(owner, model, rows: int, max_len: int, cache_kw: str, keep_kw: bool, out_vocab: int, graphs: bool,
             strict: bool) -> _State:
    """The model's cached state if it fits and is free; else a new one (cached unless another call holds it)."""
    with _states_lock:
        slots = _states.setdefault(model, {})
        state = slots.get(graphs)
        fits = state is not None and state.fits(model, rows, max_len, out_vocab, graphs)
        if fits and not state.busy:
            state.take(owner)
            return state
        shared = state is None or not state.busy
        if state is not None and not state.busy:
            rows, max_len = max(rows, state.rows), max(max_len, state.max_len)
    new = _State(model, rows, max_len, cache_kw, keep_kw, out_vocab, graphs, strict)
    new.take(owner)
    if shared:  # a concurrent call on the same draft keeps its own buffers; only a free slot is replaced
        with _states_lock:
            slots[graphs] = new
    return new


def max_len_for(max_length: int, gamma: int, on_cuda: bool) -> int:
    """Columns a call needs, `gamma` being the longest draft any option of the call can run.

    The trunk never passes max_length (a round's draft is clipped to the tokens left), but a tree row holds the
    trunk's T <= max_length - 1 columns and then its own gamma + 1 steps: max_length + gamma columns. On CUDA
    rounded up so graphs serve many calls."""
    need = max_length + gamma + 2
    return -(-need // 256) * 256 if on_cuda else need


# ----- the drafter ----------------------------------------------------------------------------------------------
@dataclass
class StaticTree:
    context_len: int  # L0: tokens before the candidates
    trunk_len: int  # T = L0 + g: columns copied from the trunk
    trunk_ids: list[int]
    trunk_top: dict
    serial: int  # which start_tree made it: only the latest tree's buffers are still intact
    rows: _Rows
    step: StepRunner


class StaticDrafter(Drafter):
    def __init__(self, model, logits_processor, do_sample: bool, top_k: int, saguaro_c: float | None = None,
                 generator: torch.Generator | None = None, out_vocab: int | None = None, *, max_len: int,
                 rows: int, graphs: bool = False, strict_graphs: bool = False):
        super().__init__(model, logits_processor, do_sample, top_k, saguaro_c, generator, out_vocab)
        self.cache = None  # the dynamic trunk cache is never used here
        self.state = _acquire(self, model, max(1, rows), max_len, self._cache_kw, self._keep_kw, self.out_vocab, graphs,
                              strict_graphs)
        self.trunk = self.state.trunk
        self.trunk.mask.fill_(self.trunk.neg)  # a new call: the trunk holds nothing
        for rows, _ in self.state.trees.values():
            rows.valid_rows = rows.valid_cols = 0
        self._dirty = 0  # lowest trunk column written since the latest start_tree
        self._serial = 0
        self._cuda = self.device.type == "cuda"
        if graphs:
            try:
                self.state.capture(strict_graphs)
            except BaseException:
                self.release()
                raise

    defers_record = False  # its tree is one fixed-shape batch: the record stays a forward of its own

    @property
    def path(self) -> str:
        return "static+graphs" if self.state.trunk_step.captured else "static"  # a failed capture runs eager

    def release(self) -> None:
        """Hand the buffers back for the next call on this draft model."""
        self.state.release()

    # ----- helpers ------------------------------------------------------------------------------------------
    def _wrote(self, col: int) -> None:
        self._dirty = min(self._dirty, col)
        for rows, _ in self.state.trees.values():
            rows.valid_cols = min(rows.valid_cols, col)

    def _check_len(self, n: int) -> None:
        if n > self.state.max_len:
            raise RuntimeError(f"hf_ssd internal error: the static draft cache holds {self.state.max_len} columns, "
                               f"{n} needed")

    def _process_rows(self, logits: torch.Tensor, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The generation's logits processors for rows whose contexts are ids[row(i), :lengths[i]]."""
        if not self._procs:
            return logits
        if self._context_free:
            return self.processor(ids[:1, :1].expand(logits.shape[0], 1), logits.clone())
        rows = ids.expand(logits.shape[0], -1) if ids.shape[0] == 1 else ids  # the trunk: one row, many lengths
        return torch.cat([self.processor(rows[i : i + 1, :n], logits[i : i + 1].clone()) for i, n in
                          enumerate(lengths)])

    def _choose_rows(self, probs: torch.Tensor, n_cached: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`Drafter._choose` for all rows at once, on the device: tokens [rows], log-probabilities [rows, V]."""
        if not self.do_sample:
            return probs.argmax(-1), None
        q = probs
        if self.saguaro_c is not None and n_cached > 0:
            q = saguaro_q(probs, n_cached, self.saguaro_c)  # the same rule as Drafter, without a sync
        race = torch.empty_like(q).exponential_(generator=self.generator).clamp_(min=1e-30)
        token = (q / race).argmax(-1)
        logq = q.log()
        if logq.shape[-1] < self.out_vocab:
            logq = torch.nn.functional.pad(logq, (0, self.out_vocab - logq.shape[-1]), value=float("-inf"))
        return token, logq

    def _tops(self, probs: torch.Tensor):
        return probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)

    # ----- the trunk ------------------------------------------------------------------------------------------
    def _crop(self, n: int) -> None:
        if len(self.ids) > n:
            del self.ids[n:]
            self.trunk.mask[..., n:].fill_(self.trunk.neg)  # the columns stay, hidden, until overwritten
            self._last = None
        for p in [p for p in self.top if p >= n or p < n - 1024]:
            del self.top[p]

    def _trunk_step(self, pos: int, token) -> torch.Tensor:
        """Feed one token (an int, or a device tensor [1]) at position `pos`; logits [1, V]."""
        self._check_len(pos + 1)
        t = self.trunk
        if isinstance(token, int):
            t.input_ids.fill_(token)
            t.ids[0, pos].fill_(token)
        else:
            t.input_ids.view(-1).copy_(token)
            t.ids[0, pos : pos + 1].copy_(token)
        t.position_ids.fill_(pos)
        t.step_cols.fill_(pos)
        t.mask[..., pos].fill_(0.0)  # in-place fills and copies only: nothing waits for the device
        t.length = pos + 1
        self._wrote(pos)
        self.forwards += 1
        with torch.no_grad():
            return self.state.trunk_step()

    @torch.no_grad()
    def _trunk_chunk(self, keep: int, new: list[int], keep_last: int) -> torch.Tensor:
        """Feed several tokens at once (eagerly, into the same static cache); logits of the last `keep_last`."""
        self._check_len(keep + len(new))
        t = self.trunk
        ids = to_device([new], self.device)
        pos = torch.arange(keep, keep + len(new), device=self.device)
        t.ids[0, keep : keep + len(new)].copy_(ids[0])
        allowed = self.state.arange.unsqueeze(0) <= pos.unsqueeze(1)
        mask = torch.zeros(allowed.shape, dtype=t.mask.dtype, device=self.device).masked_fill(~allowed, t.neg)
        kwargs = {self._cache_kw: t.cache}
        if self._keep_kw:
            kwargs["logits_to_keep"] = keep_last
        t.cols, t.length = pos, keep
        try:
            out = self.model(input_ids=ids, position_ids=pos.unsqueeze(0), attention_mask=mask[None, None],
                             use_cache=True, **kwargs)
        finally:
            t.cols = t.step_cols
        t.mask[..., keep : keep + len(new)].fill_(0.0)
        t.length = keep + len(new)
        self._wrote(keep)
        self.forwards += 1
        return out.logits[0, -keep_last:, : self.out_vocab].float()

    def _record_trunk(self, positions: list[int], logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self._process_rows(logits, self.trunk.ids, [p + 1 for p in positions]), dim=-1)
        values, idx = self._tops(probs)
        for i, pos in enumerate(positions):
            self.top[pos] = (values[i], idx[i])
        return probs

    def sync(self, context: list[int], record_from: int | None = None) -> torch.Tensor:
        plan = self._sync_plan(context, record_from)
        if not isinstance(plan, tuple):
            return plan  # already synced: the cached probabilities
        keep, new, first = plan
        if len(new) == 1:
            logits = self._trunk_step(keep, new[0])
        else:
            logits = self._trunk_chunk(keep, new, len(context) - first)
        self.ids.extend(new)
        probs = self._record_trunk(list(range(first, len(context))), logits)[-1]
        self._last = (len(context), probs)
        return probs

    def draft(self, context: list[int], n: int, fanout: list[int], stop_below: float = 0.0) -> DraftResult:
        """Sequential drafting with the trunk step; the tokens reach the host once, at the end. A confidence stop
        needs the host each step, so it takes the generic loop (over this class's `sync`)."""
        if stop_below > 0:
            return super().draft(context, n, fanout, stop_below)
        if n <= 0:
            return DraftResult([], None)
        probs = self.sync(context)
        tokens, rows = [], []
        for j in range(n):
            token, logq = self._choose_rows(probs.unsqueeze(0), fanout[j] if j < len(fanout) else 0)
            tokens.append(token)
            if logq is not None:
                rows.append(logq[0])
            if j == n - 1:
                break  # the last token is fed by the next round's record(), as in Drafter
            pos = len(context) + j
            probs = self._record_trunk([pos], self._trunk_step(pos, token))[0]
        out = host_list(torch.cat(tokens))
        self.ids.extend(out[:-1])
        self._last = (len(context) + n - 1, probs)
        return DraftResult(out, torch.stack(rows) if rows else None)

    def candidate_tops(self, context_len: int, n: int):
        tops = [self.top[context_len - 1 + j] for j in range(n + 1)]
        values = to_host(torch.stack([v for v, _ in tops]))  # one transfer for the whole round
        ids = to_host(torch.stack([i for _, i in tops]))
        return [(values[j], ids[j]) for j in range(n + 1)]

    # ----- batched pre-drafting -----------------------------------------------------------------------------
    @torch.no_grad()
    def start_tree(self, context_len: int, outcomes: list[Outcome]) -> StaticTree:
        b, tr = len(outcomes), self.trunk
        t, step = self.state.tree_for(b)
        T = len(self.ids)
        # Rows already holding the trunk's columns [0, valid_cols) only need the columns written since.
        n_rows = max(b, t.valid_rows)
        lo = t.valid_cols if t.valid_rows >= b else 0
        if lo < T:
            for dst, src in zip(t.keys + t.values, tr.keys + tr.values):
                dst[:n_rows, :, lo:T].copy_(src[:, :, lo:T].expand(n_rows, -1, -1, -1))
            t.ids[:n_rows, lo:T].copy_(tr.ids[:, lo:T].expand(n_rows, -1))
        t.valid_rows, t.valid_cols = n_rows, T
        self._dirty = T
        self._serial += 1
        return StaticTree(context_len, T, list(self.ids), dict(self.top), self._serial, t, step)

    @torch.no_grad()
    def tree_steps(self, tree: StaticTree, outcomes: list[Outcome], gamma: int, fanout: list[int], should_stop,
                   on_step=None, last=None) -> list[tuple[BranchState, DraftResult]]:
        if last is not None:  # see defers_record
            raise ValueError("the static draft path's tree has a fixed shape: it defers no record")
        b, t = len(outcomes), tree.rows
        L0, T = tree.context_len, tree.trunk_len
        self._check_len(T + gamma + 1)
        starts = [L0 + o.accepted for o in outcomes]
        # The rows' token ids (by position) get the branch tokens from L0 + k on: no longer the trunk's there.
        t.valid_cols = min(t.valid_cols, min(starts))
        # Padding rows (b < batch) run a k = 0 branch whose output is ignored: the step shape never changes.
        st = to_device(starts + [L0] * (t.batch - b), self.device)
        bonus = to_device([o.bonus for o in outcomes] + [0] * (t.batch - b), self.device)
        hidden = self.state.arange.unsqueeze(0) >= st.unsqueeze(1)  # [L0 + k, ...) assumed rejected or unused
        t.mask.copy_(torch.zeros(hidden.shape, dtype=t.mask.dtype, device=self.device)
                     .masked_fill(hidden, t.neg)[:, None, None, :])
        t.input_ids[:, 0].copy_(bonus)
        t.position_ids[:, 0].copy_(st)
        t.ids[:b].scatter_(1, st[:b, None], bonus[:b, None])
        states = [BranchState(tree, r, o) for r, o in enumerate(outcomes)]
        tokens, logqs, events = [], [], []
        for j in range(gamma + 1):
            if len(events) >= 2:
                events[-2].synchronize()  # at most two steps queued ahead: an arrived outcome stops us soon
            if should_stop():
                break
            col = T + j
            t.step_cols.fill_(col)
            t.mask[..., col].fill_(0.0)
            t.length = col + 1
            self.forwards += 1
            logits = tree.step()[:b]
            probs = torch.softmax(self._process_rows(logits, t.ids, [s + 1 + j for s in starts]), dim=-1)
            values, idx = self._tops(probs)
            for r, s in enumerate(starts):
                states[r].top[s + j] = (values[r], idx[r])
                states[r].fed = j + 1
            if j < gamma:
                token, logq = self._choose_rows(probs, fanout[j] if j < len(fanout) else 0)
                tokens.append(token)
                if logq is not None:
                    logqs.append(logq)
                t.input_ids[:b, 0].copy_(token)
                t.ids[:b].scatter_(1, st[:b, None] + 1 + j, token[:, None])
                t.position_ids.add_(1)
            if self._cuda:
                events.append(torch.cuda.Event())
                events[-1].record(torch.cuda.current_stream(self.device))
            if on_step is not None:
                on_step(j)
        drafted = host_list(torch.stack(tokens, dim=1)) if tokens else [[] for _ in outcomes]
        results = []
        for r in range(b):
            logits = torch.stack([lq[r] for lq in logqs]) if logqs else None
            results.append(DraftResult(drafted[r], logits))
        return list(zip(states, results))

    @torch.no_grad()
    def adopt(self, state: BranchState, tokens: list[int]) -> None:
        tree, r, o = state.batch, state.row, state.outcome
        if tree.serial != self._serial:
            raise RuntimeError("hf_ssd internal error: adopting a branch of a tree whose buffers were reused")
        keep = tree.context_len + o.accepted
        fed = min(state.fed, len(tokens) + 1)
        t, tr = tree.rows, self.trunk
        T = tree.trunk_len
        lo = 0 if self._dirty < keep else keep  # the trunk's [0, keep) is still the row's unless rewritten
        for dst, src in zip(tr.keys + tr.values, t.keys + t.values):
            if lo < keep:
                dst[0, :, lo:keep].copy_(src[r, :, lo:keep])
            dst[0, :, keep : keep + fed].copy_(src[r, :, T : T + fed])
        tr.ids[0, lo : keep + fed].copy_(t.ids[r, lo : keep + fed])
        tr.mask[..., : keep + fed].fill_(0.0)
        tr.mask[..., keep + fed :].fill_(tr.neg)
        tr.length = keep + fed
        self._wrote(lo)
        self.ids = tree.trunk_ids[:keep] + [o.bonus] + tokens[: fed - 1]
        self.top = {p: v for p, v in tree.trunk_top.items() if p < keep}
        self.top.update({p: state.top[p] for p in range(keep, keep + fed)})
        self._last = None


def make_drafter(model, config, logits_processor, do_sample: bool, top_k: int, generator, out_vocab: int,
                 max_length: int, rows: int, prompt_mask: torch.Tensor | None = None,
                 longest: int | None = None) -> Drafter:
    """The drafter `SSDConfig` asks for: static (with CUDA graphs on CUDA) where supported, else dynamic.

    `longest`: the longest draft (gamma) any option the call may run (default `config.gamma`); sizes the
    static buffers."""
    static, graphs = config.resolved_draft_path(model.device.type == "cuda")
    args = (model, logits_processor, do_sample, top_k, config.saguaro_c, generator, out_vocab)
    masked = prompt_mask is not None and not bool(prompt_mask.all())
    if static:
        # The static path assumes every context column is attended; a prompt with masked (padding) columns
        # takes the dynamic path, which honours the caller's attention_mask.
        why = "the prompt's attention_mask masks some columns" if masked else static_support(model)
        if why is None:
            on_cuda = model.device.type == "cuda"
            return StaticDrafter(*args, max_len=max_len_for(max_length, longest or config.gamma, on_cuda), rows=rows,
                                 graphs=graphs, strict_graphs=config.cuda_graphs is True)
        explicit = config.static_draft is True or config.cuda_graphs is True
        (logger.warning if explicit else logger.info)(
            "hf_ssd: the static draft path (CUDA graphs) does not support %s: %s; using the dynamic draft path.",
            type(model).__name__, why)
    return Drafter(*args, prompt_mask)
