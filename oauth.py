"""OAuth 2.1 for MCP hosts (CONTRACT.md section 22): the service as its own authorization server, so that a person
connects an MCP host to <base-url>/mcp by signing in and approving, and nobody copies a key.

authlib's server parts speak the protocol: the authorization code grant with PKCE (S256 only), refresh tokens
rotated on use, dynamic client registration (RFC 7591). This module hands them bottle's requests and the database,
and owns what is the service's: the metadata documents (RFC 9728 for the resource, RFC 8414 for the server), the
approval page (a signed-in person, the site's CSRF and session rules) and /my/connections. Codes and tokens are
stored only as hashes, and spent by the first write of the transaction that issues tokens (spend: a code or a
refresh token used twice, even at once, revokes its grant); an access token (ACCESS_TOKEN_PREFIX) is taken by the
whole API as a key is (marketplace.account_for_key). A grant remembers the key whose session approved it: revoking
that key ends it. Clients never approved are deleted a day after they registered (forget_unapproved_clients, at
registration). Only this module imports authlib.
"""

import json
import secrets
from collections import defaultdict
from datetime import timedelta
from urllib.parse import urlencode, urlsplit

from authlib.oauth2 import AuthorizationServer, OAuth2Request
from authlib.oauth2.rfc6749 import ClientMixin, grants
from authlib.oauth2.rfc6749.errors import (InsecureTransportError, InvalidGrantError, InvalidRequestError,
                                            OAuth2Error)
from authlib.oauth2.rfc6749.requests import OAuth2Payload
from authlib.oauth2.rfc6750 import BearerTokenGenerator
from authlib.oauth2.rfc7591 import ClientRegistrationEndpoint
from authlib.oauth2.rfc7636 import CodeChallenge
from bottle import HTTPResponse, request, response

from marketplace import (ACCESS_TOKEN_PREFIX, APIError, Forbidden, NotFound, hash_key, iso, new_id, now, now_iso,
                         read_raw_body, route, service)
from pages import browser_route, posted_form, render, require_viewer, see_other, session_viewer

ACCESS_SECONDS = 3600               # an access token lives an hour
REFRESH_DAYS = 30                   # a refresh token 30 days, and is replaced by a new one each time it is used
CODE_SECONDS = 60                   # a code lives a minute and is used once
REFRESH_PREFIX = 'mrt_'
MAX_REDIRECT_URIS = 10
MAX_CLIENT_NAME = 100
SCOPES = ['marketplace']            # the only scope, which may be left out: a token acts as its account, as a key
UNAPPROVED_CLIENT_LIFETIME = timedelta(hours=24)     # a client never approved is deleted after a day


def redirect_uri_problem(uri):
    """Why a redirect URI may not be registered (OAuth 2.1: https, or http to a loopback address), or None."""
    if not isinstance(uri, str) or len(uri) > 2000:
        return 'must be a URI of at most 2000 characters'
    if any(char <= ' ' or char == '\x7f' for char in uri):
        return 'must have no spaces or control characters'
    parts = urlsplit(uri)
    if parts.fragment or '#' in uri:
        return 'must have no fragment'
    if '@' in parts.netloc:
        return 'must have no user name or password (the approval page shows the host a person is sent to)'
    if parts.scheme == 'https' and parts.hostname:
        return None
    if parts.scheme == 'http' and parts.hostname in ('127.0.0.1', '::1', 'localhost'):
        return None
    return 'must be https, or http to a loopback address (127.0.0.1, [::1] or localhost)'


# RFC 7591's metadata by the JSON type it must have; a localized name (`client_name#fr`) is text as its field is.
TEXT_METADATA = ('client_name', 'token_endpoint_auth_method', 'scope', 'client_uri', 'logo_uri', 'tos_uri',
                 'policy_uri', 'jwks_uri', 'software_id', 'software_version', 'software_statement')
TEXT_LIST_METADATA = ('redirect_uris', 'grant_types', 'response_types', 'contacts')
OBJECT_METADATA = ('jwks',)


def metadata_type_problems(data):
    """What in a registration's JSON body is not of its field's type (text, a list of text, an object; a null is
    none of them), by field: checked before authlib reads the metadata, which fails on a number where text
    belongs."""
    problems = {}
    for name, value in data.items():
        field = name.split('#', 1)[0]
        if field in TEXT_METADATA and not isinstance(value, str):
            problems[name] = 'must be a string'
        elif field in TEXT_LIST_METADATA and not (isinstance(value, list)
                                                   and all(isinstance(item, str) for item in value)):
            problems[name] = 'must be a list of strings'
        elif field in OBJECT_METADATA and not isinstance(value, dict):
            problems[name] = 'must be an object'
    return problems


