"""Fixed one-hour rate limits (SPEC.md Limits, CONTRACT.md sections 9, 11 and 23): each endpoint (method and route
template) counted on its own, per client address without a key and per key with one (--keyed-rate-scale times the
limit; 1 in most tests here, so that one number reads for both), admins not counted, an unknown key 401 before
anything is counted, and the discovery documents never limited, cacheable with an ETag."""

import uuid
from datetime import datetime, timedelta, timezone

import pytest

import marketplace as mp
import wiring
from conftest import ADMIN_KEY, job_body

JSON_TYPE = 'application/json; charset=utf-8'
# 16:40:00 UTC: the window ends at 17:00:00, 1200 s later.
START = datetime(2026, 11, 21, 16, 40, 0, tzinfo=timezone.utc)
WINDOW_END = int(datetime(2026, 11, 21, 17, 0, 0, tzinfo=timezone.utc).timestamp())
NEXT_WINDOW_END = WINDOW_END + 3600


def header(answer, name):
    found = {key.lower(): value for key, value in answer[1].items()}
    return found.get(name.lower())


class Caller:
    """Calls an app as a client at a given IP (REMOTE_ADDR), with optional headers."""

    def __init__(self, app):
        self.app = app

    def __call__(self, method, path, body=None, key=None, ip='127.0.0.1', headers=None):
        def at_ip(environ, start_response):
            environ['REMOTE_ADDR'] = ip
            return self.app(environ, start_response)
        return mp.call_app(at_ip, method, path, body, key, headers)


def build(tmp_path, **settings):
    values = dict(db=str(tmp_path / 'x.db'), rate_limits='on', admin_key=ADMIN_KEY, keyed_rate_scale=1.0)
    values.update(settings)
    return wiring.make_app(mp.Settings(**values))


@pytest.fixture
def limited(tmp_path, real_clock):
    real_clock.set(START)
    app = build(tmp_path)
    yield Caller(app)
    app.service.close()


def new_key(call):
    """A member key made directly (not through the rate-limited registration route)."""
    return mp.create_account(call.app.service.db, 'member')[1]


def assert_limited(answer, limit, retry_after, reset=WINDOW_END):
    status, headers, body = answer
    assert status == 429, answer
    assert header(answer, 'Content-Type') == JSON_TYPE
    assert body['code'] == 'rate_limited'
    assert body['status'] == 429
    assert isinstance(body['error'], str) and body['error']
    assert header(answer, 'Retry-After') == str(retry_after)
    assert header(answer, 'X-RateLimit-Limit') == str(limit)
    assert header(answer, 'X-RateLimit-Remaining') == '0'
    assert header(answer, 'X-RateLimit-Reset') == str(reset)
    assert body['retryAfter'] == retry_after


def use_up(call, count, method, path, body=None, key=None, ip='127.0.0.1', expect=200, headers=None):
    """Make `count` requests that must all pass; return their answers."""
    answers = []
    for _ in range(count):
        answer = call(method, path, body, key=key, ip=ip, headers=headers)
        assert answer[0] == expect, answer
        answers.append(answer)
    return answers


# Reads ---------------------------------------------------------------------------

def test_61st_get_in_an_hour_is_429(limited):
    answers = use_up(limited, 60, 'GET', '/api/jobs')
    assert [header(a, 'X-RateLimit-Limit') for a in answers] == ['60'] * 60
    assert [header(a, 'X-RateLimit-Remaining') for a in answers] == [str(n) for n in range(59, -1, -1)]
    assert {header(a, 'X-RateLimit-Reset') for a in answers} == {str(WINDOW_END)}
    assert all(header(a, 'Retry-After') is None for a in answers)
    assert_limited(limited('GET', '/api/jobs'), 60, 1200)
    # Still limited a moment later, with the wait counting down.
    mp.CLOCK.set(START + timedelta(minutes=19, seconds=59, milliseconds=500))
    assert_limited(limited('GET', '/api/jobs'), 60, 1)


