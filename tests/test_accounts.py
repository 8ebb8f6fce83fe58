"""Accounts, API keys and who may do what (CONTRACT.md section 2)."""

import hashlib
import re

import pytest

import marketplace as mp
import wiring
from conftest import ADMIN_KEY, Client, job_body, make_account, make_agent, make_job, random_wallet

UUID = re.compile(r'^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$')


def header(answer, name):
    """A response header by name, whatever its case (HTTP header names are case-insensitive)."""
    found = {key.lower(): value for key, value in answer.headers.items()}
    return found.get(name.lower())


def assert_unauthorized(answer):
    assert answer.status == 401, answer
    assert answer.json['code'] == 'unauthorized'
    assert answer.json['status'] == 401
    assert isinstance(answer.json['error'], str) and answer.json['error']
    assert header(answer, 'WWW-Authenticate') == 'Bearer'


def role_of(app, account_id):
    return app.service.db.value('SELECT role FROM accounts WHERE id = :id', {'id': account_id})


# Open registration -----------------------------------------------------------

def test_post_account_returns_member_account_and_key(client):
    answer = client.post('/api/accounts', {'name': 'Ada'})
    assert answer.status == 201, answer
    assert header(answer, 'Content-Type') == 'application/json; charset=utf-8'
    assert set(answer.json) == {'account', 'apiKey'}
    account = answer.json['account']
    assert set(account) == {'id', 'name', 'role'}
    assert UUID.match(account['id'])
    assert account['name'] == 'Ada'
    assert account['role'] == 'member'
    key = answer.json['apiKey']
    assert isinstance(key, str) and len(key) >= 43   # at least 32 random bytes, base64url


def test_name_is_trimmed_and_unknown_fields_ignored(client):
    answer = client.post('/api/accounts', {'name': '  Grace  ', 'role': 'admin', 'extra': 1})
    assert answer.status == 201, answer
    assert answer.json['account']['name'] == 'Grace'
    assert answer.json['account']['role'] == 'member'


def test_two_accounts_get_different_keys_and_ids(client):
    first, first_key = make_account(client, 'one')
    second, second_key = make_account(client, 'two')
    assert first['id'] != second['id']
    assert first_key != second_key


def test_new_key_works_as_bearer_on_post_jobs(client):
    account, key = make_account(client, 'requester')
    answer = client.post('/api/jobs', job_body(), key=key)
    assert answer.status == 201, answer
    assert answer.json['job']['requesterId'] == account['id']
    assert answer.json['job']['status'] == 'open'


def test_bearer_scheme_is_case_insensitive(client):
    account, key = make_account(client)
    answer = client.post('/api/jobs', job_body(), headers={'Authorization': f'bearer {key}'})
    assert answer.status == 201, answer
    assert answer.json['job']['requesterId'] == account['id']


def test_database_stores_only_the_sha256_of_the_key(client, app):
    account, key = make_account(client, 'secretive')
    db = app.service.db
    rows = db.rows('SELECT * FROM api_keys WHERE account_id = :id', {'id': account['id']})
    assert len(rows) == 1
    row = rows[0]
    assert row['key_hash'] == hashlib.sha256(key.encode('utf-8')).hexdigest()
    assert row['revoked_at'] is None
    for stored in db.rows('SELECT * FROM api_keys'):
        for column, value in stored.items():
            assert key not in str(value), column
    # Nowhere else in the database either.
    tables = [r['name'] for r in db.rows("SELECT name FROM sqlite_master WHERE type = 'table'")]
    assert 'accounts' in tables and 'api_keys' in tables
    for table in tables:
        for stored in db.rows(f'SELECT * FROM "{table}"'):
            for column, value in stored.items():
                assert key not in str(value), f'{table}.{column}'


