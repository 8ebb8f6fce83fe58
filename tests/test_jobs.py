"""The job endpoints: create, list, show, claim, deliver, verify, cancel, and the stats they feed.

CONTRACT.md sections 1 (conventions), 2 (permissions), 3 (jobs), 7 (payments) and 11 (details).
Every error answer is checked for its status, its `code`, and the `error`/`code`/`status` body.
"""

import json
import re
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest

import marketplace as mp
import wiring
from conftest import (ADMIN_KEY, assert_error, Client, get_agent, in_hours, job_body, make_account, make_agent, Market,
                      random_wallet)

ISO_MS_Z = re.compile(r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$')
JOB_FIELDS = {'id', 'status', 'title', 'description', 'category', 'paymentAmount', 'paymentCurrency',
              'paymentRail', 'requesterId', 'requirements', 'acceptanceCriteria', 'maxWorkers',
              'competitionMode', 'deadline', 'verificationWindowHours', 'claimTimeoutHours', 'minReputation',
              'escrowStatus', 'escrowTxHash', 'escrowDepositId', 'claimCount', 'createdAt', 'updatedAt', 'url'}
CLAIM_FIELDS = {'id', 'jobId', 'agentId', 'status', 'deliverable', 'deliveredAt', 'verifiedAt',
                'autoApproved', 'createdAt', 'updatedAt'}
PAYMENT_FIELDS = {'id', 'type', 'amount', 'currency', 'rail', 'status', 'recipient', 'txHash', 'createdAt'}
DELIVERABLE = {'type': 'url', 'url': 'https://example.com/out'}


# Helpers ---------------------------------------------------------------------

def header(answer, name):
    """A response header by its case-insensitive name ('' when absent)."""
    return next((value for key, value in answer.headers.items() if key.lower() == name.lower()), '')


def post_job(client, key, **overrides):
    return client.post('/api/jobs', job_body(**overrides), key=key)


def body_without(name):
    body = job_body()
    del body[name]
    return body


def claim(client, job, key, agent_id=None):
    return client.post(f'/api/jobs/{job["id"]}/claim', None if agent_id is None else {'agentId': agent_id},
                       key=key)


def deliver(client, job, claim_id, key, body=None, path='deliver'):
    return client.post(f'/api/jobs/{job["id"]}/{path}',
                       body if body is not None else {'claimId': claim_id, 'deliverable': DELIVERABLE}, key=key)


def list_jobs(client, query=''):
    answer = client.get('/api/jobs' + query)
    assert answer.status == 200, answer
    return answer.json


def second_worker(client, name='worker-2'):
    """Another account with one agent: (account, key, agent)."""
    account, key = make_account(client, name)
    agent, _ = make_agent(client, key, name=name + '-agent')
    return account, key, agent


def naive_utc(moment):
    return moment.astimezone(timezone.utc).replace(tzinfo=None).isoformat(timespec='seconds')


@pytest.fixture
def fee_market(tmp_path):
    """A market on an app with --fee-percent 2.5; the ledger must balance afterwards."""
    app = wiring.make_app(mp.Settings(db=str(tmp_path / 'fee.db'), rate_limits='off', admin_key=ADMIN_KEY,
                                  fee_percent=Decimal('2.5')))
    yield Market(Client(app))
    problems = mp.ledger_problems(app.service.db)
    app.service.close()
    assert problems == []


# POST /api/jobs ----------------------------------------------------------------

def test_create_job_fills_every_default(market, client):
    answer = client.post('/api/jobs', job_body(), key=market.requester_key)
    assert answer.status == 201, answer
    assert set(answer.json) == {'job'}
    job = answer.json['job']
    assert JOB_FIELDS <= set(job)
    assert re.fullmatch(r'[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}', job['id'])
    assert job['status'] == 'open'
    assert job['title'] == 'Fix the flaky test'
    assert job['description'] == 'It fails one run in ten.'
    assert job['category'] == 'code'
    assert job['paymentAmount'] == '25.00'
    assert job['paymentCurrency'] == 'USDC'
    assert job['paymentRail'] == 'base'
    assert job['requesterId'] == market.requester['id']
    assert job['requirements'] == {}
    assert job['acceptanceCriteria'] == []
    assert job['maxWorkers'] == 1
    assert job['competitionMode'] == 'first-wins'
    assert job['verificationWindowHours'] == 24
    assert job['claimTimeoutHours'] == 24
    assert job['minReputation'] == '0.00'
    assert job['escrowStatus'] == 'locked'
    assert job['escrowTxHash'] is None
    assert job['claimCount'] == 0
    assert job['url'] == f'http://market.test/jobs/{job["id"]}'
    for name in ('deadline', 'createdAt', 'updatedAt'):
        assert ISO_MS_Z.match(job[name]), (name, job[name])


def test_create_job_locks_escrow_with_a_simulated_payment(market, client):
    job = market.job(paymentAmount='25.00')
    shown = market.get_job(job)
    assert shown['job'] == job
    assert shown['claims'] == []
    assert len(shown['payments']) == 1
    payment = shown['payments'][0]
    assert PAYMENT_FIELDS <= set(payment)
    assert payment['type'] == 'escrow'
    assert payment['amount'] == '25.00'
    assert payment['currency'] == 'USDC'
    assert payment['rail'] == 'base'
    assert payment['status'] == 'simulated'
    assert payment['txHash'] is None
    assert ISO_MS_Z.match(payment['createdAt'])


def test_create_usd_job_defaults_to_stripe(market):
    job = market.job(paymentCurrency='USD', paymentAmount='12.5')
    assert job['paymentCurrency'] == 'USD'
    assert job['paymentRail'] == 'stripe'
    assert job['paymentAmount'] == '12.50'
    assert market.get_job(job)['payments'][0]['rail'] == 'stripe'


def test_create_job_keeps_every_given_field(market):
    job = market.job(title='Port the parser', description='From C to Rust.', category='data',
                     paymentAmount='40', paymentCurrency='USDC', paymentRail='base',
                     requirements={'repo': 'https://github.com/x/y', 'language': 'rust'},
                     acceptanceCriteria=[{'type': 'automated', 'check': 'cargo test'}],
                     maxWorkers=3, competitionMode='best-wins', verificationWindowHours=720,
                     claimTimeoutHours=6, minReputation='2.5')
    assert job['title'] == 'Port the parser'
    assert job['description'] == 'From C to Rust.'
    assert job['category'] == 'data'
    assert job['paymentAmount'] == '40.00'
    assert job['requirements'] == {'repo': 'https://github.com/x/y', 'language': 'rust'}
    assert job['acceptanceCriteria'] == [{'type': 'automated', 'check': 'cargo test'}]
    assert job['maxWorkers'] == 3
    assert job['competitionMode'] == 'best-wins'
    assert job['verificationWindowHours'] == 720
    assert job['claimTimeoutHours'] == 6
    assert job['minReputation'] == '2.50'


def test_create_job_accepts_the_limits(market):
    job = market.job(title='t' * 200, description='d' * 20_000, paymentAmount='1000000.00',
                     maxWorkers=100, verificationWindowHours=1, claimTimeoutHours=1)
    assert len(job['title']) == 200
    assert len(job['description']) == 20_000
    assert job['paymentAmount'] == '1000000.00'
    assert job['maxWorkers'] == 100
    assert job['verificationWindowHours'] == 1
    assert job['claimTimeoutHours'] == 1
    smallest = market.job(paymentAmount='0.01', maxWorkers=1, verificationWindowHours=720, claimTimeoutHours=720)
    assert smallest['paymentAmount'] == '0.01'
    assert smallest['claimTimeoutHours'] == 720


def test_create_job_ignores_unknown_fields(market, client):
    answer = post_job(client, market.requester_key, colour='blue', status='completed',
                      escrowStatus='released', id='00000000-0000-4000-8000-000000000000')
    assert answer.status == 201, answer
    job = answer.json['job']
    assert 'colour' not in job
    assert job['status'] == 'open'
    assert job['escrowStatus'] == 'locked'
    assert job['id'] != '00000000-0000-4000-8000-000000000000'


def test_naive_deadline_is_utc(market):
    moment = (datetime.now(timezone.utc) + timedelta(days=3)).replace(microsecond=0)
    job = market.job(deadline=naive_utc(moment))
    assert job['deadline'] == moment.strftime('%Y-%m-%dT%H:%M:%S.000Z')


def test_deadline_with_offset_is_normalised_to_z_with_milliseconds(market):
    job = market.job(deadline='2099-06-01T12:30:00.123456+02:00')
    assert job['deadline'] == '2099-06-01T10:30:00.123Z'
    job = market.job(deadline='2099-06-01T12:30:00-05:00')
    assert job['deadline'] == '2099-06-01T17:30:00.000Z'
    job = market.job(deadline='2099-06-01T12:30:00Z')
    assert job['deadline'] == '2099-06-01T12:30:00.000Z'


@pytest.mark.parametrize('field', ['title', 'description', 'category', 'paymentAmount', 'deadline'])
def test_create_job_requires_field(market, client, field):
    answer = client.post('/api/jobs', body_without(field), key=market.requester_key)
    assert_error(answer, 400, 'validation_failed', fields=[field])


@pytest.mark.parametrize('field', ['title', 'description', 'category', 'paymentAmount', 'deadline'])
def test_create_job_refuses_null_required_field(market, client, field):
    answer = post_job(client, market.requester_key, **{field: None})
    assert_error(answer, 400, 'validation_failed', fields=[field])


def test_create_job_reports_every_bad_field_at_once(market, client):
    body = job_body(paymentAmount='0', maxWorkers=0)
    del body['title']
    answer = client.post('/api/jobs', body, key=market.requester_key)
    assert_error(answer, 400, 'validation_failed', fields=['title', 'paymentAmount', 'maxWorkers'])


@pytest.mark.parametrize('overrides, field', [
    ({'title': 't' * 201}, 'title'),
    ({'title': ''}, 'title'),
    ({'title': '   '}, 'title'),
    ({'description': 'd' * 20_001}, 'description'),
    ({'description': ''}, 'description'),
    ({'paymentAmount': '0'}, 'paymentAmount'),
    ({'paymentAmount': '0.00'}, 'paymentAmount'),
    ({'paymentAmount': 0}, 'paymentAmount'),
    ({'paymentAmount': '-5.00'}, 'paymentAmount'),
    ({'paymentAmount': -5}, 'paymentAmount'),
    ({'paymentAmount': '1000000.01'}, 'paymentAmount'),
    ({'paymentAmount': '2000000'}, 'paymentAmount'),
    ({'paymentAmount': '25.001'}, 'paymentAmount'),
    ({'paymentAmount': '25.000'}, 'paymentAmount'),
    ({'paymentAmount': 25.5}, 'paymentAmount'),
    ({'paymentAmount': 25.0}, 'paymentAmount'),
    ({'paymentAmount': 25}, 'paymentAmount'),           # money in bodies is a string, integers too (CONTRACT 14)
    ({'paymentAmount': True}, 'paymentAmount'),
    ({'paymentAmount': False}, 'paymentAmount'),
    ({'paymentAmount': 'twenty'}, 'paymentAmount'),
    ({'paymentAmount': '1e3'}, 'paymentAmount'),
    ({'paymentAmount': ''}, 'paymentAmount'),
    ({'paymentAmount': {'value': '25.00'}}, 'paymentAmount'),
    ({'deadline': '2020-01-01T00:00:00Z'}, 'deadline'),
    ({'deadline': 'next tuesday'}, 'deadline'),
    ({'deadline': '2099-13-01T00:00:00Z'}, 'deadline'),
    ({'deadline': 1893456000}, 'deadline'),
    ({'category': 'plumbing'}, 'category'),
    ({'category': 'Code'}, 'category'),
    ({'category': 7}, 'category'),
    ({'competitionMode': 'winner-takes-all'}, 'competitionMode'),
    ({'competitionMode': 1}, 'competitionMode'),
    ({'paymentCurrency': 'EUR'}, 'paymentCurrency'),
    ({'paymentCurrency': 1}, 'paymentCurrency'),
    ({'paymentRail': 'lightning'}, 'paymentRail'),
    ({'maxWorkers': 0}, 'maxWorkers'),
    ({'maxWorkers': 101}, 'maxWorkers'),
    ({'maxWorkers': -1}, 'maxWorkers'),
    ({'maxWorkers': '2'}, 'maxWorkers'),
    ({'maxWorkers': 1.5}, 'maxWorkers'),
    ({'maxWorkers': True}, 'maxWorkers'),
    ({'verificationWindowHours': 0}, 'verificationWindowHours'),
    ({'verificationWindowHours': 721}, 'verificationWindowHours'),
    ({'verificationWindowHours': '24'}, 'verificationWindowHours'),
    ({'claimTimeoutHours': 0}, 'claimTimeoutHours'),
    ({'claimTimeoutHours': 721}, 'claimTimeoutHours'),
    ({'claimTimeoutHours': '24'}, 'claimTimeoutHours'),
    ({'claimTimeoutHours': 1.5}, 'claimTimeoutHours'),
    ({'title': 123}, 'title'),
    ({'title': ['a']}, 'title'),
    ({'description': {'text': 'x'}}, 'description'),
    ({'requirements': []}, 'requirements'),
    ({'requirements': 'repo=x'}, 'requirements'),
    ({'acceptanceCriteria': {}}, 'acceptanceCriteria'),
    ({'acceptanceCriteria': ['tests pass']}, 'acceptanceCriteria'),
    ({'acceptanceCriteria': [{'type': 'automated'}]}, 'acceptanceCriteria'),
    ({'minReputation': 'high'}, 'minReputation'),
    ({'minReputation': -1}, 'minReputation'),
    ({'minReputation': True}, 'minReputation'),
])
def test_create_job_validation(market, client, overrides, field):
    answer = post_job(client, market.requester_key, **overrides)
    assert_error(answer, 400, 'validation_failed', fields=[field])


@pytest.mark.parametrize('currency, rail', [('USDC', 'stripe'), ('USD', 'base')])
def test_currency_must_match_its_rail(market, client, currency, rail):
    answer = post_job(client, market.requester_key, paymentCurrency=currency, paymentRail=rail)
    body = assert_error(answer, 400, 'validation_failed')
    assert body['fields'] and set(body['fields']) <= {'paymentRail', 'paymentCurrency'}, body


def test_refused_job_locks_nothing(market, client):
    assert_error(post_job(client, market.requester_key, paymentAmount='25.001'), 400, 'validation_failed',
                 fields=['paymentAmount'])
    assert list_jobs(client)['total'] == 0
    assert client.get('/api/stats').json['totalJobs'] == 0


def test_create_job_needs_a_key(client):
    answer = client.post('/api/jobs', job_body())
    assert_error(answer, 401, 'unauthorized')
    assert header(answer, 'WWW-Authenticate').startswith('Bearer')
    assert_error(client.post('/api/jobs', job_body(), key='mk_not-a-real-key'), 401, 'unauthorized')


def test_create_job_refuses_bad_json(market, client):
    assert_error(client.post('/api/jobs', b'{"title": ', key=market.requester_key), 400, 'invalid_json')
    assert_error(client.post('/api/jobs', [job_body()], key=market.requester_key), 400, 'invalid_json')


def test_member_may_name_itself_as_requester(market, client):
    answer = post_job(client, market.requester_key, requesterId=market.requester['id'].upper())
    assert answer.status == 201, answer
    assert answer.json['job']['requesterId'] == market.requester['id']


def test_member_may_not_post_for_another_account(market, client):
    answer = post_job(client, market.requester_key, requesterId=market.worker['id'])
    assert_error(answer, 403, 'forbidden')
    assert list_jobs(client)['total'] == 0


def test_malformed_requester_id_is_invalid_uuid(market, client):
    answer = post_job(client, market.requester_key, requesterId='not-a-uuid')
    assert_error(answer, 400, 'invalid_uuid', fields=['requesterId'])


def test_admin_posts_on_behalf_of_an_account(market, client):
    answer = post_job(client, ADMIN_KEY, requesterId=market.requester['id'])
    assert answer.status == 201, answer
    job = answer.json['job']
    assert job['requesterId'] == market.requester['id']
    assert job['escrowStatus'] == 'locked'
    # The requester it names may then act on it: cancel it.
    cancelled = client.post(f'/api/jobs/{job["id"]}/cancel', key=market.requester_key)
    assert cancelled.status == 200, cancelled
    assert cancelled.json['job']['status'] == 'cancelled'


def test_admin_posting_for_nobody_gets_404(client):
    """A well-formed id of nothing, in a path or a body, is 404 (CONTRACT section 1)."""
    answer = post_job(client, ADMIN_KEY, requesterId='0b6f3c1e-8d2a-4f5b-9c3d-2e1f0a9b8c7d')
    assert_error(answer, 404, 'not_found')
    assert answer.json['error'] == 'No account has this id (requesterId).'
    assert list_jobs(client)['total'] == 0


def test_admin_job_without_requester_is_the_admins(client):
    answer = post_job(client, ADMIN_KEY)
    assert answer.status == 201, answer
    admin_id = answer.json['job']['requesterId']
    assert re.fullmatch(r'[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}', admin_id)
    # The admin's own job is the admin's to cancel, and nobody else's.
    assert_error(client.post(f'/api/jobs/{answer.json["job"]["id"]}/cancel',
                             key=make_account(client, 'member')[1]), 403, 'forbidden')
    assert client.post(f'/api/jobs/{answer.json["job"]["id"]}/cancel', key=ADMIN_KEY).status == 200


# GET /api/jobs -----------------------------------------------------------------

@pytest.fixture
def four_jobs(market):
    """A 10.00 (72 h), B 30.00 (24 h), C 20.00 (48 h), D 10.50 USD (96 h), created in that order."""
    a = market.job(title='A', category='code', paymentAmount='10.00', deadline=in_hours(72))
    b = market.job(title='B', category='data', paymentAmount='30.00', deadline=in_hours(24))
    c = market.job(title='C', category='code', paymentAmount='20.00', deadline=in_hours(48))
    d = market.job(title='D', category='research', paymentAmount='10.50', paymentCurrency='USD',
                   deadline=in_hours(96))
    return {'A': a, 'B': b, 'C': c, 'D': d}


def titles(answer):
    return [job['title'] for job in answer['jobs']]


def test_list_jobs_defaults(client, four_jobs):
    answer = list_jobs(client)
    assert set(answer) >= {'jobs', 'total', 'limit', 'offset'}
    assert answer['total'] == 4
    assert answer['limit'] == 50
    assert answer['offset'] == 0
    assert titles(answer) == ['D', 'C', 'B', 'A']
    assert answer['jobs'][0] == four_jobs['D']


@pytest.mark.parametrize('sort, expected', [
    ('newest', ['D', 'C', 'B', 'A']),
    ('oldest', ['A', 'B', 'C', 'D']),
    ('pay_desc', ['B', 'C', 'D', 'A']),
    ('pay_asc', ['A', 'D', 'C', 'B']),
    ('deadline', ['B', 'C', 'A', 'D']),
])
def test_list_jobs_sorts(client, four_jobs, sort, expected):
    answer = list_jobs(client, f'?sort={sort}')
    assert titles(answer) == expected
    assert answer['total'] == 4


@pytest.mark.parametrize('sort', ['relevance', 'NEWEST', 'pay', 'random'])
def test_list_jobs_unknown_sort(client, four_jobs, sort):
    assert_error(client.get(f'/api/jobs?sort={sort}'), 400, 'invalid_parameter', fields=['sort'])


def test_list_jobs_filters_by_category(client, four_jobs):
    answer = list_jobs(client, '?category=code')
    assert titles(answer) == ['C', 'A']
    assert answer['total'] == 2
    assert titles(list_jobs(client, '?category=design')) == []
    assert_error(client.get('/api/jobs?category=plumbing'), 400, 'invalid_parameter', fields=['category'])


def test_list_jobs_filters_by_status(market, client, four_jobs):
    market.claim(four_jobs['B'])
    cancelled = client.post(f'/api/jobs/{four_jobs["A"]["id"]}/cancel', key=market.requester_key)
    assert cancelled.status == 200, cancelled
    assert titles(list_jobs(client, '?status=open')) == ['D', 'C']
    claimed = list_jobs(client, '?status=claimed')
    assert titles(claimed) == ['B'] and claimed['total'] == 1
    assert claimed['jobs'][0]['claimCount'] == 1
    assert titles(list_jobs(client, '?status=cancelled')) == ['A']
    assert titles(list_jobs(client, '?status=completed')) == []
    assert_error(client.get('/api/jobs?status=finished'), 400, 'invalid_parameter', fields=['status'])


@pytest.mark.parametrize('min_pay, expected', [
    ('10', ['D', 'C', 'B', 'A']),
    ('10.5', ['D', 'C', 'B']),
    ('10.50', ['D', 'C', 'B']),
    ('10.51', ['C', 'B']),
    ('20', ['C', 'B']),
    ('30.00', ['B']),
    ('30.01', []),
    ('0', ['D', 'C', 'B', 'A']),
])
def test_list_jobs_min_pay(client, four_jobs, min_pay, expected):
    answer = list_jobs(client, f'?min_pay={min_pay}')
    assert titles(answer) == expected
    assert answer['total'] == len(expected)


@pytest.mark.parametrize('min_pay', ['-1', '-0.5', 'ten', 'abc', '1,5', 'NaN', 'Infinity'])
def test_list_jobs_bad_min_pay(client, four_jobs, min_pay):
    assert_error(client.get(f'/api/jobs?min_pay={min_pay}'), 400, 'invalid_parameter', fields=['min_pay'])


def test_list_jobs_combines_filters_and_sort(client, four_jobs):
    answer = list_jobs(client, '?category=code&min_pay=15&sort=pay_asc')
    assert titles(answer) == ['C']
    assert answer['total'] == 1
    answer = list_jobs(client, '?status=open&min_pay=10.5&sort=deadline')
    assert titles(answer) == ['B', 'C', 'D']


def test_list_jobs_paginates(client, four_jobs):
    page = list_jobs(client, '?limit=2&offset=1')
    assert titles(page) == ['C', 'B']
    assert (page['total'], page['limit'], page['offset']) == (4, 2, 1)
    page = list_jobs(client, '?limit=2&offset=2&sort=oldest')
    assert titles(page) == ['C', 'D']
    page = list_jobs(client, '?limit=3&offset=3')
    assert titles(page) == ['A']
    assert page['total'] == 4
    page = list_jobs(client, '?offset=10')
    assert titles(page) == [] and page['total'] == 4 and page['offset'] == 10
    page = list_jobs(client, '?limit=1')
    assert titles(page) == ['D'] and page['limit'] == 1


def test_list_jobs_total_counts_the_filter_not_the_page(client, four_jobs):
    page = list_jobs(client, '?category=code&limit=1')
    assert titles(page) == ['C']
    assert page['total'] == 2


@pytest.mark.parametrize('limit', ['201', '500', '100000'])
def test_list_jobs_clamps_limit(client, four_jobs, limit):
    page = list_jobs(client, f'?limit={limit}')
    assert page['limit'] == 200
    assert len(page['jobs']) == 4


def test_list_jobs_limit_200_is_kept(client, four_jobs):
    assert list_jobs(client, '?limit=200')['limit'] == 200


@pytest.mark.parametrize('query, field', [
    ('limit=0', 'limit'),
    ('limit=-1', 'limit'),
    ('limit=abc', 'limit'),
    ('limit=1.5', 'limit'),
    ('offset=-1', 'offset'),
    ('offset=abc', 'offset'),
    ('offset=0.5', 'offset'),
])
def test_list_jobs_bad_paging(client, four_jobs, query, field):
    assert_error(client.get(f'/api/jobs?{query}'), 400, 'invalid_parameter', fields=[field])


# GET /api/jobs/:id -------------------------------------------------------------

def test_show_job(market, client):
    job = market.job()
    answer = client.get(f'/api/jobs/{job["id"]}')
    assert answer.status == 200, answer
    assert set(answer.json) == {'job', 'claims', 'payments', 'timeline'}
    assert answer.json['job'] == job and job['needsAdmin'] is False
    assert answer.json['claims'] == []
    assert [p['type'] for p in answer.json['payments']] == ['escrow']
    [escrow] = answer.json['payments']
    assert answer.json['timeline'] == [
        {'at': job['createdAt'], 'kind': 'posted', 'text': f'Posted — 25.00 USDC, due {mp.when(job["deadline"])}',
         'reference': None},
        {'at': escrow['createdAt'], 'kind': 'escrow', 'text': 'Escrow locked — 25.00 USDC (simulated)',
         'reference': None}]


def test_the_timeline_tells_a_job_oldest_first_with_its_references(market, client):
    """The job's story is in the API (CONTRACT.md 20): the entries its page shows, a dispute's id as reference."""
    job, claim = market.delivered_job()
    answer = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'Half of it.'},
                         key=market.requester_key)
    assert answer.status == 201, answer
    dispute_id = answer.json['dispute']['id']
    timeline = client.get(f'/api/jobs/{job["id"]}').json['timeline']
    assert [step['kind'] for step in timeline] == ['posted', 'escrow', 'claimed', 'delivered', 'disputed']
    assert [step['at'] for step in timeline] == sorted(step['at'] for step in timeline)
    assert timeline[4] == {'at': timeline[4]['at'], 'kind': 'disputed', 'text': 'Disputed — Half of it.',
                           'reference': dispute_id}
    assert timeline[2]['text'] == f'Claimed — by {market.agent["name"]}' and timeline[2]['reference'] is None
    assert 'timeline' not in client.get('/api/jobs').json['jobs'][0]        # lists pay nothing for it


