"""How a client reaches the data plane: the transport choice, checked in one place for every client
(TrajectoryClient, sigmaflight.Client). Imports nothing heavy: `sigmaflight status` uses it."""

from __future__ import annotations

from typing import Literal

__all__ = ["Transport", "check_transport"]

Transport = Literal["auto", "flight"]
""""auto": read a finished rollout's same-host file when the server offers one this host can open,
else stream; "flight": always stream over gRPC."""


def check_transport(transport: str) -> Transport:
    """``transport`` itself when it is "auto" or "flight"; ValueError naming it otherwise."""
    if transport not in ("auto", "flight"):
        raise ValueError(f"transport must be 'auto' or 'flight', got {transport!r}")
    return transport  # type: ignore[return-value]
