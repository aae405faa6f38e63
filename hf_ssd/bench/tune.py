"""`hf-ssd tune`: measure a pair on this machine, print its cost model, and recommend an `SSDConfig`.

Each option (AR, plain SD at several gamma, overlapped SSD at several fan-out budgets) runs alone over the same
prompts (the scheduler is restricted to it), which both measures its real speed and feeds the pair's cost
model; one call on the first prompt then tries every other option family once (as a new pair's first call does);
then the model's prediction for every option is printed next to the measurement, the default
`SSDConfig()` (schedule="auto") is measured last, already informed, and the recommendation is the option
measured fastest.

Predicted tok/s are per decoding round (verify + draft work), measured tok/s are whole `generate` calls (they
also pay the prompt prefill), so predictions read somewhat higher.

At the end the pair's cost model is saved as its tuning profile (`hf_ssd.scheduling.profile.save`), which new processes
load instead of exploring; the measurement starts from the previous profile unless `use_profile=False`.
"""

from __future__ import annotations

import contextlib
import json
import time

import torch

from ..config import SSDConfig
from ..integration import enable, last_stats
from ..scheduling import profile
from ..scheduling.costs import cost_model_for, reset_estimates
from ..scheduling.schedule import AUTO_BUDGETS, AUTO_GAMMAS, WIDE_BUDGETS, Option, Scheduler, allowed_options

SAMPLE_TEMPERATURE = 0.7


def _measure(target, draft, prompts, max_new_tokens, do_sample, config, only=None, seed=0, hooks=None):
    """(tok/s over all prompts, last stats, outputs) of SSD calls restricted to option `only` (None: unrestricted);
    with `config=None`, of the target alone (AR; stats None). `hooks`: the generator's (hf_ssd/loop/assisted.py)."""
    if only is not None:
        hooks = {**(hooks or {}), "options": lambda options: [o for o in options if o == only]}
    kwargs = {"max_new_tokens": max_new_tokens, "do_sample": do_sample}
    if do_sample:
        kwargs["temperature"] = SAMPLE_TEMPERATURE
    if config is not None:
        kwargs.update(assistant_model=draft, ssd_config=config, _ssd_hooks=hooks)
    tokens, seconds, outputs = 0, 0.0, []
    for ids in prompts:
        input_ids = torch.tensor([ids], device=target.device)
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        seconds += time.perf_counter() - start
        tokens += out.shape[1] - len(ids)
        outputs.append(out[0, len(ids):].tolist())
    rate = tokens / seconds if seconds > 0 else 0.0
    return rate, (last_stats(target) if config is not None else None), outputs


def recommended_config(option: Option) -> dict:
    """SSDConfig arguments that make the scheduler run this option (or keep choosing it)."""
    if option.kind == "ssd":
        return {"gamma": option.gamma, "fanout_budget": option.budget}
    if option.kind == "sd" and option.stop:
        return {}  # a confidence stop needs gamma unset: the default schedule offers it
    if option.kind == "sd":
        return {"gamma": option.gamma}  # auto picks plain SD where it measures it fastest, as here
    return {}  # AR: the default schedule runs the target alone when the draft does not pay


def run_tune(target, draft, prompts: list[list[int]], max_new_tokens: int = 48, gammas=(2, 4, 6),
             budgets=(1, 2, 4, 8), do_sample: bool = False, progress: bool = True, use_profile: bool = True,
             save_profile: bool = True) -> dict:
    """Measure and predict every option on `prompts` (token id lists); returns the report as a dict.

    `use_profile=False`: the measurement starts from the priors, not from the pair's saved tuning profile;
    `save_profile`: write the measured costs as the pair's profile at the end (`hf_ssd.scheduling.profile`)."""
    with contextlib.nullcontext() if use_profile else profile.ignored():
        report = _run_tune(target, draft, prompts, max_new_tokens, gammas, budgets, do_sample, progress)
    report["profile"] = {"loaded": report.pop("_loaded"), "written": None, "error": None}
    if not save_profile:
        report["profile"]["error"] = "not asked to save it"
    elif not profile.enabled():
        report["profile"]["error"] = f"{profile.NO_PROFILE_ENV} is set"
    else:
        try:
            paths = profile.save(target, draft, source="hf-ssd tune")
            report["profile"]["written"] = str(paths[0]) if paths else None
            if not paths:
                report["profile"]["error"] = "nothing measured"
        except OSError as err:
            report["profile"]["error"] = f"{type(err).__name__}: {err}"
    return report


