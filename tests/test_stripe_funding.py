"""The stripe rail's funding (CONTRACT.md 12): a job paid through Stripe Checkout waits `pending_payment`, hidden,
until a signed event (or the sweep) says it is paid; then it opens as any new job. In-process, against FakeRail:
a stateful stand-in for stripe_rail.py (the same verbs, plain dicts, the same errors) put in its place."""

import hashlib
import hmac
import itertools
import json
import sys
import time
import types
from datetime import timedelta

import pytest

import marketplace as mp
import discovery
import wiring
from conftest import ADMIN_KEY, Client, LiveServer, assert_error, in_hours, job_body, make_account, make_agent
from fake_stripe import fake_stripe, fake_stripe_server  # noqa: F401  (the fixtures)
from test_openapi import Checker

SECRET, WEBHOOK_SECRET = 'sk_test_fake', 'whsec_fake'


class StripeUnavailable(Exception):
    pass


class StripeRefused(Exception):
    def __init__(self, message, code=None, status=400):
        super().__init__(message)
        self.message, self.code, self.status = message, code, status


class InvalidSignature(Exception):
    pass


class FakeRail:
    """stripe_rail.StripeRail's verbs over sessions kept in memory, with test controls (pay, expire, fail)."""

    ids = itertools.count(1)

    def __init__(self, secret_key, webhook_secret, *, connect_webhook_secret='', api_base='https://api.stripe.com',
                 timeout=10):
        self.webhook_secret = webhook_secret
        self.sessions = {}
        self.calls = []
        self.failures = []          # exceptions the next calls raise, one each

    def _call(self, name, **params):
        self.calls.append((name, params))
        if self.failures:
            raise self.failures.pop(0)

    def open_checkout(self, *, job_id, title, amount_cents, expires_at, success_url, cancel_url):
        self._call('open_checkout', job_id=job_id, title=title, amount_cents=amount_cents, expires_at=expires_at,
                   success_url=success_url, cancel_url=cancel_url)
        session_id = f'cs_test_{next(self.ids)}'
        self.sessions[session_id] = {
            'id': session_id, 'status': 'open', 'payment_status': 'unpaid', 'amount_total': amount_cents,
            'currency': 'usd', 'client_reference_id': job_id, 'job_id': job_id, 'payment_intent': None,
            'charge': None, 'url': f'https://checkout.stripe.test/c/pay/{session_id}', 'expires_at': expires_at}
        return {'id': session_id, 'url': self.sessions[session_id]['url'], 'expires_at': expires_at}

    def checkout_session(self, session_id):
        self._call('checkout_session', session_id=session_id)
        session = self.sessions[session_id]
        return {key: session[key] for key in ('id', 'status', 'payment_status', 'amount_total', 'currency',
                                              'client_reference_id', 'job_id', 'payment_intent', 'charge')}

    def event(self, payload, signature_header):
        expected = 'v1=' + hmac.new(self.webhook_secret.encode(), payload, hashlib.sha256).hexdigest()
        if not signature_header or not hmac.compare_digest(signature_header, expected):
            raise InvalidSignature('bad signature')
        try:
            raw = json.loads(payload)
        except ValueError:
            raise InvalidSignature('unparsable payload') from None
        return {'id': raw['id'], 'type': raw['type'], 'account': raw.get('account'), 'object': raw['data']['object']}

    # Test controls ------------------------------------------------------------------------------------------

    def session_of(self, job):
        return next(s for s in self.sessions.values() if s['client_reference_id'] == job['id'])

    def pay(self, job, *, payment_status='paid'):
        """The requester pays: the session completes (an async payment: payment_status unpaid until it clears)."""
        session = self.session_of(job)
        number = session['id'].rsplit('_', 1)[1]
        session.update(status='complete', payment_status=payment_status, payment_intent=f'pi_test_{number}',
                       charge=f'ch_test_{number}' if payment_status == 'paid' else None)
        return session

    def expire(self, job):
        session = self.session_of(job)
        session.update(status='expired')
        return session

    def sign(self, payload):
        return 'v1=' + hmac.new(self.webhook_secret.encode(), payload, hashlib.sha256).hexdigest()


def stripe_object(session):
    """A Checkout Session as Stripe sends it in an event (metadata nested, no charge)."""
    return {'id': session['id'], 'object': 'checkout.session', 'status': session['status'],
            'payment_status': session['payment_status'], 'amount_total': session['amount_total'],
            'currency': session['currency'], 'client_reference_id': session['client_reference_id'],
            'metadata': {'job_id': session['job_id']}, 'payment_intent': session['payment_intent']}


events = itertools.count(1)


def payload_of(kind, thing, event_id=None):
    return json.dumps({'id': event_id or f'evt_test_{next(events)}', 'object': 'event', 'type': kind,
                       'data': {'object': thing}}).encode()


