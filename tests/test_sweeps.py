"""The expire and auto-verify sweeps, `run_sweeps`, and the reputation they move.

CONTRACT.md sections 2 (who may sweep), 3 (statuses), 4 (sweeps and reputation), 7 (payments) and 11.
Time moves only through mp.CLOCK (frozen at the start of every test here); nothing sleeps.
"""

import re
from decimal import Decimal

import pytest

import marketplace as mp
from conftest import ADMIN_KEY, assert_error, auto_verify, expire, in_hours, make_account, make_agent

ISO_MS_Z = re.compile(r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$')
NOTHING_EXPIRED = {'expired': 0, 'refunded': 0, 'reputationPenalties': 0, 'jobIds': []}
NOTHING_APPROVED = {'autoApproved': 0, 'claimIds': [], 'checked': 0}
SWEEPS = ('/api/jobs/expire', '/api/jobs/auto-verify')
EXPIRED_REASON = 'claim expired without delivery'


@pytest.fixture(autouse=True)
def frozen(real_clock):
    """Every timestamp of a test is exact: the clock stands still unless a test advances it."""
    real_clock.set(mp.now())
    return real_clock


# Helpers ---------------------------------------------------------------------

def worker(client, name):
    """Another worker: its own account and agent; (agent, key)."""
    _, key = make_account(client, name)
    agent, _ = make_agent(client, key, name=name)
    return agent, key


def approve(market, job, claim):
    answer = market.verify(job, claim, True)
    assert answer.status == 200, answer
    return answer.json


def reject(market, job, claim):
    answer = market.verify(job, claim, False)
    assert answer.status == 200, answer
    return answer.json


def payments(detail):
    """A job's payment records as (type, amount, recipient), oldest first."""
    return [(p['type'], p['amount'], p['recipient']) for p in detail['payments']]


def claim_status(detail, claim):
    (shown,) = [c for c in detail['claims'] if c['id'] == claim['id']]
    return shown['status']


def profile(client, agent):
    answer = client.get(f'/api/agents/{agent["id"]}')
    assert answer.status == 200, answer
    return answer.json


def history(client, agent):
    """The agent's reputation entries, newest first, as (delta, reason, scoreAfter)."""
    return [(e['delta'], e['reason'], e['scoreAfter']) for e in profile(client, agent)['reputationHistory']]


def numbers(client, agent):
    shown = profile(client, agent)['agent']
    return shown['reputationScore'], shown['jobsCompleted'], shown['totalEarned'], shown['completionRate']


def assert_unchanged(after, before):
    """A job's detail document is exactly as it was, its updatedAt included (checked last, to name it)."""
    def without_time(detail):
        return dict(detail, job={k: v for k, v in detail['job'].items() if k != 'updatedAt'})
    assert without_time(after) == without_time(before)
    assert after['job']['updatedAt'] == before['job']['updatedAt'], 'a sweep that changed nothing moved updatedAt'


def dispute(market, job, claim):
    answer = market.client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'Not done.'},
                                key=market.requester_key)
    assert answer.status == 201, answer
    return answer.json['dispute']


def approved_jobs(market, count, amount='10.00', agent=None, key=None):
    """`count` jobs delivered by the agent and approved by the requester."""
    for _ in range(count):
        job = market.job(paymentAmount=amount)
        claim = market.deliver(job, market.claim(job, agent=agent, key=key), key=key)
        approve(market, job, claim)


# Who may sweep, and how -------------------------------------------------------

@pytest.mark.parametrize('path', SWEEPS)
def test_a_sweep_needs_a_key(client, market, path):
    job = market.job(deadline=in_hours(1))
    mp.CLOCK.advance(hours=2)
    answer = client.post(path)
    assert answer.status == 401, answer
    assert answer.json['code'] == 'unauthorized'
    assert answer.json['status'] == 401
    assert 'Bearer' in {k.lower(): v for k, v in answer.headers.items()}['www-authenticate']
    detail = market.get_job(job)
    assert (detail['job']['status'], detail['job']['escrowStatus']) == ('open', 'locked')


@pytest.mark.parametrize('path', SWEEPS)
def test_a_sweep_refuses_a_member_key(client, market, path):
    job, claim = market.delivered_job(deadline=in_hours(1), verificationWindowHours=1)
    mp.CLOCK.advance(hours=2)
    for key in (market.requester_key, market.worker_key):
        answer = client.post(path, key=key)
        assert answer.status == 403, answer
        assert (answer.json['code'], answer.json['status']) == ('forbidden', 403)
    detail = market.get_job(job)
    assert (detail['job']['status'], claim_status(detail, claim)) == ('delivered', 'delivered')
    assert payments(detail) == [('escrow', '25.00', 'escrow')]


