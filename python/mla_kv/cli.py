"""The ``mla-kv`` command line.

    mla-kv plan --model glm-4.7-flash --gpu-mem-gib 32 --weights-gb 18.4 [--json] [--plot FILE.png]
    mla-kv demo [--model PRESET|PATH] [--device cpu|cuda] [--layers N] [--prompt-len P] [--decode-steps N]
    mla-kv info
    mla-kv bench [--quick]

Bad arguments print one line to stderr and exit with code 2 (no traceback).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from . import __version__, demo, planner
from .planner import GB, GiB


class _Parser(argparse.ArgumentParser):
    """Reports errors as one line ("mla-kv plan: error: ...") and exit code 2, without the usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


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
# torch.Generator.manual_seed takes [-2^63, 2^64 - 1]; the demo seeds with seed and seed + 1
_seed = _integer(-2 ** 63, 2 ** 64 - 2)


def _build_parser() -> _Parser:
    parser = _Parser(prog="mla-kv", description="MLA latent KV cache: planner, build info, benchmarks.")
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
    p.add_argument("--dtype", choices=list(planner.CACHE_DTYPES), default="fp16", help="cache dtype")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel size (splits heads)")
    p.add_argument("--cp", type=_positive_int, default=1,
                   help="context parallel size (splits tokens: multiplies the context that fits)")
    p.add_argument("--mtp", action="store_true",
                   help="also cache the model's MTP layers (engines running MTP speculative decoding)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot the context that fits vs GPU memory (matplotlib)")
    p.set_defaults(run=_plan, parser=p)

    p = commands.add_parser(
        "demo", help="run MLA attention layers through the library's ops and check them against HF transformers",
        description="Builds the first --layers attention layers of a model with its real shapes (random "
                    "weights, or a local checkpoint's), runs a prompt (fused_write_kv + prefill) and "
                    "--decode-steps single-token steps (fused_write_kv + decode) on a paged latent cache, and "
                    "compares every step with HF transformers' attention module on the same weights. Exit "
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
    p.add_argument("--prompt-len", type=_positive_int, default=64, help="prompt tokens (default %(default)s)")
    p.add_argument("--decode-steps", type=_positive_int, default=4,
                   help="single-token decode steps after the prompt (default %(default)s)")
    p.add_argument("--block-size", type=_positive_int, default=planner.DEFAULT_BLOCK_SIZE,
                   help="cache block size, also used by the plan (default %(default)s)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the weights and inputs (default %(default)s)")
    gpu = p.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", choices=list(planner.GPU_MEM_GIB), help="plan the cache for this GPU preset")
    gpu.add_argument("--gpu-mem-gib", type=_number(0, inclusive=False, maximum=_MAX_GIB), metavar="GIB",
                     help="plan the cache for a GPU of this memory (default: the current CUDA GPU)")
    p.add_argument("--weights-gb", type=_number(0, inclusive=True, maximum=_MAX_GB), metavar="GB",
                   help="model weight size in GB for the plan (default: a checkpoint's .safetensors, else 0)")
    p.set_defaults(run=_demo, parser=p)

    p = commands.add_parser("info", help="version, built CUDA archs and compiler, GPUs and kernel variants")
    p.set_defaults(run=_info, parser=p)

    p = commands.add_parser("bench", help="run the kernel benchmarks bench/bench_*.py (CUDA GPU only)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (passed to each script)")
    p.set_defaults(run=_bench, parser=p)
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


def _as_option(message: str) -> str:
    """A planner message naming the option: "tp: 3 does not divide ..." -> "--tp: 3 ...". The options'
    argparse types bound every other plan parameter; a --tp that does not divide the model's heads is
    what is left for the planner to refuse."""
    return "--" + message if message.startswith("tp: ") else message


def _plan_kwargs(args) -> dict:
    return dict(ratio=args.ratio, reserved_bytes=args.reserved_gib * GiB, block_size=args.block_size,
                cache_dtype=args.dtype, tp=args.tp, cp=args.cp, count_mtp_layers=args.mtp)


def _plan(args) -> int:
    if args.plot:
        try:
            import matplotlib
        except ImportError:
            print("mla-kv plan: --plot needs matplotlib: pip install matplotlib (or mla_kv[plot])",
                  file=sys.stderr)
            return 1
    try:
        model = planner.load_model(args.model)
        gpu_label, gpu_bytes = _gpu_memory(args)
        result = planner.plan(model, gpu_bytes, args.weights_gb * GB, **_plan_kwargs(args))
    except (ValueError, TypeError) as e:
        args.parser.error(_as_option(str(e)))

    if args.json:
        print(json.dumps(dict(result.to_dict(), gpu=gpu_label), indent=2))
    else:
        print(_plan_table(result, gpu_label))
    if args.plot:
        matplotlib.use("Agg")
        try:
            _plot(args.plot, result, args.weights_gb * GB, _plan_kwargs(args))
        except (OSError, ValueError) as e:  # an unwritable path or an image format matplotlib lacks
            args.parser.error(f"--plot {args.plot}: {e}")
        if not args.json:
            print(f"\nplot written to {args.plot}")
    return 0


def _plan_table(result: planner.MemoryPlan, gpu_label: str) -> str:
    m = result.model
    heads = f"{m.num_heads} heads" if m.attention == "mla" else f"{m.num_kv_heads} KV heads x {m.head_dim}"
    layers = next(iter(result.layouts.values())).num_cached_layers
    lines = [
        f"model        {m.name}: {m.attention.upper()}, {layers} cached layers, {heads}, "
        f"max context {m.max_context:,}",
        f"GPU          {result.gpu_mem_bytes / GiB:.2f} GiB ({gpu_label}), tp {result.tp}, cp {result.cp}",
        f"memory/GPU   weights {result.weight_bytes_per_gpu / GB:.2f} GB, reserved "
        f"{result.reserved_bytes / GiB:.2f} GiB, free {result.free_bytes / GiB:.2f} GiB, "
        f"cache {result.ratio:g} x free = {result.cache_bytes / GiB:.2f} GiB",
        f"cache        {result.cache_dtype}, block size {result.block_size}",
        "",
    ]
    header = ("layout", "B/token/layer", "B/token", "B/block", "blocks", "max tokens", "session_len")
    rows = [header] + [
        (lp.layout, f"{lp.bytes_per_token_per_layer:,}", f"{lp.bytes_per_token:,}", f"{lp.bytes_per_block:,}",
         f"{lp.num_blocks:,}", f"{lp.max_tokens:,}",
         f"{lp.session_len:,}" + (" (truncated)" if lp.truncated else ""))
        for lp in result.layouts.values()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:-1], widths[1:-1])] + [r[-1]]
        lines.append("  ".join(cells))
    if "latent" in result.layouts:
        latent, expanded = result.layouts["latent"], result.layouts["expanded"]
        lines.append("")
        lines.append(f"the latent layout stores {expanded.bytes_per_token // latent.bytes_per_token}x "
                     "fewer bytes per token than the expanded per-head layout")
    return "\n".join(lines)