def test_show_job_with_its_claim(market, client):
    job = market.job()
    made = market.claim(job)
    shown = market.get_job(job)
    assert shown['job']['status'] == 'claimed'
    assert shown['job']['claimCount'] == 1
    assert len(shown['claims']) == 1
    assert shown['claims'][0]['id'] == made['id']
    assert shown['claims'][0]['agentId'] == market.agent['id']
    assert shown['claims'][0]['status'] == 'claimed'


def test_show_job_accepts_uppercase_uuid(market, client):
    job = market.job()
    answer = client.get(f'/api/jobs/{job["id"].upper()}')
    assert answer.status == 200, answer
    assert answer.json['job']['id'] == job['id']
    assert answer.json['job']['id'] == job['id'].lower()
    assert answer.json['job']['url'] == f'http://market.test/jobs/{job["id"]}'


@pytest.mark.parametrize('bad', ['not-a-uuid', '12345', '0b6f3c1e-8d2a-4f5b-9c3d-2e1f0a9b8c7',
                                 '0b6f3c1e8d2a4f5b9c3d2e1f0a9b8c7d0', 'zb6f3c1e-8d2a-4f5b-9c3d-2e1f0a9b8c7d'])
def test_show_job_malformed_id(client, bad):
    assert_error(client.get(f'/api/jobs/{bad}'), 400, 'invalid_uuid')


