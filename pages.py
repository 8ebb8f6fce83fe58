"""The pages for people: the job board to read, and the forms where a signed-in person acts.

It owns the HTML (templates/, rendered with the job's story, charts and money as people read them), the static
files, and the browser's own rules: sessions bound to an API key and kept in __Host- cookies, CSRF tokens, the
Origin checks of page POSTs, sign in, up and out. A form acts through the API itself (act_as runs the request
in-process), so a page can do nothing the API would refuse. The read pages register with the rules' `route`; the
forms are routed by mount (Faces.mount_pages).
"""

import functools
import hashlib
import hmac
import html
import importlib.util
import io
import json
import re
import secrets
import time
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import bottle
import orjson
from bottle import request, response

from marketplace import (AGENT_HISTORY, AGENT_SELECT, AGENT_SORTS, APIError, ARBITRATOR_SELECT, BodyTooLarge,
                         CATEGORIES, COMPETITION_MODES, DECIMALS, DISPUTE_SELECT, FINAL_JOB_STATUSES, Forbidden, HERE,
                         JOB_SELECT, MAX_BODY, MAX_QUERY_LENGTH, NotFound, REQUEST_ID_KEY, Unauthorized, address_group,
                         agent_detail, agent_json, agent_names, arbitrator_json, cents_to_units, client_ip,
                         count_request, dispute_detail, dispute_json, format_cents, format_units, fts_query, get_job,
                         hash_key, is_admin, iso, job_json, job_parts, job_story, list_jobs, live_key, now, parse_uuid,
                         query_choice, query_min_pay, read_money, releases_to_sign, route, service, stripe_mode,
                         vote_json, when)


###############################################################################
# Pages: the job board for people #############################################
###############################################################################

TEMPLATES = HERE / 'templates'
STYLESHEET = HERE / 'static' / 'style.css'
FAVICON = HERE / 'static' / 'favicon.svg'
BOARD_SCRIPT = HERE / 'static' / 'board.js'      # a file, not inline: the pages' CSP runs no inline script
API_DOCS_SCRIPT = HERE / 'static' / 'api-docs.js'
# Swagger UI's built files, shipped by the pinned swagger-ui-py package (requirements.txt), found without importing it
SWAGGER_UI = Path(importlib.util.find_spec('swagger_ui').submodule_search_locations[0]) / 'static'
EXPLORERS = {8453: 'https://basescan.org', 84532: 'https://sepolia.basescan.org'}     # block explorers by chain
BOARD_SIZE = 50
BOARD_STATUSES = ('open', 'claimed', 'delivered', 'disputed', 'completed', 'rejected', 'refunded', 'expired',
                  'cancelled', 'any')     # what the board shows; `any`: every status (never a job waiting for its payment)
HTML_TYPE = 'text/html; charset=utf-8'
HSTS = 'max-age=31536000'   # pages over an https --public-url: browsers come back over HTTPS only, for a year


STRIPE_DASHBOARD_PATHS = {'pi_': 'payments', 'ch_': 'payments', 're_': 'refunds', 'du_': 'disputes',
                          'tr_': 'connect/transfers', 'acct_': 'connect/accounts'}


def stripe_dashboard(settings):
    """A function from a Stripe id (pi_, ch_, re_, du_, tr_, acct_) to its page in the Stripe Dashboard (the
    test-mode one for a test key), HTML-escaped for an href, or to None for another id; None outside stripe mode."""
    if not stripe_mode(settings):
        return None
    base = 'https://dashboard.stripe.com' + ('/test' if '_test_' in settings.stripe_secret_key[:8] else '')

    def link(reference):
        path = next((path for prefix, path in STRIPE_DASHBOARD_PATHS.items() if (reference or '').startswith(prefix)),
                    None)
        return html.escape(f'{base}/{path}/{reference}') if path else None
    return link


def hsts_header():
    """Strict-Transport-Security for a page when the public URL is https (header name and value), else None."""
    if service().settings.public_url.lower().startswith('https://'):
        return 'Strict-Transport-Security', HSTS
    return None


def render(name, **values):
    """A page from templates/NAME.tpl (Bottle's SimpleTemplate, where {{...}} is always HTML-escaped)."""
    response.content_type = HTML_TYPE
    svc = service()
    explorer = EXPLORERS.get(svc.settings.chain_id) if svc.settings.onchain else None
    values.setdefault('viewer', viewer())
    if values['viewer']:        # a page that knows its viewer is nobody else's
        response.set_header('Cache-Control', 'private, no-store')
    hsts = hsts_header()
    if hsts:
        response.set_header(*hsts)
    return bottle.template(name, template_lookup=[str(TEMPLATES)], when=when, explorer=explorer,
                           dashboard=stripe_dashboard(svc.settings), csrf=csrf_token, form_key=new_form_key,
                           site_name=svc.settings.site_name, short=short_hash, **values)


def short_hash(value):
    """A transaction hash as a table shows it: its start and end (the whole on hover and in its link)."""
    return value if len(value) <= 20 else f'{value[:10]}…{value[-6:]}'


