"""A TCP port for a rendezvous (``MASTER_PORT``) on this host, picked before the process that listens on it starts.

A port the kernel numbers itself (``bind`` to port 0) comes from its ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), the range it also numbers every outgoing connection and every other
``bind(0)`` from: gloo's pair listeners, the TCP store's clients. Between the pick and the listener's bind (the imports
of torch and DeepSpeed: seconds, tens of them on a loaded host) another job's gloo can take it, and the rendezvous fails
with EADDRINUSE. So the port is drawn at random below that range, where only ports asked for by number go, and
checked free. A port another job holds already is one error naming it and ``--master_port`` (:class:`PortInUse`)."""
import os
import random
import socket

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
# How many ports below the ephemeral range are drawn from (the range starts at 32768 by default: 20768-32767).
SPAN = 12_000
LOWEST = 1024  # below it, ports are privileged


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open(EPHEMERAL_RANGE) as range_file:
            return int(range_file.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def rendezvous_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port that binds on ``host`` now, below the kernel's ephemeral range when there is room for one there (else
    one the kernel picks)."""
    top = ephemeral_start()
    low = max(LOWEST, top - SPAN)
    draw = random.SystemRandom()
    if top > low:
        for _ in range(tries):
            port = draw.randrange(low, top)
            if _bindable(port, host):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class PortInUse(RuntimeError):
    """The rendezvous port is held by another process; the message names it and the flag that picks another."""


def explain_port_in_use(error: BaseException) -> BaseException:
    """``error`` from starting the process group, or, when it says the rendezvous port is taken (torch's
    ``DistNetworkError`` with ``EADDRINUSE``: another job on this host listens there, typically a second job
    started with the launchers' default port 29500), a :class:`PortInUse` naming the port and ``--master_port``."""
    text = str(error)
    if "EADDRINUSE" not in text and "address already in use" not in text.lower():
        return error
    port, host, free = os.environ.get("MASTER_PORT", "?"), os.environ.get("MASTER_ADDR", "this host"), rendezvous_port()
    return PortInUse(f"port {port} on {host} (MASTER_PORT) is in use by another process, most likely another job's "
                     f"rendezvous (the deepspeed launcher and torchrun both default to 29500): start this job with "
                     f"another port, e.g. deepspeed --master_port {free} ... or torchrun --master_port {free} ...")
