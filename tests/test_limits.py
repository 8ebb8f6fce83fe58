"""Limits on everything a caller controls (docs/limits.md "Limits"): each refused with a clear 4xx, the limit itself
accepted, and nothing stored by a refused request."""
import json
import socket

import pytest

import marketplace as mp
import http_server
from conftest import ADMIN_KEY, assert_error, job_body, make_account


def job_count(app):
    return app.service.db.value('SELECT count(*) FROM jobs')


def post_job(client, key, **overrides):
    return client.post('/api/jobs', job_body(**overrides), key=key)


def nested(depth, leaf='x'):
    """An object nesting `depth` levels deep: {"a": {"a": ... leaf}}."""
    value = leaf
    for _ in range(depth):
        value = {'a': value}
    return value


# Job fields ------------------------------------------------------------------

@pytest.mark.parametrize('field, at_limit, over, message', [
    ('title', 't' * 200, 't' * 201, 'must be at most 200 characters'),
    ('description', 'd' * 20_000, 'd' * 20_001, 'must be at most 20000 characters'),
    ('acceptanceCriteria', [{'type': 'automated', 'check': 'c'}] * 50,
     [{'type': 'automated', 'check': 'c'}] * 51, 'must be an array of at most 50 objects'),
    ('acceptanceCriteria', [{'type': 'automated', 'check': 'c' * 2000}],
     [{'type': 'automated', 'check': 'c' * 2001}], 'each item must be an object with string type and check'),
    ('acceptanceCriteria', [{'type': 'automated', 'check': 'c', 'notes': 'n' * 19_900}],
     [{'type': 'automated', 'check': 'c', 'notes': 'n' * 20_000}],
     'must be at most 20000 bytes of JSON, nesting at most 8 levels deep'),
    ('acceptanceCriteria', [{'type': 'automated', 'check': 'c', 'more': nested(6)}],
     [{'type': 'automated', 'check': 'c', 'more': nested(7)}],
     'must be at most 20000 bytes of JSON, nesting at most 8 levels deep'),
    ('requirements', {'notes': 'n' * 19_900}, {'notes': 'n' * 20_000}, 'must be at most 20000 bytes of JSON'),
    ('requirements', nested(8), nested(9), 'must nest objects and arrays at most 8 levels deep'),
    ('requirements', {'list': [[[[[[[1]]]]]]]}, {'list': [[[[[[[[1]]]]]]]]},
     'must nest objects and arrays at most 8 levels deep'),
    ('maxWorkers', 100, 101, 'must be a whole number from 1 to 100'),
    ('verificationWindowHours', 720, 721, 'must be a whole number from 1 to 720'),
    ('paymentAmount', '1000000.00', '1000000.01', None),
], ids=lambda value: value if isinstance(value, str) and len(value) < 30 else None)
def test_a_job_field_at_its_limit_is_kept_and_over_it_is_400(app, client, field, at_limit, over, message):
    key = make_account(client)[1]
    kept = post_job(client, key, **{field: at_limit})
    assert kept.status == 201, kept.json
    refused = post_job(client, key, **{field: over})
    assert_error(refused, 400, 'validation_failed', fields=[field])
    if message:
        assert refused.json['fields'][field] == message
    assert job_count(app) == 1      # only the one at the limit


def test_the_whole_body_nesting_over_32_levels_is_400_before_parsing(app, client):
    key = make_account(client)[1]
    body = json.dumps(dict(job_body(), requirements=nested(40))).encode()
    answer = client.request('POST', '/api/jobs', body, key=key, headers={'Content-Type': 'application/json'})
    assert_error(answer, 400, 'invalid_json')
    assert answer.json['error'] == 'The request body nests arrays and objects more than 32 levels deep.'
    assert job_count(app) == 0


def test_a_body_over_one_mib_is_413_and_stores_nothing(app, client):
    key = make_account(client)[1]
    answer = post_job(client, key, description='d' * mp.MAX_BODY)
    assert_error(answer, 413, 'body_too_large')
    assert job_count(app) == 0


# Agents ----------------------------------------------------------------------

