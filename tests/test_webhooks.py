"""Webhooks: the outbox and its routing, delivery and retries, chat formats, SSRF checks, and the routes.

CONTRACT.md sections 2 and 6 ("Webhooks"), 11; SPEC.md "Events: Webhooks"; docs/api.md "Webhooks".
Everything runs in-process: no background worker runs here, so each test makes the attempts itself with
webhook_delivery.deliver_webhook against the conftest `receiver` (a real HTTP server on 127.0.0.1) and moves time
with mp.CLOCK.
"""

import base64
import hashlib
import hmac
import html
import json
import re
import socket
import time
import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from email.utils import format_datetime

import pytest
import standardwebhooks

import host_guard
import marketplace as mp
import webhook_delivery
import wiring

from conftest import (ADMIN_KEY, Client, assert_error, auto_verify, expire, free_port, in_hours, make_account, make_agent,
                      make_job)

ISO = re.compile(r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$')
UUID = re.compile(r'^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$')
DELIVERY_FIELDS = {'id', 'event', 'status', 'attempts', 'lastStatusCode', 'lastError', 'nextAttemptAt',
                   'createdAt', 'deliveredAt', 'payload'}


# Helpers ---------------------------------------------------------------------------

def outbox(app, event=None, agent=None, job=None):
    """The outbox rows, oldest first, optionally of one event type, one recipient agent, one job."""
    rows = app.service.db.rows('SELECT * FROM webhook_deliveries ORDER BY rowid')
    return [row for row in rows
            if (event is None or row['event'] == event)
            and (agent is None or row['agent_id'] == agent['id'])
            and (job is None or json.loads(row['payload'])['data']['jobId'] == job['id'])]


def delivery(app, delivery_id):
    return app.service.db.row('SELECT * FROM webhook_deliveries WHERE id = :id', {'id': delivery_id})


def attempt(app, delivery_id, settings=None):
    """One delivery attempt, as the background worker would make it; the row's new status."""
    service = app.service
    return webhook_delivery.deliver_webhook(service.db, settings or service.settings, service.webhooks, delivery_id)


def recipients(rows):
    return sorted(row['agent_id'] for row in rows)


def header(request, name):
    found = {key.lower(): value for key, value in request['headers'].items()}
    return found.get(name.lower())


def hex_signature(secret, body):
    return hmac.new(secret.encode('utf-8'), body, hashlib.sha256).hexdigest()


def standard_headers(request):
    return {name: header(request, name) for name in ('webhook-id', 'webhook-timestamp', 'webhook-signature')}


def event_body(event, job, agent_id, status, base='http://market.test', amount=None, timestamp=None):
    """The exact SPEC.md body the outbox must hold."""
    return {'type': event, 'timestamp': timestamp, 'data': {
        'jobId': job['id'], 'title': job['title'], 'category': job['category'],
        'amount': amount or job['paymentAmount'], 'currency': job['paymentCurrency'], 'agentId': agent_id,
        'status': status, 'txHash': None, 'jobUrl': f'{base}/jobs/{job["id"]}'}}


def only_row(rows):
    assert len(rows) == 1, rows
    return rows[0]


def freeze():
    """Stop the clock at a whole second of the real time; return that moment."""
    moment = datetime.now(timezone.utc).replace(microsecond=0)
    mp.CLOCK.set(moment)
    return moment


def worker(client, name, url, **fields):
    """A member account with one agent whose webhook is `url`: (account, key, agent, secret)."""
    account, key = make_account(client, name)
    agent, secret = make_agent(client, key, name=name, webhookUrl=url, **fields)
    return account, key, agent, secret


def claim(client, job, agent, key):
    answer = client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': agent['id']}, key=key)
    assert answer.status == 201, answer
    return answer.json['claim']


def deliver(client, job, claim_row, key):
    answer = client.post(f'/api/jobs/{job["id"]}/deliver',
                         {'claimId': claim_row['id'], 'deliverable': {'type': 'url', 'url': 'https://example.com/o'}},
                         key=key)
    assert answer.status == 200, answer
    return answer.json['claim']


def owner_view(client, agent, key):
    answer = client.get(f'/api/agents/{agent["id"]}', key=key)
    assert answer.status == 200, answer
    return answer.json['agent']


@pytest.fixture
def other_app(settings, tmp_path):
    """Build more apps from the conftest settings with some changed, each on its own database."""
    made = []

    def build(**changes):
        changed = mp.Settings(**dict(vars(settings), db=str(tmp_path / f'other-{len(made)}.db'), **changes))
        built = wiring.make_app(changed)
        made.append(built)
        return built, Client(built)

    yield build
    for built in made:
        problems = mp.ledger_problems(built.service.db)
        built.service.close()
        assert problems == []


@pytest.fixture
def requester(client):
    return make_account(client, 'requester')


@pytest.fixture
def hooked(client, receiver):
    """A worker whose agent's webhook is the receiver: (account, key, agent, secret)."""
    return worker(client, 'hooked', receiver.url)


# Routing: job.new --------------------------------------------------------------------

def test_job_new_goes_to_the_agents_whose_capabilities_suit_the_job(client, app, requester):
    _, requester_key = requester

    def hooked_agent(name, **fields):
        return worker(client, name, f'https://hooks.example.com/{name}', **fields)[2]

    coder = hooked_agent('coder')                                           # categories ['code']
    generalist = hooked_agent('generalist', capabilities={})               # no categories: everything
    empty = hooked_agent('empty', capabilities={'categories': []})          # an empty list: everything too
    several = hooked_agent('several', capabilities={'categories': ['data', 'code']})
    designer = hooked_agent('designer', capabilities={'categories': ['design']})
    too_cheap = hooked_agent('too-cheap', capabilities={'categories': ['code'], 'maxJobValue': 24.99})
    exact = hooked_agent('exact', capabilities={'maxJobValue': 25})
    richer = hooked_agent('richer', capabilities={'maxJobValue': 1000})
    usd_only = hooked_agent('usd-only', capabilities={}, pricing={'acceptedCurrencies': ['USD']})
    both = hooked_agent('both', capabilities={}, pricing={'acceptedCurrencies': ['USD', 'USDC']})
    _, silent_key = make_account(client, 'silent')
    silent, _ = make_agent(client, silent_key, name='silent', capabilities={})      # no webhookUrl
    disabled = hooked_agent('disabled', capabilities={})
    app.service.db.execute('UPDATE agents SET webhook_disabled_at = :now WHERE id = :id',
                           {'now': mp.now_iso(), 'id': disabled['id']})
    own, _ = make_agent(client, requester_key, name='own', capabilities={},
                        webhookUrl='https://hooks.example.com/own')                 # the requester's own agent

    job = make_job(client, requester_key, paymentAmount='25.00')
    rows = outbox(app, 'job.new', job=job)
    assert recipients(rows) == sorted(a['id'] for a in (coder, generalist, empty, several, exact, richer, both))
    assert not {silent['id'], disabled['id'], own['id'], designer['id'], too_cheap['id'], usd_only['id']} \
        & {row['agent_id'] for row in rows}

    # A USD job: the USD-only agent now, and still by category and value.
    usd_job = make_job(client, requester_key, paymentAmount='25.00', paymentCurrency='USD')
    assert recipients(outbox(app, 'job.new', job=usd_job)) == sorted(
        a['id'] for a in (coder, generalist, empty, several, exact, richer, usd_only, both))

    # A design job paying more than 25: only those without categories (or with design) and a high enough ceiling.
    design_job = make_job(client, requester_key, category='design', paymentAmount='30.00')
    assert recipients(outbox(app, 'job.new', job=design_job)) == sorted(
        a['id'] for a in (generalist, empty, designer, richer, both))


@pytest.mark.parametrize('pay, ceiling', [('4.35', 4.35), ('0.29', 0.29), ('1.13', 1.13), ('25.00', 25)])
def test_job_new_when_the_max_job_value_equals_the_pay(client, app, requester, pay, ceiling):
    """CONTRACT.md 11: its maxJobValue is *at least* the pay. 4.35 × 100 is 434.99999999999994 in floats."""
    _, requester_key = requester
    agent = worker(client, 'ceiling', 'https://hooks.example.com/c', capabilities={'maxJobValue': ceiling})[2]
    job = make_job(client, requester_key, paymentAmount=pay)
    assert recipients(outbox(app, 'job.new', job=job)) == [agent['id']]
    cheaper = make_job(client, requester_key, paymentAmount=format(Decimal(pay) + Decimal('0.01'), '.2f'))
    assert outbox(app, 'job.new', job=cheaper) == []


def test_job_new_body_is_exact_and_names_the_recipient(client, app, requester):
    _, requester_key = requester
    first = worker(client, 'first', 'https://hooks.example.com/1')[2]
    second = worker(client, 'second', 'https://hooks.example.com/2')[2]
    job = make_job(client, requester_key, title='Port the parser', paymentAmount='12.50')
    rows = outbox(app, 'job.new', job=job)
    assert recipients(rows) == sorted([first['id'], second['id']])
    for row in rows:
        body = json.loads(row['payload'])
        assert body == event_body('job.new', job, row['agent_id'], 'open', timestamp=row['created_at'])
        assert body['data']['jobUrl'] == f'http://market.test/jobs/{job["id"]}'
        assert body['data']['amount'] == '12.50'
        assert ISO.match(body['timestamp'])
        assert UUID.match(row['id'])
        assert (row['status'], row['attempts'], row['last_status_code'], row['last_error']) == ('pending', 0, None, None)
        assert row['next_attempt_at'] == row['created_at']
        assert row['delivered_at'] is None


# Routing: the events of a job's life ------------------------------------------------------

def test_events_of_a_paid_job_go_to_the_claim_holder_with_exact_bodies(other_app):
    app, client = other_app(fee_percent=Decimal('2.5'))
    _, requester_key = make_account(client, 'requester')
    _, worker_key, agent, _ = worker(client, 'worker', 'https://hooks.example.com/w')
    bystander = worker(client, 'bystander', 'https://hooks.example.com/b')[2]      # suits the job, never claims

    job = make_job(client, requester_key, title='Summarise the report', paymentAmount='100.00')
    assert recipients(outbox(app, 'job.new', job=job)) == sorted([agent['id'], bystander['id']])

    claimed = claim(client, job, agent, worker_key)
    row = only_row(outbox(app, 'job.claimed', job=job))
    assert row['agent_id'] == agent['id']
    assert json.loads(row['payload']) == event_body('job.claimed', job, agent['id'], 'claimed',
                                                    timestamp=row['created_at'])

    deliver(client, job, claimed, worker_key)
    row = only_row(outbox(app, 'job.delivered', job=job))
    assert row['agent_id'] == agent['id']
    assert json.loads(row['payload']) == event_body('job.delivered', job, agent['id'], 'delivered',
                                                    timestamp=row['created_at'])

    answer = client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': claimed['id'], 'approved': True},
                         key=requester_key)
    assert answer.status == 200, answer
    released = only_row(outbox(app, 'payment.released', job=job))
    assert released['agent_id'] == agent['id']
    assert json.loads(released['payload']) == event_body('payment.released', job, agent['id'], 'completed',
                                                         amount='97.50', timestamp=released['created_at'])
    completed = only_row(outbox(app, 'job.completed', job=job))
    assert completed['agent_id'] == agent['id']
    assert json.loads(completed['payload']) == event_body('job.completed', job, agent['id'], 'completed',
                                                          timestamp=completed['created_at'])
    # Nothing ever went to the bystander but job.new, nor to anyone about another event.
    assert [row['event'] for row in outbox(app, agent=bystander)] == ['job.new']
    assert [row['event'] for row in outbox(app, agent=agent)] == [
        'job.new', 'job.claimed', 'job.delivered', 'payment.released', 'job.completed']


