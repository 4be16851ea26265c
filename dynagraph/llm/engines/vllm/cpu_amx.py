"""Ask Linux for the AMX tile registers before vLLM's CPU kernels use them.

On CPUs with AMX (Intel Sapphire Rapids and later) a process may use the tile registers
only after asking (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); the
permission is per process and cleared by ``exec``. PyTorch's oneDNN asks before its first
AMX matmul, but vLLM 0.32's CPU attention kernel (``cpu_attention_with_kv_cache``, its
AMX path on such CPUs) uses the tiles without asking: where attention runs before any
oneDNN AMX matmul in the process, the engine core dies of SIGILL ("Illegal instruction").
vLLM loads this module as a general plugin in each
of its processes (``pyproject.toml``); elsewhere (no AMX, not x86-64 Linux) it does
nothing.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

log = logging.getLogger(__name__)

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


def _libc() -> ctypes.CDLL | None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    return ctypes.CDLL(None, use_errno=True)


def amx_permitted() -> bool:
    """Whether this process may use the AMX tile data registers."""
    libc = _libc()
    if libc is None:
        return False
    mask = ctypes.c_uint64(0)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return False
    return bool(mask.value >> _XFEATURE_XTILEDATA & 1)


def request_amx() -> bool:
    """Ask for the AMX tile registers where the CPU has them; whether they are granted."""
    libc = _libc()
    if libc is None or not _has_amx():
        return False
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        log.warning("the CPU has AMX but the kernel refused the tile registers (errno %d); "
                    "vLLM's CPU attention may die of SIGILL", ctypes.get_errno())
        return False
    return True


def register() -> None:
    """vLLM's general-plugin hook (each vLLM process calls it early)."""
    request_amx()
