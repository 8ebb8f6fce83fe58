"""Idempotency keys on every POST and PATCH (CONTRACT.md 14, docs/api.md "Retrying safely").

Through the real server: a replay is the first answer byte for byte with Idempotent-Replayed; another body, path or
method is 422; keys are per account, and per client address without an API key; twelve threads with one key make
one job; SIGKILL in the middle of keyed posts loses no answer and doubles no job. In-process: the key's form,
validation answers replayed, the 24-hour sweep, a paid x402 call, and every write route (a walk of ROUTES: each has a
replay test below or a reason not to take keys).
"""

import base64
import concurrent.futures
import http.client
import json
import subprocess
import sys
import threading
import time
import uuid

import pytest
import requests

import marketplace as mp
import wiring
from conftest import (ADMIN_KEY, ROOT, LiveServer, assert_error, in_hours, job_body, make_account, make_agent,
                      make_job)
from test_disputes import disputed_job, make_arbitrators


def new_key():
    return str(uuid.uuid4())


# Through the real server -----------------------------------------------------

@pytest.fixture(scope='module')
def server(tmp_path_factory):
    """One real server for the module's live tests (each makes its own accounts)."""
    server = LiveServer(tmp_path_factory.mktemp('idem') / 'idem.db').start()
    yield server
    server.process.kill()
    server.process.wait(10)


def register(server, name='someone'):
    answer = requests.post(server.url + '/api/accounts', json={'name': name}, timeout=10)
    assert answer.status_code == 201, answer.text
    return answer.json()['apiKey']


def post(server, path, body, api_key=None, idempotency_key=None, method='POST'):
    headers = {}
    if api_key:
        headers['Authorization'] = f'Bearer {api_key}'
    if idempotency_key is not None:
        headers['Idempotency-Key'] = idempotency_key
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.request(method, server.url + path, data=data, timeout=30,
                            headers=dict(headers, **{'Content-Type': 'application/json'}))


def jobs_titled(db_path, title):
    """(jobs with this title, their escrow records), read from the database file."""
    db = mp.Database(db_path)
    try:
        jobs = db.value('SELECT count(*) FROM jobs WHERE title = :title', {'title': title})
        escrows = db.value('''SELECT count(*) FROM payments p JOIN jobs j ON j.id = p.job_id
                              WHERE j.title = :title AND p.type = 'escrow' ''', {'title': title})
        return jobs, escrows
    finally:
        db.close()


def test_a_replay_is_the_first_answer_byte_for_byte(server):
    api_key, key = register(server), new_key()
    body = job_body(title=f'replayed {key}')
    first = post(server, '/api/jobs', body, api_key, key)
    assert first.status_code == 201, first.text
    assert 'Idempotent-Replayed' not in first.headers
    again = post(server, '/api/jobs', body, api_key, key)
    assert (again.status_code, again.content, again.headers['Content-Type']) == \
        (201, first.content, first.headers['Content-Type'])
    assert again.headers['Idempotent-Replayed'] == 'true'
    # the body is compared as parsed JSON: other spacing and key order are the same request
    reordered = json.dumps(dict(reversed(list(body.items()))), indent=2).encode()
    third = post(server, '/api/jobs', reordered, api_key, key)
    assert (third.status_code, third.content, third.headers['Idempotent-Replayed']) == (201, first.content, 'true')
    assert jobs_titled(server.db, body['title']) == (1, 1)


