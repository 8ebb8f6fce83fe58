"""stripe_rail.py against the fake Stripe through the real `stripe` library: requests, answers, failures."""

import json
import time

import pytest

from fake_stripe import fake_stripe, fake_stripe_server  # noqa: F401  (fixtures)
from stripe_rail import InvalidSignature, StripeRail, StripeRefused, StripeUnavailable

JOB = '6f1c2d3e-0000-4000-8000-00000000abcd'


@pytest.fixture
def rail(fake_stripe):
    return StripeRail(fake_stripe.secret_key, fake_stripe.webhook_secret, api_base=fake_stripe.url, timeout=5)


def open_checkout(rail, job_id=JOB, amount_cents=2500, **overrides):
    args = dict(job_id=job_id, title='Label 40 photos', amount_cents=amount_cents,
                expires_at=int(time.time()) + 3600, success_url='http://127.0.0.1/jobs/x?paid=1',
                cancel_url='http://127.0.0.1/jobs/x')
    return rail.open_checkout(**dict(args, **overrides))


def paid_session(rail, fake, job_id=JOB, amount_cents=2500):
    session = open_checkout(rail, job_id, amount_cents)
    fake.complete(session['id'])
    return rail.checkout_session(session['id'])


def worker_account(rail, fake, agent_id='agent-1'):
    account_id = rail.create_account(agent_id=agent_id)
    fake.enable_payouts(account_id)
    return account_id


# --- Checkout ---

def test_open_checkout_sends_the_session_the_contract_names(rail, fake_stripe):
    expires_at = int(time.time()) + 3600
    answer = open_checkout(rail, expires_at=expires_at)
    request = fake_stripe.posts('/v1/checkout/sessions')[-1]
    form = request['form']
    assert form['mode'] == 'payment'
    assert form['client_reference_id'] == JOB
    assert form['metadata'] == {'job_id': JOB}
    assert form['payment_intent_data']['transfer_group'] == f'job_{JOB}'
    assert form['expires_at'] == str(expires_at)
    assert form['line_items'] == [{'quantity': '1', 'price_data': {
        'currency': 'usd', 'unit_amount': '2500', 'product_data': {'name': 'Label 40 photos'}}}]
    assert form['success_url'] == 'http://127.0.0.1/jobs/x?paid=1'
    assert form['cancel_url'] == 'http://127.0.0.1/jobs/x'
    assert request['idempotency_key'] == f'checkout-{JOB}'
    assert request['authorization'] == f'Bearer {fake_stripe.secret_key}'
    assert answer == {'id': answer['id'], 'url': fake_stripe.session(answer['id'])['url'], 'expires_at': expires_at}
    assert answer['id'].startswith('cs_test_')
    assert type(answer) is dict


def test_open_checkout_again_for_the_job_replays_the_same_session(rail, fake_stripe):
    expires_at = int(time.time()) + 3600
    first = open_checkout(rail, expires_at=expires_at)
    second = open_checkout(rail, expires_at=expires_at)
    assert second == first
    assert len(fake_stripe.sessions) == 1
    assert [(p['status'], p['replayed']) for p in fake_stripe.posts('/v1/checkout/sessions')] == [
        (200, False), (200, True)]


def test_open_checkout_for_the_job_with_another_price_is_refused(rail, fake_stripe):
    expires_at = int(time.time()) + 3600
    open_checkout(rail, amount_cents=2500, expires_at=expires_at)
    with pytest.raises(StripeRefused) as caught:
        open_checkout(rail, amount_cents=9900, expires_at=expires_at)
    assert (caught.value.status, caught.value.code) == (400, 'idempotency_error')
    assert len(fake_stripe.sessions) == 1


