"""The stripe rail's payouts, refunds and workers' onboarding (CONTRACT.md 12), through HTTP, against the fake
Stripe API (tests/fake_stripe.py) used through the real `stripe` library; the last test against the real server.

A release of a job paid through Stripe is a Transfer to the agent's connected account drawn on the job's charge,
a refund a Refund of its PaymentIntent; each is recorded pending, sent after the commit (and by every sweep while
pending) with the record's id as idempotency key, and confirmed with the Stripe id as reference. The ledger
balances after every test (the app fixture checks it)."""

import json
import time
from datetime import timedelta

import pytest
import requests

import marketplace as mp
import wiring
from conftest import ADMIN_KEY, Client, LiveServer, Market, assert_error, job_body, make_account
from fake_stripe import fake_stripe, fake_stripe_server  # noqa: F401  (the fixtures)
from test_openapi import Checker

ONBOARDING = '/api/agents/<agent_id>/stripe/onboarding'


# The world: a service in stripe mode on the fake ---------------------------------------------------------

def stripe_settings(tmp_path, fake, **overrides):
    return mp.Settings(**{
        'db': str(tmp_path / 'stripe.db'), 'rate_limits': 'off', 'admin_key': ADMIN_KEY,
        'public_url': 'http://market.test', 'allow_private_webhooks': True, 'stripe_secret_key': fake.secret_key,
        'stripe_webhook_secret': fake.webhook_secret, 'stripe_connect_webhook_secret': fake.connect_webhook_secret,
        'stripe_api_base': fake.url, **overrides})


@pytest.fixture
def fee_percent():
    return mp.Decimal('0')


@pytest.fixture
def stripe_app(tmp_path, fake_stripe, fee_percent):     # noqa: F811  (a fixture)
    """The app in stripe mode on the fake; after the test the ledger must balance."""
    app = wiring.make_app(stripe_settings(tmp_path, fake_stripe, fee_percent=fee_percent))
    yield app
    problems = mp.ledger_problems(app.service.db)
    app.service.close()
    assert problems == []


@pytest.fixture
def checker(stripe_app):
    return Checker(json.loads(json.dumps(stripe_app.service.openapi)))


class World(Market):
    """A requester, a worker with one agent (conftest's Market), the fake Stripe, and the steps of a job paid
    through Stripe."""

    def __init__(self, client, fake, db):
        super().__init__(client)
        self.fake, self.db = fake, db

    def webhook(self, kind, thing, account=None):
        """Deliver a signed Stripe event to the service (a Connect event, `account` set, signed with the Connect
        endpoint's secret, as Stripe does); its answer's JSON."""
        payload, signature = (self.fake.event(kind, thing) if account is None
                              else self.fake.connect_event(kind, thing, account))
        answer = self.client.post('/api/stripe/webhook', payload,
                                  headers={'Stripe-Signature': signature, 'Content-Type': 'application/json'})
        assert answer.status == 200, answer
        return answer.json

    def onboard(self, agent=None, key=None):
        answer = self.client.post(f'/api/agents/{(agent or self.agent)["id"]}/stripe/onboarding',
                                  key=key or self.worker_key)
        assert answer.status == 200, answer
        return answer.json

    def enable_payouts(self, account_id):
        """The worker finishes onboarding at Stripe, and Stripe says so (account.updated)."""
        return self.webhook('account.updated', self.fake.enable_payouts(account_id), account=account_id)

    def ready_agent(self):
        """Onboard the agent and enable its payouts: its connected account's id."""
        account_id = self.onboard()['accountId']
        self.enable_payouts(account_id)
        return account_id

    def paid_job(self, **overrides):
        """A job on rail stripe, paid through Checkout on the fake and opened by its event: the job's row."""
        answer = self.client.post('/api/jobs', job_body(paymentCurrency='USD', **overrides), key=self.requester_key)
        assert answer.status == 201 and answer.json['job']['status'] == 'pending_payment', answer
        job_id = answer.json['job']['id']
        session_id = self.db.value('SELECT stripe_session_id FROM jobs WHERE id = :id', {'id': job_id})
        assert self.webhook('checkout.session.completed', self.fake.complete(session_id))['outcome'] == 'opened'
        job = self.db.row('SELECT * FROM jobs WHERE id = :id', {'id': job_id})
        assert job['status'] == 'open' and job['payment_intent'] and job['stripe_charge'], job
        return job

    def deliver(self, job, claim, key=None):
        answer = self.client.post(f'/api/jobs/{job["id"]}/deliver',
                                  {'claimId': claim['id'], 'deliverable': {'type': 'url', 'url': 'https://x.test/o'}},
                                  key=key or self.worker_key)
        assert answer.status == 200, answer
        return claim

    def delivered(self, **overrides):
        job = self.paid_job(**overrides)
        return job, self.deliver(job, self.claim(job))

    def verify(self, job, claim, approved):
        answer = self.client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': approved},
                                  key=self.requester_key)
        assert answer.status == 200, answer
        return answer.json

    def payments(self, job, kind=None):
        answer = self.client.get(f'/api/jobs/{job["id"]}', key=self.requester_key)
        assert answer.status == 200, answer
        return [p for p in answer.json['payments'] if kind is None or p['type'] == kind]

    def sweep(self):
        return mp.run_sweeps(self.db, self.client.app.service.settings)

    def transfers(self):
        return self.fake.transfer_list()

    def refunds(self):
        return self.fake.refund_list()


