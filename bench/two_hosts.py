"""Two fake "hosts" on one Linux machine, for the multi-node tests and bench.goodput.

    with TwoHosts() as h:                       # root only; see available()
        p = h.popen(1, [sys.executable, "-c", "import socket; print(socket.gethostname())"],
                    stdout=subprocess.PIPE, text=True)
        p.communicate(timeout=30)               # -> "node1"

Each host is a network namespace (``ip netns add``) holding one end of a veth pair
(host 0 = 192.168.77.1/24, host 1 = 192.168.77.2/24, loopback up), and every command run on a
host also gets its own UTS namespace with that host's hostname (node0 / node1), so
``socket.gethostname()`` answers like on a real node. The filesystem is shared (like NFS); the
PID namespace is shared too, so the test process sees, waits for and signals the processes.

Name resolution inside a host is set per namespace with ``ip netns exec``'s /etc/netns/<ns>/
mechanism (hosts, resolv.conf, nsswitch.conf bind-mounted over /etc; the real /etc is never
touched) and chosen by ``resolve=``:

  "loopback" (default) -- the real failure mode: the host's /etc/hosts says
                ``127.0.1.1 <hostname>`` (Debian's installer default), so the hostname resolves
                to a loopback address, not to the veth address. gloo without
                GLOO_SOCKET_IFNAME binds 127.0.1.1 and the peer cannot reach it.
  "none"      -- the hostname does not resolve at all (gaierror); gloo falls back to 127.0.0.1.
  "veth"      -- a correctly configured cluster: both hostnames map to their veth addresses.

In every mode DNS is cut off (``hosts: files``, nameserver 127.0.0.1 inside the namespace), so
no lookup ever leaves the machine; the namespaces have no route anywhere but 192.168.77.0/24.

Names are unique per instance (``ae2h-<pid>-<hex>-<i>`` for namespaces, ``ae<hex>h<i>`` for the
veth ends, <= 15 chars), and the veth ends are created directly inside the namespaces, so
parallel test runs cannot collide even though all use the same addresses. ``cleanup_stale()``
removes what a killed test process (one that never reached ``__exit__``) left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import time

__all__ = ["NS_PREFIX", "TwoHosts", "available", "cleanup_stale"]

NS_PREFIX = "ae2h"
_NETNS_ETC = "/etc/netns"
_CMD_TIMEOUT = 20  # seconds, for every `ip`/`tc` call this module makes
# Runs inside the new UTS namespace: set the hostname, then become the command (same pid).
_SET_HOSTNAME = 'echo "$1" > /proc/sys/kernel/hostname || exit 125; shift; exec "$@"'


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=_CMD_TIMEOUT, check=check
    )


def available() -> tuple[bool, str]:
    """Whether TwoHosts can work here, and why not (for ``pytest.skip``).

    Checks root, ``ip`` and ``unshare`` on PATH, a writable /etc (for /etc/netns), and then
    really creates and deletes one namespace plus a UTS namespace (containers often forbid it)."""
    if os.name != "posix" or not os.path.isdir("/proc/self/ns"):
        return False, "needs Linux namespaces (/proc/self/ns missing)"
    if os.geteuid() != 0:
        return False, "needs root (ip netns / unshare --uts)"
    for tool in ("ip", "unshare", "sh"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found on PATH"
    if not os.access("/etc", os.W_OK):
        return False, "/etc is not writable (needed for /etc/netns/<ns>/hosts)"
    probe = f"{NS_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-probe"
    try:
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            return False, f"`ip netns add` failed: {r.stderr.strip()}"
        r = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                probe,
                "unshare",
                "--uts",
                "sh",
                "-c",
                _SET_HOSTNAME,
                "sh",
                "probe",
                "true",
            ],
            capture_output=True,
            text=True,
            timeout=_CMD_TIMEOUT,
        )
        if r.returncode != 0:
            return False, f"`ip netns exec ... unshare --uts` failed: {r.stderr.strip()}"
        r = _ip(
            "-n",
            probe,
            "link",
            "add",
            "aeprobe0",
            "type",
            "veth",
            "peer",
            "name",
            "aeprobe1",
            check=False,
        )
        if r.returncode != 0:
            return False, f"cannot create a veth pair: {r.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"namespace probe failed: {e}"
    finally:
        _ip("netns", "del", probe, check=False)
    return True, "ok"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ns_pids(ns: str) -> list[int]:
    r = _ip("netns", "pids", ns, check=False)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


def _kill_ns(ns: str, deadline_s: float = 10.0) -> list[int]:
    """SIGKILL every process in network namespace `ns` until none is left (bounded)."""
    killed: list[int] = []
    end = time.monotonic() + deadline_s
    while True:
        pids = [p for p in _ns_pids(ns) if p != os.getpid()]
        if not pids:
            return killed
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                killed.append(p)
            except ProcessLookupError:
                pass
        if time.monotonic() > end:
            raise RuntimeError(f"processes still in netns {ns} after {deadline_s}s: {pids}")
        time.sleep(0.05)


def _remove_ns(ns: str) -> None:
    if os.path.exists(f"/run/netns/{ns}"):
        _kill_ns(ns)
        _ip("netns", "del", ns, check=False)
    shutil.rmtree(os.path.join(_NETNS_ETC, ns), ignore_errors=True)
    with contextlib.suppress(OSError):  # only if empty: /etc/netns was not there before
        os.rmdir(_NETNS_ETC)


def cleanup_stale() -> list[str]:
    """Delete namespaces (and their /etc/netns dirs) left by TwoHosts instances whose creating
    process is gone. Returns the names removed."""
    names = set()
    for d in ("/run/netns", _NETNS_ETC):
        if os.path.isdir(d):
            names.update(os.listdir(d))
    removed = []
    for name in sorted(names):
        m = re.fullmatch(rf"{NS_PREFIX}-(\d+)-[0-9a-f]+-(\d|probe)", name)
        if m and not _pid_alive(int(m.group(1))):
            _remove_ns(name)
            removed.append(name)
    return removed


class TwoHosts:
    """Two network namespaces joined by a veth pair; see the module docstring."""

    def __init__(
        self,
        hostnames: tuple[str, str] = ("node0", "node1"),
        addrs: tuple[str, str] = ("192.168.77.1", "192.168.77.2"),
        prefixlen: int = 24,
        resolve: str = "loopback",
    ):
        if resolve not in ("loopback", "none", "veth"):
            raise ValueError(f"resolve must be 'loopback', 'none' or 'veth', not {resolve!r}")
        self.tag = secrets.token_hex(3)  # 6 hex chars
        self.hostnames = tuple(hostnames)
        self.addrs = tuple(addrs)
        self.prefixlen = prefixlen
        self.resolve = resolve
        self.namespaces = tuple(f"{NS_PREFIX}-{os.getpid()}-{self.tag}-{i}" for i in (0, 1))
        self.ifnames = tuple(f"ae{self.tag}h{i}" for i in (0, 1))  # 10 chars
        self._procs: list[subprocess.Popen] = []
        self._up = False

    # -- setup / teardown -------------------------------------------------------------------
    def _hosts_file(self, i: int) -> str:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        if self.resolve == "loopback":
            lines.append(f"127.0.1.1\t{self.hostnames[i]}")
        elif self.resolve == "veth":
            lines += [f"{a}\t{h}" for a, h in zip(self.addrs, self.hostnames, strict=True)]
        return "\n".join(lines) + "\n"

    def __enter__(self) -> TwoHosts:
        try:
            for i, ns in enumerate(self.namespaces):
                etc = os.path.join(_NETNS_ETC, ns)
                for _ in range(5):  # another instance may rmdir an empty /etc/netns meanwhile
                    try:
                        os.makedirs(etc)
                        break
                    except FileNotFoundError:
                        time.sleep(0.01)
                else:
                    os.makedirs(etc)
                with open(os.path.join(etc, "hosts"), "w") as f:
                    f.write(self._hosts_file(i))
                with open(os.path.join(etc, "resolv.conf"), "w") as f:
                    f.write("nameserver 127.0.0.1\n")  # in-namespace loopback: nothing leaves
                with open(os.path.join(etc, "nsswitch.conf"), "w") as f:
                    f.write(
                        "passwd: files\ngroup: files\nshadow: files\nhosts: files\n"
                        "networks: files\nprotocols: files\nservices: files\n"
                    )
                _ip("netns", "add", ns)
            ns0, ns1 = self.namespaces
            if0, if1 = self.ifnames
            # Created straight inside the namespaces: never visible (or colliding) in the root ns.
            _ip("-n", ns0, "link", "add", if0, "type", "veth", "peer", "name", if1, "netns", ns1)
            for i, ns in enumerate(self.namespaces):
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip(
                    "-n",
                    ns,
                    "addr",
                    "add",
                    f"{self.addrs[i]}/{self.prefixlen}",
                    "dev",
                    self.ifnames[i],
                )
                _ip("-n", ns, "link", "set", self.ifnames[i], "up")
            self._up = True
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill everything on both hosts, delete the namespaces (and with them the veth pair)
        and the /etc/netns dirs. Safe to call twice and after a half-done __enter__."""
        errors = []
        for ns in self.namespaces:
            try:
                _remove_ns(ns)
            except Exception as e:  # keep tearing down the other one
                errors.append(f"{ns}: {e}")
        for p in self._procs:  # reap (they were SIGKILLed above if still in a namespace)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    errors.append(f"pid {p.pid} did not exit")
        self._up = False
        if errors:
            raise RuntimeError("TwoHosts teardown: " + "; ".join(errors))

    # -- running things on a host -----------------------------------------------------------
    def argv(self, i: int, argv: list[str]) -> list[str]:
        """The argv that runs `argv` on host `i` (its netns, own UTS ns with its hostname).
        The wrappers exec, so the pid of the resulting process is the command's pid."""
        return [
            "ip",
            "netns",
            "exec",
            self.namespaces[i],
            "unshare",
            "--uts",
            "sh",
            "-c",
            _SET_HOSTNAME,
            "sh",
            self.hostnames[i],
            *map(str, argv),
        ]

    def popen(self, i: int, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """subprocess.Popen of `argv` on host `i`; popen_kwargs go to Popen (env, cwd, stdout...).
        Killed and reaped by kill_host(i) / close()."""
        p = subprocess.Popen(self.argv(i, argv), **popen_kwargs)
        self._procs.append(p)
        return p

    def run(
        self, i: int, argv: list[str], timeout: float = 60, **kw
    ) -> subprocess.CompletedProcess:
        """subprocess.run on host `i` with a mandatory timeout (text output captured by default)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(i, argv), timeout=timeout, **kw)

    def pids(self, i: int) -> list[int]:
        """Pids of the live processes on host `i` (``ip netns pids``)."""
        return _ns_pids(self.namespaces[i])

    def kill_host(self, i: int) -> list[int]:
        """SIGKILL every process on host `i` (a node dying); returns the pids killed. Our own
        Popen objects on that host are reaped."""
        killed = _kill_ns(self.namespaces[i])
        for p in self._procs:
            if p.pid in killed:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
        return killed

    # -- the network ------------------------------------------------------------------------
    def link_down(self, i: int) -> None:
        """Take host i's veth end administratively down. On host i the 192.168.77.0/24 route
        goes away (new connects: ENETUNREACH at once); the other host sees NO-CARRIER and its
        packets are dropped silently. Established TCP connections stall, not error."""
        _ip("-n", self.namespaces[i], "link", "set", self.ifnames[i], "down")

    def link_up(self, i: int) -> None:
        _ip("-n", self.namespaces[i], "link", "set", self.ifnames[i], "up")

    def blackhole(self, i: int, on: bool = True) -> None:
        """Silently drop everything host i sends to the other host, links staying UP and routes
        intact: a partition where both sides see only timeouts (no ENETUNREACH / EHOSTUNREACH).
        Done by pinning the peer's ARP entry on host i to a MAC nobody has (the peer's veth
        drops the frames as not addressed to it); tc netem is not in every kernel (not here).
        Call on both hosts for a symmetric partition; on=False restores (ARP relearns)."""
        ns, dev, peer = self.namespaces[i], self.ifnames[i], self.addrs[1 - i]
        if on:
            _ip(
                "-n",
                ns,
                "neigh",
                "replace",
                peer,
                "lladdr",
                "02:00:00:00:de:ad",
                "dev",
                dev,
                "nud",
                "permanent",
            )
        else:
            _ip("-n", ns, "neigh", "del", peer, "dev", dev, check=False)

    def __repr__(self) -> str:
        return (
            f"TwoHosts(namespaces={self.namespaces}, ifnames={self.ifnames}, addrs={self.addrs}, "
            f"hostnames={self.hostnames}, resolve={self.resolve!r}, up={self._up})"
        )
