"""The decoding loops: each round schedules, proposes, verifies and accepts, and speculates the next.

- `batch`: hf_ssd's own loop (`batch.decode`, transformers' `custom_generate`), which batched calls run: the
  round as named steps over per-row (`Row`) and per-round (`Round`) records;
- `plain`: plain batched decoding, which `batch` runs where drafting does not pay;
- `ragged`: a KV cache whose rows advance by different counts (masked columns, explicit positions);
- `accept`: the per-row verification rules (greedy matching, speculative sampling);
- `assisted`: one prompt (B = 1), as a candidate generator inside transformers' assisted-decoding loop.
"""
