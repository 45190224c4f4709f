"""The kernels' torch.library custom ops, and how eager code calls them.

Every fused op is a torch.library custom op, so torch.compile treats it as one opaque node (its fake
implementation gives the output shapes) and FlopCounterMode, FakeTensorMode and selective activation checkpointing
see it by name. Going through the dispatcher costs host time on every call, though: about 11 µs for a small op with
list arguments on this project's CI CPU against 1.5 µs for calling the Python body itself (measured with a probe op),
paid by every op of every layer, in the forward, the backward and any recompute, where a small-batch step is bound
by how fast the host launches kernels. So:

  custom_op(name)   registers the body as the custom op `name` (no mutated arguments) and keeps the body beside it;
  call_op(op, ...)  calls the body directly on plain tensors in plain eager: the same function, the same results.
                    It goes through the dispatcher instead where something must see the registered op: under
                    torch.compile, inside any TorchDispatchMode (FakeTensorMode, FlopCounterMode, selective
                    activation checkpointing), while the profiler records (its tables then show the op's own row),
                    and when the first tensor is on the meta device (the op's fake implementation gives the shapes)
                    or is a tensor subclass such as a DTensor (its own dispatch handles the op).
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


def _plain(x: Any) -> bool:
    """Whether an op's first argument (a tensor, or a list whose first item is one) is a plain tensor off the meta
    device; a missing tensor (None, an empty list) counts as plain."""
    if isinstance(x, (list, tuple)):
        x = x[0] if x else None
    if x is None:
        return True
    return type(x) in (torch.Tensor, torch.nn.Parameter) and not x.is_meta


def call_op(op: Any, *args: Any) -> Any:
    """op(*args): its Python body called directly in plain eager, else through the dispatcher (module docstring).
    Any other callable in the op's place (a test's spy wrapping it) is called as is."""
    body = getattr(op, "atelier_body", None)
    if (body is None or _IN_DISPATCH_MODE is None or _IN_DISPATCH_MODE() or torch.compiler.is_compiling()
            or torch.autograd._profiler_enabled() or not _plain(args[0] if args else None)):
        return op(*args)
    return body(*args)
