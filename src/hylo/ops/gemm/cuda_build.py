"""Compile a CUDA C++ source into a shared library with the machine's `nvcc`, once, cached on disk.

`build(source, arch)` returns the path of `<cache>/<stem>_<key>.so`, compiling it first if it is not
there. The key hashes the source with the headers it includes by a quoted relative path (`hopper.cuh`),
`nvcc --version`, the arch, the flags and any `-D` defines (a benchmark
builds variants of a kernel that way), so a changed kernel, another
toolkit or another GPU generation gets its own library and a stale one is never loaded. Compilation runs
under an exclusive lock on a file in the cache directory (two processes starting together compile once:
the second waits, then finds the library) and writes to a temporary name that is renamed into place, so
a reader never sees half a library. No `torch.utils.cpp_extension` and no ninja: one `nvcc` command
(the GPU machine may lack ninja, and a CPU torch has no CUDA headers); the library is loaded with
`ctypes` by its caller. Every failure raises `BuildError`, whose message is the reason to log.

The cache is `$HYLO_CACHE/kernels` when `HYLO_CACHE` is set, else `~/.cache/hylo/kernels`. `nvcc` is the
one on PATH, else `$CUDA_HOME/bin/nvcc`.

`CheckedLibrary` keeps, per GPU, whether such a library may run there: hylo's CUDA kernels are written on
machines without a GPU, so each is checked once on a GPU before its first call there and refused for the
process where it fails (the GEMV of `gemv_cuda`, the sparse MLA prefill of `sparse_mla.cuda_prefill`, the
MoE's grouped GEMMs of `moe.grouped_cuda`).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

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


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_bytes(source: Path, seen: frozenset[Path] = frozenset()) -> bytes:
    """`source` followed by every header it includes by a quoted path (resolved beside it, recursively,
    each once): what the library's contents depend on besides the toolkit and the flags."""
    text = source.read_bytes()
    parts, seen = [text], seen | {source.resolve()}
    for name in _LOCAL_INCLUDE.findall(text):
        header = (source.parent / name.decode()).resolve()
        if header not in seen:
            if not header.is_file():
                raise BuildError(f"{source.name} includes {name.decode()}, which is not at {header}")
            parts.append(source_bytes(header, seen))
            seen |= {header}
    return b"\0".join(parts)


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
    text = source_bytes(source)
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
    # e.g. C7518: one wgmma in a branch ptxas cannot prove uniform serialises every wgmma of the kernel
    for line in done.stderr.splitlines():
        if "Performance Loss" in line:
            logger.warning("%s (%s): ptxas: %s", what, arch, line.strip())


def bind_call(library: ctypes.CDLL, entry: str, call: type[ctypes.Structure]) -> None:
    """Give `library`'s `int entry(const Call*, void* stream)` its ctypes signature, `call` being the
    ctypes mirror of the C structure `Call` (one call's operands by role). The library reports each leaf
    field's byte offset and size through `<entry>_call_layout` (`call_layout.cuh`); raises OSError where
    they differ from the mirror's (a source and its Python side changed apart)."""
    mirror = leaf_layout(call)
    reported = (ctypes.c_longlong * (2 * len(mirror)))()
    count = getattr(library, f"{entry}_call_layout")(reported, len(mirror))
    theirs = [(reported[2 * i], reported[2 * i + 1]) for i in range(min(count, len(mirror)))]
    if count != len(mirror) or theirs != mirror:
        raise OSError(
            f"{entry} takes a {call.__name__} of {count} fields at (offset, size) {theirs}; its ctypes "
            f"mirror has {mirror}"
        )
    function = getattr(library, entry)
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.POINTER(call), ctypes.c_void_p]


def leaf_layout(structure: type[ctypes.Structure], base: int = 0) -> list[tuple[int, int]]:
    """(byte offset, byte size) of each non-structure field of `structure`, nested ones in place, in order."""
    fields = []
    for name, kind in structure._fields_:
        offset = base + getattr(structure, name).offset
        if issubclass(kind, ctypes.Structure):
            fields += leaf_layout(kind, offset)
        else:
            fields.append((offset, ctypes.sizeof(kind)))
    return fields


def hopper_arch(capability: tuple[int, int]) -> str | None:
    """nvcc's name of the Hopper GPU the kernels are built for (`sm_90a`: clusters, wgmma, TMA), else None."""
    return "sm_90a" if capability[0] == 9 else None


def checked_library(
    what: str,
    switch: str,
    load_library: Callable[[str], object],
    check: Callable[[object, torch.device], str | None],
    fallback: str,
) -> CheckedLibrary:
    """A `CheckedLibrary` over `load_library(arch)`, which raises `BuildError` or OSError where the library
    cannot be had: the failure is kept per arch and logged once as "<reason>; <fallback>" (`fallback` says
    what runs instead), as is a failed check."""

    def give_up(reason: str) -> str:
        logger.warning("%s; %s", reason, fallback)
        return reason

    @functools.cache
    def load(arch: str) -> object:
        try:
            return load_library(arch)
        except (BuildError, OSError) as e:
            return give_up(f"{what} could not be built or loaded: {e}")

    return CheckedLibrary(what, switch, load, check, give_up)


class CheckedLibrary:
    """A Hopper library built at first use and checked once on each GPU before its first call there.

    `load(arch)` returns the loaded library or why there is none; `check(library, device)` returns None or
    why it failed there; `give_up(reason)` logs a failure and returns the reason to keep. Per device index,
    `ready` holds the library that passed and `failed` why it is off for the process. `switch`, an
    environment variable read at every call, turns it off with "0". The check needs an eager call: a
    GPU's first call inside a CUDA graph capture is refused for that call only."""

    def __init__(
        self,
        what: str,
        switch: str,
        load: Callable[[str], object],
        check: Callable[[object, torch.device], str | None],
        give_up: Callable[[str], str],
    ):
        self.what, self.switch = what, switch
        self._load, self._check, self._give_up = load, check, give_up
        self.ready: dict[int, object] = {}
        self.failed: dict[int, str] = {}

    def refusal(self, device: torch.device) -> str | None:
        """Why the library is off on `device` (None: on), building and checking it there first if need be."""
        if os.environ.get(self.switch, "1") == "0":
            return f"{self.switch}=0"
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index in self.ready:
            return None
        if index in self.failed:
            return self.failed[index]
        capability = torch.cuda.get_device_capability(index)
        arch = hopper_arch(capability)
        if arch is None:
            return (
                f"{self.what} is built for Hopper (sm_90a); GPU {index} is sm_{capability[0]}{capability[1]}"
            )
        library = self._load(arch)
        if isinstance(library, str):
            return library
        if torch.cuda.is_current_stream_capturing():
            return f"{self.what} is checked at a GPU's first eager call; GPU {index}'s came inside a capture"
        failure = self._check(library, torch.device("cuda", index))
        if failure is not None:
            self.failed[index] = self._give_up(f"{self.what} failed its check on GPU {index}: {failure}")
            return self.failed[index]
        self.ready[index] = library
        return None