@pytest.fixture
def world(stripe_app, fake_stripe):     # noqa: F811  (a fixture)
    return World(Client(stripe_app), fake_stripe, stripe_app.service.db)


def key_of(fake, path):
    """The idempotency keys of the POSTs the fake got at `path`, oldest first."""
    return [post['idempotency_key'] for post in fake.posts(path)]


# Onboarding -----------------------------------------------------------------------------------------------

def test_onboarding_creates_the_account_once_and_answers_a_fresh_link(world, checker):
    path = f'/api/agents/{world.agent["id"]}/stripe/onboarding'
    first = checker(world.client.post(path, key=world.worker_key), 'POST', ONBOARDING, 200).json
    assert first['accountId'].startswith('acct_') and first['url'].startswith(world.fake.url + '/setup/')
    assert first['expiresAt'] > mp.now_iso()
    second = world.onboard()
    assert second['accountId'] == first['accountId'] and second['url'] != first['url']
    assert len(world.fake.posts('/v1/accounts')) == 1        # one account, asked for once
    assert key_of(world.fake, '/v1/accounts') == [f'account-{world.agent["id"]}']
    account = world.fake.account(first['accountId'])
    assert account['type'] == 'express' and account['capabilities']['transfers'] in ('inactive', 'pending')
    links = world.fake.posts('/v1/account_links')
    page = f'http://market.test/agents/{world.agent["id"]}'
    assert [(link['form']['account'], link['form']['type'], link['form']['refresh_url'], link['form']['return_url'])
            for link in links] == [(first['accountId'], 'account_onboarding', page, page)] * 2
    shown = checker(world.client.get(f'/api/agents/{world.agent["id"]}'), 'GET', '/api/agents/<agent_id>', 200)
    assert shown.json['agent']['stripe'] == {'accountId': first['accountId'], 'payoutsEnabled': False}


def test_only_the_owner_onboards(world, checker):
    _, stranger_key = make_account(world.client, 'stranger')
    path = f'/api/agents/{world.agent["id"]}/stripe/onboarding'
    assert_error(checker(world.client.post(path, key=stranger_key), 'POST', ONBOARDING), 403, 'forbidden')
    assert_error(world.client.post(path, key=ADMIN_KEY), 403, 'forbidden')
    assert_error(world.client.post(path), 401, 'unauthorized')
    assert world.fake.posts() == []
    assert world.client.get(f'/api/agents/{world.agent["id"]}').json['agent']['stripe'] is None


def test_onboarding_when_stripe_fails_is_503_and_stores_nothing(world, checker):
    world.fake.fail_next(1, 500)
    answer = checker(world.client.post(f'/api/agents/{world.agent["id"]}/stripe/onboarding', key=world.worker_key),
                     'POST', ONBOARDING)
    assert_error(answer, 503, 'payment_provider_unavailable')
    assert world.db.value('SELECT stripe_account_id FROM agents WHERE id = :id', {'id': world.agent['id']}) is None
    assert world.onboard()['accountId'].startswith('acct_')       # the retry makes it


def test_onboarding_without_stripe_is_404(client, market):
    answer = client.post(f'/api/agents/{market.agent["id"]}/stripe/onboarding', key=market.worker_key)
    assert_error(answer, 404, 'stripe_not_enabled')
    assert client.get(f'/api/agents/{market.agent["id"]}').json['agent']['stripe'] is None


