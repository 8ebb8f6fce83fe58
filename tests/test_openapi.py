"""GET /api/openapi.json: a valid OpenAPI 3.1 document of every route, true to what the routes answer."""

import json
import re
import uuid

import pytest
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

import marketplace as mp
import openapi_spec
import wiring
from conftest import ADMIN_KEY, Client, in_hours, job_body, make_account, make_job, random_wallet

BASE = 'http://market.test'
METHODS = ('get', 'put', 'post', 'delete', 'options', 'head', 'patch', 'trace')

API_ALSO = {(method, mp.openapi_path(path)): entry.get('also', {}) for (method, path), entry in openapi_spec.API_OPERATIONS.items()}
REAL_ROUTES = {(method, path): bucket for method, path, _, bucket in mp.ROUTES}
# A stream does not end in-process; its own tests cover it.
NOT_DRIVEN = {('GET', '/api/jobs/stream'),
              ('POST', '/api/x402'),      # needs a chain: test_x402.py checks its answers against this document
              ('POST', '/api/stripe/webhook'),    # needs stripe mode: test_stripe_funding.py checks its answers
              ('POST', '/api/agents/<agent_id>/stripe/onboarding'),   # stripe mode too: test_stripe_payouts.py
              ('POST', '/mcp'),               # a child process: test_mcp_http.py
              ('GET', '/.well-known/oauth-protected-resource'), ('GET', '/.well-known/oauth-protected-resource/mcp'),
              ('GET', '/.well-known/oauth-authorization-server'), ('POST', '/oauth/register'),
              ('POST', '/oauth/token'),       # test_oauth.py: a host's whole flow
              ('POST', '/message\\:send'), ('POST', '/message\\:stream'), ('GET', '/tasks/<task_id:re:[^/:]+>'),
              ('POST', '/tasks/<task_id>\\:cancel')}     # test_a2a.py: the a2a-sdk client


def operations(document):
    return {(method.upper(), path): operation for path, item in document['paths'].items()
            for method, operation in item.items() if method in METHODS}


def follow(document, node):
    """The object a local $ref points at, or the node itself."""
    if '$ref' not in node:
        return node
    target = document
    for part in node['$ref'].removeprefix('#/').split('/'):
        target = target[part.replace('~1', '/').replace('~0', '~')]
    return target


class Checker:
    """Validates answers against the document: the schema of the route's response for that status."""

    def __init__(self, document):
        self.document = document
        self.operations = operations(document)
        self.registry = Registry().with_resource(
            'urn:openapi', Resource.from_contents(document, default_specification=DRAFT202012))
        self.seen = set()

    def validate(self, instance, schema_ref):
        validator = Draft202012Validator({'$ref': 'urn:openapi' + schema_ref}, registry=self.registry,
                                         format_checker=Draft202012Validator.FORMAT_CHECKER)
        errors = sorted(validator.iter_errors(instance), key=lambda e: list(e.absolute_path))
        assert not errors, '\n'.join(f'{list(e.absolute_path)}: {e.message}' for e in errors[:10])

    def __call__(self, answer, method, route, status=None):
        """Check one answer of METHOD ROUTE (the route that handled it); return the answer."""
        if status is not None:
            assert answer.status == status, answer
        operation = self.operations[(method, mp.openapi_path(route))]
        documented = operation['responses'].get(str(answer.status))
        assert documented, f'{method} {route} answered {answer.status}, which the document does not list'
        content = follow(self.document, documented)['content']
        media = answer.headers.get('Content-Type', '').split(';')[0]
        assert media in content, (method, route, answer.status, media, list(content))
        if media == 'application/json':
            schema = content[media]['schema']
            assert set(schema) == {'$ref'}, schema
            self.validate(answer.json, schema['$ref'])
        self.seen.add((method, route, answer.status))
        return answer

    def error(self, answer, status, code):
        """An error answered by no documented operation (an unknown path or method): the Error schema."""
        assert answer.status == status and answer.json['code'] == code, answer
        self.validate(answer.json, '#/components/schemas/Error')
        return answer