def test_open_checkout_with_an_expiry_stripe_refuses_is_refused_with_its_code(rail, fake_stripe):
    with pytest.raises(StripeRefused) as caught:
        open_checkout(rail, expires_at=int(time.time()) + 600)
    assert (caught.value.status, caught.value.code) == (400, 'parameter_invalid_integer')
    assert 'expires_at' in caught.value.message
    assert fake_stripe.sessions == {}


def test_an_open_session_has_no_payment_yet(rail, fake_stripe):
    session = open_checkout(rail)
    assert rail.checkout_session(session['id']) == {
        'id': session['id'], 'status': 'open', 'payment_status': 'unpaid', 'amount_total': 2500, 'currency': 'usd',
        'client_reference_id': JOB, 'job_id': JOB, 'payment_intent': None, 'charge': None}
    request = fake_stripe.log[-1]
    assert (request['method'], request['path']) == ('GET', f'/v1/checkout/sessions/{session["id"]}')
    assert request['query'] == {'expand': ['payment_intent']}


def test_a_paid_session_names_its_payment_intent_and_charge(rail, fake_stripe):
    session = open_checkout(rail)
    fake_stripe.complete(session['id'])
    answer = rail.checkout_session(session['id'])
    intent = fake_stripe.payment_intent(answer['payment_intent'])
    assert answer['status'] == 'complete' and answer['payment_status'] == 'paid'
    assert answer['payment_intent'].startswith('pi_') and answer['charge'].startswith('ch_')
    assert intent['latest_charge'] == answer['charge']
    assert intent['transfer_group'] == f'job_{JOB}'
    assert fake_stripe.charge(answer['charge'])['amount'] == 2500


def test_an_expired_session_says_expired(rail, fake_stripe):
    session = open_checkout(rail)
    fake_stripe.expire(session['id'])
    answer = rail.checkout_session(session['id'])
    assert (answer['status'], answer['payment_status'], answer['payment_intent']) == ('expired', 'unpaid', None)


def test_a_delayed_payment_is_complete_but_unpaid_until_it_settles(rail, fake_stripe):
    session = open_checkout(rail)
    fake_stripe.complete(session['id'], paid=False)
    answer = rail.checkout_session(session['id'])
    assert (answer['status'], answer['payment_status']) == ('complete', 'unpaid')
    with pytest.raises(StripeRefused) as caught:
        rail.refund(payment_intent=answer['payment_intent'], amount_cents=100, idempotency_key='payment-1')
    assert caught.value.code == 'payment_intent_unexpected_state'
    fake_stripe.settle(session['id'])
    assert rail.checkout_session(session['id'])['payment_status'] == 'paid'


def test_a_failed_delayed_payment_stays_unpaid(rail, fake_stripe):
    session = open_checkout(rail)
    fake_stripe.complete(session['id'], paid=False)
    fake_stripe.settle(session['id'], succeeded=False)
    answer = rail.checkout_session(session['id'])
    assert (answer['status'], answer['payment_status']) == ('complete', 'unpaid')
    assert fake_stripe.payment_intent(answer['payment_intent'])['status'] == 'requires_payment_method'


def test_an_unknown_session_is_refused_as_missing(rail):
    with pytest.raises(StripeRefused) as caught:
        rail.checkout_session('cs_test_nothing')
    assert (caught.value.status, caught.value.code) == (404, 'resource_missing')


# --- Connect ---

def test_create_account_asks_for_an_express_account_that_can_receive_transfers(rail, fake_stripe):
    account_id = rail.create_account(agent_id='agent-7')
    request = fake_stripe.posts('/v1/accounts')[-1]
    assert request['form'] == {'type': 'express', 'capabilities': {'transfers': {'requested': 'true'}},
                               'metadata': {'agent_id': 'agent-7'}}
    assert request['idempotency_key'] == 'account-agent-7'
    assert account_id.startswith('acct_')
    assert rail.create_account(agent_id='agent-7') == account_id
    assert list(fake_stripe.accounts) == [account_id]