def test_show_job_unknown_id(client):
    assert_error(client.get('/api/jobs/0b6f3c1e-8d2a-4f5b-9c3d-2e1f0a9b8c7d'), 404, 'not_found')


# Claim -------------------------------------------------------------------------

def test_claim_single_worker_job(market, client):
    job = market.job()
    answer = claim(client, job, market.worker_key, market.agent['id'])
    assert answer.status == 201, answer
    made = answer.json['claim']
    assert CLAIM_FIELDS <= set(made)
    assert made['status'] == 'claimed'
    assert made['jobId'] == job['id']
    assert made['agentId'] == market.agent['id']
    assert made['deliverable'] is None
    assert made['deliveredAt'] is None
    assert made['verifiedAt'] is None
    assert made['autoApproved'] is False
    assert ISO_MS_Z.match(made['createdAt'])
    shown = market.get_job(job)['job']
    assert shown['status'] == 'claimed'
    assert shown['claimCount'] == 1
    assert shown['escrowStatus'] == 'locked'


def test_claim_without_agent_id_uses_the_only_agent(market, client):
    job = market.job()
    answer = claim(client, job, market.worker_key)
    assert answer.status == 201, answer
    assert answer.json['claim']['agentId'] == market.agent['id']
    assert answer.json['claim']['status'] == 'claimed'
    other = market.job()
    answer = client.post(f'/api/jobs/{other["id"]}/claim', {}, key=market.worker_key)
    assert answer.status == 201, answer
    assert answer.json['claim']['agentId'] == market.agent['id']