def test_each_endpoint_is_counted_on_its_own(limited):
    use_up(limited, 60, 'GET', '/api/jobs')
    assert_limited(limited('GET', '/api/jobs'), 60, 1200)
    agent_id = str(uuid.uuid4())
    for path in ('/api/agents', '/api/stats', f'/api/agents/{agent_id}'):
        answer = limited('GET', path)
        assert answer[0] in (200, 404), answer
        assert header(answer, 'X-RateLimit-Remaining') == '59'
    # One route template is one endpoint, whatever its ids.
    for remaining in range(58, -1, -1):
        assert header(limited('GET', f'/api/agents/{uuid.uuid4()}'), 'X-RateLimit-Remaining') == str(remaining)
    assert_limited(limited('GET', f'/api/agents/{uuid.uuid4()}'), 60, 1200)


def test_health_is_never_limited(limited):
    use_up(limited, 60, 'GET', '/api/jobs')
    assert_limited(limited('GET', '/api/jobs'), 60, 1200)
    for _ in range(100):
        answer = limited('GET', '/api/health')
        assert answer[0] == 200, answer
        assert answer[2]['status'] == 'ok'


def test_health_does_not_use_up_the_get_bucket(limited):
    use_up(limited, 100, 'GET', '/api/health')
    answer = limited('GET', '/api/jobs')
    assert answer[0] == 200
    assert header(answer, 'X-RateLimit-Remaining') == '59'


def test_admin_requests_are_not_counted(limited):
    use_up(limited, 70, 'GET', '/api/jobs', key=ADMIN_KEY)
    answer = limited('GET', '/api/jobs')
    assert answer[0] == 200
    assert header(answer, 'X-RateLimit-Remaining') == '59'
    # And an admin is never refused, even from an IP that is limited.
    use_up(limited, 59, 'GET', '/api/jobs')
    assert_limited(limited('GET', '/api/jobs'), 60, 1200)
    assert limited('GET', '/api/jobs', key=ADMIN_KEY)[0] == 200
    use_up(limited, 25, 'POST', '/api/jobs', job_body(), key=ADMIN_KEY, expect=201)
    use_up(limited, 12, 'POST', '/api/accounts', {'name': 'by admin'}, key=ADMIN_KEY, expect=201)


def test_an_unknown_or_revoked_key_is_401_before_anything_is_counted(limited):
    key = new_key(limited)
    db = limited.app.service.db
    mp.revoke_key(db, db.value('SELECT id FROM api_keys WHERE key_hash = :h', {'h': mp.hash_key(key)}))
    for bad in ('mk_not_a_key_' + 'x' * 40, key):
        for _ in range(70):
            status, headers, body = limited('GET', '/api/jobs', key=bad)
            assert (status, body['code']) == (401, 'unauthorized')
    answer = limited('GET', '/api/jobs')
    assert answer[0] == 200 and header(answer, 'X-RateLimit-Remaining') == '59'


def test_a_key_is_counted_per_key_at_ten_times_the_limit_and_not_against_its_address(tmp_path, real_clock):
    real_clock.set(START)
    app = build(tmp_path, keyed_rate_scale=10.0)
    try:
        call = Caller(app)
        first, second = (mp.create_account(app.service.db, name)[1] for name in ('first', 'second'))
        answers = use_up(call, 600, 'GET', '/api/jobs', key=first)
        assert header(answers[0], 'X-RateLimit-Limit') == '600'
        assert_limited(call('GET', '/api/jobs', key=first), 600, 1200)
        assert header(call('GET', '/api/jobs', key=second), 'X-RateLimit-Remaining') == '599'
        assert header(call('GET', '/api/jobs'), 'X-RateLimit-Remaining') == '59'     # the address: untouched
    finally:
        app.service.close()


def test_the_demos_scale_answers_200_gets_in_a_minute(tmp_path, real_clock):
    """`make run` serves with --rate-limit-scale 100: an agent polling the demo never meets a 429."""
    real_clock.set(START)
    app = build(tmp_path, rate_limit_scale=100)
    try:
        answers = use_up(Caller(app), 200, 'GET', '/api/jobs')
        assert header(answers[-1], 'X-RateLimit-Remaining') == str(6000 - 200)
    finally:
        app.service.close()


DISCOVERY = ('/api/health', '/api/openapi.json', '/.well-known/agent-card.json', '/.well-known/agent.json',
             '/api/x402')


