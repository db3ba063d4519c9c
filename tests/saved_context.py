"""The arrays a layer tree keeps in its saved contexts (what the memory model counts as stored
activations), for tests that hold the counts to the real thing."""

import numpy as np


def ctx_arrays(layer, out=None):
    """Every array in the saved contexts of ``layer`` and its children, appended to ``out``."""
    out = [] if out is None else out
    for ctx in layer._ctx.values():
        _flatten(ctx, out)
    for child in layer.children():
        ctx_arrays(child, out)
    return out


def _flatten(obj, out):
    if isinstance(obj, np.ndarray):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _flatten(o, out)