def test_account_updated_sets_payouts_enabled_once(world):
    account_id = world.onboard()['accountId']
    half = dict(world.fake.account(account_id), payouts_enabled=True)      # transfers not active yet
    assert world.webhook('account.updated', half, account=account_id)['outcome'] == 'recorded'
    assert world.client.get(f'/api/agents/{world.agent["id"]}').json['agent']['stripe']['payoutsEnabled'] is False
    ready = world.fake.enable_payouts(account_id)
    payload, signature = world.fake.event('account.updated', ready, account_id)
    for outcome in ('recorded', 'duplicate'):       # Stripe sends it again: no second effect
        answer = world.client.post('/api/stripe/webhook', payload, headers={'Stripe-Signature': signature})
        assert answer.status == 200 and answer.json['outcome'] == outcome, answer
    agent = world.client.get(f'/api/agents/{world.agent["id"]}').json['agent']
    assert agent['stripe'] == {'accountId': account_id, 'payoutsEnabled': True}
    assert world.webhook('account.updated', dict(ready, id='acct_nobody'), account='acct_nobody')['outcome'] == \
        'unchanged'


# Releases -------------------------------------------------------------------------------------------------

def test_approval_transfers_the_share_to_the_connected_account(world, checker):
    account_id = world.ready_agent()
    job, claim = world.delivered(paymentAmount='25.00')
    answer = checker(world.client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': True},
                                       key=world.requester_key), 'POST', '/api/jobs/<job_id>/verify', 200)
    assert answer.json['job']['status'] == 'completed' and answer.json['escrowStatus'] == 'released'
    [release] = world.payments(job, 'release')
    [transfer] = world.transfers()
    assert (transfer['amount'], transfer['currency'], transfer['destination'], transfer['source_transaction'],
            transfer['transfer_group']) == (2500, 'usd', account_id, job['stripe_charge'], f'job_{job["id"]}')
    assert key_of(world.fake, '/v1/transfers') == [release['id']]
    assert (release['status'], release['reference'], release['recipient'], release['amount']) == \
        ('confirmed', transfer['id'], account_id, '25.00')
    assert world.refunds() == [] and world.payments(job, 'fee') == []
    assert world.sweep()['stripePayments'] == {'sent': 0, 'waiting': 0, 'failed': 0}
    assert len(world.transfers()) == 1


@pytest.mark.parametrize('fee_percent', [mp.Decimal('10')])
def test_the_fee_stays_in_the_platform_balance(world, fee_percent):
    account_id = world.ready_agent()
    job, claim = world.delivered(paymentAmount='25.00')
    world.verify(job, claim, True)
    [transfer] = world.transfers()
    assert (transfer['amount'], transfer['destination']) == (2250, account_id)
    [release], [fee] = world.payments(job, 'release'), world.payments(job, 'fee')
    assert (release['amount'], release['status'], release['reference']) == ('22.50', 'confirmed', transfer['id'])
    assert (fee['amount'], fee['status'], fee['recipient'], fee['reference']) == ('2.50', 'confirmed', 'operator', None)


def test_a_release_waits_until_payouts_are_enabled(world):
    account_id = world.onboard()['accountId']
    job, claim = world.delivered()
    world.verify(job, claim, True)
    [release] = world.payments(job, 'release')
    assert (release['status'], release['reference'], release['recipient']) == ('pending', None, account_id)
    assert world.sweep()['stripePayments'] == {'sent': 0, 'waiting': 1, 'failed': 0}
    assert world.transfers() == []
    world.enable_payouts(account_id)
    assert world.sweep()['stripePayments'] == {'sent': 1, 'waiting': 0, 'failed': 0}
    world.sweep()
    [transfer] = world.transfers()
    [release] = world.payments(job, 'release')
    assert (release['status'], release['reference']) == ('confirmed', transfer['id'])
    assert key_of(world.fake, '/v1/transfers') == [release['id']]


def test_a_worker_paid_before_onboarding_is_paid_to_the_account_made_later(world):
    job, claim = world.delivered()
    world.verify(job, claim, True)
    [release] = world.payments(job, 'release')
    assert (release['status'], release['recipient']) == ('pending', world.agent['id'])
    account_id = world.ready_agent()
    world.sweep()
    [transfer] = world.transfers()
    [release] = world.payments(job, 'release')
    assert (release['status'], release['recipient'], transfer['destination']) == ('confirmed', account_id, account_id)


# Refunds --------------------------------------------------------------------------------------------------

