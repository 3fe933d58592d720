"""Failed-auth throttling: :class:`AuthFailureThrottle` counts missing or wrong API keys per
client (its address, see :func:`client_address`) and, after ``max_failures`` of them within
``window_s``, answers that client's next wrong keys with 429 (sliding window log).

It throttles failures only. The gate looks at the key first: a valid key is never throttled,
whatever others behind the same address (a load balancer, an ingress controller, a NAT) sent,
and a valid key from an address clears that address's count. So the throttle does not stop a
guesser who can tell a 200 from a 429: what defends against guessing is the keys' strength
(long random keys; ``secrets.token_urlsafe(32)``). What it does bound is the rate of wrong keys
one client may make the server check and log.

The client's address is the connection's peer, or, when the peer is one of the configured
trusted proxies (``forwarded_allow_ips``: addresses or CIDRs), the rightmost address of
``X-Forwarded-For`` that is not a trusted proxy (the rule of uvicorn's ``--forwarded-allow-ips``
and nginx's ``real_ip_recursive``): a client can prepend whatever it likes to that header, but
not what the proxies it passed through appended.
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class TrustedProxies:
    """The proxies whose ``X-Forwarded-For`` is believed: addresses and CIDRs (``10.0.0.0/8``,
    ``::1``); ``*`` trusts every peer (only where nothing but the proxy can reach the server).

    Raises:
        ValueError: an entry that is neither an address nor a network.
    """

    def __init__(self, entries: Iterable[str] = ()):
        self.any = False
        self.networks: list[_Network] = []
        for e in entries:
            e = e.strip()
            if not e:
                continue
            if e == "*":
                self.any = True
                continue
            try:
                self.networks.append(ipaddress.ip_network(e, strict=False))
            except ValueError:
                raise ValueError(f"forwarded_allow_ips: {e!r} is not an IP address or CIDR network") from None

    def __bool__(self) -> bool:
        return self.any or bool(self.networks)

    def __contains__(self, host: str) -> bool:
        if self.any:
            return True
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(addr in n for n in self.networks)


def _host_of(hop: str) -> str:
    """The address of one ``X-Forwarded-For`` entry (``1.2.3.4``, ``1.2.3.4:5``, ``[::1]:5``, ``::1``)."""
    hop = hop.strip()
    if hop.startswith("["):
        return hop[1 : hop.find("]")] if "]" in hop else hop
    if hop.count(":") == 1:
        return hop.split(":", 1)[0]
    return hop


def client_address(peer: str, forwarded_for: list[bytes], trusted: TrustedProxies) -> str:
    """The client a request came from: ``peer`` (the connection's address) unless it is a
    trusted proxy, then the rightmost ``X-Forwarded-For`` hop that is not a trusted proxy (all
    the header's values joined in order; every hop trusted: the leftmost).

    Args:
        peer: the connection's remote address (ASGI ``scope["client"][0]``).
        forwarded_for: the raw values of every ``X-Forwarded-For`` header, in order.
        trusted: the trusted proxies (empty: the header is never read).
    """
    if not trusted or not forwarded_for or peer not in trusted:
        return peer
    hops = [_host_of(h) for v in forwarded_for for h in v.decode("latin-1").split(",")]
    hops = [h for h in hops if h]
    for hop in reversed(hops):
        if hop not in trusted:
            return hop
    return hops[0] if hops else peer


class AuthFailureThrottle:
    """Counts wrong keys per client: after ``max_failures`` missing or wrong keys from one
    client within ``window_s`` seconds, its further wrong keys are refused until the oldest of
    them leaves the window (sliding window log of the last ``max_failures`` failure times).
    Ask :meth:`retry_after` only for a request whose key was not valid (see the module
    docstring), and call :meth:`record_success` for one whose key was.

    Memory is bounded: at most ``max_clients`` addresses, least recently failed evicted
    first (an attacker with that many addresses can push a throttled one out; it has that
    many addresses to guess from anyway).

    Raises:
        ValueError: ``max_failures`` < 1, ``window_s`` <= 0 or ``max_clients`` < 1.
    """

    def __init__(
        self,
        max_failures: int = 20,
        window_s: float = 60.0,
        max_clients: int = 10000,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_failures < 1 or not window_s > 0 or max_clients < 1:
            raise ValueError(
                f"need max_failures >= 1, window_s > 0, max_clients >= 1; got {max_failures}, {window_s}, {max_clients}"
            )
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_clients = max_clients
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def __len__(self) -> int:
        """Number of client addresses tracked."""
        return len(self._failures)

    def retry_after(self, client: str) -> float | None:
        """Seconds until ``client`` may try again (> 0), or None when it may try now."""
        times = self._failures.get(client)
        if times is None:
            return None
        now = self._clock()
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if not times:
            del self._failures[client]
            return None
        if len(times) < self.max_failures:
            return None
        return times[0] + self.window_s - now

    def record_failure(self, client: str) -> None:
        """Count a missing or wrong key from ``client``."""
        times = self._failures.get(client)
        if times is None:
            times = self._failures[client] = deque(maxlen=self.max_failures)
            while len(self._failures) > self.max_clients:
                self._failures.popitem(last=False)
        else:
            self._failures.move_to_end(client)
        times.append(self._clock())

    def record_success(self, client: str) -> None:
        """Forget ``client``'s failures (it sent a valid key)."""
        self._failures.pop(client, None)
