"""`marketplace.py mcp`: the MCP server for agents, driven with the mcp SDK's own client, in-process and over stdio."""

import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anyio.from_thread
import pytest
import requests
from mcp import Client, StdioServerParameters
from mcp.shared.exceptions import MCPError

import marketplace as mp
import openapi_spec
import mcp_server
from conftest import ROOT, LiveServer, free_port, in_hours, random_wallet

# The tools of CONTRACT.md section 15 and their arguments (? marks the optional ones there).
SECTION_15 = {
    'list_jobs': {'status', 'category', 'min_pay', 'sort', 'limit', 'offset'},
    'search_jobs': {'q', 'category', 'min_pay', 'status', 'sort', 'limit'},
    'get_job': {'job_id'},
    'post_job': {'title', 'description', 'category', 'payment_amount', 'deadline', 'payment_currency',
                 'payment_rail', 'requirements', 'acceptance_criteria', 'max_workers', 'competition_mode',
                 'verification_window_hours', 'claim_timeout_hours', 'min_reputation', 'escrow_tx_hash',
                 'escrow_signature', 'escrow_deposit_id', 'escrow_authorization'},
    'claim_job': {'job_id', 'agent_id'},
    'deliver_job': {'job_id', 'claim_id', 'url', 'type', 'notes'},
    'verify_delivery': {'job_id', 'claim_id', 'approved', 'reason', 'release_signature'},
    'open_dispute': {'job_id', 'claim_id', 'reason'},
    'cast_vote': {'dispute_id', 'arbitrator_id', 'vote', 'reasoning'},
    'get_agent': {'agent_id'},
    'match_jobs': {'categories', 'languages', 'min_pay', 'limit'},
    'service_health': set(),
    'register_agent': {'name', 'wallet_address', 'description', 'capabilities', 'pricing', 'webhook_url'},
    'my_claims': {'limit', 'offset'},
    'get_dispute': {'dispute_id'},
}
REQUIRED = {
    'list_jobs': [], 'search_jobs': [], 'get_job': ['job_id'], 'claim_job': ['job_id'],
    'post_job': ['title', 'description', 'category', 'payment_amount', 'deadline'],
    'deliver_job': ['job_id', 'claim_id', 'url'], 'verify_delivery': ['job_id', 'claim_id', 'approved'],
    'open_dispute': ['job_id', 'claim_id', 'reason'], 'cast_vote': ['dispute_id', 'arbitrator_id', 'vote'],
    'get_agent': ['agent_id'], 'match_jobs': [], 'service_health': [],
    'register_agent': ['name', 'wallet_address'], 'my_claims': [], 'get_dispute': ['dispute_id'],
}
CLOSED_URL = f'http://127.0.0.1:{free_port()}'     # nothing listens there


def job_arguments(**overrides):
    arguments = {'title': 'Fix the flaky test', 'description': 'It fails one run in ten.', 'category': 'code',
                 'payment_amount': '25.00', 'deadline': in_hours(48)}
    arguments.update(overrides)
    return arguments


class Session:
    """An MCP client session, driven from synchronous tests through an anyio portal."""

    def __init__(self, portal, client):
        self.portal, self.client = portal, client

    def call(self, tool, **arguments):
        return self.portal.call(self.client.call_tool, tool, arguments)

    def result(self, tool, **arguments):
        """The structured result of a call that must succeed."""
        answer = self.call(tool, **arguments)
        assert not answer.is_error, answer.content[0].text
        assert json.loads(answer.content[0].text) == answer.structured_content
        return answer.structured_content

    def read(self, uri):
        """The text of a resource."""
        return self.portal.call(self.client.read_resource, uri).contents[0].text

    def tools(self):
        return {tool.name: tool for tool in self.portal.call(self.client.list_tools).tools}


@pytest.fixture(scope='module')
def portal():
    with anyio.from_thread.start_blocking_portal() as portal:
        yield portal


@pytest.fixture
def offline(portal):
    """A session with the server in-process, over a service that is not running."""
    with portal.wrap_async_context_manager(Client(mcp_server.make_server(CLOSED_URL, 'some-key'))) as client:
        yield Session(portal, client)


def in_process(portal, url, key):
    """A session with a new server in-process (its own nonce, as another process would have)."""
    return portal.wrap_async_context_manager(Client(mcp_server.make_server(url, key)))


