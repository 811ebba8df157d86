"""The ``mla-kv`` command line.

    mla-kv plan --model glm-4.7-flash --gpu-mem-gib 32 --weights-gb 18.4 [--kv-format F|all] [--json [PATH]]
                [--plot FILE.png]
    mla-kv demo [--model PRESET|PATH] [--device cpu|cuda] [--layers N] [--prompt-len P] [--decode-steps N]
    mla-kv info
    mla-kv bench [--quick] [--json PATH] [--plot PATH]      (or: mla-kv bench OP [OP's options])
    mla-kv --version

Bad arguments print one line to stderr and exit with code 2 (no traceback); an unknown option is
reported before missing required ones. ``--json PATH`` writes JSON to PATH in plan and bench alike
(plan's ``--json`` alone, or ``--json -``, prints it instead of the table). A closed stdout (``mla-kv demo |
head -3``) ends the command quietly. The demo is mla_kv.demo, the benchmarks mla_kv.bench (which parses
its own options).
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
from typing import Optional

from . import _plot, __version__, demo, layout, planner
from .planner import GB, GiB


class _Parser(argparse.ArgumentParser):
    """Reports errors as one line ("mla-kv plan: error: ...") and exit code 2, without the usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        """argparse checks required options before it looks for unknown ones, so ``plan --modle x`` would
        report a missing --model; a first pass with nothing required reports the unknown option first."""
        required = [a for p in (self, *_subparsers(self)) for a in p._actions if a.required]
        for action in required:
            action.required = False
        try:
            known, unknown = self.parse_known_args(args, namespace)
        finally:
            for action in required:
                action.required = True
        if unknown:
            parser = getattr(known, "parser", self)
            parser.error(_unknown_message(parser, unknown))
        return super().parse_args(args, namespace)


def _subparsers(parser: argparse.ArgumentParser) -> list:
    return [p for a in parser._actions if isinstance(a, argparse._SubParsersAction) for p in a.choices.values()]


def _unknown_message(parser: argparse.ArgumentParser, unknown: list) -> str:
    message = f"unrecognized arguments: {' '.join(unknown)}"
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    close = (difflib.get_close_matches(unknown[0].split("=")[0], options, n=1, cutoff=0.75)
             if unknown[0].startswith("--") else [])
    return message + (f" (did you mean {close[0]}?)" if close else "")


# Bounds of the memory options: far above any GPU or model, and they keep byte counts finite (and
# exact) in floating point, which --gpu-mem-gib 1e300 (x 2^30 = inf) would not.
_MAX_GIB = 2 ** 20   # 1 PiB
_MAX_GB = 10 ** 6    # 1 PB


def _bound(x: float) -> str:
    return f"{int(x):,}" if x == int(x) else f"{x:g}"


def _number(minimum: float, *, inclusive: bool, maximum: float = math.inf):
    """An argparse type: a finite float above (or at, if inclusive) minimum and at most maximum."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        low_ok = value >= minimum if inclusive else value > minimum
        if not (math.isfinite(value) and low_ok and value <= maximum):
            bound = f"{'>=' if inclusive else '>'} {_bound(minimum)}"
            if maximum != math.inf:
                bound += f" and <= {_bound(maximum)}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    return parse


def _integer(minimum: int, maximum: Optional[int] = None):
    """An argparse type: an int in [minimum, maximum]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" + ("" if maximum is None else f" and <= {maximum}")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    return parse


_positive_int = _integer(1)

# --kv-format spellings: "16bit" (or "none") is kv_format None, the unquantized row in --dtype.
_KV_FORMATS = {"16bit": None, "none": None,
               **{f: f for f in (*layout.KV_FORMATS, *planner.V4_KV_FORMATS) if f is not None}}
# torch.Generator.manual_seed takes [-2^63, 2^64 - 1]; the demo seeds with seed and seed + 1
_seed = _integer(-2 ** 63, 2 ** 64 - 2)