def test_payment_disputed_goes_to_the_claim_holder(client, app, requester):
    _, requester_key = requester
    _, worker_key, agent, _ = worker(client, 'worker', 'https://hooks.example.com/w')
    job = make_job(client, requester_key, paymentAmount='40.00')
    claimed = deliver(client, job, claim(client, job, agent, worker_key), worker_key)
    answer = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claimed['id'], 'reason': 'Not done.'},
                         key=requester_key)
    assert answer.status == 201, answer
    row = only_row(outbox(app, 'payment.disputed', job=job))
    assert row['agent_id'] == agent['id']
    assert json.loads(row['payload']) == event_body('payment.disputed', job, agent['id'], 'disputed',
                                                    timestamp=row['created_at'])

    # Decided for the worker: paid, as an approval would.
    dispute = answer.json['dispute']
    answer = client.patch(f'/api/disputes/{dispute["id"]}', {'outcome': 'worker', 'resolution': 'It was done.'},
                          key=ADMIN_KEY)
    assert answer.status == 200, answer
    for event in ('payment.released', 'job.completed'):
        row = only_row(outbox(app, event, job=job))
        assert json.loads(row['payload']) == event_body(event, job, agent['id'], 'completed',
                                                        timestamp=row['created_at'])


def test_auto_verify_pays_with_the_same_events(client, app, requester):
    _, requester_key = requester
    _, worker_key, agent, _ = worker(client, 'worker', 'https://hooks.example.com/w')
    job = make_job(client, requester_key, paymentAmount='8.00', verificationWindowHours=1)
    deliver(client, job, claim(client, job, agent, worker_key), worker_key)
    mp.CLOCK.set(mp.now() + timedelta(hours=2))
    assert auto_verify(client)['autoApproved'] == 1
    assert [row['event'] for row in outbox(app, agent=agent)] == [
        'job.new', 'job.claimed', 'job.delivered', 'payment.released', 'job.completed']
    row = only_row(outbox(app, 'payment.released', job=job))
    assert json.loads(row['payload']) == event_body('payment.released', job, agent['id'], 'completed',
                                                    amount='8.00', timestamp=row['created_at'])


def test_job_expired_goes_to_each_claim_holder_naming_itself(client, app, requester):
    _, requester_key = requester
    _, key_a, agent_a, _ = worker(client, 'a', 'https://hooks.example.com/a')
    _, key_b, agent_b, _ = worker(client, 'b', 'https://hooks.example.com/b')
    _, key_c = make_account(client, 'c')
    agent_c, _ = make_agent(client, key_c, name='c')                  # holds a claim, has no webhook
    job = make_job(client, requester_key, maxWorkers=3, deadline=in_hours(1))
    for agent, key in ((agent_a, key_a), (agent_b, key_b), (agent_c, key_c)):
        claim(client, job, agent, key)
    unclaimed = make_job(client, requester_key, deadline=in_hours(1))

    mp.CLOCK.set(mp.now() + timedelta(hours=2))
    assert sorted(expire(client)['jobIds']) == sorted([job['id'], unclaimed['id']])
    rows = outbox(app, 'job.expired', job=job)
    assert recipients(rows) == sorted([agent_a['id'], agent_b['id']])
    for row in rows:
        assert json.loads(row['payload']) == event_body('job.expired', job, row['agent_id'], 'expired',
                                                        timestamp=row['created_at'])
    assert outbox(app, 'job.expired', job=unclaimed) == []            # nobody held a claim


def test_multi_worker_events_go_to_every_claim_holder(client, app, requester):
    _, requester_key = requester
    _, key_a, agent_a, _ = worker(client, 'a', 'https://hooks.example.com/a')
    _, key_b, agent_b, _ = worker(client, 'b', 'https://hooks.example.com/b')
    _, key_c = make_account(client, 'c')
    agent_c, _ = make_agent(client, key_c, name='c')                  # no webhook: never a recipient
    job = make_job(client, requester_key, maxWorkers=3)

    claim_a = claim(client, job, agent_a, key_a)
    row = only_row(outbox(app, 'job.claimed', job=job))
    assert row['agent_id'] == agent_a['id']
    assert json.loads(row['payload'])['data']['status'] == 'open'     # one of three slots taken

    claim(client, job, agent_b, key_b)
    claim(client, job, agent_c, key_c)
    rows = outbox(app, 'job.claimed', job=job)[1:]
    assert sorted((row['agent_id'], json.loads(row['payload'])['data']['agentId']) for row in rows) == sorted([
        (agent_a['id'], agent_b['id']), (agent_b['id'], agent_b['id']),       # B's claim: to A and B
        (agent_a['id'], agent_c['id']), (agent_b['id'], agent_c['id'])])      # C's claim: to A and B, not C
    assert json.loads(rows[-1]['payload'])['data']['status'] == 'claimed'   # every slot taken

    deliver(client, job, claim_a, key_a)
    rows = outbox(app, 'job.delivered', job=job)
    assert recipients(rows) == sorted([agent_a['id'], agent_b['id']])
    assert {json.loads(row['payload'])['data']['agentId'] for row in rows} == {agent_a['id']}
    assert {json.loads(row['payload'])['data']['status'] for row in rows} == {'delivered'}

    answer = client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': claim_a['id'], 'approved': True},
                         key=requester_key)
    assert answer.status == 200, answer
    for event in ('payment.released', 'job.completed'):
        rows = outbox(app, event, job=job)
        assert recipients(rows) == sorted([agent_a['id'], agent_b['id']])
        assert {json.loads(row['payload'])['data']['agentId'] for row in rows} == {agent_a['id']}
        assert {json.loads(row['payload'])['data']['amount'] for row in rows} == {'25.00'}


# The outbox is written in the transaction of the change ---------------------------------

def test_a_refused_request_writes_no_outbox_row(client, app, requester):
    _, requester_key = requester
    _, key_a, agent_a, _ = worker(client, 'a', 'https://hooks.example.com/a')
    _, key_b, agent_b, _ = worker(client, 'b', 'https://hooks.example.com/b')
    job = make_job(client, requester_key)
    claimed = claim(client, job, agent_a, key_a)
    before = outbox(app)

    answer = client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': agent_b['id']}, key=key_b)
    assert_error(answer, 409, 'already_claimed')
    answer = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claimed['id'], 'reason': 'early'},
                         key=requester_key)
    assert_error(answer, 409, 'claim_not_delivered')
    deliver(client, job, claimed, key_a)
    after_delivery = outbox(app)
    answer = client.post(f'/api/jobs/{job["id"]}/deliver',
                         {'claimId': claimed['id'], 'deliverable': {'type': 'url', 'url': 'https://example.com/2'}},
                         key=key_a)
    assert_error(answer, 409, 'already_delivered')
    assert len(after_delivery) == len(before) + 1
    assert outbox(app) == after_delivery


def test_the_outbox_row_rolls_back_with_the_change(client, app, requester, monkeypatch):
    """A failure after the row is written undoes both: the row and the change live in one transaction."""
    _, requester_key = requester
    _, key_a, agent_a, _ = worker(client, 'a', 'https://hooks.example.com/a')
    job = make_job(client, requester_key)
    before = outbox(app)
    real_queue_event = mp.queue_event

    def queue_then_fail(*args, **kwargs):
        real_queue_event(*args, **kwargs)
        raise mp.Conflict('Injected failure after the outbox write.', code='injected')

    monkeypatch.setattr(mp, 'queue_event', queue_then_fail)
    answer = client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': agent_a['id']}, key=key_a)
    assert_error(answer, 409, 'injected')
    answer = client.post('/api/jobs', {'title': 'Never posted', 'description': 'x', 'category': 'code',
                                       'paymentAmount': '5.00', 'deadline': in_hours(5)}, key=requester_key)
    assert_error(answer, 409, 'injected')
    monkeypatch.undo()

    assert outbox(app) == before
    assert app.service.db.value('SELECT count(*) FROM claims') == 0
    assert app.service.db.value("SELECT count(*) FROM jobs WHERE title = 'Never posted'") == 0
    assert client.get(f'/api/jobs/{job["id"]}').json['job']['status'] == 'open'


# Delivery: headers and signatures ----------------------------------------------------------