def new_form_key():
    """A form's Idempotency-Key, made when the form is rendered: a double click or a reload acts once."""
    return secrets.token_urlsafe(18)


def page(handler):
    """A page handler whose refusals (a malformed or unknown id, a bad filter) are pages too, with their status."""
    @functools.wraps(handler)
    def show(**params):
        try:
            return handler(**params)
        except APIError as error:
            response.status = error.status
            return render('error', title=f'{error.status} {bottle.HTTP_CODES.get(error.status, "")}', error=error)
    return show


def reputation_chart(history, start=None, width=600, height=120, pad=8):
    """The points of an SVG polyline of the score over time (history newest first, as the API gives it):
    one step per change, from the score before the first change (`start`; by default worked out from that
    change, which a change cut short at 0.00 gets wrong). None without history."""
    if not history:
        return None
    changes = list(reversed(history))
    if start is None:
        start = max(Decimal(changes[0]['scoreAfter']) - Decimal(changes[0]['delta']), Decimal(0))
    scores = [Decimal(start)] + [Decimal(change['scoreAfter']) for change in changes]
    low, high = min(scores), max(scores)
    span = (high - low) or Decimal(1)
    step = (width - 2 * pad) / (len(scores) - 1)
    points = [(pad + i * step, pad + float((high - score) / span) * (height - 2 * pad))
              for i, score in enumerate(scores)]
    return {'points': ' '.join(f'{x:.1f},{y:.1f}' for x, y in points), 'width': width, 'height': height,
            'low': format(low, '.2f'), 'high': format(high, '.2f'), 'first': format(scores[0], '.2f'),
            'last': format(scores[-1], '.2f')}


@route('GET', '/static/style.css', limit=None)
def stylesheet():
    response.content_type = 'text/css; charset=utf-8'
    response.set_header('Cache-Control', 'public, max-age=3600')
    return STYLESHEET.read_bytes()


@route('GET', '/static/favicon.svg', limit=None)
def favicon():
    """The pages' icon."""
    response.content_type = 'image/svg+xml'
    response.set_header('Cache-Control', 'public, max-age=86400')
    return FAVICON.read_bytes()


@route('GET', '/static/board.js', limit=None)
def board_script():
    """The board's script: new jobs from the live stream go on top."""
    response.content_type = 'text/javascript; charset=utf-8'
    response.set_header('Cache-Control', 'public, max-age=3600')
    return BOARD_SCRIPT.read_bytes()


@route('GET', '/', limit='pages')
@page
def board():
    """The job board: open jobs newest first (or those of another status, or all), filtered, searched; new ones
    arrive by the live stream on a board of open jobs."""
    svc, query = service(), request.query
    text = query.getunicode('q', '').strip()[:MAX_QUERY_LENGTH]
    category = query_choice(query, 'category', CATEGORIES)
    status = query_choice(query, 'status', BOARD_STATUSES) or 'open'
    min_pay = query_min_pay(query)
    listed = now() - timedelta(milliseconds=1)      # the stream replays what is posted from here on
    match = fts_query(text) if text else None
    jobs, total = ([], 0) if text and match is None else list_jobs(     # text with no word matches nothing
        svc.db, match=match, category=category, status=None if status == 'any' else status, min_pay=min_pay,
        limit=BOARD_SIZE)
    stream = None
    if not text and status == 'open':   # the stream has no full-text filter, and it brings open jobs only
        filters = {'categories': category, 'min_pay': min_pay is not None and format_cents(min_pay)}
        stream = '/api/jobs/stream?' + urlencode(
            {name: value for name, value in filters.items() if value} | {'since': iso(listed)})
    title = {'open': 'Open jobs', 'any': 'All jobs'}.get(status, f'Jobs {status}')
    return render('board', title=title, jobs=[job_json(job, svc.settings.base_url) for job in jobs],
                  total=total, q=text, category=category or '', min_pay=query.get('min_pay', '').strip()[:20],
                  categories=CATEGORIES, stream=stream, status=status, statuses=BOARD_STATUSES)


@route('GET', '/jobs/<job_id>', limit='pages')
@page
def job_page(job_id):
    """A job: what it asks, what happened to it (a timeline), its claims, deliverables and payments; to the
    signed-in requester and worker, the deliverables they may read and the buttons of what they may do."""
    return job_page_for(parse_uuid(job_id, 'jobId'))