def test_register_agent_without_key(client, app):
    wallet = random_wallet()
    answer = client.post('/api/agents/register', {
        'name': 'solo', 'walletAddress': wallet, 'webhookUrl': 'https://hooks.example.com/solo',
        'capabilities': {'categories': ['code']}})
    assert answer.status == 201, answer
    assert set(answer.json) == {'agent', 'apiKey', 'webhookSecret'}
    agent, key = answer.json['agent'], answer.json['apiKey']
    assert UUID.match(agent['id'])
    assert agent['name'] == 'solo'
    assert agent['walletAddress'] == wallet
    assert agent['reputationScore'] == '0.00'
    assert agent['webhookUrl'] == 'https://hooks.example.com/solo'   # shown to its owner
    assert answer.json['webhookSecret'].startswith('whsec_')
    # An account was created along with it, a member, owning the agent.
    owner = app.service.db.row('SELECT * FROM accounts WHERE id = :id', {'id': agent['accountId']})
    assert owner['role'] == 'member'
    assert owner['name'] == 'solo'
    stored = app.service.db.row('SELECT key_hash FROM api_keys WHERE account_id = :id', {'id': owner['id']})
    assert stored['key_hash'] == hashlib.sha256(key.encode()).hexdigest()

    # The key owns the agent: it can claim a job with it.
    _, requester_key = make_account(client, 'requester')
    job = make_job(client, requester_key)
    claim = client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': agent['id']}, key=key)
    assert claim.status == 201, claim
    assert claim.json['claim']['agentId'] == agent['id']
    assert claim.json['claim']['status'] == 'claimed'


def test_register_agent_validates_like_post_agents(client, app):
    answer = client.post('/api/agents/register', {'name': 'bad', 'walletAddress': '0x1234'})
    assert answer.status == 400, answer
    assert answer.json['code'] == 'validation_failed'
    assert 'walletAddress' in answer.json['fields']
    # Nothing half-made was left behind.
    assert app.service.db.value('SELECT count(*) FROM agents') == 0
    assert app.service.db.value("SELECT count(*) FROM accounts WHERE role = 'member'") == 0


@pytest.fixture
def closed_client(tmp_path):
    app = wiring.make_app(mp.Settings(db=str(tmp_path / 'closed.db'), rate_limits='off', admin_key=ADMIN_KEY,
                                  open_registration=False))
    yield Client(app)
    app.service.close()


@pytest.mark.parametrize('path, body', [
    ('/api/accounts', {'name': 'late'}),
    ('/api/agents/register', {'name': 'late', 'walletAddress': '0x' + 'ab' * 20}),
])
def test_closed_registration(closed_client, path, body):
    answer = closed_client.post(path, body)
    assert answer.status == 403, answer
    assert answer.json['code'] == 'registration_closed'
    assert answer.json['status'] == 403
    assert closed_client.app.service.db.value("SELECT count(*) FROM accounts WHERE role = 'member'") == 0


def test_closed_registration_still_accepts_keys(closed_client):
    # Operators hand out keys; the admin key still works.
    answer = closed_client.post('/api/jobs', job_body(), key=ADMIN_KEY)
    assert answer.status == 201, answer


@pytest.mark.parametrize('body, problem', [
    ({}, 'is required'),
    ({'name': None}, 'is required'),
    ({'name': ''}, 'must not be empty'),
    ({'name': '   '}, 'must not be empty'),
    ({'name': 42}, 'must be a string'),
    ({'name': 'x' * 101}, 'must be at most 100 characters'),
])
def test_account_name_is_required(client, app, body, problem):
    answer = client.post('/api/accounts', body)
    assert answer.status == 400, answer
    assert answer.json['code'] == 'validation_failed'
    assert answer.json['status'] == 400
    assert answer.json['fields'] == {'name': problem}
    assert app.service.db.value("SELECT count(*) FROM accounts WHERE role = 'member'") == 0


# Authentication ----------------------------------------------------------------

def test_missing_header_is_401(client):
    assert_unauthorized(client.post('/api/jobs', job_body()))


def test_unknown_key_is_401(client):
    assert_unauthorized(client.post('/api/jobs', job_body(), key='mk_' + 'x' * 43))


def test_empty_bearer_is_401(client):
    assert_unauthorized(client.post('/api/jobs', job_body(), headers={'Authorization': 'Bearer '}))


def test_non_bearer_scheme_is_401(client):
    _, key = make_account(client)
    assert_unauthorized(client.post('/api/jobs', job_body(), headers={'Authorization': f'Basic {key}'}))
    assert_unauthorized(client.post('/api/jobs', job_body(), headers={'Authorization': key}))
    assert_unauthorized(client.post('/api/jobs', job_body(), headers={'Authorization': f'Token {key}'}))


