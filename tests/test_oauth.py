"""OAuth 2.1 for MCP hosts (CONTRACT.md section 22) against `marketplace.py serve` as a process: the mcp SDK's own
OAuth client runs a host's whole flow (the 401's metadata, registration, the person signing in and approving in a
browser, the code exchanged with PKCE, tools with the token, a refresh, a revocation), and the refusals are tried by
hand: a wrong verifier, a code used twice, a redirect URI that does not match, a refresh token used twice, a token
of another service, and the key that approved it revoked."""

import base64
import hashlib
import html
import re
import secrets
import sqlite3
import subprocess
import sys
from urllib.parse import parse_qs, urlencode, urlsplit

import anyio.from_thread
import httpx2
import pytest
import requests
from mcp import Client
from mcp.client.auth import OAuthClientProvider
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import AuthorizationCodeResult, OAuthClientMetadata

from conftest import ROOT, LiveServer, in_hours
from test_server import Output, stop

TIMEOUT = 30
CALLBACK = 'http://127.0.0.1:33418/callback'


@pytest.fixture(scope='module')
def server(tmp_path_factory):
    live = LiveServer(tmp_path_factory.mktemp('oauth') / 'm.db').start()
    live.out = Output(live)
    yield live
    stop(live)


@pytest.fixture(scope='module')
def portal():
    with anyio.from_thread.start_blocking_portal() as portal:
        yield portal


def new_account(server, name):
    answer = requests.post(f'{server.url}/api/accounts', json={'name': name}, timeout=TIMEOUT)
    assert answer.status_code == 201, answer.text
    return answer.json()['account'], answer.json()['apiKey']


def hidden_fields(page, action):
    """The hidden inputs of the form posting to `action` in an HTML page."""
    form = re.search(rf'<form[^>]*action="{re.escape(action)}"[^>]*>(.*?)</form>', page, re.S).group(1)
    return {html.unescape(name): html.unescape(value)
            for name, value in re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form)}


class Person:
    """Someone at a browser (requests keeps the cookies): signs in with an API key when asked, then approves or
    denies what an authorization URL asks."""

    def __init__(self, server, key):
        self.server, self.key, self.browser = server, key, requests.Session()

    def decide(self, authorize_url, decision='approve'):
        """Open the authorization URL, sign in if sent there, then approve or deny: the answer (a redirect to the
        host, not followed), or the page that refused."""
        page = self.browser.get(authorize_url, timeout=TIMEOUT)
        if urlsplit(page.url).path == '/signin':
            fields = hidden_fields(page.text, '/signin')
            page = self.browser.post(f'{self.server.url}/signin', data=dict(fields, apiKey=self.key),
                                     timeout=TIMEOUT)
        if page.status_code != 200 or 'Connect an MCP host' not in page.text:
            return page
        fields = hidden_fields(page.text, '/oauth/authorize')
        return self.browser.post(f'{self.server.url}/oauth/authorize', data=dict(fields, decision=decision),
                                 allow_redirects=False, timeout=TIMEOUT)


class Memory:
    """The SDK's token storage, in memory."""

    def __init__(self):
        self.tokens = self.client = None

    async def get_tokens(self):
        return self.tokens

    async def set_tokens(self, tokens):
        self.tokens = tokens

    async def get_client_info(self):
        return self.client

    async def set_client_info(self, client_info):
        self.client = client_info


def pkce():
    verifier = secrets.token_urlsafe(48)
    challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b'=').decode()
    return verifier, challenge


def register(server, redirect_uris=(CALLBACK,), name='Test host'):
    return requests.post(f'{server.url}/oauth/register', json={'redirect_uris': list(redirect_uris),
                                                                'client_name': name}, timeout=TIMEOUT)


def authorize_url(server, client_id, challenge, redirect_uri=CALLBACK, **extra):
    query = {'response_type': 'code', 'client_id': client_id, 'redirect_uri': redirect_uri, 'state': 'xyz',
             'code_challenge': challenge, 'code_challenge_method': 'S256', **extra}
    return f'{server.url}/oauth/authorize?{urlencode(query)}'


def code_of(answer, state='xyz'):
    """The code of an approval's redirect to the host (its state checked, unless None: then (code, state))."""
    assert answer.status_code == 302, answer.text
    location = answer.headers['Location']
    assert location.startswith(CALLBACK + '?'), location
    query = parse_qs(urlsplit(location).query)
    if state is None:
        return query['code'][0], query['state'][0]
    assert query['state'] == [state]
    return query['code'][0]


def exchange(server, client_id, code, verifier, redirect_uri=CALLBACK):
    return requests.post(f'{server.url}/oauth/token', data={
        'grant_type': 'authorization_code', 'code': code, 'client_id': client_id, 'redirect_uri': redirect_uri,
        'code_verifier': verifier}, timeout=TIMEOUT)