@pytest.fixture
def stripe_module(monkeypatch):
    """FakeRail in stripe_rail's place (the app imports stripe_rail only in stripe mode, and only by name)."""
    module = types.ModuleType('stripe_rail')
    module.StripeRail, module.StripeUnavailable, module.StripeRefused, module.InvalidSignature = \
        FakeRail, StripeUnavailable, StripeRefused, InvalidSignature
    monkeypatch.setitem(sys.modules, 'stripe_rail', module)
    return module


@pytest.fixture
def settings(tmp_path, stripe_module):
    """conftest's settings in stripe mode (its `app` fixture still checks the ledger and job_counts after)."""
    return mp.Settings(db=str(tmp_path / 'test.db'), rate_limits='off', admin_key=ADMIN_KEY,
                       public_url='http://market.test', allow_private_webhooks=True,
                       stripe_secret_key=SECRET, stripe_webhook_secret=WEBHOOK_SECRET)


@pytest.fixture
def rail(app):
    return app.service.stripe


@pytest.fixture
def check(client):
    return Checker(client.get('/api/openapi.json').json)


def usd_job(client, key, **overrides):
    """POST a USD job in stripe mode: the 201's body {job, checkoutUrl}."""
    answer = client.post('/api/jobs', job_body(paymentCurrency='USD', **overrides), key=key)
    assert answer.status == 201, answer
    return answer.json


def send(client, rail, kind, thing, event_id=None, signature=None):
    payload = payload_of(kind, thing, event_id)
    return client.post('/api/stripe/webhook', payload,
                       headers={'Stripe-Signature': rail.sign(payload) if signature is None else signature})


def state(db, job_id):
    """(status, escrow status, payment records, stripe_events rows) of a job."""
    job = db.row('SELECT status, escrow_status FROM jobs WHERE id = :id', {'id': job_id})
    return (job['status'], job['escrow_status'],
            db.value('SELECT count(*) FROM payments WHERE job_id = :id', {'id': job_id}),
            db.value('SELECT count(*) FROM stripe_events WHERE job_id = :id', {'id': job_id}))


def visible_to_the_public(client, job):
    """Where a job shows: (in the list, in a search, in the feed, in matches, agents match by its id, by id)."""
    listed = [j['id'] for j in client.get('/api/jobs').json['jobs']]
    searched = [j['id'] for j in client.get('/api/jobs/search?q=flaky').json['results']]
    fed = job['id'] in client.get('/api/jobs/feed').body.decode()
    matched = [j['id'] for j in client.get('/api/jobs/match?categories=code').json['matches']]
    return (job['id'] in listed, job['id'] in searched, fed, job['id'] in matched,
            client.get(f'/api/agents/match?job_id={job["id"]}').status, client.get(f'/api/jobs/{job["id"]}').status)


# Start-up and health ------------------------------------------------------------------------------------

def test_health_names_each_rail(client):
    assert client.get('/api/health').json['rails'] == {'base': 'simulated', 'stripe': 'stripe'}
    assert client.get('/api/health').json['payments'] == 'simulated'


def test_health_in_simulated_mode(tmp_path):
    app = wiring.make_app(mp.Settings(db=str(tmp_path / 'plain.db'), rate_limits='off'))
    try:
        answer = mp.call_app(app, 'GET', '/api/health')[2]
        assert answer['rails'] == {'base': 'simulated', 'stripe': 'simulated'} and app.service.stripe is None
        assert not mp.stripe_mode(app.service) and mp.real_rails(app.service.settings) == set()
    finally:
        app.service.close()


def test_a_stripe_key_without_a_webhook_secret_refuses_to_start(tmp_path, stripe_module):
    settings = mp.Settings(db=str(tmp_path / 'never.db'), stripe_secret_key=SECRET)
    with pytest.raises(ValueError, match='--stripe-secret-key needs --stripe-webhook-secret'):
        wiring.make_app(settings)
    assert not (tmp_path / 'never.db').exists()


def test_the_command_line_says_so_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        wiring.main(['serve', '--db', str(tmp_path / 'never.db'), '--stripe-secret-key', SECRET])
    assert exit.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert '--stripe-secret-key needs --stripe-webhook-secret' in error and SECRET not in error


def test_stripe_mode_makes_stripe_a_real_rail_and_refuses_simulated_base(client, market):
    assert mp.real_rails(client.app.service.settings) == {'stripe'}
    assert_error(client.post('/api/jobs', job_body(), key=market.requester_key), 400, 'rail_unavailable')
    assert client.app.service.db.value('SELECT count(*) FROM jobs') == 0


