"""Two "hosts" on one machine: network namespaces joined by a veth pair (needs root and `ip`).

Namespace A holds the notebook's side (tests/multihost_driver.py: the controller and two
engines); namespace B, with its own host name (a UTS namespace) and its own /dev/shm (a tmpfs
in its mount namespace), runs `course.py engines 2` with the connection file, as docs/multihost.md's
second machine does. The scratch backend runs between them over the veth addresses.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from course_lib.processes import end_processes, record

ROOT = Path(__file__).resolve().parent.parent
N, FAR = 4, 2
RUN_TIMEOUT = 30.0  # the driver's cluster run_timeout: an engine's death must be named sooner
FAR_HOST = "course-far-host"
# the ports docs/multihost.md tells a firewall to open: the controller's, and the ranks' own
CONTROLLER_PORTS, DIST_PORTS = range(10100, 10120), range(29500, 29510)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in CI)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs the ip (iproute2) and unshare (util-linux) commands"
    probe = f"clprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """Two namespaces, A (10.x.y.1) and B (10.x.y.2), joined by a veth pair."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.a, self.b = f"cla{tag}", f"clb{tag}"
        net = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
        self.ip_a, self.ip_b = f"{net}.1", f"{net}.2"
        _ip("netns", "add", self.a)
        _ip("netns", "add", self.b)
        _ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        for ns, dev, ip in ((self.a, f"va{tag}", self.ip_a), (self.b, f"vb{tag}", self.ip_b)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def exec_in(self, ns: str, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *cmd]

    def far_host(self, *cmd: str) -> list[str]:
        """`cmd` in B as on another machine: its own host name and its own /dev/shm."""
        shell = (f"hostname {FAR_HOST} && mount -t tmpfs -o size=64m course-far /dev/shm "
                 '&& exec "$@"')
        return self.exec_in(self.b, "unshare", "--uts", "--", "sh", "-c", shell, "sh", *cmd)

    def remove(self) -> list[str]:
        for ns in (self.a, self.b):  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [ns for ns in (self.a, self.b) if ns in listed]


class Lines:
    """A process's stdout read by a thread, so every wait on it has a deadline."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.seen, self._q = proc, [], queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.seen.append(line)
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            if prefix in line:
                return line
        pytest.fail(f"no {prefix!r} within {timeout:g}s; output so far:\n" + "".join(self.seen))


def _start(cmd: list[str], procs: list) -> tuple[subprocess.Popen, Lines]:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env=dict(os.environ, PYTHONPATH=str(ROOT / "tests"),
                                     COURSE_DIST_PORTS=f"{DIST_PORTS[0]}-{DIST_PORTS[-1]}"))
    procs.append(proc)
    return proc, Lines(proc)


def _ask(proc: subprocess.Popen, lines: Lines, command: str, timeout: float = 60) -> dict:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return json.loads(lines.wait_for('"step": "' + command, timeout).split("DRIVER ", 1)[1])


def _stranger(address: list) -> list[str]:
    """A process that reaches a rank's port and tries the handshake without the secret."""
    code = ("import os, socket, sys, time\n"
            "from course_lib.dist.handshake import client_handshake\n"
            "from course_lib.dist.errors import ProtocolError\n"
            f"s = socket.create_connection(({address[0]!r}, {address[1]}), timeout=10)\n"
            "try:\n"
            "    client_handshake(s, os.urandom(32), 1, 0, time.monotonic() + 10)\n"
            "    print('STRANGER accepted')\n"
            "except (ProtocolError, OSError) as exc:\n"
            "    print('STRANGER refused:', exc)\n"
            "s.sendall(os.urandom(32))\n"  # a guessed proof: the rank must turn it away too
            "s.close()\n")
    return [sys.executable, "-c", code]


WHY_NOT = _why_not()


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))
def test_a_cluster_across_two_network_namespaces():
    hosts, procs, started = Hosts(), [], []
    try:
        driver, out = _start(hosts.exec_in(hosts.a, sys.executable,
                                           str(ROOT / "tests" / "multihost_driver.py"),
                                           str(N), str(FAR), hosts.ip_a, str(RUN_TIMEOUT),
                                           f"{CONTROLLER_PORTS[0]}-{CONTROLLER_PORTS[-1]}"),
                             procs)
        instructions = out.wait_for("course.py engines", 60)
        connection_file = instructions.split("copy ", 1)[1].split()[0]
        info = json.loads(Path(connection_file).read_text())
        ports = [p for v in info.values() for p in (v if isinstance(v, list) else [v])
                 if isinstance(p, int) and not isinstance(p, bool) and p > 1024]
        assert ports and all(p in CONTROLLER_PORTS for p in ports), info
        far, far_out = _start(hosts.far_host(sys.executable, str(ROOT / "course.py"), "engines",
                                             str(FAR), "--file", connection_file), procs)
        begun = json.loads(out.wait_for('"step": "started"', 120).split("DRIVER ", 1)[1])
        started = [p for proc in (driver, far) for p in record(proc.pid)]

        # ranks on both "hosts", each rank's address on its own side of the veth pair
        hosts_of = begun["hosts"]
        assert sorted(hosts_of).count(FAR_HOST) == FAR and len(set(hosts_of)) == 2, hosts_of
        for rank, (addr, port) in enumerate(begun["addresses"]):
            assert addr == (hosts.ip_b if hosts_of[rank] == FAR_HOST else hosts.ip_a), begun
            assert port in DIST_PORTS, begun

        # all_reduce across them equals the sum one process computes (small and large payloads)
        got = _ask(driver, out, "sums")["per_rank"]
        for size, (first, last) in zip([1000, 300_000], got[0]):
            want = sum((r + 1) * torch.arange(size, dtype=torch.float64) for r in range(N))
            assert (first, last) == (want[1].item(), want[-1].item())
        assert all(r == got[0] for r in got), got

        # shared memory within a "host", TCP across
        records = _ask(driver, out, "records")["records"]
        for rank, rec in enumerate(records):
            for peer, kind in rec["links"].items():
                same = hosts_of[int(peer)] == hosts_of[rank]
                assert kind.startswith("shm") if same else kind == "tcp", (rank, peer, kind)

        # a stranger in B, on rank 0's veth address, is turned away; the cluster still works
        target = begun["addresses"][0]
        stranger = subprocess.run(hosts.exec_in(hosts.b, *_stranger(target)), cwd=ROOT,
                                  capture_output=True, text=True, timeout=60)
        assert "STRANGER refused" in stranger.stdout, stranger.stdout + stranger.stderr
        assert _ask(driver, out, "sums")["per_rank"] == got
        rejected = _ask(driver, out, "records")["records"][0]["rejected"]
        assert any(r.startswith(hosts.ip_b + ":") for r in rejected), rejected

        # an engine in B killed with its nanny (nothing left there to report it, as when its
        # host loses it): named, as dead, well within the run's timeout
        victim = next(r for r in range(N) if hosts_of[r] == FAR_HOST)
        engine = psutil.Process(begun["pids"][victim])
        for proc in [engine, *engine.children(recursive=True)]:
            proc.kill()
        after = _ask(driver, out, "after-kill", timeout=RUN_TIMEOUT + 30)
        assert after["error"] == "EngineDied", after
        assert list(after["failures"]) == [str(victim)], after
        assert FAR_HOST in after["failures"][str(victim)], after
        assert "refuses connections" in after["failures"][str(victim)], after
        assert after["seconds"] < RUN_TIMEOUT / 2, after

        # stopping the cluster shuts the far engines down, and `course.py engines` exits
        _ask(driver, out, "stop")
        assert driver.wait(60) == 0, "".join(out.seen)
        assert far.wait(60) == 0, "".join(far_out.seen)
        left = [p for p, _ in started if psutil.pid_exists(p) and
                psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not left, f"still running: {left}"
    finally:
        for proc in procs:
            end_processes(record(proc.pid), grace=2.0)
        end_processes(started, grace=1.0)
        assert hosts.remove() == [], "namespaces left behind"


def _free_pair_below_the_ephemeral_range(start: int = 20000) -> int:
    """Two adjacent ports, both free now, below the range the kernel hands out for port 0 and
    outgoing connections (32768 and up by default), so no other test takes one meanwhile."""
    for base in range(start, 32000, 2):
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
        return base
    raise RuntimeError("no two adjacent free ports between 20000 and 32000")


def test_listeners_take_their_ports_from_the_range_a_firewall_opens(monkeypatch):
    from course_lib.dist.transport import Listener, is_listening

    base = _free_pair_below_the_ephemeral_range()
    monkeypatch.setenv("COURSE_DIST_PORTS", f"{base}-{base + 1}")
    first, second = Listener(), Listener()
    try:
        assert {first.address[1], second.address[1]} == {base, base + 1}
        with pytest.raises(OSError, match=f"no free port in COURSE_DIST_PORTS={base}-{base + 1}"):
            Listener()
        first.start(os.urandom(32), 0, 2, 5.0, on_peer=lambda *args: None)
        assert is_listening(first.address)
        with socket.create_connection(first.address) as intruder:
            intruder.sendall(b"GET / HTTP/1.0\r\n" * 4)
        deadline = time.monotonic() + 5
        while not first.rejected and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(first.rejected) == 1 and "not a course_lib.dist hello" in first.rejected[0]
        first.close()
        assert not is_listening(first.address)  # a closed port refuses: the rank is gone
    finally:
        first.close()
        second.close()
    for bad in ("29500", "9-3", "a-b", "0-10"):
        monkeypatch.setenv("COURSE_DIST_PORTS", bad)
        with pytest.raises(ValueError, match="COURSE_DIST_PORTS must be two ports"):
            Listener()
