"""The permission matrix of CONTRACT.md section 2: every write route of the API × every kind of caller.

Every POST, PATCH, PUT and DELETE operation of `openapi_spec.API_OPERATIONS` is either listed in OPEN (answers
without a key: open registration and the x402 check) or has a row in MATRIX. A write route added to the
API without either makes `test_every_write_route_has_a_row` and its own `test_permission` cells fail.

Callers, for each keyed route:
- `no key`: no Authorization header                          → 401 `unauthorized`, `WWW-Authenticate: Bearer`
- `unknown key`: a well-formed `mk_` key that was never issued → the same 401
- `revoked key`: the key of the caller who would succeed (the owner; the admin on admin-only routes),
  revoked as `marketplace.py keys revoke` does it                → the same 401
- `another member`: a valid member key that owns nothing here  → 403 `forbidden` (or the code named)
- `owner`: the member who owns the resource (the job's requester, the agent's owner, the claim's agent's
  owner, the arbitrator's owner...)                            → the documented 2xx, unless only admins may
- `admin`: ADMIN_KEY                                           → the documented 2xx where the contract lets
  an admin do it, else 403
plus a few route-specific callers (a party to a dispute, the worker on the requester's routes, an agent
below 10.00 reputation...) where the contract names a specific refusal.

Each cell is its own test on a fresh database (the `app` fixture), so one caller's success never changes
what the next one sees. After every refusal (401/403) the whole database is as it was (every row of every
table) and the resource's own state is checked field by field (job status, escrow, claims, votes...).
"""

import json
import re
import secrets
from datetime import timedelta

import pytest

import marketplace as mp
import openapi_spec
import wiring
from conftest import ADMIN_KEY, Client, Market, assert_error, free_port, in_hours, job_body, make_account, \
    make_agent, random_wallet

WRITE_METHODS = ('POST', 'PATCH', 'PUT', 'DELETE')
WRITE_ROUTES = sorted(route for route in openapi_spec.API_OPERATIONS if route[0] in WRITE_METHODS)
CALLERS = ('no key', 'unknown key', 'revoked key', 'another member', 'owner', 'admin')
UNAUTHORIZED = ('no key', 'unknown key', 'revoked key')

# Routes that answer without a key (CONTRACT.md 2, "Open registration", and 7, "POST /api/x402 (no key needed")
OPEN = {
    ('POST', '/api/accounts'): 201,
    ('POST', '/api/agents/register'): 201,
    ('POST', '/api/x402'): 200,
    ('POST', '/api/stripe/webhook'): 200,     # CONTRACT.md 12: Stripe's signature instead of a key
    ('POST', '/oauth/register'): 201,         # CONTRACT.md 22: MCP hosts register themselves (tests/test_oauth.py)
    ('POST', '/oauth/token'): 200,            # ... and trade a code or a refresh token for tokens there
}
# Routes of protocols whose every call acts as the caller's own account and answers refusals in the protocol's own
# form (CONTRACT.md 22): MCP at /mcp, A2A's binding. A missing, unknown or revoked key is the API's 401 here
# (test_a_protocol_route_needs_a_live_key); what a live key reaches is its own account's only: its tools are the
# API's own calls with that key (tests/test_mcp_http.py: a worker's approval is refused), and another account's
# A2A task is TASK_NOT_FOUND (tests/test_a2a.py).
PROTOCOL = {('POST', '/mcp'), ('POST', '/message\\:send'), ('POST', '/message\\:stream'),
            ('POST', '/tasks/<task_id>\\:cancel')}

DELIVERABLE = {'type': 'url', 'url': 'https://example.com/out'}
HOOK_URL = 'https://hooks.example/agent'


def label(method, path):
    """`POST /api/jobs/<job_id>/cancel` as `POST /api/jobs/:id/cancel` (a second id keeps its name)."""
    names = []

    def rename(match):
        names.append(match.group(1))
        if len(names) == 1:
            return ':id'
        head, *rest = match.group(1).split('_')
        return ':' + head + ''.join(word.title() for word in rest)

    return method + ' ' + re.sub(r'<(\w+)>', rename, path)


def header(answer, name):
    return {key.lower(): value for key, value in answer.headers.items()}.get(name.lower())


# A webhook session that never touches the network -----------------------------------------------------

class FakeAnswer:
    status_code = 200
    headers = {}

    def close(self):
        pass


class FakeSession:
    """Stands in for app.service.webhooks: records each POST and answers 200."""

    def __init__(self):
        self.sent = []

    def post(self, url, data=None, headers=None, **kwargs):
        self.sent.append({'url': url, 'body': json.loads(data), 'headers': dict(headers or {})})
        return FakeAnswer()


# The world each cell starts from ----------------------------------------------------------------------