def test_delivery_carries_both_signatures_and_the_service_headers(client, app, requester, hooked, receiver):
    _, requester_key = requester
    _, _, agent, secret = hooked
    job = make_job(client, requester_key)
    row = only_row(outbox(app, 'job.new', agent=agent))
    started = int(time.time())
    assert attempt(app, row['id']) == 'delivered'
    request = only_row(receiver.wait_for(1))
    body = request['body']

    assert request['path'] == '/hook'
    assert json.loads(body) == json.loads(row['payload'])
    assert json.loads(body)['data']['jobId'] == job['id']
    assert header(request, 'Content-Type') == 'application/json'
    assert header(request, 'X-Service-Event') == 'job.new'
    assert header(request, 'X-Service-Delivery') == row['id']
    assert started - 1 <= int(header(request, 'X-Service-Timestamp')) <= int(time.time()) + 1
    assert re.fullmatch(r'[0-9a-f]{64}', header(request, 'X-Service-Signature'))
    assert hmac.compare_digest(header(request, 'X-Service-Signature'), hex_signature(secret, body))
    assert header(request, 'webhook-id') == row['id']
    assert header(request, 'webhook-timestamp') == header(request, 'X-Service-Timestamp')
    assert header(request, 'webhook-signature').startswith('v1,')
    assert standardwebhooks.Webhook(secret).verify(body, request['headers']) == json.loads(row['payload'])
    # The signatures are over these very bytes with this secret.
    with pytest.raises(standardwebhooks.webhooks.WebhookVerificationError):
        standardwebhooks.Webhook(secret).verify(body.replace(b'"open"', b'"paid"'), request['headers'])
    other_secret = mp.new_webhook_secret()
    with pytest.raises(standardwebhooks.webhooks.WebhookVerificationError):
        standardwebhooks.Webhook(other_secret).verify(body, request['headers'])
    assert header(request, 'X-Service-Signature') != hex_signature(other_secret, body)

    done = delivery(app, row['id'])
    assert (done['status'], done['attempts'], done['last_status_code'], done['last_error']) == ('delivered', 1, 200, None)
    assert done['next_attempt_at'] is None
    assert ISO.match(done['delivered_at'])
    assert attempt(app, row['id']) is None                 # a delivered row is not sent again
    assert len(receiver.requests) == 1


def test_failures_are_retried_with_the_same_delivery_id(client, app, requester, hooked, receiver):
    _, requester_key = requester
    _, _, agent, secret = hooked
    make_job(client, requester_key)
    row = only_row(outbox(app, 'job.new', agent=agent))
    receiver.script = [(500, {}, 0), (500, {}, 0)]
    start = freeze()
    assert attempt(app, row['id']) == 'pending'
    after_one = delivery(app, row['id'])
    assert (after_one['attempts'], after_one['last_status_code']) == (1, 500)
    assert after_one['last_error'] == 'the receiver answered 500'
    mp.CLOCK.set(start + timedelta(seconds=60))
    assert attempt(app, row['id']) == 'pending'
    mp.CLOCK.set(start + timedelta(seconds=300))
    assert attempt(app, row['id']) == 'delivered'

    requests_made = receiver.wait_for(3)
    assert [request['status'] for request in requests_made] == [500, 500, 200]
    assert {header(request, 'X-Service-Delivery') for request in requests_made} == {row['id']}
    assert {header(request, 'webhook-id') for request in requests_made} == {row['id']}
    assert {request['body'] for request in requests_made} == {requests_made[0]['body']}   # the same body
    # X-Service-Timestamp is the time of each attempt.
    assert [int(header(request, 'X-Service-Timestamp')) for request in requests_made] == [
        int(start.timestamp()), int(start.timestamp()) + 60, int(start.timestamp()) + 300]
    for request in requests_made:
        assert header(request, 'X-Service-Signature') == hex_signature(secret, request['body'])
    done = delivery(app, row['id'])
    assert (done['status'], done['attempts'], done['last_status_code'], done['last_error']) == ('delivered', 3, 200, None)
    assert done['delivered_at'] == mp.iso(start + timedelta(seconds=300))


def test_backoff_is_base_times_three_to_the_attempts_with_jitter(client, app, settings, requester, hooked,
                                                                 receiver):
    settings.webhook_retry_base = 7.0
    _, requester_key = requester
    _, _, agent, _ = hooked
    make_job(client, requester_key)
    row = only_row(outbox(app, 'job.new', agent=agent))
    receiver.script = [(500, {}, 0)] * 4
    start = freeze()
    for attempts in range(1, 5):
        assert attempt(app, row['id']) == 'pending'
        after = delivery(app, row['id'])
        assert after['attempts'] == attempts
        wait = (mp.parse_time(after['next_attempt_at']) - start).total_seconds()
        nominal = settings.webhook_retry_base * webhook_delivery.WEBHOOK_RETRY_FACTOR ** (attempts - 1)
        assert webhook_delivery.WEBHOOK_RETRY_FACTOR == 3
        assert nominal * 0.8 - 0.001 <= wait <= nominal * 1.2 + 0.001, (attempts, wait, nominal)
    assert len(receiver.requests) == 4


@pytest.mark.parametrize('status', [429, 503])
@pytest.mark.parametrize('form', ['seconds', 'http-date'])
def test_retry_after_is_honoured(client, app, requester, hooked, receiver, status, form):
    _, requester_key = requester
    _, _, agent, _ = hooked
    make_job(client, requester_key)
    row = only_row(outbox(app, 'job.new', agent=agent))
    start = freeze()
    value = '120' if form == 'seconds' else format_datetime(start + timedelta(seconds=120), usegmt=True)
    receiver.script = [(status, {'Retry-After': value}, 0)]
    assert attempt(app, row['id']) == 'pending'
    after = delivery(app, row['id'])
    assert (after['attempts'], after['last_status_code']) == (1, status)
    assert (mp.parse_time(after['next_attempt_at']) - start).total_seconds() >= 120
    assert (mp.parse_time(after['next_attempt_at']) - start).total_seconds() <= 120 + 0.001


def test_retry_after_seconds_reads_numbers_and_dates():
    start = freeze()
    assert webhook_delivery.retry_after_seconds('120') == 120
    assert webhook_delivery.retry_after_seconds(' 5 ') == 5
    assert webhook_delivery.retry_after_seconds(None) is None
    assert webhook_delivery.retry_after_seconds('') is None
    assert webhook_delivery.retry_after_seconds('soon') is None
    assert webhook_delivery.retry_after_seconds('-5') == 0
    assert webhook_delivery.retry_after_seconds('99999999') == webhook_delivery.MAX_RETRY_AFTER
    assert webhook_delivery.retry_after_seconds(format_datetime(start + timedelta(seconds=300), usegmt=True)) == 300
    assert webhook_delivery.retry_after_seconds(format_datetime(start - timedelta(seconds=300), usegmt=True)) == 0


def test_a_410_disables_the_webhook(client, app, requester, hooked, receiver):
    _, requester_key = requester
    _, worker_key, agent, _ = hooked
    make_job(client, requester_key, title='first')
    make_job(client, requester_key, title='second')
    first, second = outbox(app, 'job.new', agent=agent)
    assert owner_view(client, agent, worker_key)['webhookEnabled'] is True

    receiver.script = [(410, {}, 0)]
    assert attempt(app, first['id']) == 'failed'
    gone = delivery(app, first['id'])
    assert (gone['status'], gone['attempts'], gone['last_status_code']) == ('failed', 1, 410)
    assert '410' in gone['last_error']
    assert gone['next_attempt_at'] is None
    shown = owner_view(client, agent, worker_key)
    assert shown['webhookEnabled'] is False
    assert shown['webhookUrl'] == receiver.url            # kept, only disabled
    assert owner_view(client, agent, ADMIN_KEY)['webhookEnabled'] is False

    # The other pending delivery fails without a request; new jobs no longer go to it; no redelivery.
    assert attempt(app, second['id']) == 'failed'
    assert delivery(app, second['id'])['last_error'] == 'the agent has no live webhook'
    assert len(receiver.wait_for(1)) == 1
    assert len(receiver.requests) == 1
    make_job(client, requester_key, title='third')
    assert len(outbox(app, 'job.new', agent=agent)) == 2
    answer = client.post(f'/api/agents/{agent["id"]}/webhooks/{first["id"]}/redeliver', key=worker_key)
    assert_error(answer, 409, 'webhook_disabled')

    # Setting the webhookUrl again turns it back on.
    answer = client.patch(f'/api/agents/{agent["id"]}', {'webhookUrl': receiver.url}, key=worker_key)
    assert answer.status == 200, answer
    assert answer.json['agent']['webhookEnabled'] is True
    make_job(client, requester_key, title='fourth')
    fourth = outbox(app, 'job.new', agent=agent)[-1]
    assert json.loads(fourth['payload'])['data']['title'] == 'fourth'
    assert attempt(app, fourth['id']) == 'delivered'
    assert len(receiver.wait_for(2)) == 2


def test_the_last_attempt_fails_the_delivery(client, app, requester, hooked, receiver):
    assert webhook_delivery.WEBHOOK_ATTEMPTS >= 6                          # CONTRACT.md 6: at least 6 attempts
    _, requester_key = requester
    _, _, agent, _ = hooked
    make_job(client, requester_key)
    row = only_row(outbox(app, 'job.new', agent=agent))
    receiver.script = [(500, {}, 0)] * webhook_delivery.WEBHOOK_ATTEMPTS
    freeze()
    for number in range(1, webhook_delivery.WEBHOOK_ATTEMPTS):
        assert attempt(app, row['id']) == 'pending'
        assert delivery(app, row['id'])['attempts'] == number
    assert attempt(app, row['id']) == 'failed'
    failed = delivery(app, row['id'])
    assert (failed['status'], failed['attempts'], failed['last_status_code']) == ('failed', webhook_delivery.WEBHOOK_ATTEMPTS, 500)
    assert failed['next_attempt_at'] is None
    assert failed['delivered_at'] is None
    assert attempt(app, row['id']) is None
    assert len(receiver.requests) == webhook_delivery.WEBHOOK_ATTEMPTS


def test_a_redirect_is_not_followed(client, app, requester, hooked, receiver):
    _, requester_key = requester
    _, _, agent, _ = hooked
    make_job(client, requester_key)
    row = only_row(outbox(app, 'job.new', agent=agent))
    receiver.script = [(302, {'Location': receiver.url + '/elsewhere'}, 0)]
    assert attempt(app, row['id']) == 'pending'
    assert len(receiver.wait_for(1)) == 1
    assert len(receiver.requests) == 1
    after = delivery(app, row['id'])
    assert (after['status'], after['attempts'], after['last_status_code']) == ('pending', 1, 302)
    assert after['last_error'] == 'the receiver answered 302'