def _plot(path: str, result: planner.MemoryPlan, weight_bytes: float, plan_kwargs: dict) -> None:
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
                 f"ratio {result.ratio:g}, {result.cache_dtype}, tp {result.tp}, cp {result.cp}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- demo -------------------------------------------------------------------------------------

def _demo_device(args) -> tuple:
    """(torch.device, a one-line note or None): --device, else cuda when a GPU and the kernels are there."""
    import torch

    from .ops import kernels_available

    if args.device == "cuda":
        if not torch.cuda.is_available():
            args.parser.error("--device cuda: no CUDA GPU found (--device cpu runs the reference ops)")
        if not kernels_available():
            args.parser.error("--device cuda: this mla_kv install has no CUDA kernels (--device cpu runs the "
                              "reference ops)")
        return torch.device("cuda", torch.cuda.current_device()), None
    if args.device == "cpu":
        return torch.device("cpu"), None
    if torch.cuda.is_available() and kernels_available():
        return torch.device("cuda", torch.cuda.current_device()), None
    reason = "no CUDA GPU found" if not torch.cuda.is_available() else "this mla_kv install has no CUDA kernels"
    return torch.device("cpu"), f"{reason}: running the PyTorch reference ops (mla_kv.reference) on the CPU"


def _demo_dtype(args, device) -> str:
    """The --dtype name, or the device's default; rejects what the CUDA kernels do not run."""
    import torch

    if device.type == "cpu":
        return args.dtype or "fp32"
    cc = torch.cuda.get_device_capability(device)
    if args.dtype is None:
        return "bf16" if cc >= (8, 0) else "fp16"
    if args.dtype == "fp32":
        args.parser.error("--dtype fp32: the attention kernels run fp16 or bf16 (fp32 runs on --device cpu)")
    if args.dtype == "bf16" and cc < (8, 0):
        args.parser.error(f"--dtype bf16: the bf16 kernels need sm80 or newer, this GPU is sm_{cc[0]}{cc[1]}")
    return args.dtype


def _demo_plan(args, spec, dtype_name: str) -> str:
    """The planner's view of the model: bytes per token of both layouts, and what fits on the GPU."""
    cache_dtype = dtype_name if dtype_name in ("fp16", "bf16") else "fp16"
    lines = []
    if cache_dtype != dtype_name:
        lines.append(f"(planned for an {cache_dtype} cache, as deployed; this run's cache is {dtype_name})")
    gpu = _gpu_memory(args) if (args.gpu or args.gpu_mem_gib) else planner.current_gpu()
    if gpu is None:
        per_layer = spec.model.bytes_per_token_per_layer(planner.CACHE_DTYPES[cache_dtype].itemsize, 1)
        layers = spec.model.num_layers
        latent, expanded = per_layer["latent"], per_layer["expanded"]
        lines += [f"KV cache     {cache_dtype}, {layers} layers: latent {latent:,} B/token/layer "
                  f"({latent * layers:,} B/token), expanded per-head {expanded:,} B/token/layer "
                  f"({expanded * layers:,} B/token): {expanded // latent}x",
                  "context      no GPU found: pass --gpu PRESET or --gpu-mem-gib N (and --weights-gb) to see "
                  "the context that fits"]
        return "\n".join(lines)
    weights_gb = args.weights_gb
    if weights_gb is None and spec.checkpoint is not None:
        weights_gb = sum(os.path.getsize(os.path.join(spec.checkpoint, f)) for f in os.listdir(spec.checkpoint)
                         if f.endswith(".safetensors")) / GB
    if weights_gb is None:
        lines.append("(weights not counted: pass --weights-gb for the model's size)")
        weights_gb = 0.0
    result = planner.plan(spec.model, gpu[1], weights_gb * GB, block_size=args.block_size, cache_dtype=cache_dtype)
    lines.append(_plan_table(result, gpu[0]))
    return "\n".join(lines)


