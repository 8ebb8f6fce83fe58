"""Disputes, arbitrators and community votes.

CONTRACT.md sections 2 (who may do what), 3 (dispute on a delivery), 4 (reputation), 5 (disputes and
arbitration), 11 (parties, outcome null until resolved, accuracy and ranking) and 18 ("Arbitration cannot
be bought": pending arbitrators, trusted ones, panels drawn at random, needsAdmin), and SPEC.md's
Disputes and Community arbitration. Every path that settles a dispute is checked down to the job's
payment records, the ledger accounts and the worker's reputation entries; the `app` fixture then
checks that the whole ledger balances.
"""

import random
import re

import pytest
import requests

import marketplace as mp
import wiring
from conftest import ADMIN_KEY, assert_error, Client, get_agent, in_hours, make_account, make_agent, Market, random_wallet
from test_server import TIMEOUT, bearer, claim_and_deliver, get_job, new_account, new_job, post, register_agent

ISO_MS_Z = re.compile(r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$')
DISPUTE_FIELDS = {'id', 'jobId', 'claimId', 'status', 'reason', 'outcome', 'resolution', 'resolvedBy',
                  'requiredVotes', 'votesReceived', 'panel', 'needsAdmin', 'createdAt', 'resolvedAt'}
ARBITRATOR_FIELDS = {'id', 'name', 'walletAddress', 'agentId', 'accountId', 'status', 'trusted', 'accuracy',
                     'votesCast', 'createdAt'}
VOTE_FIELDS = {'id', 'disputeId', 'arbitratorId', 'vote', 'reasoning', 'createdAt'}
UNKNOWN_ID = '00000000-0000-4000-8000-000000000000'
USDC = 1_000_000   # base units in one USDC


# Helpers ---------------------------------------------------------------------

def open_dispute(client, job, claim, key, reason='The output does not build.'):
    answer = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': reason}, key=key)
    assert answer.status == 201, answer
    return answer.json['dispute']


def disputed_job(market, **overrides):
    """A job whose one delivery the requester disputes: (job, claim, dispute)."""
    job, claim = market.delivered_job(**overrides)
    return job, claim, open_dispute(market.client, job, claim, market.requester_key)


def register_arbitrator(client, key, **body):
    body.setdefault('name', 'arbiter')
    body.setdefault('walletAddress', random_wallet())
    return client.post('/api/arbitrators', body, key=key)


def set_arbitrator(client, arbitrator, **body):
    """PATCH /api/arbitrators/:id as the admin ({status}, {trusted} or both); the arbitrator as it is now."""
    answer = client.patch(f'/api/arbitrators/{arbitrator["id"]}', body, key=ADMIN_KEY)
    assert answer.status == 200, answer
    return answer.json['arbitrator']


def make_arbitrators(client, count, prefix='arbiter', trusted=False):
    """`count` human arbitrators, each owned by its own new member account, registered (pending) and activated
    (and trusted, if asked) by the admin: [(arbitrator, key)]."""
    made = []
    for number in range(count):
        account, key = make_account(client, f'{prefix}-{number}')
        answer = register_arbitrator(client, ADMIN_KEY, name=f'{prefix} {number}', accountId=account['id'])
        assert answer.status == 201, answer
        assert (answer.json['arbitrator']['accountId'], answer.json['arbitrator']['status']) == \
            (account['id'], 'pending')
        extra = {'trusted': True} if trusted else {}
        made.append((set_arbitrator(client, answer.json['arbitrator'], status='active', **extra), key))
    return made


class ChosenPanels:
    """Stands in for mp.PANEL_DRAW: each dispute opened gets the next panel of `panels` (lists of arbitrators),
    which must be among the eligible ones."""

    def __init__(self, *panels):
        self.panels = [sorted(a['id'] for a in panel) for panel in panels]

    def sample(self, eligible, size):
        panel = self.panels.pop(0)
        assert set(panel) <= set(eligible) and len(panel) == size, (panel, eligible, size)
        return panel


def vote(client, dispute, arbitrator, key, choice, reasoning='I read the deliverable.'):
    return client.post(f'/api/disputes/{dispute["id"]}/vote',
                       {'arbitratorId': arbitrator['id'], 'vote': choice, 'reasoning': reasoning}, key=key)


def resolve(client, dispute, outcome, key=ADMIN_KEY, **extra):
    body = {'outcome': outcome, 'resolution': f'Decided for the {outcome}.', **extra}
    return client.patch(f'/api/disputes/{dispute["id"]}', body, key=key)


def get_dispute(client, dispute):
    answer = client.get(f'/api/disputes/{dispute["id"]}')
    assert answer.status == 200, answer
    return answer.json


def arbitrator_list(client, query=''):
    answer = client.get('/api/arbitrators' + query)
    assert answer.status == 200, answer
    return answer.json


def set_reputation(app, agent, hundredths):
    app.service.db.execute('UPDATE agents SET reputation = :score WHERE id = :id',
                           {'score': hundredths, 'id': agent['id']})


def ledger_balance(app, account, job=None):
    """What a ledger account holds in base units (only from one job's entries, given a job)."""
    return app.service.db.value('''SELECT coalesce(sum(amount), 0) FROM ledger_entries
                                   WHERE account = :a AND (:job IS NULL OR job_id = :job)''',
                                {'a': account, 'job': job['id'] if job else None})


def admin_account_id(app):
    return app.service.db.value('SELECT account_id FROM api_keys WHERE key_hash = :h',
                                {'h': mp.hash_key(ADMIN_KEY)})


def payments_of(shown):
    return [(p['type'], p['amount'], p['recipient']) for p in shown['payments']]


def history_of(client, agent):
    return [(e['delta'], e['reason'], e['jobId'], e['claimId'], e['scoreAfter'])
            for e in get_agent(client, agent)['reputationHistory']]


def assert_still_open(market, job, claim, dispute, votes=0):
    """Nothing moved: the dispute is open, claim and job disputed, the escrow locked and untouched."""
    shown = get_dispute(market.client, dispute)
    assert (shown['dispute']['status'], shown['dispute']['outcome'], shown['dispute']['votesReceived']) == \
        ('open', None, votes)
    assert (shown['job']['status'], shown['job']['escrowStatus'], shown['claim']['status']) == \
        ('disputed', 'locked', 'disputed')
    assert [p['type'] for p in market.get_job(job)['payments']] == ['escrow']
    assert get_agent(market.client, market.agent)['reputationHistory'] == []


def assert_paid_to_worker(market, app, job, claim, amount):
    """Outcome worker: claim approved, job completed, the whole price released, +1.50 `dispute won`."""
    shown = market.get_job(job)
    assert (shown['job']['status'], shown['job']['escrowStatus']) == ('completed', 'released')
    assert [(c['id'], c['status']) for c in shown['claims']] == [(claim['id'], 'approved')]
    assert ISO_MS_Z.match(shown['claims'][0]['verifiedAt'])
    assert payments_of(shown) == [('escrow', amount, 'escrow'), ('release', amount, market.agent['walletAddress'])]
    assert all((p['currency'], p['rail'], p['txHash']) == ('USDC', 'base', None) for p in shown['payments'])
    units = int(amount.replace('.', '')) * USDC // 100
    assert ledger_balance(app, mp.escrow_account(job['id'])) == 0
    assert ledger_balance(app, f'worker:{market.agent["id"]}', job) == units
    assert ledger_balance(app, f'funding:{market.requester["id"]}', job) == -units
    agent = get_agent(market.client, market.agent)
    assert (agent['agent']['reputationScore'], agent['agent']['jobsCompleted'], agent['agent']['totalEarned']) == \
        ('1.50', 1, amount)
    assert history_of(market.client, market.agent) == [('1.50', 'dispute won', job['id'], claim['id'], '1.50')]


def assert_refunded_to_requester(market, app, job, claim, amount, score_after='0.00'):
    """Outcome requester: claim rejected, job refunded, the whole price back, −1.00 `dispute lost`."""
    shown = market.get_job(job)
    assert (shown['job']['status'], shown['job']['escrowStatus']) == ('refunded', 'refunded')
    assert [(c['id'], c['status']) for c in shown['claims']] == [(claim['id'], 'rejected')]
    assert payments_of(shown) == [('escrow', amount, 'escrow'), ('refund', amount, market.requester['id'])]
    assert ledger_balance(app, mp.escrow_account(job['id'])) == 0
    assert ledger_balance(app, f'worker:{market.agent["id"]}', job) == 0
    assert ledger_balance(app, f'funding:{market.requester["id"]}', job) == 0
    agent = get_agent(market.client, market.agent)
    assert (agent['agent']['reputationScore'], agent['agent']['jobsCompleted'], agent['agent']['totalEarned']) == \
        (score_after, 0, '0.00')
    assert history_of(market.client, market.agent) == [('-1.00', 'dispute lost', job['id'], claim['id'], score_after)]


# Opening a dispute -----------------------------------------------------------

def test_requester_disputes_a_delivery(market, client, app):
    job, claim = market.delivered_job(paymentAmount='40.00')
    answer = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'Tests still fail.'},
                         key=market.requester_key)
    assert answer.status == 201, answer
    assert set(answer.json) == {'dispute', 'job'}
    dispute = answer.json['dispute']
    assert set(dispute) == DISPUTE_FIELDS
    assert ISO_MS_Z.match(dispute['createdAt'])
    assert {k: v for k, v in dispute.items() if k not in ('id', 'createdAt')} == {
        'jobId': job['id'], 'claimId': claim['id'], 'status': 'open', 'reason': 'Tests still fail.',
        'outcome': None, 'resolution': None, 'resolvedBy': None, 'requiredVotes': 3, 'votesReceived': 0,
        'panel': [], 'needsAdmin': True, 'resolvedAt': None}     # no arbitrator to draw a panel from
    assert (answer.json['job']['id'], answer.json['job']['status'], answer.json['job']['escrowStatus']) == \
        (job['id'], 'disputed', 'locked')
    shown = market.get_job(job)
    assert (shown['job']['status'], shown['job']['escrowStatus']) == ('disputed', 'locked')
    assert [c['status'] for c in shown['claims']] == ['disputed']
    assert payments_of(shown) == [('escrow', '40.00', 'escrow')]
    assert ledger_balance(app, mp.escrow_account(job['id'])) == 40 * USDC
    assert get_agent(client, market.agent)['reputationHistory'] == []