def test_discovery_documents_are_never_limited_and_answer_304_to_their_etag(limited):
    use_up(limited, 60, 'GET', '/api/jobs')
    assert_limited(limited('GET', '/api/jobs'), 60, 1200)
    agent = mp.create_account(limited.app.service.db, 'owner')[1]
    made = limited('POST', '/api/agents', {'name': 'carded', 'walletAddress': '0x' + 'ab' * 20}, key=agent)
    paths = DISCOVERY + (f'/api/agents/{made[2]["agent"]["id"]}/card',)
    for path in paths:
        answers = use_up(limited, 80, 'GET', path)
        etag = header(answers[-1], 'ETag')
        assert etag and header(answers[-1], 'X-RateLimit-Limit') is None, path
        assert header(answers[-1], 'Cache-Control') == ('public, max-age=1' if path == '/api/health' else
                                                        'public, max-age=60'), path
        status, headers, body = limited('GET', path, headers={'If-None-Match': etag})
        assert (status, body) == (304, None) or (status, body) == (304, b''), (path, status, body)


# Writes ----------------------------------------------------------------------------

def test_accounts_are_limited_at_10_per_hour(limited):
    answers = use_up(limited, 10, 'POST', '/api/accounts', {'name': 'n'}, expect=201)
    assert [header(a, 'X-RateLimit-Limit') for a in answers] == ['10'] * 10
    assert [header(a, 'X-RateLimit-Remaining') for a in answers] == [str(n) for n in range(9, -1, -1)]
    assert_limited(limited('POST', '/api/accounts', {'name': 'n'}), 10, 1200)
    assert limited.app.service.db.value("SELECT count(*) FROM accounts WHERE role = 'member'") == 10


def test_the_registration_endpoints_are_counted_apart(limited):
    use_up(limited, 10, 'POST', '/api/agents/register', {'name': 'a', 'walletAddress': '0x' + 'ab' * 20},
           expect=201)
    assert_limited(limited('POST', '/api/agents/register', {'name': 'a', 'walletAddress': '0x' + 'ab' * 20}),
                   10, 1200)
    answer = limited('POST', '/api/accounts', {'name': 'n'})
    assert answer[0] == 201 and header(answer, 'X-RateLimit-Remaining') == '9'
    assert limited.app.service.db.value("SELECT count(*) FROM accounts WHERE role = 'member'") == 11


def test_post_jobs_is_limited_at_20_per_hour(limited):
    key = new_key(limited)
    answers = use_up(limited, 20, 'POST', '/api/jobs', job_body(), key=key, expect=201)
    assert [header(a, 'X-RateLimit-Limit') for a in answers] == ['20'] * 20
    assert header(answers[0], 'X-RateLimit-Remaining') == '19'
    assert header(answers[-1], 'X-RateLimit-Remaining') == '0'
    assert_limited(limited('POST', '/api/jobs', job_body(), key=key), 20, 1200)
    assert limited.app.service.db.value('SELECT count(*) FROM jobs') == 20


def test_post_agents_is_limited_at_10_per_hour(limited):
    key = new_key(limited)
    body = {'name': 'a', 'walletAddress': '0x' + 'ab' * 20}
    use_up(limited, 10, 'POST', '/api/agents', body, key=key, expect=201)
    assert_limited(limited('POST', '/api/agents', body, key=key), 10, 1200)


def test_job_actions_are_limited_at_30_per_hour(limited):
    key = new_key(limited)
    for index in range(30):
        answer = limited('POST', f'/api/jobs/{uuid.uuid4()}/cancel', {}, key=key)
        assert answer[0] == 404, answer
        assert header(answer, 'X-RateLimit-Limit') == '30'
        assert header(answer, 'X-RateLimit-Remaining') == str(29 - index)
    assert_limited(limited('POST', f'/api/jobs/{uuid.uuid4()}/cancel', key=key), 30, 1200)
    for action in ('claim', 'deliver', 'verify', 'submit'):        # each job action is its own endpoint
        answer = limited('POST', f'/api/jobs/{uuid.uuid4()}/{action}', {}, key=key)
        assert answer[0] in (400, 404) and header(answer, 'X-RateLimit-Remaining') == '29', (action, answer)


