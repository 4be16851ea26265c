"""How ``dynamo status`` and ``dynamo settings`` find a running ``dynamo serve``.

Each supervisor writes one JSON file, ``serve-{pid}.json``, in `state_dir`
(``$DYNAGRAPH_STATE_DIR``, else ``$XDG_RUNTIME_DIR/dynagraph``, else
``~/.cache/dynagraph/run``) when its etcd is known, and removes it on exit. It names the
graph, its namespaces, the etcd and NATS it uses (its own embedded ones, or those of
``ETCD_ENDPOINTS`` / ``NATS_SERVER``) and each component's resolved config. A file whose
process is gone, or whose pid now belongs to another process (its start time differs),
is stale: `read_states` skips and deletes it.

`select` (pure) picks what a command talks to, from the live files, ``ETCD_ENDPOINTS``
and the ``--pid`` / ``--namespace`` options, and says in words what it found.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV_DIR = "DYNAGRAPH_STATE_DIR"


@dataclass(frozen=True)
class ServeState:
    """What one running ``dynamo serve`` publishes about itself."""

    pid: int
    pid_started: float
    """The process's start time (psutil), which tells a reused pid apart."""
    target: str
    cwd: str
    namespaces: list[str]
    etcd: str
    nats: str
    embedded: bool
    """True when ``etcd``/``nats`` were started by this ``dynamo serve``."""
    started_at: float
    components: dict[str, int]
    """Component name -> number of instances (workers x instances per process), in graph
    order."""
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Component name -> its resolved config values (by YAML key)."""
    component_namespaces: dict[str, str] = field(default_factory=dict)
    """Component name -> its namespace."""
    path: str = ""
    """Where this state was read from (not stored in the file)."""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("path")
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], path: str = "") -> ServeState:
        return cls(
            pid=int(data["pid"]), pid_started=float(data["pid_started"]),
            target=str(data["target"]), cwd=str(data["cwd"]),
            namespaces=[str(n) for n in data["namespaces"]], etcd=str(data["etcd"]),
            nats=str(data.get("nats", "")), embedded=bool(data.get("embedded", False)),
            started_at=float(data["started_at"]),
            components={str(k): int(v) for k, v in dict(data["components"]).items()},
            configs=dict(data.get("configs") or {}),
            component_namespaces={str(k): str(v) for k, v in
                                  dict(data.get("component_namespaces") or {}).items()},
            path=path,
        )

    def describe(self) -> str:
        """One line: ``pid 123, graphs.agg:Frontend, namespace dynamo, etcd URL (its own)``."""
        ns = "namespace" + ("s " if len(self.namespaces) > 1 else " ") + ", ".join(self.namespaces)
        own = " (started by it)" if self.embedded else ""
        return f"dynamo serve pid {self.pid}: {self.target}, {ns}, etcd {self.etcd}{own}"


def state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where state files live (see the module docstring)."""
    env = os.environ if environ is None else environ
    if env.get(ENV_DIR):
        return Path(env[ENV_DIR])
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "dynagraph"
    return Path(env.get("HOME") or Path.home()) / ".cache" / "dynagraph" / "run"


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), or None if it is gone."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return float(proc.create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def is_alive(state: ServeState) -> bool:
    """True while the process that wrote ``state`` still runs."""
    started = process_start_time(state.pid)
    return started is not None and abs(started - state.pid_started) < 1.0


