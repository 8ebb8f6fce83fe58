"""Agent cards: one per agent, and the service's own A2A v1.0.0 card at the well-known paths."""

import copy
import json
import uuid

import pytest
from a2a.client.card_resolver import parse_agent_card
from a2a.utils.proto_utils import validate_proto_required_fields

import marketplace as mp
import wiring

from conftest import ADMIN_KEY, make_account, make_agent

CARD_PATHS = ['/.well-known/agent-card.json', '/.well-known/agent.json']


def header(answer, name):
    found = {key.lower(): value for key, value in answer.headers.items()}
    return found.get(name.lower())


def card_of(client, agent):
    answer = client.get(f'/api/agents/{agent["id"]}/card')
    assert answer.status == 200, answer
    return answer.json


# Per-agent cards ---------------------------------------------------------------

def test_agent_card_fields(client):
    _, key = make_account(client, 'owner')
    agent, _ = make_agent(
        client, key, name='Coder', description='Writes Python and Go.',
        capabilities={'categories': ['code', 'data'], 'languages': ['python', 'go'], 'maxJobValue': 500,
                      'avgCompletionTime': '30m'},
        pricing={'minimumJobValue': 5, 'acceptedCurrencies': ['USDC']})
    card = card_of(client, agent)
    assert card['name'] == 'Coder'
    assert card['description'] == 'Writes Python and Go.'
    assert card['url'] == f'http://market.test/api/agents/{agent["id"]}/card'
    assert isinstance(card['version'], str) and card['version']
    assert card['capabilities'] == {'categories': ['code', 'data'], 'languages': ['python', 'go'],
                                    'maxJobValue': 500, 'avgCompletionTime': '30m'}
    assert [skill['id'] for skill in card['skills']] == ['code', 'data']
    for skill in card['skills']:
        assert set(skill) == {'id', 'name', 'description', 'tags'}
        assert skill['tags'] == [skill['id'], 'python', 'go']
        assert skill['name'] and skill['description']
    assert card['reputation'] == {'score': '0.00', 'completionRate': 0.0, 'jobsCompleted': 0}
    assert card['payment'] == {'walletAddress': agent['walletAddress'], 'acceptedCurrencies': ['USDC'],
                               'minimumJobValue': '5.00'}


def test_agent_card_url_is_its_own_address(client, market):
    card = card_of(client, market.agent)
    path = card['url'].removeprefix('http://market.test')
    assert client.get(path).json == card


def test_agent_card_defaults_without_pricing_or_description(client, market):
    card = card_of(client, market.agent)
    assert card['description']
    assert card['payment']['minimumJobValue'] == '0.00'
    assert sorted(card['payment']['acceptedCurrencies']) == ['USD', 'USDC']


def test_agent_card_minimum_is_a_decimal_string_rounded_up_to_the_cent(client):
    _, key = make_account(client, 'owner')
    agent, _ = make_agent(client, key, pricing={'minimumJobValue': 2.501})
    assert card_of(client, agent)['payment']['minimumJobValue'] == '2.51'


def test_agent_card_reputation_after_an_approved_job(client, market):
    job, claim = market.delivered_job()
    assert market.verify(job, claim, True).status == 200
    card = card_of(client, market.agent)
    assert card['reputation'] == {'score': '1.00', 'completionRate': 1.0, 'jobsCompleted': 1}


def test_agent_card_never_shows_the_webhook(client):
    _, key = make_account(client, 'owner')
    agent, secret = make_agent(client, key, webhookUrl='https://hooks.example.com/secret-path')
    for viewer in (None, key, ADMIN_KEY):
        answer = client.get(f'/api/agents/{agent["id"]}/card', key=viewer)
        assert answer.status == 200
        text = json.dumps(answer.json)
        assert 'webhookUrl' not in text
        assert 'secret-path' not in text
        assert secret not in text


def test_agent_card_bad_id_is_400(client):
    answer = client.get('/api/agents/not-a-uuid/card')
    assert answer.status == 400
    assert answer.json['code'] == 'invalid_uuid'


def test_agent_card_unknown_agent_is_404(client):
    answer = client.get(f'/api/agents/{uuid.uuid4()}/card')
    assert answer.status == 404
    assert answer.json == {'error': 'No agent has this id.', 'code': 'not_found', 'status': 404}


def test_agent_card_accepts_an_uppercase_id(client, market):
    answer = client.get(f'/api/agents/{market.agent["id"].upper()}/card')
    assert answer.status == 200
    assert answer.json['url'] == f'http://market.test/api/agents/{market.agent["id"]}/card'


# The service card --------------------------------------------------------------

