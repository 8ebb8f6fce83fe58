"""Card money that goes back stops payouts, and Stripe Connect for real (CONTRACT.md 20), through HTTP against the
fake Stripe API (tests/fake_stripe.py) used through the real `stripe` library.

A dispute over a job's charge holds its escrow (nothing leaves it: a transfer already decided waits), a dispute won
lifts the hold, a dispute lost ends the job cancelled and charged_back with no Refund sent; a refund made in the
Stripe Dashboard of the whole charge ends it cancelled and refunded (no second Refund), of a part holds it. Connect
events come signed with the Connect endpoint's secret, and the sweep asks Stripe for an account that releases wait
for when no account.updated ever comes. The ledger balances after every test (stripe_app checks it)."""

from datetime import timedelta

import pytest

import marketplace as mp
import wiring
from conftest import ADMIN_KEY, Client, assert_error, make_agent
from fake_stripe import fake_stripe, fake_stripe_server  # noqa: F401  (the fixtures)
from test_stripe_payouts import World, fee_percent, stripe_app, stripe_settings, world  # noqa: F401  (fixtures)


def shown(world, job, key=None):
    """GET /api/jobs/:id as the requester sees it."""
    answer = world.client.get(f'/api/jobs/{job["id"]}', key=key or world.requester_key)
    assert answer.status == 200, answer
    return answer.json


def decided_but_not_sent(world, approved=True):
    """A job whose verdict is decided (its release or refund recorded pending) while Stripe fails, so its Transfer
    or Refund is not sent yet: (job, the pending payment)."""
    job, claim = world.delivered(paymentAmount='20.00')
    world.fake.fail_next(1, 500)
    world.verify(job, claim, approved)
    [payment] = world.payments(job, 'release' if approved else 'refund')
    assert payment['status'] == 'pending' and world.transfers() == [] and world.refunds() == []
    return job, payment


def stripe_steps(detail):
    return [(step['kind'], step['reference']) for step in detail['timeline'] if step['kind'] == 'stripe']


# Disputes (chargebacks) -----------------------------------------------------------------------------------

def test_a_dispute_holds_a_transfer_not_sent_yet_and_a_dispute_won_sends_it_once(world):
    account_id = world.ready_agent()
    job, release = decided_but_not_sent(world)
    dispute = world.fake.dispute(job['stripe_charge'])
    assert world.webhook('charge.dispute.created', dispute) == {
        'received': True, 'eventId': world.fake.events[-1]['id'], 'outcome': 'held', 'jobId': job['id']}
    detail = shown(world, job)
    assert (detail['job']['escrowStatus'], detail['job']['needsAdmin'], detail['job']['status']) == \
        ('held', True, 'completed')
    for _ in range(2):      # the sweep sends nothing while it is held
        assert world.sweep()['stripePayments'] == {'sent': 0, 'waiting': 0, 'failed': 0}
    assert world.transfers() == [] and world.fake.posts('/v1/transfers')[1:] == []     # only the failed try
    assert world.webhook('charge.dispute.closed', world.fake.close_dispute(dispute['id'], 'won'))['outcome'] == \
        'unheld'
    [transfer] = world.transfers()
    assert (transfer['amount'], transfer['destination']) == (2000, account_id)
    world.sweep()
    assert len(world.transfers()) == 1
    detail = shown(world, job)
    assert (detail['job']['escrowStatus'], detail['job']['needsAdmin']) == ('released', False)
    [release] = world.payments(job, 'release')
    assert (release['status'], release['reference']) == ('confirmed', transfer['id'])
    assert stripe_steps(detail) == [('stripe', job['payment_intent']), ('stripe', dispute['id']),
                                    ('stripe', dispute['id'])]
    assert mp.ledger_problems(world.db) == []