def job_page_for(job_id, action=None):
    """The job page; `action` is a refused form's {action, claimId, values, error, fields}, shown where it was."""
    svc, account = service(), viewer()
    detail = job_parts(svc.db, job_id, svc.settings.base_url, account)
    job = detail['job']
    requester = account is not None and (account['id'] == job['requesterId'] or is_admin(account))
    if job['status'] == 'pending_payment' and not requester:
        # a job waiting for its payment is hidden as an unknown id is, but the requester coming back from Stripe
        # Checkout (its success and cancel URLs are this page) is told why
        raise NotFound('No job has this id yet: a job paid by card shows here once Stripe confirms the payment '
                       '(reload in a minute).')
    disputes = [dispute_json(d, svc.settings) for d in svc.db.rows(
        f'{DISPUTE_SELECT} WHERE d.job_id = :id ORDER BY d.created_at', {'id': job['id']})]
    names = agent_names(svc.db, [claim['agentId'] for claim in detail['claims']])
    timeline = job_story(svc.db, detail)
    owned = {row['id'] for row in svc.db.rows('SELECT id FROM agents WHERE account_id = :id',
                                              {'id': account['id']})} if account else set()
    # Contract mode: the Release each delivery's Approve button asks the browser's wallet to sign (forms.js), and
    # the delay a payout waits without that signature
    releases = {claim: json.dumps(typed, indent=2) for claim, typed in
                (releases_to_sign(svc, job_id, account) or {}).items()}
    delay = svc.settings.onchain.terms['arbiterDelay'] if releases and svc.settings.onchain.terms else None
    return render('job', title=job['title'], names=names, disputes=disputes, timeline=timeline,
                  requester=requester, owned=owned, action=action, releases=releases, release_delay=delay, **detail)


@route('GET', '/agents', limit='pages')
@page
def agents_page():
    """The leaderboard: agents by reputation."""
    db = service().db
    agents = db.rows(f'{AGENT_SELECT} ORDER BY {AGENT_SORTS["reputation"]} LIMIT 100')
    return render('agents', title='Agents', agents=[agent_json(agent) for agent in agents],
                  total=db.value('SELECT count(*) FROM agents'))


@route('GET', '/agents/<agent_id>', limit='pages')
@page
def agent_page(agent_id):
    """An agent: profile, capabilities, reputation over time, recent jobs."""
    svc = service()
    detail = agent_detail(svc.db, parse_uuid(agent_id, 'agentId'))
    jobs = {row['id']: row for row in svc.db.rows(
        'SELECT j.id, j.title, j.status FROM jobs j JOIN claims c ON c.job_id = j.id WHERE c.agent_id = :id',
        {'id': detail['agent']['id']})}
    history = detail['reputationHistory']
    start = 0 if len(history) < AGENT_HISTORY else None        # the whole history: every agent starts at 0.00
    return render('agent', title=detail['agent']['name'], jobs=jobs, chart=reputation_chart(history, start),
                  **detail)


@route('GET', '/disputes/<dispute_id>', limit='pages')
@page
def dispute_page(dispute_id):
    """A dispute: the reason, its panel, the votes with their reasoning, the outcome."""
    svc = service()
    detail = dispute_detail(svc.db, parse_uuid(dispute_id, 'disputeId'), svc.settings)
    votes = svc.db.rows('''SELECT v.*, a.name AS arbitrator FROM votes v JOIN arbitrators a ON a.id = v.arbitrator_id
                           WHERE v.dispute_id = :id ORDER BY v.created_at, v.rowid''', {'id': detail['dispute']['id']})
    panel = svc.db.rows('''SELECT a.name, EXISTS (SELECT 1 FROM votes v WHERE v.dispute_id = p.dispute_id
                                                   AND v.arbitrator_id = a.id) AS voted
                           FROM dispute_panels p JOIN arbitrators a ON a.id = p.arbitrator_id
                           WHERE p.dispute_id = :id ORDER BY a.name, a.id''', {'id': detail['dispute']['id']})
    names = agent_names(svc.db, [detail['claim']['agentId']])
    return render('dispute', title=f'Dispute: {detail["job"]["title"]}', names=names, panel=panel,
                  timeout_hours=svc.settings.dispute_timeout_hours,
                  votes=[dict(vote_json(vote), arbitrator=vote['arbitrator']) for vote in votes], **detail)


@route('GET', '/arbitrators', limit='pages')
@page
def arbitrators_page():
    """The arbitrators, most accurate first."""
    db = service().db
    arbitrators = db.rows(f'''{ARBITRATOR_SELECT}
        ORDER BY a.status, accuracy IS NULL, accuracy DESC, votes_cast DESC, a.created_at LIMIT 200''')
    return render('arbitrators', title='Arbitrators', arbitrators=[arbitrator_json(a) for a in arbitrators])


@route('GET', '/api/docs', limit='pages')
@page
def api_docs_page():
    """The API for people: Swagger UI over /api/openapi.json, its calls tried against this server."""
    return render('api_docs', title='API')


def static_file(path, content_type):
    """A file of the pages, cached by browsers for an hour (and by the process: the files never change)."""
    response.content_type = content_type
    response.set_header('Cache-Control', 'public, max-age=3600')
    return read_static(path)


@functools.cache
def read_static(path):
    return path.read_bytes()


@route('GET', '/static/api-docs.js', limit=None)
def api_docs_script():
    """The API page's script: starts Swagger UI (a file, not inline: the pages' CSP)."""
    return static_file(API_DOCS_SCRIPT, 'text/javascript; charset=utf-8')


