"""Same-host KV reads from another engine's shared cache (``shm_direct``, with
``shm_memory`` and ``nixl_descs``), without vLLM:
the copy plan, the move of a cache to a memfd, the manifest a peer maps, and the NIXL
agent's stand-in that turns a READ from a mapped peer into copies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dynagraph.llm.kv.transfer import shm_direct as sd
from dynagraph.llm.kv.transfer import shm_memory as sm
from dynagraph.llm.kv.transfer.nixl_descs import merge_runs
from dynagraph.runtime.addresses import host_id
from tests.support.nixl import FakeNixlAgent


def test_descriptor_pairs_merge_into_runs_contiguous_on_both_sides() -> None:
    dst = np.array([100, 110, 120, 200, 210], np.uint64)
    src = np.array([500, 510, 600, 610, 620], np.uint64)
    d, s, n = merge_runs(dst, src, np.full(5, 10, np.uint64))
    # 100-120 is contiguous here but not there (510 -> 600); 120 -> 200 breaks here
    assert (d.tolist(), s.tolist(), n.tolist()) == ([100, 120, 200], [500, 600, 610],
                                                      [20, 10, 20])
    empty = merge_runs(np.array([], np.uint64), np.array([], np.uint64),
                          np.array([], np.uint64))
    assert all(len(a) == 0 for a in empty)


def test_copy_moves_the_bytes_of_every_descriptor() -> None:
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, np.uint8)
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    pairs = [(0, 8), (8, 16), (32, 0)]  # (dst offset, src offset), 8 bytes each
    moved = sd.copy(np.array([base_d + a for a, _ in pairs], np.uint64),
                    np.array([base_s + b for _, b in pairs], np.uint64),
                    np.full(3, 8, np.uint64))
    assert moved == 24
    assert dst[:16].tolist() == list(range(8, 24)) and dst[32:40].tolist() == list(range(8))
    assert not dst[16:32].any()


def test_rehome_moves_every_view_of_a_buffer_to_one_memfd() -> None:
    buf = torch.zeros(4096 * 4, dtype=torch.int8)
    k = buf[: 4096 * 2].view(torch.bfloat16).view(2, 2048)
    v = buf[4096 * 2:].view(torch.bfloat16).view(2, 2048)
    caches = {"layer.0": k, "layer.1": v, "layer.2": k}  # a shared layer: the same tensor
    region = sm.rehome(caches)
    assert region is not None and region.nbytes == 4096 * 4
    assert os.readlink(f"/proc/self/fd/{region.fd}").startswith("/memfd:dynagraph-kv")
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() == region.addr
    assert v.data_ptr() - k.data_ptr() == 4096 * 2  # offsets kept
    v[1, 5] = 3.5
    assert sm.regions_of([v.data_ptr()]) == [region]
    peer = np.memmap(f"/proc/self/fd/{region.fd}", dtype=np.uint8, mode="r")
    back = torch.frombuffer(bytearray(peer[4096 * 2:].tobytes()), dtype=torch.bfloat16)
    assert float(back.view(2, 2048)[1, 5]) == 3.5  # the memfd holds what the views hold
    del peer


def manifest_for(tmp_path: Path, agent: str, body: dict[str, Any]) -> None:
    sm.manifest_path(agent, tmp_path).write_text(json.dumps(body))


def test_a_published_peer_maps_and_translates_its_addresses(tmp_path: Path) -> None:
    cache = {"l": torch.zeros(8192, dtype=torch.int8)}
    region = sm.rehome(cache)
    assert region is not None
    cache["l"][100] = 7
    path = sm.publish("agent-a", [region], tmp_path)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    peer = sm.PeerMemory.open("agent-a", tmp_path)
    assert peer is not None
    lens = np.array([4, 4], np.uint64)
    local = peer.translate(np.array([region.addr + 100, region.addr + 8188], np.uint64), lens)
    assert local is not None
    assert np.frombuffer(peer._keep[1], np.uint8)[100] == 7
    assert int(local[1] - local[0]) == 8088
    # a range past the region's end is not this peer's memory
    assert peer.translate(np.array([region.addr + 8190], np.uint64), lens[:1]) is None
    assert peer.translate(np.array([region.addr - 1], np.uint64), lens[:1]) is None
    sm.withdraw("agent-a", tmp_path)
    assert not path.exists() and sm.PeerMemory.open("agent-a", tmp_path) is None


def test_a_manifest_of_another_host_or_another_file_is_not_mapped(tmp_path: Path) -> None:
    region = sm.rehome({"l": torch.zeros(4096, dtype=torch.int8)})
    assert region is not None
    regions = [{"addr": region.addr, "nbytes": region.nbytes, "fd": region.fd,
                "ino": region.ino}]
    manifest_for(tmp_path, "far", {"pid": os.getpid(), "host": "other-boot-id",
                                   "regions": regions})
    manifest_for(tmp_path, "moved", {"pid": os.getpid(), "host": host_id(),
                                     "regions": [{**regions[0], "ino": region.ino + 1}]})
    manifest_for(tmp_path, "gone", {"pid": os.getpid(), "host": host_id(),
                                    "regions": [{**regions[0], "fd": 10_000}]})
    for agent in ("far", "moved", "gone", "never-published"):
        assert sm.PeerMemory.open(agent, tmp_path) is None, agent
    with pytest.raises(ValueError, match="agent name"):
        sm.manifest_path("../x", tmp_path)


def test_sweep_removes_the_manifests_of_dead_processes(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    manifest_for(tmp_path, "dead", {"pid": int(dead.stdout), "host": host_id(), "regions": []})
    manifest_for(tmp_path, "live", {"pid": os.getpid(), "host": host_id(), "regions": []})
    assert sm.sweep(tmp_path) == 1
    assert [p.name for p in tmp_path.iterdir()] == [f"{sm.MANIFEST_PREFIX}live.json"]


OWNER = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from dynagraph.llm.kv.transfer import shm_memory as sm
    cache = {"l": torch.zeros(1 << 16, dtype=torch.int8)}
    region = sm.rehome(cache)
    cache["l"][:4096] = torch.arange(4096, dtype=torch.int64).remainder(127).to(torch.int8)
    sm.publish("owner", [region], Path(sys.argv[1]))
    print(region.addr, flush=True)
    sys.stdin.read()  # until the reader is done
""")