@pytest.mark.parametrize('fee_percent', [mp.Decimal('10')])
def test_a_dispute_lost_cancels_the_job_charged_back_with_no_refund_and_no_transfer(world, fee_percent):
    world.ready_agent()
    job, release = decided_but_not_sent(world)
    dispute = world.fake.dispute(job['stripe_charge'])
    world.webhook('charge.dispute.created', dispute)
    answer = world.webhook('charge.dispute.closed', world.fake.close_dispute(dispute['id'], 'lost'))
    assert (answer['outcome'], answer['jobId']) == ('charged_back', job['id'])
    detail = shown(world, job)
    assert (detail['job']['status'], detail['job']['escrowStatus'], detail['job']['needsAdmin']) == \
        ('cancelled', 'charged_back', False)
    # the release and its fee never happened (cancelled, reversed in the ledger); the whole price went back
    assert [(p['type'], p['amount'], p['status'], p['reference']) for p in detail['payments']] == [
        ('escrow', '20.00', 'confirmed', job['payment_intent']), ('release', '18.00', 'cancelled', None),
        ('fee', '2.00', 'cancelled', None), ('refund', '20.00', 'confirmed', dispute['id'])]
    world.sweep()
    assert world.transfers() == [] and world.refunds() == [] and world.fake.posts('/v1/refunds') == []
    assert world.db.value('SELECT sum(amount) FROM ledger_entries WHERE account = :a',
                          {'a': f'worker:{world.agent["id"]}'}) == 0
    assert world.db.value("SELECT sum(amount) FROM ledger_entries WHERE account = 'fees'") == 0
    assert [step['kind'] for step in detail['timeline']][-3:] == ['stripe', 'refund', 'cancelled']
    assert mp.ledger_problems(world.db) == []


def test_a_transfer_already_made_stays_made_and_the_job_shows_needs_admin(world):
    world.ready_agent()
    job, claim = world.delivered(paymentAmount='20.00')
    world.verify(job, claim, True)
    [transfer] = world.transfers()
    dispute = world.fake.dispute(job['stripe_charge'])
    assert world.webhook('charge.dispute.created', dispute)['outcome'] == 'held'
    job_json = shown(world, job)['job']
    assert (job_json['escrowStatus'], job_json['needsAdmin']) == ('held', True)
    listed = world.client.get('/api/jobs?status=completed', key=world.requester_key).json['jobs']
    assert [(j['id'], j['needsAdmin']) for j in listed] == [(job['id'], True)]
    world.webhook('charge.dispute.closed', world.fake.close_dispute(dispute['id'], 'lost'))
    detail = shown(world, job)
    assert (detail['job']['status'], detail['job']['escrowStatus']) == ('cancelled', 'charged_back')
    assert world.transfers() == [transfer] and world.refunds() == []
    assert [(p['type'], p['status']) for p in detail['payments']] == [('escrow', 'confirmed'), ('release', 'confirmed')]


def test_a_verdict_given_while_held_waits_for_the_hold(world):
    world.ready_agent()
    job, claim = world.delivered(paymentAmount='20.00')
    dispute = world.fake.dispute(job['stripe_charge'])
    world.webhook('charge.dispute.created', dispute)
    answer = world.verify(job, claim, False)        # a rejection decided while held: its refund waits
    assert (answer['job']['status'], answer['escrowStatus'], answer['payments'][0]['status']) == \
        ('rejected', 'held', 'pending')
    world.sweep()
    assert world.refunds() == []
    world.webhook('charge.dispute.closed', world.fake.close_dispute(dispute['id'], 'won'))
    [refund] = world.refunds()
    assert refund['amount'] == 2000 and shown(world, job)['job']['escrowStatus'] == 'refunded'


# Refunds made in the Stripe Dashboard ---------------------------------------------------------------------

def test_a_whole_refund_from_the_dashboard_cancels_the_job_refunded_with_no_second_refund(world):
    world.ready_agent()
    job, refund = decided_but_not_sent(world, approved=False)       # our own Refund is decided, not sent
    charge = world.fake.refund_from_dashboard(job['stripe_charge'])
    answer = world.webhook('charge.refunded', charge)
    assert (answer['outcome'], answer['jobId']) == ('refunded', job['id'])
    detail = shown(world, job)
    assert (detail['job']['status'], detail['job']['escrowStatus'], detail['job']['needsAdmin']) == \
        ('cancelled', 'refunded', False)
    assert [(p['type'], p['status'], p['reference']) for p in detail['payments']] == [
        ('escrow', 'confirmed', job['payment_intent']), ('refund', 'cancelled', None),
        ('refund', 'confirmed', job['stripe_charge'])]
    world.sweep()
    world.sweep()
    assert [r.get('dashboard') for r in world.refunds()] == [True]        # the dashboard's, and no other
    assert len(world.fake.posts('/v1/refunds')) == 1                          # only the try that failed
    assert ('stripe', job['stripe_charge']) in stripe_steps(detail)


