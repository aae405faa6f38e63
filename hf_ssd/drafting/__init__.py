"""Drafting: the draft model's forwards, on the critical path (plain SD, a miss's fallback) and in a speculation
job's batched steps over branches.

- `drafter`: one prompt's trunk and branch rows on dynamic caches (`Drafter`); `static` the same interface on
  preallocated buffers, its steps captured as CUDA graphs (`graphs`);
- `batch`: the draft over a batch's live rows, one batched forward per drafted position (`BatchDrafter`);
- `fallback`: what a miss proposes (SD, a shorter gamma, AR, n-gram lookup);
- `kvcache` (which drafts can be cropped and batched), `probe` (a one-time check of a new draft), `matmul` (the
  draft step's matrix products).
"""