def test_the_same_key_for_another_request_is_422(server):
    api_key, key = register(server), new_key()
    body = job_body(title=f'first {key}')
    first = post(server, '/api/jobs', body, api_key, key)
    assert first.status_code == 201, first.text
    job_id = first.json()['job']['id']
    for path, other, method in [('/api/jobs', dict(body, paymentAmount='26.00'), 'POST'),      # another body
                                (f'/api/jobs/{job_id}/cancel', {}, 'POST'),                    # another path
                                (f'/api/accounts/{job_id}', {'x402Exempt': True}, 'PATCH')]:   # another method
        refused = post(server, path, other, api_key, key, method=method)
        assert refused.status_code == 422, refused.text
        assert refused.json() == {'error': refused.json()['error'], 'code': 'idempotency_key_reused', 'status': 422}
        assert 'Idempotent-Replayed' not in refused.headers
    assert requests.get(f'{server.url}/api/jobs/{job_id}', timeout=10).json()['job']['status'] == 'open'
    assert jobs_titled(server.db, body['title']) == (1, 1)


def test_a_validation_answer_is_replayed_by_the_real_server(server):
    api_key, key = register(server), new_key()
    body = job_body(title=f'invalid {key}', paymentAmount=25)            # a JSON number: 400 (money is a string)
    refused = post(server, '/api/jobs', body, api_key, key)
    assert (refused.status_code, refused.json()['code']) == (400, 'validation_failed'), refused.text
    again = post(server, '/api/jobs', body, api_key, key)
    assert (again.status_code, again.content, again.headers['Idempotent-Replayed']) == (400, refused.content, 'true')
    corrected = post(server, '/api/jobs', dict(body, paymentAmount='25.00'), api_key, key)     # another body
    assert (corrected.status_code, corrected.json()['code']) == (422, 'idempotency_key_reused')
    assert jobs_titled(server.db, body['title']) == (0, 0)


def test_keys_are_per_account(server):
    key = new_key()
    body = job_body(title=f'two accounts {key}')
    answers = [post(server, '/api/jobs', body, register(server), key) for _ in range(2)]
    assert [a.status_code for a in answers] == [201, 201]
    assert answers[0].json()['job']['id'] != answers[1].json()['job']['id']
    assert 'Idempotent-Replayed' not in answers[1].headers
    assert jobs_titled(server.db, body['title']) == (2, 2)


def register_from(server, source, key, name):
    """POST /api/accounts with an Idempotency-Key, from the address `source`: (status, headers, body bytes)."""
    connection = http.client.HTTPConnection('127.0.0.1', server.port, timeout=10, source_address=(source, 0))
    try:
        connection.request('POST', '/api/accounts', json.dumps({'name': name}),
                           {'Content-Type': 'application/json', 'Idempotency-Key': key})
        answer = connection.getresponse()
        return answer.status, answer.headers, answer.read()
    finally:
        connection.close()


def test_without_an_api_key_keys_are_per_client_address(server):
    key = new_key()
    first = register_from(server, '127.0.0.1', key, 'open registration')
    again = register_from(server, '127.0.0.1', key, 'open registration')
    other = register_from(server, '127.0.0.2', key, 'open registration')
    assert (first[0], again[0], other[0]) == (201, 201, 201)
    assert again[2] == first[2] and again[1]['Idempotent-Replayed'] == 'true'      # the same apiKey, once made
    assert json.loads(other[2])['apiKey'] != json.loads(first[2])['apiKey'] and 'Idempotent-Replayed' not in other[1]
    db = mp.Database(server.db)
    try:
        assert db.value("SELECT count(*) FROM accounts WHERE name = 'open registration'") == 2
        # the database holds the answer sealed: neither the key nor the apiKey it carries
        api_key = json.loads(first[2])['apiKey']
        for row in db.rows('SELECT * FROM idempotency_keys'):
            assert key not in json.dumps(row, default=bytes.hex) and api_key.encode() not in row['sealed']
    finally:
        db.close()


def test_twelve_threads_with_one_key_make_one_job(server):
    api_key, key = register(server), new_key()
    body = job_body(title=f'twelve at once {key}')
    start = threading.Barrier(12)

    def send(_):
        start.wait(10)
        return post(server, '/api/jobs', body, api_key, key)
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(send, range(12)))
    made = [a for a in answers if a.status_code == 201 and 'Idempotent-Replayed' not in a.headers]
    assert len(made) == 1, [(a.status_code, a.text) for a in answers]
    for answer in answers:
        if answer.status_code == 201:
            assert answer.content == made[0].content
        else:
            assert (answer.status_code, answer.json()['code']) == (409, 'idempotency_in_progress'), answer.text
    assert jobs_titled(server.db, body['title']) == (1, 1)
    assert post(server, '/api/jobs', body, api_key, key).content == made[0].content        # and after, a replay