def test_buckets_are_independent(limited):
    key = new_key(limited)
    use_up(limited, 60, 'GET', '/api/jobs')
    assert_limited(limited('GET', '/api/jobs'), 60, 1200)
    answer = limited('POST', '/api/jobs', job_body(), key=key)
    assert answer[0] == 201, answer
    assert header(answer, 'X-RateLimit-Limit') == '20'
    assert header(answer, 'X-RateLimit-Remaining') == '19'
    answer = limited('POST', '/api/accounts', {'name': 'n'})
    assert answer[0] == 201, answer
    assert header(answer, 'X-RateLimit-Remaining') == '9'
    use_up(limited, 19, 'POST', '/api/jobs', job_body(), key=key, expect=201)
    assert_limited(limited('POST', '/api/jobs', job_body(), key=key), 20, 1200)
    answer = limited('POST', '/api/agents', {'name': 'a', 'walletAddress': '0x' + 'ab' * 20}, key=key)
    assert answer[0] == 201, answer
    assert header(answer, 'X-RateLimit-Remaining') == '9'


def test_a_new_hour_resets_every_bucket(limited):
    key = new_key(limited)
    use_up(limited, 60, 'GET', '/api/jobs')
    use_up(limited, 20, 'POST', '/api/jobs', job_body(), key=key, expect=201)
    assert_limited(limited('GET', '/api/jobs'), 60, 1200)
    mp.CLOCK.advance(minutes=19, seconds=59)          # 16:59:59, still the same window
    assert_limited(limited('GET', '/api/jobs'), 60, 1)
    mp.CLOCK.advance(seconds=1)                       # 17:00:00, a new window
    answer = limited('GET', '/api/jobs')
    assert answer[0] == 200, answer
    assert header(answer, 'X-RateLimit-Remaining') == '59'
    assert header(answer, 'X-RateLimit-Reset') == str(NEXT_WINDOW_END)
    answer = limited('POST', '/api/jobs', job_body(), key=key)
    assert answer[0] == 201, answer
    assert header(answer, 'X-RateLimit-Remaining') == '19'
    use_up(limited, 59, 'GET', '/api/jobs')
    assert_limited(limited('GET', '/api/jobs'), 60, 3600, reset=NEXT_WINDOW_END)


# Client IPs ----------------------------------------------------------------------------

def test_each_ip_has_its_own_buckets(limited):
    use_up(limited, 60, 'GET', '/api/jobs', ip='10.0.0.1')
    assert_limited(limited('GET', '/api/jobs', ip='10.0.0.1'), 60, 1200)
    answer = limited('GET', '/api/jobs', ip='10.0.0.2')
    assert answer[0] == 200, answer
    assert header(answer, 'X-RateLimit-Remaining') == '59'
    answer = limited('GET', '/api/jobs', ip='127.0.0.1')
    assert header(answer, 'X-RateLimit-Remaining') == '59'
    assert_limited(limited('GET', '/api/jobs', ip='10.0.0.1'), 60, 1200)


def test_forwarded_for_is_ignored_without_trust_proxy(limited):
    use_up(limited, 60, 'GET', '/api/jobs', headers={'X-Forwarded-For': '1.1.1.1'})
    for forwarded in ('3.3.3.3', '1.1.1.1, 3.3.3.3', ''):
        assert_limited(limited('GET', '/api/jobs', headers={'X-Forwarded-For': forwarded}), 60, 1200)
    assert_limited(limited('GET', '/api/jobs'), 60, 1200)
    answer = limited('GET', '/api/jobs', ip='10.9.9.9', headers={'X-Forwarded-For': '1.1.1.1'})
    assert answer[0] == 200
    assert header(answer, 'X-RateLimit-Remaining') == '59'


@pytest.fixture
def behind_proxy(tmp_path, real_clock):
    real_clock.set(START)
    app = build(tmp_path, trust_proxy=True)
    yield Caller(app)
    app.service.close()


