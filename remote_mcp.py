"""Remote MCP: `<base-url>/mcp`, the MCP server of section 15 over Streamable HTTP (CONTRACT.md section 22).

The mcp SDK runs on asyncio and must never be patched by gevent, so `serve` does not load it: on the first request
to /mcp this face starts `marketplace.py mcp --http-fd N` (mcp_server.run_http) as a child process on a loopback
socket it has bound and hands over, and proxies each request to it. The child is stateless and answers JSON; it
calls this same API back over loopback with the caller's Bearer token, so a tool acts as the caller's account, as
the stdio server acts as its key's. This face refuses a page of another site (403 for a foreign Origin, against DNS
rebinding) and checks the token before anything reaches the child (401 with the OAuth resource metadata named); it
caps the body at 1 MiB, answering a larger one of up to 4 MiB, read whole, with a JSON-RPC error (413) so that the
client's session goes on (CONTRACT.md section 25); it passes every Mcp-* header both ways (2026-07-28 routes on
Mcp-Method and Mcp-Name), and the caller's address along, signed with a secret only this process and its child
know, so that the tools' API calls count against the caller's rate limits, not loopback's.
"""

import ctypes
import ipaddress
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from urllib.parse import urlsplit

import requests
from bottle import request, response

from marketplace import (HERE, MAX_BODY, BodyTooLarge, Forbidden, Unauthorized, Unavailable, account_for_key,
                         client_ip, read_raw_body, route, service)

log = logging.getLogger('marketplace.mcp')
RELAY_HEADER = 'X-Marketplace-Relay'        # the child's API calls: the secret, then the caller's address
PASSED_HEADERS = ('Content-Type', 'Accept', 'Authorization', 'Last-Event-Id')     # and every Mcp-* header
ANSWER_HEADERS = ('Content-Type', 'Allow')                                          # and every Mcp-* header
OVERSIZED_READ = 4 * 1024 * 1024    # a body over MAX_BODY read before its 413, so that an MCP client's send completes
CHILD_TIMEOUT = 120         # seconds a proxied request may take (a tool's API call has --mcp-timeout)

try:
    _LIBC = ctypes.CDLL('libc.so.6', use_errno=True) if sys.platform == 'linux' else None
except OSError:
    _LIBC = None


