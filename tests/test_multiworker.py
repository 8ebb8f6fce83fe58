"""Multi-worker jobs (maxWorkers > 1): first-wins, best-wins and all-paid, worker slots, rejections and deadlines.

CONTRACT.md sections 3 (jobs, multi-worker rules), 4 (sweeps and reputation), 7 (the ledger balances in
every mode) and 11 (rejections free a slot; all-paid shares round down; unpaid shares refunded at the deadline).
Every mode is followed from the first claim to the final settlement: every payment record, the escrow
balance, and the ledger check at the steps in between. Time moves only through mp.CLOCK; nothing sleeps.
"""

import pytest

import marketplace as mp
from conftest import ADMIN_KEY, assert_error, auto_verify, expire, in_hours, job_body, make_account, make_agent

FINAL = ('completed', 'rejected', 'refunded', 'expired', 'cancelled')


@pytest.fixture(autouse=True)
def frozen(real_clock):
    """The clock stands still unless a test advances it."""
    real_clock.set(mp.now())
    return real_clock


class Worker:
    """A worker account and its agent, acting on the market's jobs."""

    def __init__(self, market, name):
        self.market = market
        _, self.key = make_account(market.client, name)
        self.agent, _ = make_agent(market.client, self.key, name=name)
        self.wallet = self.agent['walletAddress']

    def try_claim(self, job):
        return self.market.client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': self.agent['id']}, key=self.key)

    def claim(self, job):
        return self.market.claim(job, agent=self.agent, key=self.key)

    def deliver(self, job, claim):
        return self.market.deliver(job, claim, key=self.key)

    def claim_and_deliver(self, job):
        return self.deliver(job, self.claim(job))


@pytest.fixture
def crew(market):
    """Four workers besides the market's own (which this file does not use)."""
    return [Worker(market, name) for name in ('ann', 'bob', 'cyd', 'dan')]


# Helpers ---------------------------------------------------------------------

def verify(market, job, claim, approved):
    answer = market.verify(job, claim, approved)
    assert answer.status == 200, answer
    return answer.json


def payments(detail):
    """A job's payment records as (type, amount, recipient), oldest first."""
    return [(p['type'], p['amount'], p['recipient']) for p in detail['payments']]


def paid(answer):
    """The payments a verify answer reports as (type, amount, recipient)."""
    return [(p['type'], p['amount'], p['recipient']) for p in answer['payments']]


def statuses(detail, *claims):
    by_id = {c['id']: c['status'] for c in detail['claims']}
    return tuple(by_id[c['id']] for c in claims)


def job_state(detail):
    job = detail['job']
    return job['status'], job['escrowStatus'], job['claimCount']


def balance(app, job):
    return mp.escrow_balance(app.service.db, job['id'])


def books_balance(app):
    assert mp.ledger_problems(app.service.db) == []


def history(client, worker):
    """(delta, reason, scoreAfter) of the worker's agent, newest first."""
    answer = client.get(f'/api/agents/{worker.agent["id"]}')
    assert answer.status == 200, answer
    return [(e['delta'], e['reason'], e['scoreAfter']) for e in answer.json['reputationHistory']]


def numbers(client, worker):
    agent = client.get(f'/api/agents/{worker.agent["id"]}').json['agent']
    return agent['reputationScore'], agent['jobsCompleted'], agent['totalEarned'], agent['completionRate']


def assert_refused(answer, code):
    assert answer.status == 409, answer
    assert (answer.json['code'], answer.json['status']) == (code, 409)


# first-wins ------------------------------------------------------------------

