"""Every error is JSON of one shape, on every route (CONTRACT.md section 1)."""

import io
import json
import re
import sys
import uuid

import pytest

import marketplace as mp
import openapi_spec
from conftest import ADMIN_KEY, Client, make_account, make_agent, make_job

JSON_TYPE = 'application/json; charset=utf-8'
SNAKE = re.compile(r'^[a-z]+(_[a-z]+)*$')

WRITES = ('POST', 'PATCH')
# POST routes that need no API key (open registration; checking an x402 payment; Stripe's events, signed; OAuth's
# registration and token endpoints, which issue the tokens).
NO_KEY = {'/api/accounts', '/api/agents/register', '/api/x402', '/api/stripe/webhook', '/oauth/register',
          '/oauth/token'}
# POST routes that take no body at all (cancel's body is optional but still parsed; POST /api/x402 reads the
# payment from its X-PAYMENT header), or whose raw body is checked by its signature before it is parsed (Stripe's
# events: tests/test_stripe_funding.py).
NO_BODY = {'/api/x402', '/api/stripe/webhook'}
# Routes of protocols that answer errors in their own form (CONTRACT 22): MCP's JSON-RPC errors at /mcp, A2A's
# google.rpc.Status on its binding, OAuth's {error, error_description} (and its token endpoint's form-encoded body);
# tests/test_mcp_http.py, tests/test_a2a.py and tests/test_oauth.py send them malformed input. Every other check
# here holds for them too (an unknown path below them, a wrong method, a missing or unknown key, a body over 1 MiB).
OWN_ERRORS = {'/mcp', '/message\\:send', '/message\\:stream', '/tasks/<task_id:re:[^/:]+>',
              '/tasks/<task_id>\\:cancel',
              '/oauth/register', '/oauth/token'}


def header(answer_headers, name):
    found = {key.lower(): value for key, value in answer_headers.items()}
    return found.get(name.lower())


def call(app, method, path, body=None, key=None, headers=None):
    return mp.call_app(app, method, path, body, key, headers)


def assert_error(answer, status, code, where=''):
    got_status, headers, body = answer
    assert got_status == status, (where, got_status, body)
    assert header(headers, 'Content-Type') == JSON_TYPE, (where, headers)
    assert isinstance(body, dict), (where, body)
    assert set(body) - {'fields'} == {'error', 'code', 'status'}, (where, body)
    assert isinstance(body['error'], str) and body['error'].strip(), (where, body)
    assert isinstance(body['code'], str) and SNAKE.match(body['code']), (where, body)
    assert body['status'] == status, (where, body)
    assert body['code'] == code, (where, body)
    assert '<html' not in body['error'].lower() and 'Traceback' not in body['error'], (where, body)
    return headers, body


# The pages for people answer their refusals as pages (HTML), with the same status.
PAGES = {path for (method, path), entry in openapi_spec.API_OPERATIONS.items() if entry['tags'] == ['Pages']}


def assert_page_error(answer, status, where=''):
    got_status, headers, body = answer
    assert got_status == status, (where, got_status, body[:300])
    assert header(headers, 'Content-Type') == 'text/html; charset=utf-8', (where, headers)
    assert f'<h1>{status} '.encode() in body and b'Traceback' not in body, (where, body[:300])


def allowed(headers):
    return {method.strip() for method in header(headers, 'Allow').split(',') if method.strip()}


def mp_client(app):
    return Client(app)


def fill(path, value):
    return re.sub(r'<[^>]+>', value, path).replace('\\:', ':')   # bottle's escaped colon (/message\\:send) is a colon


def body_target(app, path):
    """Where, and with which key, a caller with every right sends bodies to `path`: rights come before the body
    (CONTRACT.md 19), so the admin key on a real job or agent of the admin's (their owner's rights are checked
    first), with an admin's arbitrator for votes: (path, key)."""
    client = mp_client(app)
    if path.endswith('/vote'):
        answer = client.post('/api/arbitrators', {'name': 'judge', 'walletAddress': '0x' + '7' * 40}, key=ADMIN_KEY)
        assert answer.status == 201, answer
    if '<job_id>' in path:
        path = path.replace('<job_id>', make_job(client, ADMIN_KEY)['id'])
    if '<agent_id>' in path:
        path = path.replace('<agent_id>', make_agent(client, ADMIN_KEY)[0]['id'])
    return fill(path, str(uuid.uuid4())), ADMIN_KEY


