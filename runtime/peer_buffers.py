"""Device memory that every tensor-parallel rank reads: one buffer per rank, mapped by all.

Each rank allocates its buffer with the CUDA driver and exports it (`runtime.cuda_driver`);
the ranks exchange their offers over a control channel (`gather`: every rank's object, in
rank order, as gloo's `all_gather_object` returns them); each rank maps its peers' buffers;
and the ranks exchange once more whether that worked. Every rank decides from the same
gathered lists, so either all ranks hold every buffer or none does: a rank left alone with the
custom all-reduce would wait for its peers forever.

A rank that cannot take part (no kernel for its GPU in the engine, an allocation or a mapping
that fails) says why in its offer; the group then goes without, and `open_peer_buffers` returns
that reason naming the rank. Offers no Kiln rank would make (another size, a handle of the
wrong length: rank files from different builds) are an error.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kiln.runtime import cuda_driver
from kiln.runtime.cuda_driver import CudaError

HANDLE_BYTES = 64  # a CUipcMemHandle

Gather = Callable[[object], list]


class PeerBufferError(RuntimeError):
    """The ranks' offers do not fit together; the message names the rank."""


@dataclass(frozen=True)
class Offer:
    """What one rank brings to the exchange: its buffer's handle and size, or why it has none."""

    nbytes: int
    handle: bytes | None = None
    problem: str | None = None


def agree(offers: list[Offer], nbytes: int) -> str | None:
    """None when every rank offers a buffer of `nbytes`, else why the group goes without; the
    same on every rank, since every rank sees the same offers."""
    for rank, offer in enumerate(offers):
        if offer.problem is None and offer.nbytes != nbytes:
            raise PeerBufferError(f"tensor-parallel rank {rank} shares a buffer of {offer.nbytes} bytes, this rank "
                                  f"one of {nbytes}: the engine folder mixes builds; rebuild it into an empty folder")
        if offer.problem is None and (offer.handle is None or len(offer.handle) != HANDLE_BYTES):
            raise PeerBufferError(f"tensor-parallel rank {rank} offered no valid memory handle "
                                  f"({0 if offer.handle is None else len(offer.handle)} bytes, not {HANDLE_BYTES})")
    return _reasons([offer.problem for offer in offers])


def _reasons(problems: list[str | None]) -> str | None:
    """Every rank's problem, named by rank; None when no rank has one."""
    return "; ".join(f"rank {rank}: {p}" for rank, p in enumerate(problems) if p is not None) or None


@dataclass
class PeerBuffers:
    """Every rank's buffer as mapped in this process (`bases[rank]` is this rank's own)."""

    bases: list[int]
    rank: int
    gather: Gather

    def close(self) -> None:
        """Unmap the peers' buffers and free this rank's once every rank is done with them: the
        caller has waited for its own GPU work, and `gather` waits for every rank's caller."""
        self.gather(None)
        _release(self.bases, self.rank)
        self.bases = []


def open_peer_buffers(nbytes: int, rank: int, gather: Gather, problem: str | None = None) -> PeerBuffers | str:
    """Every rank's buffer of `nbytes`, mapped here; or, when some rank cannot take part (this
    one because of `problem`, or a driver call that fails), the reason, the same on every rank."""
    own = None
    if problem is None:
        try:
            own = cuda_driver.alloc_shared(nbytes)
            offer = Offer(nbytes, handle=cuda_driver.ipc_handle(own))
        except CudaError as e:
            offer = Offer(nbytes, problem=str(e))
    else:
        offer = Offer(nbytes, problem=problem)
    offers = gather(offer)
    try:
        reason = agree(offers, nbytes)
    except PeerBufferError:
        _release([own], 0)
        raise
    if reason is not None:
        _release([own], 0)
        return reason
    bases, problem = _map_peers(offers, rank, own)
    reason = _reasons(gather(problem))
    if reason is not None:
        _release(bases, rank)
        return reason
    return PeerBuffers(bases, rank, gather)


def _map_peers(offers: list[Offer], rank: int, own: int) -> tuple[list[int | None], str | None]:
    """Every rank's buffer mapped here (None where mapping failed or was not tried), and the
    first failure."""
    bases: list[int | None] = [None] * len(offers)
    bases[rank] = own
    for peer, offer in enumerate(offers):
        if peer != rank:
            try:
                bases[peer] = cuda_driver.open_ipc_handle(offer.handle)
            except CudaError as e:
                return bases, f"mapping rank {peer}'s buffer: {e}"
    return bases, None


def _release(bases: list[int | None], rank: int) -> None:
    """Unmap the peers' buffers in `bases` and free this rank's (`bases[rank]`); None is skipped."""
    for peer, base in enumerate(bases):
        if base is not None:
            (cuda_driver.free_shared if peer == rank else cuda_driver.close_ipc_handle)(base)