def test_first_wins_pays_the_first_approved_delivery_in_full(client, app, market, crew):
    ann, bob, cyd, dan = crew
    job = market.job(paymentAmount='30.00', maxWorkers=3, competitionMode='first-wins')
    assert (job['maxWorkers'], job['competitionMode'], job['escrowStatus']) == (3, 'first-wins', 'locked')
    a = ann.claim(job)
    assert job_state(market.get_job(job)) == ('open', 'locked', 1)
    b = bob.claim(job)
    assert job_state(market.get_job(job)) == ('open', 'locked', 2)
    c = cyd.claim(job)
    assert job_state(market.get_job(job)) == ('claimed', 'locked', 3)
    assert_refused(dan.try_claim(job), 'already_claimed')                 # every slot taken
    assert_refused(ann.try_claim(job), 'already_claimed')                 # ann holds a claim already
    b = bob.deliver(job, b)
    mp.CLOCK.advance(minutes=1)
    a = ann.deliver(job, a)
    assert job_state(market.get_job(job)) == ('delivered', 'locked', 3)
    books_balance(app)
    assert balance(app, job) == 30_000_000

    verdict = verify(market, job, a, True)                # approved first, though delivered second
    assert paid(verdict) == [('release', '30.00', ann.wallet)]
    assert (verdict['escrowStatus'], verdict['claim']['status'], verdict['claim']['autoApproved']) == \
        ('released', 'approved', False)
    detail = market.get_job(job)
    assert job_state(detail) == ('completed', 'released', 0)
    assert statuses(detail, a, b, c) == ('approved', 'superseded', 'superseded')
    assert payments(detail) == [('escrow', '30.00', 'escrow'), ('release', '30.00', ann.wallet)]
    assert balance(app, job) == 0
    books_balance(app)

    assert_refused(market.verify(job, b, True), 'claim_not_delivered')    # a superseded delivery cannot win
    assert_refused(dan.try_claim(job), 'job_not_open')
    assert history(client, ann) == [('1.00', 'delivery approved', '1.00')]
    assert history(client, bob) == history(client, cyd) == []             # superseded: no penalty
    assert numbers(client, ann) == ('1.00', 1, '30.00', 1)
    assert numbers(client, bob) == ('0.00', 0, '0.00', 0)                 # superseded is not a finished claim
    assert payments(market.get_job(job)) == payments(detail)


def test_first_wins_after_a_rejection_another_agent_wins(client, app, market, crew):
    ann, bob, cyd, _ = crew
    job = market.job(paymentAmount='12.00', maxWorkers=2, competitionMode='first-wins')
    a = ann.claim_and_deliver(job)
    b = bob.claim(job)
    verdict = verify(market, job, a, False)
    assert paid(verdict) == []
    assert verdict['escrowStatus'] == 'locked'
    assert job_state(market.get_job(job)) == ('open', 'locked', 1)
    c = cyd.claim_and_deliver(job)
    books_balance(app)
    verdict = verify(market, job, c, True)
    assert paid(verdict) == [('release', '12.00', cyd.wallet)]
    detail = market.get_job(job)
    assert job_state(detail) == ('completed', 'released', 0)
    assert statuses(detail, a, b, c) == ('rejected', 'superseded', 'approved')
    assert payments(detail) == [('escrow', '12.00', 'escrow'), ('release', '12.00', cyd.wallet)]
    assert history(client, ann) == [('-0.25', 'delivery rejected', '0.00')]
    assert balance(app, job) == 0


def test_first_wins_auto_verify_approves_the_earliest_delivery(client, app, market, crew):
    ann, bob, _, _ = crew
    job = market.job(paymentAmount='20.00', maxWorkers=2, competitionMode='first-wins', verificationWindowHours=1)
    b = bob.claim_and_deliver(job)
    mp.CLOCK.advance(minutes=10)
    a = ann.claim_and_deliver(job)
    mp.CLOCK.advance(hours=2)
    assert auto_verify(client) == {'autoApproved': 1, 'claimIds': [b['id']], 'checked': 2}
    detail = market.get_job(job)
    assert job_state(detail) == ('completed', 'released', 0)
    assert statuses(detail, a, b) == ('superseded', 'approved')
    assert [c['autoApproved'] for c in detail['claims'] if c['id'] == b['id']] == [True]
    assert payments(detail) == [('escrow', '20.00', 'escrow'), ('release', '20.00', bob.wallet)]
    assert history(client, bob) == [('1.00', 'delivery approved', '1.00')]
    assert auto_verify(client) == {'autoApproved': 0, 'claimIds': [], 'checked': 0}
    assert balance(app, job) == 0