def write_state(state: ServeState, directory: Path) -> Path:
    """Write ``state`` atomically as ``directory/serve-{pid}.json``; returns the path."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / f"serve-{state.pid}.json"
    fd, tmp = tempfile.mkstemp(prefix=".serve-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state.to_json(), f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def publish(target: str, namespaces: Mapping[str, str], configs: Mapping[str, Any],
            env: Mapping[str, str], *, embedded: bool) -> str | None:
    """Write this ``dynamo serve``'s state file; its path, or None (logged) if that failed.

    ``namespaces``: component name -> namespace; ``configs``: component name ->
    ``ComponentConfig`` (workers and resolved values).
    """
    state = ServeState(
        pid=os.getpid(), pid_started=process_start_time(os.getpid()) or 0.0, target=target,
        cwd=os.getcwd(), namespaces=sorted(set(namespaces.values())),
        etcd=env["ETCD_ENDPOINTS"], nats=env.get("NATS_SERVER", ""), embedded=embedded,
        started_at=time.time(),
        components={n: c.instances for n, c in configs.items()},
        configs={n: c.values for n, c in configs.items()},
        component_namespaces=dict(namespaces))
    try:
        return str(write_state(state, state_dir()))
    except OSError as exc:
        log.warning("cannot write the state file that dynamo status reads: %s", exc)
        return None


def remove_state(path: Path | str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def read_states(directory: Path, *, clean: bool = True) -> list[ServeState]:
    """The states of running ``dynamo serve`` processes in ``directory``, oldest first.

    Unreadable files are skipped; stale ones are deleted when ``clean``.
    """
    out: list[ServeState] = []
    for path in sorted(directory.glob("serve-*.json")):
        try:
            state = ServeState.from_json(json.loads(path.read_text()), str(path))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if is_alive(state):
            out.append(state)
        elif clean:
            remove_state(path)
    return sorted(out, key=lambda s: s.started_at)


class SelectionError(Exception):
    """Nothing, or more than one thing, to talk to; the message says what was found."""


@dataclass(frozen=True)
class Selection:
    """What a command reads: an etcd, the namespaces to show (None: every namespace
    found there), the ``dynamo serve`` behind it if known, and how it was chosen."""

    etcd: str
    namespaces: list[str] | None
    state: ServeState | None
    found: str


def select(states: list[ServeState], *, etcd: str | None, namespace: str | None = None,
           pid: int | None = None, where: str = "") -> Selection:
    """Choose from the live ``states`` and an etcd given by the user (``--etcd`` or
    ``ETCD_ENDPOINTS``). Raises SelectionError when nothing or too much matches."""
    candidates = states
    if pid is not None:
        candidates = [s for s in candidates if s.pid == pid]
        if not candidates:
            raise SelectionError(f"no running dynamo serve with pid {pid}"
                                 + _listing(states, where))
    if namespace is not None:
        candidates = [s for s in candidates if namespace in s.namespaces]
    if etcd:
        same = [s for s in candidates if _same_etcd(s.etcd, etcd)]
        if len(same) == 1:
            st = same[0]
            return Selection(etcd, [namespace] if namespace else st.namespaces, st,
                             f"etcd {etcd}, used by {st.describe()}")
        nss = [namespace] if namespace else None
        what = f"namespace {namespace}" if namespace else "every namespace"
        return Selection(etcd, nss, None, f"etcd {etcd} (given), {what}")
    if not candidates:
        if namespace is not None and states:
            raise SelectionError(f"no running dynamo serve has namespace {namespace!r}"
                                 + _listing(states, where))
        raise SelectionError(
            "no running dynamo serve found" + (f" (looked in {where})" if where else "")
            + "; start one, or set ETCD_ENDPOINTS (or pass --etcd) to read another etcd")
    if len(candidates) > 1:
        raise SelectionError(f"found {len(candidates)} running dynamo serve processes; "
                             "choose one with --pid (or --namespace)"
                             + _listing(candidates, where))
    st = candidates[0]
    return Selection(st.etcd, [namespace] if namespace else st.namespaces, st, st.describe())


def _same_etcd(a: str, b: str) -> bool:
    def norm(url: str) -> str:
        return url.split(",")[0].strip().removeprefix("http://").rstrip("/")

    return norm(a) == norm(b)


def _listing(states: list[ServeState], where: str) -> str:
    if not states:
        return ""
    now = time.time()
    lines = [f"  {s.describe()}, up {now - s.started_at:.0f}s" for s in states]
    return ":\n" + "\n".join(lines)
