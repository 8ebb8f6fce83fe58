"""MCP over Streamable HTTP at `<base-url>/mcp` (CONTRACT.md section 22), through the mcp SDK's own Streamable HTTP
client only, against `marketplace.py serve` as a process: the server starts its MCP child on the first request,
each request acts as the account of its Bearer token, and a bad request is refused before anything is done."""

import json
import socket

import anyio.from_thread
import httpx2
import pytest
import requests
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

import marketplace as mp
import mcp_server
import wiring
from conftest import ADMIN_KEY, LiveServer, in_hours, random_wallet
from test_server import Output, stop

TIMEOUT = 30


@pytest.fixture(scope='module')
def server(tmp_path_factory):
    live = LiveServer(tmp_path_factory.mktemp('mcp') / 'm.db').start()
    live.out = Output(live)
    yield live
    stop(live)


@pytest.fixture(scope='module')
def portal():
    with anyio.from_thread.start_blocking_portal() as portal:
        yield portal


class Session:
    """An MCP session over Streamable HTTP with one token, driven from sync tests through the portal."""

    def __init__(self, portal, client):
        self.portal, self.client = portal, client

    def call(self, tool, **arguments):
        return self.portal.call(self.client.call_tool, tool, arguments)

    def result(self, tool, **arguments):
        answer = self.call(tool, **arguments)
        assert not answer.is_error, answer.content[0].text
        assert json.loads(answer.content[0].text) == answer.structured_content
        return answer.structured_content

    def error(self, tool, **arguments):
        answer = self.call(tool, **arguments)
        assert answer.is_error, answer
        return answer.content[0].text


def connect(portal, server, token, mode='auto'):
    """The SDK's client at /mcp: `mode` 'auto' (its default: discover, else the initialize handshake), 'legacy'
    (the initialize handshake of 2025-11-25) or a protocol version it adopts without asking (2026-07-28)."""
    http = httpx2.AsyncClient(headers={'Authorization': f'Bearer {token}'}, timeout=TIMEOUT)
    return portal.wrap_async_context_manager(Client(streamable_http_client(f'{server.url}/mcp', http_client=http),
                                                    mode=mode))


def account(server, name):
    answer = requests.post(f'{server.url}/api/accounts', json={'name': name}, timeout=TIMEOUT)
    assert answer.status_code == 201, answer.text
    return answer.json()['account'], answer.json()['apiKey']


def test_a_jobs_whole_life_through_the_sdks_http_client_with_two_accounts(server, portal):
    _, requester_key = account(server, 'mcp-requester')
    _, worker_key = account(server, 'mcp-worker')
    with connect(portal, server, requester_key) as requester_client, \
            connect(portal, server, worker_key) as worker_client:
        requester, worker = Session(portal, requester_client), Session(portal, worker_client)
        tools = {tool.name: tool for tool in portal.call(requester.client.list_tools).tools}
        assert {'post_job', 'claim_job', 'verify_delivery', 'register_agent', 'my_claims', 'get_dispute'} <= set(tools)
        assert all(tool.output_schema and tool.output_schema['type'] == 'object' for tool in tools.values())

        job = requester.result('post_job', title='Summarise a paper', description='Two paragraphs.',
                               category='research', payment_amount='12.50', deadline=in_hours(24))['job']
        agent = worker.result('register_agent', name='summariser', wallet_address=random_wallet(),
                              capabilities={'categories': ['research']})['agent']
        claim = worker.result('claim_job', job_id=job['id'], agent_id=agent['id'])['claim']
        mine = worker.result('my_claims')
        assert [(entry['id'], entry['job']['id'], entry['job']['title']) for entry in mine['claims']] == \
            [(claim['id'], job['id'], 'Summarise a paper')]
        assert requester.result('my_claims')['claims'] == []
        worker.result('deliver_job', job_id=job['id'], claim_id=claim['id'], url='https://example.com/summary')
        # The worker may not approve its own delivery: the API's 403 is a tool error, and nothing changes.
        refused = worker.error('verify_delivery', job_id=job['id'], claim_id=claim['id'], approved=True)
        assert '(code: forbidden, status: 403)' in refused
        done = requester.result('verify_delivery', job_id=job['id'], claim_id=claim['id'], approved=True)
        assert (done['job']['status'], done['escrowStatus']) == ('completed', 'released')
        shown = requester.result('get_job', job_id=job['id'])
        assert [p['type'] for p in shown['payments']] == ['escrow', 'release']


def test_without_a_live_token_nothing_reaches_the_tools(server):
    message = {'jsonrpc': '2.0', 'id': 1, 'method': 'tools/list', 'params': {}}
    headers = {'Content-Type': 'application/json', 'Accept': 'application/json, text/event-stream'}
    for extra in ({}, {'Authorization': 'Bearer mk_not-a-key-of-this-service'}, {'Authorization': 'Basic eDp5'}):
        answer = requests.post(f'{server.url}/mcp', json=message, headers={**headers, **extra}, timeout=TIMEOUT)
        assert answer.status_code == 401, answer.text
        assert answer.json()['code'] == 'unauthorized'
        assert answer.headers['WWW-Authenticate'].startswith(
            f'Bearer resource_metadata="{server.url}/.well-known/oauth-protected-resource"')
    assert not any('mk_not-a-key-of-this-service' in line for line in server.out.lines)