# best-wins -------------------------------------------------------------------

def test_best_wins_every_slot_delivers_and_the_requester_picks_one(client, app, market, crew):
    ann, bob, cyd, dan = crew
    job = market.job(paymentAmount='45.00', maxWorkers=3, competitionMode='best-wins')
    claims = [w.claim(job) for w in (ann, bob, cyd)]
    assert job_state(market.get_job(job)) == ('claimed', 'locked', 3)
    a = ann.deliver(job, claims[0])
    assert job_state(market.get_job(job)) == ('delivered', 'locked', 3)
    b = bob.deliver(job, claims[1])
    c = cyd.deliver(job, claims[2])
    assert_refused(dan.try_claim(job), 'already_claimed')
    detail = market.get_job(job)
    assert job_state(detail) == ('delivered', 'locked', 3)
    assert statuses(detail, a, b, c) == ('delivered', 'delivered', 'delivered')
    books_balance(app)

    verdict = verify(market, job, b, True)                # the second delivery is the best
    assert paid(verdict) == [('release', '45.00', bob.wallet)]
    detail = market.get_job(job)
    assert job_state(detail) == ('completed', 'released', 0)
    assert statuses(detail, a, b, c) == ('superseded', 'approved', 'superseded')
    assert payments(detail) == [('escrow', '45.00', 'escrow'), ('release', '45.00', bob.wallet)]
    assert balance(app, job) == 0
    books_balance(app)
    for loser in (a, c):
        assert_refused(market.verify(job, loser, True), 'claim_not_delivered')
    assert numbers(client, bob) == ('1.00', 1, '45.00', 1)
    assert numbers(client, ann) == numbers(client, cyd) == ('0.00', 0, '0.00', 0)


# all-paid --------------------------------------------------------------------

def test_all_paid_pays_each_share_and_refunds_the_remainder(client, app, market, crew):
    ann, bob, cyd, dan = crew
    job = market.job(paymentAmount='10.00', maxWorkers=3, competitionMode='all-paid')
    a, b, c = ann.claim(job), bob.claim(job), cyd.claim(job)
    assert job_state(market.get_job(job)) == ('claimed', 'locked', 3)

    a = ann.deliver(job, a)
    verdict = verify(market, job, a, True)
    assert paid(verdict) == [('release', '3.33', ann.wallet)]           # 10.00 / 3, rounded down to the cent
    assert verdict['escrowStatus'] == 'locked'
    detail = market.get_job(job)
    assert job_state(detail) == ('claimed', 'locked', 2)                  # ann's paid claim keeps its slot
    assert statuses(detail, a, b, c) == ('approved', 'claimed', 'claimed')
    assert balance(app, job) == 6_670_000
    books_balance(app)
    assert_refused(ann.try_claim(job), 'already_claimed')
    assert_refused(dan.try_claim(job), 'already_claimed')

    b = bob.deliver(job, b)
    assert paid(verify(market, job, b, True)) == [('release', '3.33', bob.wallet)]
    assert job_state(market.get_job(job)) == ('claimed', 'locked', 1)
    assert balance(app, job) == 3_340_000
    books_balance(app)

    c = cyd.deliver(job, c)
    assert job_state(market.get_job(job)) == ('delivered', 'locked', 1)
    verdict = verify(market, job, c, True)
    assert paid(verdict) == [('release', '3.33', cyd.wallet), ('refund', '0.01', market.requester['id'])]
    assert verdict['escrowStatus'] == 'released'
    detail = market.get_job(job)
    assert job_state(detail) == ('completed', 'released', 0)
    assert statuses(detail, a, b, c) == ('approved', 'approved', 'approved')
    assert payments(detail) == [
        ('escrow', '10.00', 'escrow'),
        ('release', '3.33', ann.wallet),
        ('release', '3.33', bob.wallet),
        ('release', '3.33', cyd.wallet),
        ('refund', '0.01', market.requester['id']),
    ]
    assert balance(app, job) == 0
    books_balance(app)
    assert_refused(dan.try_claim(job), 'job_not_open')
    for worker in (ann, bob, cyd):
        assert numbers(client, worker) == ('1.00', 1, '3.33', 1)


