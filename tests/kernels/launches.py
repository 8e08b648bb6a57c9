"""Triton launches recorded, not run: what a kernel wrapper (remnant.kernels.*) launches for
given inputs, as the kernel, its argument types, constexprs and launch options, so that a
test can compile exactly those launches for sm_90 on a machine without a GPU
(compile_launches; tests/kernels/test_launches_compile.py, test_compiled.py).

Under Triton's interpreter (the CPU test session's TRITON_INTERPRET=1) a launch goes through
InterpretedFunction.run; recorded_launches() replaces it for the block, so wrappers run their
host code (configs, grids, buffers) at the engine's real shapes in no time, their kernels
not at all. Arguments are specialised by Triton's own launcher code (native_specialize_impl:
types, ints of 1 and None as constexprs, alignment from the values, do_not_specialize
kept); INTERPRETED constexprs, which wrappers set from the interpreter, are set False, as
on a GPU.
"""

from __future__ import annotations

import collections
import inspect
import json
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Recording needs the interpreter (tests/conftest.py sets it where there is no CUDA): with
#: CUDA, a wrapper's launch would run for real, on the CPU tensors the tests give it.
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="launches are recorded under Triton's interpreter (TRITON_INTERPRET=1)")
#: An instruction of an nvdisasm listing: its opcode, after an optional predicate.
SASS_OP = r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)"

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


def compile_launches(launches: list[Launch], tmp_path) -> list[dict]:
    """Each launch compiled for sm_90 in one process out of the interpreter (the test
    session's TRITON_INTERPRET makes @triton.jit functions that cannot compile): per launch
    its kernel and either `error` or ptxas's registers and spill bytes, the MMA forms in
    its SASS (`mma`), its SASS opcode counts (`ops`) and its cluster-barrier lines
    (`cluster_barriers`)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    job = tmp_path / "launches.json"
    job.write_text(json.dumps([launch.as_json() for launch in launches]))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), str(job), str(tmp_path)], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _compile_one(kernel: str, signature: dict, constants: dict, options: dict, aligned: list, out: str) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    module, name = kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    names = list(fn.arg_names)
    full = {a: signature.get(a, "constexpr") for a in names}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    try:
        compiled = triton.compile(ASTSource(fn, signature=full, constexprs=constants, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as exc:  # the compiler's own error, reported per launch
        return {"kernel": kernel, "error": f"{type(exc).__name__}: {exc}"[-2000:]}
    with open(out + ".ptx", "w") as f:
        f.write(compiled.asm["ptx"])
    report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", out + ".ptx", "-o", out + ".cubin"],
                            capture_output=True, text=True).stderr
    spills = [tuple(map(int, s)) for s in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)]
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    sass = subprocess.run([nvdisasm, "-c", out + ".cubin"], capture_output=True, text=True).stdout
    ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(SASS_OP, sass))
    return {"kernel": kernel, "spill_bytes": sum(a + b for a, b in spills), "registers": max(registers, default=0),
            "ptxas": report[-1500:] if not spills else None,
            "mma": sorted(set(re.findall(r"\b[HQ]GMMA\.[0-9x]+\.[A-Z0-9.]+", sass))), "ops": dict(ops),
            "cluster_barriers": [line.strip() for line in sass.splitlines() if "UCGABAR" in line]}


def assert_compile_without_spills(launches: list[Launch], tmp_path) -> list[dict]:
    """Each distinct launch compiled (compile_launches), none failing or spilling; their
    results, in the order of first launch."""
    unique = list({launch.key(): launch for launch in launches}.values())
    assert unique, "the wrapper launched nothing"
    results = compile_launches(unique, tmp_path)
    for launch, result in zip(unique, results):
        assert "error" not in result, (launch, result["error"])
        assert result["ptxas"] is None, (launch, result["ptxas"])  # ptxas reported its spills
        assert result["spill_bytes"] == 0, (launch, result)
    return results


if __name__ == "__main__":
    jobs, out_dir = json.loads(open(sys.argv[1]).read()), sys.argv[2]
    print(json.dumps([_compile_one(*job, os.path.join(out_dir, f"launch{i}")) for i, job in enumerate(jobs)]))