@route('GET', '/static/swagger-ui/swagger-ui-bundle.js', limit=None)
def swagger_ui_script():
    """Swagger UI itself, from the pinned swagger-ui-py package (no CDN)."""
    return static_file(SWAGGER_UI / 'swagger-ui-bundle.js', 'text/javascript; charset=utf-8')


@route('GET', '/static/swagger-ui/swagger-ui.css', limit=None)
def swagger_ui_stylesheet():
    """Swagger UI's stylesheet, from the same package."""
    return static_file(SWAGGER_UI / 'swagger-ui.css', 'text/css; charset=utf-8')


###############################################################################
# Pages: people acting in the browser #########################################
###############################################################################

# A person signs in with an API key (or signs up on the spot) and then acts through forms: post a job, pay for it,
# review a delivery, approve, reject, dispute, cancel, deliver. Every form runs the API's own route in-process for
# the session's account (act_as): the same handler, permissions, errors, rate-limit class and Idempotency-Key
# machinery, never a second copy of a rule. docs/pages.md "Using it in the browser".
SESSION_COOKIE = 'mk_session'   # the session's random id; only its SHA-256 is stored
FORM_COOKIE = 'mk_form'         # before sign-in: the random secret the sign-in forms' CSRF token is bound to
HOST_PREFIX = '__Host-'         # over HTTPS both names take it: only this host, over HTTPS, may set them
CROSS_SITE_WORDS = 'This form was sent from another site: open this site and send the form from its own page.'
SESSION_LIFETIME = timedelta(days=7)        # absolute; --session-idle-hours without a request ends one sooner
SESSION_TOUCH = timedelta(minutes=5)        # a session's last request is written at most this often
CSRF_FIELD = 'csrf'
KEY_FIELD = 'idempotencyKey'
FORMS_SCRIPT = HERE / 'static' / 'forms.js'
IN_PROGRESS_WAIT = 5.0          # seconds a form sent twice at once waits for its first sending's answer
MY_JOBS_SIZE = 500
BROWSER_ROUTES = []             # (method, path, handler, rate-limit class): pages, not API (no OpenAPI entry)


def browser_route(method, path, limit='pages'):
    """Register a page of the signed-in browser (mount routes them, outside the API's ROUTES)."""
    def register(handler):
        BROWSER_ROUTES.append((method, path, handler, limit))
        return handler
    return register


def https_request():
    """Did the person reach us over HTTPS (the public URL, the socket, or X-Forwarded-Proto with --trust-proxy)?"""
    settings = service().settings
    forwarded = request.get_header('X-Forwarded-Proto', '').split(',')[-1].strip().lower()
    return (settings.public_url.lower().startswith('https://') or request.environ.get('wsgi.url_scheme') == 'https'
            or (settings.trust_proxy and forwarded == 'https'))


def cookie_name(name):
    """A private cookie's name: `__Host-` prefixed over HTTPS (a sibling subdomain or a plain-http page cannot
    plant it), as it is over plain http (local use) otherwise."""
    return HOST_PREFIX + name if https_request() else name


def set_private_cookie(name, value, max_age=None):
    """An HttpOnly, SameSite=Lax cookie for the whole site (no Domain), Secure and `__Host-` over HTTPS."""
    lifetime = {} if max_age is None else {'max_age': max_age}      # bottle would write "Max-Age=None"
    response.set_cookie(cookie_name(name), value, path='/', httponly=True, samesite='lax', secure=https_request(),
                        **lifetime)


def private_cookie(name):
    """The value of one of our private cookies (by cookie_name: over HTTPS, an unprefixed one is not ours)."""
    return request.get_cookie(cookie_name(name))


def see_other(path):
    """A 303 to a path of this site: relative, or under --public-url; never built from the request's Host or
    X-Forwarded-Host (which whoever sends the request writes). What the answer set (cookies) goes along."""
    if not path.startswith('/') or path.startswith('//') or '\\' in path:
        raise ValueError(f'not a path of this site: {path!r}')
    public = service().settings.public_url
    answer = response.copy(cls=bottle.HTTPResponse)
    answer.status, answer.body = 303, ''
    answer.set_header('Location', public.rstrip('/') + path if public else path)
    hsts = hsts_header()
    if hsts:
        answer.set_header(*hsts)
    raise answer


def normal_origin(scheme, netloc):
    """'scheme://host[:port]' in lower case, the scheme's default port left out; None for what is not one."""
    scheme, netloc = scheme.lower(), netloc.lower()
    if scheme not in ('http', 'https') or not netloc or '@' in netloc or '/' in netloc:
        return None
    default = ':443' if scheme == 'https' else ':80'
    return f'{scheme}://{netloc.removesuffix(default)}'


def own_origin():
    """This site's origin: --public-url's, or without one the request's own Host (not X-Forwarded-Host) with the
    scheme the person used. (Host is written by the browser for the site it sends to: another site's page cannot
    make a browser send our Host with its Origin.)"""
    public = service().settings.public_url
    if public:
        parts = urlsplit(public)
        return normal_origin(parts.scheme, parts.netloc)
    return normal_origin('https' if https_request() else 'http', request.environ.get('HTTP_HOST', ''))