def test_all_paid_even_split_needs_no_refund(client, app, market, crew):
    ann, bob, cyd, _ = crew
    job = market.job(paymentAmount='9.00', maxWorkers=3, competitionMode='all-paid')
    claims = [w.claim_and_deliver(job) for w in (ann, bob, cyd)]
    for claim in claims[:2]:
        verify(market, job, claim, True)
        books_balance(app)
    assert paid(verify(market, job, claims[2], True)) == [('release', '3.00', cyd.wallet)]
    detail = market.get_job(job)
    assert job_state(detail) == ('completed', 'released', 0)
    assert payments(detail) == [('escrow', '9.00', 'escrow'), ('release', '3.00', ann.wallet),
                                ('release', '3.00', bob.wallet), ('release', '3.00', cyd.wallet)]
    assert balance(app, job) == 0


def test_all_paid_approved_agent_cannot_claim_again(client, market, crew):
    ann, _, _, _ = crew
    job = market.job(paymentAmount='10.00', maxWorkers=3, competitionMode='all-paid')
    verify(market, job, ann.claim_and_deliver(job), True)
    assert job_state(market.get_job(job)) == ('open', 'locked', 0)          # two slots still free
    assert_refused(ann.try_claim(job), 'already_claimed')
    assert job_state(market.get_job(job)) == ('open', 'locked', 0)


def test_all_paid_paid_claims_keep_their_slots(client, app, market, crew):
    ann, bob, cyd, dan = crew
    job = market.job(paymentAmount='10.00', maxWorkers=3, competitionMode='all-paid')
    for worker in (ann, bob):
        verify(market, job, worker.claim_and_deliver(job), True)
    assert job_state(market.get_job(job)) == ('open', 'locked', 0)
    assert balance(app, job) == 3_340_000
    c = cyd.claim(job)                                                       # the one slot left
    assert job_state(market.get_job(job)) == ('claimed', 'locked', 1)
    assert_refused(dan.try_claim(job), 'already_claimed')
    verdict = verify(market, job, cyd.deliver(job, c), True)
    assert paid(verdict) == [('release', '3.33', cyd.wallet), ('refund', '0.01', market.requester['id'])]
    assert job_state(market.get_job(job)) == ('completed', 'released', 0)
    assert balance(app, job) == 0


def test_all_paid_partly_paid_at_the_deadline_ends_completed(client, app, market, crew):
    ann, bob, _, _ = crew
    job = market.job(paymentAmount='10.00', maxWorkers=3, competitionMode='all-paid', deadline=in_hours(1))
    a = ann.claim_and_deliver(job)
    b = bob.claim(job)
    verify(market, job, a, True)
    assert job_state(market.get_job(job)) == ('open', 'locked', 1)
    books_balance(app)
    mp.CLOCK.advance(hours=2)
    assert expire(client) == {'expired': 1, 'refunded': 1, 'reputationPenalties': 1, 'jobIds': [job['id']]}
    detail = market.get_job(job)
    assert job_state(detail) == ('completed', 'released', 0)
    assert statuses(detail, a, b) == ('approved', 'expired')
    assert payments(detail) == [('escrow', '10.00', 'escrow'), ('release', '3.33', ann.wallet),
                                ('refund', '6.67', market.requester['id'])]   # two unused shares + 0.01
    assert history(client, bob) == [('-0.50', 'claim expired without delivery', '0.00')]
    assert balance(app, job) == 0
    books_balance(app)
    assert expire(client) == {'expired': 0, 'refunded': 0, 'reputationPenalties': 0, 'jobIds': []}


