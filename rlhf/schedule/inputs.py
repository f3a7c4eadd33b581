"""The schedule search's command-line input, checked before the search starts (tools/search_schedule.py).

``--model`` key=value shapes, the problem from ``--problem`` or from the cost
model's flags, the activation cap (``--mem-cap``, absolute or a multiple of
the serial 1F1B peak) that some start schedule of the search must meet, and
the ceiling without a cap (``--mem-ceiling``). Each
refusal is a UsageError naming the flag and what would be valid.
"""
from __future__ import annotations

from rlhf.cli import UsageError, check_out_path, check_range
from rlhf.schedule.cost_model import LLAMA, CostConfig, ModelShape, build_problem
from rlhf.schedule.io import load_problem
from rlhf.schedule.lower_bound import min_peak_memory, serial_peak_memory
from rlhf.schedule.problem import Problem, ProblemError
from rlhf.schedule.search import start_pool

INT_KEYS = {"layers", "hidden", "ffn", "heads", "kv_heads", "tp", "pp", "mb"}
MODEL_KEYS = "name, size or layers/hidden/ffn/heads[/kv_heads], tp, pp, mb, direction"
MAX_BUDGET = 1e6
"""Largest --budget / --memory-budget in nominal seconds (the proposal count must stay a practical number)."""


def parse_model(text: str) -> ModelShape:
    """One ``--model`` value (key=value pairs) as a ModelShape; UsageError naming the flag and the bad pair."""
    kv = {}
    for part in text.split(","):
        k, eq, v = (x.strip() for x in part.partition("="))
        if not eq:
            raise UsageError(f"--model: part {part!r} of {text!r} is not key=value; keys: {MODEL_KEYS}")
        if k in INT_KEYS:
            try:
                kv[k] = int(v)
            except ValueError:
                raise UsageError(f"--model: {k}={v!r} must be an integer") from None
        else:
            kv[k] = v
    size = kv.pop("size", None)
    if size is not None:
        if size not in LLAMA:
            raise UsageError(f"--model: size={size!r} is not a LLaMA preset; known sizes {sorted(LLAMA)}")
        kv = {**LLAMA[size], **kv}
    kv["microbatches"] = kv.pop("mb", None)
    try:
        return ModelShape(**kv)
    except (TypeError, ProblemError) as err:  # a missing or unknown key, a bad value
        raise UsageError(f"--model: {text!r}: {err}; keys: {MODEL_KEYS}") from None


def problem_from_flags(args) -> Problem:
    """The problem of ``--problem`` or of the ``--model`` flags and the cost model (UsageError naming the flag)."""
    if args.problem is not None:
        try:
            return load_problem(args.problem)
        except ProblemError as err:  # unreadable file, bad JSON, a bad value (named)
            raise UsageError(f"--problem: {err}") from None
    flags = {"tokens_per_microbatch": "--tokens", "seq_len": "--seq-len", "gpu_flops": "--gpu-tflops",
             "mfu": "--mfu", "comm": "--comm", "gpus": "--gpus"}
    try:
        cfg = CostConfig(tokens_per_microbatch=args.tokens, seq_len=args.seq_len,
                         gpu_flops=args.gpu_tflops * 1e12, mfu=args.mfu, comm=args.comm, gpus=args.gpus)
    except ProblemError as err:
        flag = next((f for k, f in flags.items() if f"CostConfig.{k}=" in str(err)), "cost model")
        raise UsageError(f"{flag}: {err}") from None
    try:
        return build_problem([parse_model(text) for text in args.model], cfg)
    except ProblemError as err:
        raise UsageError(f"{'--gpus' if str(err).startswith('gpus=') else '--model'}: {err}") from None


def resolve_cap(args, pb: Problem) -> tuple:
    """(the activation cap per stage or None, what set it): ``--mem-cap`` (absolute, or ``1.25x`` of the
    serial 1F1B peak), else the problem file's ``mem_cap``."""
    text = args.mem_cap
    if text is None:
        return pb.mem_cap, f"--problem {args.problem}: mem_cap"
    valid = f"a number ({pb.mem_unit}) or a multiple of the serial 1F1B peak such as 1.25x"
    try:
        number = float(text[:-1] if text.endswith("x") else text)
    except ValueError:
        raise UsageError(f"--mem-cap: {text!r} is not a number; give {valid}") from None
    if not text.endswith("x"):
        return check_range("--mem-cap", number, 0, low_open=True, unit=pb.mem_unit), "--mem-cap"
    check_range("--mem-cap", number, 0, low_open=True, unit="(times the serial 1F1B peak, e.g. 1.25x)")
    serial = max(serial_peak_memory(pb))
    if serial == 0:
        raise UsageError(f"--mem-cap: {text} of a serial 1F1B peak of 0: the problem holds no activation memory "
                         "(act_mem is 0); drop --mem-cap")
    return number * serial, "--mem-cap"


def check_cap(pb: Problem, cap, flag: str) -> None:
    """Refuse a cap that no schedule meets (below :func:`min_peak_memory`), or one that none of the search's
    start schedules meets, before the search starts; the message gives the feasible minimum."""
    if cap is None:
        return
    unit, need, serial = pb.mem_unit, max(min_peak_memory(pb)), max(serial_peak_memory(pb))
    if cap < need - 1e-9:
        raise UsageError(f"{flag}: {cap:g} {unit} is below the feasible minimum {need:g} {unit} (the largest "
                         f"activation of one micro-batch on one stage); give at least {need:g} (serial 1F1B "
                         f"needs {serial:g}, 1x)")
    if cap < serial - 1e-9 and not start_pool(pb, cap):
        raise UsageError(f"{flag}: the search finds no start schedule within {cap:g} {unit} (the feasible minimum "
                         f"is {need:g}); give a larger cap, at most the serial 1F1B peak {serial:g} (1x), which "
                         "always works")


def parse_ceiling(text: str) -> float | None:
    """``--mem-ceiling``: a multiple of the serial 1F1B peak (``2x`` or ``2``, at least 1), or None for
    ``none``; UsageError naming the flag otherwise."""
    if text.strip().lower() == "none":
        return None
    try:
        number = float(text[:-1] if text.endswith("x") else text)
    except ValueError:
        raise UsageError(f"--mem-ceiling: {text!r} is not a number; give a multiple of the serial 1F1B peak "
                         "such as 2x (at least 1x), or none") from None
    return check_range("--mem-ceiling", number, 1, unit="(times the serial 1F1B peak, e.g. 2x)")


def check_inputs(args) -> tuple:
    """(problem, cap, ceiling) of the flags, with every number and output path checked before the search
    starts."""
    check_range("--budget", args.budget, 0, MAX_BUDGET, unit="nominal seconds")
    check_range("--memory-budget", args.memory_budget, 0, MAX_BUDGET, unit="nominal seconds")
    check_range("--t0-scale", args.t0_scale, 0, low_open=True)
    check_range("--makespan-slack", args.makespan_slack, 0, 1)
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        if path is not None:
            check_out_path(flag, path)
    ceiling = parse_ceiling(args.mem_ceiling)
    pb = problem_from_flags(args)
    cap, flag = resolve_cap(args, pb)
    check_cap(pb, cap, flag)
    return pb, cap, ceiling
