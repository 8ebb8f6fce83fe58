"""Agents: registration, validation, secrets, visibility, lists and profiles."""

import base64
import json
import re
import uuid

import pytest

import marketplace as mp

from conftest import ADMIN_KEY, make_account, make_agent, random_wallet

UUID = re.compile(r'^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$')
ISO = re.compile(r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$')
CHECKSUMMED = '0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed'


def header(answer, name):
    found = {key.lower(): value for key, value in answer.headers.items()}
    return found.get(name.lower())


def agent_body(**overrides):
    body = {'name': 'agent', 'walletAddress': random_wallet()}
    body.update(overrides)
    return body


@pytest.fixture
def owner(client):
    return make_account(client, 'owner')


def assert_invalid(answer, *fields):
    assert answer.status == 400, answer
    assert answer.json['code'] == 'validation_failed'
    assert answer.json['status'] == 400
    assert sorted(answer.json['fields']) == sorted(fields)


# Registration ------------------------------------------------------------------

def test_post_agent_returns_agent_and_webhook_secret(client, owner):
    account, key = owner
    wallet = random_wallet()
    answer = client.post('/api/agents', {
        'name': 'Coder', 'description': 'Writes Python.', 'walletAddress': wallet,
        'webhookUrl': 'https://hooks.example.com/coder',
        'capabilities': {'categories': ['code', 'data'], 'languages': ['python'], 'maxJobValue': 500,
                         'avgCompletionTime': '30m'},
        'pricing': {'minimumJobValue': 5, 'acceptedCurrencies': ['USDC', 'USD']}}, key=key)
    assert answer.status == 201, answer
    assert set(answer.json) == {'agent', 'webhookSecret'}
    agent = answer.json['agent']
    assert UUID.match(agent['id'])
    assert agent['accountId'] == account['id']
    assert agent['name'] == 'Coder'
    assert agent['description'] == 'Writes Python.'
    assert agent['walletAddress'] == wallet
    assert agent['webhookUrl'] == 'https://hooks.example.com/coder'
    assert agent['capabilities'] == {'categories': ['code', 'data'], 'languages': ['python'], 'maxJobValue': 500,
                                     'avgCompletionTime': '30m'}
    assert agent['pricing'] == {'minimumJobValue': 5, 'acceptedCurrencies': ['USDC', 'USD']}
    assert agent['reputationScore'] == '0.00'
    assert agent['jobsCompleted'] == 0
    assert agent['totalEarned'] == '0.00'
    assert agent['completionRate'] == 0
    assert ISO.match(agent['createdAt'])
    secret = answer.json['webhookSecret']
    assert secret.startswith('whsec_')
    assert len(base64.b64decode(secret[len('whsec_'):], validate=True)) == 32


def test_every_agent_gets_its_own_secret(client, owner):
    _, key = owner
    secrets_seen = {make_agent(client, key)[1] for _ in range(5)}
    assert len(secrets_seen) == 5


def test_webhook_secret_never_appears_in_a_get(client, app, owner):
    account, key = owner
    _, stranger_key = make_account(client, 'stranger')
    agent, secret = make_agent(client, key, webhookUrl='https://hooks.example.com/h')
    encoded = secret[len('whsec_'):]
    for viewer in (None, key, stranger_key, ADMIN_KEY):
        for path in ('/api/agents', f'/api/agents/{agent["id"]}', '/api/agents?sort=newest'):
            answer = client.get(path, key=viewer)
            assert answer.status == 200, answer
            text = json.dumps(answer.json)
            assert secret not in text
            assert encoded not in text
            assert 'webhookSecret' not in text
            assert 'secret' not in text.lower()
    # It is stored, for signing.
    assert app.service.db.value('SELECT webhook_secret FROM agents WHERE id = :id', {'id': agent['id']}) == secret


def test_optional_fields_default(client, owner):
    _, key = owner
    answer = client.post('/api/agents', agent_body(), key=key)
    assert answer.status == 201, answer
    agent = answer.json['agent']
    assert agent['description'] == ''
    assert agent['capabilities'] == {}
    assert agent['pricing'] == {}
    assert agent['webhookUrl'] is None


# walletAddress -------------------------------------------------------------------

@pytest.mark.parametrize('wallet', [
    '0x' + 'ab12' * 10,                      # lowercase
    '0x' + 'AB12' * 10,                      # all uppercase hex
    CHECKSUMMED,                             # valid EIP-55
    '0x' + '0' * 40,
])
def test_valid_wallet_addresses(client, owner, wallet):
    answer = client.post('/api/agents', agent_body(walletAddress=wallet), key=owner[1])
    assert answer.status == 201, answer
    assert answer.json['agent']['walletAddress'] == wallet


def flip_one_letter(address):
    for index, char in enumerate(address):
        if index >= 2 and char.isalpha():
            return address[:index] + char.swapcase() + address[index + 1:]
    raise AssertionError('no letter')


@pytest.mark.parametrize('wallet', [
    flip_one_letter(CHECKSUMMED),            # 0x5AAeb...: checksum broken
    CHECKSUMMED[:-1] + 'D',                  # last letter flipped
    '0x' + 'ab' * 19,                        # too short
    '0x' + 'ab' * 21,                        # too long
    'ab' * 20,                               # no 0x
    '0x' + 'zz' * 20,                        # not hex
    '0x' + 'ab' * 19 + 'g1',
    ' 0x' + 'ab' * 20,
    '0x' + 'ab' * 20 + '\n',                # a trailing newline is not part of an address
    CHECKSUMMED + '\n',
    '',
    42,
    ['0x' + 'ab' * 20],
])
def test_invalid_wallet_addresses(client, app, owner, wallet):
    answer = client.post('/api/agents', agent_body(walletAddress=wallet), key=owner[1])
    assert_invalid(answer, 'walletAddress')
    assert isinstance(answer.json['fields']['walletAddress'], str)
    assert app.service.db.value('SELECT count(*) FROM agents') == 0


def test_checksum_flip_is_the_only_difference():
    flipped = flip_one_letter(CHECKSUMMED)
    assert flipped.lower() == CHECKSUMMED.lower() and flipped != CHECKSUMMED


@pytest.mark.parametrize('body, fields', [
    ({'name': 'no wallet'}, ['walletAddress']),
    ({'walletAddress': '0x' + 'ab' * 20}, ['name']),
    ({'name': '', 'walletAddress': '0x' + 'ab' * 20}, ['name']),
    ({'name': None, 'walletAddress': None}, ['name', 'walletAddress']),
    ({}, ['name', 'walletAddress']),
])
def test_name_and_wallet_are_required(client, owner, body, fields):
    answer = client.post('/api/agents', body, key=owner[1])
    assert_invalid(answer, *fields)


# capabilities, pricing, webhookUrl ------------------------------------------------

@pytest.mark.parametrize('capabilities', [
    {'categories': ['code', 'cooking']},
    {'categories': ['CODE']},
    {'categories': 'code'},
    {'categories': [1]},
    {'languages': 'python'},
    {'maxJobValue': -1},
    {'maxJobValue': '100'},
    'code',
])
def test_bad_capabilities(client, owner, capabilities):
    answer = client.post('/api/agents', agent_body(capabilities=capabilities), key=owner[1])
    assert_invalid(answer, 'capabilities')


def test_every_known_category_is_accepted(client, owner):
    categories = ['code', 'content', 'data', 'research', 'design', 'custom']
    answer = client.post('/api/agents', agent_body(capabilities={'categories': categories}), key=owner[1])
    assert answer.status == 201, answer
    assert answer.json['agent']['capabilities']['categories'] == categories


@pytest.mark.parametrize('pricing', [
    {'acceptedCurrencies': ['EUR']},
    {'acceptedCurrencies': ['USDC', 'EUR']},
    {'acceptedCurrencies': 'USDC'},
    {'minimumJobValue': -5},
    [],
])
def test_bad_pricing(client, owner, pricing):
    answer = client.post('/api/agents', agent_body(pricing=pricing), key=owner[1])
    assert_invalid(answer, 'pricing')


@pytest.mark.parametrize('url', [
    'ftp://hooks.example.com/x', 'hooks.example.com/x', 'javascript:alert(1)', 'http://', 'https:// x', 42,
    'https://example.com/' + 'a' * 2048,
])
def test_bad_webhook_url(client, owner, url):
    answer = client.post('/api/agents', agent_body(webhookUrl=url), key=owner[1])
    assert_invalid(answer, 'webhookUrl')


@pytest.mark.parametrize('url', ['http://hooks.example.com/x', 'https://hooks.example.com:8443/x?y=1',
                                 'HTTPS://HOOKS.EXAMPLE.COM/'])
def test_good_webhook_url(client, owner, url):
    answer = client.post('/api/agents', agent_body(webhookUrl=url), key=owner[1])
    assert answer.status == 201, answer
    assert answer.json['agent']['webhookUrl'] == url


def test_every_problem_is_reported_at_once(client, owner):
    answer = client.post('/api/agents', {'name': '', 'walletAddress': '0x12', 'webhookUrl': 'ftp://x',
                                         'capabilities': {'categories': ['nope']},
                                         'pricing': {'acceptedCurrencies': ['EUR']}}, key=owner[1])
    assert_invalid(answer, 'name', 'walletAddress', 'webhookUrl', 'capabilities', 'pricing')


# webhookUrl visibility -------------------------------------------------------------

def test_webhook_url_only_for_owner_and_admin(client, owner):
    account, key = owner
    _, stranger_key = make_account(client, 'stranger')
    agent, _ = make_agent(client, key, webhookUrl='https://hooks.example.com/private')

    def listed(viewer):
        answer = client.get('/api/agents', key=viewer)
        assert answer.status == 200, answer
        (found,) = [a for a in answer.json['agents'] if a['id'] == agent['id']]
        return found

    def shown(viewer):
        answer = client.get(f'/api/agents/{agent["id"]}', key=viewer)
        assert answer.status == 200, answer
        return answer.json['agent']

    for view in (listed, shown):
        assert view(key)['webhookUrl'] == 'https://hooks.example.com/private'
        assert view(ADMIN_KEY)['webhookUrl'] == 'https://hooks.example.com/private'
        assert 'webhookUrl' not in view(None)
        assert 'webhookUrl' not in view(stranger_key)
        assert 'webhookUrl' not in view('mk_not_a_real_key_' + 'x' * 30)
        assert view(None)['name'] == 'agent'


# GET /api/agents --------------------------------------------------------------------

def set_reputation(app, agent, hundredths):
    app.service.db.execute('UPDATE agents SET reputation = :r WHERE id = :id', {'r': hundredths, 'id': agent['id']})


def names(answer):
    assert answer.status == 200, answer
    return [agent['name'] for agent in answer.json['agents']]


def test_empty_list(client):
    answer = client.get('/api/agents')
    assert answer.status == 200, answer
    assert answer.json == {'agents': [], 'total': 0, 'limit': 50, 'offset': 0}


def test_default_sort_is_reputation(client, app, owner):
    _, key = owner
    agents = {name: make_agent(client, key, name=name)[0] for name in ('low', 'high', 'mid', 'zero', 'top')}
    set_reputation(app, agents['low'], 150)
    set_reputation(app, agents['high'], 1225)
    set_reputation(app, agents['mid'], 700)
    set_reputation(app, agents['top'], 9999)
    answer = client.get('/api/agents')
    assert names(answer) == ['top', 'high', 'mid', 'low', 'zero']
    assert [a['reputationScore'] for a in answer.json['agents']] == ['99.99', '12.25', '7.00', '1.50', '0.00']
    assert answer.json['total'] == 5
    assert answer.json['limit'] == 50
    assert answer.json['offset'] == 0
    assert names(client.get('/api/agents?sort=reputation')) == ['top', 'high', 'mid', 'low', 'zero']


def test_reputation_ties_keep_registration_order(client, app, owner):
    _, key = owner
    first, _ = make_agent(client, key, name='first')
    second, _ = make_agent(client, key, name='second')
    third, _ = make_agent(client, key, name='third')
    for agent in (first, second, third):
        set_reputation(app, agent, 300)
    assert names(client.get('/api/agents')) == ['first', 'second', 'third']


def test_limit_offset_and_total(client, app, owner):
    _, key = owner
    for index in range(5):
        agent, _ = make_agent(client, key, name=f'a{index}')
        set_reputation(app, agent, 100 * index)
    answer = client.get('/api/agents?limit=2&offset=1')
    assert names(answer) == ['a3', 'a2']
    assert answer.json['total'] == 5
    assert answer.json['limit'] == 2
    assert answer.json['offset'] == 1
    past = client.get('/api/agents?offset=10')
    assert past.json['agents'] == [] and past.json['total'] == 5 and past.json['offset'] == 10


def test_limit_is_clamped_to_200(client, app, owner):
    _, key = owner
    account_id = owner[0]['id']
    db = app.service.db
    # 205 agents straight into the database (faster than 205 requests).
    with db.transaction():
        for index in range(205):
            db.insert('agents', {'id': str(uuid.uuid4()), 'account_id': account_id, 'name': f'bulk{index}',
                                 'wallet_address': random_wallet(), 'webhook_secret': 'whsec_x',
                                 'reputation': index, 'created_at': '2026-01-01T00:00:00.000Z',
                                 'updated_at': '2026-01-01T00:00:00.000Z'})
    answer = client.get('/api/agents?limit=500')
    assert answer.status == 200, answer
    assert answer.json['limit'] == 200
    assert len(answer.json['agents']) == 200
    assert answer.json['total'] == 205
    assert answer.json['agents'][0]['name'] == 'bulk204'
    assert client.get('/api/agents?limit=200').json['limit'] == 200
    assert len(client.get('/api/agents').json['agents']) == 50


def test_huge_offset_is_an_empty_page_or_a_400(client, owner):
    make_agent(client, owner[1])
    for offset in ('99999999999999999999999', str(2 ** 63)):
        answer = client.get(f'/api/agents?offset={offset}')
        if answer.status == 200:
            assert answer.json['agents'] == []
            assert answer.json['total'] == 1
        else:
            assert answer.status == 400, answer
            assert answer.json['code'] == 'invalid_parameter'
            assert list(answer.json['fields']) == ['offset']
    answer = client.get(f'/api/agents?offset={mp.MAX_OFFSET}')
    assert answer.status == 200, answer
    assert answer.json['agents'] == [] and answer.json['offset'] == mp.MAX_OFFSET
    assert client.get(f'/api/agents?offset={mp.MAX_OFFSET + 1}').json['code'] == 'invalid_parameter'


@pytest.mark.parametrize('query, field', [
    ('sort=best', 'sort'), ('sort=REPUTATION', 'sort'), ('limit=0', 'limit'), ('limit=-1', 'limit'),
    ('limit=ten', 'limit'), ('limit=1.5', 'limit'), ('offset=-1', 'offset'), ('offset=x', 'offset'),
])
def test_bad_list_parameters(client, query, field):
    answer = client.get(f'/api/agents?{query}')
    assert answer.status == 400, answer
    assert answer.json['status'] == 400
    assert answer.json['code'] == 'invalid_parameter'
    assert list(answer.json['fields']) == [field]


@pytest.fixture
def ranked(client, app, market):
    """Three agents with distinct jobs, earnings and reputation:

    worker-agent (market.agent, created 1st): 2 approved jobs, 10.00 + 10.00 = 20.00 earned
    big-earner (created 2nd): 1 approved job of 50.00
    idle (created 3rd): no jobs, reputation set to 5.00
    """
    big_account, big_key = make_account(client, 'big')
    big, _ = make_agent(client, big_key, name='big-earner')
    idle_account, idle_key = make_account(client, 'idle')
    idle, _ = make_agent(client, idle_key, name='idle')
    for _ in range(2):
        job, claim = market.delivered_job(paymentAmount='10.00')
        assert market.verify(job, claim, True).status == 200
    job = market.job(paymentAmount='50.00', paymentCurrency='USD')
    claim = market.deliver(job, market.claim(job, agent=big, key=big_key), key=big_key)
    assert market.verify(job, claim, True).status == 200
    set_reputation(app, idle, 500)
    return {'worker-agent': market.agent, 'big-earner': big, 'idle': idle}


def test_sort_orders(client, ranked):
    assert names(client.get('/api/agents')) == ['idle', 'worker-agent', 'big-earner']
    assert names(client.get('/api/agents?sort=jobs')) == ['worker-agent', 'big-earner', 'idle']
    assert names(client.get('/api/agents?sort=earned')) == ['big-earner', 'worker-agent', 'idle']
    assert names(client.get('/api/agents?sort=newest')) == ['idle', 'big-earner', 'worker-agent']
    listed = {a['name']: a for a in client.get('/api/agents').json['agents']}
    assert listed['worker-agent']['jobsCompleted'] == 2
    assert listed['worker-agent']['totalEarned'] == '20.00'
    assert listed['worker-agent']['reputationScore'] == '2.00'
    assert listed['worker-agent']['completionRate'] == 1
    assert listed['big-earner']['jobsCompleted'] == 1
    assert listed['big-earner']['totalEarned'] == '50.00'
    assert listed['big-earner']['reputationScore'] == '1.00'
    assert listed['idle']['jobsCompleted'] == 0
    assert listed['idle']['totalEarned'] == '0.00'
    assert listed['idle']['reputationScore'] == '5.00'
    assert listed['idle']['completionRate'] == 0


def test_newest_sort_breaks_same_millisecond_ties(client, app, owner, real_clock):
    real_clock.set(mp.now())          # every agent gets the same createdAt
    _, key = owner
    for name in ('one', 'two', 'three'):
        make_agent(client, key, name=name)
    assert names(client.get('/api/agents?sort=newest')) == ['three', 'two', 'one']


# GET /api/agents/:id -----------------------------------------------------------------

def test_agent_profile_after_one_approved_job(client, market):
    job, claim = market.delivered_job(paymentAmount='12.34')
    verdict = market.verify(job, claim, True)
    assert verdict.status == 200, verdict
    answer = client.get(f'/api/agents/{market.agent["id"]}')
    assert answer.status == 200, answer
    assert set(answer.json) == {'agent', 'claims', 'reputationHistory'}
    agent = answer.json['agent']
    assert agent['id'] == market.agent['id']
    assert agent['name'] == 'worker-agent'
    assert agent['reputationScore'] == '1.00'
    assert agent['jobsCompleted'] == 1
    assert agent['totalEarned'] == '12.34'
    assert agent['completionRate'] == 1
    assert 'webhookUrl' not in agent
    (shown_claim,) = answer.json['claims']
    assert shown_claim['id'] == claim['id']
    assert shown_claim['jobId'] == job['id']
    assert shown_claim['agentId'] == market.agent['id']
    assert shown_claim['status'] == 'approved'
    assert shown_claim['deliverable'] == {'type': 'url', 'delivered': True}       # private to its readers
    mine = client.get(f'/api/agents/{market.agent["id"]}', key=market.worker_key).json['claims'][0]
    assert mine['deliverable'] == {'type': 'url', 'url': 'https://example.com/out'}
    assert shown_claim['autoApproved'] is False
    assert ISO.match(shown_claim['verifiedAt'])
    (entry,) = answer.json['reputationHistory']
    assert entry['delta'] == '1.00'
    assert entry['scoreAfter'] == '1.00'
    assert entry['reason'] == 'delivery approved'
    assert entry['jobId'] == job['id']
    assert entry['claimId'] == claim['id']
    assert ISO.match(entry['createdAt'])


def test_new_agent_profile_is_empty(client, owner):
    agent, _ = make_agent(client, owner[1], name='fresh')
    answer = client.get(f'/api/agents/{agent["id"]}')
    assert answer.status == 200, answer
    assert answer.json['claims'] == []
    assert answer.json['reputationHistory'] == []
    assert answer.json['agent']['reputationScore'] == '0.00'


def test_uppercase_id_is_accepted(client, owner):
    agent, _ = make_agent(client, owner[1])
    answer = client.get(f'/api/agents/{agent["id"].upper()}')
    assert answer.status == 200, answer
    assert answer.json['agent']['id'] == agent['id']


@pytest.mark.parametrize('bad', ['123', 'not-a-uuid', '00000000-0000-0000-0000-00000000000g',
                                 '00000000000000000000000000000000', 'register-me'])
def test_malformed_agent_id(client, bad):
    answer = client.get(f'/api/agents/{bad}')
    assert answer.status == 400, answer
    assert answer.json['code'] == 'invalid_uuid'
    assert answer.json['status'] == 400


def test_existing_id_with_a_trailing_newline_is_malformed(client, owner):
    # An encoded %0A reaches the app as a newline; the id is then malformed (400), not unknown (404).
    agent, _ = make_agent(client, owner[1])
    for bad in (agent['id'] + '\n', str(uuid.uuid4()) + '\n'):
        answer = client.get(f'/api/agents/{bad}')
        assert answer.status == 400, answer
        assert answer.json['code'] == 'invalid_uuid'
        assert answer.json['fields'] == {'agentId': 'must be a UUID'}


def test_unknown_agent_id(client):
    answer = client.get(f'/api/agents/{uuid.uuid4()}')
    assert answer.status == 404, answer
    assert answer.json['code'] == 'not_found'
    assert answer.json['status'] == 404


def test_get_register_is_405_not_an_agent_lookup(client):
    for method in ('GET', 'HEAD'):
        answer = client.request(method, '/api/agents/register')
        assert answer.status == 405, answer
        assert 'POST' in [m.strip() for m in header(answer, 'Allow').split(',')]
        assert header(answer, 'Content-Type') == 'application/json; charset=utf-8'
    answer = client.get('/api/agents/register')
    assert answer.json['code'] == 'method_not_allowed'
    assert answer.json['status'] == 405


# Strict JSON -------------------------------------------------------------------------

def strict_loads(data):
    """RFC 8259 JSON only: NaN and Infinity are not JSON (JavaScript's JSON.parse refuses them)."""
    def refuse(name):
        raise ValueError(f'{name} is not JSON')
    return json.loads(data, parse_constant=refuse)


def raw_get(app, path):
    captured = []

    def capture(environ, start_response):
        data = b''.join(app(environ, start_response))
        captured.append(data)
        return [data]
    mp.call_app(capture, 'GET', path)
    return captured[0]


@pytest.mark.parametrize('raw_number', [b'NaN', b'Infinity', b'-Infinity', b'1e400', b'-1e999'])
def test_non_finite_numbers_are_refused_and_lists_stay_strict_json(client, app, owner, raw_number):
    body = (b'{"name": "n", "walletAddress": "0x' + b'ab' * 20 + b'", "capabilities": {"categories": ["code"], '
            b'"extra": ' + raw_number + b'}, "pricing": {"note": ' + raw_number + b'}}')
    answer = client.post('/api/agents', body, key=owner[1])
    assert answer.status == 400, answer
    assert answer.json['code'] == 'invalid_json'
    assert app.service.db.value('SELECT count(*) FROM agents') == 0
    listed = strict_loads(raw_get(app, '/api/agents'))
    assert listed['total'] == 0


# A wallet is locked while the agent holds an open claim or dispute (CONTRACT.md 20) -------------------------

def patch_wallet(client, agent, key, wallet):
    return client.patch(f'/api/agents/{agent["id"]}', {'walletAddress': wallet}, key=key)


def test_an_agent_with_an_open_claim_or_dispute_cannot_change_its_wallet(client, market, app):
    agent, key = market.agent, market.worker_key
    before = agent['walletAddress']
    job = market.job()
    claim = market.claim(job)
    new = random_wallet()
    body = patch_wallet(client, agent, key, new)
    assert (body.status, body.json['code']) == (409, 'wallet_locked'), body
    assert 'walletAddress' in body.json['error']
    # the same wallet (in another letter case) and other fields still change
    same = patch_wallet(client, agent, key, '0x' + before[2:].upper())
    assert (same.status, same.json['agent']['walletAddress']) == (200, '0x' + before[2:].upper())
    named = client.patch(f'/api/agents/{agent["id"]}', {'name': 'renamed'}, key=key)
    assert (named.status, named.json['agent']['name']) == (200, 'renamed')
    market.deliver(job, claim)
    assert patch_wallet(client, agent, key, new).json['code'] == 'wallet_locked'            # delivered
    dispute = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'late'},
                          key=market.requester_key)
    assert dispute.status == 201, dispute
    assert patch_wallet(client, agent, key, new).json['code'] == 'wallet_locked'            # disputed
    stored = app.service.db.value('SELECT wallet_address FROM agents WHERE id = :id', {'id': agent['id']})
    assert stored == '0x' + before[2:].upper()
    resolved = client.patch(f'/api/disputes/{dispute.json["dispute"]["id"]}',
                            {'outcome': 'worker', 'resolution': 'Fine.'}, key=ADMIN_KEY)
    assert resolved.status == 200, resolved
    changed = patch_wallet(client, agent, key, new)                                         # nothing open now
    assert (changed.status, changed.json['agent']['walletAddress']) == (200, new)


