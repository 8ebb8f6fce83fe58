"""Read replicas (issue 24): a primary replicated by Litestream to an S3 server (moto, on 127.0.0.1) and two servers
reading that replica in place through the real litestream-vfs extension. What the primary commits is listed,
searched and streamed on both within 5 seconds; a write sent to a replica is sent on to the primary (307) or
refused (503 read_only), never answered by the replica itself; a replica restarted under writes catches up; health
says each server's role and a replica's lag."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import uuid

import pytest
import requests

from conftest import ADMIN_KEY, ROOT, LiveServer, free_port, job_body
from test_replication import AWS_ENV, s3  # noqa: F401  (s3: the moto server fixture, one for this module)
from test_server import Output, bearer, stop

import command_line
import marketplace as mp
import pages

pytestmark = pytest.mark.replication

TIMEOUT = 10                # seconds for any one HTTP call: only to avoid hanging, never asserted
SEEN_WITHIN = 5.0           # the bound: a commit on the primary reaches every replica's reads and streams
PUBLIC_URL = 'http://market.test'       # every server builds the same absolute URLs
REPLICA_URL = 's3://backups/cluster/marketplace'


def replica_server(directory, name, endpoint, primary_url=None, extra=()):
    """A read replica of REPLICA_URL, started (its --db is never used: nothing may create it)."""
    args = ['--public-url', PUBLIC_URL, '--read-replica-of', REPLICA_URL, '--replica-endpoint', endpoint, *extra]
    server = LiveServer(directory / f'{name}.db', args + (['--primary-url', primary_url] if primary_url else []),
                        env=AWS_ENV).start()
    server.out = Output(server)
    return server


@pytest.fixture(scope='module')
def cluster(s3, tmp_path_factory):  # noqa: F811
    """(primary, replica that sends writes to it, replica without --primary-url, the directory of their --db)."""
    directory = tmp_path_factory.mktemp('cluster')
    primary = LiveServer(directory / 'primary.db', ['--public-url', PUBLIC_URL, '--replica-url', REPLICA_URL,
                                                     '--replica-endpoint', s3, '--heartbeat-interval', '1'],
                         env=AWS_ENV).start()
    primary.out = Output(primary)
    servers = [primary]
    try:
        servers.append(replica_server(directory, 'forwarding', s3, primary.url))
        servers.append(replica_server(directory, 'refusing', s3))
        yield (*servers, directory)
    finally:
        for server in servers:
            stop(server)


def call(server, method, path, body=None, key=None, status=200):
    answer = requests.request(method, server.url + path, json=body, headers=bearer(key) if key else {},
                              timeout=TIMEOUT, allow_redirects=False)
    assert answer.status_code == status, (server.url, path, answer.text)
    return answer.json()


def account(server):
    return call(server, 'POST', '/api/accounts', {'name': 'requester'}, status=201)['apiKey']


def wait_until(condition, seconds, what):
    """Wait for condition() to be true (polling), at most `seconds`; the seconds it took."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < seconds, f'{what}: not within {seconds} s'
        time.sleep(0.05)
    return time.monotonic() - started


class Stream:
    """/api/jobs/stream of a server read in a thread from a raw socket (shut down to end it at once): its events and
    when each job.new arrived."""

    def __init__(self, server):
        self.events, self.arrived = [], {}
        self.sock = socket.create_connection(('127.0.0.1', server.port), timeout=TIMEOUT)
        self.sock.sendall(b'GET /api/jobs/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n')
        self.thread = threading.Thread(target=self.read, daemon=True)
        self.thread.start()

    def read(self):
        lines = self.sock.makefile('rb')
        event = None
        try:
            for line in lines:
                if line.startswith(b'event: '):
                    event = line[7:].strip().decode()
                    self.events.append(event)
                elif line.startswith(b'data: ') and event == 'job.new':
                    self.arrived.setdefault(json.loads(line[6:])['id'], time.monotonic())
        except (OSError, ValueError):       # shut down by the test
            pass

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.thread.join(TIMEOUT)
        self.sock.close()


