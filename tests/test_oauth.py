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
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import parse_qs, urlencode, urlsplit

import anyio.from_thread
import httpx2
import pytest
import requests
from mcp import Client
from mcp.client.auth import OAuthClientProvider
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import AuthorizationCodeResult, OAuthClientMetadata

import marketplace as mp
import wiring
from conftest import ADMIN_KEY, ROOT, Client as AppClient, LiveServer, in_hours
from test_pages import Page
from test_pages_actions import Browser, sign_up
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
        """Open the authorization URL, sign in if sent there, then approve or deny: the answer (the page that sends
        the browser on to the host, see sent_to), or the page that refused."""
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
    return f'{server.url if server else ""}/oauth/authorize?{urlencode(query)}'      # None: the path alone


def sent_to(answer):
    """Where the page that answers an approval or a denial sends the browser on to (its meta refresh, which its
    "continue" link repeats): a page of this site, not a redirect (the pages' CSP: form-action 'self')."""
    assert answer.status_code == 200 and 'Location' not in answer.headers, answer.text
    location = html.unescape(re.search(r'<meta http-equiv="refresh" content="0; url=([^"]+)">', answer.text).group(1))
    assert html.unescape(re.search(r'<a id="continue" href="([^"]+)"', answer.text).group(1)) == location
    return location


def code_of(answer, state='xyz'):
    """The code an approval sends the host (its state checked, unless None: then (code, state))."""
    location = sent_to(answer)
    assert location.startswith(CALLBACK + '?'), location
    query = parse_qs(urlsplit(location).query)
    if state is None:
        return query['code'][0], query['state'][0]
    assert query['state'] == [state]
    return query['code'][0]


def exchange(server, client_id, code, verifier, redirect_uri=CALLBACK, http=requests):
    return http.post(f'{server.url}/oauth/token', data={
        'grant_type': 'authorization_code', 'code': code, 'client_id': client_id, 'redirect_uri': redirect_uri,
        'code_verifier': verifier}, timeout=TIMEOUT)


