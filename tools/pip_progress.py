"""Run ``pip install`` with a progress bar, an estimate, and the whole log kept in a file.

    python tools/pip_progress.py --log FILE [--expect N] [--prefix TEXT] -- install -e .[cpu,test]

Runs ``python -m pip ARGS`` with this interpreter (stdlib only: it runs in a fresh
virtualenv), writes pip's whole output to ``--log`` and prints progress instead: every
second in place on a terminal, else a line every `LINE_EVERY` seconds (CI logs):

    pip [#######-------------]  35%  resolving: 60/~171 packages, 412 MB  1m05s, ~2m left
    pip [##############------]  70%  installing 171 packages: 40 done  2m30s, ~1m05s left

pip resolves and downloads first (progress: packages seen against ``--expect``, the count
a full install of the project resolves, an estimate), then installs (progress: new
``*.dist-info`` directories in site-packages, weighted by wheel size). On failure it
prints the last lines of the log, a likely fix, and exits with pip's code.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import sysconfig
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

LINE_EVERY = 15.0
RESOLVE_SHARE = 0.6
"""Share of the bar for resolving + downloading (the rest is installing)."""

_UNITS = {"B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9}
_COLLECT = re.compile(r"^Collecting ([A-Za-z0-9][A-Za-z0-9._-]*)")
_PROCESS = re.compile(r"^Processing (\S+\.whl)")
_SATISFIED = re.compile(r"^Requirement already satisfied: ([A-Za-z0-9][A-Za-z0-9._-]*)")
_FETCH = re.compile(r"^\s*(Downloading|Using cached) (\S+) \(([\d.]+) ([kKMG]?B)\)")
_INSTALLING = re.compile(r"^Installing collected packages: (.*)$")

HINTS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"No space left on device"),
     "free some disk space: the engine packages take about 4 GiB in .venv"),
    (re.compile(r"Could not find a version that satisfies|No matching distribution found"),
     "pip cannot find a package: check the network and the package index "
     "(pip config list; PIP_INDEX_URL), then re-run"),
    (re.compile(r"Max retries exceeded|Temporary failure in name resolution|"
                r"Network is unreachable|Connection (refused|reset)|Read timed out"),
     "pip cannot reach the package index: check the network or proxy (HTTPS_PROXY), "
     "then re-run"),
    (re.compile(r"ResolutionImpossible|conflicting dependencies"),
     "the requirements conflict: the log names them; a pin in pyproject.toml may need to move"),
    (re.compile(r"Permission denied"),
     "a file is not writable: run as the owner of the repository and its .venv"),
)
FALLBACK_HINT = "fix the error above, then re-run: bash scripts/install.sh (FORCE=1 reinstalls)"


def canonical(name: str) -> str:
    """PEP 503 name: ``Foo_Bar.baz`` -> ``foo-bar-baz``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(filename: str) -> str:
    """The distribution a wheel (or sdist) file holds: ``torch-2.1-cp311-...whl`` -> torch."""
    return canonical(Path(filename).name.split("-")[0])