class Client(ClientMixin):
    """A registered MCP host: a public client (PKCE, no secret), its redirect URIs matched exactly."""

    def __init__(self, row):
        self.row, self.redirect_uris = row, json.loads(row['redirect_uris'])

    def get_client_id(self):
        return self.row['client_id']

    def get_default_redirect_uri(self):
        return None         # the authorization request names one: exact match, never a guess

    def get_allowed_scope(self, scope):
        return ''           # no scopes: a token acts as the account that approved it, as a key does

    def check_redirect_uri(self, redirect_uri):
        return redirect_uri in self.redirect_uris

    def check_client_secret(self, client_secret):
        return False

    def check_endpoint_auth_method(self, method, endpoint):
        return method == 'none'

    def check_response_type(self, response_type):
        return response_type == 'code'

    def check_grant_type(self, grant_type):
        return grant_type in ('authorization_code', 'refresh_token')


class Code:
    """An authorization code as the grant reads it back."""

    def __init__(self, row):
        self.row = row
        self.code_challenge, self.code_challenge_method = row['code_challenge'], 'S256'

    def get_redirect_uri(self):
        return self.row['redirect_uri']

    def get_scope(self):
        return ''


class RefreshToken:
    """A refresh token as the refresh grant reads it back."""

    def __init__(self, row):
        self.row = row

    def check_client(self, client):
        return client.get_client_id() == self.row['client_id']

    def get_scope(self):
        return ''


class CodeGrant(grants.AuthorizationCodeGrant):
    TOKEN_ENDPOINT_AUTH_METHODS = ['none']

    def save_authorization_code(self, code, oauth_request):
        """The person approved: the grant and its code, in one transaction (the code as its hash)."""
        db, approval = service().db, oauth_request.user
        with db.transaction():
            db.insert('oauth_grants', {'id': approval['grant_id'], 'client_id': oauth_request.client.get_client_id(),
                                       'account_id': approval['account_id'], 'key_id': approval['key_id'],
                                       'scope': '', 'created_at': now_iso(), 'used_at': None, 'revoked_at': None})
            db.insert('oauth_codes', {
                'code_hash': hash_key(code), 'grant_id': approval['grant_id'],
                'redirect_uri': oauth_request.payload.redirect_uri,
                'code_challenge': oauth_request.payload.data['code_challenge'],
                'expires_at': iso(now() + timedelta(seconds=CODE_SECONDS)), 'used_at': None})

    def query_authorization_code(self, code, client):
        """A code of this client, unexpired and never used. A code used again revokes its grant (RFC 9700: the
        code may have been stolen), and what the first use issued with it."""
        db = service().db
        row = db.row('''SELECT c.*, g.client_id, g.revoked_at FROM oauth_codes c
                        JOIN oauth_grants g ON g.id = c.grant_id WHERE c.code_hash = :h''', {'h': hash_key(code)})
        if row is None or row['client_id'] != client.get_client_id() or row['revoked_at']:
            return None
        if row['used_at']:
            revoke_grant(db, row['grant_id'])
            return None
        return Code(row) if row['expires_at'] > now_iso() else None

    def delete_authorization_code(self, authorization_code):
        """Nothing: the code was spent by Server.save_token, in the transaction that stored its tokens."""

    def authenticate_user(self, authorization_code):
        return {'grant_id': authorization_code.row['grant_id']}


class RefreshGrant(grants.RefreshTokenGrant):
    TOKEN_ENDPOINT_AUTH_METHODS = ['none']
    INCLUDE_NEW_REFRESH_TOKEN = True

    def authenticate_refresh_token(self, refresh_token):
        """A live refresh token of a live grant. One used already (rotated) revokes its grant: a refresh token is
        used once, so a second use means two holders."""
        db = service().db
        row = db.row('''SELECT t.*, g.client_id, g.revoked_at AS grant_revoked FROM oauth_tokens t
                        JOIN oauth_grants g ON g.id = t.grant_id
                        JOIN api_keys k ON k.id = g.key_id AND k.revoked_at IS NULL
                        WHERE t.token_hash = :h AND t.kind = 'refresh' ''', {'h': hash_key(refresh_token)})
        if row is None or row['grant_revoked'] or row['expires_at'] <= now_iso():
            return None
        if row['revoked_at']:
            revoke_grant(db, row['grant_id'])
            return None
        return RefreshToken(row)

    def authenticate_user(self, refresh_token):
        return {'grant_id': refresh_token.row['grant_id']}

    def revoke_old_credential(self, refresh_token):
        """Nothing: the refresh token was spent by Server.save_token, in the transaction that stored the new ones."""