def test_a_slow_receiver_times_out_and_is_retried(client, app, settings, requester, hooked, receiver):
    settings.webhook_timeout = 0.5
    _, requester_key = requester
    _, _, agent, _ = hooked
    make_job(client, requester_key)
    row = only_row(outbox(app, 'job.new', agent=agent))
    receiver.script = [(200, {}, 2)]
    started = time.monotonic()
    assert attempt(app, row['id']) == 'pending'
    assert time.monotonic() - started < 2      # cut before the receiver's answer at 2 s (no status code below)
    after = delivery(app, row['id'])
    assert (after['attempts'], after['last_status_code']) == (1, None)
    assert after['last_error'] == 'no HTTP answer (could not connect, or no answer in time)'      # the one error of every attempt without an answer
    assert after['next_attempt_at'] is not None
    assert attempt(app, row['id']) == 'delivered'           # the script is spent: 200 at once
    assert delivery(app, row['id'])['attempts'] == 2


def test_a_refused_connection_is_retried(client, app, requester):
    _, requester_key = requester
    _, _, agent, _ = worker(client, 'closed', f'http://127.0.0.1:{free_port()}/hook')
    make_job(client, requester_key)
    row = only_row(outbox(app, 'job.new', agent=agent))
    assert attempt(app, row['id']) == 'pending'
    after = delivery(app, row['id'])
    assert (after['attempts'], after['last_status_code'], after['last_error']) == (1, None, 'no HTTP answer (could not connect, or no answer in time)')


# Chat formats -------------------------------------------------------------------------------

TRICKY_TITLE = 'Fix <b>& "quotes" bug'


@pytest.mark.parametrize('webhook_format', ['slack', 'discord', 'telegram'])
def test_chat_formats_are_each_tools_own_body_and_signed(client, app, requester, receiver, webhook_format):
    _, requester_key = requester
    _, _, agent, secret = worker(client, webhook_format, receiver.url, webhookFormat=webhook_format)
    job = make_job(client, requester_key, title=TRICKY_TITLE, paymentAmount='30.00')
    row = only_row(outbox(app, 'job.new', agent=agent))
    assert json.loads(row['payload'])['data']['title'] == TRICKY_TITLE      # the outbox keeps the raw event
    assert attempt(app, row['id']) == 'delivered'
    request = only_row(receiver.wait_for(1))
    raw = request['body']
    sent = json.loads(raw)
    job_url = f'http://market.test/jobs/{job["id"]}'

    assert header(request, 'X-Service-Event') == 'job.new'
    assert header(request, 'X-Service-Delivery') == row['id']
    assert header(request, 'X-Service-Signature') == hex_signature(secret, raw)
    assert standardwebhooks.Webhook(secret).verify(raw, request['headers']) == sent

    if webhook_format == 'slack':
        assert set(sent) == {'text', 'blocks'}
        escaped = 'Fix &lt;b&gt;&amp; "quotes" bug'
        block = sent['blocks'][0]
        assert block['type'] == 'section'
        assert block['text']['type'] == 'mrkdwn'
        assert f'<{job_url}|{escaped}>' in block['text']['text']
        assert '30.00 USDC' in block['text']['text']
        # Slack reads &, < and > as control characters in every text field, the fallback `text` included.
        for text in (sent['text'], block['text']['text']):
            assert escaped in text
            assert '<b>' not in text
            assert '& ' not in text
    elif webhook_format == 'discord':
        assert set(sent) == {'content', 'embeds', 'allowed_mentions'}
        assert sent['allowed_mentions'] == {'parse': []}
        shown = r'Fix \<b\>& "quotes" bug'          # markdown escaped with backslashes, no HTML entities
        assert sent['content'] == f'New job: {shown}'
        embed = only_row(sent['embeds'])
        assert embed['title'] == shown
        assert embed['url'] == job_url
        assert '30.00 USDC' in embed['description']
        assert '&lt;' not in raw.decode() and '&amp;' not in raw.decode()
    else:
        assert sent['parse_mode'] == 'HTML'
        assert {'text', 'parse_mode'} <= set(sent)
        text = sent['text']
        assert text.startswith('<b>New job</b>: ')
        assert f'<a href="{html.escape(job_url)}">{html.escape(TRICKY_TITLE)}</a>' in text
        assert 'Fix &lt;b&gt;&amp; ' in text
        assert '<b>&' not in text
        assert '30.00 USDC' in text


def test_chat_message_keeps_the_json_body_for_json():
    assert webhook_delivery.chat_message(webhook_delivery.SAMPLE_EVENT, 'json') is webhook_delivery.SAMPLE_EVENT


# SSRF ----------------------------------------------------------------------------------------

PRIVATE_URLS = [
    'http://127.0.0.1:8080/h',
    'http://10.0.0.1/h',
    'http://172.16.5.4/h',
    'http://192.168.1.1/h',
    'http://169.254.169.254/latest/meta-data',
    'http://localhost:9/h',                 # a name resolving to loopback
    'http://[::1]/h',
    'http://[::ffff:127.0.0.1]/h',
    'http://[fe80::1]/h',
    'http://[fd00::1]/h',
    'http://0.0.0.0/h',
    'http://100.64.0.1/h',
    'http://224.0.0.1/h',
    'https://127.0.0.1/h',
]
# Loopback in the short forms that the C resolver reads (refused whether or not the resolver reads them).
ODD_LOOPBACK_URLS = ['http://127.1/h', 'http://2130706433/h', 'http://0x7f000001/h']


@pytest.fixture
def strict(other_app):
    """An app that refuses private webhook addresses, with a member account: (app, client, key)."""
    app, client = other_app(allow_private_webhooks=False)
    _, key = make_account(client, 'strict')
    return app, client, key


@pytest.mark.parametrize('url', PRIVATE_URLS)
def test_private_webhook_urls_are_refused_at_registration(strict, url):
    app, client, key = strict
    answer = client.post('/api/agents', {'name': 'a', 'walletAddress': '0x' + '1' * 40, 'webhookUrl': url}, key=key)
    body = assert_error(answer, 400, 'validation_failed', fields=['webhookUrl'])
    assert 'loopback, private, link-local or multicast' in body['fields']['webhookUrl']
    answer = client.post('/api/agents/register', {'name': 'b', 'walletAddress': '0x' + '2' * 40, 'webhookUrl': url})
    assert_error(answer, 400, 'validation_failed', fields=['webhookUrl'])
    assert app.service.db.value('SELECT count(*) FROM agents') == 0


@pytest.mark.parametrize('url', ODD_LOOPBACK_URLS)
def test_loopback_in_short_forms_is_refused(strict, url):
    app, client, key = strict
    answer = client.post('/api/agents', {'name': 'a', 'walletAddress': '0x' + '1' * 40, 'webhookUrl': url}, key=key)
    assert_error(answer, 400, 'validation_failed', fields=['webhookUrl'])
    assert app.service.db.value('SELECT count(*) FROM agents') == 0


@pytest.mark.parametrize('url, problem', [
    ('ftp://93.184.215.14/h', 'http'),
    ('http://user:password@93.184.215.14/h', 'user name or password'),
    ('http://user@93.184.215.14/h', 'user name or password'),
    ('javascript:alert(1)', 'http'),
])
def test_bad_webhook_urls_are_refused_in_both_modes(strict, client, url, problem):
    for each_client, key in ((strict[1], strict[2]), (client, make_account(client, 'lenient')[1])):
        answer = each_client.post('/api/agents', {'name': 'a', 'walletAddress': '0x' + '1' * 40, 'webhookUrl': url},
                                  key=key)
        body = assert_error(answer, 400, 'validation_failed', fields=['webhookUrl'])
        assert problem in body['fields']['webhookUrl']


def test_a_public_ip_literal_is_accepted(strict):
    app, client, key = strict
    answer = client.post('/api/agents', {'name': 'a', 'walletAddress': '0x' + '1' * 40,
                                         'webhookUrl': 'http://93.184.215.14/h'}, key=key)
    assert answer.status == 201, answer
    assert answer.json['agent']['webhookUrl'] == 'http://93.184.215.14/h'
    assert answer.json['agent']['webhookEnabled'] is True
    agent = answer.json['agent']
    answer = client.patch(f'/api/agents/{agent["id"]}', {'webhookUrl': 'https://[2606:4700:4700::1111]/h'}, key=key)
    assert answer.status == 200, answer
    assert answer.json['agent']['webhookUrl'] == 'https://[2606:4700:4700::1111]/h'


@pytest.mark.parametrize('url', ['http://127.0.0.1:8080/h', 'http://localhost:9/h', 'http://169.254.169.254/x',
                                 'http://[::ffff:10.0.0.1]/h'])
def test_patch_with_a_private_url_is_refused(strict, url):
    app, client, key = strict
    answer = client.post('/api/agents', {'name': 'a', 'walletAddress': '0x' + '1' * 40,
                                         'webhookUrl': 'http://93.184.215.14/h'}, key=key)
    assert answer.status == 201, answer
    agent = answer.json['agent']
    answer = client.patch(f'/api/agents/{agent["id"]}', {'webhookUrl': url}, key=key)
    assert_error(answer, 400, 'validation_failed', fields=['webhookUrl'])
    assert owner_view(client, agent, key)['webhookUrl'] == 'http://93.184.215.14/h'


def test_send_time_check_blocks_a_private_address(receiver):
    session = webhook_delivery.webhook_session(False)
    settings = mp.Settings(webhook_timeout=5.0)
    agent = {'webhook_url': receiver.url, 'webhook_format': 'json', 'webhook_secret': mp.new_webhook_secret()}
    outcome = webhook_delivery.send_webhook(session, settings, agent, mp.new_id(), 'job.new', webhook_delivery.SAMPLE_EVENT)
    assert outcome['statusCode'] is None
    assert outcome['error'] == 'no HTTP answer (could not connect, or no answer in time)'      # as a closed port reads: no oracle
    assert isinstance(outcome['responseTime'], float)
    assert receiver.requests == []
    # The same call with private addresses allowed reaches it: the check, not the receiver, stopped it.
    outcome = webhook_delivery.send_webhook(webhook_delivery.webhook_session(True), settings, agent, mp.new_id(), 'job.new', webhook_delivery.SAMPLE_EVENT)
    assert (outcome['statusCode'], outcome['error']) == (200, None)
    assert len(receiver.wait_for(1)) == 1