@pytest.mark.parametrize('path', SWEEPS)
def test_get_on_a_sweep_is_405_not_a_job_lookup(client, path):
    answer = client.get(path)
    assert answer.status == 405, answer
    assert {k.lower(): v for k, v in answer.headers.items()}['allow'] == 'POST'
    assert (answer.json['code'], answer.json['status']) == ('method_not_allowed', 405)


def test_sweeps_on_an_empty_market_find_nothing(client):
    assert expire(client) == NOTHING_EXPIRED
    assert auto_verify(client) == NOTHING_APPROVED


# Expire ----------------------------------------------------------------------

def test_expire_refunds_an_overdue_open_job(client, app, market):
    job = market.job(paymentAmount='25.00', deadline=in_hours(1))
    mp.CLOCK.advance(hours=1, seconds=1)
    assert expire(client) == {'expired': 1, 'refunded': 1, 'reputationPenalties': 0, 'jobIds': [job['id']]}
    detail = market.get_job(job)
    assert (detail['job']['status'], detail['job']['escrowStatus'], detail['job']['claimCount']) == \
        ('expired', 'refunded', 0)
    assert payments(detail) == [('escrow', '25.00', 'escrow'), ('refund', '25.00', market.requester['id'])]
    refund = detail['payments'][1]
    assert (refund['currency'], refund['rail'], refund['status'], refund['txHash']) == \
        ('USDC', 'base', 'simulated', None)
    assert mp.escrow_balance(app.service.db, job['id']) == 0
    assert mp.ledger_problems(app.service.db) == []


def test_expire_leaves_a_job_until_its_deadline_has_passed(client, market):
    job = market.job(deadline=in_hours(48))
    mp.CLOCK.advance(hours=47, minutes=59)
    assert expire(client) == NOTHING_EXPIRED
    assert market.get_job(job)['job']['status'] == 'open'
    mp.CLOCK.advance(minutes=2)
    assert expire(client) == {'expired': 1, 'refunded': 1, 'reputationPenalties': 0, 'jobIds': [job['id']]}


def test_expire_penalises_a_claim_that_never_delivered(client, app, market):
    approved_jobs(market, 1)                                   # reputation 1.00 to lose from
    job = market.job(paymentAmount='8.00', deadline=in_hours(2))
    claim = market.claim(job)
    mp.CLOCK.advance(hours=3)
    assert expire(client) == {'expired': 1, 'refunded': 1, 'reputationPenalties': 1, 'jobIds': [job['id']]}
    detail = market.get_job(job)
    assert (detail['job']['status'], detail['job']['escrowStatus'], detail['job']['claimCount']) == \
        ('expired', 'refunded', 0)
    assert claim_status(detail, claim) == 'expired'
    assert payments(detail) == [('escrow', '8.00', 'escrow'), ('refund', '8.00', market.requester['id'])]
    newest = profile(client, market.agent)['reputationHistory'][0]
    assert (newest['delta'], newest['reason'], newest['scoreAfter']) == ('-0.50', EXPIRED_REASON, '0.50')
    assert (newest['jobId'], newest['claimId']) == (job['id'], claim['id'])
    assert ISO_MS_Z.match(newest['createdAt'])
    assert profile(client, market.agent)['agent']['reputationScore'] == '0.50'
    assert mp.escrow_balance(app.service.db, job['id']) == 0


def test_expiry_penalty_on_a_new_agent_is_recorded_at_the_floor(client, market):
    job = market.job(deadline=in_hours(1))
    market.claim(job)
    mp.CLOCK.advance(hours=2)
    assert expire(client)['reputationPenalties'] == 1
    assert history(client, market.agent) == [('-0.50', EXPIRED_REASON, '0.00')]
    assert profile(client, market.agent)['agent']['reputationScore'] == '0.00'


