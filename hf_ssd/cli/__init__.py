"""The `hf-ssd` command line: `hf-ssd generate` (stream one SSD generation) and `hf-ssd bench` (AR vs assisted
generation vs SSD on the same prompts).

Models: `--target/--draft` (local paths or Hub ids, loaded with `AutoModelForCausalLM`), or by default the
embedded Qwen2.5-Coder pair (`hf_ssd.pairs.load_default_pair`), or `--tiny` (a random tiny pair with a
character-level tokenizer, built offline in a second; for smoke tests only: its text is gibberish).
"""

from __future__ import annotations

import argparse
import time

from ..config import (
    DRAFT_MATMULS,
    FALLBACKS,
    LAYOUTS,
    SCHEDULES,
    VERIFY_MATMULS,
    SSDConfig,
    SSDConfigError,
)

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")


# ----------------------------------------------------------------------------------------------- arguments


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from err


def _str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _fanout(text: str):
    return text if text in ("geometric", "calibrated") else _int_list(text)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--target", help="target model: local path, Hub id, or 'default' (the embedded Qwen2.5-Coder "
                                    "1.5B Instruct, the default)")
    g.add_argument("--draft", help="draft model sharing the target's tokenizer: local path, Hub id, or 'default' "
                                   "(the embedded Qwen2.5-Coder 0.5B Instruct, the default)")
    g.add_argument("--tiny", action="store_true",
                   help="use a random tiny pair with a character-level tokenizer (offline smoke tests only)")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda when available)")
    g.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="model dtype (auto: float32 on CPU, bfloat16 on CUDA; the tiny pair is float64)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for the run (default: torch's own; 1 with --tiny, where more "
                        "threads only add synchronisation). SSD's CPU speculator uses --cpu-threads per side")
    g.add_argument("--no-profile", action="store_true",
                   help="ignore the saved tuning profile of this pair (written by `hf-ssd tune`): the scheduler "
                        "starts from its priors and explores; tune measures from scratch and still writes its "
                        "profile. HF_SSD_NO_PROFILE=1 ignores profiles too, and stops tune writing one")


def _add_ssd_args(p: argparse.ArgumentParser, with_gamma: bool = True) -> None:
    d = SSDConfig()
    g = p.add_argument_group("SSD options (hf_ssd.SSDConfig)")
    if with_gamma:
        g.add_argument("--gamma", type=int, default=None,
                       help=f"draft tokens per round (default: tuned by the scheduler from {d.gamma}; "
                            f"{d.gamma} with --schedule fixed)")
    g.add_argument("--fanout", type=_fanout, default=d.fanout,
                   help="'geometric', 'calibrated' or gamma+1 comma-separated ints (bonus tokens pre-drafted per k)")
    g.add_argument("--fanout-budget", type=int, default=d.fanout_budget, help="predicted outcomes per round (default: chosen by placement)")
    g.add_argument("--max-outcomes", type=int, default=d.max_outcomes, help="outcome-space truncation (default: the fan-out budget)")
    g.add_argument("--cache-size", type=int, default=d.cache_size, help="speculation cache capacity")
    g.add_argument("--schedule", choices=SCHEDULES, default=d.schedule,
                   help="auto: each round runs the option with the best measured speed (SSD, plain SD or AR); "
                        "fixed: always overlapped SSD")
    g.add_argument("--fallback", choices=FALLBACKS, default=None,
                   help=f"what a cache miss does (default: {d.fallback!r}; unset with --schedule auto, a miss drafts "
                        "the length the cost model finds best)")
    g.add_argument("--fallback-gamma", type=int, default=d.fallback_gamma, help="draft length of the 'short' fallback (default: gamma // 2); alone it selects --fallback short")
    g.add_argument("--saguaro-c", type=float, default=d.saguaro_c, help="Saguaro sampling constant in [0, 1) (default: off)")
    if with_gamma:
        g.add_argument("--layout", choices=LAYOUTS, default=d.layout, help="where the speculator runs")
    g.add_argument("--cpu-threads", type=int, default=d.cpu_threads,
                   help="torch threads for each of verifier and speculator on CPU (default: the torch thread setting)")
    g.add_argument("--static-draft", type=_tristate, default=d.static_draft, metavar="{auto,on,off}",
                   help="static-shape draft path (default: auto, on for CUDA drafts)")
    g.add_argument("--cuda-graphs", type=_tristate, default=d.cuda_graphs, metavar="{auto,on,off}",
                   help="CUDA graphs for the static draft steps (default: auto, on for CUDA drafts)")
    g.add_argument("--draft-matmul", choices=DRAFT_MATMULS, default=d.draft_matmul,
                   help="the draft's CPU linear layers: auto (float32: the faster of the transposed product and, in "
                        "one-row steps, float16 copies), transposed, half, stock")
    g.add_argument("--verify-matmul", choices=VERIFY_MATMULS, default=d.verify_matmul,
                   help="the target's CPU linear layers in verify forwards: auto, transposed, stock (as --draft-matmul)")