def test_a_whole_refund_from_the_dashboard_of_an_open_job_cancels_it(world):
    job = world.paid_job(paymentAmount='12.00')
    world.webhook('charge.refunded', world.fake.refund_from_dashboard(job['stripe_charge']))
    detail = shown(world, job)
    assert (detail['job']['status'], detail['job']['escrowStatus']) == ('cancelled', 'refunded')
    assert world.client.post(f'/api/jobs/{job["id"]}/cancel', key=world.requester_key).status == 409
    world.sweep()
    assert world.fake.posts('/v1/refunds') == [] and len(world.refunds()) == 1


def test_our_own_refund_coming_back_as_charge_refunded_changes_nothing(world):
    world.ready_agent()
    job, claim = world.delivered(paymentAmount='20.00')
    world.verify(job, claim, False)
    [refund] = world.refunds()
    charge = world.fake.charge(job['stripe_charge'])
    assert charge['amount_refunded'] == 2000
    assert world.webhook('charge.refunded', charge)['outcome'] == 'recorded'
    detail = shown(world, job)
    assert (detail['job']['status'], detail['job']['escrowStatus']) == ('rejected', 'refunded')
    assert [(p['type'], p['status'], p['reference']) for p in detail['payments']][1:] == [
        ('refund', 'confirmed', refund['id'])]


def test_a_partial_refund_from_the_dashboard_holds_the_escrow(world):
    world.ready_agent()
    job, claim = world.delivered(paymentAmount='20.00')
    answer = world.webhook('charge.refunded', world.fake.refund_from_dashboard(job['stripe_charge'], 500))
    assert answer['outcome'] == 'held'
    assert (shown(world, job)['job']['escrowStatus'], shown(world, job)['job']['needsAdmin']) == ('held', True)
    world.verify(job, claim, True)
    world.sweep()
    assert world.transfers() == []
    [release] = world.payments(job, 'release')
    assert release['status'] == 'pending'


# Stripe Connect for real ----------------------------------------------------------------------------------

def connect_webhook(world, account_id, secret):
    payload, signature = world.fake.event('account.updated', world.fake.enable_payouts(account_id), account_id,
                                          secret=secret)
    return world.client.post('/api/stripe/webhook', payload, headers={'Stripe-Signature': signature})


def test_a_connect_event_signed_with_the_connect_secret_enables_payouts(world):
    account_id = world.onboard()['accountId']
    answer = connect_webhook(world, account_id, world.fake.connect_webhook_secret)
    assert answer.status == 200 and answer.json['outcome'] == 'recorded', answer
    assert world.client.get(f'/api/agents/{world.agent["id"]}').json['agent']['stripe'] == \
        {'accountId': account_id, 'payoutsEnabled': True}


def test_an_event_signed_with_an_unknown_secret_is_refused(world):
    account_id = world.onboard()['accountId']
    answer = connect_webhook(world, account_id, 'whsec_someone_else_' + 'x' * 24)
    assert_error(answer, 400, 'invalid_signature')
    assert world.db.value('SELECT count(*) FROM stripe_events') == 0
    assert world.client.get(f'/api/agents/{world.agent["id"]}').json['agent']['stripe']['payoutsEnabled'] is False


def test_without_the_connect_secret_a_connect_event_is_refused(tmp_path, fake_stripe):     # noqa: F811
    app = wiring.make_app(stripe_settings(tmp_path, fake_stripe, stripe_connect_webhook_secret=''))
    try:
        world = World(Client(app), fake_stripe, app.service.db)
        account_id = world.onboard()['accountId']
        assert_error(connect_webhook(world, account_id, fake_stripe.connect_webhook_secret), 400, 'invalid_signature')
    finally:
        app.service.close()


