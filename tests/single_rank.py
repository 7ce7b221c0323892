"""The rendezvous environment of a one-process run, on a free port: GPU test drivers may run side by side
(`pytest -n 4` on the GPU machine), so none of them may take a fixed port."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port the kernel hands out (bind to port 0) may be
    handed out again at once as another process's outgoing connection's, and the rendezvous then fails with
    EADDRINUSE (seen on the GPU machine, 2026-12-03, with four drivers side by side)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(100):
        port = random.randint(20000, low - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in 20000-{low - 1}")


def single_rank_env() -> dict[str, str]:
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}
