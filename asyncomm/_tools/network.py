"""Emulated hosts on one machine: network namespaces joined by a switch, links shaped by ``tc``.

``with Network(2, rate="1gbit") as net: net.run(1, ["python", "x.py"])``; docs/several-hosts.md
("Emulated hosts") says what they are for. Each host is a network namespace with its own
address (10.R.S.k on one /24, ``R.S`` drawn per network so that networks made at once never
collide), its own hostname (``host1`` ... ``hostK``, set in a UTS namespace of its own by
``command``) and its own ``/etc/hosts``, in which -- as on many real machines -- its own
name resolves to 127.0.0.1. A bridge in a switch namespace joins the hosts' links. ``rate``
limits what each host sends (``tbf`` on its link); ``delay`` needs ``netem``, and where the
kernel lacks it making the network fails with a ``ValueError`` (no delay is ever silently
dropped).

Note on MPI
-----------
The hosts share one kernel: MPICH's default network module (UCX) moves data between them
through shared memory, so next to nothing would cross the emulated link, and UCX's own tcp
transport (``UCX_TLS=tcp``) hangs connecting between emulated hosts. Ranks on emulated hosts
therefore use MPICH's OFI module with its tcp provider (``MPI_OVER_THE_LINK``).

Needs root, ``ip`` (iproute2), ``tc`` and ``unshare``: ``missing()`` says what is lacking,
and ``Network`` raises ``PermissionError`` then.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

_NETNS_ETC = Path("/etc/netns")  # ``ip netns exec`` mounts NAME/hosts here over /etc/hosts

INTERFACE = "eth0"  # each host's link, as its namespace names it
# MPI between emulated hosts: see the note on MPI.
MPI_OVER_THE_LINK = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}


def missing() -> str | None:
    """Say what this machine lacks for emulated hosts, or ``None`` if nothing."""
    if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "emulated hosts need root (network namespaces)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"emulated hosts need {tool!r} (Debian: iproute2, util-linux)"
    return None


def _sh(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


class Network:
    """``count`` hosts on one switch; see the module's note."""

    def __init__(self, count: int, rate: str | None = None, delay: str | None = None) -> None:
        if not 1 <= count <= 250:  # each host is one address of the network's /24
            raise ValueError(f"a network has 1 to 250 hosts, not {count}")
        self.count, self.rate, self.delay = count, rate, delay
        tag = int.from_bytes(os.urandom(3), "big") >> 4  # not ``random``: tests reseed it alike
        self._id = f"ac{tag:05x}"  # ≤ 7 characters: interface names have 15 at most
        self.subnet = f"10.{100 + tag % 150}.{tag // 150 % 256}"
        self.names = [f"host{k + 1}" for k in range(count)]
        self.addresses = [f"{self.subnet}.{k + 1}" for k in range(count)]
        self.namespaces = [f"{self._id}h{k + 1}" for k in range(count)]
        self._switch = f"{self._id}sw"
        self._made: list[str] = []  # namespaces made, for teardown

    def __enter__(self) -> Network:
        reason = missing()
        if reason is not None:
            raise PermissionError(reason)
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _make(self) -> None:
        _sh("ip", "netns", "add", self._switch)
        self._made.append(self._switch)
        _sh("ip", "-n", self._switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self._switch, "link", "set", "br0", "up")
        for k, (ns, address) in enumerate(zip(self.namespaces, self.addresses, strict=True)):
            _sh("ip", "netns", "add", ns)
            self._made.append(ns)
            inside, outside = f"{self._id}e{k}", f"{self._id}p{k}"
            _sh("ip", "link", "add", inside, "type", "veth", "peer", "name", outside)
            _sh("ip", "link", "set", inside, "netns", ns)
            _sh("ip", "link", "set", outside, "netns", self._switch)
            _sh("ip", "-n", ns, "link", "set", inside, "name", INTERFACE)
            _sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", INTERFACE)
            for up in (("-n", ns, "link", "set", INTERFACE, "up"),
                       ("-n", ns, "link", "set", "lo", "up"),
                       ("-n", self._switch, "link", "set", outside, "master", "br0"),
                       ("-n", self._switch, "link", "set", outside, "up")):
                _sh("ip", *up)
            self._shape(ns)
            self._hosts_file(ns, k)

    def _shape(self, ns: str) -> None:
        if self.delay is not None:
            qdisc = ["netem", "delay", self.delay]
            if self.rate is not None:
                qdisc += ["rate", self.rate]
        elif self.rate is not None:
            qdisc = ["tbf", "rate", self.rate, "burst", "256kb", "latency", "50ms"]
        else:
            return
        try:
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", INTERFACE, "root", *qdisc)
        except RuntimeError as exc:
            raise ValueError(f"delay {self.delay}: this kernel has no netem ({exc}); only "
                             "--rate (tbf) can be emulated here" if self.delay is not None
                             else f"rate {self.rate}: {exc}") from None

    def _hosts_file(self, ns: str, k: int) -> None:
        folder = _NETNS_ETC / ns
        folder.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost", f"127.0.0.1 {self.names[k]}",  # as many machines do
                 f"{self.addresses[k]} {self.names[k]}-eth0"]  # what its address is called
        lines += [f"{a} {n}" for j, (a, n) in enumerate(zip(self.addresses, self.names,
                                                              strict=True)) if j != k]
        (folder / "hosts").write_text("\n".join(lines) + "\n")

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """Return ``argv`` as run on host ``host`` (0-based): its namespace and hostname."""
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "sh", "-c",
                f'hostname {self.names[host]} && exec "$@"', "sh", *argv]

    def run(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on host ``host``; ``kwargs`` go to ``subprocess.Popen``."""
        return subprocess.Popen(self.command(host, argv), **kwargs)

    def ssh_stand_in(self, folder: Path) -> Path:
        """Write an ``ssh`` stand-in that runs a command on the host of an address or name.

        For launchers that reach hosts through ssh (``mpiexec -launcher ssh
        -launcher-exec PATH``): called as ``PATH [options] HOST COMMAND...``.
        """
        cases = "\n".join(f"  {a}|{n}) ns={ns}; name={n};;" for a, n, ns in zip(
            self.addresses, self.names, self.namespaces, strict=True))
        script = folder / f"{self._id}-ssh"
        script.write_text(f"""#!/bin/sh
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case $host in
{cases}
  *) echo "no emulated host $host" >&2; exit 255;;
esac
exec ip netns exec "$ns" unshare --uts sh -c "hostname $name && $*"
""")
        script.chmod(0o755)
        return script

    def close(self) -> None:
        """Stop what runs on the hosts and remove them (idempotent)."""
        for ns in reversed(self._made):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                  check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
            shutil.rmtree(_NETNS_ETC / ns, ignore_errors=True)
        self._made.clear()
