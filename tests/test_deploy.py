"""Running it for real: Debian's Caddy with the shipped deploy/Caddyfile in front of the real server (HTTPS by
Caddy's own CA, the stream, X-Forwarded-For with --trust-proxy), the systemd unit checked by systemd-analyze,
--log-format json line by line, and X-Request-Id on every kind of answer."""

import http.client
import io
import json
import os
import queue
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time

import pytest
import requests

from conftest import ADMIN_KEY, ROOT, LiveServer, free_port, job_body
from test_server import Output, bearer, stop

import command_line
import marketplace as mp

TIMEOUT = 10    # seconds for any one HTTP call: only to avoid hanging, never asserted
DEPLOY = ROOT / 'deploy'
NEW_ID = re.compile(r'[0-9a-f]{32}')


# Caddy in front of the server --------------------------------------------------------------------------------------

class Caddy:
    """`caddy run` on the shipped deploy/Caddyfile, on loopback ports: its CADDY_* and MARKETPLACE_* placeholders
    set, its data (the internal CA) in `directory`. The site address 127.0.0.1 gets a certificate of Caddy's own
    CA, as `tls internal` would give; requests trust that CA's root."""

    def __init__(self, directory, upstream_port):
        self.directory = directory
        self.port = free_port()
        self.url = f'https://127.0.0.1:{self.port}'
        self.root_cert = directory / 'data' / 'caddy' / 'pki' / 'authorities' / 'local' / 'root.crt'
        self.env = dict(os.environ, HOME=str(directory), XDG_DATA_HOME=str(directory / 'data'),
                        XDG_CONFIG_HOME=str(directory / 'config'), CADDY_ADMIN='off',
                        CADDY_HTTP_PORT=str(free_port()), CADDY_HTTPS_PORT=str(self.port),
                        MARKETPLACE_DOMAIN='127.0.0.1', MARKETPLACE_UPSTREAM=f'127.0.0.1:{upstream_port}')
        self.log = open(directory / 'caddy.log', 'wb')     # its access log is long: a file, not a pipe
        self.process = subprocess.Popen(
            [shutil.which('caddy'), 'run', '--config', str(DEPLOY / 'Caddyfile'), '--adapter', 'caddyfile'],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT, cwd=directory)

    def wait_ready(self):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f'caddy exited: {(self.directory / "caddy.log").read_text()[-2000:]}')
            if self.root_cert.exists():
                try:
                    if self.get('/api/health', timeout=1).status_code == 200:
                        return self
                except (requests.ConnectionError, requests.exceptions.SSLError):
                    pass
            time.sleep(0.1)
        raise RuntimeError('caddy did not answer in 20 s')

    def get(self, path, **kwargs):
        kwargs.setdefault('timeout', TIMEOUT)
        return requests.get(self.url + path, verify=str(self.root_cert), **kwargs)

    def post(self, path, body, **kwargs):
        return requests.post(self.url + path, json=body, verify=str(self.root_cert), timeout=TIMEOUT, **kwargs)

    def connection(self, source):
        """An HTTPS connection to Caddy from the loopback address `source` (127.0.0.2, 127.0.0.3...)."""
        context = ssl.create_default_context(cafile=str(self.root_cert))
        return http.client.HTTPSConnection('127.0.0.1', self.port, timeout=TIMEOUT, context=context,
                                           source_address=(source, 0))

    def stop(self):
        """Kill it: its state is this test's temporary directory (a graceful stop waits out kept-alive connections)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.log.close()


@pytest.fixture(scope='module')
def proxied(tmp_path_factory):
    """(Caddy, the server behind it, the server's output): --trust-proxy, the per-address cap raised as the unit
    does, rate limits on at 1/20 (3 reads an hour per client), JSON logs."""
    if shutil.which('caddy') is None:
        pytest.skip('caddy is not installed: sudo apt-get install caddy')
    directory = tmp_path_factory.mktemp('proxied')
    server = LiveServer(directory / 'proxied.db', ['--trust-proxy', '--max-connections-per-ip', '4096',
                                                   '--rate-limit-scale', '0.05', '--log-format', 'json'],
                        env={'MARKETPLACE_RATE_LIMITS': 'on'}).start()
    output = Output(server)
    caddy = Caddy(directory, server.port)
    try:
        yield caddy.wait_ready(), server, output
    finally:
        caddy.stop()
        stop(server)


@pytest.fixture(scope='module')
def proxied_unlimited(tmp_path_factory):
    """(Caddy, the server's output) as `proxied`, but rate limits off (a private deployment, or many addresses),
    256 connections in all, the per-address cap raised to it as the unit does, and 8 requests in flight per client."""
    if shutil.which('caddy') is None:
        pytest.skip('caddy is not installed: sudo apt-get install caddy')
    directory = tmp_path_factory.mktemp('unlimited')
    server = LiveServer(directory / 'unlimited.db', ['--trust-proxy', '--max-connections', str(UNLIMITED_CONNECTIONS),
                                                     '--max-connections-per-ip', str(UNLIMITED_CONNECTIONS),
                                                     '--max-requests-per-client', '8', '--log-format', 'json']).start()
    output = Output(server)
    caddy = Caddy(directory, server.port)
    try:
        yield caddy.wait_ready(), output
    finally:
        caddy.stop()
        stop(server)


UNLIMITED_CONNECTIONS = 256     # fewer than the 300 slow requests of one client


def access_lines(output, request_id, seconds=5):
    """The server's JSON access lines for one request id (waiting up to `seconds` for the first)."""
    deadline = time.monotonic() + seconds
    while True:
        found = [json.loads(line) for line in list(output.lines) if f'"{request_id}"' in line]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def test_health_through_caddy_over_https(proxied):
    caddy, _, output = proxied
    answer = caddy.get('/api/health', headers={'X-Request-Id': 'health-through-caddy'})
    assert answer.status_code == 200
    assert answer.json()['status'] == 'ok'
    assert answer.headers['Server'] == 'Caddy'
    assert answer.headers['X-Request-Id'] == 'health-through-caddy'      # Caddy passes the id both ways
    [line] = access_lines(output, 'health-through-caddy')
    assert (line['route'], line['status'], line['client']) == ('/api/health', 200, '127.0.0.1')


def test_mcp_and_its_oauth_metadata_through_caddy(proxied):
    """The shipped Caddyfile needs no route of its own for /mcp (CONTRACT 22): the 401 names the metadata, and a
    key's tools/list is answered (by the MCP child the server starts on its first /mcp request)."""
    caddy, _, _ = proxied
    message = {'jsonrpc': '2.0', 'id': 1, 'method': 'tools/list', 'params': {}}
    headers = {'Accept': 'application/json, text/event-stream'}
    refused = caddy.post('/mcp', message, headers=headers)
    assert refused.status_code == 401 and 'resource_metadata=' in refused.headers['WWW-Authenticate']
    answer = caddy.post('/mcp', message, headers={**headers, 'Authorization': f'Bearer {ADMIN_KEY}'})
    assert answer.status_code == 200, answer.text
    assert 'post_job' in {tool['name'] for tool in answer.json()['result']['tools']}
    metadata = caddy.get('/.well-known/oauth-authorization-server').json()
    assert metadata['code_challenge_methods_supported'] == ['S256']


def test_plain_http_is_redirected_to_https(proxied):
    caddy, _, _ = proxied
    answer = requests.get(f'http://127.0.0.1:{caddy.env["CADDY_HTTP_PORT"]}/api/health', allow_redirects=False,
                          timeout=TIMEOUT)
    assert answer.status_code == 308
    # (Caddy 2.6 leaves a non-default https_port out of the redirect; on a server it is 443)
    assert answer.headers['Location'].startswith('https://127.0.0.1')
    assert answer.headers['Location'].endswith('/api/health')


class StreamReader:
    """An open /api/jobs/stream through Caddy, its events put on a queue with their arrival time."""

    def __init__(self, caddy):
        self.events = queue.Queue()
        self.answer = caddy.get('/api/jobs/stream', stream=True, headers={'Accept': 'text/event-stream'})
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        event = {}
        try:
            for line in self.answer.iter_lines(chunk_size=1, decode_unicode=True):
                if line == '':
                    if event:
                        self.events.put((time.monotonic(), event))
                    event = {}
                elif ':' in line and not line.startswith(':'):
                    name, _, value = line.partition(':')
                    event[name] = value.strip()
        except requests.RequestException:
            pass

    def next(self, seconds=TIMEOUT):
        return self.events.get(timeout=seconds)

    def close(self):
        """Hang up (a plain close would wait for the reader thread's read to end)."""
        try:
            self.answer.raw.connection.sock.shutdown(socket.SHUT_RDWR)
        except (AttributeError, OSError):
            pass
        self.answer.close()


def test_a_job_posted_through_caddy_reaches_an_open_stream_unbuffered(proxied):
    caddy, _, _ = proxied
    stream = StreamReader(caddy)
    try:
        assert stream.answer.status_code == 200
        assert stream.answer.headers['Content-Type'].startswith('text/event-stream')
        _, connected = stream.next()
        assert connected['event'] == 'connected'
        sent = time.monotonic()
        posted = caddy.post('/api/jobs', job_body(title='Through the proxy'), headers=bearer(ADMIN_KEY))
        assert posted.status_code == 201, posted.text
        job_id = posted.json()['job']['id']
        arrived, event = stream.next()
        while event['event'] == 'heartbeat':
            arrived, event = stream.next()
        assert (event['event'], event['id']) == ('job.new', job_id)
        assert json.loads(event['data'])['title'] == 'Through the proxy'
        # A proxy that buffered the stream would hold the event until its buffer filled or the stream ended
        # (the heartbeat is 30 s here): arriving at all within a few seconds is the point, not a latency figure.
        assert arrived - sent < 10
    finally:
        stream.close()


def read_jobs(caddy, source, forwarded=None):
    """GET /api/jobs through Caddy from a loopback source address: (status, headers, body)."""
    connection = caddy.connection(source)
    try:
        headers = {'X-Forwarded-For': forwarded} if forwarded else {}
        connection.request('GET', '/api/jobs', headers=headers)
        answer = connection.getresponse()
        return answer.status, answer.headers, json.loads(answer.read())
    finally:
        connection.close()


def test_rate_limits_count_the_client_caddy_saw(proxied):
    """Caddy replaces a client's own X-Forwarded-For with the address it saw; the server takes that last hop: two
    clients behind the one proxy have their own buckets, and a forged header changes nothing."""
    caddy, _, _ = proxied
    remaining = [read_jobs(caddy, '127.0.0.2')[1]['X-RateLimit-Remaining'] for _ in range(3)]
    assert remaining == ['2', '1', '0']
    status, headers, body = read_jobs(caddy, '127.0.0.2')
    assert (status, body['code'], headers['X-RateLimit-Limit']) == (429, 'rate_limited', '3')
    status, _, body = read_jobs(caddy, '127.0.0.2', forwarded='203.0.113.9')
    assert (status, body['code']) == (429, 'rate_limited')
    status, headers, _ = read_jobs(caddy, '127.0.0.3')
    assert (status, headers['X-RateLimit-Remaining']) == (200, '2')


def test_the_access_log_names_the_forwarded_client(proxied):
    caddy, _, output = proxied
    connection = caddy.connection('127.0.0.4')
    try:
        connection.request('GET', '/api/jobs/00000000-0000-4000-8000-000000000000',
                           headers={'X-Request-Id': 'from-127.0.0.4', 'X-Forwarded-For': '198.51.100.7'})
        answer = connection.getresponse()
        answer.read()
    finally:
        connection.close()
    assert (answer.status, answer.headers['X-Request-Id']) == (404, 'from-127.0.0.4')
    [line] = access_lines(output, 'from-127.0.0.4')
    assert (line['method'], line['route'], line['status'], line['client']) == \
        ('GET', '/api/jobs/<job_id>', 404, '127.0.0.4')


def test_one_client_holding_300_slow_bodies_through_caddy_does_not_stop_another(proxied_unlimited):
    """127.0.0.5 opens 300 sign-ups through Caddy whose bodies stall after their first byte: more than the server's
    256 connections. Caddy buffers each body before it calls the server, so the server sees none of them, and
    another client (127.0.0.6) is answered, its own bodies included."""
    caddy, output = proxied_unlimited
    context = ssl.create_default_context(cafile=str(caddy.root_cert))
    head = (b'POST /api/accounts HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n'
            b'Content-Length: 1000\r\n\r\n{')
    held = []
    try:
        for _ in range(300):
            sock = socket.create_connection(('127.0.0.1', caddy.port), timeout=TIMEOUT, source_address=('127.0.0.5', 0))
            sock = context.wrap_socket(sock, server_hostname='127.0.0.1')
            sock.sendall(head)
            held.append(sock)
        time.sleep(1)       # only ordering: Caddy has had the time to pass the requests on (it must not)
        for _ in range(5):
            connection = caddy.connection('127.0.0.6')
            connection.request('GET', '/api/health')
            answer = connection.getresponse()
            body = answer.read()
            assert answer.status == 200, (answer.status, body)
            assert json.loads(body)['status'] == 'ok'
            connection.close()
        connection = caddy.connection('127.0.0.6')
        connection.request('POST', '/api/accounts', json.dumps({'name': 'beside the slow ones'}),
                           headers={'Content-Type': 'application/json', 'X-Request-Id': 'beside-1'})
        answer = connection.getresponse()
        assert (answer.status, json.loads(answer.read())['account']['name']) == (201, 'beside the slow ones')
        connection.close()
        [line] = access_lines(output, 'beside-1')
        reached = [json.loads(line) for line in list(output.lines) if '"/api/accounts"' in line]
        assert reached == [line] and line['status'] == 201      # the other client's, not one of the 300
    finally:
        for sock in held:
            sock.close()


def test_one_client_behind_caddy_holds_at_most_its_share_of_the_servers_requests(proxied_unlimited):
    """An open stream is a request in flight at the server. Through Caddy (every connection from 127.0.0.1), one
    client (127.0.0.7) opens 8 streams, its --max-requests-per-client, and its 9th and 10th are refused 503;
    another client's stream still opens."""
    caddy, _ = proxied_unlimited
    connections, statuses = [], []
    try:
        for source in ['127.0.0.7'] * 10 + ['127.0.0.8']:
            connection = caddy.connection(source)
            connection.request('GET', '/api/jobs/stream', headers={'Accept': 'text/event-stream'})
            answer = connection.getresponse()
            connections.append(connection)
            statuses.append(answer.status)
            if answer.status == 200:
                assert answer.headers['Content-Type'].startswith('text/event-stream')
            else:
                body = json.loads(answer.read())
                assert (body['code'], answer.headers['Retry-After']) == ('unavailable', '1'), body
    finally:
        for connection in connections:
            connection.close()
    assert statuses == [200] * 8 + [503] * 2 + [200]


def test_the_shipped_caddyfile_flushes_the_stream_and_keeps_bodies_as_the_server_does():
    text = (DEPLOY / 'Caddyfile').read_text()
    stream_block = text[text.index('reverse_proxy @stream'):]
    assert '@stream path /api/jobs/stream' in text
    assert 'flush_interval -1' in stream_block[:stream_block.index('\n\t}')]
    assert 'max_size 2MB' in text and mp.MAX_BODY < 2_000_000      # the server's JSON 413 comes first
    assert 'encode' not in text     # compression would hold events back


# The systemd unit --------------------------------------------------------------------------------------------------

def unit_here(tmp_path, text=None):
    """deploy/marketplace.service with /opt/marketplace rewritten to this checkout (verify wants ExecStart to exist)."""
    unit = tmp_path / 'marketplace.service'
    unit.write_text((text or (DEPLOY / 'marketplace.service').read_text()).replace('/opt/marketplace', str(ROOT)))
    return unit


def verify(unit):
    """systemd-analyze verify's exit status and its lines about this unit (it exits 0 on ignored keys and bad
    values, so any line naming the file is a failure)."""
    done = subprocess.run(['systemd-analyze', 'verify', str(unit)], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, SYSTEMD_LOG_COLOR='0'))
    lines = [line for line in (done.stdout + done.stderr).splitlines() if unit.name in line]
    return done.returncode, lines


def test_the_unit_passes_systemd_analyze_verify(tmp_path):
    if shutil.which('systemd-analyze') is None:
        pytest.skip('systemd-analyze is not installed (Debian: apt-get install systemd)')
    assert verify(unit_here(tmp_path)) == (0, [])
    broken = (DEPLOY / 'marketplace.service').read_text().replace('ProtectSystem=strict', 'ProtectSystem=sometimes')
    status, lines = verify(unit_here(tmp_path, broken))
    assert len(lines) == 1 and 'protect system' in lines[0].lower(), (status, lines)


def test_the_unit_runs_the_server_behind_the_proxy_with_files_for_every_connection():
    text = (DEPLOY / 'marketplace.service').read_text()
    options = {}
    for line in re.sub(r'\\\n\s*', ' ', text).splitlines():
        name, equals, value = line.partition('=')
        if equals and not line.startswith('#'):
            options.setdefault(name.strip(), []).append(value.strip())
    command = options['ExecStart'][0].split()
    assert command[:3] == ['/opt/marketplace/.venv/bin/python', '/opt/marketplace/marketplace.py', 'serve']
    assert '--trust-proxy' in command
    flags = {flag: command[i + 1] for i, flag in enumerate(command) if flag.startswith('--') and flag != '--trust-proxy'}
    assert flags['--host'] == '127.0.0.1' and flags['--port'] == '8080'
    assert flags['--max-connections-per-ip'] == flags['--max-connections']
    assert int(options['LimitNOFILE'][0]) >= int(flags['--max-connections']) + command_line.FILES_BESIDE_CONNECTIONS
    assert options['User'] == ['marketplace'] and options['EnvironmentFile'] == ['/etc/marketplace/env']
    assert options['Restart'] == ['on-failure'] and options['KillSignal'] == ['SIGTERM']
    assert int(options['TimeoutStopSec'][0]) > mp.Settings().shutdown_timeout
    assert flags['--db'].startswith('/var/lib/' + options['StateDirectory'][0] + '/')
    assert options['ReadWritePaths'] == ['/var/lib/marketplace'] and options['ProtectSystem'] == ['strict']
    # docs/operations.md's file:// replica lives where the unit can be told to let Litestream write (CONTRACT.md 23).
    replica = re.search(r'--replica-url file://(/\S+)', (ROOT / 'docs' / 'operations.md').read_text()).group(1)
    assert f'#ReadWritePaths={replica}' in text.splitlines()
    assert options['CapabilityBoundingSet'] == ['']


# JSON logs and request ids -----------------------------------------------------------------------------------------

def test_json_logs_line_by_line(tmp_path):
    """A server with --log-format json: every line is one JSON object; each request's line has its route template,
    status, duration, client and request id; no key or query string is in any line."""
    server = LiveServer(tmp_path / 'logs.db', ['--log-format', 'json', '--trust-proxy']).start()
    output = Output(server)
    try:
        answer = requests.post(server.url + '/api/accounts', json={'name': 'logged'}, timeout=TIMEOUT,
                               headers={'X-Request-Id': 'sign-up:1'})
        assert (answer.status_code, answer.headers['X-Request-Id']) == (201, 'sign-up:1')
        key = answer.json()['apiKey']
        calls = [
            ('GET', f'/api/jobs/search?q={key}', {'Authorization': f'Bearer {key}', 'X-Request-Id': 'search.2'}),
            ('GET', '/api/no-such-thing', {'X-Request-Id': 'missing-3'}),
            ('POST', '/api/jobs', {'Authorization': f'Bearer mk_{"x" * 43}', 'X-Request-Id': 'stranger-4'}),
            ('GET', '/api/health', {'X-Request-Id': 'has space'}),
            ('GET', '/api/health', {'Authorization': f'Bearer {ADMIN_KEY}', 'X-Request-Id': key}),
            ('GET', '/api/health', {'X-Forwarded-For': ADMIN_KEY, 'X-Request-Id': 'forged-6'}),
        ]
        ids = []
        for method, path, headers in calls:
            answer = requests.request(method, server.url + path, headers=headers, json={} if method == 'POST' else None,
                                      timeout=TIMEOUT)
            ids.append(answer.headers['X-Request-Id'])
            assert key not in answer.headers['X-Request-Id']
        assert ids[:3] == ['search.2', 'missing-3', 'stranger-4'] and ids[5] == 'forged-6'
        assert NEW_ID.fullmatch(ids[3]) and NEW_ID.fullmatch(ids[4])        # not sane: replaced
        assert server.terminate() == 0
    finally:
        stop(server)
    text = output.text()
    lines = [json.loads(line) for line in text.splitlines()]       # every line is JSON
    requests_by_id = {line['request_id']: line for line in lines if 'request_id' in line}
    assert requests_by_id.pop('forged-6')['client'] == '[redacted]'      # a secret in a forwarded header
    for line in requests_by_id.values():
        assert set(line) == {'time', 'method', 'route', 'status', 'duration_ms', 'client', 'request_id'}
        assert re.fullmatch(r'\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z', line['time'])
        assert 0 <= line['duration_ms'] < 10_000 and line['client'] == '127.0.0.1'
    seen = {rid: (requests_by_id[rid]['method'], requests_by_id[rid]['route'], requests_by_id[rid]['status'])
            for rid in ['sign-up:1', *ids[:5]]}
    assert seen == {'sign-up:1': ('POST', '/api/accounts', 201), 'search.2': ('GET', '/api/jobs/search', 200),
                    'missing-3': ('GET', '(unmatched)', 404), 'stranger-4': ('POST', '/api/jobs', 401),
                    ids[3]: ('GET', '/api/health', 200), ids[4]: ('GET', '/api/health', 200)}
    others = [line for line in lines if 'request_id' not in line]
    assert others[0]['message'].startswith('marketplace 2.0.0 serving on http://127.0.0.1:')
    assert others[-1]['message'] == 'stopped'
    for line in others:
        assert set(line) <= {'time', 'level', 'logger', 'message', 'exception'}
        assert line['level'] in ('INFO', 'WARNING', 'ERROR') and line['logger'].startswith('marketplace')
    assert key not in text and ADMIN_KEY not in text and 'x' * 43 not in text and '?' not in text


def raw_answer(port, data):
    """What the server answers to raw bytes on a new connection (it closes the connection after a refusal)."""
    with socket.create_connection(('127.0.0.1', port), timeout=TIMEOUT) as sock:
        sock.sendall(data)
        received = b''
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b'\r\n\r\n')
    lines = head.decode('latin-1').split('\r\n')
    headers = dict(line.split(': ', 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_refusals_of_the_http_layer_carry_a_request_id(tmp_path):
    server = LiveServer(tmp_path / 'refusals.db', ['--log-format', 'json']).start()
    output = Output(server)
    try:
        status, headers, body = raw_answer(server.port, b'POST /api/jobs HTTP/1.1\r\nHost: x\r\nX-Request-Id: '
                                           b'framing-1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n')
        assert (status, body['code'], headers['X-Request-Id']) == (400, 'bad_request', 'framing-1')
        status, headers, body = raw_answer(server.port, b'GET /' + b'a' * 9000 + b' HTTP/1.1\r\n\r\n')
        assert (status, body['code']) == (414, 'uri_too_long') and NEW_ID.fullmatch(headers['X-Request-Id'])
        long_id = headers['X-Request-Id']
        [framing] = access_lines(output, 'framing-1')
        [too_long] = access_lines(output, long_id)
    finally:
        stop(server)
    assert (framing['method'], framing['route'], framing['status']) == ('POST', '(unmatched)', 400)
    assert (too_long['method'], too_long['route'], too_long['status']) == ('GET', '(unmatched)', 414)


@pytest.mark.parametrize('method, path, status', [
    ('GET', '/api/health', 200),
    ('GET', '/api/jobs', 200),
    ('GET', '/', 200),                          # a page
    ('GET', '/static/style.css', 200),          # a static file
    ('GET', '/api/nothing-here', 404),
    ('GET', '/api/jobs/expire', 405),
    ('POST', '/api/jobs', 401),
    ('GET', '/api/jobs/not-a-uuid', 400),
    ('GET', '/api/jobs/feed', 200),
])
def test_every_answer_carries_a_request_id(client, method, path, status):
    fresh = client.request(method, path)
    kept = client.request(method, path, headers={'X-Request-Id': 'Trace.ID:42-a'})
    assert (fresh.status, kept.status) == (status, status)
    assert NEW_ID.fullmatch(fresh.headers['X-Request-Id'])
    assert kept.headers['X-Request-Id'] == 'Trace.ID:42-a'


@pytest.mark.parametrize('sent', ['', 'a b', 'x' * 129, 'mk_looks-like-a-key', 'é', '<script>'])
def test_a_request_id_that_is_not_sane_is_replaced(client, sent):
    answer = client.get('/api/health', headers={'X-Request-Id': sent})
    assert NEW_ID.fullmatch(answer.headers['X-Request-Id'])


@pytest.mark.parametrize('path, template', [
    ('/api/jobs/3f0c6c9e-0000-4000-8000-000000000000', '/api/jobs/<job_id>'),
    ('/api/agents/3f0c6c9e-0000-4000-8000-000000000000/card', '/api/agents/<agent_id>/card'),
    ('/api/jobs?limit=5', '/api/jobs'),
    ('/nowhere/at/all', mp.NO_ROUTE),
])
def test_route_template_names_the_matched_rule_never_the_path(app, path, template):
    path, _, query = path.partition('?')
    environ = {'REQUEST_METHOD': 'GET', 'PATH_INFO': path, 'QUERY_STRING': query, 'SERVER_NAME': '127.0.0.1',
               'SERVER_PORT': '8080', 'SERVER_PROTOCOL': 'HTTP/1.1', 'REMOTE_ADDR': '127.0.0.1',
               'wsgi.url_scheme': 'http', 'wsgi.input': io.BytesIO(b''), 'wsgi.errors': sys.stderr}
    b''.join(app(environ, lambda status, headers, exc_info=None: None))
    assert mp.route_template(environ) == template


def test_the_openapi_document_declares_the_request_id_on_every_answer(client):
    document = client.get('/api/openapi.json').json
    components = document['components']['responses']
    answers = [answer for operations in document['paths'].values() for operation in operations.values()
               for answer in operation['responses'].values()]
    assert len(answers) > 100
    for answer in answers:
        answer = components[answer['$ref'].rsplit('/', 1)[1]] if '$ref' in answer else answer
        assert answer['headers']['X-Request-Id'] == {'$ref': '#/components/headers/X-Request-Id'}


def test_json_logs_under_litestream_are_json_too(tmp_path):
    """The unit's way with --replica-url: Litestream runs the server and writes JSON lines too (its own fields)."""
    server = LiveServer(tmp_path / 'replicated.db', ['--log-format', 'json',
                                                      '--replica-url', f'file://{tmp_path}/replica']).start()
    output = Output(server)
    try:
        answer = requests.get(server.url + '/api/health', headers={'X-Request-Id': 'replicated-1'}, timeout=TIMEOUT)
        assert answer.json()['replication']['enabled'] is True
        assert server.terminate() == 0
    finally:
        stop(server)
    lines = [json.loads(line) for line in output.text().splitlines()]
    assert [line['route'] for line in lines if line.get('request_id') == 'replicated-1'] == ['/api/health']
    assert any(line.get('msg') == 'replicating to' for line in lines)         # Litestream's
    said = [line.get('message') or line.get('msg') for line in lines]
    assert 'stopped' in said and said[-1] == 'litestream shut down'        # the server drained, then Litestream
