"""Run Triton kernels on the CPU: `use_interpreter()` before the kernel modules are imported.

Triton 3.6's interpreter reads loop bounds computed from program ids or arguments with `int()` of a
one-element numpy array, which numpy >= 2.3 refuses; the patch reads the single element instead.

Its builder checks every 32-bit integer add and multiply for overflow, which compiled kernels do only in
debug builds; at test shapes no index comes near 2^31, and the check took about a fifth of a KDA decode's
time here, so it is off (as on the GPU).

It also re-patches triton.language at every device-function call, in every program of a launch
(about a fifth of a KDA prefill's time here), although the launch has patched the same modules already
and restores them only when it ends: such a call, whose modules the launch has patched, skips it.
"""

from __future__ import annotations

import dataclasses
import os


def use_interpreter() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.runtime.interpreter as interpreter

    if getattr(interpreter, "_hylo_index_patch", False):
        return
    patch_lang_tensor = interpreter._patch_lang_tensor

    def patch_with_index(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_with_index
    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    _patch_language_once_per_launch(interpreter)
    interpreter._hylo_index_patch = True


def _patch_language_once_per_launch(interpreter) -> None:
    """`interpreter._patch_lang(fn)` patches the language modules `fn`'s globals name (a scope the
    launch restores at its end). Within one launch (`GridExecutor.__call__`, which patches first), a
    device function's call patches only modules the launch has not patched yet; a launch inside a
    launch does not occur. Safe because the patches depend on the modules alone, not on `fn`."""
    import inspect

    patch_lang, run_grid = interpreter._patch_lang, interpreter.GridExecutor.__call__
    language = (interpreter.tl, interpreter.tl.core)
    patched: set[int] | None = None  # ids of the modules the running launch has patched; None: none runs

    def patch_once(fn):
        needed = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in language}
        if patched is not None and needed and needed <= patched:
            return interpreter._LangPatchScope()  # nothing to patch, nothing to restore
        if patched is not None:
            patched.update(needed)
        return patch_lang(fn)

    def launch(self, *args, **kwargs):
        nonlocal patched
        patched = set()
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            patched = None

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch


# The compile checks' process: one per test process, started at its first check and kept, so that each
# check after the first pays for its compilation only, not for importing torch, Triton and hylo again
# (3-5 s each). It runs each script in a fresh namespace with its stdout captured, and answers one JSON
# line per script.
_COMPILER_LOOP = r"""
import contextlib, io, json, sys, traceback
for line in sys.stdin:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(json.loads(line), "<compile check>", "exec"), {"__name__": "__compile_check__"})
        reply = {"stdout": out.getvalue()}
    except BaseException:
        reply = {"stdout": out.getvalue(), "error": traceback.format_exc()}
    sys.__stdout__.write(json.dumps(reply) + "\n")
    sys.__stdout__.flush()
"""
_compiler = None


def run_compiled_for_hopper(script: str) -> str:
    """Stdout of `script`, run in a process without the interpreter, so that it can compile kernels for
    sm_90 as the GPU would (no GPU needed); fails the test with its traceback otherwise. The process is
    shared by the test process's checks (`_COMPILER_LOOP`); scripts must not depend on running first."""
    import atexit
    import json
    import subprocess
    import sys
    from pathlib import Path

    global _compiler
    if _compiler is None or _compiler.poll() is not None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src")
        _compiler = subprocess.Popen(
            [sys.executable, "-c", _COMPILER_LOOP], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        atexit.register(_compiler.communicate)  # end of input: it exits, and is waited for
    _compiler.stdin.write(json.dumps(script) + "\n")
    _compiler.stdin.flush()
    line = _compiler.stdout.readline()
    assert line, f"the compile process exited with {_compiler.wait()}"
    reply = json.loads(line)
    assert "error" not in reply, reply["error"][-2000:]
    return reply["stdout"]