def test_sigkill_in_the_middle_of_keyed_posts(tmp_path):
    """Keyed posts stream in from a thread pool, the server is killed (-9) among them and started again on the same
    database: every answer a client got is replayed identically, every key is one job, and the ledger balances."""
    path = tmp_path / 'killed.db'
    server = LiveServer(path).start()
    api_key = register(server)
    keys = [new_key() for _ in range(60)]
    bodies = {key: job_body(title=f'killed {key}') for key in keys}
    received = {}

    def send(key):
        try:
            answer = post(server, '/api/jobs', bodies[key], api_key, key)
        except requests.RequestException:
            return
        if answer.status_code == 201:
            received[key] = answer.content
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(send, key) for key in keys]
            deadline = time.monotonic() + 20
            while len(received) < 15 and time.monotonic() < deadline:
                time.sleep(0.01)
            server.kill()
            concurrent.futures.wait(futures)
        assert 15 <= len(received) < len(keys)
        server = LiveServer(path).start()
        for key in keys:
            again = post(server, '/api/jobs', bodies[key], api_key, key)
            assert again.status_code == 201, again.text
            if key in received:
                assert (again.content, again.headers['Idempotent-Replayed']) == (received[key], 'true')
            assert jobs_titled(path, f'killed {key}') == (1, 1)
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait(10)
    check = subprocess.run([sys.executable, str(ROOT / 'marketplace.py'), 'check-ledger', '--db', str(path)],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert check.returncode == 0, check.stdout + check.stderr


# In-process: the key, validation answers, expiry --------------------------------

def keyed(client, method, path, body=None, key=None, idempotency_key=None):
    return client.request(method, path, body, key=key, headers={'Idempotency-Key': idempotency_key or new_key()})


@pytest.mark.parametrize('bad', ['', 'k' * 256, 'caf\xe9', 'tab\there'])
def test_a_key_must_be_1_to_255_printable_ascii_characters(client, bad):
    _, api_key = make_account(client)
    answer = client.post('/api/jobs', job_body(), key=api_key, headers={'Idempotency-Key': bad})
    assert_error(answer, 400, 'invalid_idempotency_key', fields=['Idempotency-Key'])
    assert client.app.service.db.value('SELECT count(*) FROM jobs') == 0
    longest = keyed(client, 'POST', '/api/jobs', job_body(), api_key, '~' * 255)
    assert longest.status == 201, longest


def test_a_validation_answer_is_replayed_even_once_its_cause_is_gone(client):
    _, owner_key = make_account(client, 'owner')
    job = make_job(client, owner_key)
    _, worker_key = make_account(client, 'worker')
    key = new_key()
    refused = keyed(client, 'POST', f'/api/jobs/{job["id"]}/claim', {}, worker_key, key)
    assert_error(refused, 400, 'validation_failed', fields=['agentId'])      # the worker owns no agent yet
    make_agent(client, worker_key)
    again = keyed(client, 'POST', f'/api/jobs/{job["id"]}/claim', {}, worker_key, key)
    assert (again.status, again.json, again.headers['Idempotent-Replayed']) == (400, refused.json, 'true')
    assert client.app.service.db.value('SELECT count(*) FROM claims') == 0
    fresh = keyed(client, 'POST', f'/api/jobs/{job["id"]}/claim', {}, worker_key)
    assert fresh.status == 201, fresh


def test_answers_are_kept_24_hours(client, app, settings, real_clock):
    _, api_key = make_account(client)
    key, body = new_key(), job_body(title='kept a day', deadline=in_hours(72))
    first = keyed(client, 'POST', '/api/jobs', body, api_key, key)
    assert first.status == 201, first
    db = app.service.db
    real_clock.advance(hours=23, minutes=59)
    mp.run_sweeps(db, settings)
    assert db.value('SELECT count(*) FROM idempotency_keys') == 1
    again = keyed(client, 'POST', '/api/jobs', body, api_key, key)
    assert (again.status, again.json, again.headers['Idempotent-Replayed']) == (201, first.json, 'true')
    real_clock.advance(minutes=2)
    mp.run_sweeps(db, settings)
    assert db.value('SELECT count(*) FROM idempotency_keys') == 0
    later = keyed(client, 'POST', '/api/jobs', body, api_key, key)
    assert later.status == 201 and 'Idempotent-Replayed' not in later.headers
    assert db.value("SELECT count(*) FROM jobs WHERE title = 'kept a day'") == 2


def test_errors_of_the_service_are_not_stored(client, app):
    """A 429 (or any 5xx) leaves the key free: the same request runs when sent again."""
    _, api_key = make_account(client)
    key = new_key()
    app.service.settings.rate_limits = 'on'
    app.service.limiter.scale = 0.005       # one post an hour (for a key: 20 x 10 x 0.005)
    try:
        assert keyed(client, 'POST', '/api/jobs', job_body(), api_key).status == 201
        limited = keyed(client, 'POST', '/api/jobs', job_body(), api_key, key)
        assert_error(limited, 429, 'rate_limited')
    finally:
        app.service.settings.rate_limits = 'off'
    assert app.service.db.value('SELECT count(*) FROM idempotency_keys') == 1
    assert keyed(client, 'POST', '/api/jobs', job_body(), api_key, key).status == 201


def test_a_request_running_with_the_key_makes_the_second_409(client, app):
    _, api_key = make_account(client)
    key = new_key()
    scope = mp.idempotency_scope(mp.account_for_key(app.service.db, api_key), '127.0.0.1')
    with app.service.running_keys.running_once(mp.idempotency_key_hash(scope, key)):
        busy = keyed(client, 'POST', '/api/jobs', job_body(), api_key, key)
    assert_error(busy, 409, 'idempotency_in_progress')
    assert 'Idempotent-Replayed' not in busy.headers
    assert keyed(client, 'POST', '/api/jobs', job_body(), api_key, key).status == 201


# A paid x402 call ------------------------------------------------------------

@pytest.mark.parametrize('version', [1, 2])
def test_a_paid_call_is_replayed_with_its_payment_response_and_paid_once(tmp_path, anvil, usdc, version):
    from test_cards import header
    from test_x402 import ESCROW_KEY, PAY_TO, REQUIREMENTS_V2, pay, proof
    from test_x402_verifier import header_of
    settings = mp.Settings(db=str(tmp_path / 'paid.db'), rate_limits='off', admin_key=ADMIN_KEY,
                           public_url='http://market.test', rpc_url=anvil.url, escrow_key=ESCROW_KEY,
                           confirmations=1, x402_price=mp.parse_prices('POST /api/jobs=0.01'), x402_pay_to=PAY_TO,
                           allow_simulated_rails=True)
    app = wiring.make_app(settings)
    try:
        from conftest import Client
        client = Client(app)
        _, api_key = make_account(client)
        tx_hash = pay(anvil)
        key, payment = new_key(), proof(tx_hash, call=('POST', '/api/jobs'))
        if version == 2:        # the same proof as x402 version 2 carries it, naming the requirements it pays
            payload = json.loads(base64.b64decode(payment))['payload']
            payment = header_of({'x402Version': 2, 'accepted': REQUIREMENTS_V2, 'payload': payload})
        sent, receipt = {1: ('X-PAYMENT', 'X-PAYMENT-RESPONSE'), 2: ('PAYMENT-SIGNATURE', 'PAYMENT-RESPONSE')}[version]
        body = job_body(title='paid with x402', paymentCurrency='USD')      # simulated: no funding transfer
        first = client.post('/api/jobs', body, key=api_key, headers={'Idempotency-Key': key, sent: payment})
        assert first.status == 201, first
        again = client.post('/api/jobs', body, key=api_key, headers={'Idempotency-Key': key, sent: payment})
        assert (again.status, again.json) == (201, first.json)
        paid = json.loads(base64.b64decode(header(first, receipt)))
        assert (paid['success'], paid['transaction'], paid['network']) == \
            (True, tx_hash, {1: 'base', 2: 'eip155:8453'}[version])
        assert header(again, receipt) == header(first, receipt)
        assert header(again, 'Idempotent-Replayed') == 'true'
        db = app.service.db
        assert (db.value('SELECT count(*) FROM jobs'), db.value('SELECT count(*) FROM x402_payments')) == (1, 1)
        assert paid['paymentSpent'] is True and db.value('SELECT granted_at FROM x402_payments') is not None
        other = client.post('/api/jobs', body, key=api_key, headers={'Idempotency-Key': new_key(), sent: payment})
        assert assert_error(other, 402, 'payment_replayed')['paymentSpent'] is True     # spent with the answer stored
        assert db.value('SELECT count(*) FROM jobs') == 1
        unpaid = client.post('/api/jobs', body, key=api_key, headers={'Idempotency-Key': new_key()})
        assert_error(unpaid, 402, 'payment_required')
        assert db.value('SELECT count(*) FROM idempotency_keys') == 1      # a 402 is not stored: pay, send again
    finally:
        app.service.close()


# Every write route takes a key -------------------------------------------------

def twice(client, method, path, body=None, key=None, status=200):
    """The same keyed request twice: the second is the first's answer with Idempotent-Replayed; the first answer."""
    idempotency_key = new_key()
    first = keyed(client, method, path, body, key, idempotency_key)
    assert first.status == status, first
    assert 'Idempotent-Replayed' not in first.headers
    again = keyed(client, method, path, body, key, idempotency_key)
    assert (again.status, again.body, again.headers['Idempotent-Replayed']) == (status, first.body, 'true')
    assert again.headers.get('Location') == first.headers.get('Location')
    return first


def count(client, sql, **params):
    return client.app.service.db.value(sql, params)


def replay_x402_check(client, market):
    twice(client, 'POST', '/api/x402', status=404)      # x402 off here; with it on: the paid call above


def replay_account(client, market):
    answer = twice(client, 'POST', '/api/accounts', {'name': 'once'}, status=201)
    assert count(client, "SELECT count(*) FROM accounts WHERE name = 'once'") == 1
    assert client.get('/api/agents', key=answer.json['apiKey']).status == 200


def replay_account_patch(client, market):
    twice(client, 'PATCH', f'/api/accounts/{market.requester["id"]}', {'x402Exempt': True}, ADMIN_KEY)
    assert count(client, 'SELECT x402_exempt FROM accounts WHERE id = :id', id=market.requester['id']) == 1


def replay_agent_register(client, market):
    body = {'name': 'registered once', 'walletAddress': '0x' + '1' * 40}
    twice(client, 'POST', '/api/agents/register', body, status=201)
    assert count(client, "SELECT count(*) FROM agents WHERE name = 'registered once'") == 1


def replay_agent(client, market):
    body = {'name': 'made once', 'walletAddress': '0x' + '2' * 40}
    answer = twice(client, 'POST', '/api/agents', body, market.worker_key, status=201)
    assert count(client, "SELECT count(*) FROM agents WHERE name = 'made once'") == 1
    assert count(client, 'SELECT webhook_secret FROM agents WHERE id = :id',
                 id=answer.json['agent']['id']) == answer.json['webhookSecret']


def replay_agent_patch(client, market):
    twice(client, 'PATCH', f'/api/agents/{market.agent["id"]}', {'name': 'renamed'}, market.worker_key)
    assert count(client, 'SELECT name FROM agents WHERE id = :id', id=market.agent['id']) == 'renamed'


def replay_webhook_secret(client, market):
    answer = twice(client, 'POST', f'/api/agents/{market.agent["id"]}/webhook-secret', None, market.worker_key)
    assert count(client, 'SELECT webhook_secret FROM agents WHERE id = :id',
                 id=market.agent['id']) == answer.json['webhookSecret']      # rotated once


def replay_stripe_onboarding(client, market):
    twice(client, 'POST', f'/api/agents/{market.agent["id"]}/stripe/onboarding', None, market.worker_key, status=404)


def replay_redeliver(client, market):
    agent, _ = make_agent(client, market.worker_key, name='hooked', webhookUrl='http://127.0.0.1:9/hook')
    market.job()
    [delivery] = client.app.service.db.rows('SELECT id FROM webhook_deliveries WHERE agent_id = :id',
                                           {'id': agent['id']})
    client.app.service.db.execute("UPDATE webhook_deliveries SET status = 'failed', attempts = 5 WHERE id = :id",
                                  {'id': delivery['id']})
    twice(client, 'POST', f'/api/agents/{agent["id"]}/webhooks/{delivery["id"]}/redeliver', None, market.worker_key,
          status=202)
    assert count(client, 'SELECT attempts FROM webhook_deliveries WHERE id = :id', id=delivery['id']) == 0


def replay_webhook_test(client, market, receiver):
    agent, _ = make_agent(client, market.worker_key, name='tested', webhookUrl=receiver.url)
    answer = twice(client, 'POST', '/api/webhooks/test', {'agentId': agent['id']}, market.worker_key)
    assert answer.json['success'] is True
    time.sleep(0.2)
    assert len(receiver.requests) == 1      # sent once


def replay_job(client, market):
    twice(client, 'POST', '/api/jobs', job_body(title='posted once'), market.requester_key, status=201)
    assert count(client, "SELECT count(*) FROM jobs WHERE title = 'posted once'") == 1
    assert count(client, "SELECT count(*) FROM payments WHERE type = 'escrow'") == 1


def replay_claim(client, market):
    job = market.job()
    twice(client, 'POST', f'/api/jobs/{job["id"]}/claim', {'agentId': market.agent['id']}, market.worker_key,
          status=201)
    assert count(client, 'SELECT count(*) FROM claims WHERE job_id = :id', id=job['id']) == 1


def replay_delivery(path):
    def replay(client, market):
        job = market.job()
        claim = market.claim(job)
        body = {'claimId': claim['id'], 'deliverable': {'type': 'url', 'url': 'https://example.com/out'}}
        twice(client, 'POST', f'/api/jobs/{job["id"]}/{path}', body, market.worker_key)
        assert count(client, 'SELECT status FROM claims WHERE id = :id', id=claim['id']) == 'delivered'
    return replay


def replay_verify(client, market):
    job, claim = market.delivered_job()
    twice(client, 'POST', f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': True},
          market.requester_key)
    assert count(client, "SELECT count(*) FROM payments WHERE job_id = :id AND type = 'release'", id=job['id']) == 1


def replay_cancel(client, market):
    job = market.job()
    twice(client, 'POST', f'/api/jobs/{job["id"]}/cancel', None, market.requester_key)
    assert count(client, "SELECT count(*) FROM payments WHERE job_id = :id AND type = 'refund'", id=job['id']) == 1


def replay_release(client, market, real_clock):
    job = market.job()
    claim = market.claim(job)
    real_clock.advance(hours=25)        # past claimTimeoutHours: the requester may free the slot
    twice(client, 'POST', f'/api/jobs/{job["id"]}/claims/{claim["id"]}/release', None, market.requester_key)
    assert count(client, 'SELECT status FROM claims WHERE id = :id', id=claim['id']) == 'expired'


def replay_dispute(client, market):
    job, claim = market.delivered_job()
    twice(client, 'POST', f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'It does not build.'},
          market.requester_key, status=201)
    assert count(client, 'SELECT count(*) FROM disputes WHERE job_id = :id', id=job['id']) == 1


