"""Webhooks against the real server: bodies and both signatures, retries with Retry-After, the outbox
surviving SIGKILL, 410 disabling, slow receivers never slowing the API, SSRF refusals, no redirects.

Every server runs `marketplace.py serve` as a process on 127.0.0.1 (with `--allow-private-webhooks
--webhook-retry-base 0.2` unless a test says otherwise); every receiver is conftest's Receiver.
"""

import base64
import hashlib
import hmac
import json
import re
import statistics
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import requests
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from conftest import LiveServer, Receiver, job_body, random_wallet
from test_server import TIMEOUT, Output, bearer, claim_and_deliver, get_job, new_account, new_job, post, stop

import marketplace as mp

FAST_RETRIES = ['--webhook-retry-base', '0.2']
PRIVATE = ['--allow-private-webhooks']
ISO_UTC = re.compile(r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$')
BODY_KEYS = {'type', 'timestamp', 'data'}
BLOCKED_AT_REGISTRATION = ('resolves to a loopback, private, link-local or multicast address, '
                           'which webhooks may not reach')


# Helpers ---------------------------------------------------------------------

def start(db, *args):
    """A LiveServer on `db` with these flags, its output drained in the background (so that many log
    lines never fill the pipe and block it)."""
    server = LiveServer(db, list(args)).start()
    server.log = Output(server)
    return server


def register_hooked(server, name, url, categories=('code',)):
    """POST /api/agents/register with a webhookUrl: (agent, owner key, webhook secret)."""
    answer = post(server.url + '/api/agents/register',
                  {'name': name, 'walletAddress': random_wallet(), 'webhookUrl': url,
                   'capabilities': {'categories': list(categories)}})
    assert answer.status_code == 201, answer.text
    body = answer.json()
    agent, secret = body['agent'], body['webhookSecret']
    assert agent['webhookUrl'] == url
    assert agent['webhookEnabled'] is True
    assert re.fullmatch(r'whsec_[A-Za-z0-9+/]{43}=', secret), secret
    assert len(base64.b64decode(secret.removeprefix('whsec_'))) == 32
    return agent, body['apiKey'], secret


def header(request, name):
    """A request header by name, case-insensitively (None when absent)."""
    found = [value for key, value in request['headers'].items() if key.lower() == name.lower()]
    assert len(found) <= 1, request['headers']
    return found[0] if found else None


def check_signed(request, secret):
    """The request carries both signatures of the contract and they verify; return its JSON body."""
    raw = request['body']
    expected = hmac.new(secret.encode('utf-8'), raw, hashlib.sha256).hexdigest()
    assert header(request, 'X-Service-Signature') == expected
    parsed = Webhook(secret).verify(raw, request['headers'])      # raises when it does not verify
    body = json.loads(raw)
    assert parsed == body
    assert header(request, 'Content-Type') == 'application/json'
    assert header(request, 'X-Service-Event') == body['type']
    delivery = header(request, 'X-Service-Delivery')
    assert str(uuid.UUID(delivery)) == delivery
    assert header(request, 'webhook-id') == delivery
    assert header(request, 'webhook-timestamp') == header(request, 'X-Service-Timestamp')
    assert abs(int(header(request, 'X-Service-Timestamp')) - time.time()) < 60
    assert header(request, 'webhook-signature').startswith('v1,')
    return body


def delivery_log(server, agent_id, key, **params):
    answer = requests.get(f'{server.url}/api/agents/{agent_id}/webhooks', params=params, headers=bearer(key),
                          timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
    return answer.json()


def wait_until(condition, timeout=10, interval=0.05, what='the condition'):
    """Poll `condition` until it returns something true; return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f'{what} did not hold within {timeout} s')
        time.sleep(interval)


def show_agent(server, agent_id, key):
    answer = requests.get(f'{server.url}/api/agents/{agent_id}', headers=bearer(key), timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
    return answer.json()['agent']


def timed(call):
    """(answer, seconds it took)."""
    started = time.monotonic()
    answer = call()
    return answer, time.monotonic() - started


@pytest.fixture
def receivers():
    """Make extra receivers on demand; all closed after the test."""
    made = []

    def make():
        made.append(Receiver())
        return made[-1]

    yield make
    for receiver in made:
        receiver.close()


# 1. Every event, its body and its signatures ---------------------------------

def test_every_event_arrives_with_the_spec_body_and_verifiable_signatures(tmp_path, receiver, receivers):
    other_receiver = receivers()
    started_at = datetime.now(timezone.utc) - timedelta(seconds=1)
    server = start(tmp_path / 'events.db', *PRIVATE, *FAST_RETRIES, '--sweep-interval', '0.3', '--fee-percent', '10')
    try:
        _, requester_key = new_account(server, 'requester')
        worker, worker_key, secret = register_hooked(server, 'coder', receiver.url, ['code'])
        designer, _, designer_secret = register_hooked(server, 'designer', other_receiver.url, ['design'])

        # Job C: claimed, then left to pass its deadline (~1.5 s ahead) for the sweeper to expire.
        soon = mp.iso(mp.now() + timedelta(seconds=1.5))
        job_c = new_job(server, requester_key, title='Will expire', paymentAmount='7.50', deadline=soon)
        claim_c = post(f'{server.url}/api/jobs/{job_c["id"]}/claim', {'agentId': worker['id']}, worker_key)
        assert claim_c.status_code == 201, claim_c.text

        # Job A: claim, deliver, approve (10 % fee: the payout is 11.11 of 12.34).
        job_a = new_job(server, requester_key, title='Will be paid', paymentAmount='12.34')
        claim_a_id = claim_and_deliver(server, job_a, worker['id'], worker_key)
        approved = post(f'{server.url}/api/jobs/{job_a["id"]}/verify', {'claimId': claim_a_id, 'approved': True},
                        requester_key)
        assert approved.status_code == 200, approved.text
        assert [(p['type'], p['amount'], p['txHash']) for p in approved.json()['payments']] == \
            [('release', '11.11', None), ('fee', '1.23', None)]

        # Job B: claim, deliver, dispute.
        job_b = new_job(server, requester_key, title='Will be disputed', paymentAmount='20.00')
        claim_b_id = claim_and_deliver(server, job_b, worker['id'], worker_key)
        disputed = post(f'{server.url}/api/jobs/{job_b["id"]}/dispute',
                        {'claimId': claim_b_id, 'reason': 'It does not run.'}, requester_key)
        assert disputed.status_code == 201, disputed.text

        # Job D: a design job, for the designer only.
        job_d = new_job(server, requester_key, title='A logo', category='design', paymentAmount='5.00')

        expected = {
            ('job.new', job_a['id']): ('open', '12.34'),
            ('job.claimed', job_a['id']): ('claimed', '12.34'),
            ('job.delivered', job_a['id']): ('delivered', '12.34'),
            ('payment.released', job_a['id']): ('completed', '11.11'),
            ('job.completed', job_a['id']): ('completed', '12.34'),
            ('job.new', job_b['id']): ('open', '20.00'),
            ('job.claimed', job_b['id']): ('claimed', '20.00'),
            ('job.delivered', job_b['id']): ('delivered', '20.00'),
            ('payment.disputed', job_b['id']): ('disputed', '20.00'),
            ('job.new', job_c['id']): ('open', '7.50'),
            ('job.claimed', job_c['id']): ('claimed', '7.50'),
            ('job.expired', job_c['id']): ('expired', '7.50'),
        }
        jobs = {job['id']: job for job in (job_a, job_b, job_c, job_d)}
        arrived = receiver.wait_for(len(expected), timeout=10)
        designer_arrived = other_receiver.wait_for(1, timeout=5)
        time.sleep(0.6)      # more than two polls of the outbox: nothing else is on its way
        assert len(receiver.requests) == len(expected)
        assert len(other_receiver.requests) == 1
        assert get_job(server, job_c['id'])['job']['status'] == 'expired'

        finished_at = datetime.now(timezone.utc) + timedelta(seconds=1)
        seen = {}
        for request in arrived:
            assert request['path'] == '/hook'
            assert request['status'] == 200
            body = check_signed(request, secret)
            assert set(body) == BODY_KEYS, body
            assert ISO_UTC.match(body['timestamp']), body
            assert started_at <= datetime.fromisoformat(body['timestamp']) <= finished_at
            key = (body['type'], body['data']['jobId'])
            assert key in expected, body
            assert key not in seen, f'{key} arrived twice'
            job = jobs[key[1]]
            status, amount = expected[key]
            assert body['data'] == {
                'jobId': job['id'], 'title': job['title'], 'category': 'code', 'amount': amount,
                'currency': 'USDC', 'agentId': worker['id'], 'status': status, 'txHash': None,
                'jobUrl': f'{server.url}/jobs/{job["id"]}'}
            assert job['url'] == body['data']['jobUrl']
            seen[key] = header(request, 'X-Service-Delivery')
        assert set(seen) == set(expected)
        assert len(set(seen.values())) == len(expected)      # one delivery id per event

        # The design job went to the designer alone; the coder got no job.new for it.
        designed = check_signed(designer_arrived[0], designer_secret)
        assert designed['type'] == 'job.new'
        assert designed['data'] == {
            'jobId': job_d['id'], 'title': 'A logo', 'category': 'design', 'amount': '5.00', 'currency': 'USDC',
            'agentId': designer['id'], 'status': 'open', 'txHash': None,
            'jobUrl': f'{server.url}/jobs/{job_d["id"]}'}
        assert job_d['id'] not in {job_id for _, job_id in seen}

        # Another secret, or a changed body, does not verify.
        first = arrived[0]
        with pytest.raises(WebhookVerificationError):
            Webhook(designer_secret).verify(first['body'], first['headers'])
        with pytest.raises(WebhookVerificationError):
            Webhook(secret).verify(first['body'].replace(b'"USDC"', b'"USD"'), first['headers'])

        # The delivery log shows each of them delivered once, with the payload that was sent.
        log = delivery_log(server, worker['id'], worker_key)
        assert log['total'] == len(expected)
        by_id = {d['id']: d for d in log['deliveries']}
        assert set(by_id) == set(seen.values())
        for (event, job_id), delivery_id in seen.items():
            entry = by_id[delivery_id]
            assert (entry['event'], entry['status'], entry['attempts'], entry['lastStatusCode'],
                    entry['lastError'], entry['nextAttemptAt']) == (event, 'delivered', 1, 200, None, None)
            sent = next(r for r in arrived if header(r, 'X-Service-Delivery') == delivery_id)
            assert entry['payload'] == json.loads(sent['body'])
    finally:
        stop(server)


# 2. Retries, Retry-After, one delivery id ------------------------------------

def test_a_failing_receiver_gets_the_event_on_the_third_attempt(tmp_path, receiver):
    receiver.script = [(500, {}, 0), (503, {'Retry-After': '1'}, 0)]
    server = start(tmp_path / 'retry.db', *PRIVATE, *FAST_RETRIES)
    try:
        _, requester_key = new_account(server, 'requester')
        agent, key, secret = register_hooked(server, 'worker', receiver.url)
        job = new_job(server, requester_key)

        attempts = receiver.wait_for(3, timeout=10)
        assert [r['status'] for r in attempts] == [500, 503, 200]
        ids = {header(r, 'X-Service-Delivery') for r in attempts}
        assert len(ids) == 1
        delivery_id = ids.pop()
        bodies = [check_signed(r, secret) for r in attempts]
        assert bodies[0] == bodies[1] == bodies[2]
        assert bodies[0]['type'] == 'job.new' and bodies[0]['data']['jobId'] == job['id']
        # The first retry waits the base interval (0.2 s ± 20 %); the second honours Retry-After: 1.
        # (The upper bounds only generous: a retry's timer may run late under load.)
        assert 0.15 <= attempts[1]['at'] - attempts[0]['at'] < 2.5
        assert 1.0 <= attempts[2]['at'] - attempts[1]['at'] < 5.0

        def settled():
            log = delivery_log(server, agent['id'], key)
            return log if log['deliveries'] and log['deliveries'][0]['status'] != 'pending' else None

        log = wait_until(settled, what='the delivery settling')
        assert log['total'] == 1
        entry = log['deliveries'][0]
        assert (entry['id'], entry['event'], entry['status'], entry['attempts'], entry['lastStatusCode'],
                entry['lastError'], entry['nextAttemptAt']) == (delivery_id, 'job.new', 'delivered', 3, 200, None, None)
        assert entry['deliveredAt'] is not None
        time.sleep(0.5)
        assert len(receiver.requests) == 3
    finally:
        stop(server)


# 3. Durability across SIGKILL ------------------------------------------------

def test_pending_deliveries_survive_sigkill(tmp_path, receiver):
    receiver.script = [(500, {}, 0)] * 1000
    path = tmp_path / 'durable.db'
    server = start(path, *PRIVATE, *FAST_RETRIES)
    restarted = None
    try:
        _, requester_key = new_account(server, 'requester')
        agent, key, secret = register_hooked(server, 'worker', receiver.url)
        jobs = [new_job(server, requester_key, title=f'durable {i}') for i in range(3)]

        def all_attempted():
            log = delivery_log(server, agent['id'], key)
            return log if log['total'] == 3 and all(d['attempts'] >= 1 for d in log['deliveries']) else None

        before = wait_until(all_attempted, what='every delivery failing once')
        assert {d['status'] for d in before['deliveries']} == {'pending'}
        assert {d['lastStatusCode'] for d in before['deliveries']} == {500}
        assert {d['lastError'] for d in before['deliveries']} == {'the receiver answered 500'}
        pending_ids = {d['id'] for d in before['deliveries']}
        failed_before = set(pending_ids)        # each of these was answered 500 at least once
        assert {d['payload']['data']['jobId'] for d in before['deliveries']} == {job['id'] for job in jobs}
        assert pending_ids <= {header(r, 'X-Service-Delivery') for r in receiver.requests}

        # One more job, killed right after its 201: its delivery may not even have been tried.
        last = new_job(server, requester_key, title='durable last')
        server.kill()
        assert server.process.returncode == -9
        receiver.script.clear()         # from now on: 200
        seen_before_kill = len(receiver.requests)
        sent_before_kill = {header(r, 'X-Service-Delivery') for r in receiver.requests}

        restarted = start(path, *PRIVATE, *FAST_RETRIES)
        def last_delivery():        # its event may still wait for the fan-out (in the background) after the kill
            return next((d['id'] for d in delivery_log(restarted, agent['id'], key)['deliveries']
                         if d['payload']['data']['jobId'] == last['id']), None)

        last_id = wait_until(last_delivery, timeout=5, what="the last job's delivery")
        assert last_id not in pending_ids
        if last_id in sent_before_kill:
            pending_ids.add(last_id)        # it was tried (and failed) before the kill: then it is pending too

        def all_delivered():
            answered = {header(r, 'X-Service-Delivery') for r in receiver.requests[seen_before_kill:]
                        if r['status'] == 200}
            return answered >= pending_ids | {last_id}

        wait_until(all_delivered, timeout=15, what='every pending event arriving after the restart')
        for request in receiver.requests[seen_before_kill:]:
            assert header(request, 'X-Service-Delivery') in pending_ids | {last_id}
            body = check_signed(request, secret)
            assert body['type'] == 'job.new'
            assert request['status'] == 200

        def settled():
            log = delivery_log(restarted, agent['id'], key)
            return log if all(d['status'] != 'pending' for d in log['deliveries']) else None

        after = wait_until(settled, what='the log settling')
        assert after['total'] == 4
        assert {d['id'] for d in after['deliveries']} == pending_ids | {last_id}
        for entry in after['deliveries']:
            assert (entry['status'], entry['lastStatusCode'], entry['lastError']) == ('delivered', 200, None)
            assert entry['attempts'] >= (2 if entry['id'] in failed_before else 1)
        # Each event arrived exactly once with a 200 (at least once, and here no more was needed).
        delivered_ids = [header(r, 'X-Service-Delivery') for r in receiver.requests if r['status'] == 200]
        assert sorted(delivered_ids) == sorted(pending_ids | {last_id})
        assert restarted.terminate() == 0
    finally:
        stop(server)
        if restarted is not None:
            stop(restarted)


def test_sigkill_while_a_delivery_is_in_flight_sends_it_again_after_restart(tmp_path, receiver):
    """Killed while the receiver holds the request: the attempt never finished, so after the restart the same
    delivery (same id, same signed body) is sent again and logged delivered once."""
    receiver.script = [(200, {}, 60)]           # the first request is held; the server dies meanwhile
    path = tmp_path / 'in-flight.db'
    server = start(path, *PRIVATE, *FAST_RETRIES)
    restarted = None
    try:
        _, requester_key = new_account(server, 'requester')
        agent, key, secret = register_hooked(server, 'worker', receiver.url)
        job = new_job(server, requester_key, title='in flight')
        with receiver.arrived:
            assert receiver.arrived.wait_for(lambda: receiver.arrivals, 10), 'the delivery never arrived'
        held = receiver.arrivals[0]
        server.kill()

        restarted = start(path, *PRIVATE, *FAST_RETRIES)
        (again,) = receiver.wait_for(1, timeout=15)
        assert header(again, 'X-Service-Delivery') == held['X-Service-Delivery']
        assert again['status'] == 200
        body = check_signed(again, secret)
        assert (body['type'], body['data']['jobId']) == ('job.new', job['id'])

        def settled():
            log = delivery_log(restarted, agent['id'], key)
            return log if log['deliveries'] and log['deliveries'][0]['status'] == 'delivered' else None

        log = wait_until(settled, what='the delivery logged delivered')
        assert log['total'] == 1
        entry = log['deliveries'][0]
        assert (entry['id'], entry['status'], entry['lastStatusCode']) == (held['X-Service-Delivery'], 'delivered', 200)
        assert len(receiver.arrivals) == 2      # the held attempt and the one after the restart, no more
        assert restarted.terminate() == 0
    finally:
        stop(server)
        if restarted is not None:
            stop(restarted)


# 4. 410 disables the webhook until its URL is set again ----------------------

def test_410_disables_the_webhook_until_the_url_is_set_again(tmp_path, receiver):
    receiver.script = [(410, {}, 0)]
    server = start(tmp_path / 'gone.db', *PRIVATE, *FAST_RETRIES)
    try:
        _, requester_key = new_account(server, 'requester')
        agent, key, secret = register_hooked(server, 'worker', receiver.url)
        first = new_job(server, requester_key, title='first')
        gone = receiver.wait_for(1)[0]
        assert gone['status'] == 410
        assert check_signed(gone, secret)['data']['jobId'] == first['id']

        def disabled():
            return show_agent(server, agent['id'], key)['webhookEnabled'] is False

        wait_until(disabled, what='the webhook being disabled')
        shown = show_agent(server, agent['id'], key)
        assert shown['webhookUrl'] == receiver.url
        log = delivery_log(server, agent['id'], key)
        assert log['total'] == 1
        entry = log['deliveries'][0]
        assert (entry['status'], entry['attempts'], entry['lastStatusCode'], entry['nextAttemptAt']) == \
            ('failed', 1, 410, None)
        assert '410' in entry['lastError']

        # A later matching job: no request, nothing queued.
        new_job(server, requester_key, title='second')
        time.sleep(1.0)      # four polls of the outbox
        assert len(receiver.requests) == 1
        assert delivery_log(server, agent['id'], key)['total'] == 1

        # Setting the URL again turns it back on.
        patched = requests.patch(f'{server.url}/api/agents/{agent["id"]}', json={'webhookUrl': receiver.url},
                                 headers=bearer(key), timeout=TIMEOUT)
        assert patched.status_code == 200, patched.text
        assert patched.json()['agent']['webhookEnabled'] is True
        assert show_agent(server, agent['id'], key)['webhookEnabled'] is True
        third = new_job(server, requester_key, title='third')
        back = receiver.wait_for(2)[1]
        assert back['status'] == 200
        body = check_signed(back, secret)
        assert (body['type'], body['data']['jobId']) == ('job.new', third['id'])
    finally:
        stop(server)


# 5. A hanging receiver never slows the API -----------------------------------

def test_a_hanging_receiver_never_slows_the_api(tmp_path, receiver):
    """Timed against the same calls before any delivery hangs (medians, a generous factor: load on the machine
    slows both alike), and no single call as long as the 3 s time-out a call held by a hanging delivery waits."""
    script_length = 500
    receiver.script = [(200, {}, 3.5)] * script_length       # every request hangs past the 3 s timeout
    server = start(tmp_path / 'slow.db', *PRIVATE, *FAST_RETRIES, '--webhook-timeout', '3')
    hung = 3.0
    try:
        _, requester_key = new_account(server, 'requester')
        calls = {'post': lambda title: post(server.url + '/api/jobs', job_body(title=title), requester_key),
                 'health': lambda _: requests.get(server.url + '/api/health', timeout=TIMEOUT),
                 'jobs': lambda _: requests.get(server.url + '/api/jobs', timeout=TIMEOUT)}
        usual = {name: statistics.median(timed(lambda: call(f'before {i}'))[1] for i in range(5))
                 for name, call in calls.items()}
        took = {name: [] for name in calls}
        agent, key, _ = register_hooked(server, 'worker', receiver.url)
        for i in range(10):
            answer, seconds = timed(lambda: calls['post'](f'slow {i}'))
            assert answer.status_code == 201, answer.text
            assert seconds < hung, f'POST /api/jobs took {seconds:.2f} s'
            took['post'].append(seconds)

        # The receiver pops its script as each request arrives: as many deliveries hang as one agent may have
        # in flight (the rest of the agent's ten wait, and no other agent's deliveries would).
        wait_until(lambda: script_length - len(receiver.script) >= 4, timeout=5, what='four deliveries hanging')
        time.sleep(0.5)
        assert script_length - len(receiver.script) == 4     # the per-agent limit holds
        assert receiver.requests == []       # none has been answered yet
        for _ in range(3):
            health, seconds = timed(lambda: calls['health'](None))
            assert health.status_code == 200 and health.json()['status'] == 'ok'
            assert seconds < hung, f'GET /api/health took {seconds:.2f} s'
            took['health'].append(seconds)
            jobs, seconds = timed(lambda: calls['jobs'](None))
            assert jobs.status_code == 200 and jobs.json()['total'] >= 10
            assert seconds < hung, f'GET /api/jobs took {seconds:.2f} s'
            took['jobs'].append(seconds)
        answer, seconds = timed(lambda: calls['post']('while hanging'))
        assert answer.status_code == 201, answer.text
        assert seconds < hung, f'POST /api/jobs took {seconds:.2f} s'
        took['post'].append(seconds)

        # The test event to the hanging receiver gives up after the timeout; meanwhile the API answers.
        outcome = {}

        def send_test():
            outcome['answer'], outcome['seconds'] = timed(lambda: post(
                server.url + '/api/webhooks/test', {'agentId': agent['id']}, key))

        tester = threading.Thread(target=send_test)
        tester.start()
        answered_meanwhile = 0
        while tester.is_alive():
            health, seconds = timed(lambda: calls['health'](None))
            assert health.status_code == 200
            assert seconds < hung, f'GET /api/health took {seconds:.2f} s during the webhook test'
            took['health'].append(seconds)
            answered_meanwhile += 1
            time.sleep(0.1)
        tester.join()
        assert answered_meanwhile >= 10
        for name, seconds in took.items():
            assert statistics.median(seconds) < 10 * usual[name], (name, usual[name], seconds)
        answer = outcome['answer']
        assert answer.status_code == 200, answer.text
        result = answer.json()
        assert result == {'success': False, 'statusCode': 0, 'responseTime': result['responseTime'],
                          'webhookUrl': receiver.url, 'signed': True, 'error': 'no HTTP answer (could not connect, or no answer in time)'}
        assert 2900 <= result['responseTime'] < 8000            # cut at the 3 s time-out (late under load)
        assert 2.9 <= outcome['seconds'] < 10.0

        # The hanging deliveries were cut off at the timeout and wait for a retry.
        def timed_out():
            log = delivery_log(server, agent['id'], key)
            return [d for d in log['deliveries'] if d['lastError'] == 'no HTTP answer (could not connect, or no answer in time)']

        cut = wait_until(timed_out, timeout=5, what='a delivery timing out')
        assert all(d['status'] == 'pending' and d['lastStatusCode'] is None for d in cut)
    finally:
        stop(server)


# 6. Server-side request forgery ----------------------------------------------

def test_private_webhook_urls_are_refused_and_blocked_without_the_flag(tmp_path, receiver):
    path = tmp_path / 'ssrf.db'
    # Accepted while private webhooks are allowed...
    permissive = start(path, *PRIVATE, *FAST_RETRIES)
    try:
        agent, key, _ = register_hooked(permissive, 'early', receiver.url)
        assert permissive.terminate() == 0
    finally:
        stop(permissive)

    # ...then the same database without --allow-private-webhooks.
    strict = start(path, *FAST_RETRIES)
    try:
        port = receiver.server.server_address[1]
        for url in (f'http://127.0.0.1:{port}/h', 'http://10.0.0.1/h', 'http://169.254.169.254/latest/meta-data',
                    f'http://localhost:{port}/h'):
            answer = post(strict.url + '/api/agents/register',
                          {'name': 'sneaky', 'walletAddress': random_wallet(), 'webhookUrl': url})
            assert answer.status_code == 400, (url, answer.text)
            body = answer.json()
            assert (body['status'], body['code']) == (400, 'validation_failed'), body
            assert body['fields'] == {'webhookUrl': BLOCKED_AT_REGISTRATION}, (url, body)
        listed = requests.get(strict.url + '/api/agents', timeout=TIMEOUT).json()
        assert [a['id'] for a in listed['agents']] == [agent['id']]      # none of them was created

        # The agent accepted earlier: its delivery is blocked at send time.
        _, requester_key = new_account(strict, 'requester')
        job = new_job(strict, requester_key)

        def attempted():
            log = delivery_log(strict, agent['id'], key)
            return log if log['total'] == 1 and log['deliveries'][0]['attempts'] >= 1 else None

        entry = wait_until(attempted, what='the delivery being attempted')['deliveries'][0]
        assert entry['payload']['data']['jobId'] == job['id']
        assert entry['status'] == 'pending'          # retried later, in case the address changes
        assert entry['lastStatusCode'] is None
        assert entry['lastError'] == 'no HTTP answer (could not connect, or no answer in time)', entry
        test = post(strict.url + '/api/webhooks/test', {'agentId': agent['id']}, key)
        assert test.status_code == 200, test.text
        assert test.json()['success'] is False
        assert test.json()['statusCode'] == 0
        assert test.json()['error'] == 'no HTTP answer (could not connect, or no answer in time)', test.json()
        time.sleep(0.5)
        assert receiver.requests == []
    finally:
        stop(strict)


# 7. Redirects are not followed -----------------------------------------------

def test_redirects_are_not_followed(tmp_path, receiver, receivers):
    elsewhere = receivers()
    handler = elsewhere.server.RequestHandlerClass
    handler.do_GET = handler.do_PUT = handler.do_POST     # a 302 followed the browser way would come as a GET
    receiver.script = [(302, {'Location': elsewhere.url}, 0), (307, {'Location': elsewhere.url}, 0)] * 50
    server = start(tmp_path / 'redirect.db', *PRIVATE, *FAST_RETRIES)
    try:
        _, requester_key = new_account(server, 'requester')
        agent, key, secret = register_hooked(server, 'worker', receiver.url)
        job = new_job(server, requester_key)
        wait_until(lambda: len(receiver.requests) >= 2 or elsewhere.requests, timeout=5,
                   what='two attempts (or a followed redirect)')
        assert elsewhere.requests == []
        redirected = receiver.requests[:2]       # the first attempt and a retry, both to the receiver
        assert [r['status'] for r in redirected] == [302, 307]
        assert {header(r, 'X-Service-Delivery') for r in redirected} == {header(redirected[0], 'X-Service-Delivery')}
        assert check_signed(redirected[0], secret)['data']['jobId'] == job['id']
        test = post(server.url + '/api/webhooks/test', {'agentId': agent['id']}, key)
        assert test.status_code == 200, test.text
        code = test.json()['statusCode']
        assert code in (302, 307)
        assert (test.json()['success'], test.json()['error']) == (False, f'the receiver answered {code}')
        time.sleep(0.5)
        assert elsewhere.requests == []
        log = delivery_log(server, agent['id'], key)
        assert log['total'] == 1
        entry = log['deliveries'][0]
        assert entry['status'] == 'pending'
        assert entry['lastStatusCode'] in (302, 307)
        assert entry['lastError'] == f'the receiver answered {entry["lastStatusCode"]}'
        assert entry['attempts'] >= 2
    finally:
        stop(server)
