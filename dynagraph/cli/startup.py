"""What ``dynamo serve`` prints while a graph starts: one line per component step.

Pure (no I/O, the clock is passed in), so the exact lines are unit-tested.

- `OutputFilter` reads one child's output lines. Progress events
  (`dynagraph.runtime.progress`) and vLLM's start-up milestones (its INFO lines:
  model resolved, engine core up, weights loaded, KV cache sized ...) become events;
  vLLM's other INFO lines and a short list of warnings that are expected on every CPU
  start and say nothing actionable (`BENIGN`) are hidden unless ``--log-level debug``;
  everything else is shown with the child's ``[Component:i]`` prefix.
- `StartupView` turns events into lines such as::

      [  23.4s] VllmWorker[0]     loading: weights loaded in 0.01 s

  and, while nothing else was printed for `WAIT_EVERY` seconds, a line naming what the
  graph still waits for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from dynagraph.runtime.progress import Event, parse

WAIT_EVERY = 20.0
"""Seconds of silence after which the view says what it is waiting for."""

THROTTLE = 5.0
"""Least seconds between two lines of one repeating step (a checkpoint-shard bar)."""

_VLLM_LINE = re.compile(
    r"^(?:\([^)]*\) )?(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d "
    r"\d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] (?P<msg>.*)$")
"""vLLM's own format: ``(EngineCore pid=1) INFO 11-30 17:13:16 [core.py:133] message``."""

_OUR_VLLM_LINE = re.compile(
    r"^\d\d:\d\d:\d\d (?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) vllm\S* \[[^\]]*\] "
    r"(?P<msg>.*)$")
"""A vLLM record logged before vLLM configured its logging, in our format."""

_NIXL_INFO = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)? NIXL (?:INFO|DEBUG) ")
"""NIXL's own log lines (``2026-11-30 17:55:54 NIXL INFO _api.py:405 Backend UCX ...``)."""

_PY_WARNING = re.compile(r"^\S+\.py:\d+: \w*Warning: (?P<msg>.*)$")
_SHARDS = re.compile(r"^Loading (?P<what>\w+) checkpoint shards:\s+(?P<pct>\d+)% Completed "
                     r"\| (?P<done>\d+)/(?P<total>\d+)")

MILESTONES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^Resolved architecture: (\S+)"),
     "model {0}; starting the engine core process"),
    (re.compile(r"^Initializing a V1 LLM engine \(v([^)]+)\)"),
     "engine core up (vLLM {0}); starting its model runner"),
    (re.compile(r"^Starting to load model (\S+?)(?:\.\.\.)?$"), "loading the weights of {0}"),
    (re.compile(r"^Loading weights took ([\d.]+) seconds"), "weights loaded in {0} s"),
    (re.compile(r"^Model loading took (\S+) GiB memory and ([\d.]+) seconds"),
     "model loaded: {0} GiB in {1} s"),
    (re.compile(r"^(\w+) KV cache size: ([\d,]+) tokens"), "{0} KV cache of {1} tokens"),
    (re.compile(r"^Compiling a graph for .* takes ([\d.]+) s"), "graph compiled in {0} s"),
    (re.compile(r"^Graph capturing finished in (\d+) secs"), "CUDA graphs captured in {0} s"),
    (re.compile(r"^init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
     "engine initialised in {0} s (profiling, KV cache, warm-up)"),
)
"""vLLM INFO messages that mark a start-up step, and how the step is shown."""

BENIGN: tuple[str, ...] = (
    "Triton is installed, but doesn't include CPU backend",
    "Triton is not installed. triton-cpu is expected",
    "Enforce eager set, disabling torch.compile",
    "Inductor compilation was disabled by user settings",
    "Reset SSM cache type to float32",
    "Model Runner V2 requires Triton",
    "is not found in LD_PRELOAD",
    "NUMA binding: Using MEMBIND policy",
    "`torch.distributed.reduce_op` is deprecated",
    "resource_tracker: There appear to be",
    "The global random seed is set to 0. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False",
    "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding",
    "Initializing KVConnectorBase_V1. This API is experimental",
)
"""Warnings every vLLM start on a CPU prints, expected and with nothing to act on
(``enforce-eager`` is our default; triton and tcmalloc are absent by design; NIXL
engines run vLLM's single-process executor and a KV connector on purpose, see
`dynagraph.llm.kv.transfer.nixl_side`)."""


@dataclass(frozen=True)
class Verdict:
    """What to do with one output line: show it, hide it, or show ``event``."""

    action: Literal["show", "hide", "event"]
    event: Event | None = None


SHOW = Verdict("show")
HIDE = Verdict("hide")