@pytest.mark.parametrize('field, over, message', [
    ('name', 'n' * 101, 'must be at most 100 characters'),
    ('capabilities', {'categories': ['code'], 'languages': ['python'] * 51},
     'must be an array of at most 50 strings'),
    ('capabilities', {'languages': ['p' * 51]}, 'must hold strings of 1 to 50 characters'),
    ('capabilities', {'notes': 'n' * 10_001}, 'must be at most 10000 bytes of JSON'),
    ('capabilities', {'more': nested(8)}, 'must nest objects and arrays at most 8 levels deep'),
    ('pricing', {'notes': 'n' * 10_001}, 'must be at most 10000 bytes of JSON'),
    ('pricing', {'more': nested(8)}, 'must nest objects and arrays at most 8 levels deep'),
], ids=lambda value: value if isinstance(value, str) and len(value) < 30 else None)
def test_an_agent_field_over_its_limit_is_400(app, client, field, over, message):
    key = make_account(client)[1]
    body = {'name': 'helper', 'walletAddress': '0x' + '1' * 40, field: over}
    answer = client.post('/api/agents', body, key=key)
    assert_error(answer, 400, 'validation_failed', fields=[field])
    assert message in answer.json['fields'][field]
    assert app.service.db.value('SELECT count(*) FROM agents') == 0


def test_an_agent_at_the_limits_is_kept(client):
    key = make_account(client)[1]
    answer = client.post('/api/agents', {
        'name': 'n' * 100, 'walletAddress': '0x' + '1' * 40,
        'capabilities': {'categories': ['code'], 'languages': [f'l{n}' for n in range(50)], 'more': nested(7)},
        'pricing': {'notes': 'n' * 9_000}}, key=key)
    assert answer.status == 201, answer.json
    assert len(answer.json['agent']['capabilities']['languages']) == 50
    assert answer.json['agent']['capabilities']['more'] == nested(7)


# Query strings ---------------------------------------------------------------

@pytest.mark.parametrize('path', ['/api/jobs', '/api/jobs/search', '/api/agents', '/'])
def test_more_than_50_query_parameters_is_400(client, path):
    query = '&'.join(f'p{n}=1' for n in range(51))
    answer = client.get(f'{path}?{query}')
    assert_error(answer, 400, 'invalid_parameter')
    assert answer.json['error'] == 'A request takes at most 50 query parameters.'
    fifty = '&'.join(['category=code'] + [f'p{n}=1' for n in range(49)])
    assert client.get(f'{path}?{fifty}').status == 200


def test_a_search_longer_than_500_characters_is_400_and_the_board_cuts_it(client, market):
    market.job(title='Quokka census')
    assert client.get('/api/jobs/search?q=quokka%20' + 'x' * 493).json['total'] == 0      # 500: searched
    answer = client.get('/api/jobs/search?q=quokka%20' + 'x' * 494)
    assert_error(answer, 400, 'invalid_parameter', fields=['q'])
    assert answer.json['fields']['q'] == 'must be at most 500 characters'
    board = client.get('/?q=quokka' + '%20' * 494 + 'x')        # the board keeps the first 500 characters
    assert board.status == 200 and 'Quokka census' in board.body.decode()


@pytest.mark.parametrize('query, field, problem', [
    ('limit=0', 'limit', 'must be 1 to 200'),
    ('limit=-1', 'limit', 'must be a whole number of at least 1'),
    ('limit=ten', 'limit', 'must be a whole number of at least 1'),
    ('offset=-5', 'offset', 'must be a whole number of at least 0'),
    ('offset=1000000001', 'offset', 'must be at most 1000000000'),
    ('min_pay=-1', 'min_pay', 'must be a number of at least 0'),
    ('min_pay=NaN', 'min_pay', 'must be a number of at least 0'),
    ('categories=' + ','.join(['code'] * 51), 'categories',
     'must list one or more of code, content, data, research, design, custom'),
])
def test_bad_list_parameters_are_400(client, query, field, problem):
    path = '/api/jobs/match' if query.startswith('categories') else '/api/jobs'
    answer = client.get(f'{path}?{query}')
    assert_error(answer, 400, 'invalid_parameter')
    assert answer.json['fields'] == {field: problem}


def test_limit_over_200_is_clamped_and_echoed(client):
    assert client.get('/api/jobs?limit=100000').json['limit'] == 200


# Before the app: the HTTP layer (real server) ------------------------------