def _build_parser() -> _Parser:
    parser = _Parser(prog="mla-kv", description="MLA latent KV cache: plan (the context that fits), demo (the "
                                                "ops against HF transformers), info (build and GPUs), bench "
                                                "(the kernel benchmarks).",
                     epilog="mla-kv COMMAND --help lists a command's options.")
    parser.add_argument("--version", action="version", version=f"mla_kv {__version__}",
                        help="print the package version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser(
        "plan", help="KV cache bytes per token and the context that fits, latent vs expanded layout",
        description="KV cache bytes per token and the context that fits on a GPU. Memory accounting "
                    "(per GPU): cache = ratio x (GPU memory - weights/tp - reserved), in whole blocks.")
    p.add_argument("--model", required=True,
                   help=f"a preset ({', '.join(planner.MODELS)}) or a local HF config.json / its directory")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", choices=list(planner.GPU_MEM_GIB), help="GPU preset (nominal memory)")
    gpu.add_argument("--gpu-mem-gib", type=_number(0, inclusive=False, maximum=_MAX_GIB), metavar="GIB",
                     help="GPU memory in GiB (default: the current CUDA GPU)")
    p.add_argument("--weights-gb", type=_number(0, inclusive=True, maximum=_MAX_GB), required=True, metavar="GB",
                   help="model weight size in GB (10^9 B), whole model; each GPU holds weights / tp")
    p.add_argument("--ratio", type=_number(0, inclusive=False, maximum=1), default=planner.DEFAULT_RATIO,
                   help="fraction of FREE memory (after weights and reserved) given to the cache "
                        "(TurboMind cache_max_entry_count; default %(default)s)")
    p.add_argument("--reserved-gib", type=_number(0, inclusive=True, maximum=_MAX_GIB),
                   default=planner.DEFAULT_RESERVED_BYTES / GiB, metavar="GIB",
                   help="runtime memory taken before the cache is sized: CUDA context, workspaces, "
                        "activations (default %(default)g)")
    p.add_argument("--block-size", type=_positive_int, default=planner.DEFAULT_BLOCK_SIZE,
                   help="tokens per cache block (default %(default)s)")
    p.add_argument("--dtype", choices=list(planner.CACHE_DTYPES), default="fp16",
                   help="cache dtype: of the unquantized rows, and of int8/int4's per-token scale and zero")
    p.add_argument("--kv-format", choices=[*_KV_FORMATS, "all"], default="16bit",
                   help="cache format: 16bit (or none; default): unquantized rows in --dtype, latent and expanded "
                        "layouts; fp8, fp8_ds_mla, int8, int4: quantized latent rows (no expanded layout); "
                        "all: every format side by side, latent layout")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel size (splits heads)")
    p.add_argument("--cp", type=_positive_int, default=1,
                   help="context parallel size (splits tokens: multiplies the context that fits)")
    p.add_argument("--mtp", action="store_true",
                   help="also cache the model's MTP layers (engines running MTP speculative decoding)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the plan as JSON to PATH (as mla-kv bench --json PATH does) besides the table; "
                        "--json alone (or --json -) prints the JSON instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="plot the context that fits vs GPU memory (matplotlib)")
    p.set_defaults(run=_plan, parser=p)

    p = commands.add_parser(
        "demo", help="run MLA attention layers through the library's ops and check them against HF transformers",
        description="Builds the first --layers attention layers of a model with its real shapes (random "
                    "weights, or a local checkpoint's), runs a prompt (fused_write_kv + prefill) and "
                    "--decode-steps single-token steps (fused_write_kv + decode) on a paged latent cache, and "
                    "compares every step with HF transformers' attention module on the same weights. DSA models "
                    "(deepseek-v3.2, glm-5.x) run the indexer (write_index_keys, index_scores, index_topk) and "
                    "sparse_attention instead, their top-k checked against HF's indexer. Exit "
                    "code 0: every step within tolerance; 1: an error above it; 2: bad arguments.")
    mla_presets = [name for name, m in planner.MODELS.items() if m.attention == "mla"]
    p.add_argument("--model", default="glm-4.7-flash",
                   help=f"a preset ({', '.join(mla_presets)}; default %(default)s), a local HF checkpoint "
                        "directory (config.json; its *.safetensors give the weights) or a config.json")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="cuda: the CUDA kernels; cpu: the PyTorch reference ops (default: cuda when present)")
    p.add_argument("--dtype", choices=list(demo.DTYPES),
                   help="dtype of the library's run (default: fp32 on cpu; bf16 on cuda, fp16 below sm80); "
                        "HF runs in fp32 on the same weights, rounded to this dtype")
    p.add_argument("--layers", type=_positive_int, default=2, help="attention layers (default %(default)s)")
    p.add_argument("--heads", type=_positive_int,
                   help="run fewer attention heads than the model has (random weights only), for faster CPU runs")
    p.add_argument("--prompt-len", type=_positive_int,
                   help=f"prompt tokens (default {demo.DENSE_PROMPT_LEN}; DSA models: "
                        f"{demo.DSA_DEFAULTS['cpu']['prompt_len']} on cpu, {demo.DSA_DEFAULTS['cuda']['prompt_len']:,} "
                        "on cuda, past the top-k)")
    p.add_argument("--index-topk", type=_positive_int, metavar="K",
                   help=f"DSA models: the indexer's top-k (default {demo.DSA_DEFAULTS['cpu']['topk']} on cpu, so that "
                        f"selection matters at a short context; the model's on cuda)")
    p.add_argument("--decode-steps", type=_positive_int, default=4,
                   help="single-token decode steps after the prompt (default %(default)s)")
    p.add_argument("--block-size", type=_positive_int, default=planner.DEFAULT_BLOCK_SIZE,
                   help="cache block size, also used by the plan (default %(default)s)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the weights and inputs (default %(default)s)")
    p.add_argument("--kv-format", choices=[f for f in layout.KV_FORMATS if f], default=None,
                   help="a quantized latent cache (fp8 with dequant scale 1, fp8_ds_mla, int8, int4), written "
                        "and read by the kernels on cuda (the reference on cpu): the error shown is the format's")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", choices=list(planner.GPU_MEM_GIB), help="plan the cache for this GPU preset")
    gpu.add_argument("--gpu-mem-gib", type=_number(0, inclusive=False, maximum=_MAX_GIB), metavar="GIB",
                     help="plan the cache for a GPU of this memory (default: the current CUDA GPU)")
    p.add_argument("--weights-gb", type=_number(0, inclusive=True, maximum=_MAX_GB), metavar="GB",
                   help="model weight size in GB for the plan (default: a checkpoint's .safetensors, else 0)")
    p.set_defaults(run=_demo, parser=p)

    p = commands.add_parser("info", help="version, built CUDA archs and compiler, GPUs and kernel variants")
    p.set_defaults(run=_info, parser=p)

    # main() hands "mla-kv bench ..." to mla_kv.bench before this parser sees it: the benchmarks
    # parse their own options (mla-kv bench --help, mla-kv bench OP --help).
    p = commands.add_parser("bench", add_help=False,
                            help="the kernel benchmarks (CUDA GPU only): mla-kv bench [OP] --quick [--json PATH] "
                                 "[--plot PATH]; mla-kv bench --help lists the ops")
    p.set_defaults(run=lambda args: main(["bench"]))
    return parser


