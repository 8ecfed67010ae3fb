"""Pickled messages between a Serve replica and its engine process (serve/engine_process.py), over a socket
that only the two of them hold, without blocking either one's event loop."""

import asyncio
import pickle
import select
import socket
import struct
from collections.abc import Callable
from typing import Any


class Channel:
    """Pickled messages over a socket that never block the event loop running it (after ``start``): what the
    peer cannot take yet waits in a buffer, written as the socket drains, and a message that arrives in pieces
    is handed on once whole.

    With blocking sends, a replica whose loop fell behind on the reports (300 requests arriving) let them fill
    the socket while the child waited to send; a burst of submissions then filled it the other way. Each end
    waited for the other to read, and the replica's health check, its requests and the decode loop all stopped.
    """

    HEADER = struct.Struct("!Q")  # the pickle's length

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._unsent = bytearray()
        self._received = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_message: Callable[[Any], None] | None = None
        self._on_closed: Callable[[BaseException], None] | None = None
        self._gone: BaseException | None = None  # why the other end is gone, once it is

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop it sends and receives on since ``start`` (None before, and once closed or gone)."""
        return self._loop

    def send_now(self, message: Any) -> None:
        """Before ``start``: send one message, blocking until it is sent (the start-up exchange)."""
        self.sock.sendall(self._framed(message))

    def receive_now(self, timeout_s: float | None) -> Any | None:
        """Before ``start``: the next message, or None if none began to arrive within ``timeout_s``."""
        if not select.select([self.sock], [], [], timeout_s)[0]:
            return None
        (size,) = self.HEADER.unpack(self._receive_exactly(self.HEADER.size))
        return pickle.loads(self._receive_exactly(size))

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[Any], None],
        on_closed: Callable[[BaseException], None],
    ) -> None:
        """From now on send and receive on ``loop``; each message received goes to ``on_message``; the other end
        gone (or the socket failing) calls ``on_closed`` once."""
        self._stop_watching()
        self.sock.setblocking(False)
        self._loop, self._on_message, self._on_closed = loop, on_message, on_closed
        loop.add_reader(self.sock.fileno(), self._read)
        if self._unsent:
            loop.add_writer(self.sock.fileno(), self._write)

    def send(self, message: Any) -> None:
        """Queue ``message``; the socket takes what it can now, the rest as it drains (nothing, once gone)."""
        if self._gone is not None:
            return
        waiting = bool(self._unsent)
        self._unsent += self._framed(message)
        if not waiting:
            self._write()

    def close(self) -> None:
        self._stop_watching()
        self.sock.close()

    def _framed(self, message: Any) -> bytes:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        return self.HEADER.pack(len(payload)) + payload

    def _receive_exactly(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            piece = self.sock.recv(size - len(data))
            if not piece:
                raise EOFError("the other end closed the channel")
            data += piece
        return bytes(data)

    def _write(self) -> None:
        try:
            sent = self.sock.send(self._unsent)
        except BlockingIOError:
            sent = 0
        except OSError as error:
            self._closed(error)
            return
        del self._unsent[:sent]
        if self._unsent:
            self._loop.add_writer(self.sock.fileno(), self._write)
        else:
            self._loop.remove_writer(self.sock.fileno())

    def _read(self) -> None:
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError as error:
            self._closed(error)
            return
        if not data:
            self._closed(EOFError("the other end closed the channel"))
            return
        self._received += data
        header = self.HEADER.size
        while len(self._received) >= header:
            (size,) = self.HEADER.unpack_from(self._received)
            if len(self._received) < header + size:
                break
            message = pickle.loads(self._received[header : header + size])
            del self._received[: header + size]
            self._on_message(message)

    def _closed(self, error: BaseException) -> None:
        self._gone = error
        self._stop_watching()
        self._on_closed(error)

    def _stop_watching(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.sock.fileno())
            self._loop.remove_writer(self.sock.fileno())
        self._loop = None
