"""Every rule of CONTRACT.md section 12 once more, through HTTP against the real server (a process) and the fake
Stripe API (tests/fake_stripe.py): funding, a session that expires, a lost webhook the sweep reconciles, duplicate
and reordered events, a bad signature, onboarding, an approval before and after payouts are enabled, a fee, a
rejection, an all-paid job with an unused share, a dispute decided each way; and of section 20 the Connect event
signed with its own secret and a chargeback lost while a transfer waited. One server for the whole story; the
sweep is the `marketplace.py sweep` command (its own process, on the same database), run when the story says.
The server's clock cannot be moved: where time must pass, the database is told it did. Only 127.0.0.1."""

import json
import sqlite3
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import marketplace as mp
from conftest import ADMIN_KEY, ROOT, LiveServer, job_body
from fake_stripe import fake_stripe, fake_stripe_server  # noqa: F401  (the fixtures)
from test_onchain import running
from test_stripe_payouts import LiveWorld, wait_for


def ago(**delta):
    return mp.iso(datetime.now(timezone.utc) - timedelta(**delta))


def test_the_stripe_rail_end_to_end_on_the_real_server(tmp_path, fake_stripe):     # noqa: F811  (a fixture)
    db = tmp_path / 'stripe.db'
    env = {'MARKETPLACE_STRIPE_SECRET_KEY': fake_stripe.secret_key,
           'MARKETPLACE_STRIPE_WEBHOOK_SECRET': fake_stripe.webhook_secret,
           'MARKETPLACE_STRIPE_CONNECT_WEBHOOK_SECRET': fake_stripe.connect_webhook_secret,
           'MARKETPLACE_STRIPE_API_BASE': fake_stripe.url}

    def sweep():
        """`marketplace.py sweep` on the server's database: what the server's own sweeps do, now."""
        done = subprocess.run([sys.executable, str(ROOT / 'marketplace.py'), 'sweep', '--db', str(db),
                               '--fee-percent', '10'], env=dict(server.env), capture_output=True, text=True,
                              timeout=60, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def backdate(sql, **params):
        with sqlite3.connect(db, timeout=10) as conn:
            assert conn.execute(sql, params).rowcount == 1

    with running(LiveServer(db, ['--fee-percent', '10', '--sweep-interval', '3600'], env=env)) as server:
        w = LiveWorld(server.url, fake_stripe)
        admin = lambda method, path, body=None: w.call(method, path, body, ADMIN_KEY)    # noqa: E731

        def post(**overrides):
            answer = w.call('POST', '/api/jobs', job_body(paymentCurrency='USD', **overrides), w.requester_key)
            assert answer.status_code == 201, answer.text
            job = answer.json()['job']
            assert (job['status'], job['escrowStatus']) == ('pending_payment', 'pending')
            [session] = [s for s, one in fake_stripe.sessions.items() if one['client_reference_id'] == job['id']]
            assert answer.json()['checkoutUrl'] == fake_stripe.session(session)['url']
            return job, session

        def detail(job):
            answer = w.call('GET', f'/api/jobs/{job["id"]}', None, w.requester_key)
            assert answer.status_code == 200, answer.text
            return answer.json()

        def payments(job, kind):
            return [p for p in detail(job)['payments'] if p['type'] == kind]

        # Onboarding: the agent's owner only; the account is made once.
        assert w.call('POST', f'/api/agents/{w.agent["id"]}/stripe/onboarding', None, w.requester_key).status_code \
            == 403
        account = w.onboard()['accountId']
        assert w.onboard()['accountId'] == account and len(fake_stripe.accounts) == 1

        # Funding; the paid event opens the job; a duplicate changes nothing, nor does an expiry sent late.
        job, session = post(paymentAmount='100.00')
        assert w.call('GET', f'/api/jobs/{job["id"]}').status_code == 404          # hidden from the public
        paid = fake_stripe.complete(session)
        payload, signature = fake_stripe.event('checkout.session.completed', paid)
        bad = w.call('POST', '/api/stripe/webhook', payload, headers={'Stripe-Signature': signature[:-2] + '00'})
        assert (bad.status_code, bad.json()['code']) == (400, 'invalid_signature')
        assert detail(job)['job']['status'] == 'pending_payment'
        opened = w.call('POST', '/api/stripe/webhook', payload, headers={'Stripe-Signature': signature}).json()
        again = w.call('POST', '/api/stripe/webhook', payload, headers={'Stripe-Signature': signature}).json()
        assert (opened['outcome'], again['outcome']) == ('opened', 'duplicate')
        assert w.webhook('checkout.session.expired', dict(paid, status='expired'))['outcome'] == 'unchanged'
        assert w.call('GET', f'/api/jobs/{job["id"]}').json()['job']['status'] == 'open'
        [escrow] = payments(job, 'escrow')
        assert (escrow['status'], escrow['reference']) == ('confirmed', paid['payment_intent'])

        # An approval before payouts are enabled waits; the sweep after account.updated pays it once, less the fee.
        claim = w.deliver(job, w.claim(job))
        answer = w.call('POST', f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': True},
                        w.requester_key)
        assert answer.status_code == 200, answer.text
        [release] = payments(job, 'release')
        [fee] = payments(job, 'fee')
        assert (release['status'], release['amount'], fee['amount'], fee['status']) == \
            ('pending', '90.00', '10.00', 'confirmed')
        assert sweep()['stripePayments']['waiting'] == 1 and fake_stripe.transfer_list() == []
        # account.updated comes from the Connect endpoint, signed with its own secret (CONTRACT.md 20)
        payload, signature = fake_stripe.connect_event('account.updated', fake_stripe.enable_payouts(account), account)
        updated = w.call('POST', '/api/stripe/webhook', payload, headers={'Stripe-Signature': signature})
        assert (updated.status_code, updated.json()['outcome']) == (200, 'recorded'), updated.text
        assert sweep()['stripePayments']['sent'] == 1
        [transfer] = fake_stripe.transfer_list()
        assert (transfer['amount'], transfer['destination'], transfer['transfer_group']) == \
            (9000, account, f'job_{job["id"]}')
        assert transfer['source_transaction'] == fake_stripe.payment_intent(paid['payment_intent'])['latest_charge']
        [release] = payments(job, 'release')
        assert (release['status'], release['reference']) == ('confirmed', transfer['id'])
        assert sweep()['stripePayments']['sent'] == 0 and len(fake_stripe.transfer_list()) == 1

        # A rejection: one refund of the whole price.
        def opened_job(**overrides):
            job, session = post(**overrides)
            w.webhook('checkout.session.completed', fake_stripe.complete(session))
            return job

        def wait_for_refunds(count):
            return wait_for(lambda: len(fake_stripe.refund_list()) == count and fake_stripe.refund_list())

        rejected = opened_job(paymentAmount='40.00')
        claim = w.deliver(rejected, w.claim(rejected))
        assert w.call('POST', f'/api/jobs/{rejected["id"]}/verify', {'claimId': claim['id'], 'approved': False},
                      w.requester_key).status_code == 200
        [refund] = wait_for_refunds(1)
        assert refund['amount'] == 4000 and wait_for(lambda: payments(rejected, 'refund')[0]['status'] == 'confirmed')

        # An all-paid job for two with one share paid: at its deadline the unused share goes back.
        shared = opened_job(paymentAmount='30.00', competitionMode='all-paid', maxWorkers=2)
        claim = w.deliver(shared, w.claim(shared))
        assert w.call('POST', f'/api/jobs/{shared["id"]}/verify', {'claimId': claim['id'], 'approved': True},
                      w.requester_key).status_code == 200
        backdate('UPDATE jobs SET deadline = :past WHERE id = :id', past=ago(minutes=1), id=shared['id'])
        assert sweep()['expire']['jobIds'] == [shared['id']]
        refunds = wait_for_refunds(2)
        assert refunds[1]['amount'] == 1500 and detail(shared)['job']['status'] == 'completed'
        assert [t['amount'] for t in fake_stripe.transfer_list()] == [9000, 1350]      # 15.00 less the 10 % fee

        # Disputes decided each way by an admin: a transfer, then a refund.
        for outcome in ('worker', 'requester'):
            disputed = opened_job(paymentAmount='20.00')
            claim = w.deliver(disputed, w.claim(disputed))
            dispute = w.call('POST', f'/api/jobs/{disputed["id"]}/dispute', {'claimId': claim['id'], 'reason': 'No.'},
                             w.requester_key).json()['dispute']
            assert admin('PATCH', f'/api/disputes/{dispute["id"]}',
                         {'outcome': outcome, 'resolution': 'Read it.'}).status_code == 200
        wait_for(lambda: len(fake_stripe.transfer_list()) == 3 and len(fake_stripe.refund_list()) == 3)
        assert (fake_stripe.transfer_list()[2]['amount'], fake_stripe.refund_list()[2]['amount']) == (1800, 2000)

        # A session that expires cancels its job; a paid session whose event was lost opens at the sweep.
        expired, session = post(paymentAmount='5.00')
        assert w.webhook('checkout.session.expired', fake_stripe.expire(session))['outcome'] == 'cancelled'
        assert detail(expired)['job']['status'] == 'cancelled'
        lost, session = post(paymentAmount='6.00')
        fake_stripe.complete(session)                                   # paid; its event never comes
        assert sweep()['checkouts']['opened'] == []                     # pending for less than a minute
        backdate('UPDATE jobs SET created_at = :then WHERE id = :id', then=ago(minutes=2), id=lost['id'])
        assert sweep()['checkouts']['opened'] == [lost['id']]
        assert w.call('GET', f'/api/jobs/{lost["id"]}').json()['job']['status'] == 'open'

        # Card money that goes back (CONTRACT.md 20): a dispute holds a transfer decided meanwhile; lost, the job is
        # cancelled, charged_back, with no transfer and no Refund.
        charged, session = post(paymentAmount='8.00')
        paid = fake_stripe.complete(session)
        w.webhook('checkout.session.completed', paid)
        dispute = fake_stripe.dispute(fake_stripe.payment_intent(paid['payment_intent'])['latest_charge'])
        assert w.webhook('charge.dispute.created', dispute)['outcome'] == 'held'
        claim = w.deliver(charged, w.claim(charged))
        assert w.call('POST', f'/api/jobs/{charged["id"]}/verify', {'claimId': claim['id'], 'approved': True},
                      w.requester_key).status_code == 200
        assert sweep()['stripePayments']['sent'] == 0
        assert (detail(charged)['job']['escrowStatus'], detail(charged)['job']['needsAdmin']) == ('held', True)
        assert w.webhook('charge.dispute.closed', fake_stripe.close_dispute(dispute['id'], 'lost'))['outcome'] == \
            'charged_back'
        sweep()
        shown = detail(charged)
        assert (shown['job']['status'], shown['job']['escrowStatus']) == ('cancelled', 'charged_back')
        assert [(p['type'], p['status']) for p in shown['payments']] == [
            ('escrow', 'confirmed'), ('release', 'cancelled'), ('fee', 'cancelled'), ('refund', 'confirmed')]
        assert [s['reference'] for s in shown['timeline'] if s['kind'] == 'stripe'][-2:] == [dispute['id']] * 2
        assert (len(fake_stripe.transfer_list()), len(fake_stripe.refund_list())) == (3, 3)

        keys = [entry['idempotency_key'] for entry in fake_stripe.log
                if entry['path'] in ('/v1/transfers', '/v1/refunds') and not entry['replayed']
                and entry['status'] == 200]
        assert len(keys) == len(set(keys)) == 6                          # each payment made once
        assert server.terminate() == 0
    database = mp.Database(str(db))
    try:
        assert mp.ledger_problems(database) == []
    finally:
        database.close()