# ---- plan -------------------------------------------------------------------------------------

def _gpu_memory(args) -> tuple:
    """(label, bytes) of the GPU to plan for: --gpu-mem-gib, --gpu, else the current CUDA GPU."""
    if args.gpu_mem_gib is not None:
        return "--gpu-mem-gib", int(args.gpu_mem_gib * GiB)
    if args.gpu is not None:
        return args.gpu, planner.gpu_mem_bytes(args.gpu)
    found = planner.current_gpu()
    if found is None:
        args.parser.error("no CUDA GPU found: pass --gpu PRESET or --gpu-mem-gib N")
    return found


# planner parameters whose values the options' argparse types cannot check alone -> their options
_PLAN_OPTIONS = {"tp": "--tp", "kv_format": "--kv-format", "cache_dtype": "--dtype"}


def _as_option(message: str) -> str:
    """A planner message naming the option: "tp: 3 does not divide ..." -> "--tp: 3 ...". The options'
    argparse types bound every other plan parameter; what is left for the planner to refuse is a --tp
    that does not divide the model's heads and a --kv-format the model (GQA, rows not 512 + 64) or
    --dtype (fp32 for int8/int4's scale and zero) has no form of."""
    name, sep, rest = message.partition(": ")
    return f"{_PLAN_OPTIONS[name]}: {rest}" if sep and name in _PLAN_OPTIONS else message


def _plan_kwargs(args) -> dict:
    """plan()'s keyword arguments from the options (without kv_format for --kv-format all)."""
    kwargs = dict(ratio=args.ratio, reserved_bytes=args.reserved_gib * GiB, block_size=args.block_size,
                  cache_dtype=args.dtype, tp=args.tp, cp=args.cp, count_mtp_layers=args.mtp)
    if args.kv_format != "all":
        kwargs["kv_format"] = _KV_FORMATS[args.kv_format]
    return kwargs