def test_an_address_that_turns_private_is_blocked_when_sent(strict, receiver):
    """A name that resolved to a public address at registration and now points at loopback is not reached."""
    app, client, key = strict
    answer = client.post('/api/agents', {'name': 'a', 'walletAddress': '0x' + '1' * 40,
                                         'webhookUrl': 'http://93.184.215.14/h'}, key=key)
    assert answer.status == 201, answer
    agent = answer.json['agent']
    _, requester_key = make_account(client, 'requester')
    make_job(client, requester_key)
    row = only_row(outbox(app, 'job.new', agent=agent))
    app.service.db.execute('UPDATE agents SET webhook_url = :url WHERE id = :id',
                           {'url': receiver.url, 'id': agent['id']})
    attempt(app, row['id'])
    after = delivery(app, row['id'])
    assert after['attempts'] == 1
    assert after['last_status_code'] is None
    assert after['last_error'] == 'no HTTP answer (could not connect, or no answer in time)'
    assert after['status'] != 'delivered'
    assert receiver.requests == []


@pytest.mark.parametrize('address, public', [
    ('93.184.215.14', True), ('8.8.8.8', True), ('172.32.0.1', True), ('2606:4700:4700::1111', True),
    ('::ffff:93.184.215.14', True),
    ('127.0.0.1', False), ('127.255.255.254', False), ('10.1.2.3', False), ('172.16.0.1', False),
    ('172.31.255.255', False), ('192.168.1.1', False), ('169.254.169.254', False), ('100.64.0.1', False),
    ('0.0.0.0', False), ('224.0.0.1', False), ('239.255.255.250', False), ('255.255.255.255', False),
    ('240.0.0.1', False), ('198.18.0.1', False), ('192.0.2.1', False),
    ('::1', False), ('::', False), ('fe80::1', False), ('fe80::1%eth0', False), ('fc00::1', False),
    ('fd00::1', False), ('ff02::1', False), ('ff0e::1', False), ('2001:db8::1', False),
    ('::ffff:127.0.0.1', False), ('::ffff:10.0.0.1', False), ('::ffff:169.254.169.254', False),
])
def test_is_public_address(address, public):
    assert host_guard.is_public_address(address) is public


# IPv6 forms that embed an IPv4 address are judged by that address (CONTRACT.md 20).
EMBEDDED_PRIVATE = [
    '::127.0.0.1', '::10.0.0.1', '::169.254.169.254', '::7f00:1',              # IPv4-compatible
    '::ffff:0:127.0.0.1', '::ffff:0:10.1.2.3', '::ffff:0:a9fe:a9fe',            # IPv4-translated
    '64:ff9b::127.0.0.1', '64:ff9b::10.0.0.1', '64:ff9b::a9fe:a9fe',           # NAT64, well-known prefix
    '64:ff9b:1::127.0.0.1', '64:ff9b:1::10.0.0.1',                             # NAT64, local-use /48 (as /96)
    '64:ff9b:1:7f00:0:1::', '64:ff9b:1:a:a9:fea9:fe00:0',                      # ... and as /48 and /64
]


@pytest.mark.parametrize('address, public', [(address, False) for address in EMBEDDED_PRIVATE] + [
    ('::8.8.8.8', True), ('::ffff:0:8.8.8.8', True), ('64:ff9b::8.8.8.8', True), ('::ffff:8.8.8.8', True),
    ('64:ff9b:1::8.8.8.8', False),           # local-use NAT64: every place RFC 6052 allows must hold a public one
])
def test_ipv6_forms_embedding_ipv4_are_judged_by_the_ipv4_address(address, public):
    assert host_guard.is_public_address(address) is public


@pytest.mark.parametrize('address', ['::127.0.0.1', '::ffff:0:127.0.0.1', '64:ff9b:1::127.0.0.1'])
def test_webhook_urls_hiding_loopback_in_ipv6_are_refused(strict, address):
    app, client, key = strict
    answer = client.post('/api/agents', {'name': 'a', 'walletAddress': '0x' + '1' * 40,
                                         'webhookUrl': f'http://[{address}]/h'}, key=key)
    body = assert_error(answer, 400, 'validation_failed', fields=['webhookUrl'])
    assert 'loopback, private, link-local or multicast' in body['fields']['webhookUrl']
    assert app.service.db.value('SELECT count(*) FROM agents') == 0


# GET /api/agents/:id/webhooks -------------------------------------------------------------

def test_delivery_log_for_the_owner_and_admins(client, app, requester, hooked, receiver):
    _, requester_key = requester
    _, worker_key, agent, _ = hooked
    for number in (1, 2, 3):
        make_job(client, requester_key, title=f'job {number}')
    first = outbox(app, 'job.new', agent=agent)[0]
    assert attempt(app, first['id']) == 'delivered'

    for key in (worker_key, ADMIN_KEY):
        answer = client.get(f'/api/agents/{agent["id"]}/webhooks', key=key)
        assert answer.status == 200, answer
        assert (answer.json['total'], answer.json['limit'], answer.json['offset']) == (3, 50, 0)
        deliveries = answer.json['deliveries']
        assert [d['payload']['data']['title'] for d in deliveries] == ['job 3', 'job 2', 'job 1']   # newest first
        for shown in deliveries:
            assert set(shown) == DELIVERY_FIELDS
            assert shown['event'] == 'job.new'
            assert ISO.match(shown['createdAt'])
            assert shown['payload']['data']['agentId'] == agent['id']
        newest, _, oldest = deliveries
        assert (newest['status'], newest['attempts'], newest['lastStatusCode'], newest['lastError']) == \
            ('pending', 0, None, None)
        assert newest['deliveredAt'] is None
        assert ISO.match(newest['nextAttemptAt'])
        assert oldest['id'] == first['id']
        assert (oldest['status'], oldest['attempts'], oldest['lastStatusCode'], oldest['lastError']) == \
            ('delivered', 1, 200, None)
        assert oldest['nextAttemptAt'] is None
        assert ISO.match(oldest['deliveredAt'])
        assert oldest['payload'] == json.loads(first['payload'])

    def titles(query):
        answer = client.get(f'/api/agents/{agent["id"]}/webhooks{query}', key=worker_key)
        assert answer.status == 200, answer
        return [d['payload']['data']['title'] for d in answer.json['deliveries']], answer.json['total']

    assert titles('?status=delivered') == (['job 1'], 1)
    assert titles('?status=pending') == (['job 3', 'job 2'], 2)
    assert titles('?status=failed') == ([], 0)
    assert titles('?limit=2') == (['job 3', 'job 2'], 3)
    assert titles('?limit=2&offset=2') == (['job 1'], 3)
    assert titles('?status=pending&limit=1&offset=1') == (['job 2'], 2)
    answer = client.get(f'/api/agents/{agent["id"]}/webhooks?status=lost', key=worker_key)
    assert_error(answer, 400, 'invalid_parameter', fields=['status'])


def test_delivery_log_is_not_for_others(client, hooked):
    _, _, agent, _ = hooked
    _, stranger_key = make_account(client, 'stranger')
    assert_error(client.get(f'/api/agents/{agent["id"]}/webhooks', key=stranger_key), 403, 'forbidden')
    answer = client.get(f'/api/agents/{agent["id"]}/webhooks')
    assert_error(answer, 401, 'unauthorized')
    assert {name.lower(): value for name, value in answer.headers.items()}['www-authenticate'] == 'Bearer'
    assert_error(client.get(f'/api/agents/{uuid.uuid4()}/webhooks', key=ADMIN_KEY), 404, 'not_found')
    assert_error(client.get('/api/agents/not-a-uuid/webhooks', key=ADMIN_KEY), 400, 'invalid_uuid')


def test_a_delivery_log_shows_only_its_agents_deliveries(client, app, requester, hooked):
    _, requester_key = requester
    _, worker_key, agent, _ = hooked
    _, other_key, other, _ = worker(client, 'other', 'https://hooks.example.com/o')
    make_job(client, requester_key)
    mine = client.get(f'/api/agents/{agent["id"]}/webhooks', key=worker_key).json['deliveries']
    theirs = client.get(f'/api/agents/{other["id"]}/webhooks', key=other_key).json['deliveries']
    assert [d['payload']['data']['agentId'] for d in mine] == [agent['id']]
    assert [d['payload']['data']['agentId'] for d in theirs] == [other['id']]
    assert mine[0]['id'] != theirs[0]['id']


# POST /api/agents/:id/webhooks/:deliveryId/redeliver ------------------------------------------

def test_redeliver_starts_a_new_round_with_the_same_id(client, app, requester, hooked, receiver):
    _, requester_key = requester
    _, worker_key, agent, _ = hooked
    make_job(client, requester_key)
    row = only_row(outbox(app, 'job.new', agent=agent))
    receiver.script = [(500, {}, 0)] * webhook_delivery.WEBHOOK_ATTEMPTS
    for _ in range(webhook_delivery.WEBHOOK_ATTEMPTS):
        attempt(app, row['id'])
    assert delivery(app, row['id'])['status'] == 'failed'

    answer = client.post(f'/api/agents/{agent["id"]}/webhooks/{row["id"]}/redeliver', key=worker_key)
    assert answer.status == 202, answer
    shown = answer.json['delivery']
    assert (shown['id'], shown['status'], shown['attempts']) == (row['id'], 'pending', 0)
    again = delivery(app, row['id'])
    assert (again['id'], again['status'], again['attempts']) == (row['id'], 'pending', 0)
    assert again['next_attempt_at'] is not None
    assert again['payload'] == row['payload']
    assert len(outbox(app)) == 1                                # no new row

    assert attempt(app, row['id']) == 'delivered'
    requests_made = receiver.wait_for(webhook_delivery.WEBHOOK_ATTEMPTS + 1)
    assert header(requests_made[-1], 'X-Service-Delivery') == row['id']
    assert requests_made[-1]['status'] == 200
    done = delivery(app, row['id'])
    assert (done['status'], done['attempts'], done['last_status_code']) == ('delivered', 1, 200)

    # A delivered one can be sent again too, by an admin as well.
    answer = client.post(f'/api/agents/{agent["id"]}/webhooks/{row["id"]}/redeliver', key=ADMIN_KEY)
    assert answer.status == 202, answer
    assert attempt(app, row['id']) == 'delivered'
    assert header(receiver.wait_for(webhook_delivery.WEBHOOK_ATTEMPTS + 2)[-1], 'X-Service-Delivery') == row['id']


