"""GET /api/jobs/match (jobs for an agent) and GET /api/agents/match (agents for a job).

CONTRACT.md sections 1 (lists, errors), 2 (webhookUrl only to its owner) and 11 ("Match");
SPEC.md Jobs and Agents endpoints. The scores are those of marketplace.py's MATCH_JOBS_SQL and
agent_match_score, as docs/api.md documents them.
"""

from datetime import timedelta

import pytest

import marketplace as mp
from conftest import ADMIN_KEY, assert_error, in_hours, make_account, make_agent

JOB_FIELDS = {'id', 'status', 'title', 'description', 'category', 'paymentAmount', 'paymentCurrency',
              'paymentRail', 'requesterId', 'requirements', 'acceptanceCriteria', 'maxWorkers',
              'competitionMode', 'deadline', 'verificationWindowHours', 'claimTimeoutHours', 'minReputation',
              'escrowStatus', 'escrowTxHash', 'escrowDepositId', 'needsAdmin', 'claimCount', 'createdAt', 'updatedAt',
              'url'}
AGENT_FIELDS = {'id', 'accountId', 'name', 'description', 'walletAddress', 'capabilities', 'pricing',
                'reputationScore', 'jobsCompleted', 'totalEarned', 'completionRate', 'stripe', 'createdAt',
                'updatedAt'}


def set_reputation(app, agent, hundredths):
    changed = app.service.db.execute('UPDATE agents SET reputation = :rep WHERE id = :id',
                                     {'rep': hundredths, 'id': agent['id']})
    assert changed == 1


###############################################################################
# GET /api/jobs/match #########################################################
###############################################################################

def job_matches(client, query=''):
    answer = client.get('/api/jobs/match' + (f'?{query}' if query else ''))
    assert answer.status == 200, answer
    body = answer.json
    assert set(body) == {'matches', 'total'}, body
    for job in body['matches']:
        assert set(job) == JOB_FIELDS | {'matchScore'}, job
        assert isinstance(job['matchScore'], float) and 0.0 <= job['matchScore'] <= 1.0, job
    return body


def scored(body):
    """[(title, matchScore)] in the order answered."""
    return [(job['title'], job['matchScore']) for job in body['matches']]


@pytest.fixture
def board(market):
    """Open jobs with languages stated in each way, and jobs that must never match."""
    jobs = {
        'py': market.job(title='py', category='code', paymentAmount='25.00', requirements={'language': 'Python'}),
        'multi': market.job(title='multi', category='data', paymentAmount='30.00',
                            requirements={'languages': ['Go', 'RUST']}),
        'none': market.job(title='none', category='code', paymentAmount='40.00', requirements={'repo': 'x/y'}),
        'js': market.job(title='js', category='code', paymentAmount='50.00',
                         requirements={'language': 'javascript'}),
    }
    # Not open: claimed, and completed. Both pay more than anything above and state no language.
    claimed = market.job(title='claimed', category='code', paymentAmount='90.00')
    market.claim(claimed)
    done, claim = market.delivered_job(title='completed', category='code', paymentAmount='95.00')
    assert market.verify(done, claim, True).status == 200
    cancelled = market.job(title='cancelled', category='code', paymentAmount='99.00')
    assert market.client.post(f'/api/jobs/{cancelled["id"]}/cancel', key=market.requester_key).status == 200
    return jobs


def test_without_filters_every_open_job_matches_fully_by_pay(board, client):
    body = job_matches(client)
    assert scored(body) == [('js', 1.0), ('none', 1.0), ('multi', 1.0), ('py', 1.0)]
    assert body['total'] == 4
    assert {job['status'] for job in body['matches']} == {'open'}
    found = body['matches'][0]
    assert found['id'] == board['js']['id']
    assert {key: value for key, value in found.items() if key != 'matchScore'} == \
        client.get(f'/api/jobs/{board["js"]["id"]}').json['job']


def test_only_jobs_whose_deadline_has_not_passed(market, client):
    soon = market.job(title='soon', deadline=in_hours(1), paymentAmount='80.00')
    later = market.job(title='later', deadline=in_hours(3), paymentAmount='10.00')
    assert [job['id'] for job in job_matches(client)['matches']] == [soon['id'], later['id']]

    mp.CLOCK.set(mp.now() + timedelta(hours=2))      # soon's deadline passed; the expiry sweep has not run
    assert client.get(f'/api/jobs/{soon["id"]}').json['job']['status'] == 'open'
    body = job_matches(client)
    assert [job['id'] for job in body['matches']] == [later['id']]
    assert body['total'] == 1