def test_admin_may_dispute_for_the_requester(market, client):
    job, claim = market.delivered_job()
    dispute = open_dispute(client, job, claim, ADMIN_KEY)
    assert (dispute['status'], dispute['claimId']) == ('open', claim['id'])
    assert market.get_job(job)['job']['status'] == 'disputed'


def test_worker_cannot_dispute(market, client):
    job, claim = market.delivered_job()
    answer = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'Pay me.'},
                         key=market.worker_key)
    assert_error(answer, 403, 'forbidden')
    _, stranger_key = make_account(client, 'stranger')
    answer = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'Hm.'},
                         key=stranger_key)
    assert_error(answer, 403, 'forbidden')
    answer = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'Hm.'})
    assert_error(answer, 401, 'unauthorized')
    assert client.get('/api/disputes').json['total'] == 0
    assert market.get_job(job)['job']['status'] == 'delivered'


@pytest.mark.parametrize('body, fields', [
    ({}, {'reason'}),
    ({'reason': '   '}, {'reason'}),
    ({'reason': 42}, {'reason'}),
])
def test_dispute_needs_a_reason(market, client, body, fields):
    job, claim = market.delivered_job()
    answer = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], **body},
                         key=market.requester_key)
    assert_error(answer, 400, 'validation_failed', fields)
    assert market.get_job(job)['claims'][0]['status'] == 'delivered'


def test_dispute_needs_a_claim_of_this_job(market, client):
    job, claim = market.delivered_job()
    other, other_claim = market.delivered_job()
    answer = client.post(f'/api/jobs/{job["id"]}/dispute', {'reason': 'x'}, key=market.requester_key)
    assert_error(answer, 400, 'validation_failed', {'claimId'})
    answer = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': 'nope', 'reason': 'x'},
                         key=market.requester_key)
    assert_error(answer, 400, 'invalid_uuid')
    answer = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': other_claim['id'], 'reason': 'x'},
                         key=market.requester_key)
    assert_error(answer, 404, 'not_found')
    answer = client.post(f'/api/jobs/{UNKNOWN_ID}/dispute', {'claimId': claim['id'], 'reason': 'x'},
                         key=market.requester_key)
    assert_error(answer, 404, 'not_found')


def test_only_a_delivered_claim_can_be_disputed(market, client):
    job = market.job()
    claim = market.claim(job)
    answer = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'Too slow.'},
                         key=market.requester_key)
    assert_error(answer, 409, 'claim_not_delivered')
    assert market.get_job(job)['claims'][0]['status'] == 'claimed'
    # Approved already: nothing left to dispute.
    done, delivered = market.delivered_job()
    assert market.verify(done, delivered, True).status == 200
    answer = client.post(f'/api/jobs/{done["id"]}/dispute', {'claimId': delivered['id'], 'reason': 'Late.'},
                         key=market.requester_key)
    assert_error(answer, 409, 'claim_not_delivered')
    assert client.get('/api/disputes').json['total'] == 0


def test_a_claim_is_disputed_once_ever(market, client):
    job, claim, dispute = disputed_job(market)
    again = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'Again.'},
                        key=market.requester_key)
    assert_error(again, 409, 'already_disputed')
    assert resolve(client, dispute, 'requester').status == 200
    after = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'Once more.'},
                        key=market.requester_key)
    assert_error(after, 409, 'already_disputed')
    assert client.get('/api/disputes').json['total'] == 1


def test_a_disputed_claim_cannot_be_verified(market, client):
    job, claim, dispute = disputed_job(market)
    for approved in (True, False):
        assert_error(market.verify(job, claim, approved), 409, 'claim_not_delivered')
    assert_still_open(market, job, claim, dispute)


def test_sweeps_leave_a_dispute_to_the_arbitrators(market, client, real_clock):
    job, claim, dispute = disputed_job(market, deadline=in_hours(30))
    real_clock.advance(hours=31)
    verified = client.post('/api/jobs/auto-verify', key=ADMIN_KEY)
    assert verified.status == 200, verified
    assert (verified.json['autoApproved'], verified.json['claimIds']) == (0, [])
    expired = client.post('/api/jobs/expire', key=ADMIN_KEY)
    assert expired.status == 200, expired
    assert (expired.json['expired'], expired.json['jobIds'], expired.json['reputationPenalties']) == (0, [], 0)
    assert_still_open(market, job, claim, dispute)


# Showing and listing disputes -------------------------------------------------

def test_show_a_dispute(market, client):
    job, claim, dispute = disputed_job(market)
    shown = get_dispute(client, dispute)
    assert set(shown) == {'dispute', 'job', 'claim'}
    assert shown['dispute'] == dispute
    assert (shown['job']['id'], shown['job']['status'], shown['job']['escrowStatus']) == \
        (job['id'], 'disputed', 'locked')
    assert (shown['claim']['id'], shown['claim']['status'], shown['claim']['agentId']) == \
        (claim['id'], 'disputed', market.agent['id'])
    assert_error(client.get(f'/api/disputes/{UNKNOWN_ID}'), 404, 'not_found')
    assert_error(client.get('/api/disputes/not-a-uuid'), 400, 'invalid_uuid')
    upper = client.get(f'/api/disputes/{dispute["id"].upper()}')
    assert upper.status == 200 and upper.json['dispute']['id'] == dispute['id']


def test_list_disputes_filters_and_pages(market, client):
    made = [disputed_job(market) for _ in range(3)]
    (job1, _, d1), (job2, _, d2), (job3, _, d3) = made
    assert resolve(client, d1, 'worker').status == 200

    def ids(query=''):
        answer = client.get('/api/disputes' + query)
        assert answer.status == 200, answer
        assert set(answer.json) == {'disputes', 'total', 'limit', 'offset'}
        return [d['id'] for d in answer.json['disputes']], answer.json['total'], answer.json['limit'], \
            answer.json['offset']

    assert ids() == ([d3['id'], d2['id'], d1['id']], 3, 50, 0)
    assert ids('?status=open') == ([d3['id'], d2['id']], 2, 50, 0)
    assert ids('?status=resolved') == ([d1['id']], 1, 50, 0)
    assert ids(f'?job_id={job2["id"]}') == ([d2['id']], 1, 50, 0)
    assert ids(f'?job_id={job2["id"].upper()}') == ([d2['id']], 1, 50, 0)
    assert ids(f'?job_id={job1["id"]}&status=open') == ([], 0, 50, 0)
    assert ids(f'?job_id={job1["id"]}&status=resolved') == ([d1['id']], 1, 50, 0)
    assert ids(f'?job_id={UNKNOWN_ID}') == ([], 0, 50, 0)
    assert ids('?limit=1') == ([d3['id']], 3, 1, 0)
    assert ids('?limit=1&offset=1') == ([d2['id']], 3, 1, 1)
    assert ids('?limit=2&offset=2') == ([d1['id']], 3, 2, 2)
    assert ids('?offset=5') == ([], 3, 50, 5)
    assert ids('?limit=500') == ([d3['id'], d2['id'], d1['id']], 3, 200, 0)
    listed = client.get('/api/disputes?status=resolved').json['disputes'][0]
    assert (listed['status'], listed['outcome'], listed['resolvedBy'], listed['needsAdmin']) == \
        ('resolved', 'worker', 'admin', False)
    assert ids('?needsAdmin=true') == ([d3['id'], d2['id']], 2, 50, 0)      # no panel: no arbitrator yet
    assert ids('?needsAdmin=false') == ([d1['id']], 1, 50, 0)
    assert ids(f'?needsAdmin=true&job_id={job2["id"]}') == ([d2['id']], 1, 50, 0)
    assert_error(client.get('/api/disputes?needsAdmin=yes'), 400, 'invalid_parameter')

    assert_error(client.get('/api/disputes?status=closed'), 400, 'invalid_parameter')
    assert_error(client.get('/api/disputes?job_id=12345'), 400, 'invalid_uuid')
    assert_error(client.get('/api/disputes?limit=0'), 400, 'invalid_parameter')
    assert_error(client.get('/api/disputes?limit=-1'), 400, 'invalid_parameter')
    assert_error(client.get('/api/disputes?offset=x'), 400, 'invalid_parameter')


# Resolving by PATCH ------------------------------------------------------------