def test_redeliver_refusals(client, app, requester, hooked):
    _, requester_key = requester
    _, worker_key, agent, _ = hooked
    _, other_key, other, _ = worker(client, 'other', 'https://hooks.example.com/o')
    make_job(client, requester_key)
    mine = only_row(outbox(app, 'job.new', agent=agent))
    theirs = only_row(outbox(app, 'job.new', agent=other))

    path = f'/api/agents/{agent["id"]}/webhooks'
    assert_error(client.post(f'{path}/{theirs["id"]}/redeliver', key=worker_key), 404, 'not_found')
    assert_error(client.post(f'{path}/{uuid.uuid4()}/redeliver', key=worker_key), 404, 'not_found')
    assert_error(client.post(f'{path}/{mine["id"]}/redeliver', key=other_key), 403, 'forbidden')
    assert_error(client.post(f'{path}/{mine["id"]}/redeliver'), 401, 'unauthorized')
    assert_error(client.post(f'{path}/nope/redeliver', key=worker_key), 400, 'invalid_uuid')

    answer = client.patch(f'/api/agents/{agent["id"]}', {'webhookUrl': None}, key=worker_key)
    assert answer.status == 200, answer
    assert_error(client.post(f'{path}/{mine["id"]}/redeliver', key=worker_key), 409, 'webhook_disabled')
    assert delivery(app, mine['id'])['attempts'] == 0


# POST /api/agents/:id/webhook-secret -------------------------------------------------------

def test_rotating_the_secret(client, app, requester, hooked, receiver):
    _, requester_key = requester
    _, worker_key, agent, old_secret = hooked
    make_job(client, requester_key)
    row = only_row(outbox(app, 'job.new', agent=agent))      # pending before the rotation

    _, stranger_key = make_account(client, 'stranger')
    path = f'/api/agents/{agent["id"]}/webhook-secret'
    assert_error(client.post(path, key=ADMIN_KEY), 403, 'forbidden')
    assert_error(client.post(path, key=stranger_key), 403, 'forbidden')
    assert_error(client.post(path), 401, 'unauthorized')
    assert app.service.db.value('SELECT webhook_secret FROM agents WHERE id = :id', {'id': agent['id']}) == old_secret

    answer = client.post(path, key=worker_key)
    assert answer.status == 200, answer
    assert set(answer.json) == {'agentId', 'webhookSecret'}
    assert answer.json['agentId'] == agent['id']
    new_secret = answer.json['webhookSecret']
    assert new_secret.startswith('whsec_') and new_secret != old_secret
    assert len(base64.b64decode(new_secret[len('whsec_'):], validate=True)) == 32

    assert attempt(app, row['id']) == 'delivered'
    request = only_row(receiver.wait_for(1))
    body = request['body']
    assert header(request, 'X-Service-Signature') == hex_signature(new_secret, body)
    assert header(request, 'X-Service-Signature') != hex_signature(old_secret, body)
    assert standardwebhooks.Webhook(new_secret).verify(body, request['headers'])['type'] == 'job.new'
    with pytest.raises(standardwebhooks.webhooks.WebhookVerificationError):
        standardwebhooks.Webhook(old_secret).verify(body, request['headers'])

    # Shown once: no GET carries it.
    for key in (None, worker_key, ADMIN_KEY):
        for get_path in ('/api/agents', f'/api/agents/{agent["id"]}'):
            assert new_secret not in json.dumps(client.get(get_path, key=key).json)


# POST /api/webhooks/test ---------------------------------------------------------------------

def test_the_test_event(client, hooked, receiver):
    _, worker_key, agent, secret = hooked
    answer = client.post('/api/webhooks/test', {'agentId': agent['id']}, key=worker_key)
    assert answer.status == 200, answer
    result = answer.json
    assert set(result) == {'success', 'statusCode', 'responseTime', 'webhookUrl', 'signed'}
    assert (result['success'], result['statusCode'], result['webhookUrl'], result['signed']) == \
        (True, 200, receiver.url, True)
    assert isinstance(result['responseTime'], (int, float)) and not isinstance(result['responseTime'], bool)
    assert 0 <= result['responseTime'] < 10_000

    request = only_row(receiver.wait_for(1))
    sent = json.loads(request['body'])
    assert set(sent) == {'type', 'timestamp', 'data'}
    assert sent['type'] == 'webhook.test'
    assert ISO.match(sent['timestamp'])
    assert sent['data']['agentId'] == agent['id']
    assert header(request, 'X-Service-Event') == 'webhook.test'
    assert UUID.match(header(request, 'X-Service-Delivery'))
    assert header(request, 'X-Service-Signature') == hex_signature(secret, request['body'])
    assert standardwebhooks.Webhook(secret).verify(request['body'], request['headers']) == sent


def test_the_test_event_reports_a_failing_receiver(client, hooked, receiver):
    _, worker_key, agent, _ = hooked
    receiver.script = [(500, {}, 0)]
    answer = client.post('/api/webhooks/test', {'agentId': agent['id']}, key=worker_key)
    assert answer.status == 200, answer
    assert (answer.json['success'], answer.json['statusCode'], answer.json['signed']) == (False, 500, True)
    assert answer.json['webhookUrl'] == receiver.url
    assert answer.json['error'] == 'the receiver answered 500'
    assert len(receiver.wait_for(1)) == 1


def test_the_test_event_refusals(client, hooked):
    _, worker_key, agent, _ = hooked
    _, stranger_key = make_account(client, 'stranger')
    body = {'agentId': agent['id']}
    assert_error(client.post('/api/webhooks/test', body, key=stranger_key), 403, 'forbidden')
    assert_error(client.post('/api/webhooks/test', body, key=ADMIN_KEY), 403, 'forbidden')
    assert_error(client.post('/api/webhooks/test', body), 401, 'unauthorized')
    assert_error(client.post('/api/webhooks/test', {}, key=worker_key), 400, 'validation_failed', fields=['agentId'])
    assert_error(client.post('/api/webhooks/test', {'agentId': 'x'}, key=worker_key), 400, 'invalid_uuid')
    assert_error(client.post('/api/webhooks/test', {'agentId': str(uuid.uuid4())}, key=worker_key), 404, 'not_found')
    silent, _ = make_agent(client, worker_key, name='silent')
    assert_error(client.post('/api/webhooks/test', {'agentId': silent['id']}, key=worker_key), 400, 'no_webhook')


# PATCH /api/agents/:id ---------------------------------------------------------------------

def test_patch_changes_only_the_fields_sent(client, app, hooked, receiver):
    _, worker_key, agent, secret = hooked
    before = owner_view(client, agent, worker_key)
    answer = client.patch(f'/api/agents/{agent["id"]}', {'description': 'Now with tests.'}, key=worker_key)
    assert answer.status == 200, answer
    after = answer.json['agent']
    assert after['description'] == 'Now with tests.'
    for field in ('name', 'walletAddress', 'capabilities', 'pricing', 'webhookUrl', 'webhookFormat',
                  'webhookEnabled', 'reputationScore', 'createdAt'):
        assert after[field] == before[field], field
    assert after['webhookFormat'] == 'json'

    answer = client.patch(f'/api/agents/{agent["id"]}', {'webhookFormat': 'discord', 'name': 'renamed'}, key=worker_key)
    assert answer.status == 200, answer
    assert (answer.json['agent']['webhookFormat'], answer.json['agent']['name']) == ('discord', 'renamed')
    assert answer.json['agent']['description'] == 'Now with tests.'
    assert answer.json['agent']['webhookUrl'] == receiver.url
    assert owner_view(client, agent, worker_key) == answer.json['agent']
    # The secret does not change with a PATCH.
    assert app.service.db.value('SELECT webhook_secret FROM agents WHERE id = :id', {'id': agent['id']}) == secret


def test_patch_webhook_url_null_removes_the_webhook(client, app, requester, hooked, receiver):
    _, requester_key = requester
    _, worker_key, agent, _ = hooked
    make_job(client, requester_key)
    pending = only_row(outbox(app, 'job.new', agent=agent))
    answer = client.patch(f'/api/agents/{agent["id"]}', {'webhookUrl': None}, key=worker_key)
    assert answer.status == 200, answer
    assert (answer.json['agent']['webhookUrl'], answer.json['agent']['webhookEnabled']) == (None, False)
    make_job(client, requester_key)
    assert outbox(app, 'job.new', agent=agent) == [pending]          # no more events
    assert attempt(app, pending['id']) == 'failed'                   # and a pending one is not sent
    assert receiver.requests == []
    assert_error(client.post('/api/webhooks/test', {'agentId': agent['id']}, key=worker_key), 400, 'no_webhook')


def test_patch_refusals(client, hooked):
    _, worker_key, agent, _ = hooked
    _, stranger_key = make_account(client, 'stranger')
    path = f'/api/agents/{agent["id"]}'
    assert_error(client.patch(path, {'description': 'x'}, key=stranger_key), 403, 'forbidden')
    assert_error(client.patch(path, {'description': 'x'}, key=ADMIN_KEY), 403, 'forbidden')
    assert_error(client.patch(path, {'description': 'x'}), 401, 'unauthorized')
    assert_error(client.patch(path, {'name': None}, key=worker_key), 400, 'validation_failed', fields=['name'])
    assert_error(client.patch(path, {'walletAddress': None}, key=worker_key), 400, 'validation_failed',
                 fields=['walletAddress'])
    assert_error(client.patch(path, {'webhookUrl': 'ftp://x/y'}, key=worker_key), 400, 'validation_failed',
                 fields=['webhookUrl'])
    assert_error(client.patch(path, {'webhookFormat': 'teams'}, key=worker_key), 400, 'validation_failed',
                 fields=['webhookFormat'])
    assert_error(client.patch(f'/api/agents/{uuid.uuid4()}', {'description': 'x'}, key=worker_key), 404, 'not_found')
    shown = owner_view(client, agent, worker_key)
    assert shown['name'] == 'hooked'
    assert shown['description'] == ''


# GET /api/webhooks/templates -----------------------------------------------------------------

def test_webhook_templates(client):
    answer = client.get('/api/webhooks/templates')
    assert answer.status == 200, answer
    templates = answer.json['templates']
    assert [t['id'] for t in templates] == ['slack', 'discord', 'telegram']
    assert [t['name'] for t in templates] == ['Slack', 'Discord', 'Telegram']
    for template in templates:
        assert set(template) == {'id', 'name', 'description', 'relay', 'example'}
        assert template['description'].strip() and template['relay'].strip()
        assert template['example'] == webhook_delivery.chat_message(webhook_delivery.SAMPLE_EVENT, template['id'])
    slack, discord, telegram = (t['example'] for t in templates)
    assert set(slack) == {'text', 'blocks'}
    assert set(discord) == {'content', 'embeds', 'allowed_mentions'}
    assert telegram['parse_mode'] == 'HTML' and 'Fix the flaky test' in telegram['text']