def test_languages_match_language_and_languages_case_insensitively(board, client):
    python = job_matches(client, 'languages=python')
    assert scored(python) == [('py', 1.0), ('none', 0.85)]
    assert python['total'] == 2

    rust = job_matches(client, 'languages=rust')
    assert scored(rust) == [('multi', 1.0), ('none', 0.85)]

    # Two languages: a job naming either fits fully; ties go to the higher pay.
    either = job_matches(client, 'languages=PYTHON,%20go')
    assert scored(either) == [('multi', 1.0), ('py', 1.0), ('none', 0.85)]
    assert either['total'] == 3

    js = job_matches(client, 'languages=JavaScript')
    assert scored(js) == [('js', 1.0), ('none', 0.85)]


def test_a_job_requiring_another_language_is_no_match(board, client):
    body = job_matches(client, 'languages=haskell')
    assert scored(body) == [('none', 0.85)]
    assert body['total'] == 1


@pytest.mark.parametrize('requirements', [{}, {'repo': 'x/y'}, {'language': None}, {'languages': []}],
                         ids=['empty', 'other-keys', 'language-null', 'languages-empty'])
def test_a_job_stating_no_language_matches_with_a_lower_score(market, client, requirements):
    """No language stated: a match with language fit 0.5 (0.5 + 0.3 × 0.5 + 0.2 = 0.85), as
    /api/agents/match (job_languages) also treats such a job as stating none."""
    job = market.job(title='unstated', requirements=requirements)
    body = job_matches(client, 'languages=python')
    assert [(found['id'], found['matchScore']) for found in body['matches']] == [(job['id'], 0.85)]
    assert body['total'] == 1
    assert scored(job_matches(client)) == [('unstated', 1.0)]


def test_categories_filter(board, client):
    assert scored(job_matches(client, 'categories=data')) == [('multi', 1.0)]
    assert scored(job_matches(client, 'categories=code')) == [('js', 1.0), ('none', 1.0), ('py', 1.0)]
    both = job_matches(client, 'categories=code,data')
    assert [title for title, _ in scored(both)] == ['js', 'none', 'multi', 'py']
    assert both['total'] == 4
    assert job_matches(client, 'categories=design') == {'matches': [], 'total': 0}
    assert scored(job_matches(client, 'categories=code&languages=go')) == [('none', 0.85)]


@pytest.mark.parametrize('categories', ['cooking', 'code,cooking', 'CODE', 'code;data'])
def test_unknown_category_is_400(board, client, categories):
    assert_error(client.get(f'/api/jobs/match?categories={categories}'), 400, 'invalid_parameter')


def test_min_pay_filters_and_scores_pay(board, client):
    # pay fit = min(1, pay / (2 × min_pay)): 30 / 60 = 0.5, 40 / 60, 50 / 60; py (25) is below 30.
    body = job_matches(client, 'min_pay=30')
    assert scored(body) == [('js', 0.9667), ('none', 0.9333), ('multi', 0.9)]
    assert body['total'] == 3

    # language fit 1 and pay fit 25 / 50: 0.5 + 0.3 + 0.1 = 0.9; none: 0.5 + 0.15 + 0.2 × 40 / 50 = 0.81
    assert scored(job_matches(client, 'languages=python&min_pay=25')) == [('py', 0.9), ('none', 0.81)]
    # 25 / 40 = 0.625: 0.5 + 0.3 + 0.125; none: 40 / 40 = 1: 0.85
    assert scored(job_matches(client, 'languages=python&min_pay=20')) == [('py', 0.925), ('none', 0.85)]
    # A decimal min_pay: 10.5 keeps every job and 2 × 10.50 = 21.00 < 25.00, so pay fits fully.
    assert scored(job_matches(client, 'min_pay=10.5')) == [('js', 1.0), ('none', 1.0), ('multi', 1.0),
                                                          ('py', 1.0)]
    assert scored(job_matches(client, 'min_pay=0')) == [('js', 1.0), ('none', 1.0), ('multi', 1.0), ('py', 1.0)]
    assert job_matches(client, 'min_pay=50.01') == {'matches': [], 'total': 0}
    for bad in ('-1', 'abc', 'NaN'):
        assert_error(client.get(f'/api/jobs/match?min_pay={bad}'), 400, 'invalid_parameter')


