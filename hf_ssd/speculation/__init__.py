"""Speculation: while the target verifies a round, predict its outcomes and pre-draft the next round for each.

- `outcomes`: the one outcome model, P(k) and P(bonus | k), and the rankings both fan-outs use;
- `fanout` (the geometric split by k), `predictor` (the calibrated acceptance by the draft's confidence);
- `speculator`: where a job runs (a thread, a CUDA stream, or inline) and how its errors reach the caller;
- `cache`: one prompt's speculation cache, keyed by outcome; `batch`: a batch's job, its branches per row.
"""