def _tristate(text: str):
    values = {"auto": None, "on": True, "off": False}
    if text not in values:
        raise argparse.ArgumentTypeError(f"expected auto, on or off, got {text!r}")
    return values[text]


def ssd_options(args) -> dict:
    """The SSDConfig fields given on the command line (gamma/layout only where the command has them)."""
    keys = ["fanout", "fanout_budget", "max_outcomes", "cache_size", "fallback", "fallback_gamma",
            "saguaro_c", "cpu_threads", "gamma", "layout", "static_draft", "cuda_graphs", "schedule",
            "draft_matmul", "verify_matmul"]
    options = {k: getattr(args, k) for k in keys if hasattr(args, k)}
    for key in ("gamma", "fallback"):  # not given: SSDConfig's default, which the scheduler may tune
        if options.get(key) is None:
            options.pop(key, None)
    return options


class HELP_FORMAT(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default; options whose default is None/False say in their help what that means."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


# `hf-ssd bench` settings: the default is sized to finish in ~10 minutes on a 2-core CPU with the default pair.
BENCH_QUICK = {"num_prompts": 2, "max_new_tokens": 64, "modes": ["greedy"], "gammas": [4]}
BENCH_FULL = {"num_prompts": 10, "max_new_tokens": 128, "modes": ["greedy", "sample"], "gammas": [2, 4, 6]}


# `hf-ssd tune`'s duration, for its --help: 9 measured runs of --num-prompts x --max-new-tokens (AR, 3 SD gammas, 4
# SSD budgets, SSDConfig()), a short warm-up and one exploration call of --max-new-tokens: ~610 tokens with the
# defaults, at the 2-4 tok/s the default pair decodes on 2 CPU cores (docs/performance.md), plus 19 prompt
# prefills and the model load.
TUNE_TIME = ("With the defaults (2 prompts x 32 tokens, 8 options: 9 runs of 64 tokens, a warm-up and one 32-token "
             "call that tries each other option family once) it takes about "
             "3-6 minutes on a 2-core CPU with the default pair (estimated from its measured speeds), about 10 "
             "seconds with --tiny; the time grows with --num-prompts x --max-new-tokens x (options + 1), the options being "
             "AR, each of --gammas and each of --budgets.")


def _ints(values) -> str:
    return ",".join(map(str, values))


def _describe(setting: dict) -> str:
    return (f"{setting['num_prompts']} prompts per dataset, {setting['max_new_tokens']} new tokens, "
            f"{'+'.join(setting['modes'])}, gammas {_ints(setting['gammas'])}")


def bench_setting(args) -> dict:
    """The bench's size: --full or the quick default, with every option given explicitly taking precedence."""
    base = BENCH_FULL if args.full else BENCH_QUICK
    return {k: (getattr(args, k) if getattr(args, k) is not None else v) for k, v in base.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-ssd", description="Speculative Speculative Decoding for transformers",
                                     formatter_class=HELP_FORMAT)
    parser.add_argument("-v", "--verbose", action="store_true", help="show transformers warnings")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from one prompt with SSD, streaming the text",
                         formatter_class=HELP_FORMAT)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_int_list, help="prompt as comma-separated token ids (no tokenizer needed)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate")
    gen.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (with --do-sample)")
    gen.add_argument("--seed", type=int, default=None, help="torch seed (with --do-sample; default: unseeded)")
    gen.add_argument("--method", choices=("ssd", "sd", "ar"), default="ssd",
                     help="ssd, sd (transformers assisted generation) or ar (target alone), to compare")
    gen.add_argument("--timeline", metavar="PNG", help="write a timeline picture of the SSD rounds (default: none)")
    _add_model_args(gen)
    _add_ssd_args(gen)

    bench = sub.add_parser(
        "bench", help="compare AR, assisted generation and SSD on the same prompts", formatter_class=HELP_FORMAT,
        description="Compare AR, assisted generation and SSD on the same prompts. The defaults finish in about "
                    "10 minutes on a 2-core CPU with the default pair; --full runs the larger setting "
                    f"({_describe(BENCH_FULL)}), about 3 hours there. An estimate is printed before the run.")
    bench.add_argument("--datasets", type=_str_list, default="humaneval,gsm",
                       help="comma-separated: humaneval, gsm, or paths to .jsonl/.csv files or save_to_disk dirs")
    bench.add_argument("--full", action="store_true",
                       help=f"the larger setting: {_describe(BENCH_FULL)} (explicit options still win)")
    bench.add_argument("--num-prompts", type=int, default=None,
                       help=f"prompts per dataset (default {BENCH_QUICK['num_prompts']}; "
                            f"{BENCH_FULL['num_prompts']} with --full)")
    bench.add_argument("--max-new-tokens", type=int, default=None,
                       help=f"default {BENCH_QUICK['max_new_tokens']}; {BENCH_FULL['max_new_tokens']} with --full")
    bench.add_argument("--modes", type=_str_list, default=None,
                       help=f"greedy and/or sample, comma-separated (default {','.join(BENCH_QUICK['modes'])}; "
                            f"{','.join(BENCH_FULL['modes'])} with --full)")
    bench.add_argument("--gammas", type=_int_list, default=None,
                       help=f"SSD / tuned-assisted draft lengths (default {_ints(BENCH_QUICK['gammas'])}; "
                            f"{_ints(BENCH_FULL['gammas'])} with --full)")
    bench.add_argument("--batch-sizes", "--batch-size", dest="batch_sizes", type=_int_list, default=[1],
                       metavar="B[,B...]",
                       help="prompts per generate call, comma-separated (e.g. 1,4,16): the bench's methods (AR, "
                            "assisted, SSD variants) run when 1 is among them; each B > 1 runs the target's own batched generate and SSDConfig() (hf_ssd's batched "
                            "loop) over the same prompts in batches of B, left-padded, and reports their dataset "
                            "throughput, SSD / target batched, and the options SSD chose")
    bench.add_argument("--out", default="bench_out", help="output directory")
    bench.add_argument("--seed", type=int, default=0, help="seed for prompt selection and sampling")
    bench.add_argument("--chat", choices=("auto", "always", "never"), default="auto",
                       help="chat template: auto = for non-code prompts when the tokenizer has one")
    bench.add_argument("--max-prompt-tokens", type=int, default=None, help="keep only the last N prompt tokens (default: all; 128 with --tiny)")
    bench.add_argument("--strict", action="store_true", help="exit with status 3 when greedy outputs differ")
    bench.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    _add_model_args(bench)
    _add_ssd_args(bench, with_gamma=False)

    tune = sub.add_parser(
        "tune", help="measure this pair's costs here; print predicted and measured speed of AR, SD and SSD options "
                     "and the recommended SSDConfig; save them as the pair's tuning profile",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Measure this pair's costs on this machine: AR, plain SD at each --gammas and SSD at each "
                    "--budgets run alone over the same prompts, then the default SSDConfig(); prints the cost model, "
                    "predicted and measured tok/s and the recommendation. "
                    f"{TUNE_TIME} "
                    "At the end the measured costs are saved as the pair's tuning profile "
                    "(<cache>/profiles/<key>.json, cache ~/.cache/hf_ssd or $HF_SSD_CACHE; $HF_SSD_PROFILES names "
                    "the directory instead), keyed on target, draft, device, dtype, torch threads and machine: "
                    "later processes on this pair (hf-ssd generate/bench, your own generate calls, every worker of "
                    "a data-parallel run) start from it instead of exploring. --no-profile on a command, or "
                    "HF_SSD_NO_PROFILE=1, ignores it; other models, versions or machines never use it.")
    tune.add_argument("--dataset", default="humaneval", help="prompts: humaneval, gsm, or a .jsonl/.csv file")
    tune.add_argument("--num-prompts", type=int, default=2, help="prompts per option")
    tune.add_argument("--max-new-tokens", type=int, default=32, help="new tokens per prompt")
    tune.add_argument("--gammas", type=_int_list, default=[2, 4, 6], help="plain SD draft lengths to measure (1..8)")
    tune.add_argument("--budgets", type=_int_list, default=[1, 2, 4, 8],
                      help="SSD fan-out budgets to measure (from 1, 2, 4, 8, 16; 32 and 64 on the dynamic draft path), at "
                           "gamma 4")
    tune.add_argument("--do-sample", action="store_true", help="measure sampling (T=0.7) instead of greedy")
    tune.add_argument("--json", metavar="PATH", help="also write the full report as JSON")
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_model_args(tune)
    _add_eval_parser(sub)
    return parser