def test_expire_leaves_a_delivered_job_to_auto_verify(client, app, market):
    job, claim = market.delivered_job(deadline=in_hours(1), verificationWindowHours=24)
    mp.CLOCK.advance(hours=2)
    before = market.get_job(job)
    assert expire(client) == NOTHING_EXPIRED
    assert_unchanged(market.get_job(job), before)             # left exactly as it was
    assert (before['job']['status'], before['job']['escrowStatus']) == ('delivered', 'locked')
    assert claim_status(before, claim) == 'delivered'
    assert history(client, market.agent) == []
    mp.CLOCK.advance(hours=23)                                # delivered 25 h ago: the window has passed
    assert auto_verify(client) == {'autoApproved': 1, 'claimIds': [claim['id']], 'checked': 1}
    detail = market.get_job(job)
    assert (detail['job']['status'], detail['job']['escrowStatus']) == ('completed', 'released')
    assert payments(detail) == [('escrow', '25.00', 'escrow'), ('release', '25.00', market.agent['walletAddress'])]
    assert expire(client) == NOTHING_EXPIRED
    assert mp.escrow_balance(app.service.db, job['id']) == 0


def test_expire_leaves_a_disputed_job(client, app, market):
    job, claim = market.delivered_job(deadline=in_hours(1))
    dispute(market, job, claim)
    mp.CLOCK.advance(hours=2)
    before = market.get_job(job)
    assert expire(client) == NOTHING_EXPIRED
    assert_unchanged(market.get_job(job), before)
    assert (before['job']['status'], before['job']['escrowStatus']) == ('disputed', 'locked')
    assert claim_status(before, claim) == 'disputed'
    assert mp.escrow_balance(app.service.db, job['id']) == 25_000_000


def test_expire_on_a_waiting_multi_worker_job_expires_only_the_undelivered_claims(client, app, market):
    late, late_key = worker(client, 'late')
    job = market.job(maxWorkers=2, paymentAmount='20.00', deadline=in_hours(1))
    delivered = market.deliver(job, market.claim(job))
    idle = market.claim(job, agent=late, key=late_key)
    mp.CLOCK.advance(hours=2)
    assert expire(client) == {'expired': 0, 'refunded': 0, 'reputationPenalties': 1, 'jobIds': []}
    detail = market.get_job(job)
    assert (detail['job']['status'], detail['job']['escrowStatus'], detail['job']['claimCount']) == \
        ('delivered', 'locked', 1)
    assert (claim_status(detail, delivered), claim_status(detail, idle)) == ('delivered', 'expired')
    assert history(client, late) == [('-0.50', EXPIRED_REASON, '0.00')]
    assert history(client, market.agent) == []
    assert payments(detail) == [('escrow', '20.00', 'escrow')]
    assert mp.ledger_problems(app.service.db) == []


def test_expire_sweeps_many_jobs_at_once_and_only_the_overdue_ones(client, app, market):
    other, other_key = worker(client, 'other')
    unclaimed = market.job(paymentAmount='5.00', deadline=in_hours(1))
    claimed = market.job(paymentAmount='6.00', deadline=in_hours(2))
    first = market.claim(claimed)
    two_claims = market.job(paymentAmount='7.00', maxWorkers=2, deadline=in_hours(3))
    market.claim(two_claims)
    market.claim(two_claims, agent=other, key=other_key)
    not_due = market.job(paymentAmount='9.00', deadline=in_hours(10))
    done, done_claim = market.delivered_job(paymentAmount='4.00', deadline=in_hours(1))
    approve(market, done, done_claim)
    cancelled = market.job(deadline=in_hours(1))
    assert client.post(f'/api/jobs/{cancelled["id"]}/cancel', key=market.requester_key).status == 200
    settled = {job['id']: market.get_job(job) for job in (done, cancelled)}
    mp.CLOCK.advance(hours=4)
    result = expire(client)
    assert set(result) == {'expired', 'refunded', 'reputationPenalties', 'jobIds'}
    assert (result['expired'], result['refunded'], result['reputationPenalties']) == (3, 3, 3)
    assert sorted(result['jobIds']) == sorted([unclaimed['id'], claimed['id'], two_claims['id']])
    for job, amount in ((unclaimed, '5.00'), (claimed, '6.00'), (two_claims, '7.00')):
        detail = market.get_job(job)
        assert (detail['job']['status'], detail['job']['escrowStatus']) == ('expired', 'refunded')
        assert payments(detail) == [('escrow', amount, 'escrow'), ('refund', amount, market.requester['id'])]
        assert {c['status'] for c in detail['claims']} <= {'expired'}
    assert claim_status(market.get_job(claimed), first) == 'expired'
    assert market.get_job(not_due)['job']['status'] == 'open'
    for job in (done, cancelled):
        assert_unchanged(market.get_job(job), settled[job['id']])
    assert history(client, other) == [('-0.50', EXPIRED_REASON, '0.00')]
    assert [d for d, _, _ in history(client, market.agent)] == ['-0.50', '-0.50', '1.00']
    assert mp.ledger_problems(app.service.db) == []