def refresh(server, client_id, token):
    return requests.post(f'{server.url}/oauth/token', data={
        'grant_type': 'refresh_token', 'refresh_token': token, 'client_id': client_id}, timeout=TIMEOUT)


def me(server, token):
    """What the API makes of a token: GET /api/claims answers the token's account, or 401."""
    return requests.get(f'{server.url}/api/claims', headers={'Authorization': f'Bearer {token}'}, timeout=TIMEOUT)


def approved_tokens(server, key):
    """A registered client, its code approved by the key's account and exchanged: (client id, the token answer)."""
    client_id = register(server).json()['client_id']
    verifier, challenge = pkce()
    code = code_of(Person(server, key).decide(authorize_url(server, client_id, challenge)))
    answer = exchange(server, client_id, code, verifier)
    assert answer.status_code == 200, answer.text
    return client_id, answer.json()


def test_an_mcp_hosts_whole_flow_through_the_sdks_oauth_client(server, portal, tmp_path):
    account, key = new_account(server, 'oauth-person')
    person = Person(server, key)
    asked = []
    codes = []

    async def redirect_handler(url):
        asked.append(url)
        codes.append(code_of(person.decide(url), state=None))

    async def callback_handler():
        code, state = codes[-1]
        return AuthorizationCodeResult(code=code, state=state)

    storage = Memory()
    provider = OAuthClientProvider(
        server_url=f'{server.url}/mcp', storage=storage,
        client_metadata=OAuthClientMetadata(client_name='SDK host', redirect_uris=[CALLBACK],
                                            grant_types=['authorization_code', 'refresh_token'],
                                            response_types=['code'], token_endpoint_auth_method='none'),
        redirect_handler=redirect_handler, callback_handler=callback_handler)
    http = httpx2.AsyncClient(auth=provider, timeout=TIMEOUT)
    with portal.wrap_async_context_manager(Client(streamable_http_client(f'{server.url}/mcp', http_client=http))) \
            as client:
        posted = portal.call(client.call_tool, 'post_job', {
            'title': 'Connected by OAuth', 'description': 'Posted through /mcp with an access token.',
            'category': 'code', 'payment_amount': '3.00', 'deadline': in_hours(5)})
        assert not posted.is_error, posted.content[0].text
        assert posted.structured_content['job']['requesterId'] == account['id']
        assert len(asked) == 1 and storage.tokens.access_token.startswith('mat_')
        first_refresh = storage.tokens.refresh_token

        # The hour passes: the SDK refreshes (a new refresh token; the old one is spent) and goes on.
        db = sqlite3.connect(server.db)
        with db:            # for the server...
            db.execute("UPDATE oauth_tokens SET expires_at = '2000-01-01T00:00:00.000Z' WHERE kind = 'access'")
        provider.context.token_expiry_time = 1.0        # ... and for the host, which refreshes before it asks
        listed = portal.call(client.call_tool, 'my_claims', {})
        assert not listed.is_error, listed.content[0].text
        assert len(asked) == 1 and storage.tokens.refresh_token != first_refresh
        assert refresh(server, storage.client.client_id, first_refresh).json()['error'] == 'invalid_grant'
    # ... which, a refresh token used twice, ended the grant: every token of it stops at once.
    assert me(server, storage.tokens.access_token).status_code == 401

    connections = person.browser.get(f'{server.url}/my/connections', timeout=TIMEOUT)
    assert connections.status_code == 200 and 'No MCP host is connected.' in connections.text
    assert not any(storage.tokens.access_token in line or key in line for line in server.out.lines)


def test_approving_denying_and_revoking_on_the_connections_page(server):
    account, key = new_account(server, 'connections-person')
    client_id, tokens = approved_tokens(server, key)
    assert (tokens['token_type'].lower(), tokens['expires_in']) == ('bearer', 3600)
    assert me(server, tokens['access_token']).status_code == 200
    person = Person(server, key)
    page = person.decide(authorize_url(server, client_id, pkce()[1]), decision='deny')
    assert page.status_code == 302 and 'error=access_denied' in page.headers['Location']
    listing = person.browser.get(f'{server.url}/my/connections', timeout=TIMEOUT).text
    assert listing.count('<button type="submit" class="reject">Disconnect</button>') == 1
    grant = re.search(r'action="/my/connections/([^/]+)/revoke"', listing).group(1)
    revoked = person.browser.post(f'{server.url}/my/connections/{grant}/revoke',
                                  data=hidden_fields(listing, f'/my/connections/{grant}/revoke'), timeout=TIMEOUT)
    assert revoked.status_code == 200 and 'No MCP host is connected.' in revoked.text
    assert me(server, tokens['access_token']).status_code == 401
    assert refresh(server, client_id, tokens['refresh_token']).json()['error'] == 'invalid_grant'
    # Another person cannot revoke what is not theirs.
    _, other_key = new_account(server, 'someone-else')
    _, kept = approved_tokens(server, key)
    stranger = Person(server, other_key)
    stranger.decide(authorize_url(server, register(server).json()['client_id'], pkce()[1]), decision='deny')
    mine = re.search(r'action="/my/connections/([^/]+)/revoke"',
                     person.browser.get(f'{server.url}/my/connections', timeout=TIMEOUT).text).group(1)
    page = stranger.browser.get(f'{server.url}/my/connections', timeout=TIMEOUT).text
    answer = stranger.browser.post(f'{server.url}/my/connections/{mine}/revoke',
                                   data={'csrf': re.search(r'name="csrf" value="([^"]+)"', page).group(1)},
                                   timeout=TIMEOUT)
    assert answer.status_code == 404
    assert me(server, kept['access_token']).status_code == 200