def test_bad_json_rpc_an_unknown_tool_and_an_oversized_body_are_refused(server, portal):
    _, key = account(server, 'mcp-bad-input')
    headers = {'Authorization': f'Bearer {key}', 'Content-Type': 'application/json',
               'Accept': 'application/json, text/event-stream'}
    broken = requests.post(f'{server.url}/mcp', data=b'{"jsonrpc": "2.0", "id": 1, "method": ', headers=headers,
                           timeout=TIMEOUT)
    assert broken.status_code == 400, broken.text
    assert broken.json()['error']['code'] == -32700         # JSON-RPC parse error
    too_big = requests.post(f'{server.url}/mcp', data=b'{"x": "' + b'a' * (1024 * 1024) + b'"}', headers=headers,
                            timeout=TIMEOUT)
    assert (too_big.status_code, too_big.json()['code']) == (413, 'body_too_large')
    with connect(portal, server, key) as client:
        session = Session(portal, client)
        unknown = session.call('drain_escrow', job_id='x')
        assert unknown.is_error and 'drain_escrow' in unknown.content[0].text
        before = requests.get(f'{server.url}/api/jobs', timeout=TIMEOUT).json()['total']
        oversized = session.call('post_job', title='t' * 201, description='d', category='code',
                                 payment_amount='1.00', deadline=in_hours(2))
        assert oversized.is_error
        assert requests.get(f'{server.url}/api/jobs', timeout=TIMEOUT).json()['total'] == before


def test_an_admin_key_works_as_any_key(server, portal):
    with connect(portal, server, ADMIN_KEY) as client:
        health = Session(portal, client).result('service_health')
        assert (health['status'], health['payments']) == ('ok', 'simulated')


def test_only_this_processs_child_can_say_whose_address_its_calls_are():
    """The MCP child's API calls carry the caller's address signed with a secret of the serving process, so that
    they count against the caller's rate limits; anyone else's header is ignored."""
    secret = 'a' * 64
    assert mp.relayed_address({'HTTP_X_MARKETPLACE_RELAY': f'{secret} 203.0.113.9'}, secret) == '203.0.113.9'
    assert mp.relayed_address({'HTTP_X_MARKETPLACE_RELAY': f'{"b" * 64} 203.0.113.9'}, secret) is None
    assert mp.relayed_address({'HTTP_X_MARKETPLACE_RELAY': '203.0.113.9'}, secret) is None
    assert mp.relayed_address({}, secret) is None


def test_the_sdks_client_is_served_on_todays_protocol_and_on_the_handshake_of_2025(server, portal):
    """Every Mcp-* header reaches the MCP server (Mcp-Method and Mcp-Name, which 2026-07-28 requires), so a client
    pinned to 2026-07-28 is served, the default client negotiates it, and the initialize handshake still works."""
    _, key = account(server, 'mcp-versions')
    for mode, version in (('2026-07-28', '2026-07-28'), ('auto', '2026-07-28'), ('legacy', '2025-11-25')):
        with connect(portal, server, key, mode) as client:
            assert client.protocol_version == version
            health = Session(portal, client).result('service_health')
            assert (health['status'], health['version']) == ('ok', mp.__version__)
            tools = {tool.name for tool in portal.call(client.list_tools).tools}
            assert tools == set(mcp_server.TOOL_OPERATIONS)


LIST_TOOLS = {'jsonrpc': '2.0', 'id': 1, 'method': 'tools/list', 'params': {}}


def raw_list_tools(server, key, **headers):
    return requests.post(f'{server.url}/mcp', json=LIST_TOOLS, timeout=TIMEOUT, headers={
        'Authorization': f'Bearer {key}', 'Accept': 'application/json, text/event-stream',
        'Mcp-Protocol-Version': '2025-11-25', **headers})


def test_a_page_of_another_site_is_refused_and_a_host_without_origin_served(server):
    """Against DNS rebinding (the MCP specification's transport rule): an Origin of another site is 403, also when
    the page's host name was made to resolve here (its Host then names it too); this site's origin and a request
    without Origin are served."""
    _, key = account(server, 'mcp-origins')
    port = server.url.rsplit(':', 1)[1]
    for headers in ({'Origin': 'http://evil.example'}, {'Origin': f'http://evil.example:{port}'},
                    {'Origin': f'http://rebound.example:{port}', 'Host': f'rebound.example:{port}'},
                    {'Origin': 'null'}, {'Origin': f'https://127.0.0.1:{port}'}):
        refused = raw_list_tools(server, key, **headers)
        assert refused.status_code == 403, (headers, refused.text)
        assert refused.headers['Content-Type'].startswith('application/json')
        assert (refused.json()['code'], refused.json()['status']) == ('cross_site_request', 403)
    for headers in ({}, {'Origin': server.url}, {'Origin': f'http://localhost:{port}',
                                                'Host': f'localhost:{port}'}):
        served = raw_list_tools(server, key, **headers)
        assert served.status_code == 200, (headers, served.text)
        assert {tool['name'] for tool in served.json()['result']['tools']} == set(mcp_server.TOOL_OPERATIONS)