@pytest.fixture
def document(client):
    answer = client.get('/api/openapi.json')
    assert answer.status == 200, answer
    return answer.json


@pytest.fixture
def check(document):
    return Checker(document)


def test_document_is_valid_openapi_3_1(client, document):
    validate(document)
    assert document['openapi'] == '3.1.0'
    assert document['info']['version'] == mp.__version__ == '2.0.0'
    assert document['servers'] == [{'url': BASE}]
    assert document['components']['securitySchemes'] == {
        'bearerAuth': {'type': 'http', 'scheme': 'bearer', 'description': 'Authorization: Bearer <API key>.'}}
    for schema in document['components']['schemas'].values():
        Draft202012Validator.check_schema(schema)
    # The document is plain data: the route answers what openapi_document builds.
    assert document == json.loads(json.dumps(openapi_spec.openapi_document(BASE)))


def test_document_lists_exactly_the_routes(document):
    documented = set(operations(document))
    routes = {(method, mp.openapi_path(path)) for method, path in REAL_ROUTES}
    assert documented == routes
    assert len(documented) == len(openapi_spec.API_OPERATIONS)


def test_the_document_refuses_to_build_when_routes_and_operations_disagree(monkeypatch):
    openapi_spec.openapi_document(BASE)
    monkeypatch.setattr(openapi_spec, 'ROUTES', openapi_spec.ROUTES + [('GET', '/api/undocumented', lambda: {}, 'read')])
    with pytest.raises(ValueError, match=r"no API_OPERATIONS entry for \[\('GET', '/api/undocumented'\)\]"):
        openapi_spec.openapi_document(BASE)
    monkeypatch.setattr(openapi_spec, 'ROUTES', openapi_spec.ROUTES[:-1])
    monkeypatch.setitem(openapi_spec.API_OPERATIONS, ('DELETE', '/api/jobs/<job_id>'), openapi_spec.API_OPERATIONS[('GET', '/api/jobs')])
    with pytest.raises(ValueError, match=r"no route for \[\('DELETE', '/api/jobs/<job_id>'\)\]"):
        openapi_spec.openapi_document(BASE)


def test_every_operation_documents_its_errors(document):
    buckets = {(method, mp.openapi_path(path)): bucket for method, path, _, bucket in mp.ROUTES}
    for (method, path), operation in operations(document).items():
        where = f'{method} {path}'
        responses = operation['responses']
        contents = {status: follow(document, response)['content'] for status, response in responses.items()
                    if status.startswith('4')}
        errors = {status for status, content in contents.items()
                  if content.get('application/json', {}).get('schema') == {'$ref': '#/components/schemas/Error'}}
        pages = {status for status, content in contents.items() if set(content) == {'text/html'}}
        a2a = {status for status, content in contents.items()      # A2A's binding: its own error form
               if content.get('application/json', {}).get('schema') == {'$ref': '#/components/schemas/A2AError'}}
        assert errors, where
        assert '405' in errors and 'default' in responses, where
        assert not pages or operation['tags'] == ['Pages'], where      # only pages answer errors as pages
        for name in re.findall(r'{(\w+)}', path):
            assert {'400', '404'} <= errors | pages | a2a, where
            assert {'name': name, 'in': 'path', 'required': True, 'schema': {'type': 'string', 'format': 'uuid'},
                    'description': 'A UUID (uppercase is accepted).'} in operation['parameters'], where
        if 'requestBody' in operation:
            assert {'400', '408', '413'} <= errors, where     # 408: a body later than --body-timeout
        keyed = operation.get('security') == [{'bearerAuth': []}]
        assert keyed == ('401' in errors), where
        if keyed:
            # any key may register an agent, list its own claims, speak MCP or A2A (their tools answer refusals;
            # another account's task is not found)
            assert '403' in errors or path in ('/api/agents', '/api/claims', '/mcp') or \
                path.startswith(('/message:', '/tasks/')), where
        # 429 exactly on the rate-limited routes (every GET shares one bucket; /api/health has none).
        assert ('429' in errors) == (buckets[(method, path)] is not None), where
        extra_successes = [status for status in API_ALSO.get((method, path), ()) if status < 300]
        assert len([status for status in responses if status[0] in '23']) == 1 + len(extra_successes), where


