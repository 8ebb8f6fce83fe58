"""Discovery documents: the RSS and Atom feed of open jobs, and the A2A agent cards.

It owns the XML of the feed (what XML 1.0 can carry, excerpts, the jobs' terms) and the cards, the service's at
/.well-known/agent-card.json (cached, with an ETag) and each agent's, with the x402 extension when calls are priced.
"""

import functools
import hashlib
import json
import re
from decimal import Decimal
from email.utils import format_datetime
from xml.etree.ElementTree import Element, SubElement, tostring

from bottle import request, response

from marketplace import (DECIMALS, JOB_SELECT, JOB_SORTS, __version__, agent_json, answer_holds_until, cacheable,
                         etag_matches, format_cents, get_agent, job_json, now_iso, parse_time, parse_uuid, query_choice,
                         route, service)


X402_EXTENSION = 'https://github.com/google-a2a/a2a-x402/v0.1'


FEED_SIZE = 50
FEED_TYPES = {'rss': 'application/rss+xml; charset=utf-8', 'atom': 'application/atom+xml; charset=utf-8'}
ATOM_NS = 'http://www.w3.org/2005/Atom'
EXCERPT_CHARS = 280
# Characters XML 1.0 cannot carry at all, not even escaped: C0 controls but tab and newlines,
# lone surrogates, U+FFFE and U+FFFF.
_NOT_XML = re.compile('[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]')


def xml_text(text):
    """Text with the characters XML 1.0 forbids taken out."""
    return _NOT_XML.sub('', text)


def excerpt(text, size=EXCERPT_CHARS):
    """The start of a text on one line, cut at a word with an ellipsis when longer than `size`."""
    line = ' '.join(xml_text(text).split())
    if len(line) <= size:
        return line
    return line[:size].rsplit(' ', 1)[0].rstrip(' ,.;:') + '…'


def feed_jobs(db):
    """The newest open jobs that can still be claimed, newest first."""
    # `+`: the deadline is only a filter, so that SQLite reads open jobs newest first from jobs_status and stops
    # at FEED_SIZE instead of sorting every open job from jobs_status_deadline
    return db.rows(f'''{JOB_SELECT} WHERE j.status = 'open' AND +j.deadline > :now
                       ORDER BY {JOB_SORTS['newest']} LIMIT :limit''', {'now': now_iso(), 'limit': FEED_SIZE})


def job_terms(job):
    """One line of what a job pays, its category and its deadline."""
    return f'{job["paymentAmount"]} {job["paymentCurrency"]} · {job["category"]} · deadline {job["deadline"]}'


def jobs_feed(jobs, base_url, form):
    """The jobs (as job_json shows them) as an RSS 2.0 or Atom document, in UTF-8 bytes."""

    def add(parent, tag, text=None, **attributes):
        child = SubElement(parent, tag, attributes)
        child.text = text
        return child

    def rfc822(moment):
        return format_datetime(parse_time(moment), usegmt=True)

    title, about = 'Job Marketplace: open jobs', 'The newest open jobs on the marketplace, paid in escrow.'
    self_url = f'{base_url}/api/jobs/feed' + ('?format=atom' if form == 'atom' else '')
    updated = max((job['updatedAt'] for job in jobs), default=now_iso())
    if form == 'atom':
        feed = Element('feed', xmlns=ATOM_NS)
        add(feed, 'id', f'{base_url}/api/jobs/feed')
        add(feed, 'title', title)
        add(feed, 'subtitle', about)
        add(feed, 'link', rel='alternate', type='text/html', href=base_url)
        add(feed, 'link', rel='self', type='application/atom+xml', href=self_url)
        add(feed, 'updated', updated)
        add(add(feed, 'author'), 'name', 'Job Marketplace')
        add(feed, 'generator', 'marketplace.py', version=__version__)
        for job in jobs:
            entry = add(feed, 'entry')
            add(entry, 'id', f'urn:uuid:{job["id"]}')
            add(entry, 'title', xml_text(job['title']), type='text')
            add(entry, 'link', rel='alternate', href=job['url'])
            add(entry, 'category', term=job['category'])
            add(entry, 'published', job['createdAt'])
            add(entry, 'updated', job['updatedAt'])
            add(entry, 'summary', f'{job_terms(job)}\n\n{excerpt(job["description"])}', type='text')
    else:
        feed = Element('rss', {'version': '2.0', 'xmlns:atom': ATOM_NS})
        channel = add(feed, 'channel')
        add(channel, 'title', title)
        add(channel, 'link', base_url)
        add(channel, 'description', about)
        add(channel, 'atom:link', rel='self', type='application/rss+xml', href=self_url)
        add(channel, 'lastBuildDate', rfc822(updated))
        add(channel, 'generator', f'marketplace.py {__version__}')
        for job in jobs:
            item = add(channel, 'item')
            add(item, 'title', xml_text(job['title']))
            add(item, 'link', job['url'])
            add(item, 'guid', f'urn:uuid:{job["id"]}', isPermaLink='false')
            add(item, 'category', job['category'])
            add(item, 'pubDate', rfc822(job['createdAt']))
            add(item, 'atom:updated', job['updatedAt'])
            # RSS readers take a description as HTML: build it as HTML, which the XML then escapes.
            summary = Element('div')
            add(summary, 'p', job_terms(job))
            add(summary, 'p', excerpt(job['description']))
            add(item, 'description', tostring(summary, encoding='unicode', method='html'))
    return tostring(feed, encoding='utf-8', xml_declaration=True)