def test_a_job_posted_on_the_primary_is_listed_searched_and_streamed_on_both_replicas_within_5_seconds(cluster):
    primary, *replicas, _ = cluster
    streams = [Stream(replica) for replica in replicas]
    try:
        wait_until(lambda: all(stream.events[:1] == ['connected'] for stream in streams), TIMEOUT, 'streams')
        word = 'zebra' + uuid.uuid4().hex[:8]
        key = account(primary)
        job = call(primary, 'POST', '/api/jobs', job_body(title=f'Paint the {word} fence'), key=key, status=201)['job']
        posted = time.monotonic()
        for replica in replicas:
            def listed():
                return any(j['id'] == job['id'] for j in call(replica, 'GET', '/api/jobs?limit=50')['jobs'])

            def found():
                return [r['id'] for r in call(replica, 'GET', f'/api/jobs/search?q={word}')['results']] == [job['id']]
            wait_until(listed, SEEN_WITHIN - (time.monotonic() - posted), f'{replica.url}: the job listed')
            wait_until(found, SEEN_WITHIN - (time.monotonic() - posted), f'{replica.url}: the job found')
            assert call(replica, 'GET', f'/api/jobs/{job["id"]}')['job'] == job    # the same JSON as the primary's
        for stream in streams:
            wait_until(lambda: job['id'] in stream.arrived, SEEN_WITHIN - (time.monotonic() - posted), 'streamed')
        seconds = max(stream.arrived[job['id']] for stream in streams) - posted
        print(f'\nread replicas: the job listed, found and streamed on both within {seconds:.2f} s of its 201')
    finally:
        for stream in streams:
            stream.close()


def test_a_write_sent_to_a_replica_lands_on_the_primary_or_is_refused(cluster):
    primary, forwarding, refusing, _ = cluster
    # Followed by requests (307: the same method and body): the account is made on the primary.
    answer = requests.post(forwarding.url + '/api/accounts', json={'name': 'via a replica'}, timeout=TIMEOUT)
    assert [hop.status_code for hop in answer.history] == [307]
    assert answer.status_code == 201 and answer.url == primary.url + '/api/accounts'
    key = answer.json()['apiKey']
    # A client keeps its key on a redirect only to the same origin: one with a key follows it itself.
    body = job_body(title='Posted to a replica')
    moved = requests.post(forwarding.url + '/api/jobs?source=replica', json=body, headers=bearer(key),
                          timeout=TIMEOUT, allow_redirects=False)
    assert moved.status_code == 307
    assert moved.headers['Location'] == primary.url + '/api/jobs?source=replica'
    assert moved.json() == {'primary': primary.url + '/api/jobs?source=replica'}
    job = requests.post(moved.headers['Location'], json=body, headers=bearer(key), timeout=TIMEOUT).json()['job']
    assert call(primary, 'GET', f'/api/jobs/{job["id"]}')['job']['title'] == 'Posted to a replica'
    # Without --primary-url: refused, in the JSON error shape, and nothing changes anywhere.
    total = call(primary, 'GET', '/api/stats')['totalJobs']
    refused = requests.post(refusing.url + '/api/jobs', json=body, headers=bearer(key), timeout=TIMEOUT)
    assert refused.status_code == 503
    assert refused.headers['Content-Type'] == 'application/json; charset=utf-8'
    assert refused.json() == {'error': 'This server is a read replica: it serves reads only; send writes to the '
                                       'primary.', 'code': 'read_only', 'status': 503}
    assert call(primary, 'GET', '/api/stats')['totalJobs'] == total


def concrete(path):
    """A route's path with every <param> a well-formed id (and bottle's escaped colon a colon)."""
    return re.sub(r'<[^>]+>', str(uuid.uuid4()), path).replace('\\:', ':')