def test_a_whole_marketplace_answers_as_documented(client, check, receiver):
    """Drive every route through a realistic story and validate each JSON body against the document."""
    check(client.get('/api/health'), 'GET', '/api/health', 200)
    check(client.get('/api/openapi.json'), 'GET', '/api/openapi.json', 200)

    # Accounts and agents
    answer = check(client.post('/api/accounts', {'name': 'acme'}), 'POST', '/api/accounts', 201)
    requester_key = answer.json['apiKey']
    check(client.patch(f'/api/accounts/{answer.json["account"]["id"]}', {'x402Exempt': True}, key=ADMIN_KEY),
          'PATCH', '/api/accounts/<account_id>', 200)
    check(client.patch(f'/api/accounts/{uuid.uuid4()}', {'x402Exempt': True}, key=ADMIN_KEY),
          'PATCH', '/api/accounts/<account_id>', 404)
    check(client.patch(f'/api/accounts/{answer.json["account"]["id"]}', {'x402Exempt': False}, key=requester_key),
          'PATCH', '/api/accounts/<account_id>', 403)
    answer = check(client.post('/api/agents/register', {
        'name': 'coder-1', 'walletAddress': random_wallet(), 'webhookUrl': 'https://hooks.example.com/coder-1',
        'capabilities': {'categories': ['code'], 'languages': ['python'], 'maxJobValue': 500,
                         'avgCompletionTime': '30m', 'extra': {'kept': True}},
        'pricing': {'minimumJobValue': 5, 'acceptedCurrencies': ['USDC', 'USD']}}),
        'POST', '/api/agents/register', 201)
    agent, worker_key = answer.json['agent'], answer.json['apiKey']
    assert agent['webhookUrl'] == 'https://hooks.example.com/coder-1'
    answer = check(client.post('/api/agents', {'name': 'writer', 'walletAddress': random_wallet(),
                                               'capabilities': {'maxJobValue': None}}, key=worker_key),
                   'POST', '/api/agents', 201)
    assert answer.json['agent']['webhookUrl'] is None
    assert 'webhookUrl' not in check(client.get('/api/agents'), 'GET', '/api/agents', 200).json['agents'][0]
    assert 'webhookUrl' in check(client.get('/api/agents?sort=newest&limit=500', key=worker_key),
                                 'GET', '/api/agents', 200).json['agents'][0]

    # A job approved (USD on stripe, every field given)
    answer = check(client.post('/api/jobs', job_body(
        paymentAmount='120', paymentCurrency='USD', requirements={'repo': 'acme/app', 'language': 'python'},
        acceptanceCriteria=[{'type': 'automated', 'check': 'pytest passes'}], maxWorkers=2,
        competitionMode='best-wins', verificationWindowHours=48, minReputation='0.00'), key=requester_key),
        'POST', '/api/jobs', 201)
    job = answer.json['job']
    assert job['paymentRail'] == 'stripe'
    claim = check(client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': agent['id']}, key=worker_key),
                  'POST', '/api/jobs/<job_id>/claim', 201).json['claim']
    check(client.post(f'/api/jobs/{job["id"]}/deliver', {
        'claimId': claim['id'], 'deliverable': {'type': 'pull_request', 'url': 'https://example.com/pr/1',
                                                'notes': 'Fixed.'}}, key=worker_key),
          'POST', '/api/jobs/<job_id>/deliver', 200)
    answer = check(client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': True,
                                                                  'reason': 'Good.'}, key=requester_key),
                   'POST', '/api/jobs/<job_id>/verify', 200)
    assert [p['type'] for p in answer.json['payments']] == ['release']
    check(client.get(f'/api/jobs/{job["id"]}'), 'GET', '/api/jobs/<job_id>', 200)

    # A job rejected, delivered through the alias path and body
    job = make_job(client, requester_key)
    check(client.post(f'/api/jobs/{job["id"]}/claim', None, key=worker_key),
          'POST', '/api/jobs/<job_id>/claim', 400)     # the account owns two agents: say which
    claim = claim_for(client, job, agent, worker_key)
    check(client.post(f'/api/jobs/{job["id"]}/submit', {'claimId': claim['id'], 'deliveryUrl': 'https://example.com/log',
                                                         'artifactType': 'log'}, key=worker_key),
          'POST', '/api/jobs/<job_id>/submit', 200)
    check(client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': False},
                      key=requester_key), 'POST', '/api/jobs/<job_id>/verify', 200)
    answer = check(client.get(f'/api/agents/{agent["id"]}'), 'GET', '/api/agents/<agent_id>', 200)
    assert [e['delta'] for e in answer.json['reputationHistory']] == ['-0.25', '1.00']

    # A job cancelled
    job = make_job(client, requester_key)
    check(client.post(f'/api/jobs/{job["id"]}/cancel', key=requester_key), 'POST', '/api/jobs/<job_id>/cancel', 200)

    # A dispute decided by a trusted arbitrator's owner, and one by the three votes of its panel
    voters = []
    for n in range(3):
        account, key = make_account(client, f'arbiter-{n}')
        answer = check(client.post('/api/arbitrators', {'name': f'arbiter-{n}', 'walletAddress': random_wallet(),
                                                        'accountId': account['id']}, key=ADMIN_KEY),
                       'POST', '/api/arbitrators', 201)
        assert answer.json['arbitrator']['status'] == 'pending'
        activate = {'status': 'active', 'trusted': True} if n == 0 else {'status': 'active'}
        answer = check(client.patch(f'/api/arbitrators/{answer.json["arbitrator"]["id"]}', activate, key=ADMIN_KEY),
                       'PATCH', '/api/arbitrators/<arbitrator_id>', 200)
        voters.append((answer.json['arbitrator'], key))
    job = make_job(client, requester_key)
    claim = delivered_claim(client, job, agent, worker_key)
    answer = check(client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'Not done.'},
                               key=requester_key), 'POST', '/api/jobs/<job_id>/dispute', 201)
    dispute = answer.json['dispute']
    check(client.get(f'/api/disputes?status=open&job_id={job["id"]}&needsAdmin=false'), 'GET', '/api/disputes', 200)
    check(client.get(f'/api/disputes/{dispute["id"]}'), 'GET', '/api/disputes/<dispute_id>', 200)
    answer = check(client.patch(f'/api/disputes/{dispute["id"]}', {'outcome': 'worker', 'resolution': 'It is done.'},
                                key=voters[0][1]), 'PATCH', '/api/disputes/<dispute_id>', 200)
    assert answer.json['jobStatus'] == 'completed'
    check(client.patch(f'/api/disputes/{dispute["id"]}', {'outcome': 'worker', 'resolution': 'Again.'},
                       key=ADMIN_KEY), 'PATCH', '/api/disputes/<dispute_id>', 409)

    job = make_job(client, requester_key)
    claim = delivered_claim(client, job, agent, worker_key)
    dispute = client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'Wrong.'},
                          key=requester_key).json['dispute']
    for (arbitrator, key), vote in zip(voters, ('requester', 'worker', 'requester')):
        answer = check(client.post(f'/api/disputes/{dispute["id"]}/vote', {
            'arbitratorId': arbitrator['id'], 'vote': vote, 'reasoning': 'Read the diff.'}, key=key),
            'POST', '/api/disputes/<dispute_id>/vote', 201)
    assert answer.json['resolved'] is True and answer.json['outcome'] == 'requester'
    check(client.get(f'/api/disputes/{dispute["id"]}/vote'), 'GET', '/api/disputes/<dispute_id>/vote', 200)
    answer = check(client.get('/api/arbitrators?status=active'), 'GET', '/api/arbitrators', 200)
    assert {a['accuracy'] for a in answer.json['arbitrators']} == {0.0, 1.0}
    check(client.patch(f'/api/arbitrators/{voters[2][0]["id"]}', {'status': 'suspended'}, key=ADMIN_KEY),
          'PATCH', '/api/arbitrators/<arbitrator_id>', 200)

    # Lists and totals
    check(client.get('/api/jobs?category=code&status=completed&min_pay=10.5&sort=pay_desc&limit=10&offset=0'),
          'GET', '/api/jobs', 200)
    check(client.get('/api/disputes'), 'GET', '/api/disputes', 200)
    check(client.get('/api/stats'), 'GET', '/api/stats', 200)
    # The pages for people: HTML (and their refusals too)
    check(client.get('/?category=code&min_pay=1&q=test'), 'GET', '/', 200)
    check(client.get('/?min_pay=lots'), 'GET', '/', 400)
    check(client.get(f'/jobs/{job["id"]}'), 'GET', '/jobs/<job_id>', 200)
    check(client.get(f'/jobs/{uuid.uuid4()}'), 'GET', '/jobs/<job_id>', 404)
    check(client.get('/agents'), 'GET', '/agents', 200)
    check(client.get(f'/agents/{agent["id"]}'), 'GET', '/agents/<agent_id>', 200)
    check(client.get('/agents/nope'), 'GET', '/agents/<agent_id>', 400)
    check(client.get(f'/disputes/{dispute["id"]}'), 'GET', '/disputes/<dispute_id>', 200)
    check(client.get('/arbitrators'), 'GET', '/arbitrators', 200)
    check(client.get('/static/style.css'), 'GET', '/static/style.css', 200)
    check(client.get('/static/board.js'), 'GET', '/static/board.js', 200)
    check(client.get('/static/favicon.svg'), 'GET', '/static/favicon.svg', 200)
    check(client.get('/api/docs'), 'GET', '/api/docs', 200)
    for path in ('/static/api-docs.js', '/static/swagger-ui/swagger-ui-bundle.js', '/static/swagger-ui/swagger-ui.css'):
        check(client.get(path), 'GET', path, 200)
    check(client.get('/metrics', key=ADMIN_KEY), 'GET', '/metrics', 200)
    check(client.get('/metrics', key=requester_key), 'GET', '/metrics', 403)
    answer = check(client.get('/api/x402'), 'GET', '/api/x402', 200)
    assert answer.json == {'x402Version': 1, 'enabled': False, 'endpoints': []}
    answer = check(client.post('/api/x402', headers={'X-PAYMENT': 'e30='}), 'POST', '/api/x402', 404)
    assert answer.json['code'] == 'not_priced'

    # Discovery routes, once they are here
    discovery(client, check, agent, job)
    webhooks(client, check, agent, worker_key, receiver)

    # Sweeps: a claim that never delivers expires; a delivery nobody verifies is approved.
    stale = make_job(client, requester_key, deadline=in_hours(1))
    claim_for(client, stale, agent, worker_key)
    waiting = make_job(client, requester_key, verificationWindowHours=1)
    delivered_claim(client, waiting, agent, worker_key)
    timed = make_job(client, requester_key, claimTimeoutHours=1)
    release = f'/api/jobs/{timed["id"]}/claims/{claim_for(client, timed, agent, worker_key)["id"]}/release'
    check(client.post(release, key=requester_key), 'POST', '/api/jobs/<job_id>/claims/<claim_id>/release', 409)
    mp.CLOCK.set(mp.now())
    mp.CLOCK.advance(hours=2)
    answer = check(client.post(release, key=requester_key), 'POST', '/api/jobs/<job_id>/claims/<claim_id>/release',
                   200)
    assert (answer.json['claim']['status'], answer.json['job']['status']) == ('expired', 'open')
    answer = check(client.post('/api/jobs/expire', key=ADMIN_KEY), 'POST', '/api/jobs/expire', 200)
    assert answer.json['jobIds'] == [stale['id']]
    answer = check(client.post('/api/jobs/auto-verify', {}, key=ADMIN_KEY), 'POST', '/api/jobs/auto-verify', 200)
    assert answer.json['autoApproved'] == 1
    answer = check(client.get(f'/api/agents/{agent["id"]}', key=worker_key), 'GET', '/api/agents/<agent_id>', 200)
    assert '-0.50' in [e['delta'] for e in answer.json['reputationHistory']]
    answer = check(client.get('/api/claims', key=worker_key), 'GET', '/api/claims', 200)
    assert answer.json['total'] == len(answer.json['claims']) > 0

    # Every route's success was validated (the stream aside).
    succeeded = {(method, route) for method, route, status in check.seen if status < 300}
    assert succeeded == set(REAL_ROUTES) - NOT_DRIVEN


