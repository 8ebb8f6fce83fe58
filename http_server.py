"""The HTTP layer: gevent's WSGI server made strict for a service that strangers reach and agents hold open.

It owns how a request arrives: the head read within --header-timeout (100 header lines, 64 KiB), the keep-alive
wait, the body within --body-timeout and never drained, framing that could be read two ways refused (400), the
connection caps per address group and in all, requests in flight per client behind a proxy, answers sent in one
write, the access log, and a graceful stop. Refusals made before the app runs are JSON errors like the app's.
It knows nothing of jobs or money: command_line.serve hands it the app and the settings (Faces.make_server).
"""

import json
import logging
import re
import socket
import sys
import time
from datetime import datetime, timezone

from marketplace import (BodyAborted, BodyTimedOut, JSON_TYPE, MAX_BODY, REQUEST_ID_KEY, Unavailable, address_group,
                         client_address, iso, json_bytes, log, request_id, route_template, sane_request_id,
                         setting_secrets)
from verifier.redact import without_secrets


PROTOCOL_ERRORS = {
    400: ('Bad Request', 'bad_request', 'The request is not valid HTTP/1.1 (its request line, a header, '
                                        'Content-Length or Transfer-Encoding), or has more than 100 headers '
                                        'or 64 KiB of them.'),
    408: ('Request Timeout', 'request_timeout', 'The request line and headers did not all arrive in time.'),
    414: ('URI Too Long', 'uri_too_long', 'The request line is longer than 8192 bytes; send long input in a '
                                          'POST body.'),
}
MAX_HEADERS = 100               # header lines in one request
MAX_HEADER_BYTES = 65536        # all the header lines of one request together
ONE_SEND_BYTES = 64 * 1024    # an answer's body up to this goes out with its head in one send
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def protocol_error(status, answer_id):
    """The whole HTTP answer to a request gevent refuses before the app sees it, as JSON like every error, with
    its X-Request-Id."""
    status = status if status in PROTOCOL_ERRORS else 400
    reason, code, message = PROTOCOL_ERRORS[status]
    body = json.dumps({'error': message, 'code': code, 'status': status}).encode()
    return (f'HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: {JSON_TYPE}\r\n'
            f'X-Content-Type-Options: nosniff\r\nX-Request-Id: {answer_id}\r\n'
            f'Content-Length: {len(body)}\r\n\r\n').encode() + body


def sent_request_id(header_lines):
    """The X-Request-Id among a request's raw header lines (None if absent), for an answer the app never saw."""
    for line in header_lines:
        name, colon, value = line.partition(b':')
        if colon and name.strip().lower() == b'x-request-id':
            return value.strip().decode('latin-1')
    return None


def access_line(environ, status, seconds, trust_proxy):
    """--log-format json: one answered request as a JSON line. The route is its template, never the raw path (no
    ids, no query string); no header is written but the request id (which cannot be an API key)."""
    method = environ.get('REQUEST_METHOD') or None
    return json.dumps({'time': iso(datetime.now(timezone.utc)), 'method': method,
                       'route': route_template(environ), 'status': status,
                       'duration_ms': round(seconds * 1000, 3),
                       'client': client_address(environ, trust_proxy) or None,
                       'request_id': environ.get(REQUEST_ID_KEY)})


class MalformedRequest(ValueError):
    """A request whose framing could be read two ways (a smuggling risk): answered 400 and closed."""


def line_content(line):
    """A request or header line without its line end; MalformedRequest if a bare CR is left in it."""
    content = line[:-2] if line.endswith(b'\r\n') else line.rstrip(b'\n')
    if b'\r' in content:
        raise MalformedRequest('a bare CR in the request line or a header')
    return content