def test_allow_simulated_rails_lets_a_base_job_open_at_once(tmp_path, stripe_module):
    settings = mp.Settings(db=str(tmp_path / 'demo.db'), rate_limits='off', stripe_secret_key=SECRET,
                           stripe_webhook_secret=WEBHOOK_SECRET, allow_simulated_rails=True)
    app = wiring.make_app(settings)
    try:
        _, key = mp.create_account(app.service.db, 'requester')
        status, _, answer = mp.call_app(app, 'POST', '/api/jobs', job_body(), key=key)
        assert status == 201 and answer['job']['status'] == 'open' and 'checkoutUrl' not in answer
        assert mp.ledger_problems(app.service.db) == []
    finally:
        app.service.close()


# Funding: a job waits for its payment, hidden ---------------------------------------------------------

def test_a_usd_job_opens_a_checkout_session_and_waits(client, market, rail, check):
    before = int(mp.now().timestamp())
    answer = check(client.post('/api/jobs', job_body(paymentCurrency='USD', paymentAmount='25.50'),
                               key=market.requester_key), 'POST', '/api/jobs', 201)
    job = answer.json['job']
    assert (job['status'], job['escrowStatus'], job['paymentRail'], job['paymentCurrency']) == \
        ('pending_payment', 'pending', 'stripe', 'USD')
    (name, params), = rail.calls
    assert name == 'open_checkout'
    assert params['job_id'] == job['id'] and params['amount_cents'] == 2550 and params['title'] == job['title']
    assert params['success_url'] == params['cancel_url'] == f'http://market.test/jobs/{job["id"]}'
    assert before + 3600 <= params['expires_at'] <= int(time.time()) + 3600 + 1
    session = rail.session_of(job)
    assert answer.json['checkoutUrl'] == session['url']
    row = client.app.service.db.row('SELECT * FROM jobs WHERE id = :id', {'id': job['id']})
    assert (row['stripe_session_id'], row['checkout_url']) == (session['id'], session['url'])
    assert row['checkout_expires_at'] == mp.unix_iso(params['expires_at'])
    assert state(client.app.service.db, job['id']) == ('pending_payment', 'pending', 0, 0)
    assert client.app.service.db.value('SELECT count(*) FROM webhook_deliveries') == 0


def test_a_pending_job_is_hidden_from_everyone_but_its_requester_and_admins(client, market, rail):
    job = usd_job(client, market.requester_key)['job']
    assert visible_to_the_public(client, job) == (False, False, False, False, 404, 404)
    assert client.get('/api/jobs').json['total'] == 0
    assert client.get('/api/jobs?category=code').json['total'] == 0
    assert client.get('/api/jobs/search?category=code').json['total'] == 0
    assert client.get('/api/jobs?status=pending_payment').status == 400       # not a status to list by
    assert client.get('/api/stats').json['totalJobs'] == 0
    assert client.get(f'/api/jobs/{job["id"]}', key=market.worker_key).status == 404
    mine = client.get(f'/api/jobs/{job["id"]}', key=market.requester_key).json
    assert (mine['job']['status'], mine['checkoutUrl']) == ('pending_payment', rail.session_of(job)['url'])
    assert client.get(f'/api/jobs/{job["id"]}', key=ADMIN_KEY).json['job']['id'] == job['id']
    page = client.get(f'/jobs/{job["id"]}')
    assert page.status == 404 and b'once Stripe confirms' in page.body
    assert discovery.feed_jobs(client.app.service.db) == []


def test_a_pending_job_can_be_neither_claimed_nor_cancelled(client, market, rail):
    job = usd_job(client, market.requester_key)['job']
    answer = client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': market.agent['id']}, key=market.worker_key)
    assert_error(answer, 409, 'job_not_open')
    assert_error(client.post(f'/api/jobs/{job["id"]}/cancel', key=market.requester_key), 409, 'job_not_open')
    assert state(client.app.service.db, job['id']) == ('pending_payment', 'pending', 0, 0)


def test_the_deadline_must_come_after_the_payment_window(client, market, rail):
    answer = client.post('/api/jobs', job_body(paymentCurrency='USD', deadline=in_hours(0.5)), key=market.requester_key)
    assert_error(answer, 400, 'validation_failed', fields=['deadline'])
    assert rail.calls == [] and client.app.service.db.value('SELECT count(*) FROM jobs') == 0
    assert usd_job(client, market.requester_key, deadline=in_hours(1.1))['job']['status'] == 'pending_payment'


@pytest.mark.parametrize('failure', [StripeUnavailable('timed out'), StripeRefused('No such price', 'resource_missing')])
def test_stripe_failing_is_503_and_nothing_is_stored(client, market, rail, check, failure):
    rail.failures.append(failure)
    answer = check(client.post('/api/jobs', job_body(paymentCurrency='USD'), key=market.requester_key),
                   'POST', '/api/jobs', 503)
    assert_error(answer, 503, 'payment_provider_unavailable')
    assert answer.headers['Retry-After'] == '30'
    assert client.app.service.db.value('SELECT count(*) FROM jobs') == 0
    assert usd_job(client, market.requester_key)['job']['status'] == 'pending_payment'      # Stripe is back


