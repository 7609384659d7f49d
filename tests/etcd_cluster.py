"""A real etcd cluster for tests: members on loopback ports, data in a temp dir, killed by PID.

Debian's `etcd-server` (etcd 3.4), started with ``--enable-v2`` (jitckpt's job store uses the v2
API through torch's EtcdStore). Tests skip with the install command when etcd is missing.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdCluster:
    """``members`` etcd processes on 127.0.0.1; ``endpoint(i)`` is member i's client HOST:PORT."""

    def __init__(self, data: Path, members: int = 3) -> None:
        if shutil.which("etcd") is None:
            pytest.skip("etcd is not installed: apt-get install etcd-server (make test does it where apt works)")
        try:
            import etcd  # noqa: F401
        except ImportError:
            pytest.skip("python-etcd is not installed: pip install python-etcd")
        self.client_ports = [_free_port() for _ in range(members)]
        peer_ports = [_free_port() for _ in range(members)]
        cluster = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(peer_ports))
        self.procs: list[subprocess.Popen] = []
        self._cmds: list[list[str]] = []
        self._data = data
        for i in range(members):
            (data / f"m{i}").mkdir(parents=True)
            cmd = ["etcd", "--name", f"m{i}", "--data-dir", str(data / f"m{i}"), "--enable-v2",
                   "--listen-client-urls", f"http://127.0.0.1:{self.client_ports[i]}",
                   "--advertise-client-urls", f"http://127.0.0.1:{self.client_ports[i]}",
                   "--listen-peer-urls", f"http://127.0.0.1:{peer_ports[i]}",
                   "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_ports[i]}",
                   "--initial-cluster", cluster, "--initial-cluster-state", "new",
                   "--initial-cluster-token", f"jitckpt-test-{peer_ports[0]}"]
            self._cmds.append(cmd)
            self.procs.append(self._spawn(i))
        self._wait_healthy(timeout=60)

    def _spawn(self, i: int) -> subprocess.Popen:
        with open(self._data / f"m{i}.log", "ab") as log:
            return subprocess.Popen(self._cmds[i], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def endpoints(self, first: int = 0) -> str:
        """Every member's HOST:PORT, comma-separated, member `first` first."""
        n = len(self.client_ports)
        return ",".join(self.endpoint((first + k) % n) for k in range(n))

    def restart(self, i: int) -> None:
        """Start member i again on its data directory (it rejoins the cluster)."""
        self.procs[i] = self._spawn(i)
        self._wait_healthy(timeout=60)

    def endpoint(self, i: int = 0) -> str:
        return f"127.0.0.1:{self.client_ports[i]}"

    def _wait_healthy(self, timeout: float) -> None:
        import etcd

        deadline = time.monotonic() + timeout
        while True:
            try:
                members = tuple(("127.0.0.1", p) for i, p in enumerate(self.client_ports) if self.procs[i].poll() is None)
                etcd.Client(host=members, read_timeout=2, allow_reconnect=True).write("/health-check", "1")
                return
            except Exception as e:  # noqa: BLE001 - not up yet: connection refused, no leader
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"etcd cluster did not come up: {e}") from None
                time.sleep(0.1)  # polling a server that is starting

    def kill(self, i: int) -> None:
        self.procs[i].kill()
        self.procs[i].wait(timeout=10)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


@pytest.fixture
def etcd_cluster(tmp_path):
    cluster = EtcdCluster(tmp_path / "etcd")
    yield cluster
    cluster.close()