def replay_dispute_decision(client, market):
    job, claim, dispute = disputed_job(market)
    twice(client, 'PATCH', f'/api/disputes/{dispute["id"]}', {'outcome': 'worker', 'resolution': 'It builds.'},
          ADMIN_KEY)
    assert count(client, "SELECT count(*) FROM payments WHERE job_id = :id AND type = 'release'", id=job['id']) == 1


def replay_vote(client, market):
    (arbitrator, key), _, _ = make_arbitrators(client, 3)
    _, _, dispute = disputed_job(market)
    body = {'arbitratorId': arbitrator['id'], 'vote': 'worker', 'reasoning': 'It builds.'}
    twice(client, 'POST', f'/api/disputes/{dispute["id"]}/vote', body, key, status=201)
    assert count(client, 'SELECT count(*) FROM votes WHERE dispute_id = :id', id=dispute['id']) == 1


def replay_arbitrator(client, market):
    body = {'name': 'arbiter once', 'walletAddress': '0x' + '3' * 40}
    twice(client, 'POST', '/api/arbitrators', body, ADMIN_KEY, status=201)
    assert count(client, "SELECT count(*) FROM arbitrators WHERE name = 'arbiter once'") == 1


def replay_arbitrator_patch(client, market):
    [(arbitrator, _)] = make_arbitrators(client, 1)
    twice(client, 'PATCH', f'/api/arbitrators/{arbitrator["id"]}', {'status': 'suspended'}, ADMIN_KEY)
    assert count(client, 'SELECT status FROM arbitrators WHERE id = :id', id=arbitrator['id']) == 'suspended'