class World:
    """A requester, a worker with one agent (Market), a stranger who owns nothing, an arbiter account, and
    shortcuts to the states each route acts on."""

    def __init__(self, client, app):
        self.client, self.app, self.db = client, app, app.service.db
        self.market = Market(client)
        self.stranger, self.stranger_key = make_account(client, 'stranger')
        self.arbiter, self.arbiter_key = make_account(client, 'arbiter')
        self.admin_id = self.db.value('SELECT account_id FROM api_keys WHERE key_hash = :h',
                                      {'h': mp.hash_key(ADMIN_KEY)})
        self.webhooks = app.service.webhooks = FakeSession()

    # keys and accounts
    @property
    def requester_key(self):
        return self.market.requester_key

    @property
    def worker_key(self):
        return self.market.worker_key

    def account_id(self, key):
        return mp.account_for_key(self.db, key)['id']

    def key_of(self, s, caller):
        """The key each caller sends (None: no Authorization header); `revoked key` is handled by the test."""
        if caller == 'no key':
            return None
        if caller == 'unknown key':
            return 'mk_' + secrets.token_urlsafe(32)       # well-formed, never issued
        if caller == 'another member':
            return self.stranger_key
        if caller == 'owner':
            return s.owner_key
        if caller == 'admin':
            return ADMIN_KEY
        return s.keys[caller]

    def revoke(self, key):
        """What `marketplace.py keys revoke KEY_ID` does: the key's row revoked, the sessions it opened ended."""
        key_id = self.db.value('SELECT id FROM api_keys WHERE key_hash = :h', {'h': mp.hash_key(key)})
        assert mp.revoke_key(self.db, key_id) is True

    # states
    def job(self, **overrides):
        return self.market.job(**overrides)

    def claimed(self, **overrides):
        job = self.job(**overrides)
        return job, self.market.claim(job)

    def delivered(self, **overrides):
        return self.market.delivered_job(**overrides)

    def disputed(self):
        job, claim = self.delivered()
        answer = self.client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'Not done.'},
                                  key=self.requester_key)
        assert answer.status == 201, answer
        return job, claim, answer.json['dispute']

    def arbitrator(self, account_id, status='active', trusted=False, wallet=None, name='arbitrator'):
        """A human arbitrator owned by `account_id`, registered (pending) by the admin, who then gives it the
        status asked for and trusts it, if asked."""
        answer = self.client.post('/api/arbitrators', {'name': name, 'walletAddress': wallet or random_wallet(),
                                                       'accountId': account_id}, key=ADMIN_KEY)
        assert answer.status == 201, answer
        arbitrator = answer.json['arbitrator']
        change = ({} if status == 'pending' else {'status': status}) | ({'trusted': True} if trusted else {})
        if change:
            answer = self.client.patch(f'/api/arbitrators/{arbitrator["id"]}', change, key=ADMIN_KEY)
            assert answer.status == 200, answer
            arbitrator = answer.json['arbitrator']
        return arbitrator

    def panelists(self, count):
        """`count` active arbitrators of new accounts, [(arbitrator, key)]: with no other active one but the
        arbiter's, the next dispute's panel."""
        made = []
        for n in range(count):
            account, key = make_account(self.client, f'panelist-{n}')
            made.append((self.arbitrator(account['id'], name=f'panelist {n}'), key))
        return made

    def hooked(self):
        """A new member with an agent that has a webhook: (key, agent, webhook secret)."""
        _, key = make_account(self.client, 'hooked')
        agent, secret = make_agent(self.client, key, name='hooked-agent', webhookUrl=HOOK_URL)
        return key, agent, secret

    # reads
    def job_detail(self, job):
        return self.market.get_job(job)

    def job_summary(self, job):
        """(job status, escrowStatus, claim statuses, payment types) as GET /api/jobs/:id shows them."""
        detail = self.job_detail(job)
        return (detail['job']['status'], detail['job']['escrowStatus'],
                [claim['status'] for claim in detail['claims']], [p['type'] for p in detail['payments']])

    def dispute(self, dispute):
        answer = self.client.get(f'/api/disputes/{dispute["id"]}')
        assert answer.status == 200, answer
        return answer.json['dispute']

    def arbitrator_row(self, arbitrator_id):
        return self.db.row('SELECT * FROM arbitrators WHERE id = :id', {'id': arbitrator_id})

    def count(self, table):
        return self.db.value(f'SELECT count(*) FROM {table}')

    def snapshot(self):
        return snapshot(self.db)


def snapshot(db):
    """Every row of every table (the FTS index aside, which only mirrors jobs), order-independent."""
    tables = [row['name'] for row in db.rows(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
        "AND name NOT LIKE 'jobs_fts%' ORDER BY name")]
    return {table: sorted(json.dumps(row, sort_keys=True, default=str) for row in db.rows(f'SELECT * FROM "{table}"'))
            for table in tables}


class State:
    """What one route's cell acts on: the path, the body, who the owner is, and what to check."""

    def __init__(self, path, body=None, owner_key=None, bodies=None, keys=None, **facts):
        self.path, self.body, self.owner_key = path, body, owner_key
        self.bodies = bodies or {}      # caller -> a body other than `body`
        self.keys = keys or {}          # route-specific caller -> key
        self.__dict__.update(facts)

    def body_for(self, caller):
        return self.bodies.get(caller, self.body)


# The rows ---------------------------------------------------------------------------------------------

class Row:
    """One write route. `allowed`: the callers that succeed with `status`; every other key-holding caller
    gets 403 `forbidden` unless `codes` names another code; `extra`: route-specific callers and their 403
    code. `revoke`: whose key the `revoked key` caller holds."""

    status = 200
    allowed = ('owner', 'admin')
    codes = {}
    extra = {}
    revoke = 'owner'
    defects = {}        # caller -> reason: cells where the service is known to break the contract

    def setup(self, w, caller):
        raise NotImplementedError

    def ok(self, w, s, answer, caller):
        raise NotImplementedError

    def unchanged(self, w, s):
        raise NotImplementedError

    def expected(self, caller):
        """(status, code or None) that the contract gives this caller."""
        if caller in UNAUTHORIZED:
            return 401, 'unauthorized'
        if caller in self.extra:
            return 403, self.extra[caller]
        if caller in self.allowed:
            return self.status, None
        return 403, self.codes.get(caller, 'forbidden')


MATRIX = {}


def row(method, path):
    def register(cls):
        assert (method, path) in openapi_spec.API_OPERATIONS, (method, path)
        MATRIX[(method, path)] = cls()
        return cls
    return register


# Accounts

@row('PATCH', '/api/accounts/<account_id>')
class PatchAccount(Row):
    """Admins only (CONTRACT.md 18: x402Exempt). Owner: the account itself, which may not exempt itself."""
    allowed = ('admin',)
    revoke = 'admin'

    def setup(self, w, caller):
        account_id = w.account_id(w.requester_key)
        return State(f'/api/accounts/{account_id}', {'x402Exempt': True}, w.requester_key, account_id=account_id)

    def ok(self, w, s, answer, caller):
        assert answer.json == {'account': {'id': s.account_id, 'name': 'requester', 'role': 'member',
                                           'x402Exempt': True}}
        assert w.db.value('SELECT x402_exempt FROM accounts WHERE id = :id', {'id': s.account_id}) == 1

    def unchanged(self, w, s):
        assert w.db.value('SELECT x402_exempt FROM accounts WHERE id = :id', {'id': s.account_id}) == 0


# Agents and webhooks

@row('POST', '/api/agents')
class PostAgent(Row):
    """Any key registers an agent for its own account (the worker, here, adds a second agent)."""
    status = 201
    allowed = ('another member', 'owner', 'admin')

    def setup(self, w, caller):
        body = {'name': 'second-agent', 'walletAddress': random_wallet(),
                'capabilities': {'categories': ['data']}}
        return State('/api/agents', body, w.worker_key, agents=w.count('agents'))

    def ok(self, w, s, answer, caller):
        agent = answer.json['agent']
        assert agent['accountId'] == w.account_id(w.key_of(s, caller))
        assert (agent['name'], agent['reputationScore'], agent['capabilities']) == \
            ('second-agent', '0.00', {'categories': ['data']})
        assert answer.json['webhookSecret'].startswith('whsec_')
        assert w.count('agents') == s.agents + 1

    def unchanged(self, w, s):
        assert w.count('agents') == s.agents


