"""Run Triton kernels on the CPU: `use_interpreter()` before the kernel modules are imported.

Triton 3.6's interpreter reads loop bounds computed from program ids or arguments with `int()` of a
one-element numpy array, which numpy >= 2.3 refuses; the patch reads the single element instead.
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
    interpreter._hylo_index_patch = True


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