def refuse_cross_site():
    """403 for a page POST that a browser says comes from another site: `Sec-Fetch-Site` other than same-origin
    or none (same-site is a sibling subdomain: refused too), or an `Origin` that is not this site's ("null"
    included). Without either header (an old browser, a program) the form's CSRF token alone decides."""
    fetch_site = request.get_header('Sec-Fetch-Site')
    if fetch_site is not None and fetch_site.strip().lower() not in ('same-origin', 'none'):
        raise Forbidden(CROSS_SITE_WORDS, code='cross_site_request')
    origin = request.get_header('Origin')
    if origin is not None:
        parts = urlsplit(origin.strip())
        sent = normal_origin(parts.scheme, parts.netloc) if not parts.path and not parts.query else None
        expected = own_origin()
        if sent is None or expected is None or not hmac.compare_digest(sent, expected):
            raise Forbidden(CROSS_SITE_WORDS, code='cross_site_request')


def start_session(db, account, key_id):
    """A new session acting as `account`, bound to the key `key_id` that opened it (revoking the key ends it):
    its random id goes in the cookie, its hash in the database."""
    token = secrets.token_urlsafe(32)
    moment = now()
    with db.transaction():
        db.insert('sessions', {'id_hash': hash_key(token), 'account_id': account['id'], 'key_id': key_id,
                               'created_at': iso(moment), 'seen_at': iso(moment),
                               'expires_at': iso(moment + SESSION_LIFETIME)})
    set_private_cookie(SESSION_COOKIE, token, int(SESSION_LIFETIME.total_seconds()))
    request.environ['marketplace.session'] = (token, account)


def end_session(db, token):
    """Delete a session (sign-out) and its cookie."""
    if token:
        with db.transaction():
            db.execute('DELETE FROM sessions WHERE id_hash = :h', {'h': hash_key(token)})
    response.delete_cookie(cookie_name(SESSION_COOKIE), path='/', httponly=True, samesite='lax',
                           secure=https_request())
    request.environ['marketplace.session'] = (None, None)


def live_session(db, settings, token):
    """The account of a live session named by its cookie's value, or None (unknown, idle too long, too old, or its
    key revoked)."""
    if not token or len(token) > 100:
        return None
    digest = hash_key(token)
    row = db.row('''SELECT s.id_hash, s.seen_at, s.expires_at, a.id, a.name, a.role, a.x402_exempt
                    FROM sessions s JOIN accounts a ON a.id = s.account_id
                    JOIN api_keys k ON k.id = s.key_id AND k.revoked_at IS NULL WHERE s.id_hash = :h''',
                 {'h': digest})
    moment = now()
    if row is None or not hmac.compare_digest(row['id_hash'], digest) or row['expires_at'] <= iso(moment) or \
            row['seen_at'] <= iso(moment - timedelta(hours=settings.session_idle_hours)):
        return None
    if row['seen_at'] <= iso(moment - SESSION_TOUCH) and not db.read_only:     # a replica's reads do not count
        with db.transaction():
            db.execute('UPDATE sessions SET seen_at = :now WHERE id_hash = :h', {'now': iso(moment), 'h': digest})
    return {name: row[name] for name in ('id', 'name', 'role', 'x402_exempt')}


def session_viewer():
    """(the session cookie's value, its account) for this request, or (None, None) when nobody is signed in."""
    if 'marketplace.session' not in request.environ:
        svc = service()
        token = private_cookie(SESSION_COOKIE)
        account = live_session(svc.db, svc.settings, token)
        request.environ['marketplace.session'] = (token, account) if account else (None, None)
    return request.environ['marketplace.session']


def viewer():
    """The signed-in account, or None."""
    return session_viewer()[1]


def require_viewer():
    """The signed-in account; anyone else is sent to the sign-in page."""
    account = viewer()
    if account is None:
        see_other('/signin')
    return account


def csrf_secret(create=False):
    """What this browser's CSRF tokens are bound to: its session id, or before sign-in the form cookie (made when
    `create`, for a page that shows a form) and the client's address group. A form cookie and token that an
    attacker got on its own visit and planted in a victim's browser are then worth nothing from the victim's
    address, even from a browser that sends no Origin (refuse_cross_site stops the others)."""
    token, _ = session_viewer()
    if token:
        return token
    secret = request.environ.get('marketplace.form_secret') or private_cookie(FORM_COOKIE)
    if not secret and create:
        secret = secrets.token_urlsafe(32)
        set_private_cookie(FORM_COOKIE, secret)
    request.environ['marketplace.form_secret'] = secret
    return secret and f'{secret} {address_group(client_ip())}'


def csrf_for(secret):
    return hmac.new(secret.encode('utf-8'), b'csrf form token', hashlib.sha256).hexdigest()


def csrf_token():
    """The CSRF token every POST form of this page carries (HMAC of the browser's session id)."""
    return csrf_for(csrf_secret(create=True))