def test_the_refusals_of_section_22(server):
    _, key = new_account(server, 'refusals-person')
    client_id = register(server).json()['client_id']
    person = Person(server, key)

    verifier, challenge = pkce()
    code = code_of(person.decide(authorize_url(server, client_id, challenge)))
    assert exchange(server, client_id, code, 'x' * 50).json()['error'] == 'invalid_grant'       # wrong verifier
    first = exchange(server, client_id, code, verifier)         # a wrong verifier leaves the code to its holder
    assert first.status_code == 200 and me(server, first.json()['access_token']).status_code == 200
    # Used again, a code ends its grant (and the tokens the first use got).
    verifier, challenge = pkce()
    code = code_of(person.decide(authorize_url(server, client_id, challenge)))
    tokens = exchange(server, client_id, code, verifier).json()
    assert me(server, tokens['access_token']).status_code == 200
    assert exchange(server, client_id, code, verifier).json()['error'] == 'invalid_grant'
    assert me(server, tokens['access_token']).status_code == 401

    # A redirect URI that is not registered exactly: a page that refuses, never a redirect there.
    verifier, challenge = pkce()
    page = person.decide(authorize_url(server, client_id, challenge, redirect_uri=CALLBACK + '/other'))
    assert page.status_code == 400 and 'Location' not in page.headers
    code = code_of(person.decide(authorize_url(server, client_id, challenge)))
    assert exchange(server, client_id, code, verifier, redirect_uri=CALLBACK + '/other').json()['error'] == \
        'invalid_grant'
    # PKCE is required, S256 only.
    for extra in ({'code_challenge_method': 'plain'}, {'code_challenge': ''}):
        assert person.decide(authorize_url(server, client_id, challenge, **extra)).status_code == 400
    # Registration: https or loopback only, no fragment.
    for uri in ('http://example.com/cb', 'https://host.example/cb#x', 'ftp://127.0.0.1/cb'):
        refused = register(server, [uri])
        assert refused.status_code == 400 and refused.json()['error'] in ('invalid_redirect_uri',
                                                                          'invalid_client_metadata'), uri
    # Malformed bodies: OAuth's own error answers, nothing registered or issued.
    clients = sqlite3.connect(server.db).execute('SELECT count(*) FROM oauth_clients').fetchone()[0]
    broken = requests.post(f'{server.url}/oauth/register', data=b'{nope', timeout=TIMEOUT,
                           headers={'Content-Type': 'application/json'})
    assert broken.status_code == 400 and broken.json()['error'] in ('invalid_request', 'invalid_client_metadata')
    assert sqlite3.connect(server.db).execute('SELECT count(*) FROM oauth_clients').fetchone()[0] == clients
    for form in ({'grant_type': 'password', 'username': 'a', 'password': 'b'}, {'code': 'x'}, {}):
        refused = requests.post(f'{server.url}/oauth/token', data=form, timeout=TIMEOUT)
        assert refused.status_code == 400 and refused.json()['error'] in ('unsupported_grant_type',
                                                                           'invalid_request'), form
    # A token of another service, or made up: 401 on the API and on /mcp.
    for token in ('mat_' + secrets.token_urlsafe(32), 'eyJhbGciOiJIUzI1NiJ9.e30.x'):
        assert me(server, token).status_code == 401
        assert requests.post(f'{server.url}/mcp', json={}, timeout=TIMEOUT,
                             headers={'Authorization': f'Bearer {token}'}).status_code == 401


def test_revoking_the_key_that_approved_ends_its_grants(server):
    account, key = new_account(server, 'key-revoker')
    client_id, tokens = approved_tokens(server, key)
    assert me(server, tokens['access_token']).status_code == 200
    key_id = sqlite3.connect(server.db).execute('SELECT id FROM api_keys WHERE account_id = ?',
                                                (account['id'],)).fetchone()[0]
    revoked = subprocess.run([sys.executable, str(ROOT / 'marketplace.py'), 'keys', 'revoke', key_id,
                              '--db', server.db], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert revoked.stdout.strip() == 'revoked', revoked.stderr
    assert me(server, tokens['access_token']).status_code == 401
    assert refresh(server, client_id, tokens['refresh_token']).json()['error'] == 'invalid_grant'