def refresh(server, client_id, token, http=requests):
    return http.post(f'{server.url}/oauth/token', data={
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
    denied = parse_qs(urlsplit(sent_to(page)).query)
    assert (denied['error'], denied['state'], 'code' in denied) == (['access_denied'], ['xyz'], False)
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


# Round 4 (CONTRACT 25): codes and refresh tokens spent atomically, clients never approved forgotten, an approval
# page that says who registered the host, no admin approvals, and registration bodies of the wrong types --------

RACERS = 20


def at_once(server, send, count=RACERS):
    """`send(http)` from `count` threads released together, each on a connection of its own opened before: the
    answers, in no order."""
    barrier = threading.Barrier(count)

    def one(_):
        with requests.Session() as http:
            assert http.get(f'{server.url}/api/health', timeout=TIMEOUT).status_code == 200
            barrier.wait()
            return send(http)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def grant_row(server, client_id):
    db = sqlite3.connect(server.db)
    db.row_factory = sqlite3.Row
    return db.execute('SELECT * FROM oauth_grants WHERE client_id = ?', (client_id,)).fetchone()


def tokens_of(server, grant_id):
    return sqlite3.connect(server.db).execute('SELECT kind, count(*) FROM oauth_tokens WHERE grant_id = ? '
                                              'GROUP BY kind ORDER BY kind', (grant_id,)).fetchall()


ROUNDS = 3      # a race each, on a new code or refresh token: an unfixed server lost one of three in every run tried


def test_one_code_sent_20_times_at_once_gives_one_token_and_revokes_its_grant(server):
    _, key = new_account(server, 'code-racer')
    person = Person(server, key)
    for _ in range(ROUNDS):
        client_id = register(server).json()['client_id']
        verifier, challenge = pkce()
        code = code_of(person.decide(authorize_url(server, client_id, challenge)))
        answers = at_once(server, lambda http: exchange(server, client_id, code, verifier, http=http))
        issued = [answer.json() for answer in answers if answer.status_code == 200]
        refused = [answer.json()['error'] for answer in answers if answer.status_code != 200]
        assert (len(issued), refused) == (1, ['invalid_grant'] * (RACERS - 1))
        grant = grant_row(server, client_id)
        assert tokens_of(server, grant['id']) == [('access', 1), ('refresh', 1)]     # one pair stored, no more
        # The code was used again: the grant is revoked, and the one token it gave with it.
        assert grant['revoked_at'] is not None
        assert me(server, issued[0]['access_token']).status_code == 401
        assert refresh(server, client_id, issued[0]['refresh_token']).json()['error'] == 'invalid_grant'


def test_one_refresh_token_sent_20_times_at_once_gives_one_token_and_revokes_its_grant(server):
    _, key = new_account(server, 'refresh-racer')
    for _ in range(ROUNDS):
        client_id, tokens = approved_tokens(server, key)
        answers = at_once(server, lambda http: refresh(server, client_id, tokens['refresh_token'], http=http))
        issued = [answer.json() for answer in answers if answer.status_code == 200]
        refused = [answer.json()['error'] for answer in answers if answer.status_code != 200]
        assert (len(issued), refused) == (1, ['invalid_grant'] * (RACERS - 1))
        grant = grant_row(server, client_id)
        assert tokens_of(server, grant['id']) == [('access', 2), ('refresh', 2)]     # the first pair and one more
        assert grant['revoked_at'] is not None
        for token in (tokens['access_token'], issued[0]['access_token']):
            assert me(server, token).status_code == 401
        assert refresh(server, client_id, issued[0]['refresh_token']).json()['error'] == 'invalid_grant'


def test_the_approval_page_says_the_host_registered_itself_and_shows_where_it_is_sent(server):
    _, key = new_account(server, 'careful-person')
    client_id = register(server, ['https://claude-desktop.example:8443/callback'],
                         name='Claude Desktop (official)').json()['client_id']
    person = Person(server, key)
    url = authorize_url(server, client_id, pkce()[1], redirect_uri='https://claude-desktop.example:8443/callback')
    page = person.browser.get(url, timeout=TIMEOUT)
    page = person.browser.post(f'{server.url}/signin', data=dict(hidden_fields(page.text, '/signin'), apiKey=key),
                               timeout=TIMEOUT)
    assert page.status_code == 200
    assert '<p class="unverified"><strong>Registered by itself, not verified.</strong>' in page.text
    assert 'A host that calls itself “Claude Desktop (official)” asks to act as you' in page.text
    assert '<p class="redirect-host" id="redirect-host">claude-desktop.example:8443</p>' in page.text
    assert 'action="/oauth/authorize"' in page.text


def test_an_admins_session_cannot_approve_a_host(server):
    client_id = register(server, name='Claude Desktop (official)').json()['client_id']
    admin = Person(server, ADMIN_KEY)
    url = authorize_url(server, client_id, pkce()[1])
    page = admin.decide(url)            # signs in as the admin: the page refuses, with no buttons to press
    assert page.status_code == 403
    assert "An admin&#039;s session cannot approve an MCP host" in page.text
    assert 'action="/oauth/authorize"' not in page.text and 'value="approve"' not in page.text
    # ... and the POST the page does not offer is refused too: no grant, no code.
    fields = {name: values[0] for name, values in parse_qs(urlsplit(url).query).items()}
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
    for decision in ('approve', 'deny'):
        answer = admin.browser.post(f'{server.url}/oauth/authorize', data=dict(fields, csrf=csrf, decision=decision),
                                    allow_redirects=False, timeout=TIMEOUT)
        assert answer.status_code == 403 and 'Location' not in answer.headers
        assert "An admin&#039;s session cannot approve an MCP host" in answer.text
    assert grant_row(server, client_id) is None


GOOD_METADATA = {'redirect_uris': [CALLBACK], 'client_name': 'Typed host'}
WRONG_TYPES = [1, None, True, {'a': 'b'}, ['a']]
TEXT_FIELDS = ['client_name', 'token_endpoint_auth_method', 'scope', 'client_uri', 'logo_uri', 'tos_uri', 'policy_uri',
               'jwks_uri', 'software_id', 'software_version', 'software_statement', 'client_name#fr']
LIST_FIELDS = ['redirect_uris', 'grant_types', 'response_types', 'contacts']
WRONG_BODIES = ([(field, value) for field in TEXT_FIELDS for value in WRONG_TYPES]
                + [(field, value) for field in LIST_FIELDS
                   for value in (1, None, True, {'a': 'b'}, 'x', [1], [None], [{'a': 'b'}], [['x']], ['x', 2])]
                + [('jwks', value) for value in (1, None, 'x', [], {'a': 1}, {'keys': 'x'}, {'keys': [{'kty': 1}]})])


def test_a_registration_of_the_wrong_types_is_invalid_client_metadata(server):
    clients = sqlite3.connect(server.db).execute('SELECT count(*) FROM oauth_clients').fetchone()[0]
    for field, value in WRONG_BODIES:
        answer = requests.post(f'{server.url}/oauth/register', json=dict(GOOD_METADATA, **{field: value}),
                               timeout=TIMEOUT)
        assert (answer.status_code, answer.json()['error']) == (400, 'invalid_client_metadata'), (field, value)
    assert sqlite3.connect(server.db).execute('SELECT count(*) FROM oauth_clients').fetchone()[0] == clients
    for uri in ('http://127.0.0.1:1/c b', 'http://127.0.0.1:1/c\tb', 'https://trusted.example@evil.example/cb'):
        answer = register(server, [uri])
        assert (answer.status_code, answer.json()['error']) == (400, 'invalid_client_metadata'), uri
    assert register(server).status_code == 201


class InProcessHost:
    """A host and a person over the in-process app (whose clock tests move): registration, the approval by a
    signed-up person's session, and the code's exchange."""

    def __init__(self, app):
        self.app, self.browser = app, Browser(app)
        sign_up(self.browser, 'Grace')

    def register(self, name):
        answer = AppClient(self.app).post('/oauth/register', {'redirect_uris': [CALLBACK], 'client_name': name})
        assert answer.status == 201, answer
        return answer.json['client_id']

    def connect(self, client_id):
        """Approve the client and exchange its code: the token answer."""
        verifier, challenge = pkce()
        path = authorize_url(None, client_id, challenge)
        sent = Page(self.browser.submit(path, '/oauth/authorize', decision='approve'))
        location = html.unescape(re.search(r'url=([^"]+)"', sent.html).group(1))
        code = parse_qs(urlsplit(location).query)['code'][0]
        answer = AppClient(self.app).post('/oauth/token', urlencode({
            'grant_type': 'authorization_code', 'code': code, 'client_id': client_id, 'redirect_uri': CALLBACK,
            'code_verifier': verifier}).encode(), headers={'Content-Type': 'application/x-www-form-urlencoded'})
        assert answer.status == 200, answer
        return answer.json

    def clients(self):
        return {row['name'] for row in self.app.service.db.rows('SELECT name FROM oauth_clients')}


@pytest.fixture
def loopback_app(tmp_path):
    """The app in-process, its public URL on loopback (OAuth refuses plain http elsewhere)."""
    app = wiring.make_app(mp.Settings(db=str(tmp_path / 'oauth.db'), rate_limits='off', admin_key=ADMIN_KEY,
                                      public_url='http://127.0.0.1:8080'))
    yield app
    app.service.close()


def test_a_client_never_approved_is_deleted_a_day_after_it_registered(loopback_app, real_clock):
    real_clock.set(mp.now())
    host = InProcessHost(loopback_app)
    host.register('Never approved')
    connected = host.register('Approved')
    tokens = host.connect(connected)
    half_approved = host.register('Approved, its code never exchanged')
    path = authorize_url(None, half_approved, pkce()[1])
    assert host.browser.submit(path, '/oauth/authorize', decision='approve').status == 200
    real_clock.advance(hours=23, minutes=59)
    host.register('A day later')              # registration forgets what is over a day old: nothing yet
    assert host.clients() == {'Never approved', 'Approved', 'Approved, its code never exchanged', 'A day later'}
    real_clock.advance(minutes=2)
    host.register('Later still')
    assert host.clients() == {'Approved', 'A day later', 'Later still'}
    db = loopback_app.service.db
    assert db.value('SELECT count(*) FROM oauth_grants WHERE client_id = :id', {'id': half_approved}) == 0
    assert db.value('SELECT count(*) FROM oauth_codes') == 1           # the exchanged one's, spent
    answer = AppClient(loopback_app).get('/api/claims', key=tokens['access_token'])
    assert answer.status == 401         # its hour has passed; its refresh token still works, the client kept
    refreshed = AppClient(loopback_app).post('/oauth/token', urlencode({
        'grant_type': 'refresh_token', 'refresh_token': tokens['refresh_token'], 'client_id': connected}).encode(),
        headers={'Content-Type': 'application/x-www-form-urlencoded'})
    assert refreshed.status == 200, refreshed
    assert AppClient(loopback_app).get('/api/claims', key=refreshed.json['access_token']).status == 200