# The webhook: events open, cancel and record -----------------------------------------------------------

def test_the_paid_event_opens_the_job_as_any_new_job(client, market, rail, check):
    db = client.app.service.db
    make_agent(client, market.worker_key, name='listener', webhookUrl='https://hooks.example/new')
    job = usd_job(client, market.requester_key)['job']
    stream = client.app.service.hub.subscribe(mp.StreamFilter())
    session = rail.pay(job)
    answer = check(send(client, rail, 'checkout.session.completed', stripe_object(session), 'evt_paid'),
                   'POST', '/api/stripe/webhook', 200)
    assert answer.json == {'received': True, 'eventId': 'evt_paid', 'outcome': 'opened', 'jobId': job['id']}
    detail = client.get(f'/api/jobs/{job["id"]}').json      # anyone may read it now
    assert (detail['job']['status'], detail['job']['escrowStatus']) == ('open', 'locked')
    (payment,) = detail['payments']
    assert (payment['type'], payment['amount'], payment['currency'], payment['rail'], payment['status'],
            payment['reference'], payment['recipient'], payment['txHash']) == \
        ('escrow', '25.00', 'USD', 'stripe', 'confirmed', session['payment_intent'], 'platform', None)
    row = db.row('SELECT payment_intent, stripe_charge FROM jobs WHERE id = :id', {'id': job['id']})
    assert (row['payment_intent'], row['stripe_charge']) == (session['payment_intent'], session['charge'])
    assert visible_to_the_public(client, job) == (True, True, True, True, 200, 200)
    assert stream.get_nowait()[0] == job['id']
    assert db.value("SELECT count(*) FROM webhook_deliveries WHERE event = 'job.new'") == 1
    assert client.get('/api/stats').json['totalJobs'] == 1
    assert client.get(f'/jobs/{job["id"]}').status == 200
    # Stripe sends it again: 200, nothing more
    again = check(send(client, rail, 'checkout.session.completed', stripe_object(session), 'evt_paid'),
                  'POST', '/api/stripe/webhook', 200)
    assert again.json['outcome'] == 'duplicate'
    assert state(db, job['id']) == ('open', 'locked', 1, 1)
    assert db.value("SELECT count(*) FROM webhook_deliveries WHERE event = 'job.new'") == 1


def test_an_opened_job_goes_on_as_any_job(client, market, rail):
    job = usd_job(client, market.requester_key)['job']
    send(client, rail, 'checkout.session.completed', stripe_object(rail.pay(job)))
    assert market.claim(job)['status'] == 'claimed'
    assert mp.ledger_problems(client.app.service.db) == []


def test_an_expired_session_cancels_the_job(client, market, rail, check):
    db = client.app.service.db
    job = usd_job(client, market.requester_key)['job']
    answer = check(send(client, rail, 'checkout.session.expired', stripe_object(rail.expire(job))),
                   'POST', '/api/stripe/webhook', 200)
    assert answer.json['outcome'] == 'cancelled'
    assert state(db, job['id']) == ('cancelled', 'pending', 0, 1)
    assert client.get(f'/api/jobs/{job["id"]}').status == 200         # final: no longer hidden
    assert visible_to_the_public(client, job)[0] is True
    assert db.value('SELECT count(*) FROM webhook_deliveries') == 0


def test_events_in_any_order_apply_once(client, market, rail):
    """An expiry after the payment changes nothing; a payment after an expiry opens nothing."""
    db = client.app.service.db
    paid, unpaid = usd_job(client, market.requester_key)['job'], usd_job(client, market.requester_key)['job']
    paid_session = stripe_object(rail.pay(paid))
    assert send(client, rail, 'checkout.session.completed', paid_session).json['outcome'] == 'opened'
    late = dict(paid_session, status='expired')
    assert send(client, rail, 'checkout.session.expired', late).json['outcome'] == 'unchanged'
    assert state(db, paid['id'])[:3] == ('open', 'locked', 1)
    assert send(client, rail, 'checkout.session.expired', stripe_object(rail.expire(unpaid))).json['outcome'] == 'cancelled'
    rail.pay(unpaid)
    assert send(client, rail, 'checkout.session.completed', stripe_object(rail.session_of(unpaid))).json['outcome'] \
        == 'unchanged'
    assert state(db, unpaid['id']) == ('cancelled', 'pending', 0, 2)
    summary = db.value("SELECT summary FROM stripe_events WHERE job_id = :id AND type = 'checkout.session.completed'",
                       {'id': unpaid['id']})
    assert 'did not open the job' in summary and 'cancelled' in summary