def test_every_route_answers_errors_as_json(app):
    _, key = make_account(mp_client(app), 'caller')
    methods_of = {}
    for method, path, _, _ in mp.ROUTES:
        methods_of.setdefault(path, set()).add(method)
    post_paths = {path for method, path, _, _ in mp.ROUTES if method in WRITES}
    # Every POST route is classified, so that a new one cannot slip past the body checks unnoticed.
    assert NO_KEY <= post_paths and NO_BODY <= post_paths
    assert len(mp.ROUTES) >= 15
    checked = 0

    for method, path, _, _ in mp.ROUTES:
        concrete = fill(path, str(uuid.uuid4()))
        where = f'{method} {path}'
        keyed = openapi_spec.API_OPERATIONS[(method, path)].get('auth') == 'key'

        # Unknown path below this one: 404, for GET and for the route's own method.
        for probe in {'GET', method}:
            assert_error(call(app, probe, concrete + '/no/such/thing', {} if probe in WRITES else None, key=key),
                         404, 'not_found', f'{probe} {path}/no/such/thing')

        # Wrong method: 405 with an Allow header naming the methods the path does take.
        wrong_methods = ['DELETE', 'PUT'] + (['GET'] if 'GET' not in methods_of[path] else ['POST'] if
                                             'POST' not in methods_of[path] else [])
        for wrong in wrong_methods:
            headers, body = assert_error(call(app, wrong, concrete, key=key), 405, 'method_not_allowed',
                                         f'{wrong} {path}')
            assert methods_of[path] <= allowed(headers), (where, wrong, headers)
            assert wrong not in allowed(headers), (where, wrong, headers)

        # A malformed UUID in the path: 400 invalid_uuid (with a valid key for POST routes).
        if path in OWN_ERRORS:
            pass
        elif '<' in path and path in PAGES:
            for bad in ('not-a-uuid', str(uuid.uuid4()) + '0'):
                assert_page_error(call(app, method, fill(path, bad)), 400, f'{where} with {bad}')
            assert_page_error(call(app, method, concrete), 404, where)
        elif '<' in path:
            for bad in ('not-a-uuid', '1234', str(uuid.uuid4())[:-1] + 'g', str(uuid.uuid4()) + '0'):
                _, body = assert_error(call(app, method, fill(path, bad), {} if method in WRITES else None,
                                            key=key if keyed else None),
                                       400, 'invalid_uuid', f'{where} with {bad}')
                param = re.search(r'<(\w+)>', path).group(1)          # job_id -> jobId
                assert body['fields'] == {re.sub(r'_(\w)', lambda m: m.group(1).upper(), param): 'must be a UUID'}

        if keyed:     # no key or an unknown key: 401
            headers, _ = assert_error(call(app, method, concrete, {} if method in WRITES else None), 401,
                                      'unauthorized', where)
            assert header(headers, 'WWW-Authenticate').split(' ')[0] == 'Bearer'
        if method in WRITES:
            # No key: 401, except the open-registration routes.
            if path not in NO_KEY:
                headers, _ = assert_error(call(app, method, concrete, {}), 401, 'unauthorized', where)
                assert header(headers, 'WWW-Authenticate').split(' ')[0] == 'Bearer'
                headers, _ = assert_error(call(app, method, concrete, {}, key='mk_unknown_' + 'x' * 40),
                                          401, 'unauthorized', where)
                assert header(headers, 'WWW-Authenticate').split(' ')[0] == 'Bearer'

            # A body over 1 MiB: 413, whatever the route (at /mcp, read whole, a JSON-RPC error with the same code
            # and status: CONTRACT 25).
            huge = b'{"name": "' + b'x' * mp.MAX_BODY + b'"}'
            for raw in (huge, b' ' * (mp.MAX_BODY + 1)):
                if path == '/mcp':
                    status, headers, body = call(app, method, concrete, raw, key=key)
                    assert header(headers, 'Content-Type') == JSON_TYPE, (where, headers)
                    assert (status, body['code'], body['status'], body['error']['code']) == \
                        (413, 'body_too_large', 413, -32600), (where, body)
                else:
                    assert_error(call(app, method, concrete, raw, key=key), 413, 'body_too_large', where)

            if path not in NO_BODY | OWN_ERRORS:
                target, target_key = body_target(app, path)
                for raw in (b'{nope', b'[1, 2]', b'[]', b'"text"', b'42', b'null', b'{"a": 1} trailing',
                            b'\xff\xfe{}', b'{"a": NaN'):
                    assert_error(call(app, method, target, raw, key=target_key), 400, 'invalid_json',
                                 f'{where} with {raw[:20]!r}')
        checked += 1

    assert checked == len(mp.ROUTES)
    # Nothing was created by any refused request (the caller's account and the admin only; body_target's jobs,
    # agents and arbitrators, one per route it served, are its own).
    db = app.service.db
    caller = "(SELECT id FROM accounts WHERE name = 'caller')"
    assert db.value(f'SELECT count(*) FROM jobs WHERE requester_id = {caller}') == 0
    assert db.value(f'SELECT count(*) FROM agents WHERE account_id = {caller}') == 0
    served = {path for method, path in body_routes()}
    assert db.value('SELECT count(*) FROM accounts') == 2
    assert db.value('SELECT count(*) FROM jobs') == sum('<job_id>' in path for path in served)
    assert db.value('SELECT count(*) FROM agents') == sum('<agent_id>' in path for path in served)
    assert db.value('SELECT count(*) FROM arbitrators') == sum(path.endswith('/vote') for path in served)