def test_claim_without_agent_id_and_no_agent(market, client):
    job = market.job()
    _, key = make_account(client, 'agentless')
    assert_error(claim(client, job, key), 400, 'validation_failed', fields=['agentId'])
    assert market.get_job(job)['job']['status'] == 'open'


def test_claim_without_agent_id_and_two_agents(market, client):
    job = market.job()
    make_agent(client, market.worker_key, name='second-agent')
    assert_error(claim(client, job, market.worker_key), 400, 'validation_failed', fields=['agentId'])
    assert market.get_job(job)['claims'] == []


def test_claim_with_malformed_ids(market, client):
    job = market.job()
    assert_error(claim(client, job, market.worker_key, 'agent-1'), 400, 'invalid_uuid', fields=['agentId'])
    assert_error(client.post('/api/jobs/nope/claim', {'agentId': market.agent['id']}, key=market.worker_key),
                 400, 'invalid_uuid')


def test_claim_unknown_job_or_agent(market, client):
    job = market.job()
    unknown = '0b6f3c1e-8d2a-4f5b-9c3d-2e1f0a9b8c7d'
    assert_error(client.post(f'/api/jobs/{unknown}/claim', {'agentId': market.agent['id']},
                             key=market.worker_key), 404, 'not_found')
    assert_error(claim(client, job, market.worker_key, unknown), 404, 'not_found')


def test_claim_same_agent_twice(market, client):
    job = market.job()
    market.claim(job)
    assert_error(claim(client, job, market.worker_key, market.agent['id']), 409, 'already_claimed')
    shown = market.get_job(job)
    assert len(shown['claims']) == 1
    assert shown['job']['claimCount'] == 1


def test_claim_full_single_worker_job(market, client):
    job = market.job()
    market.claim(job)
    _, key, agent = second_worker(client)
    assert_error(claim(client, job, key, agent['id']), 409, 'already_claimed')
    assert len(market.get_job(job)['claims']) == 1


def test_claim_uppercase_agent_id(market, client):
    job = market.job()
    answer = claim(client, job, market.worker_key, market.agent['id'].upper())
    assert answer.status == 201, answer
    assert answer.json['claim']['agentId'] == market.agent['id']


def test_claim_completed_job(market, client):
    job, delivered = market.delivered_job()
    assert market.verify(job, delivered, True).status == 200
    _, key, agent = second_worker(client)
    assert_error(claim(client, job, key, agent['id']), 409, 'job_not_open')


def test_claim_rejected_job(market, client):
    job, delivered = market.delivered_job()
    assert market.verify(job, delivered, False).status == 200
    _, key, agent = second_worker(client)
    assert_error(claim(client, job, key, agent['id']), 409, 'job_not_open')


def test_claim_cancelled_job(market, client):
    job = market.job()
    assert client.post(f'/api/jobs/{job["id"]}/cancel', key=market.requester_key).status == 200
    assert_error(claim(client, job, market.worker_key, market.agent['id']), 409, 'job_not_open')
    assert market.get_job(job)['claims'] == []


def test_claim_with_someone_elses_agent(market, client):
    job = market.job()
    _, key, _ = second_worker(client)
    assert_error(claim(client, job, key, market.agent['id']), 403, 'forbidden')
    assert market.get_job(job)['claims'] == []


def test_claim_below_min_reputation(market, client):
    job = market.job(minReputation='2.00')
    body = assert_error(claim(client, job, market.worker_key, market.agent['id']), 403,
                        'insufficient_reputation')
    assert body['status'] == 403
    assert market.get_job(job)['job']['status'] == 'open'


def test_claim_at_exactly_min_reputation(market, client):
    first, delivered = market.delivered_job()
    assert market.verify(first, delivered, True).status == 200
    assert get_agent(client, market.agent)['agent']['reputationScore'] == '1.00'
    job = market.job(minReputation='1.00')
    answer = claim(client, job, market.worker_key, market.agent['id'])
    assert answer.status == 201, answer
    harder = market.job(minReputation='1.01')
    assert_error(claim(client, harder, market.worker_key, market.agent['id']), 403, 'insufficient_reputation')


def test_claim_own_job(market, client):
    job = market.job()
    own_agent, _ = make_agent(client, market.requester_key, name='self-dealer')
    assert_error(claim(client, job, market.requester_key, own_agent['id']), 403, 'own_job')
    assert market.get_job(job)['claims'] == []


def test_claim_needs_a_key(market, client):
    job = market.job()
    answer = claim(client, job, None, market.agent['id'])
    assert_error(answer, 401, 'unauthorized')
    assert header(answer, 'WWW-Authenticate').startswith('Bearer')
    assert_error(claim(client, job, 'mk_unknown', market.agent['id']), 401, 'unauthorized')
    assert market.get_job(job)['claims'] == []


def test_claim_after_deadline(market, client, real_clock):
    job = market.job(deadline=in_hours(1))
    real_clock.advance(hours=2)
    assert_error(claim(client, job, market.worker_key, market.agent['id']), 409, 'deadline_passed')
    assert market.get_job(job)['claims'] == []


def test_claim_just_before_deadline(market, client):
    job = market.job(deadline=in_hours(1))
    mp.CLOCK.advance(minutes=59)
    answer = claim(client, job, market.worker_key, market.agent['id'])
    assert answer.status == 201, answer