@row('PATCH', '/api/agents/<agent_id>')
class PatchAgent(Row):
    """The agent's owner only (CONTRACT.md 2: a key acting on what it does not own gets 403; no admin clause)."""
    allowed = ('owner',)

    def setup(self, w, caller):
        agent = w.market.agent
        return State(f'/api/agents/{agent["id"]}', {'description': 'Changed by the caller.'}, w.worker_key,
                     agent=agent)

    def ok(self, w, s, answer, caller):
        agent = answer.json['agent']
        assert (agent['id'], agent['description'], agent['name']) == \
            (s.agent['id'], 'Changed by the caller.', 'worker-agent')
        assert w.client.get(s.path).json['agent']['description'] == 'Changed by the caller.'

    def unchanged(self, w, s):
        agent = w.client.get(s.path).json['agent']
        assert (agent['description'], agent['updatedAt']) == (s.agent['description'], s.agent['updatedAt'])


@row('POST', '/api/agents/<agent_id>/webhook-secret')
class RotateSecret(Row):
    """The agent's owner only."""
    allowed = ('owner',)

    def setup(self, w, caller):
        agent = w.market.agent
        return State(f'/api/agents/{agent["id"]}/webhook-secret', None, w.worker_key, agent=agent,
                     secret=w.market.webhook_secret)

    def secret(self, w, s):
        return w.db.value('SELECT webhook_secret FROM agents WHERE id = :id', {'id': s.agent['id']})

    def ok(self, w, s, answer, caller):
        assert answer.json['agentId'] == s.agent['id']
        new = answer.json['webhookSecret']
        assert new.startswith('whsec_') and new != s.secret
        assert self.secret(w, s) == new

    def unchanged(self, w, s):
        assert self.secret(w, s) == s.secret


class StubStripeRail:
    """Stands in for the service's StripeRail in stripe mode (no network): the calls onboarding makes."""

    def create_account(self, *, agent_id):
        return 'acct_' + agent_id.replace('-', '')[:16]

    def account_link(self, account_id, *, refresh_url, return_url):
        return {'url': f'https://connect.stripe.test/setup/{account_id}', 'expires_at': 4_102_444_800}


@row('POST', '/api/agents/<agent_id>/stripe/onboarding')
class StripeOnboarding(Row):
    """The agent's owner only (CONTRACT.md 12), in stripe mode (here with a stub rail)."""
    allowed = ('owner',)

    def setup(self, w, caller):
        w.app.service.stripe = w.app.service.settings.stripe = StubStripeRail()
        agent = w.market.agent
        return State(f'/api/agents/{agent["id"]}/stripe/onboarding', None, w.worker_key, agent=agent)

    def account(self, w, s):
        return w.db.value('SELECT stripe_account_id FROM agents WHERE id = :id', {'id': s.agent['id']})

    def ok(self, w, s, answer, caller):
        account = 'acct_' + s.agent['id'].replace('-', '')[:16]
        assert answer.json == {'url': f'https://connect.stripe.test/setup/{account}',
                               'expiresAt': '2100-01-01T00:00:00.000Z', 'accountId': account}
        assert self.account(w, s) == account

    def unchanged(self, w, s):
        assert self.account(w, s) is None


@row('POST', '/api/agents/<agent_id>/webhooks/<delivery_id>/redeliver')
class Redeliver(Row):
    """The agent's owner or an admin (API_OPERATIONS and docs/api.md "Webhooks"); 202 {delivery}."""
    status = 202

    def setup(self, w, caller):
        key, agent, _ = w.hooked()
        job = w.job()           # job.new goes to the hooked agent (category code, no limits)
        delivery = w.db.row("SELECT * FROM webhook_deliveries WHERE agent_id = :a AND event = 'job.new'",
                            {'a': agent['id']})
        assert delivery is not None and json.loads(delivery['payload'])['data']['jobId'] == job['id']
        w.db.execute('''UPDATE webhook_deliveries SET status = 'failed', attempts = 8, last_error = 'gone',
                        next_attempt_at = NULL WHERE id = :id''', {'id': delivery['id']})
        return State(f'/api/agents/{agent["id"]}/webhooks/{delivery["id"]}/redeliver', None, key,
                     delivery_id=delivery['id'])

    def delivery(self, w, s):
        return w.db.row('SELECT status, attempts, last_error FROM webhook_deliveries WHERE id = :id',
                        {'id': s.delivery_id})

    def ok(self, w, s, answer, caller):
        delivery = answer.json['delivery']
        assert (delivery['id'], delivery['event'], delivery['status'], delivery['attempts'], delivery['lastError']) == \
            (s.delivery_id, 'job.new', 'pending', 0, None)
        assert self.delivery(w, s) == {'status': 'pending', 'attempts': 0, 'last_error': None}

    def unchanged(self, w, s):
        assert self.delivery(w, s) == {'status': 'failed', 'attempts': 8, 'last_error': 'gone'}


@row('POST', '/api/webhooks/test')
class WebhookTest(Row):
    """The agent's owner only (CONTRACT.md 2: "POST /api/webhooks/test ...: the agent's owner")."""
    allowed = ('owner',)

    def setup(self, w, caller):
        key, agent, secret = w.hooked()
        return State('/api/webhooks/test', {'agentId': agent['id']}, key, agent=agent)

    def ok(self, w, s, answer, caller):
        result = answer.json
        assert (result['success'], result['statusCode'], result['webhookUrl'], result['signed']) == \
            (True, 200, HOOK_URL, True)
        assert len(w.webhooks.sent) == 1
        sent = w.webhooks.sent[0]
        assert (sent['url'], sent['body']['type'], sent['body']['data']['agentId']) == \
            (HOOK_URL, 'webhook.test', s.agent['id'])
        assert sent['headers']['X-Service-Event'] == 'webhook.test'

    def unchanged(self, w, s):
        assert w.webhooks.sent == []


# Jobs

@row('POST', '/api/jobs')
class PostJob(Row):
    """Any key posts for itself; a member naming another requesterId gets 403; an admin may post on behalf
    of anyone. Owner: the requester posting for itself; another member and the admin name the requester."""
    status = 201

    def setup(self, w, caller):
        requester = w.market.requester['id']
        on_behalf = job_body(title='Posted for the requester', requesterId=requester)
        return State('/api/jobs', job_body(title='Posted for the requester'), w.requester_key,
                     bodies={'another member': on_behalf, 'admin': on_behalf}, requester=requester,
                     jobs=w.count('jobs'))

    def ok(self, w, s, answer, caller):
        job = answer.json['job']
        assert (job['requesterId'], job['title'], job['status'], job['escrowStatus'], job['paymentAmount']) == \
            (s.requester, 'Posted for the requester', 'open', 'locked', '25.00')
        assert w.count('jobs') == s.jobs + 1
        assert w.job_summary(job) == ('open', 'locked', [], ['escrow'])

    def unchanged(self, w, s):
        assert w.count('jobs') == s.jobs
        assert w.db.value('SELECT count(*) FROM payments') == s.jobs      # one escrow record per job, no more


