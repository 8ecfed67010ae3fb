"""A run is owned: ``<run>/lease.json`` names the driver training it, renewed by a heartbeat.

A second driver with the same run name (a job submitted twice) is refused while the lease is fresh, so
two runs never write, or prune, each other's checkpoints. A lease is taken over when its owner is gone:
no heartbeat for ``stale_after_s``, or a process on this host that no longer exists (a driver that was
killed outright, then resubmitted; on a Ray cluster job drivers run on the head, so this is the common
case and needs no wait).

Object storage offers no create-if-absent through pyarrow, so taking a lease is write-then-read-back:
two drivers starting within the same fraction of a second could both see themselves win until the
next heartbeat, where the loser finds another owner's token and stops its run.
"""

import os
import signal
import socket
import sys
import threading
import time
import uuid

from train import storage
from train.schema import ConfigError, Section, error_reason, read_record

LEASE = "lease.json"


class RunOwnedError(RuntimeError):
    """Another live driver holds the run's lease."""


class Owner(Section):
    """The driver that holds a lease, as ``lease.json`` records it."""

    host: str
    pid: int
    token: str  # unique per driver: what tells a lease of ours from a lease taken over
    heartbeat: float  # time.time() of the last renewal

    def describe(self, now: float) -> str:
        return f"pid {self.pid} on {self.host}, last heartbeat {now - self.heartbeat:.0f} s ago"

    def is_gone(self, now: float, stale_after_s: float) -> bool:
        """No heartbeat for ``stale_after_s``, or a process of this host that has exited."""
        if now - self.heartbeat > stale_after_s:
            return True
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False


class Lease:
    """Hold ``<run_uri>/lease.json`` while training: ``with Lease(run_uri, stale_after_s): ...``.

    A heartbeat thread renews it every ``stale_after_s / 5`` s; if it finds the lease taken over (this
    driver was stale, e.g. paused), it interrupts the main thread, which stops the run like Ctrl-C. A
    renewal that fails (storage unreachable) is retried at the next beat: four in a row may fail before
    the lease goes stale, and only a lease found in another's hands stops the run.
    """

    def __init__(self, run_uri: str, stale_after_s: float):
        self.uri = storage.join(run_uri, LEASE)
        self.stale_after_s = stale_after_s
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def _me(self) -> Owner:
        return Owner(host=socket.gethostname(), pid=os.getpid(), token=self.token, heartbeat=time.time())

    def holder(self) -> Owner | None:
        """The lease's owner; None where there is no lease. ConfigError naming the file where it is not a lease."""
        try:
            return read_record(Owner, self.uri, "a lease")
        except ConfigError as unreadable:  # no driver can tell whether it is held: none takes it over
            raise ConfigError(f"{unreadable}; if no driver is training this run, delete it") from None

    def acquire(self) -> None:
        """Take the lease, or raise RunOwnedError naming the live owner."""
        now = time.time()
        holder = self.holder()
        if holder is not None and holder.token != self.token and not holder.is_gone(now, self.stale_after_s):
            raise RunOwnedError(self._owned_message(holder, now))
        if holder is not None and holder.token != self.token:
            print(f"taking over the run from a driver that is gone ({holder.describe(now)})", file=sys.stderr)
        try:
            storage.write_json(self.uri, self._me().model_dump())
        except OSError as exc:  # the run's first write: a directory that cannot be made, credentials that only read
            raise ConfigError(f"run.storage_path: cannot write {self.uri}: {error_reason(exc)}") from None
        holder = self.holder()
        if holder is None or holder.token != self.token:  # another driver wrote in between: it wins
            raise RunOwnedError(self._owned_message(holder, now) if holder else f"{self.uri} vanished")

    def _owned_message(self, holder: Owner, now: float) -> str:
        return (
            f"run {os.path.dirname(self.uri)} is being trained by another driver ({holder.describe(now)}); "
            f"use another run.name, or wait: a lease without heartbeat for run.lease_stale_after_s "
            f"({self.stale_after_s:.0f} s) is taken over"
        )

    def _renew_until_stopped(self) -> None:
        while not self._stop.wait(self.stale_after_s / 5):
            try:
                holder = self.holder()
                if holder is not None and holder.token == self.token:
                    storage.write_json(self.uri, self._me().model_dump())
                    continue
            except (OSError, ConfigError) as exc:  # unreadable, none can take it over: it stays this driver's
                print(f"warning: could not renew the lease {self.uri} (retried next beat): {exc}", file=sys.stderr)
                continue
            taker = holder.describe(time.time()) if holder else "none: the lease file was deleted"
            print(f"error: this driver lost the lease of its run to another ({taker}); stopping", file=sys.stderr)
            # As Ctrl-C would; where SIGINT has no Python handler (a script's background job starts with it
            # ignored), as SIGTERM, which python -m train takes as Ctrl-C.
            ctrl_c = signal.SIGINT if callable(signal.getsignal(signal.SIGINT)) else signal.SIGTERM
            signal.pthread_kill(threading.main_thread().ident, ctrl_c)
            return

    def release(self) -> None:
        """Stop the heartbeat and delete the lease, if it is still ours (where storage cannot be reached, the
        lease is left to go stale: a later driver on this host takes it over at once)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        try:
            holder = self.holder()
            if holder is not None and holder.token == self.token:
                storage.delete_file(self.uri)
        except (OSError, ConfigError) as exc:
            print(f"warning: could not release the lease {self.uri}: {exc}", file=sys.stderr)

    def __enter__(self) -> "Lease":
        self.acquire()
        self._heartbeat = threading.Thread(target=self._renew_until_stopped, name="raywright-lease", daemon=True)
        self._heartbeat.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