def test_two_workers_on_a_two_worker_job(market, client):
    job = market.job(maxWorkers=2)
    _, key2, agent2 = second_worker(client, 'worker-2')
    _, key3, agent3 = second_worker(client, 'worker-3')
    first = claim(client, job, market.worker_key, market.agent['id'])
    assert first.status == 201, first
    shown = market.get_job(job)['job']
    assert (shown['status'], shown['claimCount']) == ('open', 1)
    second = claim(client, job, key2, agent2['id'])
    assert second.status == 201, second
    shown = market.get_job(job)['job']
    assert (shown['status'], shown['claimCount']) == ('claimed', 2)
    assert_error(claim(client, job, key3, agent3['id']), 409, 'already_claimed')
    assert_error(claim(client, job, market.worker_key, market.agent['id']), 409, 'already_claimed')
    claims = market.get_job(job)['claims']
    assert sorted(c['agentId'] for c in claims) == sorted([market.agent['id'], agent2['id']])


# Deliver -----------------------------------------------------------------------

def test_deliver(market, client):
    job = market.job()
    made = market.claim(job)
    answer = deliver(client, job, made['id'], market.worker_key)
    assert answer.status == 200, answer
    assert set(answer.json) >= {'claim', 'job'}
    delivered = answer.json['claim']
    assert delivered['id'] == made['id']
    assert delivered['status'] == 'delivered'
    assert delivered['deliverable']['type'] == 'url'
    assert delivered['deliverable']['url'] == 'https://example.com/out'
    assert ISO_MS_Z.match(delivered['deliveredAt'])
    assert delivered['verifiedAt'] is None
    assert answer.json['job']['id'] == job['id']
    assert answer.json['job']['status'] == 'delivered'
    assert answer.json['job']['escrowStatus'] == 'locked'
    assert answer.json['job']['claimCount'] == 1
    shown = client.get(f'/api/jobs/{job["id"]}', key=market.requester_key).json
    assert shown['job']['status'] == 'delivered'
    assert shown['claims'][0]['status'] == 'delivered'
    assert shown['claims'][0]['deliverable'] == DELIVERABLE
    assert market.get_job(job)['claims'][0]['deliverable'] == {'type': 'url', 'delivered': True}   # anyone else


@pytest.mark.parametrize('path', ['deliver', 'submit'])
@pytest.mark.parametrize('style', ['standard', 'alias'])
def test_deliver_body_and_path_aliases(market, client, path, style):
    job = market.job()
    made = market.claim(job)
    if style == 'standard':
        body = {'claimId': made['id'],
                'deliverable': {'type': 'pull_request', 'url': 'https://github.com/x/y/pull/1'}}
    else:
        body = {'claimId': made['id'], 'deliveryUrl': 'https://github.com/x/y/pull/1',
                'deliveryNotes': 'Ready for review', 'artifactType': 'pull_request'}
    answer = deliver(client, job, made['id'], market.worker_key, body=body, path=path)
    assert answer.status == 200, answer
    delivered = answer.json['claim']
    assert delivered['status'] == 'delivered'
    assert delivered['deliverable']['type'] == 'pull_request'
    assert delivered['deliverable']['url'] == 'https://github.com/x/y/pull/1'
    if style == 'alias':
        assert 'Ready for review' in delivered['deliverable'].values()
    assert ISO_MS_Z.match(delivered['deliveredAt'])
    assert answer.json['job']['status'] == 'delivered'


def test_deliver_twice(market, client):
    job = market.job()
    made = market.claim(job)
    market.deliver(job, made)
    assert_error(deliver(client, job, made['id'], market.worker_key), 409, 'already_delivered')
    assert_error(deliver(client, job, made['id'], market.worker_key, path='submit'), 409, 'already_delivered')


def test_deliver_after_approval(market, client):
    job, delivered = market.delivered_job()
    assert market.verify(job, delivered, True).status == 200
    assert_error(deliver(client, job, delivered['id'], market.worker_key), 409, 'already_delivered')


def test_deliver_by_non_owner(market, client):
    job = market.job()
    made = market.claim(job)
    _, key, _ = second_worker(client)
    assert_error(deliver(client, job, made['id'], key), 403, 'forbidden')
    assert_error(deliver(client, job, made['id'], market.requester_key), 403, 'forbidden')
    assert market.get_job(job)['claims'][0]['status'] == 'claimed'


def test_deliver_needs_a_key(market, client):
    job = market.job()
    made = market.claim(job)
    assert_error(deliver(client, job, made['id'], None), 401, 'unauthorized')


def test_deliver_claim_of_another_job(market, client):
    job = market.job()
    other = market.job()
    other_claim = market.claim(other)
    assert_error(deliver(client, job, other_claim['id'], market.worker_key), 404, 'not_found')
    assert market.get_job(other)['claims'][0]['status'] == 'claimed'


def test_deliver_unknown_claim(market, client):
    job = market.job()
    market.claim(job)
    assert_error(deliver(client, job, '0b6f3c1e-8d2a-4f5b-9c3d-2e1f0a9b8c7d', market.worker_key),
                 404, 'not_found')


@pytest.mark.parametrize('deliverable', [
    {'type': 'url'},
    {'type': 'url', 'url': ''},
    {'type': 'url', 'url': 'ftp://example.com/out.zip'},
    {'type': 'url', 'url': 'javascript:alert(1)'},
    {'type': 'url', 'url': 'example.com/out'},
    {'type': 'url', 'url': 42},
])
def test_deliver_bad_url(market, client, deliverable):
    job = market.job()
    made = market.claim(job)
    answer = deliver(client, job, made['id'], market.worker_key,
                     body={'claimId': made['id'], 'deliverable': deliverable})
    body = assert_error(answer, 400, 'validation_failed')
    assert any('url' in name.lower() for name in body['fields']), body
    assert market.get_job(job)['claims'][0]['status'] == 'claimed'


@pytest.mark.parametrize('url', [None, 'ftp://example.com/x', 'not a url'])
def test_deliver_alias_bad_url(market, client, url):
    job = market.job()
    made = market.claim(job)
    body = {'claimId': made['id'], 'deliveryNotes': 'done', 'artifactType': 'file'}
    if url is not None:
        body['deliveryUrl'] = url
    answer = deliver(client, job, made['id'], market.worker_key, body=body, path='submit')
    error = assert_error(answer, 400, 'validation_failed')
    assert any('url' in name.lower() or name == 'deliverable' for name in error['fields']), error


def test_deliver_without_deliverable_or_claim_id(market, client):
    job = market.job()
    made = market.claim(job)
    body = assert_error(deliver(client, job, made['id'], market.worker_key, body={'claimId': made['id']}),
                        400, 'validation_failed')
    assert 'deliverable' in body['fields'], body
    assert set(body['fields']) <= {'deliverable', 'deliverable.url'}, body
    answer = deliver(client, job, made['id'], market.worker_key, body={'deliverable': DELIVERABLE})
    assert_error(answer, 400, 'validation_failed', fields=['claimId'])
    answer = deliver(client, job, made['id'], market.worker_key,
                     body={'claimId': 'claim-1', 'deliverable': DELIVERABLE})
    assert_error(answer, 400, 'invalid_uuid', fields=['claimId'])


def test_deliver_after_deadline(market, client):
    job = market.job(deadline=in_hours(1))
    made = market.claim(job)
    mp.CLOCK.advance(hours=2)
    assert_error(deliver(client, job, made['id'], market.worker_key), 409, 'deadline_passed')


# Verify ------------------------------------------------------------------------

def test_approve_releases_the_escrow_to_the_worker(market, client):
    job, delivered = market.delivered_job(paymentAmount='25.00')
    answer = market.verify(job, delivered, True)
    assert answer.status == 200, answer
    assert set(answer.json) >= {'job', 'claim', 'escrowStatus', 'payments'}
    assert answer.json['claim']['status'] == 'approved'
    assert ISO_MS_Z.match(answer.json['claim']['verifiedAt'])
    assert answer.json['claim']['autoApproved'] is False
    assert answer.json['job']['status'] == 'completed'
    assert answer.json['job']['escrowStatus'] == 'released'
    assert answer.json['job']['claimCount'] == 0
    assert answer.json['escrowStatus'] == 'released'
    payments = answer.json['payments']
    assert len(payments) == 1
    assert payments[0]['type'] == 'release'
    assert payments[0]['amount'] == '25.00'
    assert payments[0]['currency'] == 'USDC'
    assert payments[0]['rail'] == 'base'
    assert payments[0]['recipient'] == market.agent['walletAddress']
    assert payments[0]['txHash'] is None
    shown = market.get_job(job)
    assert [(p['type'], p['amount']) for p in shown['payments']] == [('escrow', '25.00'), ('release', '25.00')]
    assert shown['payments'][1] == payments[0]
    assert shown['job']['status'] == 'completed'
    assert shown['claims'][0]['status'] == 'approved'