@dataclass
class PipProgress:
    """pip's state, from its output lines (`feed`) and the installed dist-infos (`done`)."""

    expect: int
    phase: str = "resolving"
    seen: set[str] = field(default_factory=set)
    satisfied: set[str] = field(default_factory=set)
    sizes: dict[str, float] = field(default_factory=dict)
    fetched: float = 0.0
    to_install: list[str] = field(default_factory=list)

    def feed(self, line: str) -> None:
        if (m := _COLLECT.match(line)) is not None:
            self.seen.add(canonical(m.group(1)))
        elif (m := _PROCESS.match(line)) is not None:
            name = wheel_name(m.group(1))
            self.seen.add(name)
            try:
                self.sizes[name] = float(os.path.getsize(m.group(1)))
            except OSError:
                pass
        elif (m := _SATISFIED.match(line)) is not None:
            self.seen.add(canonical(m.group(1)))
            self.satisfied.add(canonical(m.group(1)))
        elif (m := _FETCH.match(line)) is not None:
            size = float(m.group(3)) * _UNITS.get(m.group(4), 1.0)
            self.sizes[wheel_name(m.group(2))] = size
            if m.group(1) == "Downloading" and not m.group(2).endswith(".metadata"):
                self.fetched += size
        elif (m := _INSTALLING.match(line)) is not None:
            self.phase = "installing"
            self.to_install = [canonical(n.strip()) for n in m.group(1).split(",") if n.strip()]
        elif line.startswith("Successfully installed"):
            self.phase = "done"

    def fraction(self, installed: set[str]) -> float:
        """0..1 of the whole run, given the names installed so far."""
        if self.phase == "done":
            return 1.0
        if self.phase == "resolving":
            return RESOLVE_SHARE * min(len(self.seen) / max(self.expect, 1), 0.95)
        weights = {n: self.sizes.get(n, 1e6) for n in self.to_install}
        total = sum(weights.values()) or 1.0
        done = sum(w for n, w in weights.items() if n in installed)
        return RESOLVE_SHARE + (1 - RESOLVE_SHARE) * min(done / total, 0.99)

    def line(self, elapsed: float, installed: set[str], width: int = 20) -> str:
        frac = self.fraction(installed)
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        if self.phase == "resolving":
            what = f"resolving: {len(self.seen)}/~{max(self.expect, len(self.seen))} packages"
            if self.fetched:
                what += f", {self.fetched / 1e6:.0f} MB downloaded"
        elif self.phase == "installing":
            n = len(self.to_install)
            what = f"installing {n} packages: {len(installed & set(self.to_install))} done"
        else:
            what = f"{len(self.to_install)} packages installed"
        left = ""
        if 0.02 < frac < 1.0 and elapsed > 5:
            left = f", ~{clock(elapsed / frac - elapsed)} left"
        return f"pip [{bar}] {int(100 * frac):3d}%  {what}  {clock(elapsed)}{left}"


def clock(seconds: float) -> str:
    """``45s``, ``2m05s``."""
    s = max(0, int(round(seconds)))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s"


def hint_for(log_tail: Sequence[str]) -> str:
    text = "\n".join(log_tail)
    for pattern, hint in HINTS:
        if pattern.search(text):
            return hint
    return FALLBACK_HINT


def installed_names(site: Path, before: set[str]) -> set[str]:
    """Distributions whose ``*.dist-info`` appeared in ``site`` since ``before`` was taken."""
    try:
        now = {p.name for p in site.iterdir() if p.name.endswith(".dist-info")}
    except OSError:
        return set()
    return {canonical(d.removesuffix(".dist-info").rsplit("-", 1)[0]) for d in now - before}


def run(pip_args: list[str], log_path: Path, expect: int, prefix: str) -> int:
    site = Path(sysconfig.get_paths()["purelib"])
    before = {p.name for p in site.iterdir()} if site.is_dir() else set()
    state = PipProgress(expect=expect)
    tail: deque[str] = deque(maxlen=40)
    tty = sys.stdout.isatty()
    t0 = time.monotonic()
    with open(log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pip", *pip_args, "--progress-bar", "off"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", env={**os.environ, "PIP_NO_INPUT": "1"})
        assert proc.stdout is not None
        lock = threading.Lock()

        def read() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                log.write(raw)
                line = raw.rstrip("\n")
                with lock:
                    tail.append(line)
                    state.feed(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        last = t0
        while reader.is_alive():
            reader.join(timeout=1.0)
            now = time.monotonic()
            if tty or now - last >= LINE_EVERY:
                with lock:
                    text = state.line(now - t0, installed_names(site, before))
                print(("\r\x1b[2K" if tty else "") + prefix + text, end="" if tty else "\n",
                      flush=True)
                last = now
        code = proc.wait()
    elapsed = time.monotonic() - t0
    if code == 0:
        state.phase = "done"
        print(("\r\x1b[2K" if tty else "") + prefix + state.line(elapsed, set()), flush=True)
        return 0
    if tty:
        print()
    print(f"{prefix}pip failed (exit code {code}) after {clock(elapsed)}; last lines of "
          f"{log_path}:", file=sys.stderr)
    for line in list(tail)[-25:]:
        print(f"    {line}", file=sys.stderr)
    print(f"{prefix}fix: {hint_for(list(tail))}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pip_progress.py", description=__doc__.split("\n")[0])
    parser.add_argument("--log", type=Path, required=True, help="pip's whole output goes here")
    parser.add_argument("--expect", type=int, default=170,
                        help="packages a full install resolves (for the estimate)")
    parser.add_argument("--prefix", default="", help="put before every progress line")
    parser.add_argument("pip_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    pip_args = args.pip_args[1:] if args.pip_args[:1] == ["--"] else args.pip_args
    return run(pip_args, args.log, args.expect, args.prefix)


if __name__ == "__main__":
    raise SystemExit(main())