@row('POST', '/api/jobs/<job_id>/claim')
class Claim(Row):
    """The caller owns the agent in agentId (no admin clause). Owner: the worker with its agent; another
    member and the admin send the worker's agentId."""
    status = 201
    allowed = ('owner',)

    def setup(self, w, caller):
        job = w.job()
        return State(f'/api/jobs/{job["id"]}/claim', {'agentId': w.market.agent['id']}, w.worker_key, job=job)

    def ok(self, w, s, answer, caller):
        claim, job = answer.json['claim'], answer.json['job']
        assert (claim['jobId'], claim['agentId'], claim['status']) == (s.job['id'], w.market.agent['id'], 'claimed')
        assert (job['status'], job['claimCount']) == ('claimed', 1)
        assert w.job_summary(s.job) == ('claimed', 'locked', ['claimed'], ['escrow'])

    def unchanged(self, w, s):
        assert w.job_summary(s.job) == ('open', 'locked', [], ['escrow'])
        assert w.job_detail(s.job)['job']['claimCount'] == 0


class Deliver(Row):
    """The caller owns the claim's agent (no admin clause); `requester` (the job's own requester) too is 403."""
    allowed = ('owner',)
    extra = {'requester': 'forbidden'}
    verb = 'deliver'

    def setup(self, w, caller):
        job, claim = w.claimed()
        return State(f'/api/jobs/{job["id"]}/{self.verb}', {'claimId': claim['id'], 'deliverable': DELIVERABLE},
                     w.worker_key, keys={'requester': w.requester_key}, job=job, claim=claim)

    def ok(self, w, s, answer, caller):
        claim, job = answer.json['claim'], answer.json['job']
        assert (claim['id'], claim['status'], claim['deliverable']['url']) == \
            (s.claim['id'], 'delivered', DELIVERABLE['url'])
        assert claim['deliveredAt'] is not None
        assert job['status'] == 'delivered'
        assert w.job_summary(s.job) == ('delivered', 'locked', ['delivered'], ['escrow'])

    def unchanged(self, w, s):
        assert w.job_summary(s.job) == ('claimed', 'locked', ['claimed'], ['escrow'])
        assert w.job_detail(s.job)['claims'][0]['deliverable'] is None


@row('POST', '/api/jobs/<job_id>/deliver')
class DeliverRoute(Deliver):
    verb = 'deliver'


@row('POST', '/api/jobs/<job_id>/submit')
class SubmitRoute(Deliver):
    verb = 'submit'


@row('POST', '/api/jobs/<job_id>/verify')
class Verify(Row):
    """The job's requester or an admin; the worker (a party, but not the requester) gets 403."""
    extra = {'worker': 'forbidden'}

    def setup(self, w, caller):
        job, claim = w.delivered()
        return State(f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': True}, w.requester_key,
                     keys={'worker': w.worker_key}, job=job, claim=claim)

    def ok(self, w, s, answer, caller):
        body = answer.json
        assert (body['job']['status'], body['claim']['status'], body['escrowStatus']) == \
            ('completed', 'approved', 'released')
        assert [(p['type'], p['amount']) for p in body['payments']] == [('release', '25.00')]
        assert w.job_summary(s.job) == ('completed', 'released', ['approved'], ['escrow', 'release'])
        assert w.client.get(f'/api/agents/{w.market.agent["id"]}').json['agent']['reputationScore'] == '1.00'

    def unchanged(self, w, s):
        assert w.job_summary(s.job) == ('delivered', 'locked', ['delivered'], ['escrow'])
        assert w.client.get(f'/api/agents/{w.market.agent["id"]}').json['agent']['reputationScore'] == '0.00'


@row('POST', '/api/jobs/<job_id>/cancel')
class Cancel(Row):
    """The job's requester or an admin, while no claim is active."""
    extra = {'worker': 'forbidden'}

    def setup(self, w, caller):
        job = w.job()
        return State(f'/api/jobs/{job["id"]}/cancel', None, w.requester_key, keys={'worker': w.worker_key}, job=job)

    def ok(self, w, s, answer, caller):
        job = answer.json['job']
        assert (job['id'], job['status'], job['escrowStatus']) == (s.job['id'], 'cancelled', 'refunded')
        assert w.job_summary(s.job) == ('cancelled', 'refunded', [], ['escrow', 'refund'])

    def unchanged(self, w, s):
        assert w.job_summary(s.job) == ('open', 'locked', [], ['escrow'])


@row('POST', '/api/jobs/<job_id>/claims/<claim_id>/release')
class ReleaseClaim(Row):
    """The job's requester or an admin, once the claim has timed out; the worker itself gets 403 too."""
    extra = {'worker': 'forbidden'}

    def setup(self, w, caller):
        job, claim = w.claimed(claimTimeoutHours=1)
        mp.CLOCK.set(mp.now() + timedelta(hours=1))        # overdue (the real_clock fixture puts the clock back)
        return State(f'/api/jobs/{job["id"]}/claims/{claim["id"]}/release', None, w.requester_key,
                     keys={'worker': w.worker_key}, job=job, claim=claim)

    def ok(self, w, s, answer, caller):
        claim, job = answer.json['claim'], answer.json['job']
        assert (claim['id'], claim['status'], job['status'], job['claimCount']) == (s.claim['id'], 'expired', 'open', 0)
        assert w.job_summary(s.job) == ('open', 'locked', ['expired'], ['escrow'])
        assert w.client.get(f'/api/agents/{w.market.agent["id"]}').json['reputationHistory'][0]['delta'] == '-0.50'

    def unchanged(self, w, s):
        assert w.job_summary(s.job) == ('claimed', 'locked', ['claimed'], ['escrow'])


@row('POST', '/api/jobs/<job_id>/dispute')
class Dispute(Row):
    """The job's requester or an admin; 201 {dispute, job}."""
    status = 201
    extra = {'worker': 'forbidden'}

    def setup(self, w, caller):
        job, claim = w.delivered()
        return State(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'The tests still fail.'},
                     w.requester_key, keys={'worker': w.worker_key}, job=job, claim=claim)

    def ok(self, w, s, answer, caller):
        dispute, job = answer.json['dispute'], answer.json['job']
        assert (dispute['jobId'], dispute['claimId'], dispute['status'], dispute['reason'], dispute['outcome']) == \
            (s.job['id'], s.claim['id'], 'open', 'The tests still fail.', None)
        assert (dispute['requiredVotes'], dispute['votesReceived']) == (3, 0)
        assert (job['status'], job['escrowStatus']) == ('disputed', 'locked')
        assert w.job_summary(s.job) == ('disputed', 'locked', ['disputed'], ['escrow'])

    def unchanged(self, w, s):
        assert w.job_summary(s.job) == ('delivered', 'locked', ['delivered'], ['escrow'])
        assert w.count('disputes') == 0


