"""The marketplace as a Model Context Protocol server: tools and resources over the HTTP API, on stdio or over
Streamable HTTP.

Run it as `python marketplace.py mcp [--url URL] [--api-key KEY]` (CONTRACT.md section 15) for stdio. `serve`
answers `<base-url>/mcp` itself (section 22) by starting this module once, on the first /mcp request, as a child
process (`run_http`) on a loopback socket it hands over, and proxying to it: stateless, JSON answers, each request
acting with the Bearer token it carries. This is the only module that imports the `mcp` SDK. It is a client of the
API, so it serves a local or a remote deployment alike, and it runs on asyncio with threads: it is never
monkey-patched by gevent. Each tool is one API call; the API's JSON answer is the tool's structured result, an API
error is a tool error keeping its `error` and `code`.
"""

import contextvars
import hashlib
import inspect
import json
import os
import secrets
from decimal import Decimal
from typing import Annotated, Any, Literal
from urllib.parse import quote
from uuid import UUID

import requests
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ResourceNotFoundError, ToolError
from mcp.types import ToolAnnotations
from pydantic import Field
from typing_extensions import NotRequired, TypedDict

DEFAULT_URL = 'http://127.0.0.1:8080'
DEFAULT_TIMEOUT = 30.0
# Over HTTP: the Bearer token of the request being served (an API key or an OAuth access token), which every API
# call it makes carries instead of the server's own key.
CALLER_TOKEN = contextvars.ContextVar('caller_token', default=None)
# ... and the caller's address, which `serve` passed along and the API calls carry back signed with the secret
# `serve` gave this process (MARKETPLACE_MCP_RELAY), so that they count against the caller's rate limits.
CALLER_ADDRESS = contextvars.ContextVar('caller_address', default=None)

# Each tool is one API operation: (method, path as in the OpenAPI document). tests/test_mcp.py checks every one
# against GET /api/openapi.json.
TOOL_OPERATIONS = {
    'list_jobs': ('GET', '/api/jobs'),
    'search_jobs': ('GET', '/api/jobs/search'),
    'get_job': ('GET', '/api/jobs/{job_id}'),
    'post_job': ('POST', '/api/jobs'),
    'claim_job': ('POST', '/api/jobs/{job_id}/claim'),
    'deliver_job': ('POST', '/api/jobs/{job_id}/deliver'),
    'verify_delivery': ('POST', '/api/jobs/{job_id}/verify'),
    'open_dispute': ('POST', '/api/jobs/{job_id}/dispute'),
    'cast_vote': ('POST', '/api/disputes/{dispute_id}/vote'),
    'get_agent': ('GET', '/api/agents/{agent_id}'),
    'match_jobs': ('GET', '/api/jobs/match'),
    'service_health': ('GET', '/api/health'),
    'register_agent': ('POST', '/api/agents'),
    'my_claims': ('GET', '/api/claims'),
    'get_dispute': ('GET', '/api/disputes/{dispute_id}'),
}

# The API's vocabularies (tests/test_mcp.py checks them against marketplace.py).
Category = Literal['code', 'content', 'data', 'research', 'design', 'custom']
JobStatus = Literal['open', 'claimed', 'delivered', 'disputed', 'completed', 'rejected', 'refunded', 'expired',
                    'cancelled']
JobSort = Literal['newest', 'oldest', 'pay_desc', 'pay_asc', 'deadline']
SearchSort = Literal['relevance', 'newest', 'pay_desc', 'pay_asc', 'deadline']
CompetitionMode = Literal['first-wins', 'best-wins', 'all-paid']
Outcome = Literal['worker', 'requester']

Limit = Annotated[int, Field(ge=1, le=200, description='Page size, 1 to 200 (default 50).')]
Offset = Annotated[int, Field(ge=0, description='How many to skip (default 0).')]
MinPay = Annotated[Decimal, Field(ge=0, description='Only jobs paying at least this much, e.g. 10.5.')]
JobId = Annotated[UUID, Field(description="The job's id (a UUID).")]
ClaimId = Annotated[UUID, Field(description="The claim's id (a UUID), as claim_job answered it.")]
Money = Annotated[str, Field(pattern=r'^\d{1,7}(\.\d{1,2})?$', examples=['25.00'],
                             description='A decimal string such as "25.00" (never a JSON number): more than 0, '
                                         'at most 1000000.00, in paymentCurrency.')]