class Registration(ClientRegistrationEndpoint):
    """RFC 7591, open to anyone (as POST /api/accounts is, under its rate limit): a public client, its name and
    its redirect URIs, each https or loopback. Whatever authentication method it asks for, it is registered as a
    public client (token_endpoint_auth_method none, no secret: PKCE proves the code's holder), and told so."""

    def authenticate_token(self, oauth_request):
        return True

    def resolve_public_key(self, oauth_request):
        return None

    def get_server_metadata(self):
        return server_metadata()

    def extract_client_metadata(self, oauth_request):
        """The registered metadata, each field of its type first (metadata_type_problems): a body of the wrong
        types is invalid_client_metadata, never a failure inside authlib."""
        problems = metadata_type_problems(oauth_request.payload.data)
        if problems:
            raise InvalidClientMetadata(problems)
        try:
            return super().extract_client_metadata(oauth_request)
        except (KeyError, TypeError, ValueError, AttributeError) as error:    # jwks: an object, but not a key set
            raise InvalidClientMetadata({'metadata': f'is not valid ({type(error).__name__})'}) from None

    def save_client(self, client_info, client_metadata, oauth_request):
        uris = client_metadata.get('redirect_uris') or []
        problems = {f'redirect_uris[{index}]': redirect_uri_problem(uri) for index, uri in enumerate(uris)
                    if redirect_uri_problem(uri)}
        if not uris or len(uris) > MAX_REDIRECT_URIS or problems:
            raise InvalidClientMetadata(problems or {'redirect_uris': f'1 to {MAX_REDIRECT_URIS} are required'})
        name = (client_metadata.get('client_name') or 'An unnamed MCP host')[:MAX_CLIENT_NAME]
        db, moment = service().db, now()
        with db.transaction():
            forget_unapproved_clients(db, moment)
            db.insert('oauth_clients', {'client_id': client_info['client_id'], 'name': name,
                                        'redirect_uris': json.dumps(uris), 'created_at': iso(moment)})
        return Client({'client_id': client_info['client_id'], 'name': name, 'redirect_uris': json.dumps(uris)})

    def generate_client_info(self, oauth_request):
        """A client id, and no secret: public clients."""
        return {'client_id': secrets.token_urlsafe(24), 'client_id_issued_at': int(now().timestamp())}

    def generate_client_registration_info(self, client, oauth_request):
        """What the answer says the client is, whatever it asked: public, code and refresh token grants."""
        return {'client_name': client.row['name'], 'token_endpoint_auth_method': 'none',
                'grant_types': ['authorization_code', 'refresh_token'], 'response_types': ['code']}


class InvalidClientMetadata(OAuth2Error):
    error = 'invalid_client_metadata'
    status_code = 400

    def __init__(self, fields):
        super().__init__(description='; '.join(f'{name} {why}' for name, why in fields.items()))