def _die_with_parent():
    """In the child before exec, on Linux: SIGTERM when the server that started it dies, even by SIGKILL."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG


class McpChild:
    """The MCP child process of one app: started on first use, started again if it has died, stopped with the
    server. `relay_secret` signs the caller's address on the child's API calls."""

    def __init__(self, svc):
        self.svc = svc
        self.process = None
        self.url = None
        self.lock = threading.Lock()     # a gevent lock under serve (patched)

    def ensure(self, api_port):
        """The child's URL, starting it when it is not running: the socket is bound and listening before the
        child starts, so a request sent at once waits in its backlog until the child accepts it."""
        with self.lock:
            if self.process is not None and self.process.poll() is None:
                return self.url
            listener = socket.create_server(('127.0.0.1', 0), backlog=128)
            try:
                environment = dict(os.environ, MARKETPLACE_MCP_RELAY=self.svc.relay_secret)
                self.process = subprocess.Popen(
                    [sys.executable, str(HERE / 'marketplace.py'), 'mcp', '--http-fd', str(listener.fileno()),
                     '--url', f'http://{api_host(self.svc.settings.host)}:{api_port}',
                     '--mcp-timeout', str(self.svc.settings.mcp_timeout)],
                    pass_fds=(listener.fileno(),), env=environment, stdin=subprocess.DEVNULL,
                    preexec_fn=_die_with_parent, cwd=HERE)
                self.url = f'http://127.0.0.1:{listener.getsockname()[1]}/mcp'
            finally:
                listener.close()            # the child holds it now
            log.info('MCP over Streamable HTTP: started its process (pid %s) at %s', self.process.pid, self.url)
            return self.url

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()


def api_host(host):
    """Where the child reaches this server's API: over loopback when it listens on every address, else at the
    address it listens on (an IPv6 one in brackets)."""
    if host in ('', '0.0.0.0'):
        return '127.0.0.1'
    if host == '::':
        return '[::1]'
    return f'[{host}]' if ':' in host else host


def child_of(svc):
    """The MCP child of this app. Only under `serve` (svc.background): the child calls the API back over HTTP, which
    an app called in-process (the tests' WSGI calls, `seed`) does not answer."""
    if not svc.background:
        raise Unavailable('MCP over HTTP is served by `marketplace.py serve`, not by an app called in-process.')
    child = getattr(svc, 'mcp_child', None)
    if child is None:
        child = svc.mcp_child = McpChild(svc)
        svc.on_close.append(child.stop)
    return child


def unauthorized(message, error=None):
    """401 naming where an MCP host learns how to get a token (RFC 9728), as section 22 says."""
    metadata = f'{service().settings.base_url}/.well-known/oauth-protected-resource'
    challenge = f'Bearer resource_metadata="{metadata}"' + (f', error="{error}"' if error else '')
    failure = Unauthorized(message)
    failure.headers['WWW-Authenticate'] = challenge
    return failure


def passed_headers(environ):
    """The request's headers the MCP server reads, as sent: PASSED_HEADERS and every Mcp-* header (the protocol of
    2026-07-28 needs Mcp-Method and Mcp-Name, a tool's declared parameters come as Mcp-Param-*). A WSGI environ
    keeps no header's spelling: `HTTP_MCP_PARAM_X` is sent as Mcp-Param-X (header names are case-insensitive)."""
    headers = {name: environ[key] for name in PASSED_HEADERS
               if (key := 'CONTENT_TYPE' if name == 'Content-Type' else 'HTTP_' + name.upper().replace('-', '_'))
               in environ}
    for key, value in environ.items():
        if key.startswith('HTTP_MCP_'):
            headers['-'.join(word.capitalize() for word in key[5:].split('_'))] = value
    return headers


def answer_headers(headers):
    """The MCP server's answer headers given back: ANSWER_HEADERS and every Mcp-* header."""
    return {name: value for name, value in headers.items()
            if name.lower().startswith('mcp-') or name.lower() in {kept.lower() for kept in ANSWER_HEADERS}}


def site(url, path_allowed=False):
    """(scheme, host, port) of an http(s) URL, the scheme's default port filled in; None for anything else (an
    Origin of "null", a path, user information, a port that is not one)."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ('http', 'https') or not parts.hostname or '@' in parts.netloc or parts.query or \
            parts.fragment or (parts.path and not path_allowed):
        return None
    return scheme, parts.hostname.lower(), port or (443 if scheme == 'https' else 80)


def own_sites():
    """The sites whose pages may call /mcp: --public-url's, or without one the address served (the address it
    listens on, and the address in the request's Host when that is an IP address or localhost). A host name in Host
    is not trusted: a page of another site whose name was made to resolve here (DNS rebinding) sends its own."""
    settings = service().settings
    if settings.public_url:
        return {site(settings.public_url, path_allowed=True)}
    sites = {site(settings.base_url)}
    served = site(f'{request.environ.get("wsgi.url_scheme", "http")}://{request.environ.get("HTTP_HOST", "")}')
    if served is not None and (served[1] == 'localhost' or is_ip_address(served[1])):
        sites.add(served)
    return sites


def is_ip_address(host):
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def refuse_other_sites():
    """403 for a request whose Origin names another site than this one's (a page elsewhere, maybe through DNS
    rebinding, as the MCP specification warns); a request without Origin (an MCP host, not a page) passes."""
    origin = request.environ.get('HTTP_ORIGIN')
    if origin is not None and site(origin) not in own_sites():
        raise Forbidden('MCP is not served to pages of another site: this request\'s Origin is not '
                        f'{service().settings.base_url}.', code='cross_site_request')


def too_large_answer():
    """The answer to a body over MAX_BODY: read whole when it is at most OVERSIZED_READ (within --body-timeout, the
    body's deadline), so that the client's send completes and its connection stays open for the next call, then
    HTTP 413 with a JSON-RPC error (id null: the request was never parsed) that an MCP client reports as the call's
    error. A larger body is BodyTooLarge unread, and its connection closed (section 20)."""
    length = request.content_length
    if length > OVERSIZED_READ:
        raise BodyTooLarge()
    stream = request.environ['wsgi.input']
    if length >= 0:
        left = length
    else:       # chunked: read_raw_body has read MAX_BODY + 1 of it already
        left = OVERSIZED_READ - MAX_BODY
    while left > 0:
        chunk = stream.read(min(left, 64 * 1024))
        if not chunk:
            break
        left -= len(chunk)
    if length < 0 and left <= 0:
        raise BodyTooLarge()    # a chunked body past OVERSIZED_READ: the rest unread, the connection closed
    message = (f'The request body is larger than {MAX_BODY // (1024 * 1024)} MiB; nothing was done. Send less '
               '(a long text as a link to it).')
    response.status = 413
    response.content_type = 'application/json'
    return {'jsonrpc': '2.0', 'id': None, 'error': {'code': -32600, 'message': message},
            'code': 'body_too_large', 'status': 413}


@route('POST', '/mcp', limit='mcp')
def mcp_endpoint():
    """MCP over Streamable HTTP: the caller's Origin and Bearer token checked here, the request proxied to the MCP
    child with every Mcp-* header. Only POST: a stateless server opens no stream (GET) and ends no session (DELETE),
    so those are 405 here."""
    refuse_other_sites()
    header = request.get_header('Authorization', '')
    scheme, _, token = header.partition(' ')
    if scheme.lower() != 'bearer' or not token.strip():
        raise unauthorized('MCP needs a token: send Authorization: Bearer <an API key or an OAuth access token>.')
    if account_for_key(service().db, token.strip()) is None:
        raise unauthorized('This token is not a live API key or access token of this service.', 'invalid_token')
    try:
        body = read_raw_body()
    except BodyTooLarge:
        return too_large_answer()
    svc = service()
    url = child_of(svc).ensure(request.environ.get('SERVER_PORT') or svc.settings.port)
    headers = passed_headers(request.environ)
    headers[RELAY_HEADER] = client_ip()     # the child passes it back, signed, on the API calls it makes
    try:
        answer = requests.request(request.method, url, data=body, headers=headers, timeout=CHILD_TIMEOUT,
                                  allow_redirects=False)
    except requests.RequestException as exc:
        log.error('MCP child at %s did not answer: %s', url, type(exc).__name__)
        response.status = 503
        response.set_header('Retry-After', '5')
        response.content_type = 'application/json'
        return {'error': 'The MCP server is starting or failed; retry in a moment.', 'code': 'unavailable',
                'status': 503}
    response.status = answer.status_code
    for name, value in answer_headers(answer.headers).items():
        response.set_header(name, value)
    if answer.status_code >= 400 and not answer.headers.get('Content-Type', '').startswith('application/json'):
        # the SDK's refusals of the HTTP request itself (a Content-Type or Accept it does not take) are words:
        # answered as every error of this API is
        response.content_type = 'application/json'
        words = answer.content.decode('utf-8', 'replace').strip()[:500] or 'The MCP server refused the request.'
        return {'error': f'MCP: {words}', 'status': answer.status_code,
                'code': {400: 'bad_request', 403: 'forbidden', 405: 'method_not_allowed', 406: 'not_acceptable',
                         415: 'unsupported_media_type'}.get(answer.status_code, 'bad_request')}
    return answer.content


def call_tool(token, tool, arguments):
    """Run one MCP tool in the child as the account of `token` (a live key or access token, checked by the
    caller): (True, its structured result) or (False, the tool's error in words). For A2A's skills, which are the
    MCP tools (a2a_binding.py)."""
    svc = service()
    try:
        url = child_of(svc).ensure(request.environ.get('SERVER_PORT') or svc.settings.port)
    except Unavailable as exc:
        return False, exc.message
    message = {'jsonrpc': '2.0', 'id': 1, 'method': 'tools/call', 'params': {'name': tool, 'arguments': arguments}}
    try:
        answer = requests.post(url, json=message, timeout=CHILD_TIMEOUT, headers={
            'Authorization': f'Bearer {token}', 'Accept': 'application/json, text/event-stream',
            RELAY_HEADER: client_ip()})
        reply = answer.json()
    except (requests.RequestException, ValueError) as exc:
        log.error('MCP child did not run %s: %s', tool, type(exc).__name__)
        return False, 'The MCP server is starting or failed; send the message again in a moment.'
    if 'error' in reply:
        return False, reply['error'].get('message') or 'The tool could not run.'
    result = reply.get('result') or {}
    if result.get('isError'):
        return False, ' '.join(part.get('text', '') for part in result.get('content', [])).strip()
    return True, result.get('structuredContent')