@route('GET', '/api/jobs/feed')
def get_feed():
    form = query_choice(request.query, 'format', tuple(FEED_TYPES), 'rss')
    svc = service()
    base = svc.settings.base_url
    jobs = feed_jobs(svc.db)
    if jobs:        # the first of them to reach its deadline leaves the feed (and the next one may come in)
        answer_holds_until(min(job['deadline'] for job in jobs))
    body = jobs_feed([job_json(job, base) for job in jobs], base, form)
    response.content_type = FEED_TYPES[form]
    return body


def agent_card(agent, base_url):
    """An agent's A2A-style card: who it is, what it takes on, its record and how it is paid."""
    shown = agent_json(agent)
    capabilities, pricing = shown['capabilities'], shown['pricing']
    languages = capabilities.get('languages') or []
    skills = [{'id': category, 'name': f'{category.capitalize()} jobs',
               'description': f'Takes {category} jobs' + (f' in {", ".join(languages)}.' if languages else '.'),
               'tags': [category, *languages]}
              for category in capabilities.get('categories') or []]
    minimum = Decimal(str(pricing.get('minimumJobValue') or 0)) * 100
    return {
        'name': shown['name'],
        'description': shown['description'] or f'{shown["name"]}, an agent that takes paid jobs on the marketplace.',
        'url': f'{base_url}/api/agents/{shown["id"]}/card',
        'version': shown['updatedAt'],
        'capabilities': capabilities,
        'defaultInputModes': ['application/json'],
        'defaultOutputModes': ['application/json'],
        'skills': skills,
        'reputation': {'score': shown['reputationScore'], 'completionRate': shown['completionRate'],
                       'jobsCompleted': shown['jobsCompleted']},
        'payment': {'walletAddress': shown['walletAddress'],
                    'acceptedCurrencies': pricing.get('acceptedCurrencies') or list(DECIMALS),
                    'minimumJobValue': format_cents(int(minimum.to_integral_value(rounding='ROUND_CEILING')))},
    }


@route('GET', '/api/agents/<agent_id>/card', limit=None)
def show_agent_card(agent_id):
    svc = service()
    return cacheable(agent_card(get_agent(svc.db, parse_uuid(agent_id, 'agentId')), svc.settings.base_url), 60)


# The card's skills, which A2A's POST /message:send runs (a2a_binding.py), are the MCP tools with the same input
# (tests/test_a2a.py checks the names against mcp_server.TOOL_OPERATIONS: the mcp SDK is never loaded by `serve`,
# so they are listed here): id -> (name, what it does, tags).
SKILLS = {
    'list_jobs': ('List jobs', 'List jobs, filtered by status (e.g. open), category and minimum pay.', ['jobs']),
    'search_jobs': ('Search jobs', 'Full-text search over job titles and descriptions.', ['jobs', 'search']),
    'get_job': ('Get a job', 'One job with its claims, payments and timeline.', ['jobs']),
    'post_job': ('Post a job', 'Post a paid job; its payment is locked in escrow until the work is approved, '
                               'rejected or the deadline passes.', ['jobs', 'escrow', 'payments']),
    'claim_job': ('Claim a job', 'Claim an open job for one of your agents.', ['claim']),
    'deliver_job': ('Deliver work', 'Deliver the result of a claim (a URL and notes).', ['deliver']),
    'verify_delivery': ('Verify a delivery', 'Approve a delivery (the worker is paid) or reject it (refunded).',
                        ['payments', 'escrow']),
    'open_dispute': ('Open a dispute', 'Dispute a delivery: arbitrators decide who is paid.', ['disputes']),
    'cast_vote': ('Vote on a dispute', 'Vote on a dispute as one of its panel\'s arbitrators.', ['disputes']),
    'get_agent': ('Get an agent', "An agent's profile, reputation and recent claims.", ['agents']),
    'match_jobs': ('Match jobs', 'Open jobs that suit some categories and languages, best first.', ['match']),
    'service_health': ('Service health', 'Whether the service is up and how it takes payments.', ['health']),
    'register_agent': ('Register an agent', 'Register an agent (and its wallet) for your account.', ['agents']),
    'my_claims': ('My claims', 'Your claims, newest first, each with its job.', ['claim']),
    'get_dispute': ('Get a dispute', 'One dispute with its job, claim, votes and outcome.', ['disputes']),
}


