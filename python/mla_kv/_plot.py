"""What the ``--plot`` options of ``mla-kv plan`` and ``mla-kv bench`` share: the check that matplotlib
(the ``[plot]`` extra) is installed, the file a plot is written to, and (for the benchmarks, which
plot after minutes of measuring) the check of that file before anything runs."""
from __future__ import annotations

import os
from typing import Optional

NEEDS_MATPLOTLIB = "--plot needs matplotlib: pip install mla_kv[plot]"


def matplotlib_missing() -> Optional[str]:
    """None when matplotlib imports, else the one-line reason (naming the [plot] extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return NEEDS_MATPLOTLIB
    return None


def written_path(path: str) -> str:
    """The file a plot asked for at ``path`` is saved to: ``path`` itself when it has an extension
    (which picks the image format), else ``path`` + ".png", as matplotlib would add. The plots are
    saved to this name, so the path printed is the one written."""
    if os.path.splitext(path)[1][1:]:
        return path
    return path.rstrip(".") + ".png"


def problem(path: str) -> Optional[str]:
    """None when a plot can be written to ``path``, else a one-line reason: matplotlib missing, an
    image format matplotlib does not write, or a folder that does not exist."""
    missing = matplotlib_missing()
    if missing:
        return missing
    from matplotlib.backend_bases import FigureCanvasBase

    out = written_path(path)
    formats = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(out)[1][1:].lower()
    if ext not in formats:
        return f"--plot {path}: matplotlib does not write .{ext} files (it writes {', '.join(sorted(formats))})"
    folder = os.path.dirname(out)
    if folder and not os.path.isdir(folder):
        return f"--plot {path}: no folder {folder}"
    return None