def test_with_a_public_url_only_its_origin_may_call(tmp_path):
    """With --public-url, the only site is the public URL's: the served address is another site then. (In-process:
    the Origin is judged first, so a refusal is 403 and a page of this site reaches the token check, 401.)"""
    app = wiring.make_app(mp.Settings(db=str(tmp_path / 'x.db'), public_url='https://market.example'))
    try:
        def post(origin):
            return mp.call_app(app, 'POST', '/mcp', LIST_TOOLS, headers={'Origin': origin})
        assert post('https://market.example')[0] == 401
        assert post('https://market.example:443')[0] == 401
        for origin in ('http://127.0.0.1:8080', 'http://market.example', 'https://evil.example'):
            status, _, body = post(origin)
            assert (status, body['code']) == (403, 'cross_site_request'), origin
    finally:
        app.service.close()


def test_a_body_over_the_limit_is_a_json_rpc_error_and_the_session_goes_on(server, portal):
    """A 2 MiB tool argument: the official client reports the call's JSON-RPC error (413 body_too_large read whole)
    and its next call on the same session is served, on today's protocol and on 2025's."""
    _, key = account(server, 'mcp-oversized')
    before = requests.get(f'{server.url}/api/jobs', timeout=TIMEOUT).json()['total']
    for mode in ('2026-07-28', 'legacy'):
        with connect(portal, server, key, mode) as client:
            session = Session(portal, client)
            with pytest.raises(MCPError) as refused:
                session.call('post_job', title='Too long', description='d' * (2 * 1024 * 1024), category='code',
                             payment_amount='1.00', deadline=in_hours(2))
            assert refused.value.error.code == -32600
            assert 'larger than 1 MiB' in refused.value.error.message
            assert session.result('service_health')['status'] == 'ok'
    assert requests.get(f'{server.url}/api/jobs', timeout=TIMEOUT).json()['total'] == before


def raw_post(connection, server, key, body, length=None):
    """Send one POST /mcp on an open socket: the head, then `body` (maybe less than its Content-Length)."""
    head = (f'POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nAuthorization: Bearer {key}\r\n'
            'Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n'
            f'Content-Length: {len(body) if length is None else length}\r\n\r\n')
    connection.sendall(head.encode() + body)


def read_answer(connection):
    """(head, body) of one answer with a Content-Length, read from an open socket."""
    data = b''
    while b'\r\n\r\n' not in data:
        chunk = connection.recv(65536)
        assert chunk, f'closed before an answer: {data!r}'
        data += chunk
    head, _, body = data.partition(b'\r\n\r\n')
    length = int(next(line.split(b':')[1] for line in head.split(b'\r\n') if line.lower().startswith(
        b'content-length:')))
    while len(body) < length:
        body += connection.recv(65536)
    return head.decode('latin-1'), json.loads(body)


def test_an_oversized_body_of_up_to_4_mib_is_read_and_answered_and_beyond_the_connection_closes(server):
    _, key = account(server, 'mcp-raw-oversized')
    with socket.create_connection(('127.0.0.1', server.port), timeout=TIMEOUT) as connection:
        raw_post(connection, server, key, b'{"x": "' + b'a' * (4 * 1024 * 1024 - 9) + b'"}')
        head, body = read_answer(connection)
        assert head.startswith('HTTP/1.1 413 ') and 'connection: close' not in head.lower()
        assert (body['jsonrpc'], body['id'], body['error']['code']) == ('2.0', None, -32600)
        assert (body['code'], body['status']) == ('body_too_large', 413)
        raw_post(connection, server, key, json.dumps(LIST_TOOLS).encode())      # the same connection goes on
        head, body = read_answer(connection)
        assert head.startswith('HTTP/1.1 200 ')
        assert {tool['name'] for tool in body['result']['tools']} == set(mcp_server.TOOL_OPERATIONS)
    with socket.create_connection(('127.0.0.1', server.port), timeout=TIMEOUT) as connection:
        raw_post(connection, server, key, b'{"x": "', length=4 * 1024 * 1024 + 1)
        head, body = read_answer(connection)
        assert head.startswith('HTTP/1.1 413 ') and 'connection: close' in head.lower()
        assert (body['code'], body['status']) == ('body_too_large', 413)
        assert connection.recv(1) == b''        # closed: the rest of the body is never read