def over_stdio(portal, url, key):
    """A session with `marketplace.py mcp` as the SDK's stdio client spawns it: --url as a flag, the key from the
    environment, as a host's configuration gives them."""
    params = StdioServerParameters(command=sys.executable, args=[str(ROOT / 'marketplace.py'), 'mcp', '--url', url],
                                   env={'MARKETPLACE_API_KEY': key}, cwd=str(ROOT))
    return portal.wrap_async_context_manager(Client(params))


# In-process: the tools, their schemas, their arguments ---------------------------------------------------------

def test_the_tools_are_those_of_section_15_with_typed_schemas(offline):
    tools = offline.tools()
    assert set(tools) == set(SECTION_15) == set(mcp_server.TOOL_OPERATIONS)
    for name, tool in tools.items():
        schema = tool.input_schema
        assert schema['type'] == 'object'
        assert set(schema['properties']) == SECTION_15[name], name
        assert schema.get('required', []) == REQUIRED[name], name
        assert tool.output_schema['type'] == 'object' and tool.output_schema['required'], name
        assert 'Returns' in tool.description and len(tool.description) > 120, name
        assert tool.annotations.read_only_hint is (mcp_server.TOOL_OPERATIONS[name][0] == 'GET'), name
    post = tools['post_job'].input_schema['properties']
    assert post['payment_amount']['type'] == 'string' and post['payment_amount']['examples'] == ['25.00']
    assert post['max_workers'] == {'default': 1, 'description': 'Worker slots (default 1).', 'maximum': 100,
                                   'minimum': 1, 'title': 'Max Workers', 'type': 'integer'}
    assert tools['get_job'].input_schema['properties']['job_id']['format'] == 'uuid'
    assert 'COSTS MONEY' in tools['post_job'].description
    assert 'MOVES MONEY' in tools['verify_delivery'].description


def test_each_tools_output_schema_is_its_operations_answer(offline):
    """A tool's outputSchema names the fields of the API's answer it returns: exactly the properties of the
    operation's success schema in the OpenAPI document, required where it requires them (CONTRACT 22)."""
    document = openapi_spec.openapi_document('http://market.test')
    for name, tool in offline.tools().items():
        method, path = mcp_server.TOOL_OPERATIONS[name]
        responses = document['paths'][path][method.lower()]['responses']
        success = next(answer for status, answer in responses.items() if status.startswith('2'))
        schema = success['content']['application/json']['schema']
        schema = document['components']['schemas'][schema['$ref'].rsplit('/', 1)[1]]
        assert set(tool.output_schema['properties']) == set(schema['properties']), name
        assert set(tool.output_schema['required']) == set(schema['required']), name


def enum_of(schema):
    """The enum of a property that may be null."""
    return next(option['enum'] for option in schema.get('anyOf', [schema]) if 'enum' in option)


def test_the_enums_are_the_apis(offline):
    tools = offline.tools()
    props = {name: tool.input_schema['properties'] for name, tool in tools.items()}
    search_sorts = next(p['schema']['enum'] for p in openapi_spec.API_OPERATIONS[('GET', '/api/jobs/search')]['query']
                        if p['name'] == 'sort')
    assert enum_of(props['list_jobs']['status']) == list(mp.JOB_STATUSES)
    assert enum_of(props['list_jobs']['category']) == list(mp.CATEGORIES)
    assert enum_of(props['list_jobs']['sort']) == list(mp.JOB_SORTS)
    assert enum_of(props['search_jobs']['sort']) == search_sorts
    assert enum_of(props['post_job']['competition_mode']) == list(mp.COMPETITION_MODES)
    assert sorted(enum_of(props['post_job']['payment_currency'])) == sorted(mp.DECIMALS)
    assert sorted(enum_of(props['post_job']['payment_rail'])) == sorted(mp.RAILS.values())
    assert sorted(enum_of(props['cast_vote']['vote'])) == sorted(mp.OUTCOMES)
    assert props['match_jobs']['categories']['anyOf'][0]['items']['enum'] == list(mp.CATEGORIES)


def test_every_tool_maps_to_a_documented_operation():
    document = openapi_spec.openapi_document('http://market.test', ())
    for tool, (method, path) in mcp_server.TOOL_OPERATIONS.items():
        operation = document['paths'][path][method.lower()]
        documented = {parameter['name'] for parameter in operation.get('parameters', [])}
        arguments = SECTION_15[tool]
        if method == 'GET':     # every argument is a path or query parameter of the same name
            assert arguments <= documented, (tool, arguments - documented)
        else:                   # the path's parameters are arguments; the rest goes in the body
            assert {name for name in documented if '{' + name + '}' in path} <= arguments
            assert 'requestBody' in operation, tool