def test_a_replica_never_answers_a_write_itself(cluster):
    primary, forwarding, refusing, directory = cluster
    key = account(primary)
    writes = sorted({(method, path) for method, path, _, _ in mp.ROUTES + pages.BROWSER_ROUTES
                     if method not in ('GET', 'HEAD')})      # the API's and the pages' forms
    assert len(writes) >= 30 and ('POST', '/jobs/<job_id>/<action>') in writes
    writes += [('PUT', '/api/jobs/<job_id>'), ('DELETE', '/api/agents/<agent_id>')]   # methods no route takes
    stats = call(primary, 'GET', '/api/stats')
    for method, path in writes:
        path = concrete(path)
        for replica in (forwarding, refusing):
            answer = requests.request(method, replica.url + path, json={}, headers=bearer(key), timeout=TIMEOUT,
                                      allow_redirects=False)
            if replica is forwarding:
                assert (answer.status_code, answer.headers.get('Location')) == (307, primary.url + path), path
            else:
                assert (answer.status_code, answer.json()['code']) == (503, 'read_only'), path
    # A request target without its leading '/' (a raw request line) is still a path on the primary: glued to its URL
    # as it came, '@evil.example/...' would have named another host (CONTRACT.md 20).
    for target in ('@evil.example/api/jobs', '.evil.example/api/jobs'):
        with socket.create_connection(('127.0.0.1', forwarding.port), timeout=TIMEOUT) as sock:
            sock.sendall(f'POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n'
                         'Connection: close\r\n\r\n'.encode())
            head = sock.makefile('rb').read().split(b'\r\n\r\n')[0].decode('latin-1')
        assert head.startswith('HTTP/1.1 307 '), head
        assert f'\r\nLocation: {primary.url}/{target}\r\n' in head, head
    assert call(primary, 'GET', '/api/stats') == stats
    # The replicas read the replica in place: no file of theirs, the primary's alone.
    assert [path.name for path in directory.iterdir() if 'primary.db' not in path.name] == []


def test_health_says_the_role_and_how_far_behind_a_replica_is(cluster):
    primary, forwarding, refusing, _ = cluster
    health = call(primary, 'GET', '/api/health')
    assert health['role'] == 'primary' and 'lag' not in health and 'replicaOf' not in health
    for replica in (forwarding, refusing):
        health = call(replica, 'GET', '/api/health')
        assert (health['status'], health['role'], health['replicaOf']) == ('ok', 'replica', REPLICA_URL)
        assert health['replication'] == {'enabled': False, 'url': None}
        # heartbeats every 1 s, Litestream's 1 s sync and the extension's 1 s poll: about 3 s at most, 8 with room
        assert isinstance(health['lag'], float) and 0 <= health['lag'] < 8, health


def test_a_replica_of_nothing_or_of_itself_does_not_start(s3, tmp_path):  # noqa: F811
    env = {**{name: value for name, value in os.environ.items() if not name.startswith('MARKETPLACE_')}, **AWS_ENV}
    serve = [sys.executable, str(ROOT / 'marketplace.py'), 'serve', '--port', str(free_port()), '--db',
             str(tmp_path / 'm.db'), '--read-replica-of', 's3://backups/nobody/here', '--replica-endpoint', s3]
    empty = subprocess.run(serve, env=env, capture_output=True, text=True, timeout=30)
    assert (empty.returncode, empty.stdout) == (1, '')
    assert empty.stderr == ('marketplace.py serve: the replica s3://backups/nobody/here holds no database: start the '
                            'primary with --replica-url s3://backups/nobody/here first\n')
    both = subprocess.run(serve + ['--replica-url', 's3://backups/mine'], env=env, capture_output=True, text=True,
                          timeout=30)
    assert both.returncode == 2
    assert both.stderr.endswith('error: --read-replica-of and --replica-url: a read replica has no database of its '
                                'own to replicate\n')
    assert list(tmp_path.iterdir()) == []