def _plan(args) -> int:
    if args.plot and args.kv_format == "all":
        args.parser.error("--plot: plots one --kv-format at a time, not all")
    missing = _plot.matplotlib_missing() if args.plot else None
    if missing:
        print(f"mla-kv plan: {missing}", file=sys.stderr)
        return 1
    try:
        model = planner.load_model(args.model)
        gpu_label, gpu_bytes = _gpu_memory(args)
        if args.kv_format == "all":
            results = planner.plan_kv_formats(model, gpu_bytes, args.weights_gb * GB, **_plan_kwargs(args))
        else:
            result = planner.plan(model, gpu_bytes, args.weights_gb * GB, **_plan_kwargs(args))
    except (ValueError, TypeError) as e:
        args.parser.error(_as_option(str(e)))
    first = results[0] if args.kv_format == "all" else result
    if first.free_bytes <= 0:
        args.parser.error(_no_room(first, args))

    if args.kv_format == "all":
        _print_plan(args, lambda: _formats_json(results, gpu_label), planner.format_kv_formats(results, gpu_label))
        return 0
    _print_plan(args, lambda: dict(result.to_dict(), gpu=gpu_label), planner.format_plan(result, gpu_label))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        path = _plot.written_path(args.plot)  # "out" is written as out.png
        try:
            _plot_context(path, result, args.weights_gb * GB, _plan_kwargs(args))
        except (OSError, ValueError) as e:  # an unwritable path or an image format matplotlib lacks
            args.parser.error(f"--plot {args.plot}: {e}")
        if args.json != "-":
            print(f"\nplot written to {path}")
    return 0


def _no_room(result: planner.MemoryPlan, args) -> str:
    """Why no cache fits: the weights (per GPU) and the reserved memory take the whole GPU."""
    weights, reserved = result.weight_bytes_per_gpu, result.reserved_bytes
    what = "the weights do not fit" if weights >= result.gpu_mem_bytes else "no memory is left for the KV cache"
    split = f" / tp {result.tp}" if result.tp > 1 else ""
    return (f"{what}: weights {weights / GB:.2f} GB per GPU (--weights-gb {args.weights_gb:g}{split}) + reserved "
            f"{reserved / GiB:.2f} GiB >= the GPU's {result.gpu_mem_bytes / GiB:.2f} GiB; use a larger GPU, a "
            f"larger --tp or a smaller --reserved-gib")


def _print_plan(args, as_json, table: str) -> None:
    """The table on stdout, or with --json alone the JSON instead; --json PATH also writes it to PATH."""
    if args.json == "-":
        print(json.dumps(as_json(), indent=2))
        return
    if args.json is not None:
        try:
            with open(args.json, "w") as f:
                json.dump(as_json(), f, indent=2)
                f.write("\n")
        except OSError as e:
            args.parser.error(f"--json {args.json}: {e.strerror or e}")
    print(table)


def _formats_json(results, gpu_label: str) -> dict:
    """--kv-format all --json: the inputs and memory split once, then "kv_formats": one latent layout
    plan per format, each with its kv_format (null: unquantized)."""
    first = results[0].to_dict()
    out = dict({k: v for k, v in first.items() if k not in results[0].layouts}, gpu=gpu_label)
    out["kv_formats"] = [dict(kv_format=r.kv_format, **r.to_dict()["latent"]) for r in results]
    return out


