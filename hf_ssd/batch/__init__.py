"""Batched decoding (B > 1): hf_ssd's own loop (`loop.decode`), its ragged caches and its draft.

- `loop`: the round (schedule, propose, verify, accept) and the per-row / per-round records;
- `ragged`: a KV cache whose rows advance by different counts (masked columns, explicit positions);
- `draft`: the draft over all live rows, one batched forward per drafted position;
- `accept`: the per-row verification rules (greedy matching, speculative sampling).
"""
