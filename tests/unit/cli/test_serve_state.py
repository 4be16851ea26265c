"""Finding a running ``dynamo serve``: state files (written, read, stale ones dropped) and
the choice between several graphs, with what the commands say about it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynagraph.cli.serve_state import (
    SelectionError,
    ServeState,
    process_start_time,
    read_states,
    select,
    state_dir,
    write_state,
)


def state(pid: int = 100, *, ns: tuple[str, ...] = ("dynamo",), etcd: str = "http://127.0.0.1:1",
          target: str = "graphs.agg:Frontend", embedded: bool = True) -> ServeState:
    return ServeState(pid=pid, pid_started=1.0, target=target, cwd="/repo", namespaces=list(ns),
                      etcd=etcd, nats="nats://127.0.0.1:2", embedded=embedded, started_at=10.0,
                      components={"Frontend": 1})


def test_state_dir_order(tmp_path: Path) -> None:
    assert state_dir({"DYNAGRAPH_STATE_DIR": "/x", "XDG_RUNTIME_DIR": str(tmp_path)}) == Path("/x")
    assert state_dir({"XDG_RUNTIME_DIR": str(tmp_path)}) == tmp_path / "dynagraph"
    assert state_dir({"XDG_RUNTIME_DIR": "/does/not/exist", "HOME": "/home/u"}) == Path(
        "/home/u/.cache/dynagraph/run")


def test_written_state_is_read_back_while_its_process_lives(tmp_path: Path) -> None:
    me = ServeState(**{**state(os.getpid()).to_json(),
                       "pid_started": process_start_time(os.getpid()) or 0.0})
    path = write_state(me, tmp_path)
    assert path == tmp_path / f"serve-{os.getpid()}.json"
    [back] = read_states(tmp_path)
    assert back == ServeState(**{**me.to_json(), "path": str(path)})


def test_stale_states_are_dropped_and_deleted(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = int(done.stdout)
    write_state(state(dead), tmp_path)
    reused = ServeState(**{**state(os.getpid()).to_json(), "pid_started": 12.0})  # pid reused
    write_state(reused, tmp_path)
    (tmp_path / "serve-1.json").write_text("{not json")
    assert read_states(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serve-1.json"]


def test_one_local_serve_is_chosen_and_described() -> None:
    sel = select([state(7)], etcd=None)
    assert sel.etcd == "http://127.0.0.1:1" and sel.namespaces == ["dynamo"]
    assert sel.found == ("dynamo serve pid 7: graphs.agg:Frontend, namespace dynamo, "
                         "etcd http://127.0.0.1:1 (started by it)")


def test_nothing_running_says_where_it_looked() -> None:
    with pytest.raises(SelectionError) as exc:
        select([], etcd=None, where="/run/user/0/dynagraph")
    assert str(exc.value) == (
        "no running dynamo serve found (looked in /run/user/0/dynagraph); start one, or set "
        "ETCD_ENDPOINTS (or pass --etcd) to read another etcd")


def test_several_graphs_need_a_choice() -> None:
    a, b = state(7), state(8, ns=("demo",), etcd="http://127.0.0.1:5", target="x:Y")
    with pytest.raises(SelectionError) as exc:
        select([a, b], etcd=None)
    first, *rest = str(exc.value).splitlines()
    assert first == ("found 2 running dynamo serve processes; choose one with --pid (or "
                     "--namespace):")
    assert [r.split(", up ")[0] for r in rest] == [f"  {a.describe()}", f"  {b.describe()}"]
    assert select([a, b], etcd=None, pid=8).state == b
    assert select([a, b], etcd=None, namespace="demo").state == b
    with pytest.raises(SelectionError, match="no running dynamo serve with pid 9"):
        select([a, b], etcd=None, pid=9)
    with pytest.raises(SelectionError, match="no running dynamo serve has namespace 'x'"):
        select([a, b], etcd=None, namespace="x")


def test_a_given_etcd_wins_and_finds_the_serve_using_it() -> None:
    a, b = state(7), state(8, etcd="http://127.0.0.1:5", embedded=False)
    sel = select([a, b], etcd="127.0.0.1:5")
    assert sel.state == b and sel.etcd == "127.0.0.1:5"
    assert sel.found == ("etcd 127.0.0.1:5, used by dynamo serve pid 8: graphs.agg:Frontend, "
                         "namespace dynamo, etcd http://127.0.0.1:5")
    other = select([a, b], etcd="http://10.0.0.1:2379")
    assert (other.state, other.namespaces) == (None, None)
    assert other.found == "etcd http://10.0.0.1:2379 (given), every namespace"
    assert select([], etcd="http://e:1", namespace="demo").namespaces == ["demo"]