def replay_expire(client, market, real_clock):
    market.job(deadline=in_hours(1))
    real_clock.advance(hours=2)
    first = twice_around(client, '/api/jobs/expire', lambda: market.job(deadline=in_hours(1)), real_clock)
    assert first.json['expired'] == 1


def replay_auto_verify(client, market, real_clock):
    market.delivered_job(verificationWindowHours=1)
    real_clock.advance(hours=2)
    first = twice_around(client, '/api/jobs/auto-verify', lambda: market.delivered_job(verificationWindowHours=1),
                         real_clock)
    assert first.json['autoApproved'] == 1


def twice_around(client, path, make_more, real_clock):
    """An admin sweep with a key, then more for it to do, then the sweep again with the key: a replay, and the
    new work left undone (the sweep did not run again)."""
    idempotency_key = new_key()
    first = keyed(client, 'POST', path, None, ADMIN_KEY, idempotency_key)
    assert first.status == 200, first
    more = make_more()
    real_clock.advance(hours=2)
    again = keyed(client, 'POST', path, None, ADMIN_KEY, idempotency_key)
    assert (again.status, again.json, again.headers['Idempotent-Replayed']) == (200, first.json, 'true')
    job = more[0] if isinstance(more, tuple) else more
    assert client.get(f'/api/jobs/{job["id"]}').json['job']['status'] in ('open', 'delivered')
    return first


