"""Who listens where: TCP stores bound to the one address they are reached at, the local address
that reaches a server, and which process holds a port.

torch's ``TCPStore`` server listens on every interface whatever ``host_name`` it is given (the name
is only what clients dial). :class:`BoundTCPStore` hands it a socket already bound to that name's
address instead (``master_listen_fd``), so a store reached at 127.0.0.1 listens on loopback only and
one reached at a node's name listens on that node's interface only. It is what the weight-update
group hosts (:mod:`sglang_bridge.weight_sync.update_group`), what the trainer's default group hosts
without torchrun, what ``python -m launch.torchrun`` puts under torchrun's stores, and (through the
``bound_stores`` hook of :mod:`sglang_bridge.cpu_compat`) what an SGLang server's own TP group hosts.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
import urllib.parse
from pathlib import Path

import torch.distributed as dist

WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})
"""Bind addresses that mean every interface."""


def is_loopback(host: str) -> bool:
    """True when ``host`` names this machine's loopback interface (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_address(host: str) -> tuple[socket.AddressFamily, str]:
    """(family, address) a listener reached at ``host`` binds: that name's own address (IPv4 first).

    A wildcard stays a wildcard. A name that is not a loopback name but resolves to a loopback
    address here (Debian's ``127.0.1.1 <hostname>`` line in /etc/hosts) is bound on every interface:
    other nodes resolve the same name to the node's real address, which a loopback bind would refuse.
    """
    if host in WILDCARDS:
        return socket.AF_INET, "0.0.0.0"
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    family, addr = infos[0][0], str(infos[0][4][0])
    if ipaddress.ip_address(addr).is_loopback and not is_loopback(host):
        return socket.AF_INET, "0.0.0.0"
    return family, addr


def listen_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on ``host``'s address (:func:`bind_address`); ``port`` 0: the OS picks."""
    family, addr = bind_address(host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class BoundTCPStore(dist.TCPStore):
    """A ``torch.distributed.TCPStore`` whose server listens on ``host_name``'s address only.

    Same arguments as ``TCPStore``. As a client (``is_master=False``), or given its own
    ``master_listen_fd``, it is a plain ``TCPStore``. A multi-tenant master whose port this process
    already serves joins that server, as ``TCPStore`` does.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
    ):
        if is_master and master_listen_fd is None:
            try:
                sock = listen_socket(host_name, port)
            except OSError:
                if not multi_tenant or not port:
                    raise
                # Another tenant of this process may hold the port: TCPStore reuses its server.
            else:
                port = sock.getsockname()[1]
                master_listen_fd = sock.detach()  # the store's server owns (and closes) it from here
        super().__init__(
            host_name,
            port,
            world_size,
            is_master,
            timeout,
            wait_for_workers,
            multi_tenant,
            master_listen_fd,
            use_libuv,
        )


def address_towards(url: str) -> str:
    """The address of this machine's interface that reaches ``url``'s host (no packet is sent):
    127.0.0.1 for a server on loopback, the node's address on the servers' network otherwise. A store
    the servers must dial is hosted, and bound, there."""
    host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
    if is_loopback(host):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP connect only picks the route
        return str(s.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds the IPv4 ``address`` (``eth0``), or
    None when none does (another machine's address, a name, IPv6, or not Linux)."""
    try:
        want = socket.inet_aton(address)
    except OSError:
        return None
    try:
        import fcntl
        import struct
    except ImportError:  # pragma: no cover - not a POSIX system
        return None
    siocgifaddr = 0x8915  # <linux/sockios.h>: an interface's IPv4 address
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):  # an interface without an IPv4 address
                req = struct.pack("256s", name.encode()[:15])
                if fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24] == want:
                    return name
    return None


def port_is_free(host: str, port: int) -> bool:
    """True when a listener could bind ``port`` on ``host``'s address right now."""
    try:
        listen_socket(host, port, backlog=1).close()
    except OSError:
        return False
    return True


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP ``port`` (any address, IPv4 and IPv6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                    found.add(f[9])
    return found


def port_holder(port: int) -> str:
    """Who listens on TCP ``port``: ``pid N (command line)``, or why it cannot be told."""
    inodes = {f"socket:[{i}]" for i in _listening_inodes(port)}
    if not inodes:
        return "no process (nothing listens on it now)"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                        return f"pid {pid} ({cmd.strip()[:200]})"
    return "a process of another user (its pid is not visible to this one)"


__all__ = [
    "BoundTCPStore",
    "WILDCARDS",
    "address_towards",
    "bind_address",
    "is_loopback",
    "listen_socket",
    "port_holder",
    "port_is_free",
]