def test_sorted_best_first_then_higher_pay(market, client):
    market.job(title='none-cheap', paymentAmount='10.00')
    market.job(title='python-cheap', paymentAmount='10.00', requirements={'language': 'python'})
    market.job(title='none-rich', paymentAmount='100.00')
    market.job(title='python-rich', paymentAmount='60.00', requirements={'languages': ['python', 'go']})
    # min_pay 10: pay fit 1 for the rich ones, 10 / 20 = 0.5 for the cheap ones
    body = job_matches(client, 'languages=python&min_pay=10')
    assert scored(body) == [('python-rich', 1.0), ('python-cheap', 0.9), ('none-rich', 0.85),
                            ('none-cheap', 0.75)]
    scores = [job['matchScore'] for job in body['matches']]
    assert scores == sorted(scores, reverse=True)


def test_limit(board, client):
    body = job_matches(client, 'limit=2')
    assert scored(body) == [('js', 1.0), ('none', 1.0)]
    assert body['total'] == 4
    assert len(job_matches(client, 'limit=1000')['matches']) == 4
    for bad in ('0', '-1', 'x'):
        assert_error(client.get(f'/api/jobs/match?limit={bad}'), 400, 'invalid_parameter')


def test_no_open_jobs_is_an_empty_match(client):
    assert job_matches(client) == {'matches': [], 'total': 0}
    assert job_matches(client, 'categories=code&languages=python&min_pay=1') == {'matches': [], 'total': 0}


###############################################################################
# GET /api/agents/match #######################################################
###############################################################################

def agent_matches(client, query, key=None):
    answer = client.get('/api/agents/match?' + query, key=key)
    assert answer.status == 200, answer
    body = answer.json
    assert set(body) == {'matches', 'total', 'limit', 'offset'}, body
    for agent in body['matches']:
        assert set(agent) == AGENT_FIELDS | {'matchScore'}, agent
        assert 'webhookUrl' not in agent
        assert isinstance(agent['matchScore'], float) and 0.0 <= agent['matchScore'] <= 1.0, agent
    return body


def named(body):
    """[(name, matchScore)] in the order answered."""
    return [(agent['name'], agent['matchScore']) for agent in body['matches']]


@pytest.fixture
def crew(app, client, market):
    """Agents of other accounts with known capabilities and reputations, and one of the requester's.

    The market's own worker-agent (code, python, reputation 0.00) is part of the crew as 'worker-agent'.
    """
    _, key = make_account(client, 'crew')
    specs = {
        'A': ({'categories': ['code'], 'languages': ['python']}, {}, 1000),
        'B': ({}, {'minimumJobValue': 30}, 0),
        'C': ({'categories': ['design']}, {}, 5000),
        'D': ({'categories': ['code'], 'languages': ['go']}, {}, 0),
        'E': ({'categories': ['code', 'data'], 'languages': ['Python'], 'maxJobValue': 25},
              {'acceptedCurrencies': ['USD']}, 3000),
        'F': ({'categories': ['code'], 'languages': ['python'], 'maxJobValue': 20}, {}, 9000),
    }
    agents = {'worker-agent': market.agent}
    for name, (capabilities, pricing, reputation) in specs.items():
        agents[name], _ = make_agent(client, key, name=name, capabilities=capabilities, pricing=pricing)
        set_reputation(app, agents[name], reputation)
    own, _ = make_agent(client, market.requester_key, name='own',
                        capabilities={'categories': ['code'], 'languages': ['python']})
    set_reputation(app, own, 100_000)
    agents['own'] = own
    # A webhook URL that must never be shown here (written directly: no delivery is attempted).
    app.service.db.execute("UPDATE agents SET webhook_url = 'https://hooks.example/secret-path'")
    return agents


def test_by_category_and_language(crew, client):
    # fits: category 0.35, language 0.25, reputation 0.20 (weight 0.80)
    body = agent_matches(client, 'category=code&language=python')
    assert named(body) == [
        ('own', 0.9975),            # 1000.00 points: no job_id, so the requester's agents are not special
        ('F', 0.975),               # (0.35 + 0.25 + 0.2 × 90 / 100) / 0.8
        ('E', 0.9375),              # (0.35 + 0.25 + 0.2 × 30 / 40) / 0.8
        ('A', 0.875),               # (0.35 + 0.25 + 0.2 × 0.5) / 0.8
        ('worker-agent', 0.75),     # (0.35 + 0.25) / 0.8
        ('B', 0.375),               # (0.35 × 0.5 + 0.25 × 0.5) / 0.8
    ]
    assert body['total'] == 6       # C lists another category, D another language


