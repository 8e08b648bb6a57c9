"""Triton launches recorded, not run: what a kernel wrapper (remnant.kernels.*) launches for
given inputs, as the kernel, its argument types, constexprs and launch options, so that a
test can compile exactly those launches for sm_90 on a machine without a GPU
(tests/kernels/test_launches_compile.py).

Under Triton's interpreter (the CPU test session's TRITON_INTERPRET=1) a launch goes through
InterpretedFunction.run; recorded_launches() replaces it for the block, so wrappers run their
host code (configs, grids, buffers) at the engine's real shapes in no time, their kernels
not at all. Argument types are Triton's own (mangle_type); ints of 1 and None become
constexprs as Triton's launcher specialises them; INTERPRETED constexprs, which wrappers set
from the interpreter, are set False, as on a GPU.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field

#: Launch options a wrapper passes beside the kernel's arguments.
OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


@dataclass
class Launch:
    kernel: str  # "module:function"
    signature: dict[str, str]  # argument -> Triton type ("*bf16", "i32", ...)
    constants: dict[str, object]  # constexpr arguments and specialised ones
    options: dict[str, int]
    aligned: list[str] = field(default_factory=list)  # arguments divisible by 16 (pointers, ints)

    def key(self) -> tuple:
        return (self.kernel, tuple(self.signature.items()), repr(sorted(self.constants.items())),
                tuple(sorted(self.options.items())))

    def as_json(self) -> list:
        return [self.kernel, self.signature, self.constants, self.options, self.aligned]


def _is_constexpr(param: inspect.Parameter) -> bool:
    import triton.language as tl

    note = param.annotation
    return note is tl.constexpr or (isinstance(note, str) and note.split(".")[-1] == "constexpr")


def launch_of(fn, args: tuple, kwargs: dict) -> Launch:
    """The Launch of `fn` (the kernel's Python function) called with args and kwargs."""
    import torch
    from triton.runtime.jit import mangle_type

    params = inspect.signature(fn).parameters
    values = dict(zip(params, args))
    values.update({k: v for k, v in kwargs.items() if k in params})
    signature, constants, aligned = {}, {}, []
    for name, param in params.items():
        value = values.get(name, param.default)
        if value is inspect.Parameter.empty:
            raise ValueError(f"{fn.__name__}: no value for argument {name}")
        if _is_constexpr(param) or value is None or (isinstance(value, int) and not isinstance(value, bool)
                                                    and value == 1):
            if hasattr(value, "value") and not isinstance(value, (int, float, str, bool)):
                value = value.value  # a tl.constexpr wrapper
            constants[name] = False if name == "INTERPRETED" else value
            continue
        signature[name] = mangle_type(value)
        if isinstance(value, torch.Tensor) or (isinstance(value, int) and not isinstance(value, bool)
                                               and value % 16 == 0):
            aligned.append(name)
    options = {k: v for k, v in kwargs.items() if k in OPTIONS}
    return Launch(f"{fn.__module__}:{fn.__name__}", signature, constants, options, aligned)


@contextmanager
def recorded_launches():
    """Within the block, Triton launches are recorded (the yielded list of Launch), not run."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: list[Launch] = []
    run = InterpretedFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        if not warmup:
            launches.append(launch_of(self.fn, args, kwargs))

    InterpretedFunction.run = record
    try:
        yield launches
    finally:
        InterpretedFunction.run = run