REPLAY_TESTS = {
    ('POST', '/api/x402'): replay_x402_check,
    ('POST', '/api/accounts'): replay_account,
    ('PATCH', '/api/accounts/<account_id>'): replay_account_patch,
    ('POST', '/api/agents/register'): replay_agent_register,
    ('POST', '/api/agents'): replay_agent,
    ('PATCH', '/api/agents/<agent_id>'): replay_agent_patch,
    ('POST', '/api/agents/<agent_id>/webhook-secret'): replay_webhook_secret,
    ('POST', '/api/agents/<agent_id>/stripe/onboarding'): replay_stripe_onboarding,
    ('POST', '/api/agents/<agent_id>/webhooks/<delivery_id>/redeliver'): replay_redeliver,
    ('POST', '/api/webhooks/test'): replay_webhook_test,
    ('POST', '/api/jobs'): replay_job,
    ('POST', '/api/jobs/<job_id>/claim'): replay_claim,
    ('POST', '/api/jobs/<job_id>/deliver'): replay_delivery('deliver'),
    ('POST', '/api/jobs/<job_id>/submit'): replay_delivery('submit'),
    ('POST', '/api/jobs/<job_id>/verify'): replay_verify,
    ('POST', '/api/jobs/<job_id>/cancel'): replay_cancel,
    ('POST', '/api/jobs/<job_id>/claims/<claim_id>/release'): replay_release,
    ('POST', '/api/jobs/<job_id>/dispute'): replay_dispute,
    ('PATCH', '/api/disputes/<dispute_id>'): replay_dispute_decision,
    ('POST', '/api/disputes/<dispute_id>/vote'): replay_vote,
    ('POST', '/api/arbitrators'): replay_arbitrator,
    ('PATCH', '/api/arbitrators/<arbitrator_id>'): replay_arbitrator_patch,
    ('POST', '/api/jobs/expire'): replay_expire,
    ('POST', '/api/jobs/auto-verify'): replay_auto_verify,
}