def service_card(base_url, x402=None):
    """The service's own A2A v1.0.0 agent card; with x402 terms (X402.card_terms), it advertises pay-per-call."""
    card = {
        'name': 'Job Marketplace',
        'description': 'A job marketplace for AI agents: post paid jobs held in escrow, find and claim work, '
                       'deliver it and get paid; disputes are settled by arbitrators. Reads need no key; '
                       'writes need an API key as a Bearer token. Each skill is run by POST /message:send; new jobs '
                       'also come by the RSS/Atom feed (GET /api/jobs/feed) and the live stream (GET '
                       '/api/jobs/stream), and the same tools are served over MCP at /mcp.',
        'version': __version__,
        'supportedInterfaces': [{'url': base_url, 'protocolBinding': 'HTTP+JSON', 'protocolVersion': '1.0'}],
        'provider': {'organization': 'Job Marketplace', 'url': base_url},
        'capabilities': {'streaming': True, 'pushNotifications': True},
        'defaultInputModes': ['application/json'],
        'defaultOutputModes': ['application/json'],
        # Each skill runs through POST /message:send: a data part {"skill": <id>, "input": {...}}, the input as the
        # MCP tool of the same name takes it (GET /api/openapi.json and /mcp's tools/list describe them).
        'skills': [{'id': skill, 'name': name, 'description': description, 'tags': tags,
                    'examples': [f'{{"skill": "{skill}", "input": {{...}}}}']}
                   for skill, (name, description, tags) in SKILLS.items()],
        'securitySchemes': {'bearerAuth': {'httpAuthSecurityScheme': {
            'scheme': 'Bearer', 'description': 'An API key, or an OAuth access token (authorization server: '
                                               f'{base_url}/.well-known/oauth-authorization-server). Needed for '
                                               'messages and to write; reads of the API are public.'}},
                            'oauth': {'oauth2SecurityScheme': {
                                'description': 'OAuth 2.1 for hosts that sign a person in (PKCE S256, public '
                                               'clients registered at /oauth/register): its access token is a '
                                               'Bearer token.',
                                'oauth2MetadataUrl': f'{base_url}/.well-known/oauth-authorization-server',
                                'flows': {'authorizationCode': {
                                    'authorizationUrl': f'{base_url}/oauth/authorize',
                                    'tokenUrl': f'{base_url}/oauth/token', 'refreshUrl': f'{base_url}/oauth/token',
                                    'scopes': {'marketplace': 'Act as the approving account, as its API key '
                                                              'does (the only scope: it may be left out).'},
                                    'pkceRequired': True}}}}},
        'securityRequirements': [{'schemes': {'bearerAuth': {'list': []}}}, {'schemes': {'oauth': {'list': []}}}],
        'documentationUrl': f'{base_url}/api/openapi.json',
        # For A2A clients older than 1.0, which read these instead of supportedInterfaces.
        'url': base_url,
        'protocolVersion': '1.0',
    }
    if x402:
        network, network_v2, chain_id, asset, pay_to, endpoints = x402
        card['description'] += ' Some endpoints are paid per call in USDC with x402, with or without a key.'
        card['capabilities']['extensions'] = [{
            'uri': X402_EXTENSION, 'required': False,
            'description': f'x402 (versions 1 and 2) pay-per-call in USDC on {network} ({network_v2}): '
                           f'{", ".join(endpoints)}. {base_url}/api/x402 lists the prices; pay with an X-PAYMENT '
                           '(v1) or PAYMENT-SIGNATURE (v2) header.',
            'params': {'x402Versions': [1, 2], 'scheme': 'exact', 'network': network, 'networkV2': network_v2,
                       'chainId': chain_id, 'asset': asset, 'payTo': pay_to, 'endpoints': list(endpoints),
                       'pricing': f'{base_url}/api/x402'}}]
    return card


@functools.lru_cache(maxsize=8)
def cached_service_card(base_url, x402=None):
    """The service card and its strong ETag (a hash of its JSON), built once per base URL and x402 terms."""
    card = service_card(base_url, x402)
    digest = hashlib.sha256(json.dumps(card, sort_keys=True).encode('utf-8')).hexdigest()
    return card, f'"{digest[:32]}"'


@route('GET', '/.well-known/agent-card.json', limit=None)
@route('GET', '/.well-known/agent.json', limit=None)
def show_service_card():
    svc = service()
    card, etag = cached_service_card(svc.settings.base_url, svc.x402 and svc.x402.card_terms())
    response.set_header('Cache-Control', 'public, max-age=60')
    response.set_header('ETag', etag)
    if etag_matches(request.headers.get('If-None-Match', ''), etag):
        response.status = 304
        return b''
    return card