def test_all_paid_nobody_paid_at_the_deadline_ends_expired(client, app, market, crew):
    ann, bob, _, _ = crew
    job = market.job(paymentAmount='10.00', maxWorkers=3, competitionMode='all-paid', deadline=in_hours(1))
    a, b = ann.claim(job), bob.claim(job)
    mp.CLOCK.advance(hours=2)
    assert expire(client) == {'expired': 1, 'refunded': 1, 'reputationPenalties': 2, 'jobIds': [job['id']]}
    detail = market.get_job(job)
    assert job_state(detail) == ('expired', 'refunded', 0)
    assert statuses(detail, a, b) == ('expired', 'expired')
    assert payments(detail) == [('escrow', '10.00', 'escrow'), ('refund', '10.00', market.requester['id'])]
    assert balance(app, job) == 0


def test_all_paid_auto_verify_pays_each_due_share(client, app, market, crew):
    ann, bob, _, _ = crew
    job = market.job(paymentAmount='10.00', maxWorkers=2, competitionMode='all-paid', verificationWindowHours=1)
    a = ann.claim_and_deliver(job)
    mp.CLOCK.advance(minutes=1)
    b = bob.claim_and_deliver(job)
    mp.CLOCK.advance(hours=2)
    assert auto_verify(client) == {'autoApproved': 2, 'claimIds': [a['id'], b['id']], 'checked': 2}
    detail = market.get_job(job)
    assert job_state(detail) == ('completed', 'released', 0)
    assert statuses(detail, a, b) == ('approved', 'approved')
    assert all(c['autoApproved'] for c in detail['claims'])
    assert payments(detail) == [('escrow', '10.00', 'escrow'), ('release', '5.00', ann.wallet),
                                ('release', '5.00', bob.wallet)]
    assert balance(app, job) == 0


# Rejections free a slot -------------------------------------------------------

@pytest.mark.parametrize('mode', ['first-wins', 'best-wins', 'all-paid'])
def test_a_rejection_frees_its_slot_before_the_deadline(client, app, market, crew, mode):
    ann, bob, cyd, _ = crew
    job = market.job(paymentAmount='8.00', maxWorkers=2, competitionMode=mode)
    a = ann.claim_and_deliver(job)
    b = bob.claim(job)
    assert_refused(cyd.try_claim(job), 'already_claimed')
    verdict = verify(market, job, a, False)
    assert (verdict['claim']['status'], verdict['escrowStatus'], paid(verdict)) == ('rejected', 'locked', [])
    detail = market.get_job(job)
    assert job_state(detail) == ('open', 'locked', 1)
    assert payments(detail) == [('escrow', '8.00', 'escrow')]
    assert balance(app, job) == 8_000_000
    assert history(client, ann) == [('-0.25', 'delivery rejected', '0.00')]
    books_balance(app)

    c = cyd.claim(job)                                                       # the freed slot
    assert job_state(market.get_job(job)) == ('claimed', 'locked', 2)
    b, c = bob.deliver(job, b), cyd.deliver(job, c)
    assert job_state(market.get_job(job)) == ('delivered', 'locked', 2)
    verify(market, job, b, True)
    books_balance(app)
    if mode == 'all-paid':
        verify(market, job, c, True)
        books_balance(app)
    detail = market.get_job(job)
    assert detail['job']['status'] == 'completed'
    assert detail['job']['escrowStatus'] == 'released'
    if mode == 'all-paid':
        assert statuses(detail, a, b, c) == ('rejected', 'approved', 'approved')
        assert payments(detail) == [('escrow', '8.00', 'escrow'), ('release', '4.00', bob.wallet),
                                    ('release', '4.00', cyd.wallet)]
    else:
        # bob's approval wins the whole job; cyd's delivery is superseded
        assert statuses(detail, a, b, c) == ('rejected', 'approved', 'superseded')
        assert payments(detail) == [('escrow', '8.00', 'escrow'), ('release', '8.00', bob.wallet)]
    assert balance(app, job) == 0