def test_an_account_can_be_paid_only_after_onboarding(rail, fake_stripe):
    account_id = rail.create_account(agent_id='agent-7')
    assert rail.account(account_id) == {'id': account_id, 'payouts_enabled': False, 'transfers_active': False}
    fake_stripe.enable_payouts(account_id)
    assert rail.account(account_id) == {'id': account_id, 'payouts_enabled': True, 'transfers_active': True}


def test_account_link_asks_for_onboarding_with_both_urls(rail, fake_stripe):
    account_id = rail.create_account(agent_id='agent-7')
    link = rail.account_link(account_id, refresh_url='http://127.0.0.1/agents/7', return_url='http://127.0.0.1/a/7')
    request = fake_stripe.posts('/v1/account_links')[-1]
    assert request['form'] == {'account': account_id, 'type': 'account_onboarding',
                               'refresh_url': 'http://127.0.0.1/agents/7', 'return_url': 'http://127.0.0.1/a/7'}
    assert request['idempotency_key'].startswith(f'account-link-{account_id}-')
    assert set(link) == {'url', 'expires_at'} and link['url'].startswith('http')
    assert link['expires_at'] > time.time()
    again = rail.account_link(account_id, refresh_url='http://127.0.0.1/agents/7', return_url='http://127.0.0.1/a/7')
    assert again['url'] != link['url']


def test_account_link_for_an_unknown_account_is_refused(rail):
    with pytest.raises(StripeRefused) as caught:
        rail.account_link('acct_nothing', refresh_url='http://127.0.0.1/r', return_url='http://127.0.0.1/r')
    assert (caught.value.status, caught.value.code) == (400, 'resource_missing')


# --- Transfers and refunds ---

def test_send_transfer_pays_the_worker_from_the_funding_charge(rail, fake_stripe):
    session = paid_session(rail, fake_stripe)
    account_id = worker_account(rail, fake_stripe)
    transfer_id = rail.send_transfer(amount_cents=2250, destination=account_id, transfer_group=f'job_{JOB}',
                                     source_transaction=session['charge'], idempotency_key='payment-1')
    request = fake_stripe.posts('/v1/transfers')[-1]
    assert request['form'] == {'amount': '2250', 'currency': 'usd', 'destination': account_id,
                               'transfer_group': f'job_{JOB}', 'source_transaction': session['charge']}
    assert request['idempotency_key'] == 'payment-1'
    assert transfer_id.startswith('tr_')
    assert [t['id'] for t in fake_stripe.transfer_list()] == [transfer_id]


def test_send_transfer_again_with_its_key_pays_once(rail, fake_stripe):
    session = paid_session(rail, fake_stripe)
    account_id = worker_account(rail, fake_stripe)
    args = dict(amount_cents=2250, destination=account_id, transfer_group=f'job_{JOB}',
                source_transaction=session['charge'], idempotency_key='payment-1')
    assert rail.send_transfer(**args) == rail.send_transfer(**args)
    assert len(fake_stripe.transfer_list()) == 1


def test_send_transfer_to_an_account_not_onboarded_is_refused_and_can_be_retried(rail, fake_stripe):
    session = paid_session(rail, fake_stripe)
    account_id = rail.create_account(agent_id='agent-1')
    args = dict(amount_cents=2250, destination=account_id, transfer_group=f'job_{JOB}',
                source_transaction=session['charge'], idempotency_key='payment-1')
    with pytest.raises(StripeRefused) as caught:
        rail.send_transfer(**args)
    assert (caught.value.status, caught.value.code) == (400, 'insufficient_capabilities_for_transfer')
    fake_stripe.enable_payouts(account_id)
    assert rail.send_transfer(**args).startswith('tr_')