def test_patch_for_the_worker_pays_the_worker(market, client, app):
    job, claim, dispute = disputed_job(market, paymentAmount='37.50')
    answer = resolve(client, dispute, 'worker', resolvedBy='Support desk')
    assert answer.status == 200, answer
    assert set(answer.json) == {'dispute', 'escrowStatus', 'jobStatus'}
    assert (answer.json['escrowStatus'], answer.json['jobStatus']) == ('released', 'completed')
    resolved = answer.json['dispute']
    assert set(resolved) == DISPUTE_FIELDS
    assert (resolved['id'], resolved['status'], resolved['outcome'], resolved['resolution'],
            resolved['resolvedBy'], resolved['votesReceived']) == \
        (dispute['id'], 'resolved', 'worker', 'Decided for the worker.', 'Support desk', 0)
    assert ISO_MS_Z.match(resolved['resolvedAt']) and resolved['resolvedAt'] >= resolved['createdAt']
    assert get_dispute(client, dispute)['dispute'] == resolved
    assert get_dispute(client, dispute)['claim']['status'] == 'approved'
    assert_paid_to_worker(market, app, job, claim, '37.50')


def test_patch_for_the_requester_refunds_at_the_reputation_floor(market, client, app):
    job, claim, dispute = disputed_job(market, paymentAmount='12.34')
    answer = resolve(client, dispute, 'requester')
    assert answer.status == 200, answer
    assert (answer.json['escrowStatus'], answer.json['jobStatus']) == ('refunded', 'refunded')
    resolved = answer.json['dispute']
    assert (resolved['status'], resolved['outcome'], resolved['resolution'], resolved['resolvedBy']) == \
        ('resolved', 'requester', 'Decided for the requester.', 'admin')
    assert ISO_MS_Z.match(resolved['resolvedAt'])
    assert get_dispute(client, dispute)['claim']['status'] == 'rejected'
    assert_refunded_to_requester(market, app, job, claim, '12.34')


def test_patch_for_the_requester_takes_one_point(market, client, app):
    set_reputation(app, market.agent, 500)
    job, claim, dispute = disputed_job(market)
    assert resolve(client, dispute, 'requester').status == 200
    assert_refunded_to_requester(market, app, job, claim, '25.00', score_after='4.00')


def test_patch_by_a_trusted_arbitrators_owner(market, client, app):
    job, claim, dispute = disputed_job(market)
    [(arbitrator, key)] = make_arbitrators(client, 1, prefix='judge', trusted=True)
    assert (arbitrator['status'], arbitrator['trusted']) == ('active', True)
    answer = resolve(client, dispute, 'worker', key=key, resolvedBy='The Supreme Court')    # not theirs to name
    assert answer.status == 200, answer
    assert (answer.json['dispute']['resolvedBy'], answer.json['jobStatus']) == ('judge 0', 'completed')
    assert_paid_to_worker(market, app, job, claim, '25.00')


def test_patch_by_the_owner_of_a_trusted_agent_arbitrator(market, client, app):
    job, claim, dispute = disputed_job(market)
    owner, owner_key = make_account(client, 'senior-agent-owner')
    agent, _ = make_agent(client, owner_key, name='senior')
    set_reputation(app, agent, 1000)
    registered = register_arbitrator(client, owner_key, name='Senior bot', agentId=agent['id'])
    assert (registered.status, registered.json['arbitrator']['status']) == (201, 'pending')
    assert_error(resolve(client, dispute, 'requester', key=owner_key), 403, 'forbidden')
    set_arbitrator(client, registered.json['arbitrator'], status='active', trusted=True)
    answer = resolve(client, dispute, 'requester', key=owner_key)
    assert answer.status == 200, answer
    assert (answer.json['dispute']['resolvedBy'], answer.json['jobStatus'], answer.json['escrowStatus']) == \
        ('Senior bot', 'refunded', 'refunded')
    assert_refunded_to_requester(market, app, job, claim, '25.00')


def test_parties_cannot_decide_their_own_dispute(market, client, app):
    job, claim, dispute = disputed_job(market)
    assert_error(resolve(client, dispute, 'requester', key=market.requester_key), 403, 'conflict_of_interest')
    assert_error(resolve(client, dispute, 'worker', key=market.worker_key), 403, 'conflict_of_interest')
    # Owning a trusted, active arbitrator does not change that.
    human = register_arbitrator(client, ADMIN_KEY, accountId=market.requester['id'])
    assert human.status == 201, human
    set_arbitrator(client, human.json['arbitrator'], status='active', trusted=True)
    set_reputation(app, market.agent, 1000)
    machine = register_arbitrator(client, market.worker_key, agentId=market.agent['id'])
    assert machine.status == 201, machine
    set_arbitrator(client, machine.json['arbitrator'], status='active', trusted=True)
    assert_error(resolve(client, dispute, 'requester', key=market.requester_key), 403, 'conflict_of_interest')
    assert_error(resolve(client, dispute, 'worker', key=market.worker_key), 403, 'conflict_of_interest')
    assert_still_open(market, job, claim, dispute)


@pytest.mark.parametrize('link', ['worker agent wallet', 'funding payer'])
def test_a_trusted_arbitrator_linked_by_its_wallet_cannot_decide(market, client, app, link):
    """Linked: its wallet is the worker agent's or the job's funding payer's (any letter case)."""
    job, claim = market.delivered_job()
    payer = random_wallet()
    app.service.db.execute('UPDATE jobs SET refund_address = :a WHERE id = :id', {'a': payer, 'id': job['id']})
    dispute = open_dispute(client, job, claim, market.requester_key)
    wallet = market.agent['walletAddress'] if link == 'worker agent wallet' else payer
    owner, key = make_account(client, 'sock-puppet')
    answer = register_arbitrator(client, ADMIN_KEY, accountId=owner['id'], walletAddress='0x' + wallet[2:].upper())
    set_arbitrator(client, answer.json['arbitrator'], status='active', trusted=True)
    assert_error(resolve(client, dispute, 'worker', key=key), 403, 'conflict_of_interest')
    assert_still_open(market, job, claim, dispute)
    # The same owner with a second trusted arbitrator that has no link decides.
    other = register_arbitrator(client, ADMIN_KEY, name='clean', accountId=owner['id']).json['arbitrator']
    set_arbitrator(client, other, status='active', trusted=True)
    answer = resolve(client, dispute, 'worker', key=key)
    assert (answer.status, answer.json['dispute']['resolvedBy']) == (200, 'clean')
    assert_paid_to_worker(market, app, job, claim, '25.00')


def test_patch_needs_an_admin_or_a_trusted_active_arbitrator(market, client):
    job, claim, dispute = disputed_job(market)
    _, stranger_key = make_account(client, 'stranger')
    assert_error(resolve(client, dispute, 'worker', key=stranger_key), 403, 'forbidden')
    account, key = make_account(client, 'would-be-judge')
    pending = register_arbitrator(client, ADMIN_KEY, accountId=account['id']).json['arbitrator']
    assert_error(resolve(client, dispute, 'worker', key=key), 403, 'forbidden')        # pending
    set_arbitrator(client, pending, trusted=True)
    assert_error(resolve(client, dispute, 'worker', key=key), 403, 'forbidden')        # trusted, still pending
    set_arbitrator(client, pending, status='active', trusted=False)
    assert_error(resolve(client, dispute, 'worker', key=key), 403, 'forbidden')        # active, not trusted
    set_arbitrator(client, pending, status='suspended', trusted=True)
    assert_error(resolve(client, dispute, 'worker', key=key), 403, 'forbidden')        # trusted, suspended
    assert_error(resolve(client, dispute, 'worker', key=None), 401, 'unauthorized')
    assert_still_open(market, job, claim, dispute)


def test_a_resolved_dispute_stays_resolved(market, client, app):
    job, claim, dispute = disputed_job(market)
    first = resolve(client, dispute, 'worker')
    assert first.status == 200, first
    assert_error(resolve(client, dispute, 'requester'), 409, 'dispute_resolved')
    assert_error(resolve(client, dispute, 'worker'), 409, 'dispute_resolved')
    [(arbitrator, key)] = make_arbitrators(client, 1, trusted=True)
    assert_error(resolve(client, dispute, 'requester', key=key), 409, 'dispute_resolved')
    assert get_dispute(client, dispute)['dispute'] == first.json['dispute']
    assert_paid_to_worker(market, app, job, claim, '25.00')


@pytest.mark.parametrize('body, fields', [
    ({'resolution': 'Decided.'}, {'outcome'}),
    ({'resolution': 'Decided.', 'outcome': 'nobody'}, {'outcome'}),
    ({'resolution': 'Decided.', 'outcome': None}, {'outcome'}),
    ({'resolution': 'Decided.', 'outcome': 'WORKER'}, {'outcome'}),
])
def test_patch_needs_a_valid_outcome(market, client, body, fields):
    job, claim, dispute = disputed_job(market)
    answer = client.patch(f'/api/disputes/{dispute["id"]}', body, key=ADMIN_KEY)
    assert_error(answer, 400, 'validation_failed', fields)
    assert_still_open(market, job, claim, dispute)


def test_patch_unknown_or_malformed_dispute(client):
    assert_error(client.patch(f'/api/disputes/{UNKNOWN_ID}', {'outcome': 'worker', 'resolution': 'x'},
                              key=ADMIN_KEY), 404, 'not_found')
    assert_error(client.patch('/api/disputes/123', {'outcome': 'worker', 'resolution': 'x'},
                              key=ADMIN_KEY), 400, 'invalid_uuid')


# Community votes ---------------------------------------------------------------

