"""Speculation's arithmetic: what a draft is worth and what it costs, and how deep to draft.

- :mod:`draftwise.speculation.cost_model`: acceptance and speed-up formulas, pass-cost curves, the load-aware
  batch K;
- :mod:`draftwise.speculation.controller`: per-request K policies (fixed, AutoK) and the acceptance estimate;
- :mod:`draftwise.speculation.batch_plan`: the engine's K per sequence for a batch, with probes;
- :mod:`draftwise.speculation.pass_costs`: timing a slot backend's passes and the engine's own time per step;
- :mod:`draftwise.speculation.calibration`: measuring a target and draft pair's costs, and caching them;
- :mod:`draftwise.speculation.measurement`: timing helpers with one rule for measurement noise.

Below the engine and the proposers: nothing here imports :mod:`draftwise.engine`.
"""