# Secrets never leak ------------------------------------------------------------------------

def test_no_get_shows_a_webhook_secret(client, app, requester, hooked, receiver):
    _, requester_key = requester
    _, worker_key, agent, secret = hooked
    make_job(client, requester_key)
    row = only_row(outbox(app, 'job.new', agent=agent))
    attempt(app, row['id'])
    rotated = client.post(f'/api/agents/{agent["id"]}/webhook-secret', key=worker_key).json['webhookSecret']
    tested = client.post('/api/webhooks/test', {'agentId': agent['id']}, key=worker_key)
    assert tested.status == 200, tested
    stored = app.service.db.value('SELECT webhook_secret FROM agents WHERE id = :id', {'id': agent['id']})
    assert stored == rotated

    paths = ['/api/agents', '/api/agents?sort=newest', f'/api/agents/{agent["id"]}', f'/api/agents/{agent["id"]}/card',
             f'/api/agents/{agent["id"]}/webhooks', '/api/webhooks/templates', '/api/openapi.json']
    seen = 0
    for key in (None, worker_key, ADMIN_KEY):
        for path in paths:
            answer = client.get(path, key=key)
            if answer.status != 200:
                assert answer.status == 401 and key is None and path.endswith('/webhooks'), answer
                continue
            seen += 1
            text = answer.body.decode() if isinstance(answer.body, bytes) else json.dumps(answer.json)
            for value in (secret, rotated, secret[len('whsec_'):], rotated[len('whsec_'):]):
                assert value not in text, path
            assert 'webhookSecret' not in text or path == '/api/openapi.json'
    assert seen == len(paths) * 3 - 1
    assert rotated not in json.dumps(tested.json)


# Under abuse (CONTRACT.md 19): the fan-out, the pause, one error, pinned addresses, escaped chat ----------

UNREACHABLE = 'no HTTP answer (could not connect, or no answer in time)'


def test_the_request_writes_one_event_and_the_fan_out_makes_the_deliveries(client, app, requester):
    """In-process the fan-out runs after each request; the request's own transaction wrote one webhook_events row."""
    _, requester_key = requester
    hooked_agents = [worker(client, f'w{i}', f'https://hooks.example.com/{i}')[2] for i in range(3)]
    job = make_job(client, requester_key)
    events = app.service.db.rows('SELECT * FROM webhook_events WHERE job_id = :id', {'id': job['id']})
    assert [(e['event'], e['recipients'], e['expanded_at'] is not None) for e in events] == [('job.new', None, True)]
    assert recipients(outbox(app, 'job.new', job=job)) == sorted(a['id'] for a in hooked_agents)


def test_a_few_agents_get_their_deliveries_in_the_writes_own_transaction(client, app, requester, monkeypatch):
    _, requester_key = requester
    hooked_agents = [worker(client, f'w{i}', f'https://hooks.example.com/{i}') for i in range(3)]
    monkeypatch.setattr(app.service, 'fan_out', lambda: None)        # no fan-out runs in this test
    job = make_job(client, requester_key)
    rows = outbox(app, 'job.new', job=job)
    assert recipients(rows) == sorted(agent['id'] for _, _, agent, _ in hooked_agents)
    assert {json.loads(row['payload'])['data']['agentId'] for row in rows} == {row['agent_id'] for row in rows}
    event = app.service.db.row("SELECT * FROM webhook_events WHERE event = 'job.new' AND job_id = :id",
                               {'id': job['id']})
    assert event['expanded_at'] == event['created_at'] == rows[0]['next_attempt_at']
    _, key, agent, _ = hooked_agents[0]
    claim(client, job, agent, key)
    assert recipients(outbox(app, 'job.claimed', job=job)) == [agent['id']]      # named recipients: the same
    assert app.service.db.value('SELECT count(*) FROM webhook_events WHERE expanded_at IS NULL') == 0


def test_the_fan_out_is_exactly_once_across_a_crash_and_skips_later_agents(client, app, requester, monkeypatch):
    _, requester_key = requester
    hooked_agents = [worker(client, f'w{i}', f'https://hooks.example.com/{i}')[2] for i in range(7)]
    monkeypatch.setattr(app.service, 'fan_out', lambda: None)        # the fan-out waits: it runs below
    monkeypatch.setattr(mp, 'FAN_OUT_INLINE', 5)        # 7 agents: too many to expand in the post's transaction
    job = make_job(client, requester_key)
    assert outbox(app, 'job.new', job=job) == []
    mp.CLOCK.advance(milliseconds=5)
    late = worker(client, 'late', 'https://hooks.example.com/late')[2]        # registered after the post
    real_add, calls = mp.add_deliveries, []

    def add_then_crash(db, event, wanted):
        calls.append(len(wanted))
        real_add(db, event, wanted)
        if len(calls) == 2:
            raise RuntimeError('crash in the second batch')

    monkeypatch.setattr(mp, 'add_deliveries', add_then_crash)
    assert mp.fan_out_step(app.service.db, batch=3) is True                 # agents 1-3
    with pytest.raises(RuntimeError):
        mp.fan_out_step(app.service.db, batch=3)                            # 4-6, rolled back with its progress
    assert len(outbox(app, 'job.new', job=job)) == 3
    monkeypatch.setattr(mp, 'add_deliveries', real_add)
    assert mp.fan_out_events(app.service.db, batch=3) == 3                  # 4-6, 7, then the end (none left)
    rows = outbox(app, 'job.new', job=job)
    assert recipients(rows) == sorted(a['id'] for a in hooked_agents)       # each once; not the late agent
    assert late['id'] not in {row['agent_id'] for row in rows}
    assert mp.fan_out_events(app.service.db) == 0


def fail_in_a_row(app, agent, times):
    """`times` attempts at the agent's pending deliveries, the least tried first, each made due at once."""
    for _ in range(times):
        row = app.service.db.row('''SELECT id FROM webhook_deliveries WHERE agent_id = :id AND status = 'pending'
                                    ORDER BY attempts, rowid LIMIT 1''', {'id': agent['id']})
        app.service.db.execute('UPDATE webhook_deliveries SET next_attempt_at = :now WHERE id = :id',
                               {'now': mp.now_iso(), 'id': row['id']})
        attempt(app, row['id'])


def test_ten_failures_in_a_row_pause_the_receiver_and_a_patch_resumes_it(client, app, requester, hooked, receiver):
    _, requester_key = requester
    _, key, agent, _ = hooked
    assert owner_view(client, agent, key)['webhookStatus'] == 'active'
    for _ in range(3):
        make_job(client, requester_key)                     # three deliveries pending
    receiver.script = [(500, {}, 0)] * 10
    fail_in_a_row(app, agent, 9)
    assert owner_view(client, agent, key)['webhookStatus'] == 'active'
    fail_in_a_row(app, agent, 1)                            # the 10th in a row, across the three deliveries
    shown = owner_view(client, agent, key)
    assert (shown['webhookStatus'], shown['webhookEnabled']) == ('paused', True)
    assert len(receiver.requests) == 10
    held = outbox(app, agent=agent)
    assert [(row['status'], row['next_attempt_at']) for row in held] == [('pending', None)] * 3
    assert sum(row['attempts'] for row in held) == 10

    # Paused: a new event waits too, and an attempt started anyway sends nothing.
    make_job(client, requester_key)
    newest = outbox(app, agent=agent)[-1]
    assert (newest['status'], newest['next_attempt_at']) == ('pending', None)
    assert attempt(app, newest['id']) == 'pending'
    assert len(receiver.requests) == 10
    assert delivery(app, newest['id'])['attempts'] == 0

    # The owner sets the URL again (the same one): active, and the four are due now and delivered.
    answer = client.patch(f'/api/agents/{agent["id"]}', {'webhookUrl': receiver.url}, key=key)
    assert answer.status == 200, answer
    assert answer.json['agent']['webhookStatus'] == 'active'
    rows = outbox(app, agent=agent)
    assert all(row['next_attempt_at'] is not None and row['next_attempt_at'] <= mp.now_iso() for row in rows)
    assert [attempt(app, row['id']) for row in rows] == ['delivered'] * 4


def test_a_success_resets_the_count_and_a_successful_test_resumes(client, app, requester, hooked, receiver):
    _, requester_key = requester
    _, key, agent, _ = hooked
    for _ in range(4):
        make_job(client, requester_key)
    receiver.script = [(500, {}, 0)] * 9 + [(200, {}, 0)] + [(503, {}, 0)] * 9
    fail_in_a_row(app, agent, 10)                           # 9 failures, then a success: the count is back to 0
    fail_in_a_row(app, agent, 9)                            # 9 more: still not 10 in a row
    assert app.service.db.value('SELECT webhook_failures FROM agents WHERE id = :id', {'id': agent['id']}) == 9
    assert owner_view(client, agent, key)['webhookStatus'] == 'active'
    receiver.script = [(500, {}, 0)] * 2
    fail_in_a_row(app, agent, 1)
    assert owner_view(client, agent, key)['webhookStatus'] == 'paused'

    # A failed test leaves it paused (and does not count); a successful one resumes it.
    answer = client.post('/api/webhooks/test', {'agentId': agent['id']}, key=key)
    assert (answer.status, answer.json['success']) == (200, False)
    assert owner_view(client, agent, key)['webhookStatus'] == 'paused'
    answer = client.post('/api/webhooks/test', {'agentId': agent['id']}, key=key)
    assert (answer.status, answer.json['success']) == (200, True)
    assert owner_view(client, agent, key)['webhookStatus'] == 'active'
    assert app.service.db.value('SELECT webhook_failures FROM agents WHERE id = :id', {'id': agent['id']}) == 0
    waiting = [row for row in outbox(app, agent=agent) if row['status'] == 'pending']
    assert len(waiting) == 3 and all(row['next_attempt_at'] is not None for row in waiting)     # due again


def test_webhook_status_values(client, app, hooked):
    _, key, agent, _ = hooked
    assert owner_view(client, agent, key)['webhookStatus'] == 'active'
    app.service.db.execute('UPDATE agents SET webhook_disabled_at = :now WHERE id = :id',
                           {'now': mp.now_iso(), 'id': agent['id']})
    assert owner_view(client, agent, key)['webhookStatus'] == 'disabled'
    answer = client.patch(f'/api/agents/{agent["id"]}', {'webhookUrl': None}, key=key)
    assert answer.json['agent']['webhookStatus'] is None
    assert 'webhookStatus' not in client.get(f'/api/agents/{agent["id"]}').json['agent']      # owner only


