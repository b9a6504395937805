"""Free TCP ports for rendezvous (torch.distributed's store, test clusters)."""

from __future__ import annotations

import random
import socket


def free_port(*, count: int = 1, host: str = "127.0.0.1") -> int:
    """A port P such that P .. P+count-1 are all free on `host` ("" = every interface).

    Picked from 20000-29999, below Linux's ephemeral range (32768 up): a port handed out here
    cannot meanwhile be taken by an outgoing connection (gloo opens many), which a port the
    kernel picks (bind to 0) can.
    """
    for _ in range(200):
        base = random.randrange(20000, 30000 - count + 1)
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind((host, port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} free TCP port(s) found in 20000-29999 on {host or 'any interface'}")
