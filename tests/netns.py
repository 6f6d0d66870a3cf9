"""Two network hosts on one Linux machine: network namespaces joined by a veth pair.

A multi-node job (``torchrun --nnodes 2`` on each host, c10d rendezvous) runs for real on one
machine when each "node" is a network namespace with its own interface and address and the
only way between them is one veth link: every byte one host sends the other crosses that link
and shows in its counters (:func:`link_bytes`), and ``tc`` can slow it to an inter-node
bandwidth (:func:`limit_rate`). Needs root (``CAP_NET_ADMIN``) and iproute2;
:func:`why_no_namespaces` says why not where they are missing (a test then skips).

    with two_hosts() as (a, b):
        a.popen([...torchrun... "--node-rank", "0"])   # runs inside host a's namespace
        ...
        tx, rx = link_bytes(a)

Namespaces and links get names unique to the process (prefix ``vzmn``) and are removed on
exit, failure included, after the processes still running in them are killed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

__all__ = ["Host", "link_bytes", "limit_rate", "two_hosts", "why_no_namespaces"]

PREFIX = "vzmn"
_serial = itertools.count()


@dataclass(frozen=True)
class Host:
    """One namespaced host: its namespace, its end of the veth link and that end's address."""

    netns: str
    ifname: str
    address: str

    def command(self, argv: Sequence[str]) -> List[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(self, argv: Sequence[str], env: Optional[Dict[str, str]] = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` in this host, in a session of its own (so that it and its children
        can be killed together), with ``GLOO_SOCKET_IFNAME`` set to this host's link."""
        full_env = dict(os.environ if env is None else env, GLOO_SOCKET_IFNAME=self.ifname)
        return subprocess.Popen(self.command(argv), env=full_env, start_new_session=True, **kwargs)


def _ip(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)


def _checked(*args: str) -> str:
    done = _ip(*args)
    if done.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def why_no_namespaces() -> Optional[str]:
    """``None`` where network namespaces and veth links can be made here, else the reason."""
    name = f"{PREFIX}{os.getpid()}p{next(_serial)}"
    try:
        made = _ip("netns", "add", name)
    except FileNotFoundError:
        return "iproute2's `ip` is not installed"
    except subprocess.TimeoutExpired:
        return "`ip netns add` did not answer within 20 s"
    if made.returncode:
        return f"cannot create a network namespace (`ip netns add`: {made.stderr.strip()}); needs root/CAP_NET_ADMIN"
    try:
        veth = _ip("-n", name, "link", "add", "vzmnpa", "type", "veth", "peer", "name", "vzmnpb")
        if veth.returncode:
            return f"cannot create a veth pair (`ip link add ... type veth`: {veth.stderr.strip()})"
        return None
    finally:
        _ip("netns", "del", name)


def _kill_inside(netns: str) -> None:
    """SIGKILL every process still running in ``netns`` (the job this module started there)."""
    pids = _ip("netns", "pids", netns).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


@contextlib.contextmanager
def two_hosts(subnet: str = "10.77.0") -> Iterator[Tuple[Host, Host]]:
    """Two namespaces ``subnet.1`` and ``subnet.2`` (/24) joined by one veth pair; removed on exit.

    The addresses exist only inside the two namespaces, so they never meet the machine's own.
    """
    tag = f"{os.getpid()}x{next(_serial)}"
    # Interface names live only inside the private namespaces: they cannot collide.
    a = Host(f"{PREFIX}{tag}a", f"{PREFIX}a", f"{subnet}.1")
    b = Host(f"{PREFIX}{tag}b", f"{PREFIX}b", f"{subnet}.2")
    made: List[str] = []
    try:
        for host in (a, b):
            _checked("netns", "add", host.netns)
            made.append(host.netns)
        # Create the pair inside host a, then move its peer: no name ever lives in the root namespace.
        _checked("-n", a.netns, "link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname)
        _checked("-n", a.netns, "link", "set", b.ifname, "netns", b.netns)
        for host in (a, b):
            _checked("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.ifname)
            _checked("-n", host.netns, "link", "set", host.ifname, "up")
            _checked("-n", host.netns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for netns in made:
            _kill_inside(netns)
            _ip("netns", "del", netns)  # removes the veth pair with it


def link_bytes(host: Host) -> Tuple[int, int]:
    """``(sent, received)`` bytes so far on ``host``'s end of the link (the interface counters)."""
    stats = json.loads(_checked("-n", host.netns, "-j", "-s", "link", "show", "dev", host.ifname))[0]["stats64"]
    return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])


def limit_rate(hosts: Sequence[Host], rate: str, burst: str = "256kb", latency: str = "50ms") -> None:
    """Shape each host's outgoing side of the link to ``rate`` (``tc`` units, e.g. ``1gbit``,
    ``200mbit``) with a token bucket filter; ``rate="none"`` removes the limit."""
    for host in hosts:
        if rate == "none":
            subprocess.run(["ip", "netns", "exec", host.netns, "tc", "qdisc", "del", "dev", host.ifname, "root"],
                           capture_output=True, timeout=20)
            continue
        done = subprocess.run(["ip", "netns", "exec", host.netns, "tc", "qdisc", "replace", "dev", host.ifname,
                               "root", "tbf", "rate", rate, "burst", burst, "latency", latency],
                              capture_output=True, text=True, timeout=20)
        if done.returncode:
            raise RuntimeError(f"tc could not limit {host.ifname} to {rate}: {done.stderr.strip()}")