# Disputes and arbitration

@row('PATCH', '/api/disputes/<dispute_id>')
class ResolveDispute(Row):
    """An admin, or the owner of a trusted, active arbitrator not linked to a party (CONTRACT.md 18). Owner:
    `arbiter`, owner of the trusted, active arbitrator `Judge`; another member owns no arbitrator. The parties
    (each owning a trusted, active arbitrator too) and the owner of a trusted arbitrator whose wallet is the
    worker agent's get 403 `conflict_of_interest`; the owners of a suspended, a pending or an untrusted
    (active) arbitrator 403 `forbidden`. Every body names resolvedBy: only the admin's counts."""
    extra = {'party: requester': 'conflict_of_interest', 'party: worker': 'conflict_of_interest',
             'owner of a linked trusted arbitrator': 'conflict_of_interest',
             'owner of a suspended arbitrator': 'forbidden', 'owner of a pending arbitrator': 'forbidden',
             'owner of an untrusted arbitrator': 'forbidden'}

    def setup(self, w, caller):
        job, claim, dispute = w.disputed()
        w.arbitrator(w.arbiter['id'], trusted=True, name='Judge')
        if caller == 'party: requester':
            w.arbitrator(w.market.requester['id'], trusted=True)
        if caller == 'party: worker':
            w.arbitrator(w.market.worker['id'], trusted=True)
        own = {'owner of a linked trusted arbitrator': dict(trusted=True, wallet=w.market.agent['walletAddress']),
               'owner of a suspended arbitrator': dict(status='suspended', trusted=True),
               'owner of a pending arbitrator': dict(status='pending', trusted=True),
               'owner of an untrusted arbitrator': dict()}
        keys = {'party: requester': w.requester_key, 'party: worker': w.worker_key}
        if caller in own:
            account, keys[caller] = make_account(w.client, 'another-arbiter')
            w.arbitrator(account['id'], **own[caller])
        return State(f'/api/disputes/{dispute["id"]}',
                     {'outcome': 'worker', 'resolution': 'The work is done.', 'resolvedBy': 'The community'},
                     w.arbiter_key, keys=keys, job=job, claim=claim, dispute=dispute)

    def ok(self, w, s, answer, caller):
        body = answer.json
        dispute = body['dispute']
        assert (dispute['id'], dispute['status'], dispute['outcome'], dispute['resolution']) == \
            (s.dispute['id'], 'resolved', 'worker', 'The work is done.')
        assert dispute['resolvedBy'] == {'owner': 'Judge', 'admin': 'The community'}[caller]
        assert (body['jobStatus'], body['escrowStatus']) == ('completed', 'released')
        assert w.job_summary(s.job) == ('completed', 'released', ['approved'], ['escrow', 'release'])

    def unchanged(self, w, s):
        dispute = w.dispute(s.dispute)
        assert (dispute['status'], dispute['outcome'], dispute['resolvedAt']) == ('open', None, None)
        assert w.job_summary(s.job) == ('disputed', 'locked', ['disputed'], ['escrow'])


@row('POST', '/api/disputes/<dispute_id>/vote')
class Vote(Row):
    """The caller owns `arbitratorId` (no admin clause), which is on the dispute's panel (CONTRACT.md 18), active
    and not a party's. Owner: `arbiter` with its arbitrator, drawn with two others (the only active ones when the
    dispute opened); another member and the admin send the arbiter's arbitratorId. A party voting with its own
    arbitrator gets 403 `conflict_of_interest`; a suspended panel member's owner `arbitrator_suspended`; the owner
    of an active arbitrator activated after the draw, or of a pending one, `not_on_panel`."""
    status = 201
    allowed = ('owner',)
    extra = {'party: requester': 'conflict_of_interest', 'party: worker': 'conflict_of_interest',
             'owner of a suspended arbitrator': 'arbitrator_suspended',
             'owner of an arbitrator off the panel': 'not_on_panel', 'owner of a pending arbitrator': 'not_on_panel'}

    def setup(self, w, caller):
        arbitrator = w.arbitrator(w.arbiter['id'])
        panelists = w.panelists(2)
        job, claim, dispute = w.disputed()
        assert dispute['panel'] == sorted(a['id'] for a in [arbitrator] + [a for a, _ in panelists])
        keys, bodies = {}, {}
        own = {'party: requester': (w.market.requester['id'], w.requester_key, 'active'),
               'party: worker': (w.market.worker['id'], w.worker_key, 'active')}
        if caller in ('owner of an arbitrator off the panel', 'owner of a pending arbitrator'):
            account, key = make_account(w.client, 'newcomer')
            own[caller] = (account['id'], key, 'active' if 'off the panel' in caller else 'pending')
        if caller in own:
            account_id, keys[caller], status = own[caller]
            theirs = w.arbitrator(account_id, status=status)
            bodies[caller] = {'arbitratorId': theirs['id'], 'vote': 'worker', 'reasoning': 'Looks done.'}
        if caller == 'owner of a suspended arbitrator':       # a panel member, suspended since the draw
            suspended, keys[caller] = panelists[0]
            answer = w.client.patch(f'/api/arbitrators/{suspended["id"]}', {'status': 'suspended'}, key=ADMIN_KEY)
            assert answer.status == 200, answer
            bodies[caller] = {'arbitratorId': suspended['id'], 'vote': 'worker', 'reasoning': 'Looks done.'}
        return State(f'/api/disputes/{dispute["id"]}/vote',
                     {'arbitratorId': arbitrator['id'], 'vote': 'worker', 'reasoning': 'Looks done.'},
                     w.arbiter_key, bodies=bodies, keys=keys, job=job, dispute=dispute, arbitrator=arbitrator)

    def ok(self, w, s, answer, caller):
        body = answer.json
        vote = body['vote']
        assert (vote['disputeId'], vote['arbitratorId'], vote['vote'], vote['reasoning']) == \
            (s.dispute['id'], s.arbitrator['id'], 'worker', 'Looks done.')
        assert (body['votesReceived'], body['requiredVotes'], body['resolved'], body['outcome']) == (1, 3, False, None)
        assert w.count('votes') == 1
        assert w.job_summary(s.job) == ('disputed', 'locked', ['disputed'], ['escrow'])

    def unchanged(self, w, s):
        assert w.count('votes') == 0
        dispute = w.dispute(s.dispute)
        assert (dispute['status'], dispute['votesReceived']) == ('open', 0)
        assert w.job_summary(s.job) == ('disputed', 'locked', ['disputed'], ['escrow'])


