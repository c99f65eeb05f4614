"""Run Triton kernels on the CPU: `use_interpreter()` before the kernel modules are imported.

Triton 3.6's interpreter reads loop bounds computed from program ids or arguments with `int()` of a
one-element numpy array, which numpy >= 2.3 refuses; the patch reads the single element instead.

It also re-patches triton.language at every device-function call, in every program of a launch
(about a fifth of a KDA prefill's time here), although the launch has patched the same modules already
and restores them only when it ends: such a call, whose modules the launch has patched, skips it.
"""

from __future__ import annotations

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


def run_compiled_for_hopper(script: str) -> str:
    """Stdout of `script`, run in a fresh process without the interpreter, so that it can compile
    kernels for sm_90 as the GPU would (no GPU needed); fails the test with its stderr otherwise."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src")
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
