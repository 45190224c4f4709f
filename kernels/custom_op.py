"""The kernels' torch.library custom ops, and how eager code calls them.

Every fused op is a torch.library custom op, so torch.compile treats it as one opaque node (its fake
implementation gives the output shapes) and FlopCounterMode, FakeTensorMode and selective activation checkpointing
see it by name. Going through the dispatcher costs host time on every call, though: about 11 µs for a small op with
list arguments on this project's CI CPU against 1.5 µs for calling the Python body itself (measured with a probe op),
paid by every op of every layer, in the forward, the backward and any recompute, where a small-batch step is bound
by how fast the host launches kernels. So:

  custom_op(name)   registers the body as the custom op `name` (no mutated arguments) and keeps the body beside it;
  call_op(op, ...)  calls the op through the dispatcher under torch.compile or inside any TorchDispatchMode (they
                    must see the registered op), else the body directly: the same function, the same results.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._python_dispatch

_IN_DISPATCH_MODE = getattr(torch.utils._python_dispatch, "is_in_torch_dispatch_mode", None)


def custom_op(name: str) -> Callable[[Callable], Any]:
    """torch.library.custom_op(name, mutates_args=()) that keeps the op's Python body beside it, for call_op."""
    def register(body: Callable) -> Any:
        op = torch.library.custom_op(name, mutates_args=())(body)
        op.atelier_body = body
        return op
    return register


def call_op(op: Any, *args: Any) -> Any:
    """op(*args): through the dispatcher under torch.compile or any TorchDispatchMode, else its Python body called
    directly (module docstring). Any other callable in the op's place (a test's spy wrapping it) is called as is."""
    body = getattr(op, "atelier_body", None)
    if body is None or _IN_DISPATCH_MODE is None or _IN_DISPATCH_MODE() or torch.compiler.is_compiling():
        return op(*args)
    return body(*args)
