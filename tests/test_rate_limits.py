"""Per-IP fixed one-hour rate limits (SPEC.md Limits, CONTRACT.md sections 9 and 11)."""

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
    values = dict(db=str(tmp_path / 'x.db'), rate_limits='on', admin_key=ADMIN_KEY)
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


def test_all_get_endpoints_share_one_bucket(limited):
    agent_id = str(uuid.uuid4())
    for index in range(60):
        path = ['/api/jobs', '/api/agents', '/api/stats', f'/api/agents/{agent_id}'][index % 4]
        answer = limited('GET', path)
        assert answer[0] in (200, 404), answer
        assert header(answer, 'X-RateLimit-Remaining') == str(59 - index)
    for path in ('/api/jobs', '/api/agents', '/api/stats', f'/api/jobs/{uuid.uuid4()}'):
        assert_limited(limited('GET', path), 60, 1200)


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


def test_an_invalid_key_is_counted_like_no_key(limited):
    use_up(limited, 60, 'GET', '/api/jobs', key='mk_not_a_key_' + 'x' * 40)
    assert_limited(limited('GET', '/api/jobs', key='mk_not_a_key_' + 'x' * 40), 60, 1200)
    assert_limited(limited('GET', '/api/jobs'), 60, 1200)


# Writes ----------------------------------------------------------------------------

def test_accounts_are_limited_at_10_per_hour(limited):
    answers = use_up(limited, 10, 'POST', '/api/accounts', {'name': 'n'}, expect=201)
    assert [header(a, 'X-RateLimit-Limit') for a in answers] == ['10'] * 10
    assert [header(a, 'X-RateLimit-Remaining') for a in answers] == [str(n) for n in range(9, -1, -1)]
    assert_limited(limited('POST', '/api/accounts', {'name': 'n'}), 10, 1200)
    # The registration bucket is shared with /api/agents/register.
    assert_limited(limited('POST', '/api/agents/register', {'name': 'a', 'walletAddress': '0x' + 'ab' * 20}),
                   10, 1200)
    assert limited.app.service.db.value("SELECT count(*) FROM accounts WHERE role = 'member'") == 10


def test_registration_bucket_is_shared_both_ways(limited):
    use_up(limited, 6, 'POST', '/api/agents/register', {'name': 'a', 'walletAddress': '0x' + 'ab' * 20},
           expect=201)
    answers = use_up(limited, 4, 'POST', '/api/accounts', {'name': 'n'}, expect=201)
    assert header(answers[-1], 'X-RateLimit-Remaining') == '0'
    assert_limited(limited('POST', '/api/agents/register', {'name': 'a', 'walletAddress': '0x' + 'ab' * 20}),
                   10, 1200)
    assert_limited(limited('POST', '/api/accounts', {'name': 'n'}), 10, 1200)


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
    missing = str(uuid.uuid4())
    for index in range(30):
        action = ['claim', 'deliver', 'verify', 'cancel', 'submit'][index % 5]
        answer = limited('POST', f'/api/jobs/{missing}/{action}', {}, key=key)
        assert answer[0] in (400, 404), answer
        assert header(answer, 'X-RateLimit-Limit') == '30'
        assert header(answer, 'X-RateLimit-Remaining') == str(29 - index)
    assert_limited(limited('POST', f'/api/jobs/{missing}/cancel', key=key), 30, 1200)


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