@row('POST', '/api/arbitrators')
class PostArbitrator(Row):
    """With agentId: the caller owns the agent and its reputation is at least 10.00 (403
    `insufficient_reputation` otherwise); without agentId: admins only. Owner: the worker with its 10.00 agent;
    another member sends the worker's agentId; the admin registers a human arbitrator for the arbiter account.
    Route-specific: the owner of a 9.99 agent, a member without agentId, an admin naming an agent it does not
    own."""
    status = 201
    extra = {'owner below 10.00': 'insufficient_reputation', 'member without agentId': 'forbidden',
             'admin naming an agent it does not own': 'forbidden'}

    def setup(self, w, caller):
        agent = w.market.agent
        score = 999 if caller == 'owner below 10.00' else 1000
        w.db.execute('UPDATE agents SET reputation = :score WHERE id = :id', {'score': score, 'id': agent['id']})
        with_agent = {'name': 'worker-arbitrator', 'walletAddress': agent['walletAddress'], 'agentId': agent['id']}
        human = {'name': 'human-arbitrator', 'walletAddress': random_wallet(), 'accountId': w.arbiter['id']}
        return State('/api/arbitrators', with_agent, w.worker_key,
                     bodies={'admin': human, 'member without agentId': human},
                     keys={'owner below 10.00': w.worker_key, 'member without agentId': w.stranger_key,
                           'admin naming an agent it does not own': ADMIN_KEY},
                     agent=agent, human=human)

    def ok(self, w, s, answer, caller):
        arbitrator = answer.json['arbitrator']
        expected = {'owner': ('worker-arbitrator', s.agent['id'], w.market.worker['id']),
                    'admin': ('human-arbitrator', None, w.arbiter['id'])}[caller]
        assert (arbitrator['name'], arbitrator['agentId'], arbitrator['accountId']) == expected
        assert (arbitrator['status'], arbitrator['trusted'], arbitrator['votesCast'], arbitrator['accuracy']) == \
            ('pending', False, 0, None)
        assert w.count('arbitrators') == 1

    def unchanged(self, w, s):
        assert w.count('arbitrators') == 0


@row('PATCH', '/api/arbitrators/<arbitrator_id>')
class PatchArbitrator(Row):
    """Admins only (API_OPERATIONS, docs/api.md "Disputes and arbitration"): activating a pending arbitrator and
    trusting it. Owner: the arbitrator's own account (it may not activate or trust itself)."""
    allowed = ('admin',)
    revoke = 'admin'

    def setup(self, w, caller):
        arbitrator = w.arbitrator(w.arbiter['id'], status='pending')
        return State(f'/api/arbitrators/{arbitrator["id"]}', {'status': 'active', 'trusted': True}, w.arbiter_key,
                     arbitrator=arbitrator)

    def ok(self, w, s, answer, caller):
        arbitrator = answer.json['arbitrator']
        assert (arbitrator['id'], arbitrator['status'], arbitrator['trusted'], arbitrator['accountId']) == \
            (s.arbitrator['id'], 'active', True, w.arbiter['id'])
        row = w.arbitrator_row(s.arbitrator['id'])
        assert (row['status'], row['trusted']) == ('active', 1)

    def unchanged(self, w, s):
        row = w.arbitrator_row(s.arbitrator['id'])
        assert (row['status'], row['trusted']) == ('pending', 0)


# Sweeps

@row('POST', '/api/jobs/expire')
class Expire(Row):
    """Admin key only. Owner: the requester of the overdue job the sweep would end."""
    allowed = ('admin',)
    revoke = 'admin'

    def setup(self, w, caller):
        job, claim = w.claimed(deadline=in_hours(1))
        mp.CLOCK.advance(hours=2)
        return State('/api/jobs/expire', None, w.requester_key, job=job, claim=claim)

    def ok(self, w, s, answer, caller):
        assert answer.json == {'expired': 1, 'refunded': 1, 'reputationPenalties': 1, 'jobIds': [s.job['id']]}
        assert w.job_summary(s.job) == ('expired', 'refunded', ['expired'], ['escrow', 'refund'])

    def unchanged(self, w, s):
        assert w.job_summary(s.job) == ('claimed', 'locked', ['claimed'], ['escrow'])


@row('POST', '/api/jobs/auto-verify')
class AutoVerify(Row):
    """Admin key only. Owner: the requester of the delivery whose window has passed."""
    allowed = ('admin',)
    revoke = 'admin'

    def setup(self, w, caller):
        job, claim = w.delivered()
        mp.CLOCK.advance(hours=25)
        return State('/api/jobs/auto-verify', None, w.requester_key, job=job, claim=claim)

    def ok(self, w, s, answer, caller):
        assert answer.json == {'autoApproved': 1, 'claimIds': [s.claim['id']], 'checked': 1}
        assert w.job_summary(s.job) == ('completed', 'released', ['approved'], ['escrow', 'release'])
        assert w.job_detail(s.job)['claims'][0]['autoApproved'] is True

    def unchanged(self, w, s):
        assert w.job_summary(s.job) == ('delivered', 'locked', ['delivered'], ['escrow'])


# The matrix -------------------------------------------------------------------------------------------

def cells():
    for route in WRITE_ROUTES:
        if route in OPEN or route in PROTOCOL:
            continue
        spec = MATRIX.get(route)
        callers = CALLERS + tuple(spec.extra) if spec else CALLERS
        for caller in callers:
            marks = ()
            if spec and caller in spec.defects:
                marks = pytest.mark.xfail(strict=True, reason='DEFECT: ' + spec.defects[caller])
            yield pytest.param(route, caller, id=f'{label(*route)}-{caller}', marks=marks)


@pytest.fixture
def world(client, app):
    return World(client, app)


@pytest.mark.parametrize('route, caller', list(cells()))
def test_permission(world, route, caller):
    spec = MATRIX.get(route)
    if spec is None:
        pytest.fail(f'{label(*route)} is a write route with no row in the permission matrix (nor in OPEN)')
    method, _ = route
    state = spec.setup(world, caller)
    if caller == 'revoked key':
        key = state.owner_key if spec.revoke == 'owner' else ADMIN_KEY
        world.revoke(key)
    else:
        key = world.key_of(state, caller)
    before = world.snapshot()
    answer = world.client.request(method, state.path, state.body_for(caller), key=key)
    status, code = spec.expected(caller)
    if code is None:
        assert answer.status == status, answer
        assert isinstance(answer.json, dict), answer
        spec.ok(world, state, answer, caller)
        return
    assert_error(answer, status, code)
    if status == 401:
        assert header(answer, 'WWW-Authenticate') == 'Bearer', answer.headers
    assert world.snapshot() == before
    spec.unchanged(world, state)