def test_open_registration_routes_really_need_no_key(client):
    answer = client.post('/api/accounts', {'name': 'x'})
    assert answer.status == 201, answer
    answer = client.post('/api/agents/register', {'name': 'x', 'walletAddress': '0x' + 'ab' * 20})
    assert answer.status == 201, answer


def test_unknown_paths_are_json_404(app):
    for method, path in [('GET', '/nope'), ('GET', '/api'), ('GET', '/api/nope'), ('POST', '/api/nope'),
                         ('GET', '/index.html'), ('DELETE', '/api/jobs/x/y/z'), ('GET', '/api/health/')]:
        assert_error(call(app, method, path), 404, 'not_found', f'{method} {path}')


def test_a_500_is_json_without_a_traceback(app):
    app.route('/boom', 'GET', lambda: 1 / 0)
    status, headers, body = call(app, 'GET', '/boom')
    assert_error((status, headers, body), 500, 'internal_error', 'GET /boom')
    text = repr(body)
    assert 'Traceback' not in text
    assert 'ZeroDivisionError' not in text
    assert 'division by zero' not in text
    assert 'marketplace.py' not in text


def test_a_500_inside_an_api_handler_is_json(app, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError('secret internals')
    monkeypatch.setattr(mp, 'find_jobs', broken)
    status, headers, body = call(app, 'GET', '/api/jobs')
    assert_error((status, headers, body), 500, 'internal_error', 'GET /api/jobs')
    assert 'secret internals' not in repr(body)


def test_head_on_get_routes(app, client, market):
    job = market.job()
    for path in ('/api/health', '/api/jobs', f'/api/jobs/{job["id"]}', '/api/agents',
                 f'/api/agents/{market.agent["id"]}', '/api/stats'):
        status, headers, body = call(app, 'HEAD', path)
        assert status == 200, (path, status, body)
        assert body == b''
        assert header(headers, 'Content-Type') == JSON_TYPE
        get_status, get_headers, _ = call(app, 'GET', path)
        assert get_status == 200
        assert header(headers, 'Content-Length') == header(get_headers, 'Content-Length')


def test_head_on_a_bad_id_is_still_400(app):
    status, headers, body = call(app, 'HEAD', '/api/jobs/not-a-uuid')
    assert status == 400
    assert body == b''
    assert header(headers, 'Content-Type') == JSON_TYPE


def test_empty_body_on_post_jobs(client):
    _, key = make_account(client)
    for raw in (b'', b'   ', b'\n'):
        answer = client.post('/api/jobs', raw, key=key)
        assert answer.status == 400, answer
        assert answer.json['code'] == 'invalid_json'
        assert answer.json['status'] == 400


def test_deeply_nested_json_is_400_not_500(client):
    _, key = make_account(client)
    for raw in (b'[' * 100_000, b'{"a":' * 100_000, b'[' * 100_000 + b']' * 100_000,
                b'{"title": ' + b'[' * 100_000 + b']' * 100_000 + b'}'):
        answer = client.post('/api/jobs', raw, key=key)
        assert answer.status in (400,), answer
        if raw.startswith(b'{"title": '):
            # Valid JSON, absurdly deep: refused as invalid JSON or as an invalid field, never a 500.
            assert answer.json['code'] in ('invalid_json', 'validation_failed'), answer
        else:
            assert answer.json['code'] == 'invalid_json', answer


def test_body_without_content_length_over_1_mib_is_413(app):
    _, key = make_account(mp_client(app))
    raw = b'{"title": "' + b'x' * (mp.MAX_BODY + 10) + b'"}'
    environ = {
        'REQUEST_METHOD': 'POST', 'PATH_INFO': '/api/jobs', 'QUERY_STRING': '', 'SERVER_NAME': '127.0.0.1',
        'SERVER_PORT': '8080', 'SERVER_PROTOCOL': 'HTTP/1.1', 'REMOTE_ADDR': '127.0.0.1',
        'wsgi.url_scheme': 'http', 'wsgi.input': io.BytesIO(raw), 'wsgi.errors': sys.stderr,
        'wsgi.version': (1, 0), 'wsgi.multithread': False, 'wsgi.multiprocess': False,
        'wsgi.run_once': False, 'CONTENT_TYPE': 'application/json', 'HTTP_AUTHORIZATION': f'Bearer {key}',
    }
    seen = {}

    def start_response(status, headers, exc_info=None):
        seen['status'], seen['headers'] = int(status.split()[0]), dict(headers)

    data = b''.join(app(environ, start_response))
    assert_error((seen['status'], seen['headers'], json.loads(data)), 413, 'body_too_large', 'chunked')


def test_validation_errors_carry_fields(client):
    _, key = make_account(client)
    answer = client.post('/api/jobs', {'title': '', 'paymentAmount': '1.234'}, key=key)
    assert answer.status == 400, answer
    assert answer.json['code'] == 'validation_failed'
    assert set(answer.json['fields']) == {'title', 'description', 'category', 'paymentAmount', 'deadline'}
    assert all(isinstance(v, str) and v for v in answer.json['fields'].values())


def body_routes():
    return sorted({(method, path) for method, path, _, _ in mp.ROUTES
                   if method in WRITES and path not in NO_BODY | OWN_ERRORS})


def test_non_finite_numbers_are_not_json(app):
    """NaN, Infinity and numbers that overflow a double are not JSON (RFC 8259): 400 invalid_json,
    or they would be stored and later sent out as NaN/Infinity, which strict parsers refuse."""
    for method, path in body_routes():
        concrete, key = body_target(app, path)
        for number in (b'NaN', b'Infinity', b'-Infinity', b'1e400'):
            assert_error(call(app, method, concrete, b'{"name": "x", "extra": ' + number + b'}', key=key),
                         400, 'invalid_json', f'{method} {path} with {number!r}')


def test_uuid_with_a_trailing_newline_is_malformed_on_every_route(app):
    _, key = make_account(mp_client(app))
    for method, path, _, _ in mp.ROUTES:
        if '<' not in path or path in OWN_ERRORS:
            continue
        bad = str(uuid.uuid4()) + '\n'
        keyed = openapi_spec.API_OPERATIONS[(method, path)].get('auth') == 'key'
        if path in PAGES:
            assert_page_error(call(app, method, fill(path, bad)), 400, f'{method} {path}')
            continue
        assert_error(call(app, method, fill(path, bad), {} if method in WRITES else None, key=key if keyed else None),
                     400, 'invalid_uuid', f'{method} {path}')


def test_a_uuid_field_with_a_trailing_newline_is_malformed(client, market):
    job = market.job()
    answer = client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': market.agent['id'] + '\n'},
                         key=market.worker_key)
    assert answer.status == 400, answer
    assert answer.json['code'] == 'invalid_uuid'
    assert answer.json['fields'] == {'agentId': 'must be a UUID'}