def test_send_transfer_beyond_what_remains_of_the_charge_is_refused(rail, fake_stripe):
    session = paid_session(rail, fake_stripe)
    account_id = worker_account(rail, fake_stripe)
    rail.send_transfer(amount_cents=2000, destination=account_id, transfer_group=f'job_{JOB}',
                       source_transaction=session['charge'], idempotency_key='payment-1')
    with pytest.raises(StripeRefused) as caught:
        rail.send_transfer(amount_cents=501, destination=account_id, transfer_group=f'job_{JOB}',
                           source_transaction=session['charge'], idempotency_key='payment-2')
    assert (caught.value.status, caught.value.code) == (400, 'balance_insufficient')
    assert len(fake_stripe.transfer_list()) == 1


def test_send_transfer_from_an_unknown_charge_or_to_an_unknown_account_is_refused(rail, fake_stripe):
    session = paid_session(rail, fake_stripe)
    account_id = worker_account(rail, fake_stripe)
    for destination, source in ((account_id, 'ch_nothing'), ('acct_nothing', session['charge'])):
        with pytest.raises(StripeRefused) as caught:
            rail.send_transfer(amount_cents=100, destination=destination, transfer_group=f'job_{JOB}',
                               source_transaction=source, idempotency_key=f'payment-{destination}')
        assert (caught.value.status, caught.value.code) == (400, 'resource_missing')
    assert fake_stripe.transfer_list() == []


def test_refund_gives_back_part_of_the_payment(rail, fake_stripe):
    session = paid_session(rail, fake_stripe)
    refund_id = rail.refund(payment_intent=session['payment_intent'], amount_cents=1000, idempotency_key='payment-9')
    request = fake_stripe.posts('/v1/refunds')[-1]
    assert request['form'] == {'payment_intent': session['payment_intent'], 'amount': '1000'}
    assert request['idempotency_key'] == 'payment-9'
    assert refund_id.startswith('re_')
    assert rail.refund(payment_intent=session['payment_intent'], amount_cents=1000,
                       idempotency_key='payment-9') == refund_id
    assert [(r['id'], r['amount']) for r in fake_stripe.refund_list()] == [(refund_id, 1000)]
    assert fake_stripe.charge(session['charge'])['amount_refunded'] == 1000


def test_refund_beyond_the_payment_is_refused(rail, fake_stripe):
    session = paid_session(rail, fake_stripe)
    rail.refund(payment_intent=session['payment_intent'], amount_cents=2000, idempotency_key='payment-8')
    with pytest.raises(StripeRefused) as caught:
        rail.refund(payment_intent=session['payment_intent'], amount_cents=501, idempotency_key='payment-9')
    assert (caught.value.status, caught.value.code) == (400, 'amount_too_large')
    rail.refund(payment_intent=session['payment_intent'], amount_cents=500, idempotency_key='payment-10')
    with pytest.raises(StripeRefused) as caught:
        rail.refund(payment_intent=session['payment_intent'], amount_cents=1, idempotency_key='payment-11')
    assert caught.value.code == 'charge_already_refunded'
    assert sum(r['amount'] for r in fake_stripe.refund_list()) == 2500


def test_refund_of_an_unknown_payment_is_refused(rail):
    with pytest.raises(StripeRefused) as caught:
        rail.refund(payment_intent='pi_nothing', amount_cents=100, idempotency_key='payment-9')
    assert (caught.value.status, caught.value.code) == (400, 'resource_missing')


def test_every_post_carries_an_idempotency_key(rail, fake_stripe):
    session = paid_session(rail, fake_stripe)
    account_id = worker_account(rail, fake_stripe)
    rail.account_link(account_id, refresh_url='http://127.0.0.1/r', return_url='http://127.0.0.1/r')
    rail.send_transfer(amount_cents=100, destination=account_id, transfer_group=f'job_{JOB}',
                       source_transaction=session['charge'], idempotency_key='payment-1')
    rail.refund(payment_intent=session['payment_intent'], amount_cents=100, idempotency_key='payment-2')
    posts = fake_stripe.posts()
    assert {p['path'] for p in posts} == {'/v1/checkout/sessions', '/v1/accounts', '/v1/account_links',
                                          '/v1/transfers', '/v1/refunds'}
    assert all(p['idempotency_key'] for p in posts)