def webhooks(client, check, agent, key, receiver):
    """The webhook routes: settings, the secret, a test event, the delivery log, redelivery, templates."""
    path = '/api/agents/<agent_id>'
    answer = check(client.patch(f'/api/agents/{agent["id"]}', {'webhookUrl': receiver.url, 'webhookFormat': 'json',
                                                               'description': 'Now with a webhook.'}, key=key),
                   'PATCH', path, 200)
    assert answer.json['agent']['webhookEnabled'] is True
    check(client.patch(f'/api/agents/{agent["id"]}', {'webhookFormat': 'fax'}, key=key), 'PATCH', path, 400)
    check(client.post(f'/api/agents/{agent["id"]}/webhook-secret', key=key),
          'POST', '/api/agents/<agent_id>/webhook-secret', 200)
    answer = check(client.post('/api/webhooks/test', {'agentId': agent['id']}, key=key), 'POST', '/api/webhooks/test', 200)
    assert answer.json['success'] is True and answer.json['statusCode'] == 200
    answer = check(client.get(f'/api/agents/{agent["id"]}/webhooks', key=key),
                   'GET', '/api/agents/<agent_id>/webhooks', 200)
    delivery = answer.json['deliveries'][0]
    check(client.get(f'/api/agents/{agent["id"]}/webhooks'), 'GET', '/api/agents/<agent_id>/webhooks', 401)
    check(client.post(f'/api/agents/{agent["id"]}/webhooks/{delivery["id"]}/redeliver', key=key),
          'POST', '/api/agents/<agent_id>/webhooks/<delivery_id>/redeliver', 202)
    check(client.get('/api/webhooks/templates'), 'GET', '/api/webhooks/templates', 200)