def raw_request(server, data):
    with socket.create_connection(('127.0.0.1', server.port), timeout=10) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, body = b''.join(chunks).partition(b'\r\n\r\n')
    return head.decode('latin-1').split('\r\n'), body


def test_a_request_line_over_8_kib_is_414_json(live_server):
    head, body = raw_request(live_server, b'GET /api/jobs?q=' + b'x' * 9000 + b' HTTP/1.1\r\nHost: x\r\n\r\n')
    assert head[0] == 'HTTP/1.1 414 URI Too Long'
    assert 'Content-Type: application/json; charset=utf-8' in head
    assert json.loads(body) == {'error': http_server.PROTOCOL_ERRORS[414][2], 'code': 'uri_too_long', 'status': 414}


def test_more_than_100_headers_is_400_json(live_server):
    headers = b''.join(b'X-Many-%d: 1\r\n' % n for n in range(101))
    head, body = raw_request(live_server, b'GET /api/health HTTP/1.1\r\nHost: x\r\n' + headers + b'\r\n')
    assert head[0] == 'HTTP/1.1 400 Bad Request'
    assert json.loads(body) == {'error': http_server.PROTOCOL_ERRORS[400][2], 'code': 'bad_request', 'status': 400}


def test_a_malformed_content_length_is_400_json_and_the_server_goes_on(live_server):
    head, body = raw_request(live_server, b'POST /api/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: -3\r\n\r\n')
    assert head[0] == 'HTTP/1.1 400 Bad Request'
    assert json.loads(body)['code'] == 'bad_request'
    head, body = raw_request(live_server, b'GET /api/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n')
    assert head[0] == 'HTTP/1.1 200 OK'
    assert json.loads(body)['status'] == 'ok'


def test_admin_key_is_no_way_around_the_limits(app, client):
    answer = post_job(client, ADMIN_KEY, requirements=nested(9))
    assert_error(answer, 400, 'validation_failed', fields=['requirements'])
    assert job_count(app) == 0


# URLs ------------------------------------------------------------------------

URL_PROBLEM = 'must be an http or https URL (RFC 3986: percent-encode spaces, non-ASCII and <>"{}|\\^`)'


@pytest.mark.parametrize('url', ['https://a b/', 'https://a/\x00', 'https://ä.example/', 'https://a/ü', 'https://a/%zz',
                                 'https://a/<x>', 'https://a/{x}', 'https://a/x|y', 'https://a/"', 'https://a/x\\y',
                                 'https://a/?q=[1]', 'https://a/#x#y', 'http://a:99999/', 'https://[zz]/', 'ftp://a/x',
                                 'https://', 'https://a/' + 'x' * 2040])
def test_a_url_that_is_not_an_rfc_3986_uri_is_400(client, market, url):
    """Stored URLs are shown as format "uri" in every answer, so only URIs are stored (webhookUrl, deliverable)."""
    answer = client.post('/api/agents', {'name': 'hooked', 'walletAddress': '0x' + '1' * 40, 'webhookUrl': url},
                         key=market.worker_key)
    assert_error(answer, 400, 'validation_failed', fields=['webhookUrl'])
    assert answer.json['fields']['webhookUrl'] in (URL_PROBLEM, 'must be an http or https URL of at most 2048 characters')
    job = market.job()
    claim = market.claim(job)
    answer = client.post(f'/api/jobs/{job["id"]}/deliver', {'claimId': claim['id'], 'deliverable': {'url': url}},
                         key=market.worker_key)
    assert_error(answer, 400, 'validation_failed', fields=['deliverable.url'])


@pytest.mark.parametrize('url', ['https://example.com/x', 'http://a:8080/p?q=1#f', 'https://[::1]:80/x',
                                 "https://a/!$&'()*+,;=", 'https://a/%C3%BC%20x', 'https://a.b.c/~u?x=/?'])
def test_an_rfc_3986_url_is_kept_as_sent(client, market, url):
    job = market.job()
    claim = market.claim(job)
    answer = client.post(f'/api/jobs/{job["id"]}/deliver', {'claimId': claim['id'], 'deliverable': {'url': url}},
                         key=market.worker_key)
    assert answer.status == 200, answer.json
    assert answer.json['claim']['deliverable']['url'] == url