def test_three_votes_two_to_one_for_the_worker(market, client, app):
    (a, a_key), (b, b_key), (c, c_key) = make_arbitrators(client, 3)
    job, claim, dispute = disputed_job(market, paymentAmount='60.00')
    assert (dispute['panel'], dispute['needsAdmin']) == (sorted([a['id'], b['id'], c['id']]), False)

    first = vote(client, dispute, a, a_key, 'requester', 'Two tests are still red.')
    assert first.status == 201, first
    assert set(first.json) == {'vote', 'votesReceived', 'requiredVotes', 'resolved', 'outcome'}
    assert set(first.json['vote']) == VOTE_FIELDS
    assert ISO_MS_Z.match(first.json['vote']['createdAt'])
    assert {k: v for k, v in first.json['vote'].items() if k not in ('id', 'createdAt')} == {
        'disputeId': dispute['id'], 'arbitratorId': a['id'], 'vote': 'requester',
        'reasoning': 'Two tests are still red.'}
    assert (first.json['votesReceived'], first.json['requiredVotes'], first.json['resolved'],
            first.json['outcome']) == (1, 3, False, None)

    second = vote(client, dispute, b, b_key, 'worker')
    assert second.status == 201, second
    assert (second.json['votesReceived'], second.json['resolved'], second.json['outcome']) == (2, False, None)
    assert_still_open(market, job, claim, dispute, votes=2)

    third = vote(client, dispute, c, c_key, 'worker')
    assert third.status == 201, third
    assert (third.json['votesReceived'], third.json['requiredVotes'], third.json['resolved'],
            third.json['outcome']) == (3, 3, True, 'worker')

    resolved = get_dispute(client, dispute)['dispute']
    assert (resolved['status'], resolved['outcome'], resolved['resolvedBy'], resolved['votesReceived']) == \
        ('resolved', 'worker', 'community', 3)
    assert isinstance(resolved['resolution'], str) and resolved['resolution'].strip()
    assert ISO_MS_Z.match(resolved['resolvedAt'])
    assert_paid_to_worker(market, app, job, claim, '60.00')

    votes = client.get(f'/api/disputes/{dispute["id"]}/vote')
    assert votes.status == 200, votes
    assert votes.json['summary'] == {'requester': 1, 'worker': 2, 'total': 3}
    assert [(v['arbitratorId'], v['vote']) for v in votes.json['votes']] == \
        [(a['id'], 'requester'), (b['id'], 'worker'), (c['id'], 'worker')]
    assert votes.json['votes'][0] == first.json['vote']
    assert all(set(v) == VOTE_FIELDS and v['disputeId'] == dispute['id'] for v in votes.json['votes'])

    ranked = {x['id']: (x['accuracy'], x['votesCast']) for x in arbitrator_list(client)['arbitrators']}
    assert ranked == {a['id']: (0.0, 1), b['id']: (1.0, 1), c['id']: (1.0, 1)}


def test_three_votes_two_to_one_for_the_requester(market, client, app):
    (a, a_key), (b, b_key), (c, c_key) = make_arbitrators(client, 3)
    job, claim, dispute = disputed_job(market, paymentAmount='60.00')
    assert vote(client, dispute, a, a_key, 'worker').status == 201
    assert vote(client, dispute, b, b_key, 'requester').status == 201
    third = vote(client, dispute, c, c_key, 'requester')
    assert third.status == 201, third
    assert (third.json['votesReceived'], third.json['resolved'], third.json['outcome']) == (3, True, 'requester')
    shown = get_dispute(client, dispute)
    assert (shown['dispute']['status'], shown['dispute']['outcome'], shown['dispute']['resolvedBy']) == \
        ('resolved', 'requester', 'community')
    assert (shown['job']['status'], shown['job']['escrowStatus'], shown['claim']['status']) == \
        ('refunded', 'refunded', 'rejected')
    assert client.get(f'/api/disputes/{dispute["id"]}/vote').json['summary'] == \
        {'requester': 2, 'worker': 1, 'total': 3}
    assert_refunded_to_requester(market, app, job, claim, '60.00')
    ranked = {x['id']: x['accuracy'] for x in arbitrator_list(client)['arbitrators']}
    assert ranked == {a['id']: 0.0, b['id']: 1.0, c['id']: 1.0}


def test_votes_before_any_is_cast(market, client):
    job, claim, dispute = disputed_job(market)
    answer = client.get(f'/api/disputes/{dispute["id"]}/vote')
    assert answer.status == 200, answer
    assert answer.json == {'votes': [], 'summary': {'requester': 0, 'worker': 0, 'total': 0}}
    assert_error(client.get(f'/api/disputes/{UNKNOWN_ID}/vote'), 404, 'not_found')
    assert_error(client.get('/api/disputes/zzz/vote'), 400, 'invalid_uuid')


def test_an_arbitrator_votes_once(market, client):
    (a, a_key), _, _ = make_arbitrators(client, 3)
    job, claim, dispute = disputed_job(market)
    assert vote(client, dispute, a, a_key, 'worker').status == 201
    assert_error(vote(client, dispute, a, a_key, 'worker'), 409, 'already_voted')
    assert_error(vote(client, dispute, a, a_key, 'requester'), 409, 'already_voted')
    assert client.get(f'/api/disputes/{dispute["id"]}/vote').json['summary'] == \
        {'requester': 0, 'worker': 1, 'total': 1}
    assert_still_open(market, job, claim, dispute, votes=1)


def test_no_vote_on_a_resolved_dispute(market, client, app):
    arbitrators = make_arbitrators(client, 3)
    job, claim, dispute = disputed_job(market)
    other_job, other_claim, other = disputed_job(market)
    for (arbitrator, key), choice in zip(arbitrators, ('worker', 'worker', 'requester')):
        assert vote(client, dispute, arbitrator, key, choice).status == 201
    first, first_key = arbitrators[0]
    assert_error(vote(client, dispute, first, first_key, 'requester'), 409, 'dispute_resolved')
    [(late, late_key)] = make_arbitrators(client, 1, prefix='late')       # on no panel: refused before that
    assert_error(vote(client, dispute, late, late_key, 'requester'), 403, 'not_on_panel')
    assert get_dispute(client, dispute)['dispute']['votesReceived'] == 3
    assert_paid_to_worker(market, app, job, claim, '25.00')
    # Resolved by PATCH: the same.
    assert resolve(client, other, 'worker').status == 200
    assert_error(vote(client, other, first, first_key, 'worker'), 409, 'dispute_resolved')
    assert client.get(f'/api/disputes/{other["id"]}/vote').json['votes'] == []


def test_vote_needs_the_arbitrators_owner(market, client):
    (a, a_key), (b, b_key), _ = make_arbitrators(client, 3)
    job, claim, dispute = disputed_job(market)
    assert_error(vote(client, dispute, a, b_key, 'worker'), 403, 'forbidden')
    _, stranger_key = make_account(client, 'stranger')
    assert_error(vote(client, dispute, a, stranger_key, 'worker'), 403, 'forbidden')
    assert_error(vote(client, dispute, a, None, 'worker'), 401, 'unauthorized')
    assert_error(vote(client, dispute, {'id': UNKNOWN_ID}, a_key, 'worker'), 404, 'not_found')
    assert_error(vote(client, {'id': UNKNOWN_ID}, a, a_key, 'worker'), 404, 'not_found')
    assert_still_open(market, job, claim, dispute)


def test_suspended_arbitrator_cannot_vote(market, client):
    (a, a_key), _, _ = make_arbitrators(client, 3)
    job, claim, dispute = disputed_job(market)
    assert client.patch(f'/api/arbitrators/{a["id"]}', {'status': 'suspended'}, key=ADMIN_KEY).status == 200
    assert_error(vote(client, dispute, a, a_key, 'worker'), 403, 'arbitrator_suspended')
    assert_still_open(market, job, claim, dispute)
    reinstated = client.patch(f'/api/arbitrators/{a["id"]}', {'status': 'active'}, key=ADMIN_KEY)
    assert (reinstated.status, reinstated.json['arbitrator']['status']) == (200, 'active')
    answer = vote(client, dispute, a, a_key, 'worker')
    assert (answer.status, answer.json['votesReceived']) == (201, 1)


def test_parties_cannot_vote(market, client, app):
    job, claim, dispute = disputed_job(market)
    human = register_arbitrator(client, ADMIN_KEY, name='requester as judge', accountId=market.requester['id'])
    assert human.status == 201, human
    set_arbitrator(client, human.json['arbitrator'], status='active')
    set_reputation(app, market.agent, 1000)
    machine = register_arbitrator(client, market.worker_key, name='worker as judge', agentId=market.agent['id'])
    assert machine.status == 201, machine
    set_arbitrator(client, machine.json['arbitrator'], status='active')
    assert_error(vote(client, dispute, human.json['arbitrator'], market.requester_key, 'requester'),
                 403, 'conflict_of_interest')
    assert_error(vote(client, dispute, machine.json['arbitrator'], market.worker_key, 'worker'),
                 403, 'conflict_of_interest')
    shown = get_dispute(client, dispute)
    assert (shown['dispute']['status'], shown['dispute']['votesReceived']) == ('open', 0)
    assert [p['type'] for p in market.get_job(job)['payments']] == ['escrow']