def test_every_write_route_has_a_row():
    """A new write route must be placed in the matrix (or declared open); no row for a route that is gone."""
    keyed = set(WRITE_ROUTES) - set(OPEN) - PROTOCOL
    assert set(OPEN) <= set(WRITE_ROUTES) and PROTOCOL <= set(WRITE_ROUTES)
    assert sorted(keyed - set(MATRIX)) == []
    assert sorted(set(MATRIX) - keyed) == []


def test_the_keyed_write_routes_are_documented_as_keyed():
    """The OpenAPI document marks each matrix route with bearer security; the open ones without it."""
    for route in MATRIX:
        assert openapi_spec.API_OPERATIONS[route].get('auth') == 'key', route
        assert 401 in openapi_spec.API_OPERATIONS[route]['errors'], route
    for route in OPEN:
        assert openapi_spec.API_OPERATIONS[route].get('auth') is None, route


@pytest.mark.parametrize('route', sorted(PROTOCOL), ids=lambda route: label(*route))
@pytest.mark.parametrize('caller', UNAUTHORIZED)
def test_a_protocol_route_needs_a_live_key(world, route, caller):
    state = State(None, None, world.requester_key)
    if caller == 'revoked key':
        world.revoke(world.requester_key)
        key = world.requester_key
    else:
        key = world.key_of(state, caller)
    before = world.snapshot()
    path = mp.openapi_path(route[1]).replace('{task_id}', secrets.token_hex(16))
    answer = world.client.request(route[0], path, {'message': {'messageId': 'm'}}, key=key)
    assert_error(answer, 401, 'unauthorized')
    assert header(answer, 'WWW-Authenticate').startswith('Bearer'), answer.headers
    assert world.snapshot() == before


# The open routes --------------------------------------------------------------------------------------

@pytest.fixture
def x402_client(tmp_path):
    """An app with x402 on (a price for GET /api/jobs/match) whose node is a closed local port: POST
    /api/x402 checks a malformed payment without needing the chain."""
    settings = mp.Settings(db=str(tmp_path / 'x402.db'), rate_limits='off', admin_key=ADMIN_KEY,
                           public_url='http://market.test', allow_private_webhooks=True,
                           rpc_url=f'http://127.0.0.1:{free_port()}', escrow_key='0x' + '11' * 32,
                           x402_price=mp.parse_prices('GET /api/jobs/match=0.01'),
                           x402_pay_to='0x9965507D1a55bcC2695C58ba16FB37d819B0A4dc')
    app = wiring.make_app(settings)
    yield Client(app)
    app.service.close()


OPEN_CALLERS = ('no key', 'member', 'admin')


def open_key(client, caller):
    if caller == 'no key':
        return None
    if caller == 'member':
        return make_account(client, 'member')[1]
    return ADMIN_KEY


@pytest.mark.parametrize('caller', OPEN_CALLERS)
def test_open_registration_of_an_account(client, app, caller):
    key = open_key(client, caller)
    accounts = app.service.db.value('SELECT count(*) FROM accounts')
    answer = client.post('/api/accounts', {'name': 'newcomer'}, key=key)
    assert answer.status == OPEN[('POST', '/api/accounts')], answer
    account = answer.json['account']
    assert (account['name'], account['role']) == ('newcomer', 'member')
    assert answer.json['apiKey'] != key
    assert mp.account_for_key(app.service.db, answer.json['apiKey'])['id'] == account['id']
    assert app.service.db.value('SELECT count(*) FROM accounts') == accounts + 1


@pytest.mark.parametrize('caller', OPEN_CALLERS)
def test_open_registration_of_an_agent(client, app, caller):
    key = open_key(client, caller)
    body = {'name': 'newcomer-agent', 'walletAddress': random_wallet(), 'capabilities': {'categories': ['code']}}
    answer = client.post('/api/agents/register', body, key=key)
    assert answer.status == OPEN[('POST', '/api/agents/register')], answer
    agent, api_key = answer.json['agent'], answer.json['apiKey']
    assert (agent['name'], agent['walletAddress'], agent['reputationScore']) == \
        ('newcomer-agent', body['walletAddress'], '0.00')
    assert answer.json['webhookSecret'].startswith('whsec_')
    owner = mp.account_for_key(app.service.db, api_key)
    assert (owner['id'], owner['role']) == (agent['accountId'], 'member')
    if key is not None:         # a key sent along does not make the caller the new agent's owner
        assert mp.account_for_key(app.service.db, key)['id'] != agent['accountId']


@pytest.mark.parametrize('caller', OPEN_CALLERS)
def test_the_x402_check_needs_no_key(x402_client, caller):
    key = open_key(x402_client, caller)
    answer = x402_client.post('/api/x402', key=key, headers={'X-PAYMENT': 'bm90LWpzb24='})     # "not-json"
    assert answer.status == OPEN[('POST', '/api/x402')], answer
    assert (answer.json['valid'], answer.json['checks'], answer.json['endpoint']) == \
        (False, {'decoded': False}, 'GET /api/jobs/match')
    assert answer.json['code'] == 'payment_invalid'
    assert x402_client.app.service.db.value('SELECT count(*) FROM x402_payments') == 0


def test_the_x402_check_without_x402_is_404_not_401(client):
    """With nothing priced POST /api/x402 answers 404 `not_priced`, never a 401: it takes no key."""
    assert_error(client.post('/api/x402', headers={'X-PAYMENT': 'bm90LWpzb24='}), 404, 'not_priced')


def test_the_stripe_webhook_without_stripe_is_404_not_401(client):
    """Without a Stripe key POST /api/stripe/webhook answers 404, never a 401: it takes no key (its 200 for
    every caller: tests/test_stripe_funding.py)."""
    assert_error(client.post('/api/stripe/webhook', b'{}', headers={'Stripe-Signature': 't=1,v1=00'}), 404, 'not_found')


def test_closed_registration_refuses_both_open_routes_without_a_key(tmp_path):
    """With --no-open-registration the two registration routes answer 403 `registration_closed` (not 401)
    and create nothing."""
    settings = mp.Settings(db=str(tmp_path / 'closed.db'), rate_limits='off', admin_key=ADMIN_KEY,
                           public_url='http://market.test', allow_private_webhooks=True, open_registration=False)
    app = wiring.make_app(settings)
    try:
        client = Client(app)
        accounts = app.service.db.value('SELECT count(*) FROM accounts')
        assert_error(client.post('/api/accounts', {'name': 'newcomer'}), 403, 'registration_closed')
        assert_error(client.post('/api/agents/register', {'name': 'newcomer', 'walletAddress': random_wallet()}),
                     403, 'registration_closed')
        assert app.service.db.value('SELECT count(*) FROM accounts') == accounts
        assert app.service.db.value('SELECT count(*) FROM agents') == 0
    finally:
        app.service.close()


