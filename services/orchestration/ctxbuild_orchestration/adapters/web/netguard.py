"""URL checks and the SSRF guard of web_fetch.

The guard sits where connections are made (an httpcore network backend), not in front of the request: every
connection — the first one and each redirect hop — resolves the host once, refuses it if any address is not
public, and then connects to an address it has just checked. Checking a name and letting the HTTP client resolve
it again would leave a DNS-rebinding window between the two.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable, Iterable
from typing import Any

import httpcore
import httpx

from ...domain.web.outputs import WebToolError
from ...domain.web.specs import MAX_URL_CHARS

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
AddressPolicy = Callable[[IPAddress], "str | None"]  # an address → why it is refused, or None

DEFAULT_LIMITS = httpx.Limits(max_connections=20, max_keepalive_connections=5)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_SHARED = ipaddress.IPv4Network("100.64.0.0/10")  # carrier-grade NAT: not global, not "private" either


def validate_url(url: Any) -> httpx.URL:
    """An absolute http(s) URL with a host, or WebToolError(invalid-url). The fragment is dropped (never sent)."""
    if not isinstance(url, str) or not url.strip():
        raise WebToolError("invalid-url", "the url must be a non-empty string")
    text = url.strip()
    if len(text) > MAX_URL_CHARS:
        raise WebToolError("invalid-url", f"the url is longer than {MAX_URL_CHARS} characters")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in text):
        raise WebToolError("invalid-url", "the url contains whitespace or control characters")
    try:
        parsed = httpx.URL(text)
    except (httpx.InvalidURL, ValueError) as exc:
        raise WebToolError("invalid-url", f"{text!r} is not a valid URL ({exc})") from None
    if parsed.scheme not in ("http", "https"):
        what = repr(parsed.scheme) if parsed.scheme else "a relative URL"
        raise WebToolError("invalid-url", f"only http and https URLs can be fetched, not {what}")
    if not parsed.host:
        raise WebToolError("invalid-url", f"{text!r} has no host")
    return parsed.copy_with(fragment=None)


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries and routes to (mapped, 6to4, NAT64), if any."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def blocked_reason(ip: IPAddress) -> str | None:
    """Why web_fetch must not connect to ``ip`` by default (None: a public address)."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_v4(ip)
        if inner is not None:
            reason = blocked_reason(inner)
            return f"{reason}, embedded in {ip}" if reason else None
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if isinstance(ip, ipaddress.IPv4Address) and ip in _SHARED:
        return "shared (carrier-grade NAT)"
    if ip.is_reserved:
        return "reserved"
    if ip.is_private:
        return "private"
    if not ip.is_global:
        return "reserved"
    return None


def parse_ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text.split("%", 1)[0])  # drop an IPv6 zone id ("fe80::1%eth0")


class BlockedAddress(Exception):
    def __init__(self, host: str, ip: IPAddress, reason: str) -> None:
        where = f"{host} is" if host == str(ip) else f"{host} resolves to {ip},"
        super().__init__(f"{where} a {reason} address")
        self.host, self.ip, self.reason = host, ip, reason


def _unique(items: Iterable[IPAddress]) -> list[IPAddress]:
    return list(dict.fromkeys(items))


async def resolve(host: str, port: int) -> list[IPAddress]:
    """All addresses of ``host`` for TCP, in resolver order (an IP literal resolves to itself)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise httpcore.ConnectError(f"cannot resolve {host}: {exc}") from None
    return _unique(parse_ip(sockaddr[0]) for *_, sockaddr in infos)


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """Resolves, refuses a host if any of its addresses is refused by ``policy``, connects to a checked address."""

    def __init__(self, policy: AddressPolicy = blocked_reason,
                 inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.policy = policy
        self.inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None, socket_options: Iterable[Any] | None = None,
                          ) -> httpcore.AsyncNetworkStream:
        addresses = await resolve(host, port)
        for ip in addresses:  # all of them: a name with one public and one private address is refused
            reason = self.policy(ip)
            if reason:
                raise BlockedAddress(host, ip, reason)
        error: Exception = httpcore.ConnectError(f"{host} has no address")
        for ip in addresses:
            try:
                return await self.inner.connect_tcp(str(ip), port, timeout=timeout, local_address=local_address,
                                                    socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        raise error

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not fetched")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's own transport (request/response mapping, exception mapping) over a connection pool whose network
    backend is the guard. httpx has no public hook for the backend, so the pool it built is replaced by one that
    has it; tests/integration/test_web_tools_http.py proves the guard runs on every hop, should httpx change."""

    def __init__(self, policy: AddressPolicy = blocked_reason, *, verify: bool = True,
                 limits: httpx.Limits = DEFAULT_LIMITS) -> None:
        super().__init__(verify=verify, limits=limits, trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(verify=verify, trust_env=False),
            max_connections=limits.max_connections, max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry, network_backend=GuardedBackend(policy))