# ----------------------------------------------------------------------------------------------- models


def _device_and_dtype(args):
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    return device, dtype


def load_models(args):
    """(target, draft, tokenizer) as chosen on the command line."""
    device, dtype = _device_and_dtype(args)
    if args.tiny:
        if args.target or args.draft:
            raise SystemExit("hf-ssd: --tiny builds its own pair; drop --target/--draft")
        from ..models.tiny import tiny_pair

        return tiny_pair(device=device)
    from ..models.pairs import ModelNotAvailableError, load_default_pair, resolve_model, resolve_tokenizer

    try:
        if not args.target and not args.draft:
            return load_default_pair(dtype=dtype, device=device)
        # Either may be "default" (or left out): that role of the embedded pair.
        target = resolve_model(args.target or "default", "target", dtype=dtype, device=device)
        draft = resolve_model(args.draft or "default", "draft", dtype=dtype, device=device)
        return target, draft, resolve_tokenizer(args.target or "default")
    except ModelNotAvailableError as err:
        raise SystemExit(f"hf-ssd: {err}") from err


# ----------------------------------------------------------------------------------------------- commands


def _prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        return list(args.prompt_ids)
    if tokenizer is None:
        raise SystemExit("hf-ssd: these models have no tokenizer; pass --prompt-ids")
    if args.chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
    return tokenizer(args.prompt).input_ids


