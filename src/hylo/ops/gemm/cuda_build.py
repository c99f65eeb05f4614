"""Compile a CUDA C++ source into a shared library with the machine's `nvcc`, once, cached on disk.

`build(source, arch)` returns the path of `<cache>/<stem>_<key>.so`, compiling it first if it is not
there. The key hashes the source, `nvcc --version`, the arch, the flags and any `-D` defines (a benchmark
builds variants of a kernel that way), so a changed kernel, another
toolkit or another GPU generation gets its own library and a stale one is never loaded. Compilation runs
under an exclusive lock on a file in the cache directory (two processes starting together compile once:
the second waits, then finds the library) and writes to a temporary name that is renamed into place, so
a reader never sees half a library. No `torch.utils.cpp_extension` and no ninja: one `nvcc` command
(the GPU machine may lack ninja, and a CPU torch has no CUDA headers); the library is loaded with
`ctypes` by its caller. Every failure raises `BuildError`, whose message is the reason to log.

The cache is `$HYLO_CACHE/kernels` when `HYLO_CACHE` is set, else `~/.cache/hylo/kernels`. `nvcc` is the
one on PATH, else `$CUDA_HOME/bin/nvcc`.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

logger = logging.getLogger("hylo")

# -O3 without fast math: the kernels rely on IEEE products and subnormals
FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC")
NVCC_TIMEOUT_S = 600


class BuildError(RuntimeError):
    """Why a CUDA library could not be built (the message is the reason)."""


def cache_dir() -> Path:
    root = os.environ.get("HYLO_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "hylo") / "kernels"


def find_nvcc() -> str | None:
    """`nvcc` on PATH, else under `$CUDA_HOME/bin`; None when neither has one."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME")
    candidate = Path(home) / "bin" / "nvcc" if home else None
    return str(candidate) if candidate is not None and os.access(candidate, os.X_OK) else None


def nvcc_version(nvcc: str) -> str:
    try:
        done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"{nvcc} --version failed: {e}") from e
    if done.returncode != 0:
        raise BuildError(f"{nvcc} --version exited with {done.returncode}: {done.stderr.strip()[-300:]}")
    return done.stdout.strip()


def cache_key(source: bytes, version: str, arch: str, defines: tuple[str, ...] = ()) -> str:
    """16 hex digits of the hash of everything the library's contents depend on."""
    digest = hashlib.sha256()
    for part in (source, version.encode(), arch.encode(), " ".join((*FLAGS, *defines)).encode()):
        digest.update(len(part).to_bytes(8, "little") + part)
    return digest.hexdigest()[:16]


def compile_command(
    nvcc: str, source: Path, arch: str, output: Path, defines: tuple[str, ...] = ()
) -> list[str]:
    """`arch` as nvcc spells a real GPU, e.g. `sm_90a`; only that GPU's machine code is built. `defines`
    are `NAME=VALUE` macros (`-D`)."""
    gencode = f"arch=compute_{arch.removeprefix('sm_')},code={arch}"
    macros = [f"-D{d}" for d in defines]
    return [nvcc, *FLAGS, *macros, "-gencode", gencode, "-o", str(output), str(source)]


def build(source: Path, arch: str, what: str, defines: tuple[str, ...] = ()) -> Path:
    """The cached library of `source` for `arch` (with `defines`, `NAME=VALUE` macros), compiled now if
    absent (`what` names it in the log)."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("no nvcc on PATH or under $CUDA_HOME/bin")
    text = source.read_bytes()
    directory = cache_dir()
    library = directory / f"{source.stem}_{cache_key(text, nvcc_version(nvcc), arch, defines)}.so"
    if library.exists():
        return library
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / f"{source.stem}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not library.exists():  # another process may have built it while this one waited
                _compile(nvcc, source, arch, library, what, defines)
    except OSError as e:
        raise BuildError(f"cache directory {directory}: {e}") from e
    return library


def _compile(nvcc: str, source: Path, arch: str, library: Path, what: str, defines: tuple[str, ...]) -> None:
    logger.info("building %s (%s) with %s …", what, arch, nvcc)
    start = time.perf_counter()
    partial = library.with_name(f"{library.name}.{os.getpid()}.tmp")
    try:
        done = subprocess.run(
            compile_command(nvcc, source, arch, partial, defines), capture_output=True, text=True,
            timeout=NVCC_TIMEOUT_S,
        )  # fmt: skip
        if done.returncode != 0:
            raise BuildError(f"nvcc exited with {done.returncode}: {done.stderr.strip()[-1500:]}")
        os.replace(partial, library)
    except subprocess.TimeoutExpired as e:
        raise BuildError(f"nvcc ran past {NVCC_TIMEOUT_S} s") from e
    except OSError as e:
        raise BuildError(f"running {nvcc} into {library.parent}: {e}") from e
    finally:
        partial.unlink(missing_ok=True)
    logger.info("built %s (%s) in %.1f s: %s", what, arch, time.perf_counter() - start, library)
