"""Which hosts a webhook may reach (CONTRACT.md 11 and 20): a webhook URL's host looked up once, within a time
limit and without a thread, and every address it has checked against the networks webhooks may not reach
(loopback, private, link-local, multicast, reserved, and IPv6 forms that carry such an IPv4 address). The rules
(marketplace.py) check a URL when it is registered; webhook delivery connects to the address checked here.
Below the rules: it imports nothing of ours."""

import ipaddress
import socket
from urllib.parse import urlsplit

import gevent

# IPv6 forms that carry an IPv4 address in their last 32 bits: IPv4-compatible (::a.b.c.d, which :: and ::1 are
# not), IPv4-mapped, IPv4-translated (RFC 2765) and the well-known NAT64 prefix (RFC 6052).
IPV4_IN_LAST_32 = [ipaddress.ip_network(net) for net in ('::/96', '::ffff:0:0/96', '::ffff:0:0:0/96', '64:ff9b::/96')]
LOCAL_NAT64 = ipaddress.ip_network('64:ff9b:1::/48')    # RFC 8215: its IPv4 sits where the operator's prefix puts it


def embedded_ipv4(ip):
    """The IPv4 addresses an IPv6 address stands for (CONTRACT.md 20): the one in its last 32 bits for the forms of
    IPV4_IN_LAST_32; under the local-use NAT64 prefix, the one at each place RFC 6052 allows for a prefix of /48,
    /56, /64 or /96; the 6to4 and Teredo client addresses. [] for any other address."""
    value = int(ip)
    if any(ip in net for net in IPV4_IN_LAST_32) and value > 1:
        return [ipaddress.IPv4Address(value & 0xFFFFFFFF)]
    if ip in LOCAL_NAT64:       # RFC 6052 2.2: bits 64-71 are zero; the IPv4 address is split around them
        at_48 = (value >> 64 & 0xFFFF) << 16 | (value >> 40 & 0xFFFF)
        at_56 = (value >> 64 & 0xFF) << 24 | (value >> 32 & 0xFFFFFF)
        at_64 = value >> 24 & 0xFFFFFFFF
        return [ipaddress.IPv4Address(bits) for bits in (at_48, at_56, at_64, value & 0xFFFFFFFF)]
    return [found for found in (ip.sixtofour, ip.teredo and ip.teredo[1]) if found]


def is_public_address(address):
    """Is an IP address one a webhook may reach (not loopback, private, link-local, multicast, reserved)? An IPv6
    address that carries an IPv4 address is judged by that address (by every one it may stand for)."""
    ip = ipaddress.ip_address(address.split('%')[0])
    if ip.version == 6:
        embedded = embedded_ipv4(ip)
        if embedded:
            public = all(is_public_address(str(inner)) for inner in embedded)
            # 6to4 and Teredo are judged as themselves too; the translation forms only by what they carry
            return public and (ip.is_global or not (ip.sixtofour or ip.teredo))
    return ip.is_global and not ip.is_multicast


class BlockedAddress(OSError):
    """A webhook URL's host resolves to an address that webhooks may not reach."""


WEBHOOK_LOOKUP_SECONDS = 2      # a webhook host's name lookup; longer fails, as an attempt without an answer
_host_resolvers = {}            # (gevent hub, dns server) -> its c-ares resolver (host_resolver)


def host_resolver(dns_server=''):
    """This thread's c-ares resolver for webhook hosts, asking `dns_server` (IP:PORT; '': the system's servers).
    It runs in gevent's loop: no thread of gevent's pool, nor the commit thread, ever waits for a name."""
    import gevent.resolver.ares
    hub = gevent.get_hub()
    key = (hub, dns_server)
    if key not in _host_resolvers:
        options = {'timeout': WEBHOOK_LOOKUP_SECONDS, 'tries': 1}
        if dns_server:
            host, _, port = dns_server.rpartition(':')
            options.update(servers=[host.strip('[]')], udp_port=int(port), tcp_port=int(port))
        _host_resolvers[key] = gevent.resolver.ares.Resolver(hub, **options)
    return _host_resolvers[key]


def lookup_host(host, port, dns_server=''):
    """getaddrinfo's answers (TCP) for a webhook host, within WEBHOOK_LOOKUP_SECONDS (else TimeoutError, an
    OSError). Under the server (and whenever a --dns-server is given) through host_resolver; in-process tests,
    which fake socket.getaddrinfo, through the socket module. Network I/O."""
    from gevent import monkey
    try:
        ipaddress.ip_address(host.split('%')[0])
        return monkey.get_original('socket', 'getaddrinfo')(      # an address: nothing to look up, no thread
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_NUMERICHOST)
    except ValueError:
        pass
    if not dns_server and not monkey.is_module_patched('socket'):
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    with gevent.Timeout(WEBHOOK_LOOKUP_SECONDS, TimeoutError(f'no answer for {host} in {WEBHOOK_LOOKUP_SECONDS} s')):
        return host_resolver(dns_server).getaddrinfo(host, port, 0, socket.SOCK_STREAM, socket.IPPROTO_TCP)


def pinned_address(url, allow_private, dns_server=''):
    """Resolve a webhook URL's host once (lookup_host) and check every address it has (unless `allow_private`):
    the (family, sockaddr) to connect to, the first one. BlockedAddress if any is not public. Network I/O."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == 'https' else 80)
    found = lookup_host(parts.hostname, port, dns_server)
    if not allow_private and not all(is_public_address(info[4][0]) for info in found):
        raise BlockedAddress(f'{parts.hostname} resolves to an address webhooks may not reach')
    family, _, _, _, sockaddr = found[0]
    return family, sockaddr


def webhook_url_problem(url, allow_private, dns_server=''):
    """What makes a webhook URL unusable, or None: the scheme, or (unless allowed) an address that resolves
    to a loopback, private, link-local or multicast network. Resolving the name is network I/O."""
    parts = urlsplit(url)
    if parts.scheme not in ('http', 'https') or not parts.hostname:
        return 'must be an http or https URL'
    if parts.username or parts.password:
        return 'must not carry a user name or password'
    if allow_private:
        return None
    try:
        pinned_address(url, allow_private=False, dns_server=dns_server)
    except BlockedAddress:
        return 'resolves to a loopback, private, link-local or multicast address, which webhooks may not reach'
    except (OSError, ValueError, UnicodeError):
        return 'has a host name that does not resolve'
    return None