class OutputFilter:
    """Classifies the output lines of one component process (stateful: a hidden Python
    warning hides the source line printed under it).

    ``quiet_vllm``: vLLM logs at INFO for us (we set its level), so its INFO lines other
    than milestones are hidden. ``hide_benign``: hide `BENIGN` lines (not at debug level).
    """

    def __init__(self, *, quiet_vllm: bool, hide_benign: bool) -> None:
        self.quiet_vllm = quiet_vllm
        self.hide_benign = hide_benign
        self._hide_indented = False

    def classify(self, line: str) -> Verdict:
        line = line.rstrip("\r\n")
        if "\r" in line:  # a progress bar redrawn in place: its last state counts
            line = next((part for part in reversed(line.split("\r")) if part.strip()), "")
        hide_indented, self._hide_indented = self._hide_indented, False
        event = parse(line)
        if event is not None:
            return Verdict("event", event)
        if not line.strip():
            return HIDE
        if hide_indented and line.startswith(" "):
            return HIDE
        if self.quiet_vllm and _NIXL_INFO.match(line):
            return HIDE
        m = _VLLM_LINE.match(line) or _OUR_VLLM_LINE.match(line)
        if m is not None:
            return self._vllm(m.group("level"), m.group("msg"))
        shards = _SHARDS.match(line)
        if shards is not None:
            done, total = shards.group("done"), shards.group("total")
            if done == "0":
                return HIDE  # the bar's first state says nothing yet
            return Verdict("event", Event(
                "loading", f"{shards.group('what')} checkpoint shards {done}/{total} "
                f"({shards.group('pct')}%)", {"repeat": "shards", "final": done == total}))
        if self.hide_benign and _benign(line):
            self._hide_indented = _PY_WARNING.match(line) is not None
            return HIDE
        return SHOW

    def _vllm(self, level: str, msg: str) -> Verdict:
        if level in ("INFO", "DEBUG"):
            for pattern, template in MILESTONES:
                m = pattern.match(msg)
                if m is not None:
                    return Verdict("event", Event("loading", template.format(*m.groups())))
            return HIDE if self.quiet_vllm else SHOW
        if level == "WARNING" and self.hide_benign and _benign(msg):
            return HIDE
        return SHOW


def _benign(text: str) -> bool:
    return any(b in text for b in BENIGN)


@dataclass
class _Proc:
    label: str
    phase: str = "starting"
    since: float = 0.0
    detail: str = ""
    ready: bool = False
    last_repeat: dict[str, float] = field(default_factory=dict)


class StartupView:
    """The supervisor's start-up lines. ``t0`` and every ``now`` come from one clock."""

    def __init__(self, t0: float, labels: list[str]) -> None:
        self.t0 = t0
        self.width = max((len(label) for label in labels), default=0)
        self.procs = {label: _Proc(label, since=t0) for label in labels}
        self.last_line = t0

    def _line(self, now: float, label: str, text: str) -> str:
        self.last_line = now
        return f"[{now - self.t0:7.1f}s] {label:<{self.width}}  {text}"

    def started(self, label: str, pid: int, now: float, restart: int = 0) -> str:
        p = self.procs.setdefault(label, _Proc(label))
        p.phase, p.since, p.detail, p.ready = "starting", now, "", False
        again = f", restart {restart}" if restart else ""
        return self._line(now, label, f"started, pid {pid}{again}")

    def event(self, label: str, ev: Event, now: float) -> str | None:
        """The line for ``ev`` from ``label`` (None: throttled, or not worth a line)."""
        p = self.procs.setdefault(label, _Proc(label, since=now))
        if ev.phase == "ready":
            p.phase, p.ready = "ready", True
            where = ev.fields.get("url") or ev.fields.get("address") or ""
            return self._line(now, label, f"ready in {now - p.since:.1f}s"
                              + (f", {where}" if where else ""))
        if p.phase == "loading" and ev.detail == p.detail:
            return None  # the same step again (a bar's last state is printed twice)
        p.phase, p.detail = "loading", ev.detail
        repeat = ev.fields.get("repeat")
        if isinstance(repeat, str) and not ev.fields.get("final"):
            if now - p.last_repeat.get(repeat, -THROTTLE) < THROTTLE:
                return None
            p.last_repeat[repeat] = now
        return self._line(now, label, f"loading: {ev.detail}")

    def exited(self, label: str) -> None:
        """``label`` exited (it will be started again, or the graph stops)."""
        p = self.procs.get(label)
        if p is not None:
            p.phase, p.ready = "exited", False

    def waiting(self, now: float) -> str | None:
        """A line naming what is not ready yet, if nothing was printed for `WAIT_EVERY` s."""
        if now - self.last_line < WAIT_EVERY:
            return None
        pending = [p for p in self.procs.values() if not p.ready]
        if not pending:
            return None
        self.last_line = now
        parts = [f"{p.label} ({p.phase}, {now - p.since:.0f}s)" for p in pending]
        return (f"[{now - self.t0:7.1f}s] waiting for {len(pending)} of {len(self.procs)}: "
                + ", ".join(parts))

    def all_ready(self) -> bool:
        return all(p.ready for p in self.procs.values())