def discovery(client, check, agent, job):
    """The discovery routes: search, matching, cards and the feed."""
    check(client.get('/api/jobs/search?q=flaky&category=code'), 'GET', '/api/jobs/search', 200)
    check(client.get('/api/jobs/search?min_pay=1'), 'GET', '/api/jobs/search', 200)
    check(client.get('/api/jobs/search'), 'GET', '/api/jobs/search', 400)
    check(client.get('/api/jobs/match?categories=code,data&languages=python&min_pay=1'),
          'GET', '/api/jobs/match', 200)
    check(client.get(f'/api/agents/match?job_id={job["id"]}'), 'GET', '/api/agents/match', 200)
    check(client.get('/api/agents/match?category=code&language=python&min_reputation=0'),
          'GET', '/api/agents/match', 200)
    check(client.get(f'/api/agents/match?job_id={uuid.uuid4()}'), 'GET', '/api/agents/match', 404)
    check(client.get(f'/api/agents/{agent["id"]}/card'), 'GET', '/api/agents/<agent_id>/card', 200)
    for path in ('/.well-known/agent-card.json', '/.well-known/agent.json'):
        check(client.get(path), 'GET', path, 200)
    check(client.get('/api/jobs/feed'), 'GET', '/api/jobs/feed', 200)
    check(client.get('/api/jobs/feed?format=atom'), 'GET', '/api/jobs/feed', 200)