def test_trust_proxy_uses_the_last_forwarded_hop(behind_proxy):
    call = behind_proxy
    use_up(call, 60, 'GET', '/api/jobs', headers={'X-Forwarded-For': '1.1.1.1, 2.2.2.2'})
    # Same last hop: same client, whatever comes before it (a client can forge the earlier entries).
    for forwarded in ('2.2.2.2', '9.9.9.9, 2.2.2.2', '1.1.1.1,2.2.2.2', ' 7.7.7.7 ,  2.2.2.2 '):
        assert_limited(call('GET', '/api/jobs', headers={'X-Forwarded-For': forwarded}), 60, 1200)
    # Another last hop: another client, even from the same proxy socket.
    answer = call('GET', '/api/jobs', headers={'X-Forwarded-For': '2.2.2.2, 1.1.1.1'})
    assert answer[0] == 200, answer
    assert header(answer, 'X-RateLimit-Remaining') == '59'
    # No header: the socket's address.
    answer = call('GET', '/api/jobs')
    assert answer[0] == 200, answer
    assert header(answer, 'X-RateLimit-Remaining') == '59'
    answer = call('GET', '/api/jobs', headers={'X-Forwarded-For': ''})
    assert header(answer, 'X-RateLimit-Remaining') == '58'


# Settings --------------------------------------------------------------------------

def test_scale_one_tenth_makes_get_limit_6(tmp_path, real_clock):
    real_clock.set(START)
    app = build(tmp_path, rate_limit_scale=0.1)
    try:
        call = Caller(app)
        answers = use_up(call, 6, 'GET', '/api/jobs')
        assert [header(a, 'X-RateLimit-Limit') for a in answers] == ['6'] * 6
        assert [header(a, 'X-RateLimit-Remaining') for a in answers] == ['5', '4', '3', '2', '1', '0']
        assert_limited(call('GET', '/api/jobs'), 6, 1200)
        key = mp.create_account(app.service.db, 'm')[1]
        use_up(call, 2, 'POST', '/api/jobs', job_body(), key=key, expect=201)
        assert_limited(call('POST', '/api/jobs', job_body(), key=key), 2, 1200)
    finally:
        app.service.close()


def test_scale_ten_makes_get_limit_600(tmp_path, real_clock):
    real_clock.set(START)
    app = build(tmp_path, rate_limit_scale=10)
    try:
        answer = Caller(app)('GET', '/api/jobs')
        assert header(answer, 'X-RateLimit-Limit') == '600'
        assert header(answer, 'X-RateLimit-Remaining') == '599'
    finally:
        app.service.close()


def test_rate_limits_off(client, real_clock):
    real_clock.set(START)
    for _ in range(100):
        answer = client.get('/api/jobs')
        assert answer.status == 200
        assert {name.lower() for name in answer.headers} & {'x-ratelimit-limit', 'retry-after'} == set()


def test_a2a_messages_have_a_class_of_their_own_at_120_an_hour_per_key(tmp_path, real_clock):
    """POST /message:send and /message:stream (each may store a task) are counted in the class `a2a`: 120 an hour per
    key at the default --keyed-rate-scale of 10, each endpoint on its own, apart from the other classes (MCP's 600
    per key, reads) and from another key."""
    real_clock.set(START)
    app = build(tmp_path, keyed_rate_scale=10.0)
    try:
        call = Caller(app)
        first, second = (mp.create_account(app.service.db, name)[1] for name in ('first', 'second'))
        sent = {'message': {'messageId': 'm-1', 'role': 'ROLE_USER', 'parts': [{'text': 'hello'}]}}
        assert mp.RATE_LIMITS['a2a'] * mp.Settings().keyed_rate_scale == 120
        answers = use_up(call, 120, 'POST', '/message:send', sent, key=first)
        assert [header(answers[n], 'X-RateLimit-Remaining') for n in (0, 119)] == ['119', '0']
        assert header(answers[0], 'X-RateLimit-Limit') == '120'
        assert_limited(call('POST', '/message:send', sent, key=first), 120, 1200)
        streamed = call('POST', '/message:stream', sent, key=first)
        assert (streamed[0], header(streamed, 'X-RateLimit-Remaining')) == (200, '119')
        assert header(call('POST', '/message:send', sent, key=second), 'X-RateLimit-Remaining') == '119'
        assert header(call('POST', '/mcp', {}, key=first), 'X-RateLimit-Limit') == '6000'
        assert header(call('GET', '/api/jobs', key=first), 'X-RateLimit-Remaining') == '599'
        mp.CLOCK.advance(minutes=20)                    # 17:00:00, a new window
        answer = call('POST', '/message:send', sent, key=first)
        assert (answer[0], header(answer, 'X-RateLimit-Remaining')) == (200, '119')
    finally:
        app.service.close()