def test_an_async_payment_opens_the_job_when_it_clears(client, market, rail):
    db = client.app.service.db
    job = usd_job(client, market.requester_key)['job']
    session = rail.pay(job, payment_status='unpaid')
    assert send(client, rail, 'checkout.session.completed', stripe_object(session)).json['outcome'] == 'unchanged'
    assert state(db, job['id'])[:3] == ('pending_payment', 'pending', 0)
    session.update(payment_status='paid', charge='ch_test_async')
    assert send(client, rail, 'checkout.session.async_payment_succeeded', stripe_object(session)).json['outcome'] \
        == 'opened'
    assert db.value('SELECT stripe_charge FROM jobs WHERE id = :id', {'id': job['id']}) == 'ch_test_async'


def test_a_failed_async_payment_cancels_the_job(client, market, rail):
    job = usd_job(client, market.requester_key)['job']
    session = rail.pay(job, payment_status='unpaid')
    assert send(client, rail, 'checkout.session.async_payment_failed', stripe_object(session)).json['outcome'] \
        == 'cancelled'
    assert state(client.app.service.db, job['id']) == ('cancelled', 'pending', 0, 1)


@pytest.mark.parametrize('signature', ['', 'v1=' + '0' * 64, 'garbage'])
def test_a_bad_signature_changes_nothing(client, market, rail, check, signature):
    db = client.app.service.db
    job = usd_job(client, market.requester_key)['job']
    answer = check(send(client, rail, 'checkout.session.completed', stripe_object(rail.pay(job)), signature=signature),
                   'POST', '/api/stripe/webhook', 400)
    assert_error(answer, 400, 'invalid_signature')
    assert state(db, job['id']) == ('pending_payment', 'pending', 0, 0)
    assert db.value('SELECT count(*) FROM stripe_events') == 0


def test_a_body_changed_after_signing_changes_nothing(client, market, rail):
    job = usd_job(client, market.requester_key)['job']
    signed = payload_of('checkout.session.expired', stripe_object(rail.expire(job)))
    forged = signed.replace(b'expired', b'completed', 1)
    answer = client.post('/api/stripe/webhook', forged, headers={'Stripe-Signature': rail.sign(signed)})
    assert_error(answer, 400, 'invalid_signature')
    assert state(client.app.service.db, job['id']) == ('pending_payment', 'pending', 0, 0)


def test_no_header_at_all_is_invalid_signature(client, rail):
    assert_error(client.post('/api/stripe/webhook', b'{}'), 400, 'invalid_signature')


@pytest.mark.parametrize('change', ['another session', 'less money', 'another currency', 'references disagree'])
def test_a_payment_that_does_not_fit_the_job_opens_nothing(client, market, rail, change):
    db = client.app.service.db
    job, other = usd_job(client, market.requester_key)['job'], usd_job(client, market.requester_key)['job']
    session = rail.pay(job)
    if change == 'another session':        # paid, but it is the other job's session said to be this job's
        session = dict(rail.pay(other), client_reference_id=job['id'], job_id=job['id'])
        rail.sessions[session['id']] = session
    elif change == 'less money':
        session['amount_total'] = 2499
    elif change == 'another currency':
        session['currency'] = 'eur'
    else:
        session['job_id'] = other['id']
    answer = send(client, rail, 'checkout.session.completed', stripe_object(session))
    assert answer.status == 200 and answer.json['outcome'] == 'unchanged'
    assert state(db, job['id'])[:3] == ('pending_payment', 'pending', 0)
    assert state(db, other['id'])[:3] == ('pending_payment', 'pending', 0)
    assert db.value("SELECT count(*) FROM webhook_deliveries") == 0


def test_stripe_down_while_reading_the_session_leaves_the_event_for_its_retry(client, market, rail, check):
    db = client.app.service.db
    job = usd_job(client, market.requester_key)['job']
    session = stripe_object(rail.pay(job))
    rail.failures.append(StripeUnavailable('connection refused'))
    answer = check(send(client, rail, 'checkout.session.completed', session, 'evt_retry'),
                   'POST', '/api/stripe/webhook', 503)
    assert_error(answer, 503, 'payment_provider_unavailable')
    assert state(db, job['id']) == ('pending_payment', 'pending', 0, 0)
    assert send(client, rail, 'checkout.session.completed', session, 'evt_retry').json['outcome'] == 'opened'


