"""Scheduling: which option (AR, plain SD, or overlapped SSD at some gamma and fan-out budget) each round runs.

- `costs`: what things cost on this machine, measured per pair (verify, draft and tree steps, acceptance by
  position, where the bonus ranks, ...);
- `schedule`: the model of each option's tokens per second from those costs, and the choice (`Scheduler`);
- `profile`: the measured costs saved across processes (`hf-ssd tune`).
"""
