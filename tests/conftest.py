"""Shared test fixtures: an in-process app on a temporary database, factories, and a real server."""

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import marketplace as mp  # noqa: E402
import wiring  # noqa: E402

ADMIN_KEY = 'test-admin-key-' + 'a' * 32


def pytest_configure(config):
    config.addinivalue_line('markers', 'replication: Litestream and an S3 server for real (tests/test_replication.py, '
                                       'tests/test_read_replicas.py; in make test, about a minute together)')


class Response:
    """What one in-process request answered."""

    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers
        self.json = body if isinstance(body, (dict, list)) else None
        self.body = body

    def __repr__(self):
        return f'<Response {self.status} {self.json if self.json is not None else self.body!r:.200}>'


class Client:
    """Calls the WSGI app in-process, as a caller with an optional API key would."""

    def __init__(self, app):
        self.app = app

    def request(self, method, path, body=None, key=None, headers=None):
        return Response(*mp.call_app(self.app, method, path, body, key, headers))

    def get(self, path, **kwargs):
        return self.request('GET', path, **kwargs)

    def post(self, path, body=None, **kwargs):
        return self.request('POST', path, body, **kwargs)

    def patch(self, path, body=None, **kwargs):
        return self.request('PATCH', path, body, **kwargs)

    def delete(self, path, **kwargs):
        return self.request('DELETE', path, **kwargs)


def assert_error(answer, status, code, fields=None):
    """The answer is the JSON error of the contract: {error, code, status[, fields]}; return the body."""
    assert answer.status == status, answer
    body = answer.json
    assert isinstance(body, dict), answer
    assert body['status'] == status, body
    assert body['code'] == code, body
    assert isinstance(body['error'], str) and body['error'].strip(), body
    if fields is not None:
        assert isinstance(body.get('fields'), dict), body
        assert set(body['fields']) == set(fields), body
        for problem in body['fields'].values():
            assert isinstance(problem, str) and problem.strip(), body
    return body


def random_wallet():
    return '0x' + secrets.token_hex(20)


def in_hours(hours):
    return mp.iso(mp.now() + timedelta(hours=hours))


def make_account(client, name='someone'):
    """A member account through open registration: (account, key)."""
    answer = client.post('/api/accounts', {'name': name})
    assert answer.status == 201, answer
    return answer.json['account'], answer.json['apiKey']


def make_agent(client, key, **overrides):
    """An agent owned by the key's account: (agent, webhookSecret)."""
    body = {'name': 'agent', 'walletAddress': random_wallet(),
            'capabilities': {'categories': ['code'], 'languages': ['python']}}
    body.update(overrides)
    answer = client.post('/api/agents', body, key=key)
    assert answer.status == 201, answer
    return answer.json['agent'], answer.json['webhookSecret']


def job_body(**overrides):
    body = {'title': 'Fix the flaky test', 'description': 'It fails one run in ten.', 'category': 'code',
            'paymentAmount': '25.00', 'deadline': in_hours(48)}
    body.update(overrides)
    return body


def make_job(client, key, **overrides):
    answer = client.post('/api/jobs', job_body(**overrides), key=key)
    assert answer.status == 201, answer
    return answer.json['job']


def get_agent(client, agent):
    """GET /api/agents/:id: {agent, claims, reputationHistory}."""
    answer = client.get(f'/api/agents/{agent["id"]}')
    assert answer.status == 200, answer
    return answer.json


def expire(client):
    """Run the expiry sweep with the admin key; its answer."""
    answer = client.post('/api/jobs/expire', key=ADMIN_KEY)
    assert answer.status == 200, answer
    return answer.json


def auto_verify(client):
    """Run the auto-verify sweep with the admin key; its answer."""
    answer = client.post('/api/jobs/auto-verify', key=ADMIN_KEY)
    assert answer.status == 200, answer
    return answer.json


class Market:
    """A requester, a worker account with one agent, and shortcuts through a job's life."""

    def __init__(self, client):
        self.client = client
        self.requester, self.requester_key = make_account(client, 'requester')
        self.worker, self.worker_key = make_account(client, 'worker')
        self.agent, self.webhook_secret = make_agent(client, self.worker_key, name='worker-agent')

    def job(self, **overrides):
        return make_job(self.client, self.requester_key, **overrides)

    def claim(self, job, agent=None, key=None):
        answer = self.client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': (agent or self.agent)['id']},
                                  key=key or self.worker_key)
        assert answer.status == 201, answer
        return answer.json['claim']

    def deliver(self, job, claim, key=None):
        answer = self.client.post(f'/api/jobs/{job["id"]}/deliver',
                                  {'claimId': claim['id'], 'deliverable': {'type': 'url', 'url': 'https://example.com/out'}},
                                  key=key or self.worker_key)
        assert answer.status == 200, answer
        return answer.json['claim']

    def delivered_job(self, **overrides):
        """A job with one delivered claim: (job, claim)."""
        job = self.job(**overrides)
        claim = self.deliver(job, self.claim(job))
        return job, claim

    def verify(self, job, claim, approved, key=None):
        return self.client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': approved},
                                key=key or self.requester_key)

    def get_job(self, job):
        answer = self.client.get(f'/api/jobs/{job["id"]}')
        assert answer.status == 200, answer
        return answer.json