@pytest.mark.parametrize('body, status, code', [
    ({'vote': 'maybe'}, 400, 'validation_failed'),
    ({'vote': None}, 400, 'validation_failed'),
    ({'arbitratorId': 'x'}, 400, 'invalid_uuid'),
    ({'arbitratorId': None}, 400, 'validation_failed'),
])
def test_vote_body_is_checked(market, client, body, status, code):
    (a, a_key), _, _ = make_arbitrators(client, 3)
    job, claim, dispute = disputed_job(market)
    full = {'arbitratorId': a['id'], 'vote': 'worker', 'reasoning': 'ok', **body}
    answer = client.post(f'/api/disputes/{dispute["id"]}/vote', full, key=a_key)
    assert_error(answer, status, code)
    assert_still_open(market, job, claim, dispute)


@pytest.fixture
def five_votes(tmp_path):
    """An app that needs five votes to decide a dispute; the ledger must balance after the test."""
    settings = mp.Settings(db=str(tmp_path / 'five.db'), rate_limits='off', admin_key=ADMIN_KEY,
                           public_url='http://market.test', required_votes=5)
    app = wiring.make_app(settings)
    yield app
    problems = mp.ledger_problems(app.service.db)
    app.service.close()
    assert problems == []


def test_required_votes_setting(five_votes):
    client = Client(five_votes)
    market = Market(client)
    arbitrators = make_arbitrators(client, 5)
    job, claim, dispute = disputed_job(market)
    assert (dispute['requiredVotes'], dispute['panel']) == (5, sorted(a['id'] for a, _ in arbitrators))
    choices = ['worker', 'requester', 'requester', 'worker', 'requester']
    for number, ((arbitrator, key), choice) in enumerate(zip(arbitrators[:4], choices), start=1):
        answer = vote(client, dispute, arbitrator, key, choice)
        assert (answer.status, answer.json['votesReceived'], answer.json['requiredVotes'],
                answer.json['resolved'], answer.json['outcome']) == (201, number, 5, False, None)
    assert_still_open(market, job, claim, dispute, votes=4)
    last = vote(client, dispute, *arbitrators[4], choices[4])
    assert (last.status, last.json['votesReceived'], last.json['resolved'], last.json['outcome']) == \
        (201, 5, True, 'requester')
    assert_refunded_to_requester(market, five_votes, job, claim, '25.00')


def test_a_dispute_keeps_the_required_votes_it_was_opened_with(market, client, app):
    everyone = make_arbitrators(client, 5)
    job, claim, early = disputed_job(market)
    app.service.settings.required_votes = 5
    later_job, later_claim, later = disputed_job(market)
    assert (early['requiredVotes'], later['requiredVotes']) == (3, 5)
    assert (len(early['panel']), len(later['panel'])) == (3, 5)
    arbitrators = [(a, key) for a, key in everyone if a['id'] in early['panel']]
    for arbitrator, key in arbitrators:
        assert vote(client, later, arbitrator, key, 'worker').status == 201
    answers = [vote(client, early, arbitrator, key, 'worker') for arbitrator, key in arbitrators]
    assert [(a.status, a.json['requiredVotes'], a.json['resolved']) for a in answers] == \
        [(201, 3, False), (201, 3, False), (201, 3, True)]
    assert_paid_to_worker(market, app, job, claim, '25.00')
    shown = get_dispute(client, later)['dispute']
    assert (shown['status'], shown['requiredVotes'], shown['votesReceived']) == ('open', 5, 3)
    assert market.get_job(later_job)['job']['status'] == 'disputed'


# Arbitrators ------------------------------------------------------------------------

def test_admin_registers_human_arbitrators(client, app):
    owner, _ = make_account(client, 'retired-judge')
    wallet = random_wallet()
    answer = register_arbitrator(client, ADMIN_KEY, name='Judge Dredd', walletAddress=wallet, accountId=owner['id'])
    assert answer.status == 201, answer
    assert set(answer.json) == {'arbitrator'}
    arbitrator = answer.json['arbitrator']
    assert set(arbitrator) == ARBITRATOR_FIELDS
    assert ISO_MS_Z.match(arbitrator['createdAt'])
    assert {k: v for k, v in arbitrator.items() if k not in ('id', 'createdAt')} == {
        'name': 'Judge Dredd', 'walletAddress': wallet, 'agentId': None, 'accountId': owner['id'],
        'status': 'pending', 'trusted': False, 'accuracy': None, 'votesCast': 0}
    own = register_arbitrator(client, ADMIN_KEY, name='The admin')
    assert own.status == 201, own
    assert (own.json['arbitrator']['accountId'], own.json['arbitrator']['agentId']) == (admin_account_id(app), None)
    listed = arbitrator_list(client)
    assert listed['total'] == 2
    assert {a['id']: a for a in listed['arbitrators']}[arbitrator['id']] == arbitrator


def test_human_arbitrator_registration_errors(client):
    member, member_key = make_account(client, 'member')
    assert_error(register_arbitrator(client, member_key), 403, 'forbidden')
    assert_error(register_arbitrator(client, member_key, accountId=member['id']), 403, 'forbidden')
    assert_error(register_arbitrator(client, None), 401, 'unauthorized')
    unknown = register_arbitrator(client, ADMIN_KEY, accountId=UNKNOWN_ID)     # a well-formed id of nothing: 404
    assert_error(unknown, 404, 'not_found')
    assert unknown.json['error'] == 'No account has this id (accountId).'
    assert_error(register_arbitrator(client, ADMIN_KEY, accountId='not-a-uuid'), 400, 'invalid_uuid')
    assert_error(client.post('/api/arbitrators', {'walletAddress': random_wallet()}, key=ADMIN_KEY),
                 400, 'validation_failed', {'name'})
    assert_error(client.post('/api/arbitrators', {'name': 'x', 'walletAddress': 'nope'}, key=ADMIN_KEY),
                 400, 'validation_failed', {'walletAddress'})
    assert arbitrator_list(client)['total'] == 0


def test_an_agent_with_ten_points_becomes_an_arbitrator(market, client, app):
    set_reputation(app, market.agent, 1000)
    wallet = random_wallet()
    answer = register_arbitrator(client, market.worker_key, name='Bot judge', walletAddress=wallet,
                                 agentId=market.agent['id'])
    assert answer.status == 201, answer
    arbitrator = answer.json['arbitrator']
    assert {k: v for k, v in arbitrator.items() if k not in ('id', 'createdAt')} == {
        'name': 'Bot judge', 'walletAddress': wallet, 'agentId': market.agent['id'],
        'accountId': market.worker['id'], 'status': 'pending', 'trusted': False, 'accuracy': None, 'votesCast': 0}
    again = register_arbitrator(client, market.worker_key, agentId=market.agent['id'])
    assert_error(again, 409, 'already_arbitrator')
    assert arbitrator_list(client)['total'] == 1


def test_agent_arbitrator_needs_reputation_and_ownership(market, client, app):
    set_reputation(app, market.agent, 999)
    assert_error(register_arbitrator(client, market.worker_key, agentId=market.agent['id']),
                 403, 'insufficient_reputation')
    set_reputation(app, market.agent, 1000)
    assert_error(register_arbitrator(client, market.requester_key, agentId=market.agent['id']), 403, 'forbidden')
    assert_error(register_arbitrator(client, market.worker_key, agentId=UNKNOWN_ID), 404, 'not_found')
    assert arbitrator_list(client)['total'] == 0
    answer = register_arbitrator(client, market.worker_key, agentId=market.agent['id'])
    assert answer.status == 201, answer


def test_agent_arbitrator_earned_through_disputes_won(market, client, app):
    """Reputation earned the ordinary way counts: seven disputes won (7 x 1.50 = 10.50)."""
    for _ in range(6):
        job, claim, dispute = disputed_job(market, paymentAmount='1.00')
        assert resolve(client, dispute, 'worker').status == 200
    assert get_agent(client, market.agent)['agent']['reputationScore'] == '9.00'
    assert_error(register_arbitrator(client, market.worker_key, agentId=market.agent['id']),
                 403, 'insufficient_reputation')
    job, claim, dispute = disputed_job(market, paymentAmount='1.00')
    assert resolve(client, dispute, 'worker').status == 200
    assert get_agent(client, market.agent)['agent']['reputationScore'] == '10.50'
    assert register_arbitrator(client, market.worker_key, agentId=market.agent['id']).status == 201


