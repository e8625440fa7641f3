"""Whether kernel tests can run in Triton's interpreter (TANDEM_TRITON_INTERPRET=1)."""
from __future__ import annotations

import os

import pytest


def interpret_mark(kernel) -> pytest.MarkDecorator:
    """skipif marker for interpreter tests; `kernel` is any @triton.jit function of the module
    under test (it shows whether TRITON_INTERPRET was set before tandem.kernels was imported)."""
    return pytest.mark.skipif(_reason(kernel) is not None, reason=str(_reason(kernel)))


def _reason(kernel) -> str | None:
    if os.environ.get("TANDEM_TRITON_INTERPRET") != "1":
        return "set TANDEM_TRITON_INTERPRET=1 to run the kernels in Triton's interpreter"
    import numpy as np
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        return "tandem.kernels was imported before TRITON_INTERPRET was set"
    if tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4) and triton.__version__ < "3.7":
        return "Triton < 3.7's interpreter needs numpy < 2.4 (triton#9171)"
    return None