def test_approve_usd_job(market):
    job, delivered = market.delivered_job(paymentAmount='7.25', paymentCurrency='USD')
    answer = market.verify(job, delivered, True)
    assert answer.status == 200, answer
    assert [(p['type'], p['amount'], p['currency'], p['rail']) for p in answer.json['payments']] == \
        [('release', '7.25', 'USD', 'stripe')]


def test_reject_refunds_the_escrow(market, client):
    job, delivered = market.delivered_job(paymentAmount='25.00')
    answer = client.post(f'/api/jobs/{job["id"]}/verify',
                         {'claimId': delivered['id'], 'approved': False, 'reason': 'The tests still fail.'},
                         key=market.requester_key)
    assert answer.status == 200, answer
    assert answer.json['claim']['status'] == 'rejected'
    assert ISO_MS_Z.match(answer.json['claim']['verifiedAt'])
    assert answer.json['job']['status'] == 'rejected'
    assert answer.json['job']['escrowStatus'] == 'refunded'
    assert answer.json['escrowStatus'] == 'refunded'
    payments = answer.json['payments']
    assert [(p['type'], p['amount'], p['currency']) for p in payments] == [('refund', '25.00', 'USDC')]
    assert payments[0]['txHash'] is None
    shown = market.get_job(job)
    assert [p['type'] for p in shown['payments']] == ['escrow', 'refund']
    assert shown['job']['status'] == 'rejected'


def test_verify_a_claim_not_yet_delivered(market, client):
    job = market.job()
    made = market.claim(job)
    for approved in (True, False):
        assert_error(market.verify(job, made, approved), 409, 'claim_not_delivered')
    shown = market.get_job(job)
    assert shown['job']['status'] == 'claimed'
    assert [p['type'] for p in shown['payments']] == ['escrow']


@pytest.mark.parametrize('first, second', [(True, True), (True, False), (False, True), (False, False)])
def test_verify_twice(market, first, second):
    job, delivered = market.delivered_job()
    assert market.verify(job, delivered, first).status == 200
    assert_error(market.verify(job, delivered, second), 409, 'claim_not_delivered')
    shown = market.get_job(job)
    assert len(shown['payments']) == 2
    assert shown['job']['status'] == ('completed' if first else 'rejected')


def test_worker_may_not_verify(market, client):
    job, delivered = market.delivered_job()
    assert_error(market.verify(job, delivered, True, key=market.worker_key), 403, 'forbidden')
    _, stranger_key = make_account(client, 'stranger')
    assert_error(market.verify(job, delivered, False, key=stranger_key), 403, 'forbidden')
    shown = market.get_job(job)
    assert shown['job']['status'] == 'delivered'
    assert shown['job']['escrowStatus'] == 'locked'


def test_verify_needs_a_key(market, client):
    job, delivered = market.delivered_job()
    answer = client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': delivered['id'], 'approved': True})
    assert_error(answer, 401, 'unauthorized')


def test_admin_may_verify(market):
    job, delivered = market.delivered_job(paymentAmount='3.00')
    answer = market.verify(job, delivered, True, key=ADMIN_KEY)
    assert answer.status == 200, answer
    assert answer.json['job']['status'] == 'completed'
    assert [(p['type'], p['amount']) for p in answer.json['payments']] == [('release', '3.00')]


@pytest.mark.parametrize('approved', ['yes', 'true', 1, 0, None, [], {}])
def test_approved_must_be_a_boolean(market, client, approved):
    job, delivered = market.delivered_job()
    answer = client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': delivered['id'], 'approved': approved},
                         key=market.requester_key)
    assert_error(answer, 400, 'validation_failed', fields=['approved'])
    assert market.get_job(job)['job']['status'] == 'delivered'


def test_verify_without_claim_id(market, client):
    job, delivered = market.delivered_job()
    answer = client.post(f'/api/jobs/{job["id"]}/verify', {'approved': True}, key=market.requester_key)
    assert_error(answer, 400, 'validation_failed', fields=['claimId'])
    answer = client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': 'x', 'approved': True},
                         key=market.requester_key)
    assert_error(answer, 400, 'invalid_uuid', fields=['claimId'])


def test_verify_claim_of_another_job(market, client):
    job, _ = market.delivered_job()
    other, other_claim = market.delivered_job()
    answer = client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': other_claim['id'], 'approved': True},
                         key=market.requester_key)
    assert_error(answer, 404, 'not_found')
    assert market.get_job(other)['job']['status'] == 'delivered'


def assert_one_reputation_entry(client, market, job, claim, delta, score):
    shown = get_agent(client, market.agent)
    assert shown['agent']['reputationScore'] == score
    [entry] = shown['reputationHistory']
    assert isinstance(entry['reason'], str) and entry['reason']
    assert ISO_MS_Z.match(entry['createdAt'])
    assert (entry['delta'], entry['jobId'], entry['claimId'], entry['scoreAfter']) == (delta, job['id'], claim['id'], score)


def test_approval_gives_reputation(market, client):
    job, delivered = market.delivered_job()
    assert market.verify(job, delivered, True).status == 200
    assert_one_reputation_entry(client, market, job, delivered, '1.00', '1.00')


def test_rejection_on_a_zero_agent_is_recorded_at_the_floor(market, client):
    job, delivered = market.delivered_job()
    assert market.verify(job, delivered, False).status == 200
    assert_one_reputation_entry(client, market, job, delivered, '-0.25', '0.00')


def test_agent_record_after_approvals_and_a_rejection(market, client):
    before = get_agent(client, market.agent)['agent']
    assert (before['jobsCompleted'], before['totalEarned'], before['completionRate']) == (0, '0.00', 0)
    for amount in ('10.00', '15.00'):
        job, delivered = market.delivered_job(paymentAmount=amount)
        assert market.verify(job, delivered, True).status == 200
    job, delivered = market.delivered_job(paymentAmount='5.00')
    assert market.verify(job, delivered, False).status == 200
    shown = get_agent(client, market.agent)
    agent = shown['agent']
    assert agent['jobsCompleted'] == 2
    assert agent['totalEarned'] == '25.00'
    assert agent['completionRate'] == pytest.approx(2 / 3, abs=1e-3)
    assert agent['reputationScore'] == '1.75'
    assert [(e['delta'], e['scoreAfter']) for e in shown['reputationHistory']] == \
        [('-0.25', '1.75'), ('1.00', '2.00'), ('1.00', '1.00')]


def test_release_with_fee(fee_market):
    market = fee_market
    job, delivered = market.delivered_job(paymentAmount='100.00')
    answer = market.verify(job, delivered, True)
    assert answer.status == 200, answer
    assert answer.json['escrowStatus'] == 'released'
    payments = {p['type']: p for p in answer.json['payments']}
    assert sorted(payments) == ['fee', 'release']
    assert payments['release']['amount'] == '97.50'
    assert payments['release']['recipient'] == market.agent['walletAddress']
    assert payments['fee']['amount'] == '2.50'
    shown = market.get_job(job)
    assert sorted((p['type'], p['amount']) for p in shown['payments']) == \
        [('escrow', '100.00'), ('fee', '2.50'), ('release', '97.50')]
    agent = market.client.get(f'/api/agents/{market.agent["id"]}').json['agent']
    assert agent['totalEarned'] == '97.50'
    assert market.client.get('/api/stats').json['totalUSDC'] == '97.50'


def test_reject_with_fee_takes_no_fee(fee_market):
    market = fee_market
    job, delivered = market.delivered_job(paymentAmount='100.00')
    answer = market.verify(job, delivered, False)
    assert answer.status == 200, answer
    assert [(p['type'], p['amount']) for p in answer.json['payments']] == [('refund', '100.00')]


@pytest.mark.parametrize('currency', ['USDC', 'USD'])
@pytest.mark.parametrize('amount, release, fee', [
    ('0.10', '0.10', '0.00'),    # 2.5 % of 0.10 is 0.0025: no whole cent of fee
    ('0.50', '0.49', '0.01'),    # 0.0125 -> 0.01
    ('1.00', '0.98', '0.02'),    # 0.025 -> 0.02
    ('10.10', '9.85', '0.25'),   # 0.2525 -> 0.25
])
def test_fee_rounds_to_the_cent(fee_market, currency, amount, release, fee):
    """The payment records of a release add up to the job's price, in two-place amounts."""
    market = fee_market
    job, delivered = market.delivered_job(paymentAmount=amount, paymentCurrency=currency)
    answer = market.verify(job, delivered, True)
    assert answer.status == 200, answer
    by_type = {}
    for payment in answer.json['payments']:
        by_type.setdefault(payment['type'], []).append(payment['amount'])
    assert by_type.get('release') == [release], answer.json['payments']
    fees = by_type.get('fee', [])
    assert sum(Decimal(f) for f in fees) == Decimal(fee), answer.json['payments']
    if fee == '0.00':
        assert fees in ([], ['0.00'])
    else:
        assert fees == [fee]
    assert Decimal(release) + Decimal(fee) == Decimal(amount)