# --- Failures at the boundary ---

@pytest.mark.parametrize('status', [500, 502, 503, 429, 409])
def test_a_failing_stripe_is_unavailable_after_exactly_one_request(rail, fake_stripe, status):
    account_id = rail.create_account(agent_id='agent-1')
    fake_stripe.fail_next(1, status)
    before = len(fake_stripe.log)
    with pytest.raises(StripeUnavailable):
        rail.account(account_id)
    assert len(fake_stripe.log) == before + 1


def test_a_500_on_a_post_is_not_retried_and_the_same_key_succeeds_later(rail, fake_stripe):
    fake_stripe.fail_next(1, 500)
    with pytest.raises(StripeUnavailable):
        open_checkout(rail)
    assert len(fake_stripe.posts('/v1/checkout/sessions')) == 1
    assert fake_stripe.sessions == {}
    assert open_checkout(rail)['id'] in fake_stripe.sessions


def test_an_answer_lost_after_the_transfer_was_made_is_not_paid_twice_on_retry(rail, fake_stripe):
    session = paid_session(rail, fake_stripe)
    account_id = worker_account(rail, fake_stripe)
    args = dict(amount_cents=2250, destination=account_id, transfer_group=f'job_{JOB}',
                source_transaction=session['charge'], idempotency_key='payment-1')
    fake_stripe.fail_next(1, 'drop', after=True)
    with pytest.raises(StripeUnavailable):
        rail.send_transfer(**args)
    assert len(fake_stripe.transfer_list()) == 1
    assert rail.send_transfer(**args) == fake_stripe.transfer_list()[0]['id']
    assert len(fake_stripe.transfer_list()) == 1


@pytest.mark.parametrize('body', [{'object': 'checkout.session'}, b'<html>502 Bad Gateway</html>', b''])
def test_a_malformed_answer_is_unavailable(rail, fake_stripe, body):
    fake_stripe.fail_next(1, 200, body=body)
    with pytest.raises(StripeUnavailable):
        open_checkout(rail)


def test_a_dropped_connection_is_unavailable_after_exactly_one_request(rail, fake_stripe):
    fake_stripe.fail_next(1, 'drop')
    with pytest.raises(StripeUnavailable):
        rail.refund(payment_intent='pi_x', amount_cents=100, idempotency_key='payment-1')
    assert len(fake_stripe.log) == 1


def test_a_slow_stripe_is_unavailable_within_the_time_out(fake_stripe):
    rail = StripeRail(fake_stripe.secret_key, fake_stripe.webhook_secret, api_base=fake_stripe.url, timeout=0.5)
    fake_stripe.delay_next(10)
    started = time.monotonic()
    with pytest.raises(StripeUnavailable):
        rail.checkout_session('cs_test_slow')
    assert time.monotonic() - started < 10     # cut at the time-out, before the answer at 10 s
    assert len(fake_stripe.log) == 1


def test_stripe_that_cannot_be_reached_is_unavailable(fake_stripe):
    rail = StripeRail(fake_stripe.secret_key, fake_stripe.webhook_secret, api_base='http://127.0.0.1:9', timeout=2)
    with pytest.raises(StripeUnavailable):
        rail.account('acct_x')


def test_a_wrong_secret_key_is_refused(fake_stripe):
    rail = StripeRail('sk_test_wrong', fake_stripe.webhook_secret, api_base=fake_stripe.url)
    with pytest.raises(StripeRefused) as caught:
        rail.account('acct_x')
    assert caught.value.status == 401


# --- Webhooks ---