def test_rejection_refunds_the_whole_amount(world):
    world.ready_agent()
    job, claim = world.delivered(paymentAmount='40.00')
    answer = world.verify(job, claim, False)
    assert answer['job']['status'] == 'rejected' and answer['escrowStatus'] == 'refunded'
    [refund] = world.refunds()
    [record] = world.payments(job, 'refund')
    assert (refund['amount'], refund['payment_intent']) == (4000, job['payment_intent'])
    assert (record['status'], record['reference'], record['amount']) == ('confirmed', refund['id'], '40.00')
    assert key_of(world.fake, '/v1/refunds') == [record['id']]
    assert world.transfers() == []


def test_cancel_refunds(world):
    job = world.paid_job(paymentAmount='12.34')
    answer = world.client.post(f'/api/jobs/{job["id"]}/cancel', key=world.requester_key)
    assert answer.status == 200 and answer.json['job']['status'] == 'cancelled', answer
    [refund] = world.refunds()
    assert refund['amount'] == 1234
    assert world.payments(job, 'refund')[0]['reference'] == refund['id']


def test_all_paid_shares_transfer_and_unused_shares_refund_at_the_end(world, real_clock):
    account_id = world.ready_agent()
    job = world.paid_job(paymentAmount='30.00', maxWorkers=3, competitionMode='all-paid',
                         deadline=mp.iso(mp.now() + timedelta(hours=3)))
    claim = world.deliver(job, world.claim(job))
    world.verify(job, claim, True)
    [transfer] = world.transfers()
    assert (transfer['amount'], transfer['destination']) == (1000, account_id)
    assert world.refunds() == []
    real_clock.set(mp.now() + timedelta(hours=4))
    answer = world.client.post('/api/jobs/expire', key=ADMIN_KEY)
    assert answer.status == 200 and answer.json['jobIds'] == [job['id']], answer
    [refund] = world.refunds()
    assert (refund['amount'], refund['payment_intent']) == (2000, job['payment_intent'])
    detail = world.client.get(f'/api/jobs/{job["id"]}', key=world.requester_key).json
    assert (detail['job']['status'], detail['job']['escrowStatus']) == ('completed', 'released')
    assert [(p['type'], p['amount'], p['status']) for p in detail['payments']] == [
        ('escrow', '30.00', 'confirmed'), ('release', '10.00', 'confirmed'), ('refund', '20.00', 'confirmed')]


@pytest.mark.parametrize('outcome', ['worker', 'requester'])
def test_a_dispute_decided_each_way(world, outcome):
    account_id = world.ready_agent()
    job, claim = world.delivered(paymentAmount='18.00')
    answer = world.client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'Half done.'},
                               key=world.requester_key)
    assert answer.status == 201, answer
    dispute_id = answer.json['dispute']['id']
    assert world.transfers() == [] and world.refunds() == []
    answer = world.client.patch(f'/api/disputes/{dispute_id}', {'outcome': outcome, 'resolution': 'Decided.'},
                                key=ADMIN_KEY)
    assert answer.status == 200, answer
    if outcome == 'worker':
        [transfer] = world.transfers()
        assert (transfer['amount'], transfer['destination'], world.refunds()) == (1800, account_id, [])
        assert world.payments(job, 'release')[0]['reference'] == transfer['id']
    else:
        [refund] = world.refunds()
        assert (refund['amount'], world.transfers()) == (1800, [])
        assert world.payments(job, 'refund')[0]['reference'] == refund['id']


def test_a_job_on_rail_stripe_from_simulated_mode_stays_simulated(world):
    """A job row without a PaymentIntent (made while the rail was simulated) pays nothing through Stripe."""
    world.ready_agent()
    job = world.paid_job()
    world.db.execute('UPDATE jobs SET payment_intent = NULL WHERE id = :id', {'id': job['id']})
    claim = world.deliver(job, world.claim(job))
    world.verify(job, claim, True)
    assert [p['status'] for p in world.payments(job, 'release')] == ['simulated']
    assert world.transfers() == []


# Stripe failing -------------------------------------------------------------------------------------------