# Exempt accounts (CONTRACT.md 18): x402Exempt spares an account x402 prices, and gives it nothing else -----------

def exempt(world, key):
    answer = world.client.patch(f'/api/accounts/{world.account_id(key)}', {'x402Exempt': True}, key=ADMIN_KEY)
    assert answer.status == 200 and answer.json['account']['x402Exempt'] is True, answer


ADMIN_ONLY = sorted(route for route, spec in MATRIX.items() if spec.allowed == ('admin',))


@pytest.mark.parametrize('route', ADMIN_ONLY, ids=[label(*route) for route in ADMIN_ONLY])
def test_an_exempt_account_gets_no_admin_right(world, route):
    spec = MATRIX[route]
    state = spec.setup(world, 'another member')
    exempt(world, world.stranger_key)
    before = world.snapshot()
    assert_error(world.client.request(route[0], state.path, state.body_for('another member'), key=world.stranger_key),
                 403, 'forbidden')
    assert world.snapshot() == before
    spec.unchanged(world, state)


def test_admin_only_routes_include_the_new_ones():
    assert {('PATCH', '/api/accounts/<account_id>'), ('PATCH', '/api/arbitrators/<arbitrator_id>'),
            ('POST', '/api/jobs/expire'), ('POST', '/api/jobs/auto-verify')} <= set(ADMIN_ONLY)


PRICED_CALLERS = {'no key': (402, 'payment_required'), 'unknown key': (401, 'unauthorized'),
                  'member': (402, 'payment_required'), 'exempt member': (200, None), 'admin': (200, None)}


@pytest.mark.parametrize('caller', PRICED_CALLERS)
def test_a_priced_operation_binds_every_caller_but_admins_and_exempt_accounts(x402_client, caller):
    """GET /api/jobs/match priced at 0.01 USDC, asked without a payment (the node is never needed)."""
    world = World(x402_client, x402_client.app)
    key = {'no key': None, 'unknown key': 'mk_' + secrets.token_urlsafe(32), 'admin': ADMIN_KEY}.get(caller)
    if caller in ('member', 'exempt member'):
        key = world.stranger_key
        if caller == 'exempt member':
            exempt(world, key)
    answer = x402_client.get('/api/jobs/match?categories=code', key=key)
    status, code = PRICED_CALLERS[caller]
    if code is None:
        assert (answer.status, answer.json['matches'], header(answer, 'X-PAYMENT-RESPONSE')) == (200, [], None)
        return
    body = assert_error(answer, status, code)
    if status == 402:
        assert body['accepts'][0]['payTo'] == '0x9965507D1a55bcC2695C58ba16FB37d819B0A4dc'
    assert x402_client.app.service.db.value('SELECT count(*) FROM x402_payments') == 0


# Browser sessions after revocation (CONTRACT 20: a session lives only as long as its key) -----------------------

def signed_in(app, key):
    """A browser over the in-process app, signed in with `key` through the sign-in page."""
    from test_pages_actions import Browser
    browser = Browser(app)
    answer = browser.submit('/signin', '/signin', apiKey=key)
    assert answer.status == 303, answer
    return browser


def location(answer):
    return header(answer, 'Location')


def test_a_revoked_member_keys_session_is_signed_out_and_acts_no_more(world):
    job, claim = world.delivered()
    browser = signed_in(world.app, world.requester_key)
    hidden = browser.hidden(f'/jobs/{job["id"]}', f'/jobs/{job["id"]}/approve')
    world.revoke(world.requester_key)
    before, summary = world.snapshot(), world.job_summary(job)
    answer = browser.request('POST', f'/jobs/{job["id"]}/approve', {**hidden, 'claimId': claim['id']})
    assert (answer.status, location(answer)) == (303, 'http://market.test/signin')
    assert browser.get('/my/jobs').status == 303
    assert world.snapshot() == before
    assert summary[:2] == world.job_summary(job)[:2] == ('delivered', 'locked')


def test_a_session_of_a_retired_env_admin_key_cannot_release_a_strangers_escrow(tmp_path):
    """docs/security.md's remedy for a leaked admin key (a new MARKETPLACE_ADMIN_KEY) ends what the old key opened: its
    sessions, and its account's admin role. A restart with the same key changes nothing."""
    old, new = ADMIN_KEY, 'new-admin-key-' + secrets.token_urlsafe(32)

    def start(admin_key):
        return wiring.make_app(mp.Settings(db=str(tmp_path / 'rotate.db'), rate_limits='off', admin_key=admin_key,
                                       public_url='http://market.test'))
    app = start(old)
    market = Market(Client(app))
    job, claim = market.delivered_job(paymentAmount='250.00')
    browser = signed_in(app, old)
    hidden = browser.hidden(f'/jobs/{job["id"]}', f'/jobs/{job["id"]}/approve')      # an admin sees the buttons
    old_account = mp.account_for_key(app.service.db, old)
    assert old_account['role'] == 'admin'
    before = snapshot(app.service.db)
    app.service.close()

    app = start(old)                    # the same key again: nothing changes, the session still acts
    assert snapshot(app.service.db) == before
    browser.client = Client(app)
    assert browser.get('/my/jobs').status == 200
    app.service.close()

    app = start(new)
    try:
        db = app.service.db
        assert db.value('SELECT role FROM accounts WHERE id = :id', {'id': old_account['id']}) == 'member'
        assert db.value('SELECT count(*) FROM sessions') == 0
        browser.client = Client(app)
        answer = browser.request('POST', f'/jobs/{job["id"]}/approve', {**hidden, 'claimId': claim['id']})
        assert (answer.status, location(answer)) == (303, 'http://market.test/signin')
        detail = Client(app).get(f'/api/jobs/{job["id"]}').json
        assert (detail['job']['status'], detail['job']['escrowStatus'], detail['job']['paymentAmount']) == \
            ('delivered', 'locked', '250.00')
        assert [payment['type'] for payment in detail['payments']] == ['escrow']
        assert_error(Client(app).post(f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': True},
                                      key=old), 401, 'unauthorized')
        assert signed_in(app, new).get('/my/jobs').status == 200
        assert mp.ledger_problems(db) == []
    finally:
        app.service.close()
