"""MCP over Streamable HTTP at `<base-url>/mcp` (CONTRACT.md section 22), through the mcp SDK's own Streamable HTTP
client only, against `marketplace.py serve` as a process: the server starts its MCP child on the first request,
each request acts as the account of its Bearer token, and a bad request is refused before anything is done."""

import json

import anyio.from_thread
import httpx2
import pytest
import requests
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

import marketplace as mp
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


def connect(portal, server, token):
    http = httpx2.AsyncClient(headers={'Authorization': f'Bearer {token}'}, timeout=TIMEOUT)
    return portal.wrap_async_context_manager(Client(streamable_http_client(f'{server.url}/mcp', http_client=http)))


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