def test_stripe_failing_for_a_while_pays_everything_exactly_once(world):
    account_id = world.ready_agent()
    approved, rejected, lost = world.delivered(), world.delivered(), world.delivered()
    world.fake.fail_next(2, 500)            # the transfer and the refund asked for after the two answers
    assert world.verify(*approved, True)['payments'][0]['status'] == 'pending'
    assert world.verify(*rejected, False)['payments'][0]['status'] == 'pending'
    world.fake.fail_next(1, 500, after=True)    # Stripe makes this transfer but its answer is lost
    assert world.verify(*lost, True)['payments'][0]['status'] == 'pending'
    assert len(world.transfers()) == 1 and world.refunds() == []
    assert [p['status'] for job, _ in (approved, rejected, lost) for p in world.payments(job)
            if p['type'] != 'escrow'] == ['pending'] * 3
    world.fake.fail_next(1, 'drop')          # the first sweep's first call: no answer at all; the round stops
    assert world.sweep()['stripePayments'] == {'sent': 0, 'waiting': 0, 'failed': 1}
    assert world.sweep()['stripePayments'] == {'sent': 3, 'waiting': 0, 'failed': 0}
    assert world.sweep()['stripePayments'] == {'sent': 0, 'waiting': 0, 'failed': 0}
    transfers, refunds = world.transfers(), world.refunds()
    assert len(transfers) == 2 and len(refunds) == 1
    assert {t['destination'] for t in transfers} == {account_id}
    for job, _ in (approved, rejected, lost):
        [record] = [p for p in world.payments(job) if p['type'] != 'escrow']
        assert record['status'] == 'confirmed'
        assert record['reference'] in {t['id'] for t in transfers} | {r['id'] for r in refunds}
        assert set(key_of(world.fake, '/v1/transfers') + key_of(world.fake, '/v1/refunds')) >= {record['id']}
    # every retry used its record's id: each key names one record
    records = {p['id'] for job, _ in (approved, rejected, lost) for p in world.payments(job)}
    assert set(key_of(world.fake, '/v1/transfers') + key_of(world.fake, '/v1/refunds')) <= records


# The real server killed between an approval's answer and its transfer -----------------------------------

def test_sigkill_between_the_answer_and_the_transfer_pays_once(tmp_path, fake_stripe):     # noqa: F811
    env = {'MARKETPLACE_STRIPE_SECRET_KEY': fake_stripe.secret_key,
           'MARKETPLACE_STRIPE_WEBHOOK_SECRET': fake_stripe.webhook_secret,
           'MARKETPLACE_STRIPE_API_BASE': fake_stripe.url}
    db = tmp_path / 'live.db'
    server = LiveServer(db, ['--sweep-interval', '0.5'], env=env).start()
    try:
        world = LiveWorld(server.url, fake_stripe)
        account_id = world.ready_agent()
        job, claim = world.delivered()
        fake_stripe.delay_next(3)               # the transfer: Stripe holds it while the server dies
        answer = world.call('POST', f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': True},
                            world.requester_key)
        assert answer.status_code == 200, answer.text
        [release] = [p for p in answer.json()['payments'] if p['type'] == 'release']
        assert release['status'] == 'pending'
        wait_for(lambda: fake_stripe.posts('/v1/transfers'))
        server.kill()
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait(10)
    wait_for(lambda: fake_stripe.transfer_list())   # the held request runs: Stripe made the transfer, nobody heard
    assert len(fake_stripe.transfer_list()) == 1
    again = LiveServer(db, ['--sweep-interval', '0.5'], env=env).start()
    try:
        def confirmed():
            detail = requests.get(f'{again.url}/api/jobs/{job["id"]}', timeout=5).json()
            return [p for p in detail['payments'] if p['type'] == 'release' and p['status'] == 'confirmed']
        [paid] = wait_for(confirmed)
        [transfer] = fake_stripe.transfer_list()
        assert (paid['reference'], transfer['destination'], transfer['amount']) == (transfer['id'], account_id, 2500)
        assert key_of(fake_stripe, '/v1/transfers') == [release['id'], release['id']]     # the same key, twice
        time.sleep(1.2)                         # more sweeps: nothing more
        assert len(fake_stripe.transfer_list()) == 1 and len(fake_stripe.posts('/v1/transfers')) == 2
    finally:
        assert again.terminate() == 0
    database = mp.Database(str(db))
    try:
        assert mp.ledger_problems(database) == []
    finally:
        database.close()