def test_the_sweep_enables_payouts_when_no_account_updated_ever_comes(world, real_clock):
    account_id = world.onboard()['accountId']
    job, claim = world.delivered(paymentAmount='20.00')
    world.verify(job, claim, True)
    start = mp.now()
    real_clock.set(start)
    assert world.sweep()['stripeAccounts'] == {'checked': 1, 'enabled': 0, 'failed': 0}
    assert len(world.fake.account_reads(account_id)) == 1 and world.transfers() == []
    world.fake.enable_payouts(account_id)           # onboarding finished; its account.updated is lost
    for minutes in (0, 5, 9):       # asked at most once per ten minutes
        real_clock.set(start + timedelta(minutes=minutes))
        assert world.sweep()['stripeAccounts'] == {'checked': 0, 'enabled': 0, 'failed': 0}
    assert len(world.fake.account_reads(account_id)) == 1 and world.transfers() == []
    real_clock.set(start + timedelta(minutes=10))
    result = world.sweep()
    assert result['stripeAccounts'] == {'checked': 1, 'enabled': 1, 'failed': 0}
    assert result['stripePayments'] == {'sent': 1, 'waiting': 0, 'failed': 0}
    [transfer] = world.transfers()
    assert (transfer['amount'], transfer['destination']) == (2000, account_id)
    real_clock.set(start + timedelta(minutes=30))
    world.sweep()
    assert len(world.fake.account_reads(account_id)) == 2        # payouts enabled: not asked again
    assert world.client.get(f'/api/agents/{world.agent["id"]}').json['agent']['stripe']['payoutsEnabled'] is True


def test_the_sweep_does_not_ask_for_accounts_nothing_waits_for(world):
    world.onboard()
    world.paid_job()
    assert world.sweep()['stripeAccounts'] == {'checked': 0, 'enabled': 0, 'failed': 0}
    assert world.fake.account_reads() == []


def test_a_dispute_lost_ends_the_claims_and_disputes_of_the_job_so_nothing_pays_later(world):
    world.ready_agent()
    job, claim = world.delivered(paymentAmount='20.00', maxWorkers=2, competitionMode='all-paid')
    second_agent, _ = make_agent(world.client, world.worker_key, name='second-agent')
    other = world.deliver(job, world.claim(job, agent=second_agent))
    answer = world.client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': other['id'], 'reason': 'Half done.'},
                               key=world.requester_key)
    assert answer.status == 201, answer
    ours = answer.json['dispute']['id']
    dispute = world.fake.dispute(job['stripe_charge'])
    world.webhook('charge.dispute.created', dispute)
    world.webhook('charge.dispute.closed', world.fake.close_dispute(dispute['id'], 'lost'))
    detail = shown(world, job)
    assert [c['status'] for c in detail['claims']] == ['superseded', 'superseded']
    answer = world.client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': True},
                               key=world.requester_key)
    assert_error(answer, 409, 'claim_not_delivered')
    decided = world.client.patch(f'/api/disputes/{ours}', {'outcome': 'worker', 'resolution': 'Paid.'}, key=ADMIN_KEY)
    assert_error(decided, 409, 'dispute_resolved')
    assert [(s['kind'], s['text'], s['reference']) for s in detail['timeline'] if s['kind'] == 'dispute_decided'] == [
        ('dispute_decided', 'Dispute closed undecided — The card payment went back to the payer: nothing to decide.',
         ours)]
    world.sweep()
    assert world.transfers() == [] and world.fake.posts('/v1/refunds') == []
    assert (detail['job']['status'], detail['job']['escrowStatus']) == ('cancelled', 'charged_back')
    assert mp.ledger_problems(world.db) == []


def test_the_job_page_says_its_escrow_is_held(world):
    job = world.paid_job()
    world.webhook('charge.dispute.created', world.fake.dispute(job['stripe_charge']))
    page = world.client.get(f'/jobs/{job["id"]}').body.decode()
    assert 'id="held"' in page and 'The payer disputed charge' in page
