"""Hosts that share nothing but a network, made of Linux namespaces on this machine.

A host is a network namespace (one interface on the lab's bridge, an address from the benchmark
range 198.18.0.0/15, no route anywhere else) plus a mount, PID and UTS namespace of its own:

- its own ``/tmp``, ``/dev/shm``, ``/mnt``, ``/var/tmp`` and home directory (tmpfs), so its Ray
  temp dir, shared-memory files and ``~/.cache`` are its own;
- the rest of the machine's filesystem read-only, the checkout and its virtual environment
  included: the image every host boots from;
- a directory shared at the same path on every host that asks for it (as NFS would be), and
  nothing else shared;
- its link shaped with ``tc tbf`` to a rate the test chooses;
- its processes in a PID namespace whose first process is a small init: killing that init
  SIGKILLs every process of the host at once, as a machine that loses power.

The test process stays outside the hosts (in the machine's own namespaces, where the bridge
has the lab's first address) and runs commands in them through ``nsenter``, as an operator
would over ssh. Its files are reached through ``/proc/<init>/root``.

Everything a lab makes is named with its prefix and removed by :meth:`Lab.close`, which
checks that nothing is left: no namespace, interface, mount or process.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RANGE = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544's benchmark range: never routed
VENV = Path(sys.prefix)
CHECKOUT = Path(__file__).resolve().parents[1]
SHARED = "/mnt/shared"  # where a host that asks for it sees the lab's shared directory
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
TOOLS = ("ip", "tc", "unshare", "nsenter")
SUITE_PREFIX = "rsh"  # every lab's names start with it
SUBNET_LOCK = "/tmp/raysinga-test-labs.lock"  # held while a lab takes its subnet

# The first process of a host: makes its filesystem, then reaps orphans until it is killed.
# Run by the machine's Python (the host's view of it is made before it imports anything more).
INIT = r"""
import ctypes, json, os, signal, socket, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 32, 4096, 16384, 1 << 18)

def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {src} on {dst}: {os.strerror(err)}")

# what the host sees of the machine: opened before anything is covered
binds = [(os.open(src, os.O_PATH), dst, ro) for src, dst, ro in cfg["binds"]]
mount(None, "/", None, MS_REC | MS_PRIVATE)
mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV)
for path, opts in cfg["tmpfs"]:
    mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, opts)
for fd, dst, ro in binds:
    os.makedirs(dst, exist_ok=True)
    mount(f"/proc/self/fd/{fd}", dst, None, MS_BIND | MS_REC)
    if ro:
        mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    os.close(fd)
mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY)
socket.sethostname(cfg["name"])
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)  # only the machine's SIGKILL ends a host
sys.stdout.write("ready\n")
sys.stdout.flush()
os.close(1)
import time
while True:  # reap whatever ends; with nothing to reap, look again in a while
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.5)
"""


def unavailable() -> str | None:
    """Why hosts cannot be made here, or None where they can."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network and mount namespaces)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"emulated hosts need {', '.join(missing)} (iproute2, util-linux)"
    probe = f"{SUITE_PREFIX}probe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot make a network namespace: {r.stderr.strip() or r.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def _tc(*args: str) -> None:
    r = subprocess.run(["tc", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {r.stderr.strip()}")


def _ns_id(pid: int, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return None


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


@dataclass
class Host:
    """One emulated machine of a :class:`Lab`."""

    name: str
    address: str
    netns: str
    port: str  # its link's end on the bridge
    init: int  # the pid of its first process, as the machine sees it
    ns: dict[str, str]  # its namespaces' ids (pid, mnt, net)
    lab: Lab
    env: dict[str, str] = field(default_factory=dict)  # what every command gets
    own_python: str = ""  # a virtual environment of its own (Lab.host's ``python``)
    lost: bool = False

    # ------------------------------------------------------------------ its files
    def path(self, p: str | Path) -> Path:
        """``p`` as this host sees it, reached from the machine."""
        return Path(f"/proc/{self.init}/root") / str(p).lstrip("/")

    # ------------------------------------------------------------------ commands
    def command(self, args: list[str]) -> list[str]:
        """``args`` run inside this host (a new process of its PID namespace)."""
        return [
            "nsenter",
            f"--target={self.init}",
            "--mount",
            "--uts",
            "--net",
            "--pid",
            "--wd=/",
            "--",
            "env",
            "-i",
            *(f"{k}={v}" for k, v in self.env.items()),
            *args,
        ]

    def popen(self, args: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start ``args`` in this host; ``env`` adds to its environment."""
        if self.lost:
            raise RuntimeError(f"host {self.name} is lost")
        extra = [f"{k}={v}" for k, v in (env or {}).items()]
        cmd = self.command(["env", *extra, *args] if extra else args)
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.STDOUT)
        kw.setdefault("text", True)
        return subprocess.Popen(cmd, **kw)

    def run(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        timeout: float = 300,
        check: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run ``args`` in this host to its end, its output captured (stdout and stderr
        together in ``stdout``)."""
        p = self.popen(args, env)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            what = f"{self.name}: {' '.join(args)} ran past {timeout} s:\n{out}"
            raise AssertionError(what) from None
        r = subprocess.CompletedProcess(args, p.returncode, out, "")
        if check and r.returncode != 0:
            raise AssertionError(f"{self.name}: {' '.join(args)} exited {r.returncode}:\n{out}")
        return r

    def python(self, code: str, env: dict[str, str] | None = None, timeout: float = 300):
        """Run Python ``code`` with the image's virtual environment in this host."""
        return self.run([str(VENV / "bin" / "python"), "-c", code], env, timeout)

    # ------------------------------------------------------------------ its processes
    def processes(self) -> list[int]:
        """Its live processes, as the machine numbers them."""
        return [p for p in _pids() if _ns_id(p, "pid") == self.ns["pid"]]

    def pid_of(self, host_pid: int) -> int:
        """The machine's number of the process this host numbers ``host_pid``."""
        for p in self.processes():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{p}/status").read_text().splitlines():
                    if line.startswith("NSpid:") and int(line.split()[-1]) == host_pid:
                        return p
        raise LookupError(f"host {self.name} has no process {host_pid}")

    def kill(self, host_pid: int, sig: int = signal.SIGKILL) -> None:
        """Signal a process this host numbers ``host_pid`` (an actor reports its own pid)."""
        os.kill(self.pid_of(host_pid), sig)

    # ------------------------------------------------------------------ its link
    def link(self, up: bool) -> None:
        """Take this host's link down (a partition: its processes live on) or up again."""
        _ip("link", "set", self.port, "up" if up else "down")

    def lose(self) -> None:
        """The machine is gone at once: every process SIGKILLed and its link down."""
        self.link(False)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.init, signal.SIGKILL)  # the kernel kills the rest of its namespace
        self.lost = True
        deadline = time.monotonic() + 15
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.05)

    def shape(self, mbit: float | None) -> None:
        """Limit its link to ``mbit`` Mbit/s each way (token bucket), or lift the limit."""
        ends = [[], ["-n", self.netns]]
        devs = [self.port, "eth0"]
        for ns, dev in zip(ends, devs, strict=True):
            subprocess.run(["tc", *ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if mbit is not None:
                burst = max(int(mbit * 1e6 / 8 / 250), 16 * 1024)  # 4 ms of the rate
                _tc(*ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                    "burst", str(burst), "latency", "50ms")  # fmt: skip

    def counters(self) -> dict[str, int]:
        """Bytes and packets its interface has sent and received."""
        stats = Path(f"/sys/class/net/{self.port}/statistics")
        # the bridge end's counters, reversed: what the bridge end receives, the host sent
        return {
            "tx_bytes": int((stats / "rx_bytes").read_text()),
            "rx_bytes": int((stats / "tx_bytes").read_text()),
        }

    # ------------------------------------------------------------------ Ray on it
    def ray_start(
        self,
        cpus: int,
        head: Host | None = None,
        object_store_mb: int = 256,
        *more: str,
        env: dict[str, str] | None = None,
    ) -> None:
        """``ray start`` on this host, as a user starts it: the head of a cluster (``head``
        None) or a node joining ``head``; ``env`` adds to its environment (and so to every
        process of Ray's there). Ray's token is copied from the head's home, as a user copies
        it to each machine."""
        ray_cli = [self.own_python, "-c", "from ray.scripts.scripts import main; main()"]
        ray = ray_cli if self.own_python else [str(VENV / "bin" / "ray")]
        common = [
            f"--node-ip-address={self.address}",
            f"--num-cpus={cpus}",
            f"--object-store-memory={object_store_mb * 2**20}",
            "--disable-usage-stats",
            *more,
        ]
        if head is None:
            self.run([*ray, "get-auth-token", "--generate"], check=True)
            args = [*ray, "start", "--head", "--port=6379", "--dashboard-host=0.0.0.0", *common]
        else:
            token = head.path("/root/.ray/auth_token")
            if token.exists():
                self.path("/root/.ray").mkdir(exist_ok=True)
                shutil.copyfile(token, self.path("/root/.ray/auth_token"))
            args = [*ray, "start", f"--address={head.address}:6379", *common]
        self.run(args, env=env, timeout=180, check=True)


# What picks the numeric libraries' kernels on this machine (OPENBLAS_CORETYPE: OpenBLAS's
# kernels for another CPU than the one it detects; NPY_DISABLE_CPU_FEATURES: NumPy's). The hosts
# are this machine's CPUs, and the tests hold their runs bit for bit to runs on this machine:
# they must compute with the same kernels (OpenBLAS's Haswell and SkylakeX kernels sum a
# product's terms in different orders).
KERNEL_CHOICE = ("OPENBLAS_", "GOTO_", "MKL_", "NPY_")


def kernel_choice() -> dict[str, str]:
    """This machine's environment variables that choose its numeric kernels
    (:data:`KERNEL_CHOICE`), for the hosts' environment."""
    return {k: v for k, v in os.environ.items() if k.startswith(KERNEL_CHOICE)}


class Lab:
    """Emulated hosts on one bridge, and what they share: removed whole by :meth:`close`."""

    def __init__(self, root: Path) -> None:
        self.root = root  # a directory of the machine's for what the lab keeps outside hosts
        self.id = f"{SUITE_PREFIX}{os.getpid() % 1000:03d}{int(time.time() * 1000) % 1000:03d}"
        self.bridge = f"{self.id}br"
        self.hosts: list[Host] = []
        self.shared = root / "shared"
        self._seen_ns: set[str] = set()
        self._unshare: list[subprocess.Popen] = []
        self._servers: list[subprocess.Popen] = []
        LAB_IDS.add(self.id)
        # another test session of this machine may make a lab meanwhile (CI runs two): the
        # subnet is chosen and taken under a lock, so no two bridges share one
        with open(SUBNET_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.net = self._free_subnet()
            self.gateway = str(self.net.network_address + 1)  # the machine's end of the bridge
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/{self.net.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        """A /24 of the benchmark range that no interface of the machine uses."""
        used = _ip("-4", "-o", "addr", "show").stdout
        for net in RANGE.subnets(new_prefix=24):
            if f" {net.network_address + 1}/" not in used:
                return net
        raise RuntimeError("every /24 of 198.18.0.0/15 is in use")

    def host(
        self,
        name: str,
        shared: bool = False,
        mbit: float | None = None,
        python: str | None = None,
    ) -> Host:
        """A new host named ``name``; ``shared``: it sees the lab's shared directory at
        ``SHARED``; ``mbit``: its link's rate; ``python``: the Python of a virtual environment
        of the machine's, its own (seen at the same path, first on its ``PATH``, and the one
        its Ray starts from), instead of the checkout's."""
        i = len(self.hosts) + 2
        netns, port = f"{self.id}-{name}", f"{self.id}v{i}"
        address = str(self.net.network_address + i)
        _ip("netns", "add", netns)
        _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("link", "set", port, "master", self.bridge, "up")
        _ip("-n", netns, "addr", "add", f"{address}/{self.net.prefixlen}", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        home = os.path.expanduser("~")
        own = Path(python).parents[1] if python else None
        images = sorted({str(VENV), sys.base_prefix, str(CHECKOUT), *([str(own)] if own else [])})
        binds = [(p, p, True) for p in images]
        if shared:
            self.shared.mkdir(parents=True, exist_ok=True)
            binds.append((str(self.shared), SHARED, False))
        cfg = {
            "name": name,
            "tmpfs": [
                ("/tmp", "mode=1777,size=4g"),
                ("/var/tmp", "mode=1777,size=256m"),
                ("/dev/shm", "mode=1777,size=2g"),
                ("/mnt", "mode=755"),
                (home, "mode=700"),
            ],
            "binds": binds,
        }
        p = subprocess.Popen(
            ["ip", "netns", "exec", netns, "unshare", "--mount", "--uts", "--pid", "--fork",
             "--propagation", "private", sys.executable, "-S", "-c", INIT, json.dumps(cfg)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        self._unshare.append(p)
        ready = p.stdout.readline() if p.stdout else ""
        if ready.strip() != "ready":
            p.kill()
            raise RuntimeError(f"host {name} did not start: {p.stderr.read() if p.stderr else ''}")
        init = self._child_of(p.pid)
        ns = {k: _ns_id(init, k) or "" for k in ("pid", "mnt", "net")}
        self._seen_ns.update(ns.values())
        ALL_NAMESPACES.update(ns.values())
        env = {
            "HOME": home,
            "PATH": f"{own or VENV}/bin:{SYSTEM_PATH}",
            "LANG": "C.UTF-8",
            "RAY_AUTH_MODE": "token",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_enable_metrics_collection": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
            **kernel_choice(),
        }
        h = Host(name, address, netns, port, init, ns, self, env, python or "")
        self.hosts.append(h)
        if mbit is not None:
            h.shape(mbit)
        return h

    @staticmethod
    def _child_of(pid: int) -> int:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                if kids:
                    return int(kids[0])
            time.sleep(0.01)
        raise RuntimeError(f"unshare {pid} started no init")

    # ------------------------------------------------------------------ services
    def s3(self, host: Host, port: int = 9000) -> str:
        """An S3 server (moto's server mode) on ``host``; returns its endpoint ``ip:port``."""
        p = host.popen(
            [str(VENV / "bin" / "python"), "-m", "moto.server", "-H", "0.0.0.0", "-p", str(port)],
            stdout=subprocess.DEVNULL,
        )
        self._servers.append(p)
        endpoint = f"{host.address}:{port}"
        deadline = time.monotonic() + 60
        import socket  # noqa: PLC0415

        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection((host.address, port), 1):
                return endpoint
            time.sleep(0.2)
        raise RuntimeError(f"moto's S3 server on {host.name} did not answer in 60 s")

    # ------------------------------------------------------------------ the end
    def close(self) -> list[str]:
        """Remove every host, interface and namespace of the lab; returns what is left of it
        (empty where nothing is)."""
        for h in self.hosts:
            with contextlib.suppress(ProcessLookupError):
                os.kill(h.init, signal.SIGKILL)
        for p in [*self._unshare, *self._servers]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=15)
        for h in self.hosts:  # a veth pair goes whole with either end, at once
            _ip("link", "del", h.port, check=False)
            _ip("netns", "del", h.netns, check=False)
        _ip("link", "del", self.bridge, check=False)
        deadline = time.monotonic() + 15
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def leftovers(self) -> list[str]:
        """What of this lab is still there: namespaces, interfaces, processes in its
        namespaces (its mounts live in those and go with them)."""
        return leftovers(self.id, self._seen_ns)


def leftovers(
    prefix: str | tuple[str, ...] = SUITE_PREFIX, namespaces: set[str] | None = None
) -> list[str]:
    """Network namespaces and interfaces named with ``prefix`` (or any of several), and
    processes in any of ``namespaces`` (as ``/proc/PID/ns/*`` name them: ``pid:[id]``), as
    found on the machine now."""
    left = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        if line.split() and line.split()[0].startswith(prefix):
            left.append(f"network namespace {line.split()[0]}")
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(prefix):
            left.append(f"interface {name}")
    for pid in _pids() if namespaces else []:
        ids = {_ns_id(pid, k) for k in ("pid", "mnt", "net")}
        if ids & namespaces:  # type: ignore[operator]
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:80]
                left.append(f"process {pid} ({cmd.decode(errors='replace').strip()})")
    return left


def ray_cluster(
    lab: Lab,
    cpus: list[int],
    shared: bool = True,
    python: str | None = None,
    env: dict[str, str] | None = None,
) -> list[Host]:
    """Hosts ``h1``, ``h2``, ... with Ray started on each as a user starts it: ``h1`` the
    head, each with the CPUs ``cpus`` gives it; ``shared``: each sees the lab's shared
    directory; ``python``: the other hosts' own Python (:meth:`Lab.host`); ``env``: added to
    every ``ray start``'s environment. Returns once every node has joined."""
    made = [
        lab.host(f"h{i + 1}", shared=shared, python=python if i else None) for i in range(len(cpus))
    ]
    made[0].ray_start(cpus[0], env=env)
    for h, n in zip(made[1:], cpus[1:], strict=True):
        h.ray_start(n, head=made[0], env=env)
    wait_nodes(made[0], len(made))
    return made


def wait_nodes(head: Host, n: int, timeout: float = 60) -> None:
    """Until the cluster of ``head`` counts ``n`` live nodes."""
    code = (
        "import ray, time\n"
        f"ray.init(address='{head.address}:6379', log_to_driver=False)\n"
        f"t = time.monotonic() + {timeout}\n"
        f"while len([x for x in ray.nodes() if x['Alive']]) != {n} and time.monotonic() < t:\n"
        "    time.sleep(0.2)\n"
        "print(len([x for x in ray.nodes() if x['Alive']]))\n"
    )
    r = head.python(code, timeout=timeout + 60)
    assert r.returncode == 0 and last_json(r.stdout) == n, r.stdout


def wait_joined(head: Host, host: Host, timeout: float = 120) -> None:
    """Until ``host`` is a live node of the cluster of ``head``, whatever else its count (a
    host lost earlier stays counted alive until Ray's health checks give it up)."""
    code = (
        "import ray, time\n"
        f"ray.init(address='{head.address}:6379', log_to_driver=False)\n"
        f"t = time.monotonic() + {timeout}\n"
        "def joined():\n"
        f"    return any(x['Alive'] and x['NodeManagerAddress'] == '{host.address}'"
        " for x in ray.nodes())\n"
        "while not joined() and time.monotonic() < t:\n"
        "    time.sleep(0.2)\n"
        "print(int(joined()))\n"
    )
    r = head.python(code, timeout=timeout + 60)
    assert r.returncode == 0 and last_json(r.stdout) == 1, r.stdout


def sigkill_role(among: list[Host], role: dict[str, Any]) -> None:
    """SIGKILL a role that :func:`placed_roles` listed, inside its host."""
    host = next(h for h in among if h.name == role["host"])
    host.run(["kill", "-9", str(role["pid"])], check=True)


def placed_roles(head: Host, among: list[Host]) -> list[dict[str, Any]]:
    """The live actors in a placement group on ``among``, as Ray's state API on the head lists
    them: a run's roles as placed, without the spares that wait outside the group (on a
    standby host too) until one takes over. Each: ``host`` (its name), ``cls`` and ``pid`` (as
    its host sees it)."""
    code = (
        "import json, ray\n"
        "from ray.util.state import list_actors\n"
        f"ray.init(address='{head.address}:6379', log_to_driver=False)\n"
        "ips = {n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes()}\n"
        "acts = list_actors(filters=[('state', '=', 'ALIVE')], limit=1000, detail=True)\n"
        "acts = [a for a in acts if a.placement_group_id]\n"
        "print(json.dumps([(ips.get(a.node_id), a.class_name, a.pid) for a in acts]))\n"
    )
    r = head.python(code, timeout=120)
    assert r.returncode == 0, r.stdout
    names = {h.address: h.name for h in among}
    return [
        {"host": names[ip], "cls": cls, "pid": pid}
        for ip, cls, pid in last_json(r.stdout)
        if ip in names
    ]


def last_json(text: str) -> Any:
    """The last line of a process's output that is a JSON document: what a driver printed
    last, where Ray's own log lines (its C++ core writes them to stderr, at any time, a
    worker's error pushed on its way out among them) may follow it."""
    for line in reversed(text.strip().splitlines()):
        with contextlib.suppress(ValueError):
            return json.loads(line)
    raise AssertionError(f"no JSON line in: {text}")


def roles_by_host(head: Host, among: list[Host]) -> dict[str, list[str]]:
    """The classes of the roles on each of ``among`` (by host name): :func:`placed_roles`."""
    out: dict[str, list[str]] = {h.name: [] for h in among}
    for role in placed_roles(head, among):
        out[role["host"]].append(role["cls"])
    return out


# ---------------------------------------------------------------------- a driver on the head
# A test whose driver must act at an instant of the run (a hook of the trainer's) runs that
# driver on the head host (:func:`drive`); where it loses or adds a machine, it asks the lab,
# which lives outside the hosts, through its own stdout and stdin (:class:`RemoteCluster`).
REQUEST = "@lab "


def drive(made: list[Host], fn: Any, *args: Any, timeout: float = 900):
    """Run ``fn(*args)`` (a module-level function of a test module; its arguments JSON) in a
    Python on ``made[0]``, the head, answering its :class:`RemoteCluster` requests: a host
    lost (marked lost in ``made``), a new one started with ``ray start`` (appended to
    ``made``), or the hosts' interface counters. Returns the finished process, its output in
    ``stdout``; it is killed at ``timeout``."""
    import inspect  # noqa: PLC0415
    import threading  # noqa: PLC0415

    head = made[0]
    where = [str(CHECKOUT / "tests"), str(Path(inspect.getfile(fn)).parent)]
    code = (
        "import importlib, json, sys\n"
        f"sys.path[:0] = {json.dumps(where)}\n"
        f"fn = getattr(importlib.import_module({fn.__module__!r}), {fn.__name__!r})\n"
        "fn(*json.loads(sys.argv[1]))\n"
    )
    argv = [str(VENV / "bin" / "python"), "-c", code, json.dumps(args)]
    p = head.popen(
        argv, env={"PYTHONUNBUFFERED": "1"}, stdin=subprocess.PIPE, start_new_session=True
    )
    expired = threading.Event()

    def expire() -> None:  # nsenter and the driver it forked in the host: one process group
        expired.set()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, expire)
    timer.start()
    out: list[str] = []
    try:
        assert p.stdout is not None and p.stdin is not None
        for line in p.stdout:
            if not line.startswith(REQUEST):
                out.append(line)
                continue
            try:
                reply = "ok " + _carry_out(json.loads(line[len(REQUEST) :]), made)
            except Exception as e:  # noqa: BLE001 - the driver raises it
                reply = f"error {type(e).__name__}: {e}".replace("\n", " ")
            p.stdin.write(reply + "\n")
            p.stdin.flush()
        p.wait()
    finally:
        timer.cancel()
        if p.poll() is None:  # the test failed while it ran
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    text = "".join(out)
    if expired.is_set():
        text += f"\n[the driver was killed at the {timeout} s limit]"
    return subprocess.CompletedProcess(argv, p.returncode, text, "")


def _carry_out(request: dict[str, Any], made: list[Host]) -> str:
    head = made[0]
    if request["op"] == "lose":
        (host,) = [h for h in made if h.address == request["address"] and not h.lost]
        host.lose()
        return host.address
    if request["op"] == "add":
        host = head.lab.host(f"h{len(made) + 1}", shared=True)
        resources = request.get("resources")
        more = [f"--resources={json.dumps(resources)}"] if resources else []
        host.ray_start(request["cpus"], head, 256, *more)
        made.append(host)
        return host.address
    if request["op"] == "counters":
        return json.dumps({h.address: h.counters() for h in made if not h.lost})
    raise ValueError(f"no such request: {request}")


@dataclass
class RemoteNode:
    """A node as :class:`RemoteCluster` lists it (what tests and raysinga's chaos read of a
    ``ray.cluster_utils`` node)."""

    node_id: str
    address: str
    cpus: int

    @property
    def _ray_params(self) -> Any:
        import types  # noqa: PLC0415

        return types.SimpleNamespace(num_cpus=self.cpus)


class RemoteCluster:
    """In a driver started by :func:`drive`: the calls of ``ray.cluster_utils.Cluster`` that
    the tests and raysinga's chaos make, carried out by the lab outside the hosts. Removing a
    node loses its host whole (every process SIGKILLed, its link down); adding one starts a
    new host with ``ray start``. Ray must be initialized."""

    def __init__(self) -> None:
        import threading  # noqa: PLC0415

        self._lock = threading.Lock()  # one request at a time, from any thread

    def _ask(self, request: dict[str, Any]) -> str:
        with self._lock:
            sys.stdout.write(REQUEST + json.dumps(request) + "\n")
            sys.stdout.flush()
            reply = sys.stdin.readline().strip()
        if not reply.startswith("ok "):
            raise RuntimeError(f"the lab could not {request['op']}: {reply or 'no answer'}")
        return reply[3:]

    @staticmethod
    def _nodes() -> list[RemoteNode]:
        import ray  # noqa: PLC0415

        return [
            RemoteNode(n["NodeID"], n["NodeManagerAddress"], int(n["Resources"].get("CPU", 0)))
            for n in ray.nodes()
            if n["Alive"] and "node:__internal_head__" not in n["Resources"]
        ]

    @property
    def worker_nodes(self) -> list[RemoteNode]:
        """The live nodes but the head."""
        return self._nodes()

    def remove_node(self, node: RemoteNode, allow_graceful: bool = False) -> None:
        self._ask({"op": "lose", "address": node.address})

    def add_node(self, num_cpus: int = 1, resources: dict[str, float] | None = None, **_):
        """A new host of ``num_cpus`` CPUs (and ``resources``), once Ray counts it alive."""
        address = self._ask({"op": "add", "cpus": num_cpus, "resources": resources})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found = [n for n in self._nodes() if n.address == address]
            if found:
                return found[0]
            time.sleep(0.2)
        raise RuntimeError(f"the node started on {address} did not join in 60 s")

    def wait_for_nodes(self) -> None:
        """Nothing to wait for: :meth:`add_node` returns once its node has joined."""

    def counters(self) -> dict[str, dict[str, int]]:
        """Each live host's interface counters (:meth:`Host.counters`), by address."""
        return json.loads(self._ask({"op": "counters"}))


ALL_NAMESPACES: set[str] = set()  # of every lab of this process: the session's last check
LAB_IDS: set[str] = set()  # the prefixes of this process's labs (another session's are its own)


@contextlib.contextmanager
def lab(root: Path):
    """A :class:`Lab` removed at the end, failing if anything of it is left."""
    made = Lab(root)
    try:
        yield made
    finally:
        left = made.close()
        assert not left, f"the lab left: {left}"