def wait_for(check, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError('timed out waiting')


class LiveWorld(World):
    """World's steps over HTTP against a real server."""

    def __init__(self, url, fake):
        self.url, self.fake = url, fake
        self.requester, self.requester_key = self.account('requester')
        self.worker, self.worker_key = self.account('worker')
        answer = self.call('POST', '/api/agents', {'name': 'worker-agent', 'walletAddress': '0x' + '12' * 20},
                           self.worker_key)
        assert answer.status_code == 201, answer.text
        self.agent = answer.json()['agent']

    def call(self, method, path, body=None, key=None, headers=None):
        headers = dict(headers or {}, **({'Authorization': f'Bearer {key}'} if key else {}))
        data = body if isinstance(body, bytes) else (None if body is None else json.dumps(body).encode())
        if data is not None:
            headers.setdefault('Content-Type', 'application/json')
        return requests.request(method, self.url + path, data=data, headers=headers, timeout=10)

    def account(self, name):
        answer = self.call('POST', '/api/accounts', {'name': name})
        assert answer.status_code == 201, answer.text
        return answer.json()['account'], answer.json()['apiKey']

    def webhook(self, kind, thing, account=None):
        payload, signature = self.fake.event(kind, thing, account)
        answer = self.call('POST', '/api/stripe/webhook', payload, headers={'Stripe-Signature': signature})
        assert answer.status_code == 200, answer.text
        return answer.json()

    def onboard(self, agent=None, key=None):
        answer = self.call('POST', f'/api/agents/{self.agent["id"]}/stripe/onboarding', None, self.worker_key)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def paid_job(self, **overrides):
        answer = self.call('POST', '/api/jobs', job_body(paymentCurrency='USD', **overrides), self.requester_key)
        assert answer.status_code == 201, answer.text
        job = answer.json()['job']
        [session_id] = [s for s, session in self.fake.sessions.items() if session['client_reference_id'] == job['id']]
        assert self.webhook('checkout.session.completed', self.fake.complete(session_id))['outcome'] == 'opened'
        return job

    def claim(self, job, agent=None, key=None):
        answer = self.call('POST', f'/api/jobs/{job["id"]}/claim', {'agentId': self.agent['id']}, self.worker_key)
        assert answer.status_code == 201, answer.text
        return answer.json()['claim']

    def deliver(self, job, claim, key=None):
        answer = self.call('POST', f'/api/jobs/{job["id"]}/deliver',
                           {'claimId': claim['id'], 'deliverable': {'type': 'url', 'url': 'https://example.com/o'}},
                           self.worker_key)
        assert answer.status_code == 200, answer.text
        return claim


def test_a_job_paid_through_stripe_is_not_settled_without_stripe(world, tmp_path):
    """The same database served without the Stripe key: the verdict is 503, nothing changes, the sweeps wait."""
    job, claim = world.delivered()
    before = world.payments(job)
    plain = wiring.make_app(mp.Settings(db=str(tmp_path / 'stripe.db'), rate_limits='off', admin_key=ADMIN_KEY,
                                    public_url='http://market.test', allow_private_webhooks=True,
                                    allow_simulated_rails=True))
    try:
        client = Client(plain)
        answer = client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': True},
                             key=world.requester_key)
        assert_error(answer, 503, 'payment_provider_unavailable')
        world.db.execute("UPDATE claims SET delivered_at = '2000-01-01T00:00:00.000Z' WHERE id = :id",
                         {'id': claim['id']})
        assert mp.run_sweeps(plain.service.db, plain.service.settings)['autoVerify']['autoApproved'] == 0
    finally:
        plain.service.close()
    assert world.payments(job) == before and world.transfers() == []


# The pages -----------------------------------------------------------------------------------------------

def test_the_pages_link_the_stripe_references_to_the_dashboard(world):
    account_id = world.ready_agent()
    job, claim = world.delivered(title='Paid by card')
    world.verify(job, claim, approved=True)
    [escrow] = world.payments(job, 'escrow')
    [release] = world.payments(job, 'release')
    assert (release['status'], release['reference'][:3]) == ('confirmed', 'tr_')
    dashboard = 'https://dashboard.stripe.com/test'        # the fake's key is a test key: the test-mode dashboard
    page = world.client.get(f'/jobs/{job["id"]}')
    assert page.status == 200, page
    html = page.body.decode()
    assert f'<a href="{dashboard}/payments/{escrow["reference"]}">' in html              # timeline and table
    assert html.count(f'<a href="{dashboard}/connect/transfers/{release["reference"]}">') == 2
    agent_page = world.client.get(f'/agents/{world.agent["id"]}').body.decode()
    assert 'payouts enabled' in agent_page
    assert f'<a href="{dashboard}/connect/accounts/{account_id}">' in agent_page
