"""What the security tests read off the live system: process trees, their command lines, their
listening sockets, and files that hold a secret or are readable by others."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from pathlib import Path


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant (by parent pid)."""
    parent: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent[int(pid)] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    tree, frontier = [root], [root]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier]
        tree += kids
        frontier = kids
    return tree


def cmdlines_holding(secret: str, pids: list[int]) -> dict[int, str]:
    """The processes among ``pids`` whose command line contains ``secret``."""
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if secret.encode() in cmd:
                found[pid] = cmd.replace(b"\0", b" ").decode(errors="replace")
    return found


def environs_holding(secret: str, pids: list[int]) -> list[int]:
    """The processes among ``pids`` whose environment contains ``secret``."""
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if secret.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(pid)
    return found


def _addr(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # /proc prints 4 host-order words
    return socket.inet_ntop(socket.AF_INET6, words)


def listeners(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state held by ``pids``."""
    by_inode: dict[str, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":
                addr, port = f[1].rsplit(":", 1)
                by_inode[f"socket:[{f[9]}]"] = (_addr(addr), int(port, 16))
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    hit = by_inode.get(os.readlink(f"/proc/{pid}/fd/{fd}"))
                    if hit:
                        found.append((pid, *hit))
    return found


def not_on_loopback(pids: list[int]) -> list[tuple[int, str, int]]:
    """The listeners of ``pids`` reachable from beyond this machine."""
    return [(p, a, port) for p, a, port in listeners(pids) if not ipaddress.ip_address(a).is_loopback]


def files_holding(secret: str, root: Path) -> list[Path]:
    """Files under ``root`` whose bytes contain ``secret``."""
    needle = secret.encode()
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and needle in p.read_bytes()]


def open_to_others(root: Path) -> list[tuple[Path, str]]:
    """Paths under (and including) ``root`` with any group or other permission bit."""
    modes = {p: p.lstat().st_mode for p in [root, *root.rglob("*")] if not p.is_symlink()}
    return [(p, oct(m & 0o777)) for p, m in modes.items() if m & 0o077]