def cmd_generate(args) -> int:
    import torch
    from transformers import TextStreamer

    import hf_ssd

    from ..bench.timeline import plot_timeline

    try:
        config = SSDConfig(**ssd_options(args), record_timeline=bool(args.timeline))
    except SSDConfigError as err:
        raise SystemExit(f"hf-ssd: {err}") from err
    target, draft, tokenizer = load_models(args)
    hf_ssd.enable(target)
    ids = _prompt_ids(args, tokenizer)
    input_ids = torch.tensor([ids], dtype=torch.long, device=target.device)
    kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample,
              "attention_mask": torch.ones_like(input_ids)}
    if args.do_sample:
        kwargs["temperature"] = args.temperature
        if args.seed is not None:
            torch.manual_seed(args.seed)
    if tokenizer is not None:
        kwargs["streamer"] = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    if args.method != "ar":
        kwargs["assistant_model"] = draft
    if args.method == "ssd":
        kwargs["ssd_config"] = config
    if args.timeline and args.method != "ssd":
        raise SystemExit("hf-ssd: --timeline pictures SSD rounds; use it with --method ssd")

    if tokenizer is not None and args.prompt is not None and not args.chat:
        print(args.prompt, end="", flush=True)  # the streamed continuation then reads on from the prompt
    with torch.inference_mode():
        start = time.perf_counter()
        out = target.generate(input_ids, **kwargs)
        seconds = time.perf_counter() - start
    new = out[0, len(ids):].tolist()
    if tokenizer is None:
        print("token ids:", ",".join(map(str, new)))
    print()
    if args.method == "ssd":
        stats = hf_ssd.last_stats(target)
        print(f"[hf-ssd] {stats.summary()}")
        if args.timeline:
            path = plot_timeline(stats, args.timeline)
            print(f"[hf-ssd] timeline written to {path}")
    else:
        tps = len(new) / seconds if seconds > 0 else 0.0
        print(f"[hf-ssd] {args.method}: {len(new)} tokens in {seconds:.2f}s ({tps:.2f} tok/s)")
    return 0