def posted_form():
    """The POSTed form's fields as text, once its CSRF token checks out (in constant time); 403 otherwise."""
    form = {name: request.forms.getunicode(name, default='') for name in request.forms.keys()}
    secret = csrf_secret()
    if not secret or not hmac.compare_digest(csrf_for(secret), form.get(CSRF_FIELD, '')):
        raise Forbidden('This form has no valid security token (CSRF): reload the page and send the form again.',
                        code='csrf_failed')
    return form


def act_as(account, method, path, body=None, idempotency_key=None):
    """Run an API route in-process for `account` (None: without one), as its HTTP request from this client would:
    its handler, permissions, rate-limit class and Idempotency-Key. Returns (status, the JSON answer)."""
    outer = request.environ
    raw = b'' if body is None else orjson.dumps(body)
    environ = {name: value for name, value in outer.items() if name in (
        'REMOTE_ADDR', 'SERVER_NAME', 'SERVER_PORT', 'SERVER_PROTOCOL', 'HTTP_HOST', 'HTTP_X_FORWARDED_FOR',
        'HTTP_X_FORWARDED_PROTO', REQUEST_ID_KEY, 'wsgi.url_scheme', 'wsgi.errors', 'wsgi.version', 'wsgi.multithread',
        'wsgi.multiprocess', 'wsgi.run_once')}
    environ.update({'REQUEST_METHOD': method, 'PATH_INFO': path, 'QUERY_STRING': '', 'wsgi.input': io.BytesIO(raw),
                    'CONTENT_LENGTH': str(len(raw)), 'CONTENT_TYPE': 'application/json',
                    'marketplace.account': account})
    if idempotency_key:
        environ['HTTP_IDEMPOTENCY_KEY'] = idempotency_key
    app, outcome = request.app, {}

    def start_response(status, headers, exc_info=None):
        outcome['status'] = int(status.split()[0])
    waited = 0.0
    try:
        while True:
            environ['wsgi.input'] = io.BytesIO(raw)
            data = b''.join(app(dict(environ), start_response))
            answer = orjson.loads(data) if data else {}
            if outcome['status'] != 409 or answer.get('code') != 'idempotency_in_progress' or \
                    waited >= IN_PROGRESS_WAIT:
                return outcome['status'], answer
            time.sleep(0.1)     # a double click: the first sending is still running (outside any transaction)
            waited += 0.1
    finally:
        request.bind(outer)
        response.bind()


def browser_page(handler, bucket):
    """A browser route's handler: sizes, a POST's site (refuse_cross_site: before its rate limit, which another
    site's page must not spend) and its rate limit checked first; refusals are pages with their status."""
    @page
    @functools.wraps(handler)
    def show(**params):
        if request.content_length > MAX_BODY:
            raise BodyTooLarge()
        if request.method == 'POST':
            refuse_cross_site()
        count_request(bucket)
        return handler(**params)
    return show


def refusal(status, answer):
    """An API refusal as an APIError (for a page): its words, code, status and fields."""
    return APIError(answer.get('error'), code=answer.get('code'), status=status, fields=answer.get('fields'))


@browser_route('GET', '/static/forms.js', limit=None)
def forms_script():
    """The forms' script: focus on the first error, and signing a funding with the browser's wallet."""
    response.content_type = 'text/javascript; charset=utf-8'
    response.set_header('Cache-Control', 'public, max-age=3600')
    return FORMS_SCRIPT.read_bytes()


# Signing in, up and out -------------------------------------------------------

def next_page(path):
    """Where sign-in goes on to: back to an OAuth approval that asked for it (only there: no open redirect),
    else the person's jobs."""
    return path if isinstance(path, str) and path.startswith('/oauth/authorize?') and '\\' not in path else '/my/jobs'


@browser_route('GET', '/signin')
def signin_page():
    return render('signin', title='Sign in', typed_name='', error=None, signup_error=None,
                  next=next_page(request.query.getunicode('next', default='')))


@browser_route('POST', '/signin', limit='signin')
def post_signin():
    """Sign in with an API key: the key finds the account and is forgotten (its id is kept: revoking it ends the
    session); the session acts as the account."""
    form = posted_form()
    svc = service()
    key_id, account = live_key(svc.db, form.get('apiKey', '').strip()) if form.get('apiKey', '').strip() \
        else (None, None)
    if account is None:
        response.status = 401
        return render('signin', title='Sign in', typed_name='', signup_error=None, next=next_page(form.get('next')),
                      error=Unauthorized('The API key is unknown or revoked.'))
    old, _ = session_viewer()
    if old:
        end_session(svc.db, old)
    start_session(svc.db, account, key_id)
    see_other(next_page(form.get('next')))


