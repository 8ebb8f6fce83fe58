"""Webhooks under abuse, against the real server: dead receivers delay only themselves, and a job post does not
wait for the fan-out to 20,000 agents.

CONTRACT.md section 19 (the third bullet); docs/api.md "Webhooks" and "Limits". The agents are written straight into
the database before the server starts (registering 20,000 through the API would take minutes); the dead receivers
are one socket on 127.0.0.1 that accepts every connection and never answers.
"""

import json
import socket
import statistics
import threading
import time

import requests

import marketplace as mp

from conftest import ADMIN_KEY, LiveServer, in_hours
from test_server import Output

TIMEOUT = 30


class DeadReceiver:
    """A socket on 127.0.0.1 that accepts every connection and never reads or answers (held until closed)."""

    def __init__(self):
        self.sock = socket.create_server(('127.0.0.1', 0), backlog=1024)
        self.held = []
        self.closed = False
        threading.Thread(target=self.accept_forever, daemon=True).start()

    def url(self, path):
        return f'http://127.0.0.1:{self.sock.getsockname()[1]}/{path}'

    def accept_forever(self):
        while not self.closed:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self):
        self.closed = True
        self.sock.close()
        for connection in self.held:
            connection.close()


def seed_agents(path, count, url_of, per_account=20):
    """`count` agents with webhooks (`url_of(i)`) and no categories (every job suits them), `per_account` to an
    account, written straight into a fresh database; also a requester with a key: (its key)."""
    db = mp.Database(path)
    db.migrate()
    moment = mp.now_iso()
    with db.transaction():
        _, key = mp.create_account(db, 'requester')
        account_id = None
        for i in range(count):
            if i % per_account == 0:
                account_id = mp.new_id()
                db.insert('accounts', {'id': account_id, 'name': f'account {i}', 'role': 'member',
                                       'created_at': moment})
            db.insert('agents', {'id': mp.new_id(), 'account_id': account_id, 'name': f'agent {i}',
                                 'wallet_address': '0x' + f'{i + 1:040x}', 'webhook_url': url_of(i),
                                 'webhook_secret': mp.new_webhook_secret(), 'capabilities': '{}', 'pricing': '{}',
                                 'reputation': 0, 'created_at': moment, 'updated_at': moment})
    db.close()
    return key


def post_job(server, key, title):
    """POST /api/jobs; (the answer, its seconds)."""
    started = time.monotonic()
    answer = requests.post(server.url + '/api/jobs', timeout=TIMEOUT, headers={'Authorization': f'Bearer {key}'},
                           json={'title': title, 'description': 'Under load.', 'category': 'code',
                                 'paymentAmount': '5.00', 'deadline': in_hours(5)})
    return answer, time.monotonic() - started


def register_live_agent(server, url):
    """An account with one agent whose webhook is `url` (through the API): (agent, key)."""
    headers = {'Authorization': f'Bearer {ADMIN_KEY}'}
    account = requests.post(server.url + '/api/accounts', json={'name': 'live'}, headers=headers, timeout=TIMEOUT)
    assert account.status_code == 201, account.text
    key = account.json()['apiKey']
    agent = requests.post(server.url + '/api/agents', timeout=TIMEOUT, headers={'Authorization': f'Bearer {key}'},
                          json={'name': 'live', 'walletAddress': '0x' + 'f' * 40, 'webhookUrl': url})
    assert agent.status_code == 201, agent.text
    return agent.json()['agent'], key


def count_deliveries(path):
    db = mp.Database(path)
    try:
        return db.value('SELECT count(*) FROM webhook_deliveries'), db.value(
            'SELECT count(DISTINCT agent_id || event || payload) FROM webhook_deliveries')
    finally:
        db.close()


def test_150_dead_receivers_do_not_delay_a_live_one(tmp_path, receiver):
    dead = DeadReceiver()
    path = tmp_path / 'dead.db'
    key = seed_agents(path, 150, lambda i: dead.url(f'dead-{i}'), per_account=1)     # 150 accounts
    server = LiveServer(path, ['--allow-private-webhooks', '--webhook-timeout', '10']).start()
    Output(server)      # thousands of failed attempts are logged: more than a pipe holds
    try:
        agent, _ = register_live_agent(server, receiver.url)
        for round_number in range(3):
            answer, _ = post_job(server, key, f'round {round_number}')
            answered = time.monotonic()
            assert answer.status_code == 201, answer.text
            job_id = answer.json()['job']['id']
            arrived = receiver.wait_for(round_number + 1, timeout=10)[round_number]
            assert json.loads(arrived['body'])['data']['jobId'] == job_id
            assert json.loads(arrived['body'])['data']['agentId'] == agent['id']
            # one that waited behind a dead receiver would come after its 10 s time-out: half of it is generous
            assert arrived['at'] - answered < 5.0, f'job.new arrived {arrived["at"] - answered:.2f} s after the 201'
        # The dead ones are being tried meanwhile (held, unanswered), 150 connections at least.
        deadline = time.monotonic() + 5
        while len(dead.held) < 150 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(dead.held) >= 150
    finally:
        server.kill()
        dead.close()


def test_a_job_post_with_20000_webhook_agents_waits_for_none_of_them(tmp_path):
    """The post writes one outbox row, not 20,000 deliveries: at its 201 the fan-out has not finished, and its
    median time is within a generous factor of a post's on a server with no agent (timed in turns, so that load
    on the machine slows both alike; the 20,000 deliveries written in the request would cost a hundred times)."""
    dead = DeadReceiver()
    path = tmp_path / 'crowd.db'
    agents = 20_000
    key = seed_agents(path, agents, lambda i: dead.url(f'hook-{i}'))
    bare_key = seed_agents(tmp_path / 'bare.db', 0, None)
    server = LiveServer(path, ['--allow-private-webhooks']).start()
    bare = LiveServer(tmp_path / 'bare.db', ['--allow-private-webhooks']).start()
    Output(server)
    Output(bare)
    try:
        answer, _ = post_job(server, key, 'warm-up')    # the first request of a process pays for imports and caches
        assert answer.status_code == 201, answer.text
        assert count_deliveries(path)[0] < agents       # answered before its deliveries were all written
        post_job(bare, bare_key, 'warm-up')
        crowded, alone = [], []
        for i in range(5):
            answer, seconds = post_job(server, key, f'crowded {i}')
            assert answer.status_code == 201, answer.text
            crowded.append(seconds)
            answer, seconds = post_job(bare, bare_key, f'alone {i}')
            assert answer.status_code == 201, answer.text
            alone.append(seconds)
            time.sleep(0.02)        # the fan-out of the posts before is under way
        print(f'\na post: {statistics.median(crowded) * 1000:.1f} ms (median) with 20,000 webhook agents, '
              f'{statistics.median(alone) * 1000:.1f} ms with none')
        assert statistics.median(crowded) < 25 * statistics.median(alone), (crowded, alone)

        expected = 6 * agents
        made, stalled = 0, time.monotonic() + 30        # waits as long as the fan-out moves (slower under load)
        while made < expected and time.monotonic() < stalled:
            time.sleep(0.5)
            now_made = count_deliveries(path)[0]
            if now_made > made:
                made, stalled = now_made, time.monotonic() + 30
        assert count_deliveries(path) == (expected, expected)       # every one made, none twice
        health = requests.get(server.url + '/api/health', timeout=TIMEOUT)
        assert health.status_code == 200
    finally:
        server.kill()
        bare.kill()
        dead.close()