def test_a_signed_event_becomes_a_plain_dict(rail, fake_stripe):
    session = open_checkout(rail)
    fake_stripe.complete(session['id'])
    payload, header = fake_stripe.event('checkout.session.completed', fake_stripe.session(session['id']))
    event = rail.event(payload, header)
    assert event == {'id': json.loads(payload)['id'], 'type': 'checkout.session.completed', 'account': None,
                     'object': fake_stripe.session(session['id'])}
    assert type(event['object']) is dict and type(event['object']['metadata']) is dict
    assert event['object']['metadata']['job_id'] == JOB


def test_a_connect_event_names_its_account(rail, fake_stripe):
    account_id = worker_account(rail, fake_stripe)
    payload, header = fake_stripe.event('account.updated', fake_stripe.account(account_id), account=account_id)
    event = rail.event(payload, header)
    assert (event['type'], event['account']) == ('account.updated', account_id)
    assert event['object']['capabilities'] == {'transfers': 'active'}


def test_an_event_signed_with_the_connect_secret_is_good_only_with_that_secret(rail, fake_stripe):
    """Stripe signs connected accounts' events at the Connect endpoint with its own secret (CONTRACT.md 20)."""
    account_id = worker_account(rail, fake_stripe)
    payload, header = fake_stripe.connect_event('account.updated', fake_stripe.account(account_id), account_id)
    with pytest.raises(InvalidSignature):
        rail.event(payload, header)         # a rail that knows only the platform endpoint's secret
    both = StripeRail(fake_stripe.secret_key, fake_stripe.webhook_secret, api_base=fake_stripe.url,
                      connect_webhook_secret=fake_stripe.connect_webhook_secret)
    assert (both.event(payload, header)['account'], both.event(payload, header)['type']) == \
        (account_id, 'account.updated')
    payload, header = fake_stripe.event('checkout.session.completed', {'id': 'cs_test_1'})
    assert both.event(payload, header)['object'] == {'id': 'cs_test_1'}        # the platform's still good
    payload, header = fake_stripe.event('checkout.session.completed', {'id': 'cs_test_1'}, secret='whsec_other')
    with pytest.raises(InvalidSignature):
        both.event(payload, header)


def test_a_tampered_event_is_invalid(rail, fake_stripe):
    payload, header = fake_stripe.event('checkout.session.completed', {'id': 'cs_test_1', 'amount_total': 100})
    with pytest.raises(InvalidSignature):
        rail.event(payload.replace(b'100', b'900'), header)


def test_an_event_signed_with_another_secret_is_invalid(rail, fake_stripe):
    payload, header = fake_stripe.event('checkout.session.completed', {'id': 'cs_test_1'}, secret='whsec_other')
    with pytest.raises(InvalidSignature):
        rail.event(payload, header)


def test_a_stale_event_is_invalid(rail, fake_stripe):
    payload, header = fake_stripe.event('checkout.session.completed', {'id': 'cs_test_1'},
                                        timestamp=int(time.time()) - 301 - 5)
    with pytest.raises(InvalidSignature):
        rail.event(payload, header)
    payload, header = fake_stripe.event('checkout.session.completed', {'id': 'cs_test_1'},
                                        timestamp=int(time.time()) - 240)
    assert rail.event(payload, header)['type'] == 'checkout.session.completed'


@pytest.mark.parametrize('header', [None, '', 't=abc,v1=00', 'v1=00', 't=1700000000'])
def test_a_missing_or_malformed_signature_is_invalid(rail, fake_stripe, header):
    payload, _ = fake_stripe.event('checkout.session.completed', {'id': 'cs_test_1'})
    with pytest.raises(InvalidSignature):
        rail.event(payload, header)


@pytest.mark.parametrize('payload', [b'not json', b'[1, 2]', b'{"object": "charge", "id": "ch_1"}', b'\xff\xfe'])
def test_a_signed_body_that_is_not_an_event_is_invalid(rail, fake_stripe, payload):
    header = fake_stripe.sign(payload)
    with pytest.raises(InvalidSignature):
        rail.event(payload, header)