@pytest.mark.parametrize('path, field, items', [
    ('/api/jobs?offset=99999999999999999999999', 'offset', 'jobs'),
    ('/api/agents?offset=99999999999999999999999', 'offset', 'agents'),
    ('/api/jobs?min_pay=99999999999999999999999999', 'min_pay', 'jobs'),
    ('/api/jobs?min_pay=1e999999', 'min_pay', 'jobs'),
])
def test_absurd_query_values_never_500(app, path, field, items):
    """Numbers too large for SQLite are refused (400) or match nothing (an empty page); never 500."""
    status, headers, body = call(app, 'GET', path)
    if status == 200:
        assert body[items] == [], path
        assert body['total'] == 0, path
    else:
        _, body = assert_error((status, headers, body), 400, 'invalid_parameter', path)
        assert list(body['fields']) == [field], path


def test_exactly_one_mib_is_read_one_byte_more_is_413(app):
    name = b'x' * (mp.MAX_BODY - len(b'{"name": ""}'))
    exact = b'{"name": "' + name + b'"}'
    assert len(exact) == mp.MAX_BODY
    _, body = assert_error(call(app, 'POST', '/api/accounts', exact), 400, 'validation_failed', 'exact')
    assert body['fields'] == {'name': 'must be at most 100 characters'}
    assert_error(call(app, 'POST', '/api/accounts', exact + b' '), 413, 'body_too_large', 'one more')
