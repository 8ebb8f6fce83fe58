"""The stripe rail against Stripe's own test mode: runs only when STRIPE_TEST_SECRET_KEY (an sk_test_ key) is set, so
that `make test` needs no internet. What the fake of tests/fake_stripe.py stands in for, checked once for real: a
Checkout Session as the service opens it, read back; an Express connected account and its onboarding link.

    STRIPE_TEST_SECRET_KEY=sk_test_... .venv/bin/python -m pytest -q tests/test_stripe_live.py
"""

import os
import time
import uuid

import pytest

from stripe_rail import StripeRail

KEY = os.environ.get('STRIPE_TEST_SECRET_KEY', '')

pytestmark = pytest.mark.skipif(
    not KEY.startswith('sk_test_'),
    reason='STRIPE_TEST_SECRET_KEY is not set to a Stripe test-mode secret key (sk_test_...): this test talks to '
           "Stripe's test mode over the internet, which `make test` never needs")


@pytest.fixture(scope='module')
def rail():
    return StripeRail(KEY, 'whsec_unused', timeout=20)


def test_a_checkout_session_opens_as_the_service_asks_and_reads_back(rail):
    job_id = str(uuid.uuid4())
    expires_at = int(time.time()) + 31 * 60           # Stripe takes 30 minutes to 24 hours
    opened = rail.open_checkout(job_id=job_id, title='Live test job', amount_cents=2500, expires_at=expires_at,
                                success_url='https://example.com/jobs/' + job_id,
                                cancel_url='https://example.com/jobs/' + job_id)
    assert opened['id'].startswith('cs_test_') and opened['url'].startswith('https://')
    assert opened['expires_at'] == expires_at
    again = rail.open_checkout(job_id=job_id, title='Live test job', amount_cents=2500, expires_at=expires_at,
                               success_url='https://example.com/jobs/' + job_id,
                               cancel_url='https://example.com/jobs/' + job_id)
    assert again['id'] == opened['id']              # the same idempotency key: the same session
    session = rail.checkout_session(opened['id'])
    assert (session['status'], session['payment_status'], session['amount_total'], session['currency']) == \
        ('open', 'unpaid', 2500, 'usd')
    assert session['client_reference_id'] == session['job_id'] == job_id


def test_an_express_account_and_its_onboarding_link(rail):
    agent_id = str(uuid.uuid4())
    account_id = rail.create_account(agent_id=agent_id)
    assert account_id.startswith('acct_')
    assert rail.create_account(agent_id=agent_id) == account_id     # created once
    link = rail.account_link(account_id, refresh_url='https://example.com/agents/' + agent_id,
                             return_url='https://example.com/agents/' + agent_id)
    assert link['url'].startswith('https://') and link['expires_at'] > time.time()
    state = rail.account(account_id)
    assert (state['id'], state['payouts_enabled']) == (account_id, False)