def caddy_in_front(directory, primary, replicas):
    """Debian's caddy on the shipped deploy/Caddyfile.replicas, on loopback ports, in front of these servers:
    (its process, its HTTPS URL, the root certificate of its own CA, which requests trust)."""
    port = free_port()
    env = dict(os.environ, HOME=str(directory), XDG_DATA_HOME=str(directory / 'data'),
               XDG_CONFIG_HOME=str(directory / 'config'), CADDY_ADMIN='off', CADDY_HTTP_PORT=str(free_port()),
               CADDY_HTTPS_PORT=str(port), MARKETPLACE_DOMAIN='127.0.0.1',
               MARKETPLACE_PRIMARY=f'127.0.0.1:{primary.port}',
               MARKETPLACE_REPLICAS=' '.join(f'127.0.0.1:{replica.port}' for replica in replicas))
    log = open(directory / 'caddy.log', 'wb')
    process = subprocess.Popen([shutil.which('caddy'), 'run', '--config', str(ROOT / 'deploy' / 'Caddyfile.replicas'),
                                '--adapter', 'caddyfile'], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=directory)
    log.close()
    root = directory / 'data' / 'caddy' / 'pki' / 'authorities' / 'local' / 'root.crt'
    url = f'https://127.0.0.1:{port}'

    def ready():
        assert process.poll() is None, (directory / 'caddy.log').read_text()[-2000:]
        try:
            return root.exists() and requests.get(url + '/api/health', verify=str(root), timeout=1).ok
        except (requests.ConnectionError, requests.exceptions.SSLError):
            return False
    wait_until(ready, 20, 'caddy')
    return process, url, str(root)


def test_the_replicas_caddyfile_sends_writes_to_the_primary_and_reads_to_the_replicas(cluster, tmp_path):
    if shutil.which('caddy') is None:
        pytest.skip('caddy is not installed: sudo apt-get install caddy')
    primary, *replicas, _ = cluster
    process, url, root = caddy_in_front(tmp_path, primary, replicas)
    try:
        def get(path, **headers):
            return requests.get(url + path, headers=headers, verify=root, timeout=TIMEOUT).json()
        # reads take turns over the replicas; a signed-in person and X-Read-From: primary read the primary
        assert [get('/api/health')['role'] for _ in range(4)] == ['replica'] * 4
        assert get('/api/health', **{'X-Read-From': 'primary'})['role'] == 'primary'
        assert get('/api/health', Cookie='theme=dark; mk_session=abc')['role'] == 'primary'
        assert get('/api/health', Cookie='theme=dark; __Host-mk_session=abc')['role'] == 'primary'     # over HTTPS
        assert get('/api/health', Cookie='theme=dark; not_mk_session=abc')['role'] == 'replica'
        answer = requests.post(url + '/api/accounts', json={'name': 'through caddy'}, verify=root, timeout=TIMEOUT)
        assert answer.status_code == 201 and answer.history == []       # the primary's own answer: no 307 on the way
        key = answer.json()['apiKey']
        answer = requests.post(url + '/api/jobs', json=job_body(title='Through the front'), headers=bearer(key),
                               verify=root, timeout=TIMEOUT)
        assert answer.status_code == 201
        job_id = answer.json()['job']['id']
        wait_until(lambda: requests.get(url + f'/api/jobs/{job_id}', verify=root, timeout=TIMEOUT).status_code == 200,
                   SEEN_WITHIN, 'the job read through the front')
    finally:
        process.kill()
        process.wait(TIMEOUT)