def test_a_second_expire_finds_nothing_and_changes_nothing(client, app, market):
    other, other_key = worker(client, 'other')
    overdue = market.job(deadline=in_hours(1))
    market.claim(overdue)
    waiting, _ = market.delivered_job(deadline=in_hours(1))                  # a delivery waits
    shared = market.job(maxWorkers=2, deadline=in_hours(1))
    market.deliver(shared, market.claim(shared))
    market.claim(shared, agent=other, key=other_key)
    mp.CLOCK.advance(hours=2)
    assert expire(client) == {'expired': 1, 'refunded': 1, 'reputationPenalties': 2, 'jobIds': [overdue['id']]}
    jobs = {job['id']: market.get_job(job) for job in (overdue, waiting, shared)}
    agents = {agent['id']: profile(client, agent) for agent in (market.agent, other)}
    ledger = app.service.db.rows('SELECT * FROM ledger_entries ORDER BY id')
    mp.CLOCK.advance(minutes=5)
    assert expire(client) == NOTHING_EXPIRED
    for job in (overdue, waiting, shared):
        assert_unchanged(market.get_job(job), jobs[job['id']])
    for agent in (market.agent, other):
        assert profile(client, agent) == agents[agent['id']]
    assert app.service.db.rows('SELECT * FROM ledger_entries ORDER BY id') == ledger


# Claim timeouts (CONTRACT.md 18: a claim cannot freeze a job) ------------------

PENALTY = ('-0.50', EXPIRED_REASON, '0.50')     # from 1.00, as approved_jobs(market, 1) leaves it


def release(market, job, claim, key):
    return market.client.post(f'/api/jobs/{job["id"]}/claims/{claim["id"]}/release', key=key)


def test_a_claim_still_claimed_after_its_timeout_expires_at_the_sweep_and_frees_its_slot(client, app, market):
    approved_jobs(market, 1)
    job = market.job(paymentAmount='8.00', claimTimeoutHours=2, deadline=in_hours(48))
    assert job['claimTimeoutHours'] == 2
    claim = market.claim(job)
    mp.CLOCK.advance(hours=1, minutes=59, seconds=59)
    assert expire(client) == NOTHING_EXPIRED
    assert market.get_job(job)['job']['status'] == 'claimed'
    mp.CLOCK.advance(seconds=1)                               # exactly claimTimeoutHours after the claim
    assert expire(client) == {'expired': 0, 'refunded': 0, 'reputationPenalties': 1, 'jobIds': []}
    detail = market.get_job(job)
    assert (detail['job']['status'], detail['job']['escrowStatus'], detail['job']['claimCount']) == \
        ('open', 'locked', 0)
    assert claim_status(detail, claim) == 'expired'
    assert detail['claims'][0]['updatedAt'] == mp.now_iso()
    assert payments(detail) == [('escrow', '8.00', 'escrow')]         # no money moves: the job goes on
    assert history(client, market.agent)[0] == PENALTY
    assert expire(client) == NOTHING_EXPIRED                          # once
    # The slot is free for another agent; the agent that let its claim lapse may not take it again.
    assert_error(client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': market.agent['id']},
                             key=market.worker_key), 409, 'claim_expired')
    other, other_key = worker(client, 'next-worker')
    second = market.claim(job, agent=other, key=other_key)
    approve(market, job, market.deliver(job, second, key=other_key))
    assert market.get_job(job)['job']['status'] == 'completed'
    assert mp.ledger_problems(app.service.db) == []


