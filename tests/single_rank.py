"""The rendezvous environment of a one-process run, on a free port: GPU test drivers may run side by side
(`pytest -n 4` on the GPU machine), so none of them may take a fixed port."""

from __future__ import annotations

import socket


def single_rank_env() -> dict[str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