@pytest.mark.parametrize('tool, arguments, field', [
    ('post_job', job_arguments(payment_amount=25), 'payment_amount'),      # money is a string, never a number
    ('post_job', job_arguments(payment_amount='25.001'), 'payment_amount'),
    ('post_job', job_arguments(category='cooking'), 'category'),
    ('post_job', {key: value for key, value in job_arguments().items() if key != 'title'}, 'title'),
    ('post_job', job_arguments(max_workers=101), 'max_workers'),
    ('get_job', {'job_id': 'not-a-uuid'}, 'job_id'),
    ('list_jobs', {'limit': 500}, 'limit'),
    ('list_jobs', {'sort': 'random'}, 'sort'),
    ('verify_delivery', {'job_id': str(uuid.uuid4()), 'claim_id': str(uuid.uuid4()), 'approved': 'maybe'},
     'approved'),
    ('cast_vote', {'dispute_id': str(uuid.uuid4()), 'arbitrator_id': str(uuid.uuid4()), 'vote': 'nobody'}, 'vote'),
])
def test_arguments_are_checked_before_any_call(offline, tool, arguments, field):
    answer = offline.call(tool, **arguments)
    text = answer.content[0].text
    assert answer.is_error is True
    assert f'validation error for {tool}Arguments\n{field}' in text
    assert 'unreachable' not in text        # the API was never asked


def test_an_unreachable_service_is_a_tool_error_naming_it_and_fast(offline):
    started = time.monotonic()
    answer = offline.call('list_jobs', status='open')
    assert time.monotonic() - started < 5
    assert answer.is_error is True and answer.structured_content is None
    assert answer.content[0].text == (f'Error executing tool list_jobs: The marketplace service is unreachable at '
                                      f'{CLOSED_URL} (ConnectionError); is it running, and is the URL right?')
    assert 'Traceback' not in answer.content[0].text


def test_a_service_that_never_answers_is_a_tool_error_after_the_time_out(portal):
    with socket.socket() as silent:     # accepts connections (the backlog) and never answers
        silent.bind(('127.0.0.1', 0))
        silent.listen()
        url = 'http://127.0.0.1:%d' % silent.getsockname()[1]
        with portal.wrap_async_context_manager(Client(mcp_server.make_server(url, 'key', timeout=1))) as client:
            started = time.monotonic()
            answer = Session(portal, client).call('get_job', job_id=str(uuid.uuid4()))
            waited = time.monotonic() - started
    assert answer.is_error is True
    assert answer.content[0].text == (f'Error executing tool get_job: The marketplace service at {url} did not '
                                      'answer within 1 s (unreachable); try again later.')
    assert 1 <= waited < 5


def test_the_write_key_is_the_calls_hash_plus_the_process_nonce():
    api, other = mcp_server.MarketplaceAPI(CLOSED_URL), mcp_server.MarketplaceAPI(CLOSED_URL)
    key = api.idempotency_key('post_job', {'body': {'title': 'a', 'category': 'code'}})
    assert key == api.idempotency_key('post_job', {'body': {'category': 'code', 'title': 'a'}})   # canonical JSON
    assert key != api.idempotency_key('post_job', {'body': {'title': 'b', 'category': 'code'}})
    assert key != api.idempotency_key('claim_job', {'body': {'title': 'a', 'category': 'code'}})
    assert key.endswith('-' + api.nonce) and len(key) == 4 + 48 + 1 + 16
    assert key.removesuffix(api.nonce) == other.idempotency_key(
        'post_job', {'body': {'title': 'a', 'category': 'code'}}).removesuffix(other.nonce)
    assert api.nonce != other.nonce


