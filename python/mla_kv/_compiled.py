"""The compiled kernels, ``mla_kv._C``, loaded once: every other module takes ``_C`` from here.

``_C`` is None in a reference-only install (built without a CUDA compiler) or when the extension does
not load; ``load_error`` then holds the ImportError (None when ``_C`` loaded).
"""
try:  # the compiled kernels are absent in a reference-only install
    from . import _C
except ImportError as error:  # pragma: no cover - depends on the build
    _C = None
    load_error = error
else:
    load_error = None