def test_another_process_reads_the_published_cache_until_it_is_gone(tmp_path: Path) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path)], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert owner.stdout is not None and owner.stdin is not None
        addr = int(owner.stdout.readline())
        agent = FakeNixlAgent()
        nixl = sd.ShmNixl(agent, tmp_path)
        dst = np.zeros((2, 4096), np.uint8)
        mine = nixl.prep_xfer_dlist("", descs(dst.ctypes.data, 2, 4096))
        theirs = nixl.prep_xfer_dlist("owner", descs(addr, 2, 4096))
        read = nixl.make_prepped_xfer("READ", mine, [1], theirs, [0], notif_msg=b"n")
        assert nixl.transfer(read) == "DONE"
        assert dst[1].tolist() == [i % 127 for i in range(4096)] and not dst[0].any()
        owner.stdin.close()
        owner.wait(timeout=30)
        # the owner is gone: its memory is unmapped and a READ from it is NIXL's
        assert nixl.make_prepped_xfer("READ", mine, [1], theirs, [0]) == "nixl-handle"
        assert nixl.peer("owner") is None and sm.sweep(tmp_path) == 1
    finally:
        owner.kill()
        owner.wait(timeout=30)


def descs(base: int, blocks: int, block: int) -> np.ndarray:
    """vLLM's N x 3 rows (address, length, device) of ``blocks`` blocks."""
    return np.array([[base + i * block, block, 0] for i in range(blocks)], np.uint64)


def test_a_read_from_a_mapped_peer_is_a_copy_and_its_notification(tmp_path: Path) -> None:
    remote = {"l": torch.zeros(8 * 64, dtype=torch.int8)}
    region = sm.rehome(remote)
    assert region is not None
    remote["l"].view(8, 64)[3] = 9  # the peer's block 3
    sm.publish("prefill-agent", [region], tmp_path)
    local = np.zeros((8, 64), np.uint8)
    agent = FakeNixlAgent()
    nixl = sd.ShmNixl(agent, tmp_path)
    mine = nixl.prep_xfer_dlist("NIXL_INIT_AGENT",
                                nixl.get_xfer_descs(descs(local.ctypes.data, 8, 64), "DRAM"))
    theirs = nixl.prep_xfer_dlist(b"prefill-agent",
                                  nixl.get_xfer_descs(descs(region.addr, 8, 64), "DRAM"))
    handle = nixl.make_prepped_xfer("READ", mine, [5, 6], theirs, [3, 4], notif_msg=b"req:1")
    assert isinstance(handle, sd.ShmRead) and agent.calls == []
    assert nixl.transfer(handle) == "DONE" and nixl.check_xfer_state(handle) == "DONE"
    assert local[5].tolist() == [9] * 64 and not local[6].any() and not local[:5].any()
    assert agent.calls == [("notif", b"prefill-agent", b"req:1")]
    tele = nixl.get_xfer_telemetry(handle)
    assert tele.totalBytes == 128 and tele.descCount == 2 and tele.xferDuration > 0
    assert nixl.release_xfer_handle(handle) is None and nixl.copies == 1
    assert nixl.name == "decode-agent"  # the rest is the agent's
    # once the peer is removed, its READs are NIXL's again
    nixl.remove_remote_agent(b"prefill-agent")
    assert nixl.make_prepped_xfer("READ", mine, [5], theirs, [3]) == "nixl-handle"