def framing_problem(header_lines):
    """Why a request's body boundary is ambiguous (None when it is not), from its raw header lines.

    Every line must be `token: value` (no space before the colon, no folded continuation); every
    Content-Length all ASCII digits and all of them equal; Transfer-Encoding only `chunked`, once, and
    never with a Content-Length.
    """
    lengths, codings = [], []
    for line in header_lines:
        name, colon, value = line_content(line).partition(b':')
        if not colon or not _TOKEN.fullmatch(name):
            return f'a malformed header line {line[:100]!r}'
        value = value.strip(b' \t')
        if name.lower() == b'content-length':
            if not value.isdigit():         # bytes.isdigit is ASCII digits only
                return f'a Content-Length that is not a number: {value[:40]!r}'
            lengths.append(int(value))
        elif name.lower() == b'transfer-encoding':
            codings.append(value.lower())
    if len(set(lengths)) > 1:
        return 'Content-Length headers that differ'
    if codings and lengths:
        return 'both Content-Length and Transfer-Encoding'
    if codings and codings != [b'chunked']:
        return f'a Transfer-Encoding other than chunked: {b", ".join(codings)[:60]!r}'
    return None


def make_server(app, settings):
    """gevent's WSGI server with time-outs, connection caps, strict framing, TCP_NODELAY and a graceful stop.

    Without TCP_NODELAY a kept-alive client waits ~40 ms per request: Nagle's algorithm holds the
    response's last segment until the client's delayed ACK arrives.

    A request's line and headers must all arrive within --header-timeout seconds (counted from the
    connection's start, then from the first byte of each next request; else 408 and closed); a kept-alive
    connection may wait --keepalive-timeout seconds for its next request, else it is closed silently.
    Nothing limits the time of a response (a stream stays open). A connection beyond
    --max-connections-per-ip from one address group or --max-connections in all is closed as soon as it
    is accepted, before anything is read. A request whose body boundary is ambiguous gets 400 and closed.

    With --trust-proxy every connection is the proxy's, so the cap per client counts requests in flight by the
    client the proxy names (X-Forwarded-For): more than --max-requests-per-client at once are answered 503.

    A request's body must arrive in full within --body-timeout seconds of the end of its headers (BodyInput):
    read later it is 408, cut short or malformed 400, each with one log line and the connection closed. An
    answer given while the body is not all read says `Connection: close` and the body is never drained.

    stop(timeout) stops accepting, closes kept-alive connections waiting for their next request,
    lets requests in flight finish (then closes their connections) and kills what still runs after
    `timeout` seconds. Handlers run in a pool so that stop() can wait for them.
    """
    import gevent
    import gevent.pywsgi
    from gevent.pool import Pool
    from gevent.pywsgi import MAX_REQUEST_LINE, Input, OldMessage, WSGIHandler, WSGIServer
    hidden = setting_secrets(settings)      # never in an access line, even in a header a client wrote

    class BodyInput(Input):
        """gevent's reader of a request body, within the body's deadline and never drained. A read past the
        deadline is BodyTimedOut (408), a body cut short or malformed (bad chunked framing) BodyAborted (400):
        each logged in one line, and the reader stays failed."""
        __slots__ = ('deadline', 'failed', 'environ')

        def read(self, length=None):
            return self.in_time(Input.read, length)

        def readline(self, size=None):
            return self.in_time(Input.readline, size)

        def in_time(self, read, size):
            if self.failed is not None:
                raise self.failed
            gevent.get_hub().loop.update_now()     # the timer counts from the loop's clock, maybe stale by now
            timer = gevent.Timeout(max(self.deadline - time.monotonic(), 0.0))
            try:
                with timer:
                    return read(self, size)
            except gevent.Timeout as exc:
                if exc is not timer:
                    raise
                self.failed, what = BodyTimedOut(), f'did not all arrive within {settings.body_timeout:g} s'
            except (OSError, ValueError) as exc:       # gevent's IOError, _InvalidClientInput, a reset, int('')
                self.failed, what = BodyAborted(), f'is cut short or malformed ({exc!r:.200})'
            environ = self.environ      # the route's template, never the raw path (a %0A in it would end the line)
            log.warning('%s %s from %s: the request body %s; answered %s and closed', environ.get('REQUEST_METHOD'),
                        route_template(environ), client_address(environ, settings.trust_proxy), what,
                        self.failed.status)
            raise self.failed

        @property
        def complete(self):
            """Has the whole body been read (or was there none)?"""
            if self.failed is not None:
                return False
            if self.chunked_input:
                return self.chunk_length == 0
            return self.position >= (self.content_length or 0)

        def _discard(self):
            """Never read a body that nobody asked for: the connection is closed instead."""

    def client_too_busy(environ, start_response):
        """The answer to a request over --max-requests-per-client: 503, JSON, and the connection closed."""
        error = Unavailable(f'This client has {settings.max_requests_per_client} requests in flight already; send '
                            'this one when one of them has finished.')
        body = json_bytes(error.body())
        start_response('503 Service Unavailable', [
            ('Content-Type', JSON_TYPE), ('Content-Length', str(len(body))), ('Retry-After', '1'),
            ('Connection', 'close'), ('X-Content-Type-Options', 'nosniff'), ('X-Request-Id', request_id(environ))])
        return [body]

    access_clock = [None, '']      # (the second, as the access log writes it)

    class Handler(WSGIHandler):
        requests_started = 0
        header_lines = ()
        refusal = None              # the status that answers the request being read, when it is refused
        refused_with = None         # (status, request id) of the answer to a request refused before the app

        def read_requestline(self):
            """The request line once the whole header block is in; '' closes the connection."""
            if self.server.stopping:
                return ''                   # no new request on this connection: close it
            self.server.idle.add(self)
            try:
                return self.read_request_head()
            finally:
                self.server.idle.discard(self)

        def read_request_head(self):
            """Wait for a request (keep-alive time-out), then read its line and headers (header time-out)."""
            self.refusal, self.header_lines = None, []
            if self.requests_started:
                idle = gevent.Timeout(settings.keepalive_timeout)
                try:
                    with idle:
                        if not self.rfile.peek(1):
                            return ''       # the client closed it
                except gevent.Timeout as exc:
                    if exc is not idle:
                        raise
                    return ''
            self.requests_started += 1
            deadline = gevent.Timeout(settings.header_timeout)
            try:
                with deadline:
                    line = self.rfile.readline(MAX_REQUEST_LINE)
                    if len(line) >= MAX_REQUEST_LINE:
                        return line.decode('latin-1')       # gevent answers 414
                    if not line.endswith(b'\n'):
                        return ''                           # the client closed it
                    size = 0
                    while (header := self.rfile.readline(MAX_HEADER_BYTES + 1)) not in (b'\r\n', b'\n'):
                        if not header.endswith(b'\n'):
                            if len(header) <= MAX_HEADER_BYTES:
                                return ''   # the client closed it in the middle
                            self.refusal = 400
                            break
                        self.header_lines.append(header)
                        size += len(header)
                        if size > MAX_HEADER_BYTES or len(self.header_lines) > MAX_HEADERS:
                            self.refusal = 400
                            break
            except gevent.Timeout as exc:
                if exc is not deadline:
                    raise
                self.refusal = 408
                return 'HEADERS NOT-IN-TIME HTTP/1.1'      # what the access log shows; read_request refuses it
            return line.decode('latin-1')

        def read_request(self, raw_requestline):
            self.requestline = raw_requestline.rstrip()     # for the access log, also when refused
            if self.refusal:
                raise MalformedRequest(PROTOCOL_ERRORS[self.refusal][2])
            line_content(raw_requestline.encode('latin-1'))
            problem = framing_problem(self.header_lines)
            if problem:
                self.refusal = 400
                raise MalformedRequest(problem)
            return super().read_request(raw_requestline)

        def MessageClass(self, fp, *args):
            """The request's headers from the lines read_request_head kept, each `token: value` (framing_problem
            checked them), as http.client's parser makes them (value without its leading blanks and line end),
            without parsing them through the email package again (a third of gevent's cost of a small request)."""
            message = OldMessage()
            for line in self.header_lines:
                name, _, value = line.decode('latin-1').partition(':')
                message._headers.append((name, value.lstrip(' \t').rstrip('\r\n')))
            return message

        def handle_one_response(self):
            if self.server.stopping:
                self.close_connection = True
            if not settings.trust_proxy:
                return super().handle_one_response()
            # Behind a proxy every connection is the proxy's: the cap per client counts its requests in flight.
            client = address_group(client_address(self.environ, True))
            in_flight = self.server.requests_by_client
            if in_flight.get(client, 0) >= settings.max_requests_per_client:
                self.application = client_too_busy
                return super().handle_one_response()
            in_flight[client] = in_flight.get(client, 0) + 1
            try:
                return super().handle_one_response()
            finally:
                in_flight[client] -= 1
                if not in_flight[client]:
                    del in_flight[client]

        def get_environ(self):
            """gevent's environ, its body read by a BodyInput whose deadline starts now, at the end of the headers
            (also for an Upgrade request: this server upgrades nothing, so no request reads the raw socket)."""
            environ = super().get_environ()
            plain = self.wsgi_input
            body = BodyInput(plain.rfile, plain.content_length, socket=plain.socket, chunked_input=plain.chunked_input)
            body.deadline, body.failed, body.environ = time.monotonic() + settings.body_timeout, None, environ
            self.wsgi_input = environ['wsgi.input'] = body
            environ['wsgi.input_terminated'] = True
            return environ

        def handle_one_request(self):
            self.refused_with = None
            result = super().handle_one_request()
            if isinstance(result, tuple):       # refused before the app: gevent's answer has an empty body
                status = self.refusal or int(result[0])
                self.refused_with = (status, sane_request_id(sent_request_id(self.header_lines)))
                result = (str(status), protocol_error(*self.refused_with))
            elif result is None and self.wsgi_input is not None and not self.wsgi_input.complete:
                self.close_unread()
            return result

        def close_unread(self):
            """Before closing a connection whose request body was not all read: send FIN after the answer and drop
            what has already arrived (no waiting for more), so that the client reads its answer rather than a reset
            (RFC 9112 9.6)."""
            raw = getattr(self.socket, '_sock', None)
            try:
                self.socket.shutdown(socket.SHUT_WR)
                dropped = 0
                while raw is not None and dropped < 4 * MAX_BODY:
                    data = raw.recv(65536)      # non-blocking under gevent: BlockingIOError once nothing is left
                    if not data:
                        break
                    dropped += len(data)
            except OSError:
                pass

        def _write_with_headers(self, data):
            """gevent's, but the head and a body of up to ONE_SEND_BYTES in one send: one syscall and one
            segment for most answers, where gevent makes two (a tenth of a small answer's cost, make bench)."""
            self.headers_sent = True
            self.finalize_headers()         # decides response_use_chunked (a stream's)
            if self.wsgi_input is not None and not self.wsgi_input.complete:
                # answered before its body was all read: the body is never drained, so the connection is closed
                if not any(name.lower() == b'connection' for name, _ in self.response_headers):
                    self.response_headers.append((b'Connection', b'close'))
                self.close_connection = True
            head = bytearray(b'HTTP/1.1 ')
            head += self.status
            head += b'\r\n'
            for header, value in self.response_headers:
                head += header + b': ' + value + b'\r\n'
            head += b'\r\n'
            if self.response_use_chunked or len(data) > ONE_SEND_BYTES:
                self._sendall(head)
                self._write(data)
            else:
                head += data
                self._sendall(head)

        def _sendall(self, data):
            """gevent's, but without asking the socket for its send buffer's size first (a getsockopt call each
            time, 3 % of a small answer's cost): up to ONE_SEND_BYTES goes out by plain sends."""
            if len(data) > ONE_SEND_BYTES:
                return super()._sendall(data)
            view, sent = memoryview(data), 0
            try:
                while sent < len(view):
                    sent += self.socket.send(view[sent:])
            except OSError as error:
                self.status = f'socket error: {error}'
                self.code = -abs(self.code or 0)
                raise
            self.response_length += len(data)

        def format_request(self):
            """gevent's access line, its local time (to the second) formatted once a second."""
            second = int(time.time())
            if second != access_clock[0]:
                access_clock[:] = [second, str(datetime.fromtimestamp(second))]
            length = self.response_length or '-'
            delta = f'{self.time_finish - self.time_start:.6f}' if self.time_finish else '-'
            address = self.client_address[0] if isinstance(self.client_address, tuple) else self.client_address
            status = (self._orig_status or self.status or '000').split()[0]
            return f'{address or "-"} - - [{access_clock[1]}] "{self.requestline or ""}" {status} {length} {delta}'

        def _send_error_response_if_possible(self, error_code):
            """gevent's own answer (a body that could not be read, a failure outside Bottle), with the request's id."""
            if self.response_length:
                self.close_connection = True
                return
            status, headers, body = gevent.pywsgi._ERRORS[error_code]
            answer_id = request_id(self.environ) if isinstance(self.environ, dict) else sane_request_id(None)
            try:
                self.start_response(status, [*headers, ('X-Content-Type-Options', 'nosniff'),
                                             ('X-Request-Id', answer_id)])
                self.write(body)
            except OSError:
                self.close_connection = True

        def log_request(self):
            """The access log: gevent's line, or with --log-format json access_line (refusals before the app too)."""
            if settings.log_format != 'json':
                return super().log_request()
            if self.refused_with:
                status, answer_id = self.refused_with
                method = (self.requestline or '').partition(' ')[0]
                environ = {'REMOTE_ADDR': self.client_address[0] if isinstance(self.client_address, tuple) else '',
                           'REQUEST_METHOD': method if status != 408 and re.fullmatch('[A-Z]{1,20}', method) else '',
                           REQUEST_ID_KEY: answer_id}
            else:
                environ = self.environ
                status = int((self._orig_status or self.status or '0').split()[0])
            seconds = (self.time_finish or time.time()) - self.time_start
            line = access_line(environ, status, seconds, settings.trust_proxy)
            self.server.log.write(without_secrets(line, hidden) + '\n')     # as the filter does for every record

    class Server(WSGIServer):
        handler_class = Handler

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.stopping = False
            self.idle = set()
            self.open_connections = 0
            self.open_by_group = {}
            self.requests_by_client = {}    # with --trust-proxy: requests in flight by forwarded client's group
            self.refused_connections = 0
            self.refusals_logged_at = 0.0

        def do_handle(self, sock, address):
            group = address_group(address[0]) if isinstance(address, tuple) else ''
            if (self.open_connections >= settings.max_connections
                    or self.open_by_group.get(group, 0) >= settings.max_connections_per_ip):
                sock.close()
                self.note_refusal(group)
                return
            self.open_connections += 1
            self.open_by_group[group] = self.open_by_group.get(group, 0) + 1
            super().do_handle(sock, address)

        def do_close(self, sock, address):
            try:
                super().do_close(sock, address)
            finally:
                group = address_group(address[0]) if isinstance(address, tuple) else ''
                self.open_connections -= 1
                self.open_by_group[group] -= 1
                if not self.open_by_group[group]:
                    del self.open_by_group[group]

        def note_refusal(self, group):
            """Count a connection closed by a cap; log the count at most once a minute."""
            self.refused_connections += 1
            moment = time.monotonic()
            if moment - self.refusals_logged_at >= 60:
                log.warning('closed %s connections over the caps (the last from %s; %s open in all)',
                            self.refused_connections, group, self.open_connections)
                self.refused_connections, self.refusals_logged_at = 0, moment

        def handle(self, sock, address):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().handle(sock, address)

        def stop(self, timeout=None):
            self.stopping = True
            self.close()
            for handler in list(self.idle):
                try:
                    handler.socket.shutdown(socket.SHUT_RDWR)
                except (AttributeError, OSError):
                    pass
            super().stop(timeout=timeout)

    # A backlog of 1024: after a restart every stream reconnects at once. The access log is gevent's own line (or
    # access_line with --log-format json), written straight to stderr: through `logging` it cost a sixth of the
    # throughput and let a few kept-alive connections wait for seconds under load (make bench).
    return Server((settings.host, settings.port), app, spawn=Pool(), backlog=1024, log=sys.stderr,
                  error_log=logging.getLogger('marketplace.server'))