class Server(AuthorizationServer):
    """authlib's server over bottle and the service's database."""

    def __init__(self):
        super().__init__(scopes_supported=SCOPES)
        self.register_grant(CodeGrant, [S256Only(required=True)])
        self.register_grant(RefreshGrant)
        self.register_endpoint(Registration)
        self.register_token_generator('default', BearerTokenGenerator(
            access_token_generator=lambda **kwargs: ACCESS_TOKEN_PREFIX + secrets.token_urlsafe(32),
            refresh_token_generator=lambda **kwargs: REFRESH_PREFIX + secrets.token_urlsafe(32),
            expires_generator=lambda client, grant_type: ACCESS_SECONDS))

    def query_client(self, client_id):
        row = service().db.row('SELECT * FROM oauth_clients WHERE client_id = :id', {'id': client_id or ''})
        return Client(row) if row else None

    def save_token(self, token, oauth_request):
        """The tokens issued, as hashes, in the transaction whose first write spends what paid for them (the code,
        or the refresh token); the grant's `used_at` moves on; codes and tokens long expired go. Already spent (the
        same code or refresh token sent twice at once: both were read unspent), nothing is stored, the grant is
        revoked with what the first use issued, and the answer is invalid_grant."""
        db, grant_id, moment = service().db, oauth_request.user['grant_id'], now()
        with db.transaction():
            spent = spend(db, oauth_request, moment)
            if not spent:
                db.execute('UPDATE oauth_grants SET revoked_at = coalesce(revoked_at, :now) WHERE id = :id',
                           {'now': iso(moment), 'id': grant_id})
            else:
                for kind, value, expires in (('access', token['access_token'], timedelta(seconds=ACCESS_SECONDS)),
                                             ('refresh', token.get('refresh_token'), timedelta(days=REFRESH_DAYS))):
                    if value:
                        db.insert('oauth_tokens', {'token_hash': hash_key(value), 'grant_id': grant_id,
                                                   'kind': kind, 'expires_at': iso(moment + expires),
                                                   'revoked_at': None, 'created_at': iso(moment)})
                db.execute('UPDATE oauth_grants SET used_at = :now WHERE id = :id',
                           {'now': iso(moment), 'id': grant_id})
                # what expired over a day ago is forgotten (a refresh token used twice is caught until it expires)
                for table in ('oauth_codes', 'oauth_tokens'):
                    db.execute(f'DELETE FROM {table} WHERE expires_at < :old',
                               {'old': iso(moment - timedelta(days=1))})
        if not spent:
            raise InvalidGrantError('This code or refresh token was used already: its grant is revoked.')

    def create_oauth2_request(self, fields=None):
        return fields if isinstance(fields, OAuth2Request) else bottle_request(fields)

    def create_json_request(self, fields=None):
        return bottle_request(fields, json_body=True)

    def handle_response(self, status, body, headers):
        body = json.dumps(body) if isinstance(body, dict) else (body or '')
        return HTTPResponse(body, status, headers=dict(headers or ()))

    def send_signal(self, name, *args, **kwargs):
        pass


class S256Only(CodeChallenge):
    """PKCE with S256 only (OAuth 2.1): a challenge without its method, or with "plain", is refused."""
    SUPPORTED_CODE_CHALLENGE_METHOD = ['S256']

    def validate_code_challenge(self, grant, redirect_uri):
        if grant.request.payload.data.get('code_challenge_method') != 'S256':
            raise InvalidRequestError("PKCE is required: code_challenge with code_challenge_method 'S256'.")
        return super().validate_code_challenge(grant, redirect_uri)


class BottleOAuth2Request(OAuth2Request):
    """An OAuth2Request whose query and form are the fields given (authlib reads both)."""

    @property
    def args(self):
        return self.payload.data

    @property
    def form(self):
        return self.payload.data


class Payload(OAuth2Payload):
    def __init__(self, fields):
        self._fields = fields

    @property
    def data(self):
        return {name: values[0] for name, values in self._fields.items()}

    @property
    def datalist(self):
        return self._fields


def bottle_request(fields=None, json_body=False):
    """authlib's view of this request: its query and form fields (or `fields`, {name: [values]}), or a JSON body."""
    if fields is None:
        fields = defaultdict(list)
        for source in (request.query, request.forms) if request.method == 'POST' and not json_body else \
                (request.query,):
            for name in source.keys():
                fields[name].extend(source.getall(name))
    try:
        oauth_request = BottleOAuth2Request(request.method, service().settings.base_url + request.fullpath,
                                            headers=dict(request.headers))
    except InsecureTransportError:
        raise APIError('OAuth needs https (or a loopback address): this service\'s --public-url is plain http on '
                       'another host.', code='insecure_transport') from None
    oauth_request.payload = Payload(fields)
    if json_body:
        from authlib.oauth2.rfc6749 import JsonRequest
        json_request = JsonRequest(request.method, oauth_request.uri, oauth_request.headers)
        json_request.payload = JsonPayload(read_raw_body())
        return json_request
    return oauth_request


class JsonPayload:
    def __init__(self, raw):
        try:
            self.data = json.loads(raw or b'{}')
        except ValueError:
            self.data = None
        if not isinstance(self.data, dict):
            self.data = {}