@pytest.mark.parametrize('kind', ['charge.refunded', 'charge.dispute.created'])
def test_charge_events_are_recorded_on_the_job_and_card_money_going_back_stops_it(client, market, rail, kind):
    """CONTRACT.md 20 (superseding 12's 'no automatic change'): a dispute holds the escrow, a whole refund made
    outside the service ends the job refunded (tests/test_stripe_chargebacks.py has the rest)."""
    db = client.app.service.db
    job = usd_job(client, market.requester_key)['job']
    session = rail.pay(job)
    send(client, rail, 'checkout.session.completed', stripe_object(session))
    if kind == 'charge.refunded':
        thing = {'id': session['charge'], 'object': 'charge', 'amount_refunded': 2500,
                 'payment_intent': session['payment_intent'], 'transfer_group': f'job_{job["id"]}'}
    else:
        thing = {'id': 'dp_test_1', 'object': 'dispute', 'charge': session['charge'], 'amount': 2500,
                 'reason': 'fraudulent', 'payment_intent': session['payment_intent']}
    answer = send(client, rail, kind, thing, 'evt_charge')
    outcome = 'refunded' if kind == 'charge.refunded' else 'held'
    assert answer.json == {'received': True, 'eventId': 'evt_charge', 'outcome': outcome, 'jobId': job['id']}
    assert send(client, rail, kind, thing, 'evt_charge').json['outcome'] == 'duplicate'
    assert state(db, job['id']) == (('cancelled', 'refunded', 2, 2) if kind == 'charge.refunded'
                                    else ('open', 'held', 1, 2))
    assert mp.ledger_problems(db) == []
    page = client.get(f'/jobs/{job["id"]}').body.decode()
    assert ('Stripe refunded 25.00 USD' if kind == 'charge.refunded' else 'The payer disputed charge') in page


def test_other_event_types_are_answered_and_ignored(client, rail, check):
    answer = check(send(client, rail, 'payment_intent.created', {'id': 'pi_x', 'object': 'payment_intent'}, 'evt_x'),
                   'POST', '/api/stripe/webhook', 200)
    assert answer.json == {'received': True, 'eventId': 'evt_x', 'outcome': 'ignored', 'jobId': None}
    assert client.app.service.db.value('SELECT count(*) FROM stripe_events') == 0


@pytest.mark.parametrize('caller', ['no key', 'member', 'admin'])
def test_the_webhook_takes_no_key(client, rail, caller):
    key = {'no key': None, 'member': make_account(client)[1], 'admin': ADMIN_KEY}[caller]
    payload = payload_of('customer.created', {'id': 'cus_1'})
    answer = client.post('/api/stripe/webhook', payload, key=key, headers={'Stripe-Signature': rail.sign(payload)})
    assert answer.status == 200, answer


def test_an_unknown_job_or_a_session_of_another_service_opens_nothing(client, rail):
    session = {'id': 'cs_elsewhere', 'status': 'complete', 'payment_status': 'paid', 'amount_total': 100,
               'currency': 'usd', 'client_reference_id': None, 'job_id': None, 'payment_intent': 'pi_e', 'charge': None}
    rail.sessions['cs_elsewhere'] = session
    answer = send(client, rail, 'checkout.session.completed', stripe_object(session), 'evt_elsewhere')
    assert answer.json == {'received': True, 'eventId': 'evt_elsewhere', 'outcome': 'unchanged', 'jobId': None}
    assert client.app.service.db.value('SELECT job_id FROM stripe_events') is None


# Lost webhooks: the sweep asks Stripe ------------------------------------------------------------------

def test_the_sweep_opens_a_paid_job_whose_event_never_came(client, market, rail, real_clock):
    db, settings = client.app.service.db, client.app.service.settings
    job = usd_job(client, market.requester_key)['job']
    rail.pay(job)
    assert mp.run_sweeps(db, settings)['checkouts'] == {'checked': 0, 'failed': 0, 'opened': [], 'cancelled': []}
    real_clock.set(mp.now() + timedelta(minutes=2))
    rail.failures.append(StripeUnavailable('down'))
    assert mp.run_sweeps(db, settings)['checkouts']['failed'] == 1           # tried again at the next sweep
    assert mp.run_sweeps(db, settings)['checkouts'] == {'checked': 1, 'failed': 0, 'opened': [job['id']],
                                                         'cancelled': []}
    assert state(db, job['id']) == ('open', 'locked', 1, 0)
    assert db.value("SELECT reference FROM payments WHERE job_id = :id", {'id': job['id']}) == \
        rail.session_of(job)['payment_intent']
    assert mp.run_sweeps(db, settings)['checkouts']['checked'] == 0         # nothing pending any more
    # its event comes after all: applied once, nothing more
    assert send(client, rail, 'checkout.session.completed', stripe_object(rail.session_of(job))).json['outcome'] \
        == 'unchanged'
    assert state(db, job['id'])[:3] == ('open', 'locked', 1)