# Cancel ------------------------------------------------------------------------

def test_cancel_refunds_the_escrow(market, client):
    job = market.job(paymentAmount='25.00')
    answer = client.post(f'/api/jobs/{job["id"]}/cancel', key=market.requester_key)
    assert answer.status == 200, answer
    assert set(answer.json) >= {'job'}
    assert answer.json['job']['status'] == 'cancelled'
    assert answer.json['job']['escrowStatus'] == 'refunded'
    shown = market.get_job(job)
    assert [(p['type'], p['amount']) for p in shown['payments']] == [('escrow', '25.00'), ('refund', '25.00')]
    assert shown['payments'][1]['txHash'] is None
    assert shown['job']['status'] == 'cancelled'


def test_cancel_with_an_active_claim(market, client):
    job = market.job()
    market.claim(job)
    assert_error(client.post(f'/api/jobs/{job["id"]}/cancel', key=market.requester_key), 409, 'job_not_open')
    shown = market.get_job(job)
    assert shown['job']['status'] == 'claimed'
    assert shown['job']['escrowStatus'] == 'locked'
    assert [p['type'] for p in shown['payments']] == ['escrow']


def test_cancel_with_an_active_claim_on_an_open_multi_worker_job(market, client):
    job = market.job(maxWorkers=3)
    market.claim(job)
    assert market.get_job(job)['job']['status'] == 'open'
    assert_error(client.post(f'/api/jobs/{job["id"]}/cancel', key=market.requester_key), 409, 'job_not_open')


def test_cancel_with_a_delivery(market, client):
    job, _ = market.delivered_job()
    assert_error(client.post(f'/api/jobs/{job["id"]}/cancel', key=market.requester_key), 409, 'job_not_open')


@pytest.mark.parametrize('approved', [True, False])
def test_cancel_a_finished_job(market, client, approved):
    job, delivered = market.delivered_job()
    assert market.verify(job, delivered, approved).status == 200
    assert_error(client.post(f'/api/jobs/{job["id"]}/cancel', key=market.requester_key), 409, 'job_not_open')
    assert len(market.get_job(job)['payments']) == 2


def test_cancel_twice(market, client):
    job = market.job()
    assert client.post(f'/api/jobs/{job["id"]}/cancel', key=market.requester_key).status == 200
    assert_error(client.post(f'/api/jobs/{job["id"]}/cancel', key=market.requester_key), 409, 'job_not_open')
    assert [p['type'] for p in market.get_job(job)['payments']] == ['escrow', 'refund']


def test_cancel_by_someone_else(market, client):
    job = market.job()
    assert_error(client.post(f'/api/jobs/{job["id"]}/cancel', key=market.worker_key), 403, 'forbidden')
    assert_error(client.post(f'/api/jobs/{job["id"]}/cancel'), 401, 'unauthorized')
    shown = market.get_job(job)
    assert shown['job']['status'] == 'open'
    assert shown['job']['escrowStatus'] == 'locked'


def test_admin_may_cancel(market, client):
    job = market.job(paymentAmount='8.00')
    answer = client.post(f'/api/jobs/{job["id"]}/cancel', key=ADMIN_KEY)
    assert answer.status == 200, answer
    assert answer.json['job']['status'] == 'cancelled'
    assert answer.json['job']['escrowStatus'] == 'refunded'
    assert [(p['type'], p['amount']) for p in market.get_job(job)['payments']] == \
        [('escrow', '8.00'), ('refund', '8.00')]


def test_cancel_unknown_or_malformed_job(market, client):
    assert_error(client.post('/api/jobs/0b6f3c1e-8d2a-4f5b-9c3d-2e1f0a9b8c7d/cancel', key=market.requester_key),
                 404, 'not_found')
    assert_error(client.post('/api/jobs/job-1/cancel', key=market.requester_key), 400, 'invalid_uuid')


# GET /api/stats ----------------------------------------------------------------

def test_stats_on_an_empty_market(client):
    answer = client.get('/api/stats')
    assert answer.status == 200, answer
    stats = answer.json
    assert (stats['totalJobs'], stats['openJobs'], stats['completedJobs']) == (0, 0, 0)
    assert (stats['totalUSDC'], stats['totalUSD']) == ('0.00', '0.00')
    assert stats['totalAgents'] == 0


def test_stats_after_a_small_scenario(market, client):
    paid_usdc, c1 = market.delivered_job(paymentAmount='12.50')
    assert market.verify(paid_usdc, c1, True).status == 200
    paid_usdc2, c2 = market.delivered_job(paymentAmount='7.25')
    assert market.verify(paid_usdc2, c2, True).status == 200
    paid_usd, c3 = market.delivered_job(paymentAmount='4.00', paymentCurrency='USD')
    assert market.verify(paid_usd, c3, True).status == 200
    rejected, c4 = market.delivered_job(paymentAmount='99.00')
    assert market.verify(rejected, c4, False).status == 200
    cancelled = market.job(paymentAmount='50.00')
    assert client.post(f'/api/jobs/{cancelled["id"]}/cancel', key=market.requester_key).status == 200
    market.claim(market.job(paymentAmount='3.00'))                 # claimed
    market.job(paymentAmount='1.00')                               # open
    market.job(paymentAmount='2.00', paymentCurrency='USD')        # open
    second_worker(client)                                          # a second agent
    stats = client.get('/api/stats').json
    assert stats['totalJobs'] == 8
    assert stats['openJobs'] == 2
    assert stats['completedJobs'] == 3
    assert stats['totalUSDC'] == '19.75'
    assert stats['totalUSD'] == '4.00'
    assert stats['totalAgents'] == 2


def test_claiming_a_delivered_single_worker_job_is_job_not_open(client, market):
    job, _ = market.delivered_job()
    other, _ = make_agent(client, market.worker_key, name='second')
    answer = client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': other['id']}, key=market.worker_key)
    assert answer.status == 409
    assert answer.json['code'] == 'job_not_open'


def test_the_requesters_reason_is_kept_on_the_claim(market, client):
    job, delivered = market.delivered_job()
    answer = client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': delivered['id'], 'approved': False,
                                                          'reason': 'Misses half the releases.'},
                         key=market.requester_key)
    assert answer.json['claim']['verificationReason'] == 'Misses half the releases.'
    assert market.get_job(job)['claims'][0]['verificationReason'] == 'Misses half the releases.'
    approved_job, approved = market.delivered_job()
    assert market.verify(approved_job, approved, True).json['claim']['verificationReason'] is None