def test_a_replica_restarted_while_the_primary_writes_catches_up(cluster, s3):  # noqa: F811
    primary, _, refusing, directory = cluster
    key = account(primary)
    posted, stopping = [], threading.Event()

    def post_jobs():
        session = requests.Session()
        while not stopping.is_set():
            answer = session.post(primary.url + '/api/jobs', json=job_body(title=f'Load {len(posted)}'),
                                  headers=bearer(key), timeout=TIMEOUT)
            assert answer.status_code == 201
            posted.append(answer.json()['job']['id'])

    writer = threading.Thread(target=post_jobs)
    writer.start()
    restarted = None
    try:
        wait_until(lambda: len(posted) >= 20, TIMEOUT, 'the first writes')
        refusing.process.send_signal(signal.SIGTERM)
        assert refusing.process.wait(TIMEOUT) == 0
        before = len(posted)
        wait_until(lambda: len(posted) >= before + 50, TIMEOUT, 'writes while the replica is down')
        restarted = replica_server(directory, 'refusing', s3)
        wait_until(lambda: len(posted) >= before + 100, TIMEOUT, 'writes after the restart')
    finally:
        stopping.set()
        writer.join(TIMEOUT)
    try:
        total = call(primary, 'GET', '/api/stats')['totalJobs']
        seconds = wait_until(lambda: call(restarted, 'GET', '/api/stats')['totalJobs'] == total, SEEN_WITHIN,
                             'the restarted replica caught up')
        newest = [job['id'] for job in call(restarted, 'GET', '/api/jobs?limit=100&sort=newest')['jobs']]
        assert newest == posted[::-1][:100]
        print(f'\nread replicas: {len(posted)} jobs posted across a replica restart; caught up {seconds:.2f} s '
              'after the last')
    finally:
        if restarted is not None:
            stop(restarted)


def metric(server, name):
    """One sample's value from a server's /metrics (read with the admin key), or None when it is not there."""
    text = requests.get(server.url + '/metrics', headers=bearer(ADMIN_KEY), timeout=TIMEOUT).text
    found = re.search(rf'^{name} (\S+)$', text, re.M)
    return float(found[1]) if found else None


def test_a_lagging_replica_says_so_in_health_and_serves_no_stale_read(cluster, s3):  # noqa: F811
    """The primary's Litestream stopped (SIGSTOP): no heartbeat reaches the replica. Past --max-replica-lag (6 s),
    health is 503 lagging, a read is 307 to the primary (503 replica_lagging without --primary-url), its view is
    reopened with one log line, and /metrics shows the lag; once Litestream goes on, it serves reads again and shows
    the job posted meanwhile."""
    primary, *_, directory = cluster
    args = ['--max-replica-lag', '6']       # a replica is about 3 s behind at most: heartbeat, sync, poll
    forwarding = replica_server(directory, 'lag-forwarding', s3, primary.url, args)
    refusing = replica_server(directory, 'lag-refusing', s3, None, args)
    key = account(primary)
    try:
        wait_until(lambda: call(forwarding, 'GET', '/api/health')['lag'] is not None, SEEN_WITHIN, 'a heartbeat')
        # Under load a replica's first view may already lag and be reopened once: count from here.
        before = metric(refusing, 'marketplace_replica_reopenings_total')
        primary.process.send_signal(signal.SIGSTOP)         # the pid is Litestream's; the server is its child
        try:
            job = call(primary, 'POST', '/api/jobs', job_body(title='Posted while the replica lags'), key, 201)['job']
            wait_until(lambda: requests.get(forwarding.url + '/api/health', timeout=TIMEOUT).status_code == 503,
                       TIMEOUT, 'health 503')
            health = requests.get(refusing.url + '/api/health', timeout=TIMEOUT)
            assert (health.status_code, health.json()['status'], health.json()['code']) == \
                (503, 'lagging', 'replica_lagging'), health.text
            assert health.json()['lag'] > 6 and health.headers['Retry-After'] == '5'
            answer = requests.get(forwarding.url + '/api/jobs?limit=5', timeout=TIMEOUT, allow_redirects=False)
            assert (answer.status_code, answer.headers['Location']) == (307, primary.url + '/api/jobs?limit=5')
            answer = requests.get(refusing.url + f'/api/jobs/{job["id"]}', timeout=TIMEOUT)
            assert (answer.status_code, answer.json()['code'], answer.headers['Retry-After']) == \
                (503, 'replica_lagging', '5'), answer.text
            assert answer.json()['lag'] > 6
            wait_until(lambda: metric(refusing, 'marketplace_replica_reopenings_total') >= before + 1, TIMEOUT,
                       'the view reopened')
            assert metric(refusing, 'marketplace_replica_lag_seconds') > 6
        finally:
            primary.process.send_signal(signal.SIGCONT)
        for replica in (forwarding, refusing):
            wait_until(lambda: requests.get(replica.url + '/api/health', timeout=TIMEOUT).status_code == 200,
                       TIMEOUT, 'caught up')
            assert call(replica, 'GET', f'/api/jobs/{job["id"]}')['job']['title'] == 'Posted while the replica lags'
    finally:
        stop(forwarding)
        stop(refusing)
    lines = [line for line in refusing.out.text().splitlines() if 'max-replica-lag' in line]
    assert lines and all('behind its primary (over --max-replica-lag 6 s): reads are refused, and its view of the '
                         'replica is reopened' in line for line in lines), lines