def test_revoked_key_is_401(client, app):
    account, key = make_account(client)
    assert client.post('/api/jobs', job_body(), key=key).status == 201
    changed = app.service.db.execute('UPDATE api_keys SET revoked_at = :now WHERE account_id = :id',
                                     {'now': mp.now_iso(), 'id': account['id']})
    assert changed == 1
    assert_unauthorized(client.post('/api/jobs', job_body(), key=key))
    assert app.service.db.value('SELECT count(*) FROM jobs') == 1


def test_unauthorized_on_every_keyed_route(client, market):
    job = market.job()
    for path in ('/api/agents', '/api/jobs', f'/api/jobs/{job["id"]}/claim', f'/api/jobs/{job["id"]}/deliver',
                 f'/api/jobs/{job["id"]}/verify', f'/api/jobs/{job["id"]}/cancel'):
        assert_unauthorized(client.post(path, {}))


def test_get_routes_need_no_key_and_ignore_a_bad_one(client, market):
    job = market.job()
    for key in (None, 'not-a-key'):
        answer = client.get(f'/api/jobs/{job["id"]}', key=key)
        assert answer.status == 200, answer
        assert answer.json['job']['id'] == job['id']


# Ownership -------------------------------------------------------------------

def test_claim_with_someone_elses_agent_is_403(client, market):
    job = market.job()
    _, stranger_key = make_account(client, 'stranger')
    answer = client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': market.agent['id']}, key=stranger_key)
    assert answer.status == 403, answer
    assert answer.json['code'] == 'forbidden'
    assert answer.json['status'] == 403
    assert market.get_job(job)['claims'] == []


def test_deliver_verify_cancel_by_a_stranger_are_403(client, market):
    _, stranger_key = make_account(client, 'stranger')
    job = market.job()
    claim = market.claim(job)
    deliver = client.post(f'/api/jobs/{job["id"]}/deliver',
                          {'claimId': claim['id'], 'deliverable': {'type': 'url', 'url': 'https://x.example/out'}},
                          key=stranger_key)
    assert deliver.status == 403, deliver
    assert deliver.json['code'] == 'forbidden'
    market.deliver(job, claim)
    verify = market.verify(job, claim, True, key=stranger_key)
    assert verify.status == 403, verify
    assert verify.json['code'] == 'forbidden'
    # The worker may not verify its own delivery either.
    assert market.verify(job, claim, True, key=market.worker_key).status == 403
    other = market.job()
    cancel = client.post(f'/api/jobs/{other["id"]}/cancel', key=stranger_key)
    assert cancel.status == 403, cancel
    assert cancel.json['code'] == 'forbidden'
    assert market.get_job(job)['job']['status'] == 'delivered'
    assert market.get_job(other)['job']['status'] == 'open'


def test_member_cannot_post_for_another_requester(client):
    _, key = make_account(client, 'member')
    other, _ = make_account(client, 'other')
    answer = client.post('/api/jobs', job_body(requesterId=other['id']), key=key)
    assert answer.status == 403, answer
    assert answer.json['code'] == 'forbidden'


# Admin keys --------------------------------------------------------------------

def test_admin_key_from_settings_has_admin_role(client, app):
    rows = app.service.db.rows('''SELECT a.role, a.name FROM api_keys k JOIN accounts a ON a.id = k.account_id
                                  WHERE k.key_hash = :h''', {'h': hashlib.sha256(ADMIN_KEY.encode()).hexdigest()})
    assert rows == [{'role': 'admin', 'name': 'admin'}]
    # And it acts as one: it may post a job on behalf of another requester.
    other, _ = make_account(client, 'other')
    answer = client.post('/api/jobs', job_body(requesterId=other['id']), key=ADMIN_KEY)
    assert answer.status == 201, answer
    assert answer.json['job']['requesterId'] == other['id']


def test_admin_key_is_not_stored_in_clear(app):
    for table in [r['name'] for r in app.service.db.rows("SELECT name FROM sqlite_master WHERE type = 'table'")]:
        for stored in app.service.db.rows(f'SELECT * FROM "{table}"'):
            for column, value in stored.items():
                assert ADMIN_KEY not in str(value), f'{table}.{column}'


def test_restarting_with_the_same_admin_key_keeps_one_admin(settings, app):
    again = wiring.make_app(settings)
    try:
        assert again.service.db.value("SELECT count(*) FROM accounts WHERE role = 'admin'") == 1
        assert again.service.db.value('SELECT count(*) FROM api_keys') == 1
    finally:
        again.service.close()