def revoke_grant(db, grant_id):
    """End a grant: its tokens stop working at once (account_for_key and the refresh grant read the grant)."""
    with db.transaction():
        db.execute('UPDATE oauth_grants SET revoked_at = coalesce(revoked_at, :now) WHERE id = :id',
                   {'now': now_iso(), 'id': grant_id})


def forget_unapproved_clients(db, moment):
    """Delete, in the caller's transaction, the clients registered over a day ago that were never approved (no
    grant of theirs ever exchanged its code), with those grants and their codes (an approval whose code was never
    exchanged, dead since its minute passed); how many clients. Registration calls it, so the table holds no more
    never-approved clients than one day's registrations."""
    old = {'old': iso(moment - UNAPPROVED_CLIENT_LIFETIME)}
    db.execute('''DELETE FROM oauth_codes WHERE grant_id IN
                      (SELECT id FROM oauth_grants WHERE used_at IS NULL AND created_at < :old)''', old)
    db.execute('DELETE FROM oauth_grants WHERE used_at IS NULL AND created_at < :old', old)
    return db.execute('''DELETE FROM oauth_clients WHERE created_at < :old
                         AND NOT EXISTS (SELECT 1 FROM oauth_grants g WHERE g.client_id = oauth_clients.client_id)''',
                      old)


def spend(db, oauth_request, moment):
    """Spend the code or the refresh token that pays for this token request, inside the caller's transaction: an
    UPDATE that only an unspent one passes, so of two requests that both read it unspent, one spends it. False when
    it was spent already."""
    if oauth_request.authorization_code is not None:
        return db.execute('UPDATE oauth_codes SET used_at = :now WHERE code_hash = :h AND used_at IS NULL',
                          {'now': iso(moment), 'h': oauth_request.authorization_code.row['code_hash']}) == 1
    return db.execute('''UPDATE oauth_tokens SET revoked_at = :now
                         WHERE token_hash = :h AND kind = 'refresh' AND revoked_at IS NULL''',
                      {'now': iso(moment), 'h': oauth_request.refresh_token.row['token_hash']}) == 1


def the_server():
    svc = service()
    if getattr(svc, 'oauth', None) is None:
        svc.oauth = Server()
    return svc.oauth


# Metadata ---------------------------------------------------------------------------------------------------------

def server_metadata():
    base = service().settings.base_url
    return {'issuer': base, 'authorization_endpoint': f'{base}/oauth/authorize',
            'token_endpoint': f'{base}/oauth/token', 'registration_endpoint': f'{base}/oauth/register',
            'response_types_supported': ['code'], 'grant_types_supported': ['authorization_code', 'refresh_token'],
            'code_challenge_methods_supported': ['S256'], 'token_endpoint_auth_methods_supported': ['none'],
            'scopes_supported': SCOPES, 'service_documentation': f'{base}/api/docs'}


@route('GET', '/.well-known/oauth-protected-resource')
@route('GET', '/.well-known/oauth-protected-resource/mcp')
def protected_resource():
    """RFC 9728: where an MCP host, told 401 by /mcp, learns which authorization server issues its tokens."""
    base = service().settings.base_url
    return {'resource': f'{base}/mcp', 'authorization_servers': [base], 'bearer_methods_supported': ['header'],
            'scopes_supported': SCOPES, 'resource_name': 'Job marketplace (MCP)',
            'resource_documentation': f'{base}/api/docs'}


@route('GET', '/.well-known/oauth-authorization-server')
def authorization_server():
    """RFC 8414: the endpoints and what they support (PKCE S256, public clients, refresh tokens)."""
    return server_metadata()


@route('POST', '/oauth/register', limit='registration')
def register_client():
    """RFC 7591: an MCP host registers itself (its name and redirect URIs) and gets a client_id."""
    return the_server().create_endpoint_response('client_registration')


@route('POST', '/oauth/token', limit='oauth')
def token():
    """A code (with its PKCE verifier) or a refresh token for an access token of an hour and a new refresh
    token; OAuth's error answers (invalid_grant, invalid_request...) otherwise."""
    return the_server().create_token_response()


# The approval page and the person's connections -------------------------------------------------------------------

AUTHORIZE_FIELDS = ('response_type', 'client_id', 'redirect_uri', 'code_challenge', 'code_challenge_method',
                    'state', 'scope', 'resource')


def session_key_id():
    token, _ = session_viewer()
    return service().db.value('SELECT key_id FROM sessions WHERE id_hash = :h', {'h': hash_key(token)})