def test_the_replicas_caddyfile_routes_reads_around_a_lagging_replica_then_to_the_primary(cluster, s3, tmp_path):  # noqa: F811,E501
    """The primary's Litestream stopped: replica A (--max-replica-lag 6) lags first, and Caddy's health check leaves it
    out, so reads keep being answered by B; once B lags too (20 s), reads go to the primary rather than fail."""
    if shutil.which('caddy') is None:
        pytest.skip('caddy is not installed: sudo apt-get install caddy')
    primary, *_, directory = cluster
    first = replica_server(directory, 'lags-first', s3, None, ['--max-replica-lag', '6'])
    later = replica_server(directory, 'lags-later', s3, None, ['--max-replica-lag', '20'])
    process, url, root = caddy_in_front(tmp_path, primary, [first, later])

    def read(path):
        return requests.get(url + path, verify=root, timeout=TIMEOUT)

    def health(server):
        return requests.get(server.url + '/api/health', timeout=TIMEOUT).status_code
    try:
        wait_until(lambda: health(first) == health(later) == 200, SEEN_WITHIN, 'both replicas in step')
        primary.process.send_signal(signal.SIGSTOP)         # Litestream's pid: no heartbeat reaches the replicas
        try:
            wait_until(lambda: health(first) == 503, TIMEOUT, 'the first replica lagging')
            # within Caddy's next health checks (every 2 s) the lagging one is left out: ten reads in a row answered
            wait_until(lambda: all(read('/api/jobs?limit=1').status_code == 200 for _ in range(10)), TIMEOUT,
                       'reads answered around the lagging replica')
            assert health(first) == 503 and health(later) == 200
            assert read('/api/health').json()['role'] == 'replica'
            wait_until(lambda: health(later) == 503, 2 * TIMEOUT + 10, 'the second replica lagging')
            wait_until(lambda: read('/api/health').json()['role'] == 'primary', TIMEOUT, 'reads sent to the primary')
            assert read('/api/jobs?limit=1').status_code == 200
        finally:
            primary.process.send_signal(signal.SIGCONT)
    finally:
        process.kill()
        process.wait(TIMEOUT)
        stop(first)
        stop(later)


@pytest.mark.parametrize('target', ['/api/jobs', '@evil.example/api/jobs', '.evil.example/api/jobs',
                                    'http://evil.example/api/jobs', '//evil.example/api/jobs'])