class Criterion(TypedDict):
    """One acceptance criterion of a job."""

    type: Annotated[str, Field(min_length=1, max_length=2000, examples=['automated'])]
    check: Annotated[str, Field(min_length=1, max_length=2000, description='What the delivery must pass.')]


# What each tool answers: the API's JSON answer of its operation, its top-level fields (tests/test_mcp.py checks them
# against the OpenAPI document's response schemas), each tool's outputSchema. Objects are the API's (a job, a claim,
# ...), described in the `marketplace://openapi` resource.
Obj = dict[str, Any]
JobList = TypedDict('JobList', {'jobs': list[Obj], 'total': int, 'limit': int, 'offset': int})
SearchResult = TypedDict('SearchResult', {'results': list[Obj], 'total': int, 'limit': int, 'offset': int,
                                          'query': str | None, 'filters': Obj, 'sort': str})
JobDetail = TypedDict('JobDetail', {'job': Obj, 'claims': list[Obj], 'payments': list[Obj], 'timeline': list[Obj],
                                    'checkoutUrl': NotRequired[str], 'releaseTypedData': NotRequired[Obj]})
JobResult = TypedDict('JobResult', {'job': Obj, 'checkoutUrl': NotRequired[str]})
ClaimResult = TypedDict('ClaimResult', {'claim': Obj, 'job': Obj})
VerifyResult = TypedDict('VerifyResult', {'job': Obj, 'claim': Obj, 'escrowStatus': str, 'payments': list[Obj]})
DisputeCreated = TypedDict('DisputeCreated', {'dispute': Obj, 'job': Obj})
VoteCast = TypedDict('VoteCast', {'vote': Obj, 'votesReceived': int, 'requiredVotes': int, 'resolved': bool,
                                  'outcome': str | None})
AgentDetail = TypedDict('AgentDetail', {'agent': Obj, 'claims': list[Obj], 'reputationHistory': list[Obj]})
JobMatches = TypedDict('JobMatches', {'matches': list[Obj], 'total': int})
Health = TypedDict('Health', {'status': str, 'version': str, 'dbConnected': bool, 'payments': str, 'rails': Obj,
                              'replication': Obj, 'role': str, 'replicaOf': NotRequired[str],
                              'lag': NotRequired[float | None], 'error': NotRequired[str], 'code': NotRequired[str],
                              'chain': NotRequired[Obj], 'escrow': NotRequired[Obj]})
AgentCreated = TypedDict('AgentCreated', {'agent': Obj, 'webhookSecret': str | None})
MyClaims = TypedDict('MyClaims', {'claims': list[Obj], 'total': int, 'limit': int, 'offset': int})
DisputeDetail = TypedDict('DisputeDetail', {'dispute': Obj, 'job': Obj, 'claim': Obj})
ANSWERS = {'list_jobs': JobList, 'search_jobs': SearchResult, 'get_job': JobDetail, 'post_job': JobResult,
           'claim_job': ClaimResult, 'deliver_job': ClaimResult, 'verify_delivery': VerifyResult,
           'open_dispute': DisputeCreated, 'cast_vote': VoteCast, 'get_agent': AgentDetail, 'match_jobs': JobMatches,
           'service_health': Health, 'register_agent': AgentCreated, 'my_claims': MyClaims,
           'get_dispute': DisputeDetail}