def _run_tune(target, draft, prompts, max_new_tokens, gammas, budgets, do_sample, progress) -> dict:
    from tqdm.auto import tqdm

    enable(target)
    reset_estimates(target)
    base = SSDConfig(hit_rate_warning=0.0)
    static, _ = base.resolved_draft_path(draft.device.type == "cuda")
    allowed_budgets = AUTO_BUDGETS + (() if static else WIDE_BUDGETS)  # as the generator allows them
    if not set(gammas) <= set(AUTO_GAMMAS) or not set(budgets) <= set(allowed_budgets):
        raise ValueError(f"hf-ssd tune measures the scheduler's options: gammas from {list(AUTO_GAMMAS)}, budgets "
                         f"from {list(allowed_budgets)}; got gammas {list(gammas)}, budgets {list(budgets)}.")
    options = [Option("ar")] + [Option("sd", g) for g in gammas]
    options += [Option("ssd", 4 if 4 in gammas else gammas[0], b) for b in budgets]
    steps = len(options) + 3
    bar = tqdm(total=steps, desc="hf-ssd tune", disable=not progress)
    # Warm-up: first calls pay one-off costs (allocations, kernel selection) that would skew the first option.
    _measure(target, draft, prompts[:1], min(8, max_new_tokens), do_sample, base)
    bar.update(1)
    ar_rate, _, ar_out = _measure(target, draft, prompts, max_new_tokens, do_sample, None)
    rows = []
    identical = True
    for option in options:
        bar.set_postfix_str(option.name)
        if option.kind == "ar":
            measured, outs = ar_rate, ar_out
        else:
            measured, _, outs = _measure(target, draft, prompts, max_new_tokens, do_sample, base, only=option)
        identical &= do_sample or outs == ar_out
        rows.append({"option": option.name, "measured_tok_s": measured})
        bar.update(1)
    stats = last_stats(target)
    top_k = max(o.budget for o in allowed_options(base, stats.layout, 1, wide=not static)) + 1  # as the generator keys it
    costs = cost_model_for(target, draft, draft.device, stats.layout, do_sample, top_k, base.initial_acceptance,
                           base.draft_matmul, base.verify_matmul)  # the estimates the calls above filled
    # The scheduler's other families (confidence-stopped SD, SSD at 16, the one-thread AR and SD of a CPU with more
    # threads) are not measured above. One call that starts as on a pair with no estimates, trying the default
    # twice and then each other family once (`Scheduler.first_rounds(every_family=True)`), measures them, so that
    # the profile saved at the end leaves a new process nothing to explore.
    bar.set_postfix_str("each family once")
    seen, costs.rounds_seen = costs.rounds_seen, 0
    try:
        _measure(target, draft, prompts[:1], max_new_tokens, do_sample, base, hooks={"every_family": True})
    finally:
        costs.rounds_seen += seen
    bar.update(1)
    scheduler = Scheduler(base, costs, options, options[0], inline=stats.layout == "inline",
                          deferred_record=stats.draft_path == "dynamic")  # as the generator's (depth 1)
    for row, option in zip(rows, options):
        pred = scheduler.predict(option)
        row["predicted_tok_s"] = pred.rate if pred is not None else None
    auto_rate, auto_stats, auto_out = _measure(target, draft, prompts, max_new_tokens, do_sample, base)
    identical &= do_sample or auto_out == ar_out
    bar.update(1)
    bar.close()
    best = max(zip(rows, options), key=lambda ro: ro[0]["measured_tok_s"])
    return {
        "device": str(target.device), "layout": stats.layout, "mode": "sample" if do_sample else "greedy",
        "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "cost_model": costs.snapshot(4, sorted(set(budgets))),
        "options": rows,
        "auto": {"measured_tok_s": auto_rate, "schedule": auto_stats.schedule_summary()},
        "greedy_identical": None if do_sample else identical,
        "recommended": {"option": best[1].name, "measured_tok_s": best[0]["measured_tok_s"],
                        "ssd_config": recommended_config(best[1]), "advice": recommendation_words(best[1])},
        "_loaded": costs.profile,
    }