def _plot_context(path: str, result: planner.MemoryPlan, weight_bytes: float, plan_kwargs: dict) -> None:
    """Context that fits (per layout) vs GPU memory per GPU, with the model's max context."""
    import matplotlib.pyplot as plt

    floor_gib = (result.weight_bytes_per_gpu + result.reserved_bytes) / GiB
    gpu_gib = result.gpu_mem_bytes / GiB
    top_gib = max(2 * gpu_gib, floor_gib + 16)
    mems = [floor_gib + (top_gib - floor_gib) * i / 200 for i in range(1, 201)]

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, here in result.layouts.items():
        tokens = [planner.plan(result.model, g * GiB, weight_bytes, **plan_kwargs).layouts[name].max_tokens
                  for g in mems]
        line, = ax.plot(mems, [max(t, 1) for t in tokens], label=f"{name} ({here.bytes_per_token:,} B/token)")
        if here.max_tokens > 0:  # a log axis cannot show 0
            ax.plot([gpu_gib], [here.max_tokens], "o", color=line.get_color())
            ax.annotate(f"{here.max_tokens:,}", (gpu_gib, here.max_tokens), textcoords="offset points",
                        xytext=(6, -12))
    ax.axhline(result.model.max_context, color="gray", linestyle="--",
               label=f"model max context {result.model.max_context:,}")
    ax.axvline(gpu_gib, color="black", linestyle=":", label=f"this plan: {gpu_gib:g} GiB")
    ax.set_yscale("log")
    ax.set_xlabel("GPU memory (GiB)")
    ax.set_ylabel("tokens that fit in the KV cache")
    ax.set_title(f"{result.model.name}: weights {result.weight_bytes_per_gpu / GB:.1f} GB/GPU, "
                 f"ratio {result.ratio:g}, {planner.format_label(result)}, tp {result.tp}, cp {result.cp}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- demo -------------------------------------------------------------------------------------

def _demo(args) -> int:
    gpu = _gpu_memory(args) if (args.gpu or args.gpu_mem_gib) else None  # None: the current GPU, if any
    return demo.main(args, gpu)


# ---- info -------------------------------------------------------------------------------------

def _info(args) -> int:
    import torch

    print(f"mla_kv       {__version__}")
    print(f"torch        {torch.__version__} (CUDA runtime {torch.version.cuda or 'none'})")
    try:
        from . import _build_info
    except ImportError:
        _build_info = None
    if _build_info is None:
        print("kernels      no build info (running from a source tree without a build): reference ops only")
    elif not _build_info.WITH_CUDA:
        print("kernels      not built (reference-only install): ops on CUDA tensors raise")
    else:
        archs = ", ".join(f"sm_{a}" for a in _build_info.CUDA_ARCHS)
        print(f"kernels      built for {archs} with {_build_info.CUDA_COMPILER}")

    compiled = None
    if _build_info is not None and _build_info.WITH_CUDA:
        from ._compiled import _C as compiled, load_error
        if compiled is None:
            print(f"             the compiled module does not load: {load_error}")

    if not torch.cuda.is_available():
        print("GPU          none found: the reference (PyTorch) path only")
        return 0
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        cc = props.major * 10 + props.minor
        if compiled is None:
            variant = "none (no kernels in this install)"
        else:
            arch = compiled.resolve_arch(compiled.Arch.auto, cc)
            variant = _cannot_run(cc, _build_info.CUDA_ARCHS) if arch == compiled.Arch.auto else arch.name
        print(f"GPU {i}        {props.name}, sm_{cc}, {props.total_memory / GiB:.1f} GiB -> kernel variant {variant}")
        if compiled is not None and arch != compiled.Arch.auto:
            with torch.cuda.device(i):
                limits = compiled.device_smem_limits()
                tiles = [compiled.attention_tiles(arch, rows, compiled.SmemLimits()) for rows in (16, 32, 64)]
            shapes = ", ".join(f"{t.block_m}x{t.block_n}/{t.stages} {t.smem_bytes:,} B" if t.block_m else "none fits"
                               for t in tiles)
            print(f"             shared memory {limits.per_block:,} B per block, {limits.per_sm:,} per SM; "
                  f"attention tiles for 16 / 32 / 64 rows: {shapes}")
    return 0


def _cannot_run(cc: int, archs) -> str:
    """What info says of a GPU that no compiled target serves (a target runs on its own arch and newer)."""
    built = ", ".join(f"sm_{a}" for a in archs) or "no arch"
    if cc < 75:
        how = ("sm_70 needs a CUDA 12.x nvcc: CUDACXX=/usr/local/cuda-12.9/bin/nvcc MLA_KV_CUDA_ARCHS=70 "
               "pip install .")
    else:
        how = f"reinstall with MLA_KV_CUDA_ARCHS={cc} (or add it to the list)"
    return f"none: this build ({built}) cannot run on this GPU; {how}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["bench"]:
            from . import bench

            code = bench.main(argv[1:], prog="mla-kv bench")
        else:
            parser = _build_parser()
            args = parser.parse_args(argv)
            code = args.run(args)
        sys.stdout.flush()  # inside the try: a pipe closed early fails here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _stdout_closed()


def _stdout_closed() -> int:
    """The reader of stdout went away (``mla-kv demo | head -3``): stop quietly, as a command killed by
    SIGPIPE would (exit 141, 128 + SIGPIPE). stdout goes to devnull so that Python's final flush of what
    is still buffered does not report the broken pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor
        pass
    return 141


if __name__ == "__main__":
    sys.exit(main())