class MarketplaceAPI:
    """The HTTP API of one deployment, called with one API key; every call has a time-out."""

    def __init__(self, url=DEFAULT_URL, api_key='', timeout=DEFAULT_TIMEOUT):
        self.url = url.rstrip('/')
        self.api_key = api_key
        self.timeout = timeout
        self.nonce = secrets.token_hex(8)   # this process's: another session's same call is a new call

    def idempotency_key(self, tool, arguments):
        """The Idempotency-Key of a write: the hash of the tool and its arguments, plus this process's nonce, so
        that a host's retry of the same call in this session does not act twice."""
        canonical = json.dumps([tool, arguments], sort_keys=True, separators=(',', ':'), default=str)
        return f'mcp-{hashlib.sha256(canonical.encode()).hexdigest()[:48]}-{self.nonce}'

    def call(self, method, path, *, query=None, body=None, tool=None):
        """The API's JSON answer to one request; APIFailure when it answers an error or cannot be reached."""
        headers = {'Accept': 'application/json', 'User-Agent': 'marketplace-mcp'}
        token = CALLER_TOKEN.get() or self.api_key
        if token:
            headers['Authorization'] = f'Bearer {token}'
        if CALLER_ADDRESS.get() and os.environ.get('MARKETPLACE_MCP_RELAY'):
            headers['X-Marketplace-Relay'] = f'{os.environ["MARKETPLACE_MCP_RELAY"]} {CALLER_ADDRESS.get()}'
        if tool and method in ('POST', 'PATCH'):
            headers['Idempotency-Key'] = self.idempotency_key(tool, {'path': path, 'query': query, 'body': body})
        params = {name: value for name, value in (query or {}).items() if value is not None}
        try:
            answer = requests.request(method, self.url + path, params=params, json=body, headers=headers,
                                      timeout=self.timeout, allow_redirects=False)
        except requests.Timeout:
            raise APIFailure(f'The marketplace service at {self.url} did not answer within {self.timeout:g} s '
                             '(unreachable); try again later.') from None
        except requests.RequestException as exc:
            raise APIFailure(f'The marketplace service is unreachable at {self.url} '
                             f'({type(exc).__name__}); is it running, and is the URL right?') from None
        try:
            data = answer.json()
        except ValueError:
            data = None
        if 300 <= answer.status_code < 400:     # never followed: a replica's URL is no place for writes
            primary = answer.headers.get('Location') or (isinstance(data, dict) and data.get('primary')) or 'elsewhere'
            raise APIFailure(f'The marketplace service at {self.url} answered HTTP {answer.status_code}: it sends this '
                             f'call to {primary} (a read replica sends writes to its primary). Nothing was done; '
                             'start this MCP server with --url naming the primary.', answer.status_code, 'redirect')
        if answer.status_code >= 400:
            raise APIFailure.from_answer(answer.status_code, data, self.url)
        if not isinstance(data, dict):
            raise APIFailure(f'The marketplace service at {self.url} answered HTTP {answer.status_code} '
                             'without a JSON object; is the URL that of the API?')
        return data


class APIFailure(Exception):
    """An API call that did not succeed: its message is what a model reads; `status` and `code` when it answered."""

    def __init__(self, message, status=None, code=None):
        super().__init__(message)
        self.status, self.code = status, code

    @classmethod
    def from_answer(cls, status, body, url):
        """The failure of an error answer: the API's `error`, `code` and `status`, then the rest of its body."""
        if not (isinstance(body, dict) and 'code' in body):
            return cls(f'The marketplace service at {url} answered HTTP {status} without a JSON error.', status)
        message = f'{body.get("error", "")} (code: {body["code"]}, status: {body.get("status", status)})'
        rest = {name: value for name, value in body.items() if name not in ('error', 'code', 'status')}
        if rest:
            message += '\n' + json.dumps(rest, sort_keys=True)
        return cls(message, status, body['code'])


def without_none(fields):
    """The fields that were given."""
    return {name: value for name, value in fields.items() if value is not None}


def decimal_text(value):
    """A Decimal as plain text for a query or body (10.5, never 1.05E+1)."""
    return None if value is None else format(value, 'f')


READ = ToolAnnotations(read_only_hint=True, open_world_hint=False)
WRITE = ToolAnnotations(read_only_hint=False, destructive_hint=False, idempotent_hint=True, open_world_hint=False)
MONEY_MOVES = ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=True, open_world_hint=False)


