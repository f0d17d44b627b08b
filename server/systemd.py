"""sd_notify(3) without libsystemd: readiness, stopping, status and the watchdog.

    deepinfer process ──datagram "READY=1" / "WATCHDOG=1" / ...──▶ $NOTIFY_SOCKET ──▶ systemd

Producer: the three long-running commands (serve, coordinator, node), on their event loop.
Consumer: systemd, for units with ``Type=notify`` (deploy/systemd/). Outside systemd
(``$NOTIFY_SOCKET`` unset) every call is a no-op that returns False, so the commands call these
unconditionally.

The watchdog pings come from a task on the event loop: a loop that is blocked, or an engine that
no longer turns, stops them, and systemd restarts the unit after ``WatchdogSec``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable

logger = logging.getLogger(__name__)

# A send blocks only while systemd's receive queue is full; bounded, so that a wedged manager
# cannot stall the event loop for long (a lost WATCHDOG=1 is resent half an interval later).
_SEND_TIMEOUT_S = 1.0


def notify(state: str) -> bool:
    """Send ``state`` (newline-separated ``KEY=value`` lines) to ``$NOTIFY_SOCKET``.

    True when the datagram was sent; False when not under systemd or the send failed (logged).
    """
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # Linux abstract namespace
    elif not address.startswith("/"):
        logger.warning("sd_notify: unsupported NOTIFY_SOCKET %r (not a unix socket)", address)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(_SEND_TIMEOUT_S)
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as e:
        logger.warning("sd_notify %r to %r failed: %s", state, address, e)
        return False
    return True


def ready() -> bool:
    """Startup is complete: weights loaded and the HTTP site listening."""
    return notify("READY=1")


def stopping() -> bool:
    """The drain began; systemd counts TimeoutStopSec from the stop request."""
    return notify("STOPPING=1")


def status(text: str) -> bool:
    """One line for ``systemctl status`` (newlines would start new KEY=value assignments)."""
    return notify("STATUS=" + " ".join(text.splitlines()))


def watchdog_interval() -> float | None:
    """``WatchdogSec`` in seconds when systemd expects pings from this process, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    try:
        if pid and int(pid) != os.getpid():
            return None  # meant for another process (we were started by the main one)
        interval_s = int(usec) / 1e6
    except ValueError:
        logger.warning("sd_notify: ignoring WATCHDOG_USEC=%r WATCHDOG_PID=%r", usec, pid)
        return None
    return interval_s if interval_s > 0 else None


async def watchdog_loop(is_healthy: Callable[[], bool]) -> None:
    """Send ``WATCHDOG=1`` every interval/2 while ``is_healthy()``; returns at once when systemd
    has no watchdog for this process. While unhealthy it sends nothing, so that systemd kills
    and restarts the unit once ``WatchdogSec`` has passed since the last ping."""
    interval_s = watchdog_interval()
    if interval_s is None:
        return
    was_healthy = True
    while True:
        try:
            is_ok = is_healthy()
        except Exception:
            logger.exception("watchdog: the health check raised; treating it as unhealthy")
            is_ok = False
        if is_ok:
            notify("WATCHDOG=1")
            if not was_healthy:
                logger.warning("watchdog: healthy again; pinging systemd again")
        elif was_healthy:
            logger.error(
                "watchdog: unhealthy; pings withheld, systemd restarts the unit within %.0f s",
                interval_s,
            )
        was_healthy = is_ok
        await asyncio.sleep(interval_s / 2)


@contextlib.asynccontextmanager
async def watchdog(is_healthy: Callable[[], bool]) -> AsyncIterator[None]:
    """Run ``watchdog_loop(is_healthy)`` as a task for the span of the ``async with``."""
    task = asyncio.create_task(watchdog_loop(is_healthy), name="deepinfer-sd-watchdog")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