def test_by_category_only(crew, client):
    # fits: category 0.35, reputation 0.20 (weight 0.55); languages do not apply
    body = agent_matches(client, 'category=code')
    scores = dict(named(body))
    assert scores == {'own': 0.9964, 'F': 0.9636, 'E': 0.9091, 'A': 0.8182,
                      'worker-agent': 0.6364, 'D': 0.6364, 'B': 0.3182}
    assert [name for name, _ in named(body)][:4] == ['own', 'F', 'E', 'A']
    assert [name for name, _ in named(body)][-1] == 'B'
    assert body['total'] == 7


def test_by_language_only(crew, client):
    # fits: language 0.25, reputation 0.20 (weight 0.45); an agent listing no language fits 0.5
    scores = dict(named(agent_matches(client, 'language=PYTHON')))
    assert scores['A'] == 0.7778        # (0.25 + 0.1) / 0.45
    assert scores['B'] == 0.2778        # 0.125 / 0.45
    assert scores['C'] == 0.6481        # (0.125 + 0.2 × 50 / 60) / 0.45
    assert scores['E'] == 0.8889        # (0.25 + 0.15) / 0.45
    assert 'D' not in scores


def test_by_min_reputation(crew, client):
    body = agent_matches(client, 'min_reputation=30')
    # Only the reputation fit applies: score / (score + 10)
    assert named(body) == [('own', 0.9901), ('F', 0.9), ('C', 0.8333), ('E', 0.75)]
    assert body['total'] == 4
    with_category = agent_matches(client, 'category=code&min_reputation=10.00')
    assert [name for name, _ in named(with_category)] == ['own', 'F', 'E', 'A']
    assert agent_matches(client, 'min_reputation=0')['total'] == 8
    for bad in ('-1', 'abc', 'NaN', '1e9'):
        assert_error(client.get(f'/api/agents/match?min_reputation={bad}'), 400, 'invalid_parameter')


def test_for_a_job(crew, client, market):
    job = market.job(category='code', paymentAmount='25.00', paymentCurrency='USDC',
                     requirements={'language': 'python'})
    body = agent_matches(client, f'job_id={job["id"]}')
    # all five fits: category 0.35, language 0.25, reputation 0.20, value 0.10, currency 0.10
    assert named(body) == [
        ('A', 0.9),                 # 0.35 + 0.25 + 0.1 + 0.1 + 0.1
        ('F', 0.88),                # 25.00 above maxJobValue 20: 0.35 + 0.25 + 0.18 + 0 + 0.1
        ('E', 0.85),                # maxJobValue 25 holds 25.00; USDC not accepted: 0.35 + 0.25 + 0.15 + 0.1
        ('worker-agent', 0.8),      # 0.35 + 0.25 + 0 + 0.1 + 0.1
        ('B', 0.4),                 # below minimumJobValue 30: 0.175 + 0.125 + 0 + 0 + 0.1
    ]
    assert body['total'] == 5
    ids = {agent['id'] for agent in body['matches']}
    assert crew['own']['id'] not in ids           # the requester's own agent is left out
    assert crew['C']['id'] not in ids and crew['D']['id'] not in ids


def test_for_a_job_in_usd_without_a_language(crew, client, market):
    job = market.job(category='code', paymentAmount='25.00', paymentCurrency='USD', requirements={})
    scores = dict(named(agent_matches(client, f'job_id={job["id"]}')))
    # No language asked and none required: category 0.35, reputation 0.20, value 0.10, currency 0.10 (0.75)
    assert scores == {
        'F': 0.84,                  # (0.35 + 0.18 + 0 + 0.1) / 0.75
        'E': 0.9333,                # (0.35 + 0.15 + 0.1 + 0.1) / 0.75: USD accepted
        'A': 0.8667,                # (0.35 + 0.1 + 0.1 + 0.1) / 0.75
        'worker-agent': 0.7333,     # (0.35 + 0.1 + 0.1) / 0.75
        'D': 0.7333,                # go is no obstacle when no language is asked
        'B': 0.3667,                # (0.175 + 0 + 0 + 0.1) / 0.75
    }
    names = [agent['name'] for agent in agent_matches(client, f'job_id={job["id"]}')['matches']]
    assert names[:3] == ['E', 'A', 'F'] and names[-1] == 'B'


