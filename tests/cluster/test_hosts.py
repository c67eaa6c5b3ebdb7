"""The emulated hosts themselves (tests/hosts.py): machines that share nothing but a network
of the rate a test chooses, lost whole at an instant, and leaving nothing behind."""

from __future__ import annotations

import hosts
import pytest

pytestmark = pytest.mark.cluster

SEND = r"""
import socket, sys, time
n = int(sys.argv[2])
s = socket.create_connection((sys.argv[1], 7000), 5)
t = time.perf_counter()
s.sendall(b"x" * n)
s.shutdown(socket.SHUT_WR)
s.recv(1)
print(n * 8 / (time.perf_counter() - t) / 1e6)
"""

RECEIVE = r"""
import socket
srv = socket.create_server(("0.0.0.0", 7000))
print("listening", flush=True)
c, _ = srv.accept()
while c.recv(1 << 16):
    pass
c.sendall(b"k")
"""


def test_hosts_share_only_the_network(lab):
    a, b = lab.host("a"), lab.host("b", shared=True)
    a.path("/tmp/mine").write_text("a's")
    a.path("/dev/shm/mine").write_text("a's")
    a.path("/root/mine").write_text("a's")
    seen = b.run(["sh", "-c", "hostname; ls /tmp /dev/shm /root /mnt; touch /work 2>&1; true"])
    assert seen.stdout.split()[0] == "b"
    assert "mine" not in seen.stdout and "shared" in seen.stdout
    assert "Read-only file system" in seen.stdout  # the image every host boots from
    here = b.run(["ls", str(hosts.CHECKOUT / "tests" / "hosts.py")])
    assert here.returncode == 0, here.stdout
    a_sees = a.run(["ls", hosts.SHARED])
    assert a_sees.returncode != 0, "a did not ask for the shared directory"
    routes = b.run(["ip", "-4", "route"]).stdout
    assert "default" not in routes and routes.count("\n") == 1, routes  # its subnet only
    ok = b.python(f"import socket; socket.create_connection(('{a.address}', 22), 2)")
    assert "ConnectionRefusedError" in ok.stdout  # a's kernel answered: a real network


def test_a_shaped_link_carries_its_rate(lab):
    a, b = lab.host("a"), lab.host("b")
    b.shape(40)
    rates = []
    for _ in range(2):
        server = a.popen([str(hosts.VENV / "bin" / "python"), "-c", RECEIVE])
        assert server.stdout.readline().strip() == "listening"
        sent = b.run(
            [str(hosts.VENV / "bin" / "python"), "-c", SEND, a.address, str(10 * 2**20)],
            timeout=60,
        )
        server.wait(timeout=30)
        rates.append(float(sent.stdout.split()[-1]))
    assert 25 <= max(rates) <= 48, rates  # 40 Mbit/s, less the headers
    before = b.counters()["tx_bytes"]
    assert before >= 2 * 10 * 2**20


def test_a_lost_host_takes_every_process_with_it_and_a_partition_heals(lab):
    a, b = lab.host("a"), lab.host("b")
    sleeper = a.popen(["sh", "-c", "sleep 300 & sleep 300 & echo started; wait"])
    assert sleeper.stdout.readline().strip() == "started"
    mine = [p for p in a.processes() if p != a.init]
    assert len(mine) >= 3, mine
    b.link(False)
    cut = b.python(f"import socket; socket.create_connection(('{a.address}', 22), 2)")
    assert "timed out" in cut.stdout or "unreachable" in cut.stdout.lower(), cut.stdout
    b.link(True)
    # healed: a's kernel refuses the port; b's neighbour entry for a, failed while cut, may
    # say "no route" for a moment first (bounded: 50 tries)
    back = b.python(
        "import socket, time\n"
        "for _ in range(50):\n"
        "    try:\n"
        f"        socket.create_connection(('{a.address}', 22), 2)\n"
        "    except ConnectionRefusedError:\n"
        "        print('ConnectionRefusedError'); break\n"
        "    except OSError as e:\n"
        "        print(e); time.sleep(0.1)\n"
    )
    assert "ConnectionRefusedError" in back.stdout, back.stdout
    a.lose()
    assert a.processes() == []
    sleeper.wait(timeout=10)
    assert b.processes(), "b lives on"