@pytest.mark.parametrize('command, patched', [('mcp', False), ('serve', True)])
def test_only_serve_patches_with_gevent(command, patched):
    # marketplace.py run as a program, as `python marketplace.py COMMAND` would, with the command's work replaced.
    probe = f'''
import runpy, sys
import mcp_server
from gevent import monkey
mcp_server.run = lambda *args: None
sys.argv = ['marketplace.py', {command!r}, '--help' if {command!r} == 'serve' else '--url=http://127.0.0.1:1']
try:
    runpy.run_path('marketplace.py', run_name='__main__')
except SystemExit:
    pass
print('patched' if monkey.is_module_patched('socket') else 'not patched', file=sys.stderr)
'''
    run = subprocess.run([sys.executable, '-c', probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.stderr.strip().splitlines()[-1] == ('patched' if patched else 'not patched')


# Over stdio, against a real server ------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def server(tmp_path_factory):
    server = LiveServer(tmp_path_factory.mktemp('mcp') / 'live.db').start()
    yield server
    server.process.kill()
    server.process.wait(10)


def register(server, path, body, key=None):
    headers = {'Authorization': f'Bearer {key}'} if key else {}
    answer = requests.post(server.url + path, json=body, headers=headers, timeout=10)
    assert answer.status_code == 201, answer.text
    return answer.json()


@pytest.fixture(scope='module')
def people(server):
    """A requester's key, a worker's key and the worker's one agent."""
    requester_key = register(server, '/api/accounts', {'name': 'requester'})['apiKey']
    worker_key = register(server, '/api/accounts', {'name': 'worker'})['apiKey']
    agent = register(server, '/api/agents', {'name': 'worker-agent', 'walletAddress': random_wallet(),
                                             'capabilities': {'categories': ['code'], 'languages': ['python']}},
                     key=worker_key)['agent']
    return {'requester_key': requester_key, 'worker_key': worker_key, 'agent': agent}


@pytest.fixture(scope='module')
def requester(portal, server, people):
    with over_stdio(portal, server.url, people['requester_key']) as client:
        yield Session(portal, client)


@pytest.fixture(scope='module')
def worker(portal, server, people):
    with over_stdio(portal, server.url, people['worker_key']) as client:
        yield Session(portal, client)


def test_a_jobs_whole_life_across_two_sessions(requester, worker, people):
    health = requester.result('service_health')
    assert (health['status'], health['version'], health['dbConnected'], health['payments']) == \
        ('ok', '2.0.0', True, 'simulated')
    job = requester.result('post_job', **job_arguments(title='Port the parser to Rust',
                                                       requirements={'language': 'python'}))['job']
    assert (job['status'], job['paymentAmount'], job['paymentCurrency'], job['escrowStatus']) == \
        ('open', '25.00', 'USDC', 'locked')

    found = worker.result('search_jobs', q='parser', status='open')
    assert [found_job['id'] for found_job in found['results']] == [job['id']]
    matches = worker.result('match_jobs', categories=['code'], languages=['python'], min_pay=20)
    assert [(match['id'], match['matchScore']) for match in matches['matches']] == [(job['id'], 0.925)]
    claim = worker.result('claim_job', job_id=job['id'])['claim']          # the worker's one agent
    assert (claim['status'], claim['agentId']) == ('claimed', people['agent']['id'])
    delivered = worker.result('deliver_job', job_id=job['id'], claim_id=claim['id'],
                              url='https://example.com/pull/7', type='pull_request', notes='All tests pass.')
    assert (delivered['claim']['status'], delivered['job']['status']) == ('delivered', 'delivered')

    verified = requester.result('verify_delivery', job_id=job['id'], claim_id=claim['id'], approved=True,
                                reason='Good work.')
    assert (verified['job']['status'], verified['claim']['status'], verified['escrowStatus']) == \
        ('completed', 'approved', 'released')
    assert [(p['type'], p['amount'], p['currency'], p['recipient']) for p in verified['payments']] == [
        ('release', '25.00', 'USDC', people['agent']['walletAddress'])]

    seen = worker.result('get_job', job_id=job['id'])
    assert (seen['job']['status'], seen['job']['escrowStatus']) == ('completed', 'released')
    assert [(p['type'], p['amount'], p['status']) for p in seen['payments']] == [
        ('escrow', '25.00', 'simulated'), ('release', '25.00', 'simulated')]
    agent = worker.result('get_agent', agent_id=people['agent']['id'])['agent']
    assert (agent['jobsCompleted'], agent['totalEarned'], agent['reputationScore']) == (1, '25.00', '1.00')


def test_api_errors_keep_their_code(portal, server, requester):
    missing = str(uuid.uuid4())
    answer = requester.call('get_job', job_id=missing)
    assert answer.is_error is True and answer.structured_content is None
    assert answer.content[0].text == 'Error executing tool get_job: No job has this id. (code: not_found, status: 404)'

    with in_process(portal, server.url, 'not-a-key-' + 'x' * 32) as client:
        answer = Session(portal, client).call('post_job', **job_arguments())
    assert answer.is_error is True
    assert '(code: unauthorized, status: 401)' in answer.content[0].text

    answer = requester.call('post_job', **job_arguments(deadline='2001-01-01T00:00:00Z'))
    assert answer.is_error is True
    assert '(code: validation_failed, status: 400)\n{"fields": {"deadline": ' in answer.content[0].text


def test_resources_read_a_job_and_the_openapi_document(requester, server):
    job = requester.result('post_job', **job_arguments(title='Read me as a resource'))['job']
    shown = json.loads(requester.read(f'marketplace://jobs/{job["id"]}'))
    assert (shown['job']['id'], shown['job']['title'], shown['job']['paymentAmount']) == \
        (job['id'], 'Read me as a resource', '25.00')
    document = json.loads(requester.read('marketplace://openapi'))
    assert document == requests.get(server.url + '/api/openapi.json', timeout=10).json()
    assert document['openapi'] == '3.1.0'
    with pytest.raises(MCPError) as refused:
        requester.read(f'marketplace://jobs/{uuid.uuid4()}')
    assert (refused.value.code, refused.value.message) == (-32602, 'No job has this id. (code: not_found, status: 404)')


def test_a_retried_post_job_posts_once_and_another_session_posts_again(portal, server, people, requester):
    arguments = job_arguments(title='Posted by a host that retries', payment_amount='7.50')
    first = requester.result('post_job', **arguments)['job']
    again = requester.result('post_job', **arguments)['job']
    assert again == first
    with in_process(portal, server.url, people['requester_key']) as client:   # another session, its own nonce
        second = Session(portal, client).result('post_job', **arguments)['job']
    assert second['id'] != first['id']
    listed = requests.get(server.url + '/api/jobs/search', params={'q': 'host that retries'}, timeout=10).json()
    assert sorted(job['id'] for job in listed['results']) == sorted([first['id'], second['id']])
    assert {job['paymentAmount'] for job in listed['results']} == {'7.50'}


def test_the_server_exits_0_when_its_stdin_closes():
    process = subprocess.Popen([sys.executable, str(ROOT / 'marketplace.py'), 'mcp', '--url', CLOSED_URL],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        hello = {'jsonrpc': '2.0', 'id': 1, 'method': 'initialize', 'params': {
            'protocolVersion': '2025-06-18', 'capabilities': {}, 'clientInfo': {'name': 'test', 'version': '1'}}}
        process.stdin.write(json.dumps(hello).encode() + b'\n')
        process.stdin.flush()
        answer = json.loads(process.stdout.readline())      # it answers without asking the API anything
        assert (answer['id'], answer['result']['serverInfo']['name']) == (1, 'marketplace')
        started = time.monotonic()
        process.stdin.close()
        assert process.wait(10) == 0
        assert time.monotonic() - started < 5
        assert b'Traceback' not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_a_redirect_is_a_tool_error_naming_the_primary_and_is_not_followed(portal):
    """A read replica answers a write 307 to its primary: the tool fails saying so (CONTRACT.md 20), never reports
    the 307's body as a success, and does not follow it."""
    hits = []

    class Replica(BaseHTTPRequestHandler):
        def answer(self):
            hits.append((self.server.name, self.command, self.path))
            length = int(self.headers.get('Content-Length') or 0)
            self.rfile.read(length)
            location = f'{primary_url}{self.path}'
            body = json.dumps({'primary': location}).encode()
            self.send_response(307 if self.server.name == 'replica' else 200)
            self.send_header('Location', location)
            self.send_header('Content-Type', 'application/json')
            self.send_header('Content-Length', str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = answer

        def log_message(self, *args):
            pass

    servers = []
    for name in ('primary', 'replica'):
        server = ThreadingHTTPServer(('127.0.0.1', 0), Replica)
        server.name = name
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    primary_url, replica_url = (f'http://127.0.0.1:{server.server_address[1]}' for server in servers)
    try:
        with in_process(portal, replica_url, 'key') as client:
            session = Session(portal, client)
            posted = session.call('post_job', **job_arguments())
            listed = session.call('list_jobs', status='open')
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    for answer, path in ((posted, '/api/jobs'), (listed, '/api/jobs?status=open&sort=newest&limit=50&offset=0')):
        assert answer.is_error is True and answer.structured_content is None, answer
        text = answer.content[0].text
        assert f'answered HTTP 307: it sends this call to {primary_url}{path}' in text, text
        assert 'naming the primary' in text
    assert [(name, method) for name, method, _ in hits] == [('replica', 'POST'), ('replica', 'GET')]