def test_a_wallet_is_free_again_once_the_claim_ends(client, market):
    job, claim = market.delivered_job()
    assert patch_wallet(client, market.agent, market.worker_key, random_wallet()).json['code'] == 'wallet_locked'
    assert market.verify(job, claim, False).status == 200                                    # rejected: ended
    new = random_wallet()
    changed = patch_wallet(client, market.agent, market.worker_key, new)
    assert (changed.status, changed.json['agent']['walletAddress']) == (200, new)


# Names: NFKC, without control, format, private-use or unassigned characters (CONTRACT.md 20) ------------------

@pytest.mark.parametrize('name', [
    'pay\u200bpal',             # zero-width space (Cf)
    'admin\u202egnp.exe',       # right-to-left override (Cf)
    '\u2066bidi\u2069',         # isolates (Cf)
    'bell\u0007',               # C0 control (Cc)
    'line\nbreak',              # a newline is a control too
    'nel\u0085',                # C1 control (Cc)
    'private\ue000use',         # private use (Co)
    'unassigned\u0378',         # unassigned (Cn)
    'soft\u00adhyphen',         # soft hyphen (Cf)
    '\ufeffbom',                # byte order mark (Cf)
])
def test_names_with_invisible_or_unassigned_characters_are_refused(client, owner, app, name):
    _, key = owner
    assert_invalid(client.post('/api/agents', agent_body(name=name), key=key), 'name')
    assert_invalid(client.post('/api/accounts', {'name': name}), 'name')
    assert_invalid(client.post('/api/arbitrators', {'name': name, 'walletAddress': random_wallet()}, key=ADMIN_KEY),
                   'name')
    agent, _ = make_agent(client, key, name='plain')
    assert_invalid(client.patch(f'/api/agents/{agent["id"]}', {'name': name}, key=key), 'name')
    assert app.service.db.value("SELECT count(*) FROM accounts WHERE name != 'owner' AND name != 'admin'") == 0
    assert app.service.db.value('SELECT count(*) FROM arbitrators') == 0


