"""``transport.streams.until_closed``: what a lingering stream reads after its answer, and when it stops."""

from __future__ import annotations

import asyncio

from echo_p2p.transport.streams import until_closed


def feed(data: bytes, eof: bool) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


async def linger(reader: asyncio.StreamReader, limit: int) -> list[int]:
    charged: list[int] = []
    await asyncio.wait_for(until_closed(reader, limit, charged.append), timeout=2.0)
    return charged


async def test_a_caller_that_wrote_exactly_the_limit_is_waited_for_until_it_closes():
    """The lost-ack flake of fresh-clone run 39 (2026-12-03): a refused sender that wrote 64 KiB after a
    frame header, exactly the trainer's linger floor, then waited for its ack. The stream stopped reading at
    the limit without waiting for the sender's close, the trainer closed its end with the sender's still
    open, and p2pd's reset could overtake the ack. Now it reads on to the close (one more read at the limit)."""
    reader = feed(b"x" * 1000, eof=False)
    charged: list[int] = []
    task = asyncio.create_task(until_closed(reader, 1000, charged.append))
    await asyncio.sleep(0.05)
    assert not task.done() and sum(charged) == 1000  # the limit read, the close not yet seen
    reader.feed_eof()
    await asyncio.wait_for(task, timeout=2.0)
    assert sum(charged) == 1000 and reader.at_eof()


async def test_a_caller_that_writes_on_costs_one_byte_more_than_the_limit():
    reader = feed(b"x" * 5000, eof=False)
    assert sum(await linger(reader, 1000)) == 1001 and not reader.at_eof()


async def test_a_caller_that_closes_below_the_limit_is_read_to_its_end():
    reader = feed(b"x" * 10, eof=True)
    assert sum(await linger(reader, 1000)) == 10 and reader.at_eof()