def cmd_bench(args) -> int:
    from ..bench import run_bench

    options = ssd_options(args)
    setting = bench_setting(args)
    try:
        SSDConfig(**options, gamma=max(setting["gammas"]))  # fail fast on bad options, before loading models
    except SSDConfigError as err:
        raise SystemExit(f"hf-ssd: {err}") from err
    bad_modes = [m for m in setting["modes"] if m not in ("greedy", "sample")]
    if bad_modes or not setting["modes"]:
        raise SystemExit(f"hf-ssd: --modes takes greedy and/or sample, got {setting['modes']}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        raise SystemExit(f"hf-ssd: --batch-sizes takes batch sizes of at least 1, got {args.batch_sizes}")
    target, draft, tokenizer = load_models(args)
    max_prompt = args.max_prompt_tokens or (128 if args.tiny else None)
    results = run_bench(
        target, draft, tokenizer, datasets=args.datasets, out_dir=args.out, num_prompts=setting["num_prompts"],
        max_new_tokens=setting["max_new_tokens"], modes=tuple(setting["modes"]), gammas=tuple(setting["gammas"]),
        ssd_options=options, seed=args.seed, chat=args.chat, max_prompt_tokens=max_prompt,
        progress=not args.no_progress, batch_sizes=tuple(args.batch_sizes),
    )
    from pathlib import Path

    print((Path(args.out) / "results.md").read_text(encoding="utf-8"))
    print(f"[hf-ssd] results in {args.out}: results.json, results.md, " + ", ".join(Path(p).name for p in results["plots"]))
    if results["greedy_identical"]:
        print("[hf-ssd] greedy outputs identical across all methods")
    elif args.strict:
        return 3
    return 0


def cmd_tune(args) -> int:
    from ..bench.prompts import encode_prompt, load_prompts
    from ..bench.tune import render, run_tune

    target, draft, tokenizer = load_models(args)
    _, ds = load_prompts(args.dataset, args.num_prompts)
    prompts = [encode_prompt(r["prompt"], r["kind"], tokenizer)[-(128 if args.tiny else 4096):] for r in ds]
    try:
        report = run_tune(target, draft, prompts, args.max_new_tokens, tuple(args.gammas), tuple(args.budgets),
                          args.do_sample, progress=not args.no_progress, use_profile=not args.no_profile)
    except ValueError as err:
        raise SystemExit(f"hf-ssd: {err}") from err
    print(render(report))
    if args.json:
        import json

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


def _add_eval_parser(sub) -> None:
    ev = sub.add_parser(
        "eval", help="generate with SSD over a dataset file: results.jsonl per example, a summary and plots; "
                     "resumable; data-parallel under accelerate launch", formatter_class=HELP_FORMAT,
        description="Generate a completion for every row of a dataset file and write DIR/results.jsonl (one line "
                    "per example, appended as each finishes), summary.json, summary.md and plots. Rerunning the "
                    "same command resumes; other settings on the same --out are refused. Data parallel: "
                    "accelerate launch --multi_gpu --num_processes N -m hf_ssd.cli eval ... (one process per GPU; "
                    "add --device cpu for CPU processes; see docs/scaling.md).")
    ev.add_argument("--data", required=True, help="a .jsonl, .json, .csv or .parquet file or a datasets.save_to_disk "
                                                  "directory")
    ev.add_argument("--field", default="prompt", help="the prompt column")
    ev.add_argument("--split", default=None, help="split of a save_to_disk DatasetDict (default: its only split)")
    ev.add_argument("--chat", action="store_true",
                    help="apply the tokenizer's chat template (a text becomes one user message; a column of "
                         "{role, content} lists is used as is)")
    ev.add_argument("--limit", type=int, default=None, help="only the first N rows (default: all)")
    ev.add_argument("--out", default="eval_out", help="output directory (rerun with the same one to resume)")
    ev.add_argument("--batch-size", type=int, default=1,
                    help="examples per generate call, left-padded (ssd: hf_ssd's batched loop; ar: the target's own "
                         "batched generate; sd: 1 only). Greedy completions are the same at any batch size, so a "
                         "run may resume at another one; a kill loses at most the batch in flight")
    ev.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per example")
    ev.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    ev.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (with --do-sample)")
    ev.add_argument("--top-k", type=int, default=None, help="top-k sampling (with --do-sample; default: the "
                                                            "model's generation config)")
    ev.add_argument("--top-p", type=float, default=None, help="nucleus sampling (with --do-sample; default: the "
                                                              "model's generation config)")
    ev.add_argument("--seed", type=int, default=0, help="sampling seed: example i is generated with seed + i")
    ev.add_argument("--method", choices=("ssd", "sd", "ar"), default="ssd",
                    help="ssd, sd (transformers assisted generation) or ar (target alone), to compare")
    ev.add_argument("--metric", default=None,
                    help="score the completions: gsm (final-number exact match), humaneval (runs the code; needs "
                         "--allow-code-execution), a local evaluate metric path, or a name evaluate loads offline")
    ev.add_argument("--reference-field", default=None,
                    help="the references' column for --metric (default: the first of answer, reference, target)")
    ev.add_argument("--allow-code-execution", action="store_true",
                    help="allow --metric humaneval to run model-written code in a subprocess")
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_model_args(ev)
    _add_ssd_args(ev)


def _eval_models(args) -> dict:
    """How the pair is named in the run's settings.json (known before loading it)."""
    if args.tiny:
        return {"pair": "tiny (hf_ssd.models.tiny.tiny_pair, float64)"}
    _, dtype = _device_and_dtype(args)
    return {"target": args.target or "default", "draft": args.draft or "default",
            "dtype": str(dtype).removeprefix("torch.")}


def _eval_state(args):
    """The accelerate process state: this process's rank among `accelerate launch`'s processes (one without it).

    CPU processes need `cpu=True` (accelerate then joins them with gloo): on machines without CUDA, or with
    --device cpu, or under `accelerate launch --cpu`."""
    import os

    import torch
    from accelerate import PartialState

    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    launched = any(os.environ.get(k) for k in ("LOCAL_RANK", "WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))
    if use_cpu and os.environ.get("MASTER_ADDR") and not launched:
        # accelerate's simple launcher set up a rendezvous for several processes but started only this one:
        # `accelerate launch --cpu` runs several CPU processes only through MPI (--mpirun_hostfile).
        raise SystemExit(
            "hf-ssd: accelerate launch --cpu started a single process: with --cpu, accelerate runs several "
            "processes only through MPI (--mpirun_hostfile). For N CPU processes on one machine run "
            "`accelerate launch --multi_gpu --num_processes N -m hf_ssd.cli eval --device cpu ...` (torchrun "
            "underneath; hf-ssd joins the processes over gloo), or drop --num_processes for one process.")
    cpu = use_cpu or args.device == "cpu" or not torch.cuda.is_available()
    return PartialState(cpu=cpu)


def cmd_eval(args) -> int:
    import contextlib
    import os
    from pathlib import Path

    from ..bench import eval as ev
    from ..bench import store
    from ..bench.runner import torch_threads
    from ..bench.scoring import ScoringError, check_metric

    options = ssd_options(args) if args.method == "ssd" else {}
    try:
        ev.check_batch_size(args.batch_size, args.method)  # before anything is written or loaded
        SSDConfig(**options)
        data = ev.load_data(args.data, args.field, args.split, args.limit)
        ev.check_prompts(data, args.chat)
        if args.metric is not None:
            check_metric(args.metric, data.columns, args.reference_field, args.allow_code_execution)
        generation = ev.generation_options(args.max_new_tokens, args.do_sample, args.temperature, args.top_k,
                                           args.top_p, args.seed)
    except (SSDConfigError, ev.EvalError, ScoringError) as err:
        raise SystemExit(f"hf-ssd: {err}") from err
    state = _eval_state(args)
    models = _eval_models(args)
    # The batch size is not among the settings: greedy completions are identical at every batch size (each row is
    # exact: SSD's batched loop per row, the target's own batched generate on left-padded rows), so a run may be
    # resumed, or extended, at another --batch-size without mixing different results. (In float16/bfloat16 a
    # batched kernel may round differently from a one-row one and flip a near-tie, as in any batched generate.
    # Sampled completions follow the same distribution at any batch size; their draws depend on the batches, see
    # hf_ssd/bench/eval.py.)
    settings = ev.eval_settings(data, models, generation, args.method, options, args.chat)
    lock = store.exclusive(Path(args.out)) if state.is_main_process else contextlib.nullcontext()
    try:
        with lock:
            store.check_settings(Path(args.out), settings, write=state.is_main_process)  # before loading models
            if args.device == "auto" and state.num_processes > 1:
                args.device = str(state.device)  # GPU i for process i (or the CPU)
            threads = args.threads
            if threads is None and not args.tiny and state.num_processes > 1 and state.device.type == "cpu":
                cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
                threads = max(1, cores // state.num_processes)  # the cores divided between the processes
            with torch_threads(threads):
                with state.main_process_first():  # the main process fills the model cache first
                    target, draft, tokenizer = load_models(args)
                summary = ev.evaluate_dataset(
                    target, draft, tokenizer, data, args.out, chat=args.chat, max_new_tokens=args.max_new_tokens,
                    do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    seed=args.seed, method=args.method, ssd_options=options, batch_size=args.batch_size,
                    models=models, metric=args.metric,
                    reference_field=args.reference_field, allow_code_execution=args.allow_code_execution,
                    progress=not args.no_progress, state=state)
    except (ev.EvalError, store.StoreError, ScoringError) as err:
        raise SystemExit(f"hf-ssd: {err}") from err
    if summary is not None:
        print((Path(args.out) / "summary.md").read_text(encoding="utf-8"))
        print(f"[hf-ssd] results in {args.out}: results.jsonl, settings.json, summary.json, summary.md, "
              + ", ".join(Path(p).name for p in summary["plots"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.verbose:
        import transformers

        transformers.logging.set_verbosity_error()
    command = {"generate": cmd_generate, "bench": cmd_bench, "tune": cmd_tune, "eval": cmd_eval}[args.command]
    with _torch_threads(args.threads or (1 if args.tiny else None)), _profile_switch(args):
        return command(args)


def _profile_switch(args):
    """`--no-profile`: no tuning profile is read during the command (`hf-ssd tune` still writes its new one)."""
    import contextlib

    from ..scheduling import profile

    return profile.ignored() if getattr(args, "no_profile", False) else contextlib.nullcontext()


def _torch_threads(n: int | None):
    """Torch's intra-op threads for one command, restored afterwards (main() also runs in-process)."""
    from ..bench.runner import torch_threads

    return torch_threads(n)