@browser_route('POST', '/signup', limit='signin')
def post_signup():
    """Sign up: POST /api/accounts's own handler; the new key is shown once, on this answer only, and the browser
    is signed in as the new account."""
    form = posted_form()
    status, answer = act_as(None, 'POST', '/api/accounts', {'name': form.get('name', '')}, form.get(KEY_FIELD))
    if status != 201:
        response.status = status
        return render('signin', title='Sign in', typed_name=form.get('name', ''), error=None,
                      signup_error=refusal(status, answer))
    svc = service()
    old, _ = session_viewer()
    if old:
        end_session(svc.db, old)
    key_id = svc.db.value('SELECT id FROM api_keys WHERE key_hash = :h', {'h': hash_key(answer['apiKey'])})
    start_session(svc.db, answer['account'], key_id)
    response.set_header('Cache-Control', 'no-store')
    return render('signed_up', title='Your API key', account=answer['account'], api_key=answer['apiKey'])


@browser_route('POST', '/signout')
def post_signout():
    form = posted_form()        # noqa: F841  (a cross-site form must not sign anyone out)
    end_session(service().db, session_viewer()[0])
    see_other('/')


# Posting a job ------------------------------------------------------------------

JOB_FORM_FIELDS = ('title', 'description', 'category', 'paymentAmount', 'paymentCurrency', 'deadline', 'maxWorkers',
                   'competitionMode', 'verificationWindowHours', 'claimTimeoutHours', 'minReputation', 'requirements',
                   'acceptanceCriteria', 'escrowTxHash', 'escrowSignature', 'escrowDepositId')
WHOLE_NUMBER_FIELDS = ('maxWorkers', 'verificationWindowHours', 'claimTimeoutHours')


def job_body_from_form(form):
    """POST /api/jobs's body from the form as typed: empty fields left out (the API's defaults), whole numbers as
    numbers, requirements as JSON, acceptance criteria one per line. What does not parse is sent as typed, for the
    API to refuse in its own words."""
    body = {}
    for name in JOB_FORM_FIELDS:
        value = form.get(name, '')
        if not value.strip():
            continue
        if name != 'description':
            value = value.strip()
        if name in WHOLE_NUMBER_FIELDS and re.fullmatch(r'[0-9]{1,9}', value):
            value = int(value)
        elif name == 'requirements':
            try:
                value = json.loads(value)
            except ValueError:
                pass
        elif name == 'acceptanceCriteria':
            value = [{'type': 'manual', 'check': line.strip()} for line in value.splitlines() if line.strip()]
        body[name] = value
    return body


def job_form_defaults():
    deadline = (now() + timedelta(days=3)).strftime('%Y-%m-%dT%H:%M')
    return {'category': 'code', 'paymentCurrency': 'USDC', 'deadline': deadline, 'maxWorkers': '1',
            'competitionMode': 'first-wins', 'verificationWindowHours': '24', 'claimTimeoutHours': '24',
            'minReputation': '0.00'}


def funding_help(account, values, answer=None):
    """In onchain mode, how a USDC job's requester funds it; None in other modes. Wallet mode (CONTRACT 18): the
    escrow address to send to, the amount and the typed data to sign. Contract mode (CONTRACT 21): the JobEscrow to
    deposit into and, once the API has answered 402, its escrowRequirements; never the server's own address."""
    onchain = service().settings.onchain
    if not onchain:
        return None
    answer = answer or {}
    amount = None
    try:
        amount = format_units(cents_to_units(read_money(values.get('paymentAmount', '').strip()), 'USDC'), 'USDC')
    except (ValueError, TypeError):
        pass
    if onchain.contract:
        wanted = {name: value for name, value in (answer.get('escrowRequirements') or {}).items()
                  if name != 'authorizationTypedData'}       # a relayed authorization is for programs, not this form
        return {'contract': onchain.contract, 'amount': amount, 'asset': onchain.usdc,
                'requirements': json.dumps(wanted, indent=2) if wanted else None}
    typed = answer.get('fundingTypedData') or onchain.funding_typed_data(account['id'])
    return {'payTo': onchain.escrow_address, 'amount': amount, 'asset': onchain.usdc,
            'typedData': json.dumps(typed, indent=2)}


def rail_modes():
    """What each currency's money is here: {'USDC': 'simulated'|'onchain'|'contract', 'USD': 'simulated'|'stripe'}."""
    settings = service().settings
    usdc = 'simulated' if not settings.onchain else 'contract' if settings.onchain.contract else 'onchain'
    return {'USDC': usdc, 'USD': 'stripe' if stripe_mode(settings) else 'simulated'}


def invalid_marker(fields, order):
    """A function from a field's name to its attributes when the API refused it: aria-invalid, aria-describedby
    (its message's id) and, on the first refused field in `order`, autofocus."""
    first = next((name for name in order if name in fields), None)

    def attributes(name):
        if name not in fields:
            return ''
        return f' aria-invalid="true" aria-describedby="{name}-error"' + (' autofocus' if name == first else '')
    return attributes


def job_form(account, values, error=None, answer=None):
    """The "Post a job" form, as typed, with the API's refusal next to its fields."""
    fields = dict((answer or {}).get('fields') or {})
    if 'paymentRail' in fields:
        fields.setdefault('paymentCurrency', fields['paymentRail'])
    return render('post_job', title='Post a job', val=lambda name: values.get(name, ''), error=error, fields=fields,
                  invalid=invalid_marker(fields, JOB_FORM_FIELDS), categories=CATEGORIES, modes=COMPETITION_MODES,
                  currencies=tuple(DECIMALS), rails=rail_modes(), funding=funding_help(account, values, answer))