def test_a_closed_port_and_a_blocked_address_read_the_same(strict, client, receiver):
    """No port-scan oracle: the delivery log and the test answer say the same for both."""
    closed = {'webhook_url': f'http://127.0.0.1:{free_port()}/hook', 'webhook_format': 'json',
              'webhook_secret': mp.new_webhook_secret()}
    blocked = dict(closed, webhook_url=receiver.url)
    settings = mp.Settings(webhook_timeout=5.0)
    refused = webhook_delivery.send_webhook(webhook_delivery.webhook_session(True), settings, closed, mp.new_id(), 'job.new', webhook_delivery.SAMPLE_EVENT)
    stopped = webhook_delivery.send_webhook(webhook_delivery.webhook_session(False), settings, blocked, mp.new_id(), 'job.new', webhook_delivery.SAMPLE_EVENT)
    assert (refused['statusCode'], refused['error']) == (None, UNREACHABLE)
    assert (stopped['statusCode'], stopped['error']) == (None, UNREACHABLE)
    assert receiver.requests == []

    # Through the API: the test answer of a strict server for an agent whose name now points at loopback.
    app, strict_client, key = strict
    answer = strict_client.post('/api/agents', {'name': 'a', 'walletAddress': '0x' + '1' * 40,
                                                'webhookUrl': 'http://93.184.215.14/h'}, key=key)
    agent = answer.json['agent']
    app.service.db.execute('UPDATE agents SET webhook_url = :url WHERE id = :id', {'url': receiver.url, 'id': agent['id']})
    answer = strict_client.post('/api/webhooks/test', {'agentId': agent['id']}, key=key)
    assert (answer.json['success'], answer.json['statusCode'], answer.json['error']) == (False, 0, UNREACHABLE)


def fake_resolver(monkeypatch, answers):
    """Patch socket.getaddrinfo: each call answers the next address of `answers`; the names asked, in order."""
    asked, answers = [], iter(answers)

    def resolve(host, port, *args, **kwargs):
        asked.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, '', (next(answers), port))]

    monkeypatch.setattr(socket, 'getaddrinfo', resolve)
    return asked


def test_the_connection_goes_to_the_address_checked(monkeypatch, receiver):
    """DNS rebinding: a name that answers an allowed address to the check and loopback afterwards never reaches
    loopback. 127.0.0.2 stands for the public address (so no packet leaves this machine): nothing listens there."""
    asked = fake_resolver(monkeypatch, ['127.0.0.2', '127.0.0.1', '127.0.0.1'])
    monkeypatch.setattr(host_guard, 'is_public_address', lambda address: address == '127.0.0.2')
    port = receiver.server.server_address[1]
    agent = {'id': 'a', 'webhook_url': f'http://rebind.test:{port}/hook', 'webhook_format': 'json',
             'webhook_secret': mp.new_webhook_secret()}
    outcome = webhook_delivery.send_webhook(webhook_delivery.webhook_session(False), mp.Settings(webhook_timeout=5.0), agent, mp.new_id(),
                              'job.new', webhook_delivery.SAMPLE_EVENT)
    assert asked == ['rebind.test']                     # resolved once, never again
    assert (outcome['statusCode'], outcome['error']) == (None, UNREACHABLE)     # 127.0.0.2 refused it
    assert receiver.requests == []


def test_a_pinned_connection_keeps_the_name_in_the_host_header(monkeypatch, receiver):
    asked = fake_resolver(monkeypatch, ['127.0.0.1'])
    port = receiver.server.server_address[1]
    agent = {'id': 'a', 'webhook_url': f'http://hooks.example.test:{port}/hook?x=1', 'webhook_format': 'json',
             'webhook_secret': mp.new_webhook_secret()}
    outcome = webhook_delivery.send_webhook(webhook_delivery.webhook_session(True), mp.Settings(webhook_timeout=5.0), agent, mp.new_id(),
                              'job.new', webhook_delivery.SAMPLE_EVENT)
    assert (outcome['statusCode'], outcome['error']) == (200, None)
    request = only_row(receiver.wait_for(1))
    assert (header(request, 'Host'), request['path']) == (f'hooks.example.test:{port}', '/hook?x=1')
    assert asked == ['hooks.example.test']


def test_a_name_with_one_private_address_among_public_ones_is_blocked(monkeypatch, receiver):
    def resolve(host, port, *args, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, '', (address, port))
                for address in ('93.184.215.14', '127.0.0.1')]

    monkeypatch.setattr(socket, 'getaddrinfo', resolve)
    agent = {'id': 'a', 'webhook_url': 'http://mixed.test/hook', 'webhook_format': 'json',
             'webhook_secret': mp.new_webhook_secret()}
    outcome = webhook_delivery.send_webhook(webhook_delivery.webhook_session(False), mp.Settings(webhook_timeout=5.0), agent, mp.new_id(),
                              'job.new', webhook_delivery.SAMPLE_EVENT)
    assert (outcome['statusCode'], outcome['error']) == (None, UNREACHABLE)


HOSTILE = dict(webhook_delivery.SAMPLE_EVENT, data=dict(webhook_delivery.SAMPLE_EVENT['data'],
                                          title='[click](https://evil.example) @everyone <!channel> <@123> **#1**',
                                          category='code_~|>`-'))


def test_discord_shows_user_text_as_text_and_pings_nobody():
    sent = webhook_delivery.chat_message(HOSTILE, 'discord')
    assert sent['allowed_mentions'] == {'parse': []}
    title = (r'\[click\]\(https://evil.example\) @' '\u200b' r'everyone \<!channel\> \<@' '\u200b'
             r'123\> \*\*\#1\*\*')
    assert sent['content'] == f'New job: {title}'
    embed = only_row(sent['embeds'])
    assert embed['title'] == title
    assert embed['url'] == HOSTILE['data']['jobUrl']
    assert embed['description'] == r'New job · 25.00 USDC · code\_\~\|\>\`\- · open'
    assert '](' not in sent['content'] and '@everyone' not in json.dumps(sent)


def test_slack_and_telegram_escapes_hold():
    slack = webhook_delivery.chat_message(HOSTILE, 'slack')
    escaped = '[click](https://evil.example) @everyone &lt;!channel&gt; &lt;@123&gt; **#1**'
    assert slack['text'].startswith(f'New job: {escaped} (')
    assert f'|{escaped}>' in slack['blocks'][0]['text']['text']
    assert '<!channel>' not in json.dumps(slack) and '<@123>' not in json.dumps(slack)
    telegram = webhook_delivery.chat_message(HOSTILE, 'telegram')
    assert f'>{escaped}</a>' in telegram['text']
    assert telegram['text'].count('<a ') == 1 and '<!channel>' not in telegram['text']


class HeldPool:
    """Stands in for the worker's gevent pool: records what it is asked to start and runs nothing."""

    def __init__(self, size):
        self.size, self.started = size, []

    def free_count(self):
        return self.size - len(self.started)

    def spawn(self, function, delivery_id, agent_id, account_id, failing):
        self.started.append(agent_id)


def held_worker(app, size):
    worker_ = webhook_delivery.WebhookWorker(app.service, concurrency=size)
    worker_.pool = HeldPool(size)
    return worker_


def test_the_worker_takes_agents_round_robin_within_the_caps(client, app, requester, monkeypatch):
    """Fifty due deliveries of one agent, older than everyone's, do not starve the others; 4 per agent, 8 per
    account; receivers that have been failing get half the pool."""
    _, requester_key = requester
    _, flood_key, flood, _ = worker(client, 'flood', 'https://hooks.example.com/flood')
    others = [worker(client, f'other{i}', f'https://hooks.example.com/{i}')[2] for i in range(3)]
    for _ in range(50):
        make_job(client, requester_key)
    app.service.db.execute('''UPDATE webhook_deliveries SET next_attempt_at = '2000-01-01T00:00:00.000Z'
                              WHERE agent_id = :id''', {'id': flood['id']})        # the flood is the oldest
    held = held_worker(app, 4)
    held.start_due()
    assert sorted(held.pool.started) == sorted([flood['id']] + [a['id'] for a in others])     # one each first

    held = held_worker(app, 100)
    held.start_due()
    assert {agent: held.pool.started.count(agent) for agent in set(held.pool.started)} == {
        agent['id']: 4 for agent in [flood] + others}                                   # then up to 4 each

    # One account with three agents: 8 in flight at most, across them.
    more = [make_agent(client, flood_key, name=f'flood{i}', webhookUrl=f'https://hooks.example.com/f{i}')[0]
            for i in range(2)]
    make_job(client, requester_key)
    make_job(client, requester_key)
    held = held_worker(app, 100)
    held.start_due()
    fleet = {flood['id']} | {agent['id'] for agent in more}
    assert sum(agent in fleet for agent in held.pool.started) == 8

    # Failing receivers (the last attempt failed) share half the pool: 10 slots, 5 for them.
    app.service.db.execute('UPDATE agents SET webhook_failures = 3')
    held = held_worker(app, 10)
    held.start_due()
    assert len(held.pool.started) == 5


def test_the_last_quarter_of_the_pool_is_for_receivers_with_nothing_in_flight(client, app, requester):
    """Six receivers whose first attempts hang (not failing yet: nothing has answered) each get a job posted
    meanwhile; a live receiver's delivery, written a moment later, still finds a slot: second deliveries in flight
    to one receiver never take the last quarter of the pool (test_webhooks_abuse's 150 dead receivers, at scale)."""
    _, requester_key = requester
    hanging = [worker(client, f'hanging{i}', f'https://hooks.example.com/h{i}')[2] for i in range(6)]
    make_job(client, requester_key)
    held = held_worker(app, 8)          # a quarter: 2 slots
    held.start_due()
    assert sorted(held.pool.started) == sorted(agent['id'] for agent in hanging)      # their first attempts
    make_job(client, requester_key)      # the second job's deliveries to the six are due; only 2 slots are free
    held.start_due()
    assert len(held.pool.started) == 6                                              # none takes the last quarter
    live = worker(client, 'live', 'https://hooks.example.com/live')[2]
    make_job(client, requester_key)
    held.start_due()
    assert held.pool.started[6:] == [live['id']]        # the live receiver's first delivery finds its slot