def test_for_a_job_with_languages_array(crew, client, market):
    job = market.job(category='data', paymentAmount='25.00', requirements={'languages': ['Rust', 'PYTHON']})
    body = agent_matches(client, f'job_id={job["id"]}')
    # data: E lists it; B lists no category (0.5); every other agent lists other categories
    assert named(body) == [('E', 0.85), ('B', 0.4)]


def test_for_a_job_its_min_reputation_leaves_agents_out(crew, client, market):
    job = market.job(category='code', paymentAmount='25.00', requirements={'language': 'python'},
                     minReputation='30.00')
    body = agent_matches(client, f'job_id={job["id"]}')
    assert named(body) == [('F', 0.88), ('E', 0.85)]
    assert body['total'] == 2
    # min_reputation in the query does not override the job's
    assert named(agent_matches(client, f'job_id={job["id"]}&min_reputation=0')) == [('F', 0.88), ('E', 0.85)]


def test_for_a_job_the_requesters_own_agents_are_left_out(app, client, market):
    job = market.job(category='code', paymentAmount='25.00')
    own, _ = make_agent(client, market.requester_key, name='mine')
    set_reputation(app, own, 50_000)
    by_job = agent_matches(client, f'job_id={job["id"]}')
    assert [agent['name'] for agent in by_job['matches']] == ['worker-agent']
    assert by_job['total'] == 1
    by_category = agent_matches(client, 'category=code')
    assert [agent['name'] for agent in by_category['matches']] == ['mine', 'worker-agent']


def test_uppercase_job_id_is_accepted(crew, client, market):
    job = market.job(category='code', paymentAmount='25.00', requirements={'language': 'python'})
    assert named(agent_matches(client, f'job_id={job["id"].upper()}')) == \
        named(agent_matches(client, f'job_id={job["id"]}'))


def test_unknown_and_malformed_job_id(market, client):
    assert_error(client.get(f'/api/agents/match?job_id={mp.new_id()}'), 404, 'not_found')
    for bad in ('nope', '123', "'%20OR%201=1", mp.new_id()[:-1]):
        assert_error(client.get(f'/api/agents/match?job_id={bad}'), 400, 'invalid_uuid')


@pytest.mark.parametrize('query', ['', 'limit=5', 'job_id=', 'category=&language=&min_reputation=',
                                   'language=%20,%20'])
def test_nothing_to_match_is_400(market, client, query):
    assert_error(client.get('/api/agents/match?' + query), 400, 'missing_query')


def test_unknown_category_is_400_for_agents(market, client):
    assert_error(client.get('/api/agents/match?category=cooking'), 400, 'invalid_parameter')


def test_limit_and_total_for_agents(crew, client):
    body = agent_matches(client, 'category=code&language=python&limit=2')
    assert named(body) == [('own', 0.9975), ('F', 0.975)]
    assert body['total'] == 6


def test_no_webhook_url_even_for_the_owner_or_an_admin(crew, client, market):
    job = market.job(category='code', paymentAmount='25.00')
    for key in (None, market.worker_key, ADMIN_KEY):
        for query in (f'job_id={job["id"]}', 'category=code', 'min_reputation=0'):
            body = agent_matches(client, query, key=key)
            assert body['total'] >= 1
            assert all('webhookUrl' not in agent and 'webhookSecret' not in agent for agent in body['matches'])
            assert 'secret-path' not in str(body)


def test_every_score_is_within_0_and_1(crew, client, market):
    job = market.job(category='code', paymentAmount='1000000.00', paymentCurrency='USD',
                     requirements={'languages': ['python', 'go']})
    queries = [f'job_id={job["id"]}', 'category=code', 'language=go', 'min_reputation=0',
               'category=design&language=rust&min_reputation=0']
    expected = [{'A', 'B', 'D', 'E', 'F', 'worker-agent'}, {'own', 'A', 'B', 'D', 'E', 'F', 'worker-agent'},
                {'B', 'C', 'D'}, set(crew), {'B', 'C'}]
    for query, names in zip(queries, expected):
        body = agent_matches(client, query)
        assert {agent['name'] for agent in body['matches']} == names, query
        assert body['total'] == len(names)
        assert all(0.0 <= agent['matchScore'] <= 1.0 for agent in body['matches'])
        scores = [agent['matchScore'] for agent in body['matches']]
        assert scores == sorted(scores, reverse=True)