def make_server(url=DEFAULT_URL, api_key='', timeout=DEFAULT_TIMEOUT):
    """The MCP server over the API at `url`, acting with `api_key`; it asks the API nothing until a tool runs."""
    api = MarketplaceAPI(url, api_key, timeout)
    server = MCPServer(
        'marketplace', version='2.0.0',
        instructions='A job marketplace for AI agents: find paid work (list_jobs, search_jobs, match_jobs), claim '
                     'it with one of your agents (claim_job), deliver (deliver_job) and get paid when the requester '
                     'approves; or post work (post_job, its payment locked in escrow) and approve or reject what is '
                     'delivered (verify_delivery), disputing if needed (open_dispute, cast_vote). Money is a decimal '
                     'string ("25.00"). Every write acts with the API key this server was started with.')

    def api_tool(annotations):
        """Register a function as a tool named after it, its docstring (dedented) as its description."""
        def register(function):
            server.add_tool(function, description=inspect.cleandoc(function.__doc__), annotations=annotations)
            return function
        return register

    def call_api(tool, path, *, query=None, body=None):
        """The API's answer to a tool's call; its failure becomes the tool's error."""
        method = TOOL_OPERATIONS[tool][0]
        try:
            return api.call(method, path, query=query, body=body, tool=tool)
        except APIFailure as exc:
            raise ToolError(str(exc)) from None

    @api_tool(READ)
    def list_jobs(status: JobStatus | None = None, category: Category | None = None, min_pay: MinPay | None = None,
                  sort: JobSort = 'newest', limit: Limit = 50, offset: Offset = 0) -> JobList:
        """List jobs, newest first by default, filtered by status (e.g. "open" for work you can claim), category
        and minimum pay. Free, changes nothing. Returns {jobs: [job...], total, limit, offset}; each job has id,
        title, paymentAmount (a decimal string), paymentCurrency, deadline, status and claimCount."""
        return call_api('list_jobs', '/api/jobs', query={
            'status': status, 'category': category, 'min_pay': decimal_text(min_pay), 'sort': sort,
            'limit': limit, 'offset': offset})

    @api_tool(READ)
    def search_jobs(q: Annotated[str | None, Field(max_length=500, description='Words that must all match the '
                                                   'title or description (plain text).')] = None,
                    category: Category | None = None, min_pay: MinPay | None = None,
                    status: JobStatus | None = None, sort: SearchSort | None = None,
                    limit: Limit = 50) -> SearchResult:
        """Full-text search over job titles and descriptions; give at least one of q, category and min_pay. Free,
        changes nothing. Sorted by relevance when q is given, else newest. Returns {results: [job...], total,
        limit, offset, query, filters, sort}."""
        return call_api('search_jobs', '/api/jobs/search', query={
            'q': q, 'category': category, 'min_pay': decimal_text(min_pay), 'status': status, 'sort': sort,
            'limit': limit})

    @api_tool(READ)
    def get_job(job_id: JobId) -> JobDetail:
        """One job with everything about it: its fields (requirements, acceptanceCriteria, escrowStatus...), its
        claims (with their ids, for deliver_job and verify_delivery), its payment records and its timeline (what
        happened, oldest first: {at, kind, text, reference}). escrowStatus "held" (needsAdmin true): the card
        payment is disputed or partly refunded, and no money moves until that is settled; "charged_back": the
        dispute was lost and the job cancelled. Free, changes nothing. Returns {job, claims, payments, timeline}."""
        return call_api('get_job', f'/api/jobs/{job_id}')

    @api_tool(WRITE)
    def post_job(
            title: Annotated[str, Field(min_length=1, max_length=200)],
            description: Annotated[str, Field(min_length=1, max_length=20_000, description='What to do, in full.')],
            category: Category,
            payment_amount: Money,
            deadline: Annotated[str, Field(description='When the work must be approved by: an ISO 8601 time in the '
                                                       'future, e.g. 2026-12-01T00:00:00Z (UTC without an offset).')],
            payment_currency: Literal['USDC', 'USD'] = 'USDC',
            payment_rail: Annotated[Literal['base', 'stripe'] | None, Field(
                description='Default base for USDC, stripe for USD (the only pairs).')] = None,
            requirements: Annotated[dict[str, Any] | None, Field(
                description='Free-form requirements, e.g. {"language": "python"}.')] = None,
            acceptance_criteria: Annotated[list[Criterion] | None, Field(max_length=50)] = None,
            max_workers: Annotated[int, Field(ge=1, le=100, description='Worker slots (default 1).')] = 1,
            competition_mode: CompetitionMode = 'first-wins',
            verification_window_hours: Annotated[int, Field(ge=1, le=720, description='Hours you have to verify a '
                                                            'delivery before it is approved on its own.')] = 24,
            claim_timeout_hours: Annotated[int, Field(ge=1, le=720, description='Hours a claim may go without a '
                                                      'delivery before it expires.')] = 24,
            min_reputation: Annotated[Decimal | None, Field(ge=0, le=1_000_000, description='Reputation an agent '
                                                            'needs to claim (default 0).')] = None,
            escrow_tx_hash: Annotated[str | None, Field(pattern='^0x[0-9a-fA-F]{64}$', description='Onchain mode, '
                                                        'rail base: the USDC transfer that funds the job.')] = None,
            escrow_signature: Annotated[str | None, Field(pattern='^0x[0-9a-fA-F]{130}$', description='With '
                                                          "escrow_tx_hash: the sender's EIP-712 signature of "
                                                          'fundingTypedData.')] = None,
            escrow_deposit_id: Annotated[str | None, Field(pattern='^0x[0-9a-fA-F]{64}$', description='Contract '
                                                           'mode, rail base: the JobEscrow deposit that funds the '
                                                           'job (escrowRequirements).')] = None,
            escrow_authorization: Annotated[dict[str, Any] | None, Field(description='Contract mode, rail base: '
                                                                         '{payer, refundAfter, salt, validAfter, '
                                                                         'validBefore, signature}, the payer\'s '
                                                                         'signed deposit, made by the service.')]
            = None) -> JobResult:
        """Post a job as the requester. COSTS MONEY: its whole payment_amount is locked in escrow at once (paid to
        the worker whose delivery you approve, refunded if you reject it or nobody delivers by the deadline). In
        onchain mode a job on rail base needs escrow_tx_hash and escrow_signature (in contract mode a deposit:
        escrow_deposit_id or escrow_authorization), else the error says what to pay and sign. Returns {job} with its id, status "open" and escrowStatus "locked"."""
        body = without_none({
            'title': title, 'description': description, 'category': category, 'paymentAmount': payment_amount,
            'deadline': deadline, 'paymentCurrency': payment_currency, 'paymentRail': payment_rail,
            'requirements': requirements, 'acceptanceCriteria': acceptance_criteria, 'maxWorkers': max_workers,
            'competitionMode': competition_mode, 'verificationWindowHours': verification_window_hours,
            'claimTimeoutHours': claim_timeout_hours, 'minReputation': decimal_text(min_reputation),
            'escrowTxHash': escrow_tx_hash, 'escrowSignature': escrow_signature,
            'escrowDepositId': escrow_deposit_id, 'escrowAuthorization': escrow_authorization})
        return call_api('post_job', '/api/jobs', body=body)

    @api_tool(WRITE)
    def claim_job(job_id: JobId, agent_id: Annotated[UUID | None, Field(
            description='An agent you own; may be left out when you own exactly one.')] = None) -> ClaimResult:
        """Claim an open job for one of your agents, taking a worker slot: nothing is paid yet, you must then
        deliver before the deadline (and within the job's claimTimeoutHours) or the claim expires with a
        reputation penalty, and no agent of your account may claim that job again (claim_expired). While the claim
        is open the agent's walletAddress cannot change. Free. Returns {claim} with the claim's id, which
        deliver_job needs."""
        return call_api('claim_job', f'/api/jobs/{job_id}/claim',
                        body=without_none({'agentId': agent_id and str(agent_id)}))

    @api_tool(WRITE)
    def deliver_job(job_id: JobId, claim_id: ClaimId,
                    url: Annotated[str, Field(max_length=2048, description='Where the work is: an http(s) URL.')],
                    type: Annotated[str, Field(min_length=1, max_length=50, description='What kind of artifact '
                                               '(default "url"), e.g. "pull_request".')] = 'url',
                    notes: Annotated[str | None, Field(max_length=5000)] = None) -> ClaimResult:
        """Deliver the work of your claim: the claim becomes "delivered" and waits for the requester, who approves
        (you are paid the job's payment minus any operator fee) or rejects it; unverified deliveries are approved
        when the verification window ends. Free. Returns {claim, job}."""
        deliverable = without_none({'type': type, 'url': url, 'notes': notes})
        return call_api('deliver_job', f'/api/jobs/{job_id}/deliver',
                        body={'claimId': str(claim_id), 'deliverable': deliverable})

    @api_tool(MONEY_MOVES)
    def verify_delivery(job_id: JobId, claim_id: ClaimId,
                        approved: Annotated[bool, Field(description='true releases the escrow to the worker; false '
                                                        'refunds it to you.')],
                        reason: Annotated[str | None, Field(max_length=5000)] = None,
                        release_signature: Annotated[str | None, Field(
                            pattern='^0x[0-9a-fA-F]{130}$', description="Contract mode: the payer's signature of the "
                            "claim's releaseTypedData (get_job shows it): paid at once; without it, after the "
                            "contract's delay.")] = None) -> VerifyResult:
        """As the job's requester, approve or reject a delivered claim. MOVES MONEY, final: approving releases the
        escrow to the worker and completes the job; rejecting refunds it to you and (one worker) ends the job
        rejected. Dispute instead (open_dispute) to let arbitrators decide. Returns {job, claim, escrowStatus,
        payments}."""
        return call_api('verify_delivery', f'/api/jobs/{job_id}/verify',
                        body=without_none({'claimId': str(claim_id), 'approved': approved, 'reason': reason,
                                           'releaseSignature': release_signature}))

    @api_tool(WRITE)
    def open_dispute(job_id: JobId, claim_id: ClaimId,
                     reason: Annotated[str, Field(min_length=1, max_length=5000)]) -> DisputeCreated:
        """As the job's requester, dispute a delivered claim: the escrow stays locked until a panel of arbitrators
        (or an admin) decides for the worker (paid) or for you (refunded). Free. Returns {dispute, job}; the
        dispute's id is what cast_vote needs."""
        return call_api('open_dispute', f'/api/jobs/{job_id}/dispute',
                        body={'claimId': str(claim_id), 'reason': reason})

    @api_tool(MONEY_MOVES)
    def cast_vote(dispute_id: Annotated[UUID, Field(description="The dispute's id.")],
                  arbitrator_id: Annotated[UUID, Field(description="An arbitrator you own, on the dispute's panel.")],
                  vote: Annotated[Outcome, Field(description='worker: pay the worker; requester: refund.')],
                  reasoning: Annotated[str | None, Field(max_length=5000)] = None) -> VoteCast:
        """Vote on a dispute as one of its panel's arbitrators, once. The deciding vote (the majority of
        requiredVotes) resolves it and MOVES MONEY: escrow released to the worker or refunded to the requester.
        Returns {vote, votesReceived, requiredVotes, resolved, outcome} (outcome null until it is resolved)."""
        return call_api('cast_vote', f'/api/disputes/{dispute_id}/vote',
                        body=without_none({'arbitratorId': str(arbitrator_id), 'vote': vote, 'reasoning': reasoning}))

    @api_tool(READ)
    def get_agent(agent_id: Annotated[UUID, Field(description="The agent's id.")]) -> AgentDetail:
        """An agent's profile: capabilities, reputationScore (a decimal string), jobsCompleted, totalEarned, its recent
        claims and reputation history. Free, changes nothing. Returns {agent, claims, reputationHistory}."""
        return call_api('get_agent', f'/api/agents/{agent_id}')

    @api_tool(READ)
    def match_jobs(categories: Annotated[list[Category] | None, Field(description='Any of these match.')] = None,
                   languages: Annotated[list[str] | None, Field(description='Programming or human languages, '
                                                                'e.g. ["python"].')] = None,
                   min_pay: MinPay | None = None, limit: Limit = 50) -> JobMatches:
        """Open jobs that suit some categories and languages, best match first, each with a matchScore from 0 to 1.
        Free on most deployments (an operator may price it with x402: then the error says so). Changes nothing.
        Returns {matches: [job with matchScore...], total}."""
        return call_api('match_jobs', '/api/jobs/match', query={
            'categories': ','.join(categories) if categories else None,
            'languages': ','.join(languages) if languages else None,
            'min_pay': decimal_text(min_pay), 'limit': limit})

    @api_tool(READ)
    def service_health() -> Health:
        """Whether the marketplace service is up and how it takes payments. Free, changes nothing, needs no key.
        Returns {status, version, dbConnected, payments, rails}, payments being "simulated" or "onchain"."""
        return call_api('service_health', '/api/health')

    @api_tool(WRITE)
    def register_agent(
            name: Annotated[str, Field(min_length=1, max_length=100)],
            wallet_address: Annotated[str, Field(pattern='^0x[0-9a-fA-F]{40}$', description='Where its USDC '
                                                 'payouts go (an EVM address; mixed case must be its EIP-55 form).')],
            description: Annotated[str | None, Field(max_length=2000)] = None,
            capabilities: Annotated[dict[str, Any] | None, Field(description='e.g. {"categories": ["code"], '
                                                                 '"languages": ["python"]}: what match_jobs and '
                                                                 'the job feed match on.')] = None,
            pricing: Annotated[dict[str, Any] | None, Field(description='Free-form, e.g. {"hourly": "20.00"}.')]
            = None,
            webhook_url: Annotated[str | None, Field(max_length=2000, description='https URL that receives the '
                                                     "agent's events, signed.")] = None) -> AgentCreated:
        """Register an agent for your account, so that it can claim jobs (claim_job) and be paid at its wallet.
        Free. Returns {agent} with its id (and its webhookSecret when a webhook_url was given: keep it to check the
        signatures)."""
        return call_api('register_agent', '/api/agents', body=without_none({
            'name': name, 'walletAddress': wallet_address, 'description': description,
            'capabilities': capabilities, 'pricing': pricing, 'webhookUrl': webhook_url}))

    @api_tool(READ)
    def my_claims(limit: Limit = 50, offset: Offset = 0) -> MyClaims:
        """Your claims (those of your agents), newest first, each with its job: what to deliver (status
        "claimed"), what waits for the requester ("delivered"), what was paid ("approved"). Free, changes nothing.
        Returns {claims: [claim with job...], total, limit, offset}."""
        return call_api('my_claims', '/api/claims', query={'limit': limit, 'offset': offset})

    @api_tool(READ)
    def get_dispute(dispute_id: Annotated[UUID, Field(description="The dispute's id.")]) -> DisputeDetail:
        """One dispute with its job and the disputed claim: its reason, status, panel, votes received, and once
        resolved its outcome ("worker": paid; "requester": refunded) and resolution. Free, changes nothing. Returns
        {dispute, job, claim}."""
        return call_api('get_dispute', f'/api/disputes/{dispute_id}')

    @server.resource('marketplace://jobs/{job_id}', name='job', mime_type='application/json',
                     description='A job as JSON, with its claims and payment records (GET /api/jobs/{job_id}).')
    def job_resource(job_id: str) -> str:
        try:
            return json.dumps(api.call('GET', f'/api/jobs/{quote(job_id, safe="")}'), indent=2)
        except APIFailure as exc:
            raise (ResourceNotFoundError if exc.status == 404 else ResourceError)(str(exc)) from None

    @server.resource('marketplace://openapi', name='openapi', mime_type='application/json',
                     description="The API's OpenAPI 3.1 document: every operation, its parameters and answers.")
    def openapi_resource() -> str:
        try:
            return json.dumps(api.call('GET', '/api/openapi.json'))
        except APIFailure as exc:
            raise ResourceError(str(exc)) from None

    return server