def authorization_fields(source):
    return {name: [source[name]] for name in AUTHORIZE_FIELDS if source.get(name)}


def validated(fields, account):
    """authlib's check of an authorization request (client, exact redirect URI, PKCE S256): its grant, or an
    APIError shown as a page (never a redirect to a URI not checked)."""
    try:
        return the_server().get_consent_grant(request=bottle_request(fields), end_user=account)
    except OAuth2Error as error:
        raise APIError(f'This authorization request cannot be approved: {error.description or error.error}.',
                       code=error.error) from None


ADMIN_REFUSAL = ("An admin's session cannot approve an MCP host: a host approved here would act as an admin. Sign "
                 "in with a member account's API key to connect a host.")


def redirect_host(uri):
    """The host (and port) of a redirect URI, as the approval page shows it in large type."""
    parts = urlsplit(uri)
    return f'{parts.hostname}:{parts.port}' if parts.port else (parts.hostname or '')


@browser_route('GET', '/oauth/authorize')
def authorize_page():
    """The person approves or denies an MCP host: signed in first (then back here), the host's name shown as what
    it calls itself (registered by itself, not verified) and the host it will be sent to in large type. An admin's
    session is shown the page with the refusal instead of the buttons (403)."""
    fields = authorization_fields(request.query)
    _, account = session_viewer()
    if account is None:
        see_other('/signin?' + urlencode({'next': request.fullpath + ('?' + request.query_string
                                                                       if request.query_string else '')}))
    grant = validated(fields, account)
    refusal = ADMIN_REFUSAL if account['role'] == 'admin' else None
    if refusal:
        response.status = 403
    redirect_uri = fields['redirect_uri'][0] if 'redirect_uri' in fields else ''
    return render('authorize', title='Connect an MCP host', client=grant.client.row, redirect_uri=redirect_uri,
                  redirect_host=redirect_host(redirect_uri), refusal=refusal,
                  fields={name: values[0] for name, values in fields.items()})


@browser_route('POST', '/oauth/authorize', limit='signin')
def authorize_decision():
    """Approve (a code for the host) or deny (access_denied for it); an admin's session is refused (403). The
    answer is a page of this site that sends the browser on to the host's redirect URI (a meta refresh, and a
    link), not a redirect: the pages' Content-Security-Policy (form-action 'self') stops a form's redirect to
    another origin in Chromium, which left the host without its code."""
    account = require_viewer()
    form = posted_form()
    fields = authorization_fields(form)
    grant = validated(fields, account)
    if account['role'] == 'admin':
        raise Forbidden(ADMIN_REFUSAL, code='admin_cannot_approve')
    approval = None
    if form.get('decision') == 'approve':
        approval = {'grant_id': new_id(), 'account_id': account['id'], 'key_id': session_key_id()}
    answer = the_server().create_authorization_response(request=bottle_request(fields), grant_user=approval,
                                                        grant=grant)
    location = answer.headers.get('Location')
    if answer.status_code != 302 or not location:
        return answer
    return render('authorize_sent', title='Back to the host', location=location, approved=approval is not None,
                  redirect_host=redirect_host(location))


@browser_route('GET', '/my/connections')
def connections_page():
    """The MCP hosts the signed-in person connected (a grant whose code was exchanged: an approval the host never
    got its token for is not a connection), and a button to disconnect each."""
    account = require_viewer()
    grants = service().db.rows('''SELECT g.id, g.created_at, g.used_at, c.name, c.redirect_uris FROM oauth_grants g
                                  JOIN oauth_clients c ON c.client_id = g.client_id
                                  WHERE g.account_id = :id AND g.revoked_at IS NULL AND g.used_at IS NOT NULL
                                  ORDER BY g.created_at DESC''',
                               {'id': account['id']})
    return render('connections', title='My connections', grants=grants)


@browser_route('POST', '/my/connections/<grant_id>/revoke')
def revoke_connection(grant_id):
    """Disconnect a host: its grant ends, and every token of it stops working at once."""
    account = require_viewer()
    posted_form()
    db = service().db
    if db.value('SELECT account_id FROM oauth_grants WHERE id = :id', {'id': grant_id}) != account['id']:
        raise NotFound('You have no connection with this id.')
    revoke_grant(db, grant_id)
    see_other('/my/connections')