def test_only_admins_change_an_arbitrators_status(client):
    account, a_key = make_account(client, 'judge')
    a = register_arbitrator(client, ADMIN_KEY, accountId=account['id']).json['arbitrator']
    assert (a['status'], a['trusted']) == ('pending', False)
    for body in ({'status': 'active'}, {'trusted': True}, {'status': 'suspended'}):
        assert_error(client.patch(f'/api/arbitrators/{a["id"]}', body, key=a_key), 403, 'forbidden')
        assert_error(client.patch(f'/api/arbitrators/{a["id"]}', body), 401, 'unauthorized')
    assert [(x['status'], x['trusted']) for x in arbitrator_list(client)['arbitrators']] == [('pending', False)]
    answer = client.patch(f'/api/arbitrators/{a["id"]}', {'status': 'active'}, key=ADMIN_KEY)
    assert answer.status == 200, answer
    assert answer.json['arbitrator'] == dict(a, status='active')
    answer = client.patch(f'/api/arbitrators/{a["id"]}', {'trusted': True}, key=ADMIN_KEY)      # status stays
    assert (answer.status, answer.json['arbitrator']) == (200, dict(a, status='active', trusted=True))
    answer = client.patch(f'/api/arbitrators/{a["id"]}', {'status': 'suspended', 'trusted': False}, key=ADMIN_KEY)
    assert (answer.status, answer.json['arbitrator']) == (200, dict(a, status='suspended', trusted=False))
    assert_error(client.patch(f'/api/arbitrators/{a["id"]}', {'status': 'retired'}, key=ADMIN_KEY),
                 400, 'validation_failed', {'status'})
    assert_error(client.patch(f'/api/arbitrators/{a["id"]}', {'status': 'pending'}, key=ADMIN_KEY),
                 400, 'validation_failed', {'status'})
    assert_error(client.patch(f'/api/arbitrators/{a["id"]}', {'trusted': 'yes'}, key=ADMIN_KEY),
                 400, 'validation_failed', {'trusted'})
    assert_error(client.patch(f'/api/arbitrators/{a["id"]}', {}, key=ADMIN_KEY),
                 400, 'validation_failed', {'status', 'trusted'})
    assert_error(client.patch(f'/api/arbitrators/{a["id"]}', {'trusted': None}, key=ADMIN_KEY),
                 400, 'validation_failed', {'status', 'trusted'})
    assert arbitrator_list(client)['arbitrators'] == [dict(a, status='suspended')]
    assert_error(client.patch(f'/api/arbitrators/{UNKNOWN_ID}', {'status': 'active'}, key=ADMIN_KEY),
                 404, 'not_found')
    assert_error(client.patch('/api/arbitrators/x', {'status': 'active'}, key=ADMIN_KEY), 400, 'invalid_uuid')


def test_arbitrators_ranked_by_accuracy_then_votes(market, client, monkeypatch):
    arbitrators = make_arbitrators(client, 6)
    (a0, k0), (a1, k1), (a2, k2), (a3, k3), (a4, k4), (a5, k5) = arbitrators
    listed = arbitrator_list(client)
    assert (listed['total'], listed['limit'], listed['offset']) == (6, 50, 0)
    assert all(a['accuracy'] is None and a['votesCast'] == 0 for a in listed['arbitrators'])
    monkeypatch.setattr(mp, 'PANEL_DRAW', ChosenPanels([a0, a1, a2], [a1, a2, a5], [a3, a4, a5], [a4, a0, a5]))

    # Dispute 1, decided 2-1 by vote for the worker: a0, a1 right, a2 wrong.
    _, _, d1 = disputed_job(market)
    for arbitrator, key, choice in ((a0, k0, 'worker'), (a1, k1, 'worker'), (a2, k2, 'requester')):
        assert vote(client, d1, arbitrator, key, choice).status == 201
    # Dispute 2, two votes, then decided by PATCH for the worker: a1 right again, a2 right this time.
    _, _, d2 = disputed_job(market)
    for arbitrator, key in ((a1, k1), (a2, k2)):
        assert vote(client, d2, arbitrator, key, 'worker').status == 201
    # Before d2 is resolved its votes do not count towards accuracy.
    before = {a['id']: (a['accuracy'], a['votesCast']) for a in arbitrator_list(client)['arbitrators']}
    assert before == {a0['id']: (1.0, 1), a1['id']: (1.0, 2), a2['id']: (0.0, 2), a3['id']: (None, 0),
                      a4['id']: (None, 0), a5['id']: (None, 0)}
    # Dispute 2b, one vote (a3, wrong), then decided by PATCH for the worker.
    _, _, d2b = disputed_job(market)
    assert vote(client, d2b, a3, k3, 'requester').status == 201
    assert resolve(client, d2, 'worker').status == 200
    assert resolve(client, d2b, 'worker').status == 200
    # Dispute 3 stays open: a4's vote counts as cast, not towards accuracy.
    _, _, d3 = disputed_job(market)
    assert vote(client, d3, a4, k4, 'worker').status == 201

    listed = arbitrator_list(client)
    assert listed['total'] == 6
    assert [(a['id'], a['accuracy'], a['votesCast']) for a in listed['arbitrators']] == [
        (a1['id'], 1.0, 2),
        (a0['id'], 1.0, 1),
        (a2['id'], 0.5, 2),
        (a3['id'], 0.0, 1),
        (a4['id'], None, 1),
        (a5['id'], None, 0),
    ]
    page = arbitrator_list(client, '?limit=2&offset=1')
    assert ([a['id'] for a in page['arbitrators']], page['total'], page['limit'], page['offset']) == \
        ([a0['id'], a2['id']], 6, 2, 1)
    assert [a['id'] for a in arbitrator_list(client, '?offset=5')['arbitrators']] == [a5['id']]

    assert client.patch(f'/api/arbitrators/{a2["id"]}', {'status': 'suspended'}, key=ADMIN_KEY).status == 200
    suspended = arbitrator_list(client, '?status=suspended')
    assert ([(a['id'], a['status']) for a in suspended['arbitrators']], suspended['total']) == \
        ([(a2['id'], 'suspended')], 1)
    active = arbitrator_list(client, '?status=active')
    assert ([a['id'] for a in active['arbitrators']], active['total']) == \
        ([a1['id'], a0['id'], a3['id'], a4['id'], a5['id']], 5)
    newcomer = register_arbitrator(client, ADMIN_KEY, name='newcomer').json['arbitrator']
    waiting = arbitrator_list(client, '?status=pending')
    assert ([(a['id'], a['status']) for a in waiting['arbitrators']], waiting['total']) == \
        ([(newcomer['id'], 'pending')], 1)
    assert_error(client.get('/api/arbitrators?status=retired'), 400, 'invalid_parameter')
    assert_error(client.get('/api/arbitrators?limit=0'), 400, 'invalid_parameter')


# Stats ------------------------------------------------------------------------------

def test_stats_count_open_disputes_and_arbitrators(market, client):
    def stats():
        answer = client.get('/api/stats')
        assert answer.status == 200, answer
        return answer.json

    before = stats()
    assert (before['openDisputes'], before['totalArbitrators'], before['completedJobs'], before['totalUSDC']) == \
        (0, 0, 0, '0.00')
    arbitrators = make_arbitrators(client, 3)
    assert stats()['totalArbitrators'] == 3
    _, _, d1 = disputed_job(market, paymentAmount='30.00')
    _, _, d2 = disputed_job(market)
    assert stats()['openDisputes'] == 2
    assert resolve(client, d1, 'worker').status == 200
    after = stats()
    assert (after['openDisputes'], after['completedJobs'], after['totalUSDC'], after['totalJobs']) == \
        (1, 1, '30.00', 2)
    for (arbitrator, key), choice in zip(arbitrators, ('requester', 'requester', 'worker')):
        assert vote(client, d2, arbitrator, key, choice).status == 201
    final = stats()
    assert (final['openDisputes'], final['totalArbitrators'], final['completedJobs'], final['totalUSDC']) == \
        (0, 3, 1, '30.00')


# Multi-worker jobs ---------------------------------------------------------------

@pytest.mark.parametrize('mode', ['first-wins', 'best-wins'])
def test_approval_waits_for_a_dispute_on_another_delivery(market, client, app, mode):
    _, other_key = make_account(client, 'second-worker')
    other_agent, _ = make_agent(client, other_key, name='second-agent')
    job = market.job(maxWorkers=2, competitionMode=mode, paymentAmount='50.00')
    first = market.deliver(job, market.claim(job))
    second = market.deliver(job, market.claim(job, agent=other_agent, key=other_key), key=other_key)
    assert market.get_job(job)['job']['status'] == 'delivered'
    dispute = open_dispute(client, job, first, market.requester_key)
    assert market.get_job(job)['job']['status'] == 'disputed'

    assert_error(market.verify(job, second, True), 409, 'dispute_open')
    shown = market.get_job(job)
    assert {c['id']: c['status'] for c in shown['claims']} == {first['id']: 'disputed', second['id']: 'delivered'}
    assert [p['type'] for p in shown['payments']] == ['escrow']

    answer = resolve(client, dispute, 'requester')
    assert answer.status == 200, answer
    assert (answer.json['escrowStatus'], answer.json['jobStatus']) == ('locked', 'delivered')
    assert history_of(client, market.agent) == [('-1.00', 'dispute lost', job['id'], first['id'], '0.00')]

    approved = market.verify(job, second, True)
    assert approved.status == 200, approved
    assert (approved.json['job']['status'], approved.json['escrowStatus']) == ('completed', 'released')
    shown = market.get_job(job)
    assert {c['id']: c['status'] for c in shown['claims']} == {first['id']: 'rejected', second['id']: 'approved'}
    assert payments_of(shown) == [('escrow', '50.00', 'escrow'), ('release', '50.00', other_agent['walletAddress'])]
    assert ledger_balance(app, f'worker:{other_agent["id"]}') == 50 * USDC
    assert ledger_balance(app, f'worker:{market.agent["id"]}') == 0
    assert ledger_balance(app, mp.escrow_account(job['id'])) == 0
    assert history_of(client, other_agent) == [('1.00', 'delivery approved', job['id'], second['id'], '1.00')]


