"""Triton launches recorded, not run: what a kernel wrapper (remnant.kernels.*) launches for
given inputs, as the kernel, its argument types, constexprs and launch options, so that a
test can compile exactly those launches for sm_90 on a machine without a GPU
(tests/kernels/test_launches_compile.py).

Under Triton's interpreter (the CPU test session's TRITON_INTERPRET=1) a launch goes through
InterpretedFunction.run; recorded_launches() replaces it for the block, so wrappers run their
host code (configs, grids, buffers) at the engine's real shapes in no time, their kernels
not at all. Arguments are specialised by Triton's own launcher code (native_specialize_impl:
types, ints of 1 and None as constexprs, alignment from the values, do_not_specialize
kept); INTERPRETED constexprs, which wrappers set from the interpreter, are set False, as
on a GPU.
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
                tuple(sorted(self.options.items())), tuple(self.aligned))

    def as_json(self) -> list:
        return [self.kernel, self.signature, self.constants, self.options, self.aligned]


def _is_constexpr(param: inspect.Parameter) -> bool:
    import triton.language as tl

    note = param.annotation
    return note is tl.constexpr or (isinstance(note, str) and note.split(".")[-1] == "constexpr")


def launch_of(fn, args: tuple, kwargs: dict, do_not_specialize=()) -> Launch:
    """The Launch of `fn` (the kernel's Python function) called with args and kwargs, each
    argument specialised as Triton's launcher does it (native_specialize_impl: the type, a
    1 or None as a constexpr, 16-divisible ints and 16-byte aligned pointers marked), but
    for the arguments named in do_not_specialize."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    params = inspect.signature(fn).parameters
    values = dict(zip(params, args))
    values.update({k: v for k, v in kwargs.items() if k in params})
    names = list(params)
    frozen = {names[d] if isinstance(d, int) else d for d in do_not_specialize}
    signature, constants, aligned = {}, {}, []
    for name, param in params.items():
        value = values.get(name, param.default)
        if value is inspect.Parameter.empty:
            raise ValueError(f"{fn.__name__}: no value for argument {name}")
        if _is_constexpr(param):
            if hasattr(value, "value") and not isinstance(value, (int, float, str, bool)):
                value = value.value  # a tl.constexpr wrapper
            constants[name] = False if name == "INTERPRETED" else value
            continue
        kind, key = native_specialize_impl(BaseBackend, value, False, name not in frozen, name not in frozen)
        if kind == "constexpr":
            constants[name] = key
            continue
        signature[name] = kind
        if key == "D":
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
            launches.append(launch_of(self.fn, args, kwargs, self.kwargs.get("do_not_specialize") or ()))

    InterpretedFunction.run = record
    try:
        yield launches
    finally:
        InterpretedFunction.run = run