def test_an_account_that_let_a_claim_expire_cannot_claim_the_job_again_with_another_agent(client, app, market):
    """One account, one squat (CONTRACT.md 20): rotating the account's agents does not freeze the job again,
    whether the claim lapsed at the sweep or the requester released it."""
    job = market.job(claimTimeoutHours=1, deadline=in_hours(48))
    spare, _ = make_agent(client, market.worker_key, name='spare')
    third, _ = make_agent(client, market.worker_key, name='third')
    market.claim(job)
    mp.CLOCK.advance(hours=1)
    assert expire(client)['reputationPenalties'] == 1
    for agent in (market.agent, spare):
        assert_error(client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': agent['id']}, key=market.worker_key),
                     409, 'claim_expired')
    assert market.get_job(job)['job']['claimCount'] == 0
    other, other_key = worker(client, 'honest')
    claim = market.claim(job, agent=other, key=other_key)
    mp.CLOCK.advance(hours=1)
    released = client.post(f'/api/jobs/{job["id"]}/claims/{claim["id"]}/release', key=market.requester_key)
    assert released.status == 200, released
    assert_error(client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': other['id']}, key=other_key),
                 409, 'claim_expired')
    assert_error(client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': third['id']}, key=market.worker_key),
                 409, 'claim_expired')
    newcomer, newcomer_key = worker(client, 'newcomer')       # another account still may
    assert market.claim(job, agent=newcomer, key=newcomer_key)['status'] == 'claimed'
    assert [c['status'] for c in market.get_job(job)['claims']] == ['expired', 'expired', 'claimed']


def test_each_job_has_its_own_claim_timeout_and_a_delivery_in_time_stays(client, market):
    quick = market.job(claimTimeoutHours=1)
    slow = market.job()                                        # the default: 24 hours
    delivered = market.job(claimTimeoutHours=1)
    quick_claim, slow_claim = market.claim(quick), market.claim(slow)
    on_time = market.deliver(delivered, market.claim(delivered))
    mp.CLOCK.advance(hours=23)
    assert expire(client)['reputationPenalties'] == 1
    assert claim_status(market.get_job(quick), quick_claim) == 'expired'
    assert claim_status(market.get_job(slow), slow_claim) == 'claimed'
    assert claim_status(market.get_job(delivered), on_time) == 'delivered'
    mp.CLOCK.advance(hours=1)
    assert expire(client)['reputationPenalties'] == 1
    assert claim_status(market.get_job(slow), slow_claim) == 'expired'


def test_a_timed_out_claim_of_a_multi_worker_job_frees_one_slot(client, market):
    job = market.job(maxWorkers=2, competitionMode='all-paid', claimTimeoutHours=1)
    other, other_key = worker(client, 'other')
    lapsing = market.claim(job)
    mp.CLOCK.advance(minutes=30)
    kept = market.deliver(job, market.claim(job, agent=other, key=other_key), key=other_key)
    mp.CLOCK.advance(minutes=31)
    assert expire(client)['reputationPenalties'] == 1
    detail = market.get_job(job)
    assert [c['status'] for c in detail['claims']] == ['expired', 'delivered']
    assert (detail['job']['status'], detail['job']['claimCount']) == ('delivered', 1)
    assert claim_status(detail, kept) == 'delivered' and claim_status(detail, lapsing) == 'expired'


def test_the_requester_may_release_an_overdue_claim_at_once(client, app, market):
    approved_jobs(market, 1)
    job = market.job(claimTimeoutHours=3)
    claim = market.claim(job)
    mp.CLOCK.advance(hours=2, minutes=59)
    assert_error(release(market, job, claim, market.requester_key), 409, 'claim_not_overdue')
    mp.CLOCK.advance(minutes=1)
    _, stranger_key = make_account(client, 'stranger')
    for key in (stranger_key, market.worker_key):             # a stranger, and the worker itself
        assert_error(release(market, job, claim, key), 403, 'forbidden')
    assert_error(release(market, job, claim, None), 401, 'unauthorized')
    assert claim_status(market.get_job(job), claim) == 'claimed'
    answer = release(market, job, claim, market.requester_key)
    assert answer.status == 200, answer
    assert set(answer.json) == {'claim', 'job'}
    assert (answer.json['claim']['id'], answer.json['claim']['status']) == (claim['id'], 'expired')
    assert (answer.json['job']['status'], answer.json['job']['claimCount']) == ('open', 0)
    assert history(client, market.agent)[0] == PENALTY
    assert_error(release(market, job, claim, market.requester_key), 409, 'claim_not_claimed')
    assert expire(client) == NOTHING_EXPIRED                   # nothing left for the sweep
    assert mp.ledger_problems(app.service.db) == []