def test_dispute_won_on_a_multi_worker_job_supersedes_the_other(market, client, app):
    _, other_key = make_account(client, 'second-worker')
    other_agent, _ = make_agent(client, other_key, name='second-agent')
    job = market.job(maxWorkers=2, competitionMode='best-wins', paymentAmount='50.00')
    first = market.deliver(job, market.claim(job))
    second = market.deliver(job, market.claim(job, agent=other_agent, key=other_key), key=other_key)
    dispute = open_dispute(client, job, first, market.requester_key)
    answer = resolve(client, dispute, 'worker')
    assert answer.status == 200, answer
    assert (answer.json['escrowStatus'], answer.json['jobStatus']) == ('released', 'completed')
    shown = market.get_job(job)
    assert {c['id']: c['status'] for c in shown['claims']} == {first['id']: 'approved', second['id']: 'superseded'}
    assert payments_of(shown) == [('escrow', '50.00', 'escrow'), ('release', '50.00', market.agent['walletAddress'])]
    assert ledger_balance(app, f'worker:{market.agent["id"]}') == 50 * USDC
    assert history_of(client, market.agent) == [('1.50', 'dispute won', job['id'], first['id'], '1.50')]
    assert history_of(client, other_agent) == []



def test_a_first_wins_job_holds_one_open_dispute_at_a_time(client, market):
    job = market.job(maxWorkers=2, competitionMode='first-wins', paymentAmount='40.00')
    _, second_key = make_account(client, 'second-worker')
    second_agent, _ = make_agent(client, second_key, name='second')
    first = market.deliver(job, market.claim(job))
    second = market.deliver(job, market.claim(job, agent=second_agent, key=second_key), key=second_key)
    opened = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': first['id'], 'reason': 'Wrong output.'},
                         key=market.requester_key)
    assert opened.status == 201, opened
    refused = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': second['id'], 'reason': 'Also wrong.'},
                          key=market.requester_key)
    assert_error(refused, 409, 'dispute_open')
    # Deciding the open dispute for its worker pays the whole price and supersedes the other delivery.
    decided = client.patch(f'/api/disputes/{opened.json["dispute"]["id"]}',
                           {'outcome': 'worker', 'resolution': 'The output was right.'}, key=ADMIN_KEY)
    assert (decided.status, decided.json['jobStatus'], decided.json['escrowStatus']) == (200, 'completed', 'released')
    claims = {c['id']: c['status'] for c in market.get_job(job)['claims']}
    assert claims == {first['id']: 'approved', second['id']: 'superseded'}
    assert [(p['type'], p['amount']) for p in market.get_job(job)['payments']] == [('escrow', '40.00'), ('release', '40.00')]


# Panels (CONTRACT.md 18, "Arbitration cannot be bought") ------------------------------

def test_a_panel_of_required_votes_is_drawn_when_a_dispute_opens(market, client, app):
    arbitrators = make_arbitrators(client, 5)
    pending = register_arbitrator(client, ADMIN_KEY, name='pending').json['arbitrator']
    [(suspended, _)] = make_arbitrators(client, 1, prefix='benched')
    set_arbitrator(client, suspended, status='suspended')
    job, claim, dispute = disputed_job(market)
    eligible = {a['id'] for a, _ in arbitrators}
    assert (len(dispute['panel']), dispute['needsAdmin']) == (3, False)
    assert set(dispute['panel']) <= eligible and dispute['panel'] == sorted(dispute['panel'])
    stored = app.service.db.rows('SELECT arbitrator_id FROM dispute_panels WHERE dispute_id = :id ORDER BY 1',
                                 {'id': dispute['id']})
    assert [row['arbitrator_id'] for row in stored] == dispute['panel']
    assert get_dispute(client, dispute)['dispute']['panel'] == dispute['panel']
    assert pending['id'] not in dispute['panel'] and suspended['id'] not in dispute['panel']


def test_only_the_panel_votes(market, client, monkeypatch):
    arbitrators = make_arbitrators(client, 4)
    (a, a_key), (b, b_key), (c, c_key), (outsider, outsider_key) = arbitrators
    monkeypatch.setattr(mp, 'PANEL_DRAW', ChosenPanels([a, b, c]))
    job, claim, dispute = disputed_job(market)
    assert dispute['panel'] == sorted([a['id'], b['id'], c['id']])
    assert_error(vote(client, dispute, outsider, outsider_key, 'worker'), 403, 'not_on_panel')
    pending_owner, pending_key = make_account(client, 'pending-judge')
    pending = register_arbitrator(client, ADMIN_KEY, accountId=pending_owner['id']).json['arbitrator']
    assert_error(vote(client, dispute, pending, pending_key, 'worker'), 403, 'not_on_panel')
    assert_still_open(market, job, claim, dispute)
    assert vote(client, dispute, a, a_key, 'worker').status == 201
    assert vote(client, dispute, b, b_key, 'worker').status == 201
    assert_error(vote(client, dispute, outsider, outsider_key, 'requester'), 403, 'not_on_panel')
    last = vote(client, dispute, c, c_key, 'requester')
    assert (last.status, last.json['resolved'], last.json['outcome']) == (201, True, 'worker')


@pytest.mark.parametrize('link', ['requester account', 'worker account', 'worker agent wallet', 'funding payer'])
def test_a_linked_arbitrator_is_never_drawn(market, client, app, link):
    """Four clean arbitrators and one linked: over ten disputes the linked one is never on a panel (nor may
    it vote: conflict_of_interest), and three of the four others always are."""
    clean = make_arbitrators(client, 4)
    payer = random_wallet()
    owner, key = {'requester account': (market.requester, market.requester_key),
                  'worker account': (market.worker, market.worker_key)}.get(link) or make_account(client, 'puppet')
    wallet = {'worker agent wallet': market.agent['walletAddress'], 'funding payer': payer}.get(link, random_wallet())
    linked = register_arbitrator(client, ADMIN_KEY, name='linked', accountId=owner['id'],
                                 walletAddress='0x' + wallet[2:].upper()).json['arbitrator']   # case-blind
    linked = set_arbitrator(client, linked, status='active')
    for _ in range(10):
        job, claim = market.delivered_job()
        app.service.db.execute('UPDATE jobs SET refund_address = :a WHERE id = :id', {'a': payer, 'id': job['id']})
        dispute = open_dispute(client, job, claim, market.requester_key)
        assert len(dispute['panel']) == 3 and set(dispute['panel']) <= {a['id'] for a, _ in clean}, dispute
        assert dispute['needsAdmin'] is False
    assert_error(vote(client, dispute, linked, key, 'worker'), 403, 'conflict_of_interest')
    assert_still_open(market, job, claim, dispute)


def test_a_short_panel_leaves_the_dispute_to_an_admin(market, client, app):
    """Three active arbitrators, but one is the worker's: too few to draw three, so no panel and needsAdmin."""
    make_arbitrators(client, 2)
    set_reputation(app, market.agent, 1000)
    mine = register_arbitrator(client, market.worker_key, agentId=market.agent['id']).json['arbitrator']
    set_arbitrator(client, mine, status='active')
    job, claim, dispute = disputed_job(market)
    assert (dispute['panel'], dispute['needsAdmin']) == ([], True)
    assert app.service.db.value('SELECT count(*) FROM dispute_panels') == 0
    listed = client.get('/api/disputes?needsAdmin=true').json
    assert ([d['id'] for d in listed['disputes']], listed['total']) == ([dispute['id']], 1)
    assert_still_open(market, job, claim, dispute)
    answer = resolve(client, dispute, 'requester')
    assert (answer.status, answer.json['dispute']['needsAdmin'], answer.json['dispute']['panel']) == \
        (200, False, [])
    assert client.get('/api/disputes?needsAdmin=true').json['total'] == 0
    assert_refunded_to_requester(market, app, job, claim, '25.00', score_after='9.00')


def test_panels_are_drawn_at_random(market, client, monkeypatch):
    """Five eligible arbitrators, panels of three: the draw (seeded here, SystemRandom in service) gives
    different panels over twenty disputes, and every eligible arbitrator sits on some of them."""
    monkeypatch.setattr(mp, 'PANEL_DRAW', random.Random(20260118))
    arbitrators = make_arbitrators(client, 5)
    panels = [tuple(disputed_job(market, paymentAmount='1.00')[2]['panel']) for _ in range(20)]
    assert all(len(set(panel)) == 3 for panel in panels)
    assert len(set(panels)) >= 5
    assert {member for panel in panels for member in panel} == {a['id'] for a, _ in arbitrators}
    monkeypatch.undo()
    assert isinstance(mp.PANEL_DRAW, mp.secrets.SystemRandom)       # the service's own draw


def test_a_dispute_open_past_the_timeout_needs_an_admin(market, client, app, real_clock):
    arbitrators = make_arbitrators(client, 3)
    job, claim, dispute = disputed_job(market)
    assert (len(dispute['panel']), dispute['needsAdmin']) == (3, False)
    opened = mp.parse_time(dispute['createdAt'])
    real_clock.set(opened + mp.timedelta(hours=168) - mp.timedelta(milliseconds=1))
    assert get_dispute(client, dispute)['dispute']['needsAdmin'] is False
    assert client.get('/api/disputes?needsAdmin=true').json['total'] == 0
    real_clock.set(opened + mp.timedelta(hours=168))
    assert get_dispute(client, dispute)['dispute']['needsAdmin'] is True
    listed = client.get('/api/disputes?needsAdmin=true').json
    assert [d['id'] for d in listed['disputes']] == [dispute['id']]
    assert listed['disputes'][0]['needsAdmin'] is True
    assert client.get('/api/disputes?needsAdmin=false').json['total'] == 0
    # Nothing moves on its own, sweeps included; the panel may still vote.
    assert client.post('/api/jobs/expire', key=ADMIN_KEY).status == 200
    assert client.post('/api/jobs/auto-verify', key=ADMIN_KEY).status == 200
    assert_still_open(market, job, claim, dispute)
    (a, a_key) = arbitrators[0]
    assert vote(client, dispute, a, a_key, 'worker').status == 201
    # A shorter --dispute-timeout-hours counts for disputes already open.
    real_clock.set(opened + mp.timedelta(hours=24))
    assert get_dispute(client, dispute)['dispute']['needsAdmin'] is False
    app.service.settings.dispute_timeout_hours = 24
    assert get_dispute(client, dispute)['dispute']['needsAdmin'] is True
    assert resolve(client, dispute, 'worker').status == 200
    assert get_dispute(client, dispute)['dispute']['needsAdmin'] is False
    assert client.get('/api/disputes?needsAdmin=false').json['total'] == 1