def test_the_sweep_cancels_a_job_whose_session_expired_and_leaves_open_ones(client, market, rail, real_clock):
    db, settings = client.app.service.db, client.app.service.settings
    expired, waiting = usd_job(client, market.requester_key)['job'], usd_job(client, market.requester_key)['job']
    rail.expire(expired)
    real_clock.set(mp.now() + timedelta(minutes=2))
    assert mp.run_sweeps(db, settings)['checkouts'] == {'checked': 2, 'failed': 0, 'opened': [],
                                                         'cancelled': [expired['id']]}
    assert state(db, expired['id']) == ('cancelled', 'pending', 0, 0)
    assert state(db, waiting['id']) == ('pending_payment', 'pending', 0, 0)


def test_the_sweep_without_stripe_reports_no_checkouts(tmp_path):
    app = wiring.make_app(mp.Settings(db=str(tmp_path / 'plain.db')))
    try:
        assert 'checkouts' not in mp.run_sweeps(app.service.db, app.service.settings)
    finally:
        app.service.close()


def test_lists_leave_out_pending_jobs_in_index_order(client, market, rail):
    """find_jobs without a status filter leaves pending jobs out of pages and totals, still in index order."""
    db = client.app.service.db
    pending = usd_job(client, market.requester_key)['job']
    opened = usd_job(client, market.requester_key)['job']
    send(client, rail, 'checkout.session.completed', stripe_object(rail.pay(opened)))
    for sort in ('newest', 'oldest', 'pay_desc', 'deadline'):
        seqs, total = mp.find_jobs(db, sort=sort)
        assert (len(seqs), total) == (1, 1)
    seqs, total = mp.find_jobs(db, match='"flaky"', sort='relevance')
    assert (len(seqs), total) == (1, 1)
    assert mp.jobs_in_order(db, seqs)[0]['id'] == opened['id'] != pending['id']


def test_less_than_fifty_cents_cannot_be_paid_by_card(client, market, rail):
    answer = client.post('/api/jobs', job_body(paymentCurrency='USD', paymentAmount='0.49'), key=market.requester_key)
    assert_error(answer, 400, 'validation_failed', fields=['paymentAmount'])
    assert rail.calls == []


# The real stack: stripe_rail.py and the stripe library against tests/fake_stripe.py ------------------------

@pytest.fixture
def real(tmp_path, fake_stripe):
    """An in-process app whose StripeRail is the real one, pointed at the fake Stripe API."""
    settings = mp.Settings(db=str(tmp_path / 'real.db'), rate_limits='off', admin_key=ADMIN_KEY,
                           public_url='http://market.test', allow_private_webhooks=True,
                           stripe_secret_key=fake_stripe.secret_key, stripe_webhook_secret=fake_stripe.webhook_secret,
                           stripe_api_base=fake_stripe.url)
    app = wiring.make_app(settings)
    yield app
    problems = mp.ledger_problems(app.service.db)
    app.service.close()
    assert problems == []


def post_event(client, fake, kind, thing, **options):
    payload, signature = fake.event(kind, thing, **options)
    return client.post('/api/stripe/webhook', payload, headers={'Stripe-Signature': signature})


def test_the_real_rail_opens_the_session_the_contract_asks_for(real, fake_stripe):
    client = Client(real)
    _, key = make_account(client, 'requester')
    answer = usd_job(client, key, paymentAmount='12.34')
    job = answer['job']
    (post,) = fake_stripe.posts('/v1/checkout/sessions')
    form = post['form']
    assert post['idempotency_key'] == f'checkout-{job["id"]}'
    assert (form['mode'], form['client_reference_id'], form['metadata'], form['payment_intent_data']['transfer_group'],
            form['line_items'][0]['price_data']['unit_amount'], form['line_items'][0]['price_data']['currency']) == \
        ('payment', job['id'], {'job_id': job['id']}, f'job_{job["id"]}', '1234', 'usd')
    session_id = real.service.db.value('SELECT stripe_session_id FROM jobs WHERE id = :id', {'id': job['id']})
    assert answer['checkoutUrl'] == fake_stripe.session(session_id)['url']
    # paid: the event (signed by the library's own helper) opens it with the charge of the expanded PaymentIntent
    session = fake_stripe.complete(session_id)
    opened = post_event(client, fake_stripe, 'checkout.session.completed', session)
    assert opened.json['outcome'] == 'opened', opened
    intent = fake_stripe.payment_intent(session['payment_intent'])
    row = real.service.db.row('SELECT status, payment_intent, stripe_charge FROM jobs WHERE id = :id', {'id': job['id']})
    assert (row['status'], row['payment_intent'], row['stripe_charge']) == ('open', intent['id'], intent['latest_charge'])


def test_the_real_rail_refuses_stale_and_foreign_signatures(real, fake_stripe):
    client = Client(real)
    _, key = make_account(client, 'requester')
    job = usd_job(client, key)['job']
    session_id = real.service.db.value('SELECT stripe_session_id FROM jobs WHERE id = :id', {'id': job['id']})
    session = fake_stripe.complete(session_id)
    stale = post_event(client, fake_stripe, 'checkout.session.completed', session, timestamp=int(time.time()) - 301)
    foreign = post_event(client, fake_stripe, 'checkout.session.completed', session, secret='whsec_another')
    for answer in (stale, foreign):
        assert_error(answer, 400, 'invalid_signature')
    assert state(real.service.db, job['id']) == ('pending_payment', 'pending', 0, 0)