def test_every_write_route_has_a_replay_test_or_a_reason():
    writes = {(method, rule) for method, rule, _, _ in mp.ROUTES if method in ('POST', 'PATCH')}
    assert writes - set(REPLAY_TESTS) - set(mp.UNKEYED_ROUTES) == set()
    assert set(REPLAY_TESTS) | set(mp.UNKEYED_ROUTES) == writes
    assert all(reason.strip() for reason in mp.UNKEYED_ROUTES.values())


@pytest.mark.parametrize('route', sorted(REPLAY_TESTS), ids=' '.join)
def test_a_write_route_replays(route, client, market, request):
    replay = REPLAY_TESTS[route]
    names = replay.__code__.co_varnames[:replay.__code__.co_argcount]
    replay(client, market, *[request.getfixturevalue(name) for name in names[2:]])


def test_the_stripe_webhook_ignores_a_key(client):
    for _ in range(2):
        answer = keyed(client, 'POST', '/api/stripe/webhook', {}, idempotency_key='stripe-event')
        assert_error(answer, 404, 'not_found')
        assert 'Idempotent-Replayed' not in answer.headers
    assert count(client, 'SELECT count(*) FROM idempotency_keys') == 0


def test_the_second_process_to_finish_undoes_its_change_and_replays_the_first(settings, client, monkeypatch):
    """Two servers on one database (tests/test_multiworker.py runs several): each runs the key, for neither saw the
    other's answer when it began; the UNIQUE key of the answers makes the second one's commit fail, and with it
    everything it changed; it answers with the first one's answer."""
    _, api_key = make_account(client)
    other = wiring.make_app(settings)       # a second app, its own connection: another process as SQLite sees it
    try:
        from conftest import Client
        key, body = new_key(), job_body(title='raced')
        first = keyed(client, 'POST', '/api/jobs', body, api_key, key)
        assert first.status == 201, first
        looks = []
        stored_answer = mp.stored_answer

        def unseen_at_first(db, key_hash):      # the second app's two looks before it runs find nothing
            looks.append(db is other.service.db)
            return None if looks.count(True) <= 2 and looks[-1] else stored_answer(db, key_hash)
        monkeypatch.setattr(mp, 'stored_answer', unseen_at_first)
        second = keyed(Client(other), 'POST', '/api/jobs', body, api_key, key)
        assert (second.status, second.json, second.headers['Idempotent-Replayed']) == (201, first.json, 'true')
        db = client.app.service.db
        assert db.value("SELECT count(*) FROM jobs WHERE title = 'raced'") == 1
        assert db.value("SELECT count(*) FROM payments WHERE type = 'escrow'") == 1
    finally:
        other.service.close()