def test_a_rejected_slot_is_claimed_again_and_the_rejected_claim_is_not_counted(client, market, crew):
    ann, bob, cyd, _ = crew
    job = market.job(paymentAmount='6.00', maxWorkers=3, competitionMode='first-wins')
    a = ann.claim(job)
    b = bob.claim_and_deliver(job)
    c = cyd.claim_and_deliver(job)
    assert job_state(market.get_job(job)) == ('delivered', 'locked', 3)
    verify(market, job, c, False)
    detail = market.get_job(job)
    assert job_state(detail) == ('delivered', 'locked', 2)                  # bob's delivery still waits
    listed = client.get('/api/jobs?status=delivered').json['jobs']
    assert [(j['id'], j['claimCount']) for j in listed] == [(job['id'], 2)]
    verify(market, job, b, True)
    detail = market.get_job(job)
    assert job_state(detail) == ('completed', 'released', 0)
    assert statuses(detail, a, b, c) == ('superseded', 'approved', 'rejected')
    assert client.get(f'/api/jobs?status=completed').json['jobs'][0]['claimCount'] == 0


@pytest.mark.parametrize('mode', ['first-wins', 'best-wins', 'all-paid'])
def test_a_rejection_after_the_deadline_with_no_active_claim_ends_the_job(client, app, market, crew, mode):
    ann, _, _, _ = crew
    job = market.job(paymentAmount='14.00', maxWorkers=2, competitionMode=mode, deadline=in_hours(1))
    a = ann.claim_and_deliver(job)
    mp.CLOCK.advance(hours=2)
    assert expire(client) == {'expired': 0, 'refunded': 0, 'reputationPenalties': 0, 'jobIds': []}
    assert job_state(market.get_job(job)) == ('delivered', 'locked', 1)
    verdict = verify(market, job, a, False)
    assert paid(verdict) == [('refund', '14.00', market.requester['id'])]
    assert verdict['escrowStatus'] == 'refunded'
    detail = market.get_job(job)
    assert job_state(detail) == ('rejected', 'refunded', 0)
    assert statuses(detail, a) == ('rejected',)
    assert payments(detail) == [('escrow', '14.00', 'escrow'), ('refund', '14.00', market.requester['id'])]
    assert balance(app, job) == 0
    assert expire(client) == {'expired': 0, 'refunded': 0, 'reputationPenalties': 0, 'jobIds': []}


def test_all_paid_rejection_after_the_deadline_with_someone_paid_ends_completed(client, app, market, crew):
    ann, bob, _, _ = crew
    job = market.job(paymentAmount='10.00', maxWorkers=2, competitionMode='all-paid', deadline=in_hours(1))
    a = ann.claim_and_deliver(job)
    b = bob.claim_and_deliver(job)
    verify(market, job, a, True)
    assert job_state(market.get_job(job)) == ('delivered', 'locked', 1)
    mp.CLOCK.advance(hours=2)
    verdict = verify(market, job, b, False)
    assert paid(verdict) == [('refund', '5.00', market.requester['id'])]
    assert verdict['escrowStatus'] == 'released'
    detail = market.get_job(job)
    assert job_state(detail) == ('completed', 'released', 0)
    assert statuses(detail, a, b) == ('approved', 'rejected')
    assert payments(detail) == [('escrow', '10.00', 'escrow'), ('release', '5.00', ann.wallet),
                                ('refund', '5.00', market.requester['id'])]
    assert balance(app, job) == 0
    books_balance(app)