def test_an_admin_may_release_and_only_a_claim_still_claimed(client, market):
    job = market.job(claimTimeoutHours=1)
    claim = market.claim(job)
    delivered_job, delivered = market.delivered_job(claimTimeoutHours=1)
    mp.CLOCK.advance(hours=1)
    assert_error(release(market, delivered_job, delivered, ADMIN_KEY), 409, 'claim_not_claimed')
    assert_error(release(market, delivered_job, claim, ADMIN_KEY), 404, 'not_found')   # a claim of another job
    answer = client.post(f'/api/jobs/{job["id"]}/claims/not-a-uuid/release', key=ADMIN_KEY)
    assert_error(answer, 400, 'invalid_uuid')
    answer = release(market, job, claim, ADMIN_KEY)
    assert answer.status == 200, answer
    assert answer.json['claim']['status'] == 'expired'


# Auto-verify -----------------------------------------------------------------

def test_auto_verify_waits_for_the_verification_window(client, market):
    job, claim = market.delivered_job(verificationWindowHours=2)
    mp.CLOCK.advance(hours=1, minutes=59)
    assert auto_verify(client) == {'autoApproved': 0, 'claimIds': [], 'checked': 1}
    detail = market.get_job(job)
    assert (detail['job']['status'], claim_status(detail, claim)) == ('delivered', 'delivered')
    assert payments(detail) == [('escrow', '25.00', 'escrow')]


def test_auto_verify_approves_as_the_requester_would(client, app, market):
    job, claim = market.delivered_job(paymentAmount='12.50', verificationWindowHours=2)
    mp.CLOCK.advance(hours=2, seconds=1)
    assert auto_verify(client) == {'autoApproved': 1, 'claimIds': [claim['id']], 'checked': 1}
    detail = market.get_job(job)
    assert (detail['job']['status'], detail['job']['escrowStatus'], detail['job']['claimCount']) == \
        ('completed', 'released', 0)
    (shown,) = detail['claims']
    assert (shown['status'], shown['autoApproved'], shown['verifiedAt']) == ('approved', True, mp.now_iso())
    assert payments(detail) == [('escrow', '12.50', 'escrow'), ('release', '12.50', market.agent['walletAddress'])]
    entry = profile(client, market.agent)['reputationHistory'][0]
    assert (entry['delta'], entry['reason'], entry['scoreAfter'], entry['jobId'], entry['claimId']) == \
        ('1.00', 'delivery approved', '1.00', job['id'], claim['id'])
    assert numbers(client, market.agent) == ('1.00', 1, '12.50', 1)
    assert mp.escrow_balance(app.service.db, job['id']) == 0


def test_auto_verify_pays_exactly_what_a_requester_approval_pays(client, app, settings, market):
    settings.fee_percent = Decimal('10')               # the app's own settings object: a 10 % operator fee
    by_hand, by_hand_claim = market.delivered_job(paymentAmount='25.00', verificationWindowHours=1)
    by_sweep, by_sweep_claim = market.delivered_job(paymentAmount='25.00', verificationWindowHours=1)
    approve(market, by_hand, by_hand_claim)
    mp.CLOCK.advance(hours=2)
    assert auto_verify(client) == {'autoApproved': 1, 'claimIds': [by_sweep_claim['id']], 'checked': 1}
    wallet = market.agent['walletAddress']
    expected = [('escrow', '25.00', 'escrow'), ('release', '22.50', wallet), ('fee', '2.50', 'operator')]
    hand, sweep = market.get_job(by_hand), market.get_job(by_sweep)
    assert payments(hand) == payments(sweep) == expected
    assert (hand['job']['status'], hand['job']['escrowStatus']) == (sweep['job']['status'], sweep['job']['escrowStatus']) \
        == ('completed', 'released')
    assert (hand['claims'][0]['autoApproved'], sweep['claims'][0]['autoApproved']) == (False, True)
    assert history(client, market.agent) == [('1.00', 'delivery approved', '2.00'), ('1.00', 'delivery approved', '1.00')]
    assert numbers(client, market.agent) == ('2.00', 2, '45.00', 1)
    assert mp.escrow_balance(app.service.db, by_sweep['id']) == 0


def test_auto_verify_checked_counts_deliveries_not_yet_due(client, market):
    soon, soon_claim = market.delivered_job(verificationWindowHours=1)
    later, later_claim = market.delivered_job(verificationWindowHours=10)
    market.claim(market.job())                                    # claimed, not delivered: not examined
    mp.CLOCK.advance(hours=2)
    assert auto_verify(client) == {'autoApproved': 1, 'claimIds': [soon_claim['id']], 'checked': 2}
    assert claim_status(market.get_job(later), later_claim) == 'delivered'
    assert auto_verify(client) == {'autoApproved': 0, 'claimIds': [], 'checked': 1}
    mp.CLOCK.advance(hours=9)
    assert auto_verify(client) == {'autoApproved': 1, 'claimIds': [later_claim['id']], 'checked': 1}
    assert market.get_job(soon)['job']['status'] == market.get_job(later)['job']['status'] == 'completed'