def test_the_real_rail_down_is_503_and_the_sweep_reconciles(real, fake_stripe, real_clock):
    client = Client(real)
    _, key = make_account(client, 'requester')
    fake_stripe.fail_next(1, 503)
    assert_error(client.post('/api/jobs', job_body(paymentCurrency='USD'), key=key), 503, 'payment_provider_unavailable')
    fake_stripe.fail_next(1, 'drop')
    assert_error(client.post('/api/jobs', job_body(paymentCurrency='USD'), key=key), 503, 'payment_provider_unavailable')
    assert real.service.db.value('SELECT count(*) FROM jobs') == 0
    paid, expired = usd_job(client, key)['job'], usd_job(client, key)['job']
    ids = {job['id']: real.service.db.value('SELECT stripe_session_id FROM jobs WHERE id = :id', {'id': job['id']})
           for job in (paid, expired)}
    fake_stripe.complete(ids[paid['id']])
    fake_stripe.expire(ids[expired['id']])
    real_clock.set(mp.now() + timedelta(minutes=2))
    checkouts = mp.run_sweeps(real.service.db, real.service.settings)['checkouts']
    assert checkouts == {'checked': 2, 'failed': 0, 'opened': [paid['id']], 'cancelled': [expired['id']]}
    assert state(real.service.db, paid['id']) == ('open', 'locked', 1, 0)
    assert state(real.service.db, expired['id']) == ('cancelled', 'pending', 0, 0)


# Over HTTP: the real server --------------------------------------------------------------------------------

@pytest.fixture
def stripe_server(tmp_path, fake_stripe):
    server = LiveServer(tmp_path / 'live.db', [
        '--stripe-secret-key', fake_stripe.secret_key, '--stripe-webhook-secret', fake_stripe.webhook_secret,
        '--stripe-api-base', fake_stripe.url, '--public-url', 'http://market.test']).start()
    yield server
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait(10)


def test_funding_through_the_real_server(stripe_server, fake_stripe):
    import requests
    url = stripe_server.url
    key = requests.post(url + '/api/accounts', json={'name': 'requester'}, timeout=10).json()['apiKey']
    auth = {'Authorization': f'Bearer {key}'}
    fake_stripe.fail_next(1, 500)
    down = requests.post(url + '/api/jobs', json=job_body(paymentCurrency='USD'), headers=auth, timeout=15)
    assert (down.status_code, down.json()['code'], down.headers['Retry-After']) == \
        (503, 'payment_provider_unavailable', '30')
    answer = requests.post(url + '/api/jobs', json=job_body(paymentCurrency='USD'), headers=auth, timeout=15)
    assert answer.status_code == 201, answer.text
    job, checkout_url = answer.json()['job'], answer.json()['checkoutUrl']
    assert job['status'] == 'pending_payment' and checkout_url.startswith(fake_stripe.url)
    assert requests.get(f'{url}/api/jobs/{job["id"]}', timeout=10).status_code == 404
    assert requests.get(f'{url}/api/jobs', timeout=10).json()['total'] == 0
    (session_id,) = fake_stripe.sessions
    payload, signature = fake_stripe.event('checkout.session.completed', fake_stripe.complete(session_id))
    bad = requests.post(url + '/api/stripe/webhook', data=payload, headers={'Stripe-Signature': signature[:-2] + '00'},
                        timeout=10)
    assert (bad.status_code, bad.json()['code']) == (400, 'invalid_signature')
    for outcome in ('opened', 'duplicate'):
        sent = requests.post(url + '/api/stripe/webhook', data=payload, headers={'Stripe-Signature': signature,
                                                                               'Content-Type': 'application/json'},
                             timeout=15)
        assert (sent.status_code, sent.json()['outcome']) == (200, outcome), sent.text
    shown = requests.get(f'{url}/api/jobs/{job["id"]}', timeout=10).json()
    assert (shown['job']['status'], shown['job']['escrowStatus'], shown['payments'][0]['reference']) == \
        ('open', 'locked', fake_stripe.session(session_id)['payment_intent'])
    assert [j['id'] for j in requests.get(f'{url}/api/jobs', timeout=10).json()['jobs']] == [job['id']]
    assert job['id'] in requests.get(f'{url}/api/jobs/feed', timeout=10).text
    assert stripe_server.terminate() == 0
    logs = stripe_server.output()
    assert fake_stripe.secret_key not in logs and fake_stripe.webhook_secret not in logs