def test_job_lists_rendered_by_sqlite_equal_job_json(client, market, app):
    """Job lists are rendered to JSON by SQLite (JOB_JSON_SQL) and single jobs by job_json: the same fields
    and values, for every kind of job — odd text, nested requirements, both currencies, claims, each status."""
    odd = 'Ünïcode "quotes" \\ back\\slash <tag> & 🎉\ttab\nnewline \u2028 \x7f'
    market.job(title=odd, description=odd, requirements={'language': 'python', 'nested': {'list': [1, 2.5, None,
                                                                                                     True, odd]}},
               acceptanceCriteria=[{'type': 'test', 'check': odd}], minReputation='12.34')
    market.job(paymentCurrency='USD', paymentAmount='0.01', maxWorkers=3, competitionMode='best-wins')
    claimed = market.job(paymentAmount='999999.99')
    market.claim(claimed)
    done, claim = market.delivered_job()
    market.verify(done, claim, True)
    cancelled = market.job()
    assert client.post(f'/api/jobs/{cancelled["id"]}/cancel', {}, key=market.requester_key).status == 200
    db, base = app.service.db, 'http://market.test'
    seqs, total = mp.find_jobs(db, limit=200)
    assert total == 5
    rendered = [json.loads(text) for text in mp.jobs_in_order(db, seqs, base)]
    expected = [mp.job_json(row, base) for row in mp.jobs_in_order(db, seqs)]
    assert rendered == expected
    assert [list(job) for job in rendered] == [list(job) for job in expected]      # the same order of fields
    assert {job['status'] for job in rendered} == {'open', 'claimed', 'completed', 'cancelled'}
    assert rendered[-1]['title'] == odd and rendered[-1]['minReputation'] == '12.34'
    assert client.get('/api/jobs?limit=200').json['jobs'] == expected
    # GET /api/jobs/:id is rendered by SQLite too (JOB_DETAIL_SQL): the job, its claims and its payments
    rejected, claim = market.delivered_job(paymentCurrency='USD', paymentAmount='12.34')
    market.verify(rejected, claim, False)
    auto, claim = market.delivered_job(verificationWindowHours=1)
    mp.CLOCK.set(mp.now() + timedelta(hours=2))
    try:
        assert client.post('/api/jobs/auto-verify', {}, key=ADMIN_KEY).json['autoApproved'] == 1
    finally:
        mp.CLOCK.set(None)
    # ... as each reader sees it: deliverables whole for the requester, the worker and admins, else redacted
    readers = {None: None, market.requester_key: market.requester, market.worker_key: market.worker,
               ADMIN_KEY: mp.account_for_key(db, ADMIN_KEY)}
    for row in db.rows('SELECT id FROM jobs'):
        for key, account in readers.items():
            answer = client.get(f'/api/jobs/{row["id"]}', key=key)
            detail = mp.job_detail(db, row['id'], base, account)
            assert answer.status == 200 and answer.json == detail
            assert [list(claim) for claim in answer.json['claims']] == [list(claim) for claim in detail['claims']]
    shown = client.get(f'/api/jobs/{auto["id"]}').json
    assert shown['claims'][0]['autoApproved'] is True
    assert shown['claims'][0]['deliverable'] == {'type': 'url', 'delivered': True}
    shown = client.get(f'/api/jobs/{auto["id"]}', key=market.worker_key).json
    assert shown['claims'][0]['deliverable'] == {'type': 'url', 'url': 'https://example.com/out'}
    assert [p['type'] for p in shown['payments']] == ['escrow', 'release']
    assert [p['amount'] for p in client.get(f'/api/jobs/{rejected["id"]}').json['payments']] == ['12.34', '12.34']


# Deliverables are private until paid (CONTRACT.md 18) ----------------------------------------------------

SECRET_URL = 'https://files.example.com/work.zip'
SECRET_NOTES = 'The archive password is hunter2.'
REDACTED = {'type': 'archive', 'delivered': True}


def test_a_deliverable_is_shown_only_to_the_requester_the_worker_admins_and_the_panel(market, client, app):
    """A competing worker, a stranger and anonymous readers see {type, delivered: true} in every answer that
    carries the claim, on the pages, in the feed and in the webhooks; the requester, the worker, an admin and
    the owner of a panel arbitrator see the url and the notes."""
    db = app.service.db
    job = market.job(maxWorkers=2, competitionMode='best-wins')
    _, rival_key, rival = second_worker(client, 'rival')
    client.patch(f'/api/agents/{rival["id"]}', {'webhookUrl': 'https://hooks.example.com/rival'}, key=rival_key)
    market.claim(job, agent=rival, key=rival_key)
    made = market.claim(job)
    answer = deliver(client, job, made['id'], market.worker_key, body={'claimId': made['id'], 'deliverable': {
        'type': 'archive', 'url': SECRET_URL, 'notes': SECRET_NOTES}})
    whole = {'type': 'archive', 'url': SECRET_URL, 'notes': SECRET_NOTES}
    assert answer.json['claim']['deliverable'] == whole                      # the worker's own answer
    dispute = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': made['id'], 'reason': 'Half done.'},
                          key=market.requester_key).json['dispute']
    panelist, panelist_key = make_account(client, 'panelist')
    outsider, outsider_key = make_account(client, 'outsider arbiter')
    for account in (panelist, outsider):
        arbitrator = client.post('/api/arbitrators', {'name': account['name'], 'walletAddress': random_wallet(),
                                                      'accountId': account['id']}, key=ADMIN_KEY).json['arbitrator']
        if account is panelist:     # drawn for the panel (the dispute engineer's code fills dispute_panels)
            db.execute('INSERT INTO dispute_panels (dispute_id, arbitrator_id) VALUES (:d, :a)',
                       {'d': dispute['id'], 'a': arbitrator['id']})
    _, stranger_key = make_account(client, 'stranger')

    def shown(key):
        """The deliverable in GET /api/jobs/:id, /api/agents/:id and /api/disputes/:id for this key."""
        detail = client.get(f'/api/jobs/{job["id"]}', key=key).json
        (in_job,) = [c['deliverable'] for c in detail['claims'] if c['id'] == made['id']]
        (rival_claim,) = [c['deliverable'] for c in detail['claims'] if c['id'] != made['id']]
        assert rival_claim is None                                          # not delivered: null for everyone
        (in_agent,) = get_agent_as(client, market.agent, key)['claims']
        in_dispute = client.get(f'/api/disputes/{dispute["id"]}', key=key).json['claim']
        assert in_job == in_agent['deliverable'] == in_dispute['deliverable']
        return in_job

    for key in (market.requester_key, market.worker_key, ADMIN_KEY, panelist_key):
        assert shown(key) == whole, key
    for key in (None, rival_key, stranger_key, outsider_key):
        assert shown(key) == REDACTED, key
    for path in (f'/jobs/{job["id"]}', f'/agents/{market.agent["id"]}', f'/disputes/{dispute["id"]}',
                 '/api/jobs/feed', '/api/jobs/feed?format=atom'):
        page = client.get(path)
        assert page.status == 200
        text = page.body.decode() if isinstance(page.body, bytes) else str(page.body)
        assert SECRET_URL not in text and 'hunter2' not in text, path
    assert 'Delivered (archive), private' in client.get(f'/jobs/{job["id"]}').body.decode()
    payloads = [row['payload'] for row in db.rows('SELECT payload FROM webhook_deliveries WHERE agent_id = :a',
                                                  {'a': rival['id']})]
    assert {json.loads(p)['type'] for p in payloads} == {'job.claimed', 'job.delivered', 'payment.disputed'}
    assert not any(SECRET_URL in p or 'hunter2' in p for p in payloads)
    # Paid, it stays the requester's: the rival still sees no url.
    client.patch(f'/api/disputes/{dispute["id"]}', {'outcome': 'worker', 'resolution': 'Done.'}, key=ADMIN_KEY)
    assert shown(rival_key) == REDACTED
    assert shown(market.requester_key) == whole


def get_agent_as(client, agent, key):
    answer = client.get(f'/api/agents/{agent["id"]}', key=key)
    assert answer.status == 200, answer
    return answer.json


def test_a_deliverable_is_private_on_the_real_server(live_server):
    """The same over HTTP: an anonymous reader and a competing worker get no url; the requester does."""
    import requests

    def post(path, body, key=None):
        answer = requests.post(live_server.url + path, json=body, timeout=10,
                               headers={'Authorization': f'Bearer {key}'} if key else {})
        assert answer.status_code in (200, 201), answer.text
        return answer.json()

    requester_key = post('/api/accounts', {'name': 'requester'})['apiKey']
    agent_body = {'name': 'agent', 'walletAddress': random_wallet()}
    worker = post('/api/agents/register', agent_body)
    rival = post('/api/agents/register', agent_body)
    job = post('/api/jobs', job_body(maxWorkers=2, competitionMode='best-wins'), requester_key)['job']
    claim = post(f'/api/jobs/{job["id"]}/claim', {}, worker['apiKey'])['claim']
    post(f'/api/jobs/{job["id"]}/claim', {}, rival['apiKey'])
    post(f'/api/jobs/{job["id"]}/deliver', {'claimId': claim['id'], 'deliverable': {
        'type': 'archive', 'url': SECRET_URL, 'notes': SECRET_NOTES}}, worker['apiKey'])

    def deliverable(key=None):
        answer = requests.get(f'{live_server.url}/api/jobs/{job["id"]}', timeout=10,
                              headers={'Authorization': f'Bearer {key}'} if key else {})
        assert answer.status_code == 200, answer.text
        assert (SECRET_URL in answer.text) == (key == requester_key)
        return next(c['deliverable'] for c in answer.json()['claims'] if c['id'] == claim['id'])

    assert deliverable() == REDACTED
    assert deliverable(rival['apiKey']) == REDACTED
    assert deliverable(requester_key) == {'type': 'archive', 'url': SECRET_URL, 'notes': SECRET_NOTES}
    page = requests.get(f'{live_server.url}/jobs/{job["id"]}', timeout=10)
    assert page.status_code == 200 and SECRET_URL not in page.text and 'hunter2' not in page.text
