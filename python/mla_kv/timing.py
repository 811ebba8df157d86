"""GPU timing shared by the benchmarks and the demo: CUDA events around CUDA-graph replays."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def time_graph(fn: Callable[[int], object], variants: int = 1, calls: int = 20, samples: int = 21,
               warmup: int = 3) -> float:
    """Median seconds per call of fn(i), i cycling over ``variants`` input sets.

    The calls are captured in one CUDA graph (so Python and launch overhead stay out, and the op is
    shown to be graph-safe) and the graph is replayed ``samples`` times between CUDA events.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as graph capture requires
        for i in range(warmup):
            fn(i % variants)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % variants)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)