def test_reads_from_a_peer_without_shared_memory_stay_on_nixl(tmp_path: Path) -> None:
    agent = FakeNixlAgent()
    nixl = sd.ShmNixl(agent, tmp_path)
    local = np.zeros((4, 64), np.uint8)
    mine = nixl.prep_xfer_dlist("NIXL_INIT_AGENT",
                                nixl.get_xfer_descs(descs(local.ctypes.data, 4, 64), "DRAM"))
    theirs = nixl.prep_xfer_dlist(b"far-agent",
                                  nixl.get_xfer_descs(descs(1 << 40, 4, 64), "DRAM"))
    handle = nixl.make_prepped_xfer("READ", mine, [0], theirs, [1], notif_msg=b"n")
    assert handle == "nixl-handle"
    assert nixl.transfer(handle) == "PROC" and nixl.check_xfer_state(handle) == "PROC"
    assert agent.calls == [("make", "READ"), ("transfer", "nixl-handle")]


def test_the_env_switch() -> None:
    assert sd.enabled({sd.ENV: "1"}) and not sd.enabled({sd.ENV: "0"}) and not sd.enabled({})


PEAK = textwrap.dedent("""
    import resource, torch
    from dynagraph.llm.kv.transfer import shm_memory as sm
    gib = 1 << 30
    buf = torch.ones(gib, dtype=torch.int8)  # every page touched, as vLLM's zeros
    caches = {"k": buf[: gib // 2].view(torch.bfloat16), "v": buf[gib // 2:].view(torch.bfloat16)}
    del buf
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert sm.rehome(caches) is not None
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(grew // 1024)
""")


def test_rehome_frees_the_old_buffer_before_making_the_new_one() -> None:
    """Peak memory stays at one cache (a second copy would be a whole cache more)."""
    out = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True,
                         check=True, timeout=120)
    grew_mib = int(out.stdout)
    assert grew_mib < 256, grew_mib  # 1,024 if both lived at once


def test_populate_maps_the_pages_without_holding_the_gil() -> None:
    """Another thread keeps running while 256 MiB of a mapping are populated."""
    import mmap
    import threading
    import time

    n = 256 << 20
    fd = os.memfd_create("populate-test")
    try:
        os.ftruncate(fd, n)
        mapped = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    view = np.frombuffer(mapped, np.uint8)
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    thread = threading.Thread(target=tick)
    thread.start()
    try:
        began = time.perf_counter()
        assert sm.populate(view.ctypes.data, n)
        took = time.perf_counter() - began
    finally:
        done.set()
        thread.join()
    during = [t for t in ticks if began <= t <= began + took]
    assert len(during) >= 2 or took < 0.005, (len(during), took)
    del view
    mapped.close()


def test_a_peer_of_several_regions_translates_into_each(tmp_path: Path) -> None:
    import ctypes

    caches = [{"l": torch.zeros(4096 * (i + 1), dtype=torch.int8)} for i in range(3)]
    regions = [sm.rehome(c) for c in caches]  # the caches stay alive: their fds stay open
    for i, c in enumerate(caches):
        c["l"][8] = i + 1
    listed = sorted((r for r in regions if r is not None), key=lambda r: -r.addr)
    assert len(listed) == 3
    sm.publish("many", listed, tmp_path)  # not in address order
    peer = sm.PeerMemory.open("many", tmp_path)
    assert peer is not None
    local = peer.translate(np.array([r.addr + 8 for r in regions if r is not None], np.uint64),
                           np.full(3, 1, np.uint64))
    assert local is not None
    assert [ctypes.string_at(a, 1)[0] for a in local.tolist()] == [1, 2, 3]