def test_auto_verify_leaves_a_disputed_delivery(client, app, market):
    job, claim = market.delivered_job(verificationWindowHours=1)
    dispute(market, job, claim)
    mp.CLOCK.advance(hours=5)
    assert auto_verify(client) == NOTHING_APPROVED
    detail = market.get_job(job)
    assert (detail['job']['status'], detail['job']['escrowStatus'], claim_status(detail, claim)) == \
        ('disputed', 'locked', 'disputed')
    assert payments(detail) == [('escrow', '25.00', 'escrow')]
    assert history(client, market.agent) == []
    assert mp.escrow_balance(app.service.db, job['id']) == 25_000_000


def test_a_second_auto_verify_finds_nothing_and_changes_nothing(client, app, market):
    job, claim = market.delivered_job(verificationWindowHours=1)
    mp.CLOCK.advance(hours=2)
    assert auto_verify(client)['claimIds'] == [claim['id']]
    before, agent = market.get_job(job), profile(client, market.agent)
    ledger = app.service.db.rows('SELECT * FROM ledger_entries ORDER BY id')
    mp.CLOCK.advance(minutes=5)
    assert auto_verify(client) == NOTHING_APPROVED
    assert_unchanged(market.get_job(job), before)
    assert profile(client, market.agent) == agent
    assert app.service.db.rows('SELECT * FROM ledger_entries ORDER BY id') == ledger


# run_sweeps ------------------------------------------------------------------

def test_run_sweeps_returns_both_results(client, app, settings, market):
    overdue = market.job(paymentAmount='3.00', deadline=in_hours(1))
    claimed = market.job(paymentAmount='4.00', deadline=in_hours(1))
    idle = market.claim(claimed)
    due, due_claim = market.delivered_job(paymentAmount='5.00', verificationWindowHours=1)
    mp.CLOCK.advance(hours=2)
    result = mp.run_sweeps(app.service.db, settings)
    assert list(result) == ['expire', 'autoVerify']
    assert result['expire']['jobIds'] and sorted(result['expire']['jobIds']) == sorted([overdue['id'], claimed['id']])
    assert {k: v for k, v in result['expire'].items() if k != 'jobIds'} == \
        {'expired': 2, 'refunded': 2, 'reputationPenalties': 1}
    assert result['autoVerify'] == {'autoApproved': 1, 'claimIds': [due_claim['id']], 'checked': 1}
    assert claim_status(market.get_job(claimed), idle) == 'expired'
    assert payments(market.get_job(due))[-1] == ('release', '5.00', market.agent['walletAddress'])
    assert mp.run_sweeps(app.service.db, settings) == {'expire': NOTHING_EXPIRED, 'autoVerify': NOTHING_APPROVED}


def test_run_sweeps_expires_before_it_auto_verifies(client, app, settings, market):
    """An all-paid job past its deadline, one delivery due for auto-verify and one claim never delivered.
    Expiry first: the idle claim expires while the delivery still waits (the job is left), then auto-verify
    pays the delivery and, with no active claim left past the deadline, ends the job."""
    idler, idler_key = worker(client, 'idler')
    job = market.job(paymentAmount='10.00', maxWorkers=2, competitionMode='all-paid', deadline=in_hours(1),
                     verificationWindowHours=1)
    delivered = market.deliver(job, market.claim(job))
    idle = market.claim(job, agent=idler, key=idler_key)
    mp.CLOCK.advance(hours=2)
    result = mp.run_sweeps(app.service.db, settings)
    assert result == {'expire': {'expired': 0, 'refunded': 0, 'reputationPenalties': 1, 'jobIds': []},
                      'autoVerify': {'autoApproved': 1, 'claimIds': [delivered['id']], 'checked': 1}}
    detail = market.get_job(job)
    assert (detail['job']['status'], detail['job']['escrowStatus']) == ('completed', 'released')
    assert (claim_status(detail, delivered), claim_status(detail, idle)) == ('approved', 'expired')
    assert payments(detail) == [('escrow', '10.00', 'escrow'), ('release', '5.00', market.agent['walletAddress']),
                                ('refund', '5.00', market.requester['id'])]
    assert mp.escrow_balance(app.service.db, job['id']) == 0