def recommendation_words(option: Option) -> str:
    """The recommendation in words (an empty `SSDConfig(**{})` says nothing about running the target alone)."""
    if option.kind == "ar":
        return ("run the target alone (no SSD): the draft does not pay on this machine; call model.generate without "
                "assistant_model and ssd_config (the default SSDConfig() also runs the target alone here once it "
                "has measured the pair)")
    config = recommended_config(option)
    if not config:
        return "use the default SSDConfig(): its scheduler picks this option automatically"
    args = ", ".join(f"{k}={v}" for k, v in config.items())
    return f"SSDConfig({args})   (the default SSDConfig() schedules it automatically)"


def render(report: dict) -> str:
    lines = [
        f"hf-ssd tune: {report['mode']}, {report['prompts']} prompts x {report['max_new_tokens']} new tokens on "
        f"{report['device']} (layout {report['layout']})",
        "",
        "cost model (seconds; verify_s by candidates, tree_step_s by branches):",
    ]
    lines += [f"  {k}: {v}" for k, v in report["cost_model"].items()]
    lines += ["", f"{'option':<18} {'predicted tok/s':>16} {'measured tok/s':>15}"]
    for row in report["options"]:
        pred = "-" if row["predicted_tok_s"] is None else f"{row['predicted_tok_s']:.2f}"
        lines.append(f"{row['option']:<18} {pred:>16} {row['measured_tok_s']:>15.2f}")
    auto = report["auto"]
    lines += [
        f"{'SSDConfig() auto':<18} {'':>16} {auto['measured_tok_s']:>15.2f}   ({auto['schedule']})",
        "",
        "(predicted: per decoding round; measured: whole generate calls, including the prompt prefill)",
    ]
    if report["greedy_identical"] is not None:
        lines.append("greedy outputs identical to the target alone: " + ("yes" if report["greedy_identical"] else
                                                                         "NO (please report a bug)"))
    rec = report["recommended"]
    if rec["option"] == "ar":  # in words: SSDConfig(**{}) would read as "use SSD with the defaults"
        line = (f"recommended: run the target alone (no SSD): ar measured fastest ({rec['measured_tok_s']:.2f} tok/s); "
                "call model.generate without assistant_model and ssd_config (the default SSDConfig() also falls back "
                "to the target alone here once it has measured the pair)")
    else:
        line = f"recommended: {rec['option']} ({rec['measured_tok_s']:.2f} tok/s measured): {rec['advice']}"
    lines += [line, "json: " + json.dumps(rec)]
    prof = report.get("profile")
    if prof is not None:
        if prof.get("loaded"):
            lines.append(f"started from the previous tuning profile {prof['loaded']} (--no-profile: from the priors)")
        if prof.get("written"):
            lines.append(f"tuning profile written to {prof['written']}: new processes on this pair, this device, "
                         f"dtype and thread count start from it (--no-profile or {profile.NO_PROFILE_ENV}=1 ignores it)")
        else:
            lines.append(f"tuning profile not written ({prof.get('error')})")
    return "\n".join(lines)