def test_a_replicas_location_is_the_primary_url_and_a_path_starting_with_a_slash(target):
    """Unit level (no cluster): send_writes_to_primary as a replica's before-request hook runs it."""
    app = types.SimpleNamespace(service=types.SimpleNamespace(
        x402=None, settings=types.SimpleNamespace(primary_url='https://primary.test/')))
    mp.request.bind({'REQUEST_METHOD': 'POST', 'PATH_INFO': target, 'QUERY_STRING': 'a=1'})
    with pytest.raises(mp.bottle.HTTPResponse) as raised:
        mp.send_writes_to_primary(app)
    path = target if target.startswith('/') else '/' + target
    assert (raised.value.status_code, raised.value.headers['Location']) == (307, f'https://primary.test{path}?a=1')
    assert json.loads(raised.value.body) == {'primary': f'https://primary.test{path}?a=1'}


@pytest.mark.parametrize('lag, method, path, refused', [
    (40, 'GET', '/api/jobs', True), (40, 'HEAD', '/jobs/1', True), (40, 'GET', '/api/jobs/stream', True),
    (40, 'GET', '/api/health', False), (40, 'GET', '/metrics', False), (40, 'GET', '/static/style.css', False),
    (29, 'GET', '/api/jobs', False), (None, 'GET', '/api/jobs', False)])
def test_a_lagging_replica_refuses_every_read_but_health_metrics_and_static_files(lag, method, path, refused):
    """Unit level: past --max-replica-lag (30 s) a read is 503 replica_lagging without --primary-url; under it, or
    before the first heartbeat (None: nothing to judge by), it is served."""
    beat = None if lag is None else (time.time() - lag) * 1000
    app = types.SimpleNamespace(service=types.SimpleNamespace(
        x402=None, db=types.SimpleNamespace(value=lambda sql: beat),
        settings=types.SimpleNamespace(primary_url='', max_replica_lag=30.0), replica_resync_lag=None))
    mp.request.bind({'REQUEST_METHOD': method, 'PATH_INFO': path, 'QUERY_STRING': ''})
    if not refused:
        assert mp.send_writes_to_primary(app) is None
        return
    with pytest.raises(mp.bottle.HTTPResponse) as raised:
        mp.send_writes_to_primary(app)
    body = json.loads(raised.value.body)
    assert (raised.value.status_code, body['code'], raised.value.headers['Retry-After']) == \
        (503, 'replica_lagging', '5')
    assert 40 <= body['lag'] < 41 and body['error'].startswith('This read replica is 40')


def test_a_view_that_caught_up_or_failed_is_replaced_before_reads_are_served_again(monkeypatch):
    """Unit level, a scripted view (its lag at each look): litestream-vfs 0.5.17 may lose the changes of the L0 files
    it reads in the poll that brings an L1 compaction (docs/operations.md "Read replicas"), most likely when a replica catches
    up after lagging, and may then fail a read ("malformed"). So a view that caught up, or failed, is replaced by a
    fresh one, and reads stay refused (replica_resync_lag) until the fresh view is within the limit."""
    class Done(Exception):
        pass
    script = iter([2, 40, 40, 1, 1, 'failed', 1, 1])
    seen = []       # (the lag read, were reads refused when it was read?)

    class View:
        def value(self, sql):
            lag = next(script, None)
            if lag is None:
                raise Done()
            seen.append((lag, service.replica_resync_lag is not None))
            if lag == 'failed':
                raise mp.apsw.CorruptError('database disk image is malformed')
            return (time.time() - lag) * 1000

        def reopen(self):
            seen.append('reopened')
    service = types.SimpleNamespace(db=View(), settings=types.SimpleNamespace(max_replica_lag=30.0),
                                    replica_reopenings=0, replica_resync_lag=None)
    monkeypatch.setattr(command_line, "REPLICA_POLL_SECONDS", 0)
    with pytest.raises(Done):
        command_line.watch_replica_forever(service)
    assert seen == [(2, False), (40, False), 'reopened', (40, True), (1, True), 'reopened', (1, True),
                    ('failed', False), 'reopened', (1, True), 'reopened', (1, True)]
    assert (service.replica_reopenings, service.replica_resync_lag) == (4, None)
