"""The real server as a process on 127.0.0.1: races, a crash, SIGTERM, TCP_NODELAY, start-up, health."""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from conftest import ADMIN_KEY, ROOT, LiveServer, free_port, job_body, random_wallet

import marketplace as mp
import http_server

TIMEOUT = 10    # seconds for any one HTTP call: only to avoid hanging, never asserted


# Helpers ---------------------------------------------------------------------

def bearer(key):
    return {'Authorization': f'Bearer {key}'}


def post(url, body, key=None, session=None):
    return (session or requests).post(url, json=body, headers=bearer(key) if key else {}, timeout=TIMEOUT)


def new_account(server, name):
    answer = post(server.url + '/api/accounts', {'name': name})
    assert answer.status_code == 201, answer.text
    return answer.json()['account'], answer.json()['apiKey']


def register_agent(server, name):
    """An account and its agent in one step: (agent, key)."""
    answer = post(server.url + '/api/agents/register',
                  {'name': name, 'walletAddress': random_wallet(), 'capabilities': {'categories': ['code']}})
    assert answer.status_code == 201, answer.text
    return answer.json()['agent'], answer.json()['apiKey']


def new_job(server, key, **overrides):
    answer = post(server.url + '/api/jobs', job_body(**overrides), key)
    assert answer.status_code == 201, answer.text
    return answer.json()['job']


def claim_and_deliver(server, job, agent_id, worker_key):
    """Claim a job for an agent and deliver it over HTTP; the claim id."""
    claim = post(f'{server.url}/api/jobs/{job["id"]}/claim', {'agentId': agent_id}, worker_key)
    assert claim.status_code == 201, claim.text
    claim_id = claim.json()['claim']['id']
    delivered = post(f'{server.url}/api/jobs/{job["id"]}/deliver',
                     {'claimId': claim_id, 'deliverable': {'type': 'url', 'url': 'https://example.com/out'}}, worker_key)
    assert delivered.status_code == 200, delivered.text
    assert delivered.json()['job']['status'] == 'delivered'
    return claim_id