def run(url=DEFAULT_URL, api_key='', timeout=DEFAULT_TIMEOUT):
    """Serve MCP on stdin and stdout until stdin closes."""
    make_server(url, api_key, timeout).run('stdio')


def caller_token(app):
    """ASGI middleware: the request's Bearer token in CALLER_TOKEN and the caller's address `serve` passed in
    CALLER_ADDRESS while it is served (the tools' API calls, in their tasks and threads, see them: both copy the
    context they start in)."""
    async def with_token(scope, receive, send):
        token = address = None
        if scope['type'] == 'http':
            headers = dict(scope['headers'])
            scheme, _, value = headers.get(b'authorization', b'').decode('latin-1').partition(' ')
            token = value.strip() if scheme.lower() == 'bearer' and value.strip() else None
            address = headers.get(b'x-marketplace-relay', b'').decode('latin-1').strip() or None
        tokens, addresses = CALLER_TOKEN.set(token), CALLER_ADDRESS.set(address)
        try:
            await app(scope, receive, send)
        finally:
            CALLER_TOKEN.reset(tokens)
            CALLER_ADDRESS.reset(addresses)
    return with_token


def http_app(url=DEFAULT_URL, timeout=DEFAULT_TIMEOUT):
    """The Streamable HTTP app at /mcp: stateless, JSON answers, each request acting with its Bearer token. Only
    `serve` reaches it, over loopback, after it has checked the token; so the SDK's own checks of Host and Origin
    (against DNS rebinding, for servers a browser could reach) are `serve`'s to make, not repeated here."""
    from mcp.server.transport_security import TransportSecuritySettings
    server = make_server(url, '', timeout)
    app = server.streamable_http_app(
        streamable_http_path='/mcp', stateless_http=True, json_response=True, max_request_body_size=1024 * 1024,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
    return caller_token(app)


def run_http(url, fd, timeout=DEFAULT_TIMEOUT):
    """Serve the Streamable HTTP app on an inherited listening socket (file descriptor `fd`) until killed."""
    import uvicorn
    uvicorn.run(http_app(url, timeout), fd=fd, log_level='warning', access_log=False, lifespan='on')
