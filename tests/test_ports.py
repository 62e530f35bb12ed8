"""The rendezvous port the tests and the single-process job pick: free, and below the kernel's ephemeral range (where
gloo's pair listeners and every outgoing connection take their ports: one of them took a port picked from that
range while the job that was to listen on it still imported, and its rendezvous failed with EADDRINUSE)."""
import socket

import pytest

from ds_pseudo_real import ports

pytestmark = pytest.mark.no_ops  # builds no DeepSpeed engine: never waits for its C++ ops


def test_the_port_is_free_and_below_the_ephemeral_range():
    start = ports.ephemeral_start()
    picked = {ports.rendezvous_port() for _ in range(20)}
    assert all(max(ports.LOWEST, start - ports.SPAN) <= port < start for port in picked), (picked, start)
    assert len(picked) > 1  # drawn at random: two jobs starting together do not take the same one
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", picked.pop()))


def test_a_port_taken_below_the_range_is_not_picked(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        # a range of one port, the taken one: nothing below the ephemeral range is free, the kernel picks one
        monkeypatch.setattr(ports, "ephemeral_start", lambda: port + 1)
        monkeypatch.setattr(ports, "SPAN", 1)
        assert ports.rendezvous_port(tries=5) != port


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_start", lambda: ports.LOWEST)
    port = ports.rendezvous_port()
    assert port >= ports.LOWEST
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