# Reputation and agent numbers --------------------------------------------------

def test_agent_numbers_after_approvals_a_rejection_and_expiries(client, app, market):
    by_hand = market.job(paymentAmount='10.00')
    by_hand_claim = market.deliver(by_hand, market.claim(by_hand))
    approve(market, by_hand, by_hand_claim)                                                 # +1.00 -> 1.00
    auto, auto_claim = market.delivered_job(paymentAmount='5.50', verificationWindowHours=1)
    refused, refused_claim = market.delivered_job(paymentAmount='7.00')
    reject(market, refused, refused_claim)                                                  # -0.25 -> 0.75
    lapsed = [market.job(paymentAmount='2.00', deadline=in_hours(1)) for _ in range(2)]
    lapsed_claims = [market.claim(job) for job in lapsed]
    mp.CLOCK.advance(hours=2)
    assert auto_verify(client)['claimIds'] == [auto_claim['id']]                            # +1.00 -> 1.75
    assert expire(client)['reputationPenalties'] == 2                                       # 2 x -0.50 -> 0.75
    assert history(client, market.agent) == [
        ('-0.50', EXPIRED_REASON, '0.75'),
        ('-0.50', EXPIRED_REASON, '1.25'),
        ('1.00', 'delivery approved', '1.75'),
        ('-0.25', 'delivery rejected', '0.75'),
        ('1.00', 'delivery approved', '1.00'),
    ]
    # completionRate = approved / (approved + rejected + expired) = 2 / 5
    assert numbers(client, market.agent) == ('0.75', 2, '15.50', 0.4)
    statuses = {c['id']: c['status'] for c in profile(client, market.agent)['claims']}
    assert [statuses[c['id']] for c in lapsed_claims] == ['expired', 'expired']
    assert statuses[by_hand_claim['id']] == statuses[auto_claim['id']] == 'approved'
    assert statuses[refused_claim['id']] == 'rejected'
    assert mp.ledger_problems(app.service.db) == []


def test_agent_list_sorts_by_jobs_earnings_and_reputation(client, app, market):
    """worker-agent (market.agent): 3 approved x 1.00, then 3 claims expired: reputation 1.50, 3 jobs, 3.00 earned
    rich: 1 auto-approved job of 100.00: reputation 1.00, 1 job, 100.00 earned
    steady: 2 approved x 10.00 (one by hand, one auto): reputation 2.00, 2 jobs, 20.00 earned
    idle: nothing."""
    rich, rich_key = worker(client, 'rich')
    steady, steady_key = worker(client, 'steady')
    worker(client, 'idle')
    approved_jobs(market, 3, amount='1.00')
    approved_jobs(market, 1, amount='10.00', agent=steady, key=steady_key)
    steady_auto = market.job(paymentAmount='10.00', verificationWindowHours=1)
    market.deliver(steady_auto, market.claim(steady_auto, agent=steady, key=steady_key), key=steady_key)
    rich_job = market.job(paymentAmount='100.00', verificationWindowHours=1)
    market.deliver(rich_job, market.claim(rich_job, agent=rich, key=rich_key), key=rich_key)
    for _ in range(3):
        market.claim(market.job(paymentAmount='1.00', deadline=in_hours(1)))
    mp.CLOCK.advance(hours=2)
    swept = mp.run_sweeps(app.service.db, app.service.settings)
    assert swept['expire']['reputationPenalties'] == 3
    assert (swept['autoVerify']['autoApproved'], swept['autoVerify']['checked']) == (2, 2)
    listed = client.get('/api/agents').json['agents']
    shown = {a['name']: (a['reputationScore'], a['jobsCompleted'], a['totalEarned'], a['completionRate'])
             for a in listed}
    assert shown == {'worker-agent': ('1.50', 3, '3.00', 0.5), 'rich': ('1.00', 1, '100.00', 1),
                     'steady': ('2.00', 2, '20.00', 1), 'idle': ('0.00', 0, '0.00', 0)}

    def order(sort):
        answer = client.get(f'/api/agents?sort={sort}')
        assert answer.status == 200, answer
        return [a['name'] for a in answer.json['agents']]

    assert [a['name'] for a in listed] == order('reputation') == ['steady', 'worker-agent', 'rich', 'idle']
    assert order('jobs') == ['worker-agent', 'steady', 'rich', 'idle']
    assert order('earned') == ['rich', 'steady', 'worker-agent', 'idle']