@pytest.fixture
def open_arbitration(tmp_path):
    settings = mp.Settings(db=str(tmp_path / 'open.db'), rate_limits='off', admin_key=ADMIN_KEY,
                           public_url='http://market.test', open_arbitration=True)
    app = wiring.make_app(settings)
    yield Client(app)
    problems = mp.ledger_problems(app.service.db)
    app.service.close()
    assert problems == []


def test_open_arbitration_activates_arbitrators_at_registration(open_arbitration):
    client = open_arbitration
    market = Market(client)
    account, key = make_account(client, 'judge')
    human = register_arbitrator(client, ADMIN_KEY, accountId=account['id']).json['arbitrator']
    client.app.service.db.execute('UPDATE agents SET reputation = 1000 WHERE id = :id', {'id': market.agent['id']})
    machine = register_arbitrator(client, market.worker_key, agentId=market.agent['id']).json['arbitrator']
    assert [(a['status'], a['trusted']) for a in (human, machine)] == [('active', False), ('active', False)]
    # Active is not trusted: deciding alone still needs an admin's word.
    job, claim, dispute = disputed_job(market)
    assert_error(resolve(client, dispute, 'worker', key=key), 403, 'forbidden')


# The attack that made these rules: a farmed arbitrator deciding alone ---------------

def test_a_farmed_arbitrator_cannot_take_a_strangers_escrow(live_server):
    """One person with two accounts farms 10.00 reputation through ten 0.01 jobs, registers the agent as an
    arbitrator and tries to release a stranger's disputed 300.00 to a third account's worker: refused at
    every step, and the escrow stays locked."""
    server = live_server
    _, farm_key = new_account(server, 'farm-requester')
    agent, agent_key = register_agent(server, 'farmed-agent')
    for _ in range(10):
        job = new_job(server, farm_key, paymentAmount='0.01')
        claim_id = claim_and_deliver(server, job, agent['id'], agent_key)
        answer = post(f'{server.url}/api/jobs/{job["id"]}/verify', {'claimId': claim_id, 'approved': True}, farm_key)
        assert answer.status_code == 200, answer.text
    farmed = requests.get(f'{server.url}/api/agents/{agent["id"]}', timeout=TIMEOUT).json()['agent']
    assert farmed['reputationScore'] == '10.00'
    answer = post(f'{server.url}/api/arbitrators', {'name': 'Fair judge', 'walletAddress': random_wallet(),
                                                    'agentId': agent['id']}, agent_key)
    assert answer.status_code == 201, answer.text
    arbitrator = answer.json()['arbitrator']
    assert (arbitrator['status'], arbitrator['trusted']) == ('pending', False)

    _, victim_key = new_account(server, 'victim')
    accomplice, accomplice_key = register_agent(server, 'accomplice')
    job = new_job(server, victim_key, paymentAmount='300.00')
    claim_id = claim_and_deliver(server, job, accomplice['id'], accomplice_key)
    answer = post(f'{server.url}/api/jobs/{job["id"]}/dispute', {'claimId': claim_id, 'reason': 'Empty files.'},
                  victim_key)
    assert answer.status_code == 201, answer.text
    dispute = answer.json()['dispute']
    assert (dispute['panel'], dispute['needsAdmin']) == ([], True)

    def attempts():
        decide = requests.patch(f'{server.url}/api/disputes/{dispute["id"]}', headers=bearer(agent_key),
                                json={'outcome': 'worker', 'resolution': 'Looks fine.', 'resolvedBy': 'community'},
                                timeout=TIMEOUT)
        voted = post(f'{server.url}/api/disputes/{dispute["id"]}/vote',
                     {'arbitratorId': arbitrator['id'], 'vote': 'worker'}, agent_key)
        return [(a.status_code, a.json()['code']) for a in (decide, voted)]

    assert attempts() == [(403, 'forbidden'), (403, 'not_on_panel')]
    answer = requests.patch(f'{server.url}/api/arbitrators/{arbitrator["id"]}', json={'status': 'active'},
                            headers=bearer(ADMIN_KEY), timeout=TIMEOUT)
    assert (answer.status_code, answer.json()['arbitrator']['status']) == (200, 'active')
    assert attempts() == [(403, 'forbidden'), (403, 'not_on_panel')]      # active, but not trusted, not drawn

    shown = requests.get(f'{server.url}/api/disputes/{dispute["id"]}', timeout=TIMEOUT).json()
    assert (shown['dispute']['status'], shown['dispute']['votesReceived'], shown['dispute']['resolvedBy']) == \
        ('open', 0, None)
    state = get_job(server, job['id'])
    assert (state['job']['status'], state['job']['escrowStatus']) == ('disputed', 'locked')
    assert [c['status'] for c in state['claims']] == ['disputed']
    assert [(p['type'], p['amount']) for p in state['payments']] == [('escrow', '300.00')]


# A dispute is judged on the ties it opened with (CONTRACT.md 20) ----------------------------------------------

def test_a_losing_worker_copying_a_panel_members_wallet_freezes_nothing(market, client, app, monkeypatch):
    """The attack: the worker puts a panel member's public wallet on its agent, so that the member's vote is
    refused as a conflict. The PATCH is refused (wallet_locked), and even a wallet changed behind the API's back
    changes neither who votes nor the outcome: the ties were stored when the dispute opened."""
    (a, a_key), (b, b_key), (c, c_key) = make_arbitrators(client, 3)
    monkeypatch.setattr(mp, 'PANEL_DRAW', ChosenPanels([a, b, c]))
    job, claim, dispute = disputed_job(market)
    stolen = '0x' + a['walletAddress'][2:].upper()
    answer = client.patch(f'/api/agents/{market.agent["id"]}', {'walletAddress': stolen}, key=market.worker_key)
    assert_error(answer, 409, 'wallet_locked')
    assert get_agent(client, market.agent)['agent']['walletAddress'] == market.agent['walletAddress']
    app.service.db.execute('UPDATE agents SET wallet_address = :w WHERE id = :id',
                           {'w': stolen, 'id': market.agent['id']})
    assert vote(client, dispute, a, a_key, 'requester').status == 201
    assert vote(client, dispute, b, b_key, 'requester').status == 201
    last = vote(client, dispute, c, c_key, 'worker')
    assert (last.status, last.json['resolved'], last.json['outcome']) == (201, True, 'requester')
    shown = market.get_job(job)
    assert (shown['job']['status'], shown['job']['escrowStatus']) == ('refunded', 'refunded')
    assert payments_of(shown) == [('escrow', '25.00', 'escrow'), ('refund', '25.00', market.requester['id'])]


def test_a_trusted_arbitrators_decision_stands_whatever_wallet_the_worker_takes_later(market, client, app):
    [(judge, judge_key)] = make_arbitrators(client, 1, prefix='judge', trusted=True)
    job, claim, dispute = disputed_job(market)
    stored = app.service.db.row('''SELECT requester_account, worker_account, worker_wallet, payer_wallet
                                   FROM disputes WHERE id = :id''', {'id': dispute['id']})
    assert stored == {'requester_account': market.requester['id'], 'worker_account': market.worker['id'],
                      'worker_wallet': market.agent['walletAddress'], 'payer_wallet': None}
    app.service.db.execute('UPDATE agents SET wallet_address = :w WHERE id = :id',
                           {'w': judge['walletAddress'], 'id': market.agent['id']})
    answer = resolve(client, dispute, 'requester', key=judge_key)
    assert (answer.status, answer.json['dispute']['resolvedBy'], answer.json['jobStatus']) == \
        (200, 'judge 0', 'refunded'), answer


def test_a_worker_wallet_linked_when_the_dispute_opened_stays_linked(market, client, app):
    """The other way round: a trusted arbitrator holding the worker agent's wallet at opening stays in conflict
    after the agent's wallet changes."""
    owner, key = make_account(client, 'puppet')
    linked = register_arbitrator(client, ADMIN_KEY, accountId=owner['id'],
                                 walletAddress=market.agent['walletAddress']).json['arbitrator']
    set_arbitrator(client, linked, status='active', trusted=True)
    job, claim, dispute = disputed_job(market)
    app.service.db.execute('UPDATE agents SET wallet_address = :w WHERE id = :id',
                           {'w': random_wallet(), 'id': market.agent['id']})
    assert_error(resolve(client, dispute, 'worker', key=key), 403, 'conflict_of_interest')
    app.service.db.execute('UPDATE agents SET wallet_address = :w WHERE id = :id',
                           {'w': market.agent['walletAddress'], 'id': market.agent['id']})