@pytest.mark.parametrize('sent, stored', [
    ('\uff21\uff44\uff4d\uff49\uff4e', 'Admin'),        # fullwidth letters
    ('\u212bngstr\u00f6m', '\u00c5ngstr\u00f6m'),           # the Angstrom sign is the letter A with a ring
    ('A\u030angstro\u0308m', '\u00c5ngstr\u00f6m'),         # combining marks composed
    ('\ufb01le bot', 'file bot'),                         # the fi ligature
    ('  \u2460 robot  ', '1 robot'),                      # circled digit; spaces trimmed
    ('Zoë 🤖 agent', 'Zoë 🤖 agent'),                    # emoji and accents stay
])
def test_names_are_stored_nfkc_normalised(client, owner, sent, stored):
    _, key = owner
    agent = client.post('/api/agents', agent_body(name=sent), key=key)
    assert (agent.status, agent.json['agent']['name']) == (201, stored), agent
    account = client.post('/api/accounts', {'name': sent})
    assert (account.status, account.json['account']['name']) == (201, stored), account
    arbitrator = client.post('/api/arbitrators', {'name': sent, 'walletAddress': random_wallet()}, key=ADMIN_KEY)
    assert (arbitrator.status, arbitrator.json['arbitrator']['name']) == (201, stored), arbitrator
    plain, _ = make_agent(client, key, name='plain')
    renamed = client.patch(f'/api/agents/{plain["id"]}', {'name': sent}, key=key)
    assert (renamed.status, renamed.json['agent']['name']) == (200, stored), renamed


def test_a_name_is_measured_after_normalising(client, owner):
    """U+FDFA is one character that NFKC spells in 18: 10 of them are 180 characters, over the limit of 100."""
    assert_invalid(client.post('/api/agents', agent_body(name='\ufdfa' * 10), key=owner[1]), 'name')