@pytest.fixture(autouse=True)
def real_clock():
    """Every test starts and ends with the real clock."""
    mp.CLOCK.set(None)
    yield mp.CLOCK
    mp.CLOCK.set(None)


@pytest.fixture
def settings(tmp_path):
    # allow_private_webhooks: webhook URLs are not resolved (no DNS in tests); the SSRF tests turn it off.
    return mp.Settings(db=str(tmp_path / 'test.db'), rate_limits='off', admin_key=ADMIN_KEY,
                       public_url='http://market.test', allow_private_webhooks=True)


@pytest.fixture
def app(settings):
    """The app on a fresh database; after the test, the ledger must balance and job_counts (kept by triggers)
    must hold the real number of jobs of each category and status."""
    app = wiring.make_app(settings)
    yield app
    problems = mp.ledger_problems(app.service.db)
    counted = app.service.db.rows('SELECT category, status, count(*) AS jobs FROM jobs GROUP BY 1, 2 ORDER BY 1, 2')
    kept = app.service.db.rows('SELECT category, status, jobs FROM job_counts WHERE jobs > 0 ORDER BY 1, 2')
    app.service.close()
    assert problems == []
    assert kept == counted


@pytest.fixture
def client(app):
    return Client(app)


@pytest.fixture
def market(client):
    return Market(client)


def free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


class LiveServer:
    """`marketplace.py serve` as a real process on 127.0.0.1."""

    def __init__(self, db, extra_args=(), env=None, new_session=False):
        self.db = str(db)
        self.new_session = new_session      # its own process group, which a test may SIGKILL whole
        self.port = free_port()
        self.url = f'http://127.0.0.1:{self.port}'
        self.extra_args = list(extra_args)
        self.env = dict(os.environ, **{'MARKETPLACE_ADMIN_KEY': ADMIN_KEY, 'MARKETPLACE_RATE_LIMITS': 'off', **(env or {})})
        self.process = None

    def start(self):
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / 'marketplace.py'), 'serve', '--db', self.db, '--port', str(self.port),
             *self.extra_args], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
            start_new_session=self.new_session)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f'server exited: {self.process.stdout.read().decode()}')
            try:
                if requests.get(self.url + '/api/health', timeout=1).status_code == 200:
                    return self
            except requests.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError('server did not start in 15 s')

    def kill(self):
        """SIGKILL: no chance to clean up."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def terminate(self, timeout=15):
        """SIGTERM, then the exit code."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def output(self):
        return self.process.stdout.read().decode()


@pytest.fixture
def live_server(tmp_path):
    """A running server on a fresh database; stopped after the test."""
    server = LiveServer(tmp_path / 'live.db').start()
    yield server
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait(10)


class Receiver:
    """A webhook receiver on 127.0.0.1 that records every request. It answers from `script`, a list of
    (status, headers, delay seconds) used one per request, then 200 to everything after."""

    def __init__(self):
        self.requests = []
        self.arrivals = []      # the headers of every request as it arrives, before any delay
        self.script = []
        self.arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get('Content-Length') or 0))
                status, headers, delay = receiver.script.pop(0) if receiver.script else (200, {}, 0)
                with receiver.arrived:
                    receiver.arrivals.append(dict(self.headers))
                    receiver.arrived.notify_all()
                if delay:
                    time.sleep(delay)
                with receiver.arrived:
                    receiver.requests.append({'path': self.path, 'headers': dict(self.headers), 'body': body,
                                              'status': status, 'at': time.monotonic()})
                    receiver.arrived.notify_all()
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header('Content-Length', '0')
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f'http://127.0.0.1:{self.server.server_address[1]}/hook'

    def wait_for(self, count, timeout=10):
        """The first `count` requests, waiting up to `timeout` seconds for them."""
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.requests) >= count, timeout), \
                f'{len(self.requests)} of {count} requests arrived in {timeout} s'
            return self.requests[:count]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.close()


@pytest.fixture(scope='session')
def anvil():
    """One local EVM for the whole session (tests/chain.py): anvil on 127.0.0.1, chain id 8453, with
    TestUSDC's code at the Base USDC address and at chain.OTHER_TOKEN. Started on first use. Tests
    that change the chain should use `usdc`, which puts the chain back as it was after each test."""
    import chain  # web3 loads only when a test needs the chain
    if chain.anvil_binary() is None:
        pytest.skip(f'anvil is not installed ({chain.ANVIL} is missing): run `make test`, which installs it '
                    'with npm install from package-lock.json')
    node = chain.Anvil().start()
    try:
        node.install_token(chain.USDC)
        node.install_token(chain.OTHER_TOKEN)
        yield node
    finally:
        node.stop()


@pytest.fixture
def usdc(anvil):
    """The TestUSDC contract (web3) at the Base USDC address; every change to the chain made during
    the test (blocks, balances, time, code) is reverted after it."""
    import chain
    # A revert takes the chain's clock back to the snapshot's newest block, which in a long session may be minutes
    # behind the wall clock that clients sign by (validAfter ten minutes back): a block at the wall clock's time
    # first, outside the snapshot, keeps every test's chain within a minute of it.
    if anvil.timestamp() < time.time() - 60:
        anvil.set_next_timestamp(int(time.time()))
        anvil.mine()
    snapshot = anvil.snapshot()
    yield anvil.token(chain.USDC)
    anvil.automine(True)
    anvil.revert(snapshot)