def claim_for(client, job, agent, key):
    answer = client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': agent['id']}, key=key)
    assert answer.status == 201, answer
    return answer.json['claim']


def delivered_claim(client, job, agent, key):
    claim = claim_for(client, job, agent, key)
    answer = client.post(f'/api/jobs/{job["id"]}/deliver',
                         {'claimId': claim['id'], 'deliverable': {'url': 'https://example.com/out'}}, key=key)
    assert answer.status == 200, answer
    return answer.json['claim']


def test_errors_answer_as_documented(client, check, market):
    job = market.job()
    # 400: not JSON, a field of the wrong kind, a malformed UUID, a bad query parameter
    answer = check(client.post('/api/jobs', b'{"title": ', key=market.requester_key), 'POST', '/api/jobs', 400)
    assert answer.json['code'] == 'invalid_json'
    answer = check(client.post('/api/jobs', job_body(paymentAmount='25.001', maxWorkers='2'),
                               key=market.requester_key), 'POST', '/api/jobs', 400)
    assert set(answer.json['fields']) == {'paymentAmount', 'maxWorkers'}
    check(client.get('/api/jobs/not-a-uuid'), 'GET', '/api/jobs/<job_id>', 400)
    check(client.get('/api/jobs?limit=-1'), 'GET', '/api/jobs', 400)
    # 401: no key, an unknown key
    check(client.post('/api/jobs', job_body()), 'POST', '/api/jobs', 401)
    check(client.post(f'/api/jobs/{job["id"]}/claim', {}, key='mk_unknown'), 'POST', '/api/jobs/<job_id>/claim', 401)
    # 403: a member runs a sweep; someone else's agent claims
    check(client.post('/api/jobs/expire', key=market.worker_key), 'POST', '/api/jobs/expire', 403)
    check(client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': market.agent['id']}, key=market.requester_key),
          'POST', '/api/jobs/<job_id>/claim', 403)
    # 404: a well-formed id that does not exist; an unknown path
    check(client.get(f'/api/jobs/{uuid.uuid4()}'), 'GET', '/api/jobs/<job_id>', 404)
    check(client.get(f'/api/disputes/{uuid.uuid4()}/vote'), 'GET', '/api/disputes/<dispute_id>/vote', 404)
    check.error(client.get('/api/nothing/here'), 404, 'not_found')
    # 405: a method the path does not take, and GET on a POST-only path that looks like a job id
    check.error(client.delete('/api/jobs'), 405, 'method_not_allowed')
    answer = check(client.get('/api/jobs/expire'), 'GET', '/api/jobs/<job_id>', 405)
    assert answer.headers['Allow'] == 'POST'
    # 409: the same agent claims twice
    market.claim(job)
    answer = check(client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': market.agent['id']},
                               key=market.worker_key), 'POST', '/api/jobs/<job_id>/claim', 409)
    assert answer.json['code'] == 'already_claimed'
    # 413: a body over 1 MiB
    check(client.post('/api/accounts', b'{"name": "' + b'x' * mp.MAX_BODY + b'"}'), 'POST', '/api/accounts', 413)


def test_a_rate_limited_answer_is_documented(tmp_path):
    settings = mp.Settings(db=str(tmp_path / 'limits.db'), rate_limits='on', rate_limit_scale=0.1,
                           public_url=BASE)
    app = wiring.make_app(settings)
    mp.CLOCK.set(mp.now())     # both requests in one rate-limit window
    try:
        client = Client(app)
        check = Checker(client.get('/api/openapi.json').json)
        check(client.post('/api/accounts', {'name': 'first'}), 'POST', '/api/accounts', 201)
        answer = check(client.post('/api/accounts', {'name': 'second'}), 'POST', '/api/accounts', 429)
        assert int(answer.headers['Retry-After']) > 0
        documented = check.operations[('POST', '/api/accounts')]['responses']['429']
        assert set(follow(check.document, documented)['headers']) == {'Retry-After', 'X-Request-Id', *openapi_spec.RATE_LIMIT_HEADERS}
    finally:
        app.service.close()