def _demo(args) -> int:
    try:
        spec = demo.resolve_model(args.model)
    except (ValueError, TypeError) as e:
        args.parser.error(str(e))
    if args.layers > spec.model.num_layers:
        args.parser.error(f"--layers {args.layers}: {spec.name} has {spec.model.num_layers} layers")
    if args.prompt_len + args.decode_steps > spec.model.max_context:
        args.parser.error(f"--prompt-len + --decode-steps = {args.prompt_len + args.decode_steps} exceeds "
                          f"{spec.name}'s max context {spec.model.max_context:,}")
    if args.heads is not None and spec.checkpoint is not None:
        args.parser.error(f"--heads: {spec.name}'s weights fix the heads; the override is for random weights")
    if args.block_size > spec.model.max_context:  # its blocks are allocated whole
        args.parser.error(f"--block-size {args.block_size}: exceeds {spec.name}'s max context "
                          f"{spec.model.max_context:,}")
    if args.heads is not None and args.heads > spec.model.num_heads:  # it makes runs faster, never larger
        args.parser.error(f"--heads {args.heads}: {spec.name} has {spec.model.num_heads} attention heads")
    device, note = _demo_device(args)
    dtype_name = _demo_dtype(args, device)
    try:
        stack = demo.build_stack(spec, args.layers, demo.DTYPES[dtype_name], device, seed=args.seed,
                                 num_heads=args.heads)
    except ImportError as e:  # transformers or safetensors missing: not an argument error
        print(f"mla-kv demo: {e}", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as e:
        args.parser.error(str(e))

    if device.type == "cuda":
        import torch

        cc = torch.cuda.get_device_capability(device)
        where = f"{device}, {torch.cuda.get_device_name(device)} (sm_{cc[0]}{cc[1]}): the CUDA kernels"
    else:
        where = "cpu: the PyTorch reference ops (mla_kv.reference)"
    if note:
        print(note)
    print(f"mla-kv demo  {spec.name}: prompt {args.prompt_len}, decode steps {args.decode_steps}, {dtype_name} "
          f"on {where}")
    print("\n".join(demo.describe(stack, args.block_size)), end="\n\n", flush=True)
    try:
        result = demo.run(stack, args.prompt_len, args.decode_steps, args.block_size, seed=args.seed,
                          time_kernels=device.type == "cuda")
    except (ValueError, TypeError) as e:  # an op rejecting this configuration (e.g. the block size)
        args.parser.error(str(e))
    print(demo.format_phases(result), end="\n\n")
    print(_demo_plan(args, spec, dtype_name))
    if result.timings_us:
        print()
        print(demo.format_timings(result.timings_us))
    if result.failed:
        worst = max(p.max_error for p in result.failed)
        print(f"mla-kv demo: error above tolerance {result.tolerance:g} in "
              f"{', '.join(p.name for p in result.failed)} (max {worst:.2e})", file=sys.stderr)
        return 1
    return 0


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
        try:
            from . import _C as compiled
        except ImportError as e:
            print(f"             the compiled module does not load: {e}")

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
            variant = "none (no compiled target at or below this GPU)" if arch == compiled.Arch.auto else arch.name
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


# ---- bench ------------------------------------------------------------------------------------

def _bench_scripts() -> list:
    """bench/bench_*.py under the working directory or the source tree this module runs from."""
    source_root = Path(__file__).resolve().parents[2]
    for root in dict.fromkeys((Path.cwd(), source_root)):
        scripts = sorted((root / "bench").glob("bench_*.py"))
        if scripts:
            return scripts
    return []


def _bench(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("mla-kv bench: no CUDA GPU found; the benchmarks time the CUDA kernels and need one",
              file=sys.stderr)
        return 1
    scripts = _bench_scripts()
    if not scripts:
        print("mla-kv bench: no bench/bench_*.py found; run it from the mla_kv source tree", file=sys.stderr)
        return 1
    failed = []
    for i, script in enumerate(scripts, 1):
        done = "#" * (20 * (i - 1) // len(scripts))
        print(f"[{done:<20}] {i}/{len(scripts)} {script.name}", flush=True)
        cmd = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        if subprocess.call(cmd) != 0:
            failed.append(script.name)
    print(f"[{'#' * 20}] {len(scripts)}/{len(scripts)} done", flush=True)
    if failed:
        print(f"mla-kv bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