@pytest.mark.parametrize('short', ['x' * 31, 'short', 'a' * 16])
def test_too_short_admin_key_refuses_to_start(tmp_path, short):
    with pytest.raises(ValueError, match='at least 32'):
        wiring.make_app(mp.Settings(db=str(tmp_path / 'short.db'), rate_limits='off', admin_key=short))


def test_ensure_admin_key_promotes_an_existing_member_key(client, app):
    account, key = make_account(client, 'promoted')
    other, _ = make_account(client, 'other')
    assert client.post('/api/jobs', job_body(requesterId=other['id']), key=key).status == 403
    mp.ensure_admin_key(app.service.db, key)
    assert role_of(app, account['id']) == 'admin'
    # Still the same account and a single key, no new admin account.
    assert app.service.db.value('SELECT count(*) FROM api_keys WHERE account_id = :id', {'id': account['id']}) == 1
    # the settings' key, which an earlier value of the variable named, is retired: its account is an admin no more
    assert app.service.db.value("SELECT count(*) FROM accounts WHERE role = 'admin'") == 1
    answer = client.post('/api/jobs', job_body(requesterId=other['id']), key=key)
    assert answer.status == 201, answer
    assert answer.json['job']['requesterId'] == other['id']
    # It is now the environment's admin key: the one the settings named before is revoked.
    assert_unauthorized(client.post('/api/jobs', job_body(), key=ADMIN_KEY))


# Admin keys follow the environment (CONTRACT.md 18) ------------------------------------------------------

KEY_A, KEY_B = 'admin-key-a-' + 'a' * 32, 'admin-key-b-' + 'b' * 32


def start(tmp_path, admin_key):
    """The app on one database file, started with this MARKETPLACE_ADMIN_KEY ('' for none)."""
    return wiring.make_app(mp.Settings(db=str(tmp_path / 'env.db'), rate_limits='off', admin_key=admin_key))


def test_starting_with_another_admin_key_revokes_the_one_before(tmp_path):
    first = start(tmp_path, KEY_A)
    client = Client(first)
    _, member_key = make_account(client, 'member')
    operator, operator_key = mp.create_account(first.service.db, 'ops', 'admin')      # keys create --admin
    assert client.post('/api/jobs', job_body(), key=KEY_A).status == 201
    first.service.close()
    second = start(tmp_path, KEY_B)
    try:
        client = Client(second)
        assert_unauthorized(client.post('/api/jobs', job_body(), key=KEY_A))
        assert_unauthorized(client.post('/api/jobs/expire', key=KEY_A))
        other, _ = make_account(client, 'other')
        answer = client.post('/api/jobs', job_body(requesterId=other['id']), key=KEY_B)       # B acts as an admin
        assert answer.status == 201, answer
        # Only keys the variable made admin are revoked: a member's key and an operator's admin key stay.
        assert client.post('/api/jobs', job_body(), key=member_key).status == 201
        assert client.post('/api/jobs', job_body(requesterId=other['id']), key=operator_key).status == 201
        rows = second.service.db.rows('SELECT key_hash, from_env, revoked_at IS NOT NULL AS revoked FROM api_keys '
                                      'WHERE from_env = 1 ORDER BY created_at')
        assert [(r['key_hash'], r['revoked']) for r in rows] == [(mp.hash_key(KEY_A), 1), (mp.hash_key(KEY_B), 0)]
    finally:
        second.service.close()


def test_without_the_variable_the_admin_key_it_named_stays(tmp_path):
    start(tmp_path, KEY_A).service.close()
    app = start(tmp_path, '')
    try:
        assert Client(app).post('/api/jobs', job_body(), key=KEY_A).status == 201
    finally:
        app.service.close()


def test_a_revoked_admin_key_refuses_to_start(tmp_path):
    start(tmp_path, KEY_A).service.close()
    start(tmp_path, KEY_B).service.close()          # revokes A
    with pytest.raises(ValueError, match='revoked'):
        start(tmp_path, KEY_A)


def test_admin_sees_webhook_url_of_any_agent(client):
    _, key = make_account(client, 'owner')
    agent, _ = make_agent(client, key, webhookUrl='https://hooks.example.com/a')
    answer = client.get(f'/api/agents/{agent["id"]}', key=ADMIN_KEY)
    assert answer.json['agent']['webhookUrl'] == 'https://hooks.example.com/a'