def test_a_rejection_after_the_deadline_waits_for_a_claim_still_active(client, app, market, crew):
    ann, bob, _, _ = crew
    job = market.job(paymentAmount='14.00', maxWorkers=2, competitionMode='first-wins', deadline=in_hours(1))
    a = ann.claim_and_deliver(job)
    b = bob.claim(job)
    mp.CLOCK.advance(hours=2)                                                # no sweep yet: bob's claim is active
    verdict = verify(market, job, a, False)
    assert (paid(verdict), verdict['escrowStatus']) == ([], 'locked')
    detail = market.get_job(job)
    assert detail['job']['status'] not in FINAL
    assert (detail['job']['escrowStatus'], detail['job']['claimCount']) == ('locked', 1)
    assert balance(app, job) == 14_000_000
    books_balance(app)
    assert expire(client) == {'expired': 1, 'refunded': 1, 'reputationPenalties': 1, 'jobIds': [job['id']]}
    detail = market.get_job(job)
    assert job_state(detail) == ('expired', 'refunded', 0)
    assert statuses(detail, a, b) == ('rejected', 'expired')
    assert payments(detail) == [('escrow', '14.00', 'escrow'), ('refund', '14.00', market.requester['id'])]
    assert balance(app, job) == 0


def test_a_dispute_holds_a_multi_worker_job_past_its_deadline(client, app, market, crew):
    ann, bob, _, _ = crew
    job = market.job(paymentAmount='16.00', maxWorkers=2, competitionMode='first-wins', deadline=in_hours(1))
    a = ann.claim_and_deliver(job)
    b = bob.claim(job)
    opened = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': a['id'], 'reason': 'Incomplete.'},
                         key=market.requester_key)
    assert opened.status == 201, opened
    mp.CLOCK.advance(hours=2)
    assert expire(client) == {'expired': 0, 'refunded': 0, 'reputationPenalties': 1, 'jobIds': []}
    detail = market.get_job(job)
    assert job_state(detail) == ('disputed', 'locked', 1)
    assert statuses(detail, a, b) == ('disputed', 'expired')
    decided = client.patch(f'/api/disputes/{opened.json["dispute"]["id"]}',
                           {'outcome': 'requester', 'resolution': 'Not what was asked.'}, key=ADMIN_KEY)
    assert decided.status == 200, decided
    assert (decided.json['jobStatus'], decided.json['escrowStatus']) == ('refunded', 'refunded')
    detail = market.get_job(job)
    assert job_state(detail) == ('refunded', 'refunded', 0)
    assert statuses(detail, a, b) == ('rejected', 'expired')
    assert payments(detail) == [('escrow', '16.00', 'escrow'), ('refund', '16.00', market.requester['id'])]
    assert history(client, ann) == [('-1.00', 'dispute lost', '0.00')]
    assert balance(app, job) == 0
    books_balance(app)


def test_an_all_paid_job_must_pay_at_least_a_cent_per_worker(app, client, market):
    """A share rounded down to 0.00 would pay nothing and still earn reputation: refused at posting."""
    answer = client.post('/api/jobs', job_body(paymentAmount='0.03', maxWorkers=4, competitionMode='all-paid'),
                         key=market.requester_key)
    assert_error(answer, 400, 'validation_failed', fields=['paymentAmount'])
    assert answer.json['fields']['paymentAmount'] == \
        'must be at least 0.01 per worker in all-paid mode (0.04 for 4 workers)'
    assert app.service.db.value('SELECT count(*) FROM jobs') == 0
    kept = market.job(paymentAmount='0.04', maxWorkers=4, competitionMode='all-paid')
    assert kept['paymentAmount'] == '0.04'
    assert market.job(paymentAmount='0.03', maxWorkers=4, competitionMode='best-wins')['maxWorkers'] == 4