@pytest.mark.parametrize('path', CARD_PATHS)
def test_service_card_passes_the_a2a_strict_check(client, path):
    answer = client.get(path)
    assert answer.status == 200, answer
    assert header(answer, 'Content-Type') == 'application/json; charset=utf-8'
    parsed = parse_agent_card(copy.deepcopy(answer.json))
    validate_proto_required_fields(parsed)
    assert parsed.name == 'Job Marketplace'
    assert parsed.description
    assert parsed.version == mp.__version__ == '2.0.0'
    [interface] = parsed.supported_interfaces
    assert interface.url == 'http://market.test'
    assert interface.protocol_binding == 'HTTP+JSON'
    assert interface.protocol_version == '1.0'
    assert parsed.capabilities.streaming is True
    assert parsed.capabilities.push_notifications is True
    assert list(parsed.default_input_modes) == ['application/json']
    assert list(parsed.default_output_modes) == ['application/json']
    assert parsed.provider.organization and parsed.provider.url == 'http://market.test'
    import mcp_server      # the skills are the MCP tools, which POST /message:send runs (test_a2a.py)
    assert [skill.id for skill in parsed.skills] == list(mcp_server.TOOL_OPERATIONS)
    assert all(skill.examples and skill.tags for skill in parsed.skills)
    assert parsed.security_schemes['bearerAuth'].http_auth_security_scheme.scheme == 'Bearer'
    assert list(parsed.security_requirements[0].schemes) == ['bearerAuth']
    assert parsed.documentation_url == 'http://market.test/api/openapi.json'


def test_service_card_finds_work_by_search_match_feed_and_stream(client):
    card = client.get(CARD_PATHS[0]).json
    skills = {skill['id']: skill for skill in card['skills']}
    assert 'search' in skills['search_jobs']['tags'] and 'match' in skills['match_jobs']['tags']
    assert '/api/jobs/feed' in card['description'] and '/api/jobs/stream' in card['description']


def test_service_card_keeps_the_legacy_fields(client):
    card = client.get(CARD_PATHS[0]).json
    assert card['url'] == 'http://market.test'
    assert card['protocolVersion'] == '1.0'
    assert set(card['securitySchemes']) == {'bearerAuth', 'oauth'}
    scheme = card['securitySchemes']['bearerAuth']
    assert set(scheme) == {'httpAuthSecurityScheme'}
    assert scheme['httpAuthSecurityScheme']['scheme'] == 'Bearer'
    oauth = card['securitySchemes']['oauth']['oauth2SecurityScheme']
    assert oauth['oauth2MetadataUrl'] == 'http://market.test/.well-known/oauth-authorization-server'
    assert oauth['flows']['authorizationCode']['pkceRequired'] is True
    assert card['securityRequirements'] == [{'schemes': {'bearerAuth': {'list': []}}},
                                            {'schemes': {'oauth': {'list': []}}}]
    assert card['documentationUrl'].endswith('/api/openapi.json')


def test_both_paths_give_the_same_card_and_etag(client):
    first, second = (client.get(path) for path in CARD_PATHS)
    assert first.body == second.body
    assert header(first, 'ETag') == header(second, 'ETag')


@pytest.mark.parametrize('path', CARD_PATHS)
def test_service_card_cache_headers(client, path):
    answer = client.get(path)
    assert header(answer, 'Cache-Control') == 'public, max-age=300'
    etag = header(answer, 'ETag')
    assert etag.startswith('"') and etag.endswith('"') and not etag.startswith('W/')
    assert header(client.get(path), 'ETag') == etag


@pytest.mark.parametrize('path', CARD_PATHS)
def test_if_none_match_answers_304_without_a_body(client, path):
    etag = header(client.get(path), 'ETag')
    answer = client.get(path, headers={'If-None-Match': etag})
    assert answer.status == 304
    assert answer.body == b''
    assert header(answer, 'ETag') == etag
    assert header(answer, 'Cache-Control') == 'public, max-age=300'
    assert header(answer, 'Content-Type') is None


def test_if_none_match_lists_and_weak_tags_match(client):
    etag = header(client.get(CARD_PATHS[0]), 'ETag')
    for value in (f'"other", {etag}', f'W/{etag}', '*'):
        assert client.get(CARD_PATHS[0], headers={'If-None-Match': value}).status == 304, value


def test_a_stale_etag_gets_the_card(client):
    answer = client.get(CARD_PATHS[0], headers={'If-None-Match': '"stale"'})
    assert answer.status == 200
    assert answer.json['name'] == 'Job Marketplace'


def test_the_card_follows_the_public_url(tmp_path):
    settings = mp.Settings(db=str(tmp_path / 'other.db'), rate_limits='off', public_url='https://jobs.example.org/')
    app = wiring.make_app(settings)
    try:
        status, headers, card = mp.call_app(app, 'GET', '/.well-known/agent-card.json')
    finally:
        app.service.close()
    assert status == 200
    assert card['url'] == card['supportedInterfaces'][0]['url'] == 'https://jobs.example.org'
    assert card['documentationUrl'] == 'https://jobs.example.org/api/openapi.json'