@browser_route('GET', '/jobs/new')
def new_job_page():
    return job_form(require_viewer(), job_form_defaults())


@browser_route('POST', '/jobs/new', limit=None)
def post_job_page():
    """POST /api/jobs for the session's account; its refusal shown next to the fields, the form as typed."""
    account = require_viewer()
    form = posted_form()
    status, answer = act_as(account, 'POST', '/api/jobs', job_body_from_form(form), form.get(KEY_FIELD))
    if status in (200, 201):
        job = answer['job']
        see_other(f'/jobs/{job["id"]}/pay' if answer.get('checkoutUrl') else f'/jobs/{job["id"]}')
    response.status = status
    return job_form(account, form, refusal(status, answer), answer)


@browser_route('GET', '/jobs/<job_id>/pay')
def pay_page(job_id):
    """Between the form and Stripe Checkout: a page of ours that sends the requester on (a form's redirect to
    another origin would break the pages' form-action 'self')."""
    account = require_viewer()
    job = get_job(service().db, parse_uuid(job_id, 'jobId'))
    if job['requester_id'] != account['id'] and not is_admin(account):
        raise NotFound('No job has this id.')
    if job['status'] != 'pending_payment' or not job['checkout_url']:
        see_other(f'/jobs/{job["id"]}')
    return render('pay', title='Pay for the job', job=job_json(job, service().settings.base_url),
                  checkout_url=job['checkout_url'], refresh=job['checkout_url'])


# Acting on a job ----------------------------------------------------------------

def job_action_request(job_id, action, form):
    """The API request behind a job page's button: (path, body)."""
    claim = form.get('claimId', '')
    if action == 'approve':       # contract mode: with the Release the browser's wallet signed, if it did
        signature = form.get('releaseSignature', '').strip()
        return f'/api/jobs/{job_id}/verify', dict({'claimId': claim, 'approved': True},
                                                  **({'releaseSignature': signature} if signature else {}))
    if action == 'reject':
        return f'/api/jobs/{job_id}/verify', {'claimId': claim, 'approved': False, 'reason': form.get('reason', '')}
    if action == 'dispute':
        return f'/api/jobs/{job_id}/dispute', {'claimId': claim, 'reason': form.get('reason', '')}
    if action == 'cancel':
        return f'/api/jobs/{job_id}/cancel', None
    if action == 'deliver':
        deliverable = {'type': 'url', 'url': form.get('url', '').strip()}
        if form.get('notes', '').strip():
            deliverable['notes'] = form['notes']
        return f'/api/jobs/{job_id}/deliver', {'claimId': claim, 'deliverable': deliverable}
    raise NotFound('There is no such action on a job.')


@browser_route('POST', '/jobs/<job_id>/<action>', limit=None)
def job_action_page(job_id, action):
    """Approve, reject, dispute, cancel or deliver through the API's own route; back to the job's page."""
    account = require_viewer()
    job_id = parse_uuid(job_id, 'jobId')
    form = posted_form()
    path, body = job_action_request(job_id, action, form)
    status, answer = act_as(account, 'POST', path, body, form.get(KEY_FIELD))
    if status < 300:
        see_other(f'/jobs/{job_id}')
    response.status = status
    return job_page_for(job_id, {'action': action, 'claimId': form.get('claimId', ''), 'values': form,
                                 'error': refusal(status, answer), 'fields': answer.get('fields') or {}})


@browser_route('GET', '/my/jobs')
def my_jobs_page():
    """The signed-in account's jobs by status, and its agents' claims."""
    account = require_viewer()
    svc = service()
    jobs = svc.db.rows(f'{JOB_SELECT} WHERE j.requester_id = :id ORDER BY j.created_at DESC LIMIT {MY_JOBS_SIZE}',
                       {'id': account['id']})
    groups = {}
    for job in jobs:
        groups.setdefault(job['status'], []).append(job_json(job, svc.settings.base_url))
    order = ('pending_payment', 'delivered', 'disputed', 'open', 'claimed') + FINAL_JOB_STATUSES
    claims = svc.db.rows(f'''SELECT c.id, c.status, c.job_id, c.created_at, j.title, j.status AS job_status,
                                    a.name AS agent FROM claims c JOIN agents a ON a.id = c.agent_id
                             JOIN jobs j ON j.id = c.job_id WHERE a.account_id = :id
                             ORDER BY c.created_at DESC LIMIT {MY_JOBS_SIZE}''', {'id': account['id']})
    return render('my_jobs', title='My jobs', groups=[(status, groups[status]) for status in order if status in groups],
                  claims=claims)


def mount(app):
    """Route the signed-in browser's pages on the app: make_app calls it (Faces.mount_pages, wiring.py)."""
    for method, path, handler, bucket in BROWSER_ROUTES:
        app.route(path, method, browser_page(handler, bucket), name=handler.__name__)