def get_job(server, job_id):
    answer = requests.get(f'{server.url}/api/jobs/{job_id}', timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
    return answer.json()


def ledger_of(db_path):
    """ledger_problems of a database file the server no longer holds."""
    db = mp.Database(db_path)
    try:
        return mp.ledger_problems(db)
    finally:
        db.close()


def stop(server):
    """Stop a LiveServer if it still runs (used in finally blocks)."""
    if server.process is not None and server.process.poll() is None:
        server.process.kill()
        server.process.wait(10)


class Output:
    """Reads a server's output in the background, so that a busy server never blocks on a full pipe."""

    def __init__(self, server):
        self.lines = []
        self.reader = threading.Thread(target=self._read, args=(server.process.stdout,), daemon=True)
        self.reader.start()

    def _read(self, stream):
        for line in iter(stream.readline, b''):
            self.lines.append(line.decode(errors='replace'))

    def wait_for(self, text, seconds=10):
        """Whether a line containing `text` appeared within `seconds` (only to avoid hanging)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if any(text in line for line in list(self.lines)):
                return True
            time.sleep(0.01)
        return False

    def text(self):
        """Everything the server wrote; call after it exited."""
        self.reader.join(10)
        return ''.join(self.lines)


def cli_env(**extra):
    """The environment without any MARKETPLACE_* setting of the caller, plus `extra`."""
    env = {name: value for name, value in os.environ.items() if not name.startswith('MARKETPLACE_')}
    env.update(extra)
    return env


def wait_for_health(url, process, seconds=15):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f'server exited {process.returncode}: {process.stdout.read().decode()}')
        try:
            if requests.get(url + '/api/health', timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            time.sleep(0.05)
    raise AssertionError(f'no server answered on {url} in {seconds} s')


def run_concurrently(count, action):
    """Run action(i) in `count` threads released together by a barrier; return the results in order."""
    barrier = threading.Barrier(count)
    results = [None] * count

    def run(i):
        barrier.wait(TIMEOUT)
        try:
            results[i] = action(i)
        except Exception as exc:   # reported by the assertions on the results
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    return results


# Races -----------------------------------------------------------------------

def test_twenty_concurrent_approvals_pay_exactly_once(tmp_path):
    server = LiveServer(tmp_path / 'race.db').start()
    try:
        requester, requester_key = new_account(server, 'requester')
        agent, worker_key = register_agent(server, 'worker')
        job = new_job(server, requester_key, paymentAmount='40.00')
        claim_id = claim_and_deliver(server, job, agent['id'], worker_key)

        answers = run_concurrently(20, lambda i: post(f'{server.url}/api/jobs/{job["id"]}/verify',
                                                      {'claimId': claim_id, 'approved': True}, requester_key))

        assert all(isinstance(a, requests.Response) for a in answers), answers
        statuses = sorted(a.status_code for a in answers)
        assert statuses == [200] + [409] * 19
        winner = next(a.json() for a in answers if a.status_code == 200)
        assert winner['job']['status'] == 'completed'
        assert winner['escrowStatus'] == 'released'
        assert [(p['type'], p['amount']) for p in winner['payments']] == [('release', '40.00')]
        for loser in (a for a in answers if a.status_code == 409):
            assert loser.headers['Content-Type'].startswith('application/json')
            assert loser.json()['code'] == 'claim_not_delivered'
            assert loser.json()['status'] == 409

        shown = get_job(server, job['id'])
        assert shown['job']['status'] == 'completed'
        assert shown['job']['escrowStatus'] == 'released'
        assert [p['type'] for p in shown['payments']] == ['escrow', 'release']
        assert [c['status'] for c in shown['claims']] == ['approved']
        assert server.terminate() == 0
    finally:
        stop(server)
    assert ledger_of(server.db) == []


def test_twenty_agents_claim_a_single_worker_job_at_once(tmp_path):
    server = LiveServer(tmp_path / 'claims.db').start()
    try:
        _, requester_key = new_account(server, 'requester')
        workers = [register_agent(server, f'worker-{i}') for i in range(20)]
        job = new_job(server, requester_key)

        answers = run_concurrently(20, lambda i: post(f'{server.url}/api/jobs/{job["id"]}/claim',
                                                      {'agentId': workers[i][0]['id']}, workers[i][1]))

        assert all(isinstance(a, requests.Response) for a in answers), answers
        assert sorted(a.status_code for a in answers) == [201] + [409] * 19
        assert {a.json()['code'] for a in answers if a.status_code == 409} == {'already_claimed'}
        winner = next(i for i, a in enumerate(answers) if a.status_code == 201)
        shown = get_job(server, job['id'])
        assert shown['job']['status'] == 'claimed'
        assert shown['job']['claimCount'] == 1
        assert [(c['agentId'], c['status']) for c in shown['claims']] == [(workers[winner][0]['id'], 'claimed')]
        assert server.terminate() == 0
    finally:
        stop(server)
    assert ledger_of(server.db) == []


# Crash -----------------------------------------------------------------------

def test_acknowledged_writes_survive_sigkill(tmp_path):
    path = tmp_path / 'crash.db'
    server = LiveServer(path).start()
    output = Output(server)
    lock = threading.Lock()
    acknowledged = {}    # job id -> the status its last 2xx answer reported
    in_doubt = {}        # job id -> the status an unanswered request would have brought it to
    halt = threading.Event()
    try:
        _, requester_key = new_account(server, 'requester')
        agent, worker_key = register_agent(server, 'worker')

        def work(n):
            session = requests.Session()
            i = 0
            while not halt.is_set():
                i += 1
                try:
                    answer = session.post(server.url + '/api/jobs', json=job_body(title=f'job {n}-{i}'),
                                          headers=bearer(requester_key), timeout=TIMEOUT)
                    if answer.status_code != 201:
                        raise AssertionError(f'POST /api/jobs answered {answer.status_code}: {answer.text}')
                    job_id = answer.json()['job']['id']
                    with lock:
                        acknowledged[job_id] = 'open'
                    if i % 2:
                        continue      # half the jobs stay open
                    base = f'{server.url}/api/jobs/{job_id}'
                    claim_id = None
                    steps = [('claim', {'agentId': agent['id']}, worker_key, 'claimed'),
                             ('deliver', None, worker_key, 'delivered'),
                             ('verify', None, requester_key, 'completed')]
                    for action, body, key, status in steps:
                        if action == 'deliver':
                            body = {'claimId': claim_id, 'deliverable': {'type': 'url', 'url': 'https://example.com/x'}}
                        elif action == 'verify':
                            body = {'claimId': claim_id, 'approved': True}
                        with lock:
                            in_doubt[job_id] = status
                        answer = session.post(f'{base}/{action}', json=body, headers=bearer(key), timeout=TIMEOUT)
                        if answer.status_code // 100 != 2:
                            raise AssertionError(f'{action} answered {answer.status_code}: {answer.text}')
                        if action == 'claim':
                            claim_id = answer.json()['claim']['id']
                        reported = answer.json()['job']['status']
                        with lock:
                            acknowledged[job_id] = reported
                            in_doubt.pop(job_id, None)
                        assert reported == status, (action, reported)
                except requests.RequestException:
                    return    # the server is gone: this write is simply unacknowledged

        failures = []

        def worker_thread(n):
            try:
                work(n)
            except Exception as exc:
                failures.append(exc)
                halt.set()

        threads = [threading.Thread(target=worker_thread, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        server.kill()
        assert server.process.returncode == -9
        halt.set()
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads)
        assert failures == []
        assert 'stopped' not in output.text()     # it was killed, not stopped
    finally:
        halt.set()
        stop(server)

    assert len(acknowledged) >= 20, 'too few writes were acknowledged to prove anything'
    assert 'completed' in acknowledged.values()

    restarted = LiveServer(path).start()
    try:
        found = {}
        offset = 0
        while True:
            page = requests.get(f'{restarted.url}/api/jobs', params={'limit': 200, 'offset': offset}, timeout=TIMEOUT)
            assert page.status_code == 200, page.text
            found.update({job['id']: job['status'] for job in page.json()['jobs']})
            offset += 200
            if offset >= page.json()['total']:
                break
        assert len(found) == page.json()['total']
        wrong = {job_id: (status, found.get(job_id)) for job_id, status in acknowledged.items()
                 if found.get(job_id) != status and found.get(job_id) != in_doubt.get(job_id)}
        assert wrong == {}, f'acknowledged jobs lost or changed (acknowledged, found): {wrong}'
        # A completed job shows its payout after the crash too.
        completed = next(job_id for job_id, status in acknowledged.items() if status == 'completed')
        assert [p['type'] for p in get_job(restarted, completed)['payments']] == ['escrow', 'release']
        assert restarted.terminate() == 0
    finally:
        stop(restarted)
    assert ledger_of(path) == []


# SIGTERM ---------------------------------------------------------------------

def test_sigterm_with_an_idle_kept_alive_connection_exits_0(tmp_path):
    server = LiveServer(tmp_path / 'term.db').start()
    try:
        session = requests.Session()
        assert session.get(server.url + '/api/health', timeout=TIMEOUT).status_code == 200
        # The session keeps its connection open (HTTP/1.1 keep-alive) while the server is told to stop.
        assert server.terminate(timeout=10) == 0
        output = server.output()
        assert 'stopping' in output
        assert output.rstrip().endswith('stopped')
        with pytest.raises(requests.ConnectionError):
            requests.get(server.url + '/api/health', timeout=TIMEOUT)
        session.close()
    finally:
        stop(server)


def test_sigterm_finishes_a_request_in_flight(tmp_path):
    """A request whose body is still arriving when SIGTERM comes is answered, then the server exits 0."""
    server = LiveServer(tmp_path / 'inflight.db').start()
    connection = None
    try:
        body = json.dumps({'name': 'in-flight'}).encode()
        connection = socket.create_connection(('127.0.0.1', server.port), timeout=TIMEOUT)
        connection.sendall(b'POST /api/accounts HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n'
                           b'Connection: close\r\nContent-Length: %d\r\n\r\n' % len(body) + body[:5])
        time.sleep(0.5)     # only ordering: the server has read the headers and waits in the handler for the body
        output = Output(server)
        server.process.send_signal(15)
        assert output.wait_for('stopping'), output.lines     # SIGTERM is handled while the request is in flight
        try:
            connection.sendall(body[5:])
            answer = b''
            while chunk := connection.recv(65536):
                answer += chunk
        except OSError as exc:
            answer = repr(exc).encode()
        head, _, payload = answer.partition(b'\r\n\r\n')
        assert head.startswith(b'HTTP/1.1 201'), answer[:300]
        assert json.loads(payload)['account']['name'] == 'in-flight'
        assert server.process.wait(10) == 0
        assert output.text().rstrip().endswith('stopped')
    finally:
        if connection is not None:
            connection.close()
        stop(server)
    db = mp.Database(server.db)
    try:
        assert db.value("SELECT count(*) FROM accounts WHERE name = 'in-flight'") == 1
    finally:
        db.close()


# TCP_NODELAY -----------------------------------------------------------------

class RecordingSocket:
    """Stands in for an accepted connection: records setsockopt; anything else is an error."""

    def __init__(self, events):
        self.events = events

    def setsockopt(self, level, option, value):
        self.events.append(('setsockopt', level, option, value))

    def __getattr__(self, name):
        raise AssertionError(f'the server used socket.{name} before handing the connection on')


def test_make_server_sets_tcp_nodelay_before_handling(monkeypatch, tmp_path):
    from gevent.pywsgi import WSGIServer
    events = []
    monkeypatch.setattr(WSGIServer, 'handle', lambda self, sock, address: events.append(('handle', sock, address)))
    server = http_server.make_server(lambda environ, start_response: [], mp.Settings(host='127.0.0.1', port=0))
    assert isinstance(server, WSGIServer)
    sock = RecordingSocket(events)
    server.handle(sock, ('127.0.0.1', 40000))
    assert events == [('setsockopt', socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
                      ('handle', sock, ('127.0.0.1', 40000))]


def test_accepted_connections_have_tcp_nodelay(monkeypatch):
    """On a real gevent server: the accepted socket has TCP_NODELAY on when the WSGI handler gets it."""
    import gevent.socket
    from gevent.pywsgi import WSGIServer
    seen = []
    original = WSGIServer.handle

    def handle(self, sock, address):
        seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        return original(self, sock, address)

    monkeypatch.setattr(WSGIServer, 'handle', handle)

    def app(environ, start_response):
        start_response('200 OK', [('Content-Type', 'text/plain'), ('Content-Length', '2')])
        return [b'ok']

    def one_request(server):
        server.start()
        try:
            client = gevent.socket.create_connection(('127.0.0.1', server.server_port), timeout=TIMEOUT)
            try:
                client.sendall(b'GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n')
                answer = b''
                while chunk := client.recv(4096):
                    answer += chunk
            finally:
                client.close()
        finally:
            server.stop()
        return answer

    answer = one_request(http_server.make_server(app, mp.Settings(host='127.0.0.1', port=0)))
    assert answer.startswith(b'HTTP/1.1 200') and answer.endswith(b'ok')
    assert len(seen) == 1 and seen[0] != 0
    # The control: a plain gevent server does not set it, so the check above means something.
    one_request(WSGIServer(('127.0.0.1', 0), app, log=None))
    assert len(seen) == 2 and seen[1] == 0


# Start-up --------------------------------------------------------------------

def serve_command(db, *args):
    return [sys.executable, str(ROOT / 'marketplace.py'), 'serve', '--db', str(db), *args]


@pytest.mark.parametrize('how', ['env', 'flag'])
def test_a_short_admin_key_is_refused_at_start(tmp_path, how):
    short = 'short-admin-key'
    if how == 'env':
        command, env = serve_command(tmp_path / 'a.db', '--port', str(free_port())), cli_env(MARKETPLACE_ADMIN_KEY=short)
    else:
        command, env = serve_command(tmp_path / 'a.db', '--port', str(free_port()), '--admin-key', short), cli_env()
    try:
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        pytest.fail('the server started with a 15-character admin key')
    assert done.returncode != 0
    message = (done.stdout + done.stderr).lower()
    assert 'admin key' in message
    assert '32 characters' in message
    assert short not in done.stdout + done.stderr      # the secret is not echoed


def test_port_from_the_environment(tmp_path):
    port = free_port()
    url = f'http://127.0.0.1:{port}'
    process = subprocess.Popen(serve_command(tmp_path / 'env.db'), cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, env=cli_env(MARKETPLACE_PORT=str(port),
                                                                     MARKETPLACE_ADMIN_KEY=ADMIN_KEY))
    try:
        wait_for_health(url, process)
        health = requests.get(url + '/api/health', timeout=TIMEOUT)
        assert health.json()['status'] == 'ok'
        # The admin key from the environment is an admin key: it may post for another account.
        other = post(url + '/api/accounts', {'name': 'other'}).json()['account']
        answer = post(url + '/api/jobs', job_body(requesterId=other['id']), ADMIN_KEY)
        assert answer.status_code == 201, answer.text
        assert answer.json()['job']['requesterId'] == other['id']
        process.send_signal(15)
        assert process.wait(10) == 0
        assert f'serving on http://127.0.0.1:{port} ' in process.stdout.read().decode()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_port_flag_wins_over_the_environment(tmp_path):
    env_port = free_port()
    server = LiveServer(tmp_path / 'flag.db', env={'MARKETPLACE_PORT': str(env_port)}).start()
    try:
        assert server.port != env_port
        assert requests.get(server.url + '/api/health', timeout=TIMEOUT).status_code == 200
        with pytest.raises(requests.ConnectionError):
            requests.get(f'http://127.0.0.1:{env_port}/api/health', timeout=TIMEOUT)
        assert server.terminate() == 0
        assert f'serving on http://127.0.0.1:{server.port} ' in server.output()
    finally:
        stop(server)


def test_a_bad_setting_in_the_environment_is_named(tmp_path):
    done = subprocess.run(serve_command(tmp_path / 'bad.db', '--port', str(free_port())), cwd=ROOT,
                          env=cli_env(MARKETPLACE_RATE_LIMITS='sometimes'), capture_output=True, text=True, timeout=15)
    assert done.returncode == 2
    assert 'MARKETPLACE_RATE_LIMITS' in done.stderr


# Health and errors over HTTP -------------------------------------------------

def test_health_over_http(live_server):
    answer = requests.get(live_server.url + '/api/health', timeout=TIMEOUT)
    assert answer.status_code == 200
    assert answer.headers['Content-Type'] == 'application/json; charset=utf-8'
    assert answer.json() == {'status': 'ok', 'version': '2.0.0', 'dbConnected': True, 'payments': 'simulated',
                             'rails': {'base': 'simulated', 'stripe': 'simulated'},
                             'replication': {'enabled': False, 'url': None}, 'role': 'primary'}


def test_the_access_log_line_and_answers_small_and_large(live_server):
    output = Output(live_server)
    small = requests.get(live_server.url + '/api/health?probe=access-line', timeout=TIMEOUT)
    key = requests.post(live_server.url + '/api/accounts', json={'name': 'poster'}, timeout=TIMEOUT).json()['apiKey']
    for n in range(40):     # a list of 40 jobs with 2 KB descriptions: an answer past ONE_SEND_BYTES
        assert requests.post(live_server.url + '/api/jobs', json=job_body(title=f'Large {n}', description='d' * 2000),
                             headers={'Authorization': f'Bearer {key}'}, timeout=TIMEOUT).status_code == 201
    large = requests.get(live_server.url + '/api/jobs?limit=40', timeout=TIMEOUT)
    assert len(large.content) > http_server.ONE_SEND_BYTES and len(large.json()['jobs']) == 40
    assert output.wait_for('"GET /api/jobs?limit=40 HTTP/1.1" 200')
    line = next(line for line in output.lines if 'probe=access-line' in line)
    # gevent's access line: address, the local time to the second, the request line, status, bytes, seconds
    assert re.fullmatch(r'127\.0\.0\.1 - - \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] "GET /api/health\?probe=access-line '
                        r'HTTP/1\.1" 200 (\d+) \d+\.\d{6}\n', line), line
    sent = int(line.split('" 200 ')[1].split()[0])
    assert sent > len(small.content) and sent < len(small.content) + 1000     # the head and the body
    big = next(line for line in output.lines if '"GET /api/jobs?limit=40 HTTP/1.1" 200' in line)
    assert int(big.split('" 200 ')[1].split()[0]) > len(large.content)


def test_unknown_path_is_a_json_404(live_server):
    answer = requests.get(live_server.url + '/api/no-such-thing', timeout=TIMEOUT)
    assert answer.status_code == 404
    assert answer.headers['Content-Type'] == 'application/json; charset=utf-8'
    body = answer.json()
    assert body['code'] == 'not_found'
    assert body['status'] == 404
    assert isinstance(body['error'], str) and body['error']
    # An unknown id on a known route is a JSON 404 too.
    missing = requests.get(live_server.url + '/api/jobs/' + '0' * 8 + '-0000-4000-8000-' + '0' * 12, timeout=TIMEOUT)
    assert missing.status_code == 404
    assert missing.json()['code'] == 'not_found'
