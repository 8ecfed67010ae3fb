"""serve/channel.py: messages between a replica and its engine process that neither end waits to send."""

import asyncio
import socket

import pytest

from serve.channel import Channel

pytestmark = pytest.mark.unit


def test_both_ends_sending_more_than_the_socket_holds_get_every_message_whole_and_in_order():
    """Each end sends ~8 MB before either reads: with blocking sends each would wait for the other forever."""
    ends = {name: Channel(sock) for name, sock in zip("ab", socket.socketpair(), strict=True)}
    big = b"x" * 4_000_000
    received: dict[str, list] = {"a": [], "b": []}

    async def run() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def receiver(name: str):
            def on_message(message) -> None:
                received[name].append(message)
                if all(len(got) == 2 for got in received.values()):
                    done.set_result(None)

            return on_message

        for name, end in ends.items():
            end.start(loop, receiver(name), done.set_exception)
        for n in range(2):
            ends["a"].send(("from a", n, big))
            ends["b"].send(("from b", n, big))
        await asyncio.wait_for(done, 30)

    asyncio.run(run())
    assert [(who, n, data == big) for who, n, data in received["a"]] == [("from b", 0, True), ("from b", 1, True)]
    assert [(who, n, data == big) for who, n, data in received["b"]] == [("from a", 0, True), ("from a", 1, True)]
    for end in ends.values():
        end.close()


def test_the_other_end_gone_is_said_once_and_later_messages_are_dropped():
    ours, theirs = (Channel(sock) for sock in socket.socketpair())
    closed: list[BaseException] = []

    async def run() -> None:
        ours.start(asyncio.get_running_loop(), print, closed.append)
        theirs.close()
        while not closed:
            await asyncio.sleep(0.01)
        ours.send("after")  # no error: the replica fails its requests through its own check

    asyncio.run(run())
    assert len(closed) == 1 and isinstance(closed[0], EOFError)
    ours.close()
