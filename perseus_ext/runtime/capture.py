"""Whether a perseus-ext hook runs while a CUDA stream is being captured into a CUDA graph.

Work launched during capture is not executed: it is recorded into the graph, and every later
`replay()` runs it again without a single Python hook. A clock change queued from a hook during
capture would therefore be tied to a device marker recorded into the graph -- one the device
reaches at a time no hook knows of -- and every replay would run at whatever clock was in force.
So the runtime asks at each hook (`torch.cuda.is_current_stream_capturing()`, a C call that
never synchronises) and steps aside while a capture is on. On a machine without CUDA nothing is
ever captured and the probe is a constant.
"""

from __future__ import annotations

from typing import Callable


def _never() -> bool:
    return False


def capture_probe() -> Callable[[], bool]:
    """A no-argument callable: True while the current CUDA stream is capturing."""
    try:
        import torch
    except ImportError:
        return _never
    try:
        if not torch.cuda.is_available():
            return _never
    except Exception:  # a broken CUDA install: nothing can be capturing either
        return _never

    def capturing() -> bool:
        try:
            return bool(torch.cuda.is_current_stream_capturing())
        except Exception:
            return False

    return capturing
