#!/usr/bin/env python3
"""A job marketplace for AI agents: paid jobs with escrow, claims, deliveries and payouts.

Run it:
    python marketplace.py serve [--host 127.0.0.1] [--port 8080] [--db marketplace.db]
    python marketplace.py seed                       # demo accounts, agents and jobs
    python marketplace.py keys create --name NAME [--admin]
    python marketplace.py keys list | keys revoke KEY_ID
    python marketplace.py sweep                      # expire overdue jobs, auto-approve deliveries
    python marketplace.py backup PATH                # online SQLite backup
    python marketplace.py restore --replica-url URL --db PATH [--timestamp ISO]   # from Litestream's replica
    python marketplace.py check-ledger               # does every job's money add up?
    python marketplace.py mcp [--url URL] [--api-key KEY]   # an MCP server on stdio for agents, over the API

Every setting is a --flag and a MARKETPLACE_<NAME> environment variable; see SETTINGS below
or `python marketplace.py serve --help`.

This file holds the marketplace's rules, its API routes and the app. The faces that speak other vocabularies (pages,
the OpenAPI document, the HTTP layer, x402, webhook delivery, the feed and cards, MCP, and the command line with the
running server around the app) are modules of their own that import these rules; wiring.py hands them to the app (docs/development.md).
"""

__version__ = '2.0.0'

import sys

if __name__ == '__main__' and sys.argv[1:2] == ['serve']:
    # Only to serve: tests import this module unpatched, the other commands need no greenlets, and `mcp` runs the
    # MCP SDK on asyncio and threads, which gevent's patches would break.
    from gevent import monkey
    monkey.patch_all()

import argparse
import base64
import functools
import hashlib
import hmac
import io
import ipaddress
import itertools
import json
import logging
import math
import os
import re
import secrets
import threading
import time
import unicodedata
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from decimal import ROUND_DOWN, Decimal, InvalidOperation
from pathlib import Path
from urllib.parse import quote

import apsw
import bottle
import gevent.queue
import orjson
from bottle import request, response

import metrics
import replication
from database import SCHEMA_SQL, SCHEMA_VERSION, Database, ReplicaDatabase, schema_version  # noqa: F401 (tests)
from errors import (APIError, BadRequest, BodyAborted, BodyTimedOut, BodyTooLarge, CommitFailed,  # noqa: F401 (faces)
                    Conflict, Forbidden, InvalidJSON, InvalidUUID, MethodNotAllowed, NotFound, RateLimited,
                    ReadOnlyReplica, ReplicaLagging, Unauthorized, Unavailable, UnsupportedMediaType, ValidationFailed,
                    STATUS_CODES, allow_header, payment_error)
from host_guard import IPV4_IN_LAST_32, LOCAL_NAT64, webhook_url_problem
from read_cache import ReadCache
from verifier.addresses import address_problem
from verifier.errors import ChainUnavailable, FeeTooLow, VerificationError
from verifier.redact import url_secrets

HERE = Path(__file__).resolve().parent
log = logging.getLogger('marketplace')


###############################################################################
# Settings ####################################################################
###############################################################################

def parse_bool(text):
    """Read a boolean from an environment variable."""
    value = str(text).strip().lower()
    if value in ('1', 'true', 'yes', 'on'):
        return True
    if value in ('0', 'false', 'no', 'off'):
        return False
    raise ValueError(f'expected true or false, got {text!r}')


def parse_choice(*choices):
    """A parser of one of these words (case and surrounding blanks ignored)."""
    def parse(text):
        value = str(text).strip().lower()
        if value not in choices:
            raise ValueError(f'expected {" or ".join(choices)}, got {text!r}')
        return value
    return parse


def parse_percent(text):
    """Read a percentage between 0 and 100 with at most two decimal places."""
    try:
        value = Decimal(str(text))
    except InvalidOperation:
        raise ValueError(f'expected a percentage such as 2.5, got {text!r}') from None
    if not value.is_finite() or not 0 <= value <= 100 or value != value.quantize(Decimal('0.01')):
        raise ValueError(f'expected a percentage from 0 to 100 with at most two decimals, got {text!r}')
    return value


def parse_odd(text):
    """Read a positive odd whole number (a vote count that cannot tie)."""
    value = int(text)
    if value < 1 or value % 2 == 0:
        raise ValueError(f'expected a positive odd number, got {text!r}')
    return value


def parse_range(low, high):
    """Make a reader of whole numbers from low to high."""
    def read(text):
        value = int(text)
        if not low <= value <= high:
            raise ValueError(f'expected a whole number from {low} to {high}, got {text!r}')
        return value
    read.__name__ = 'int'
    return read


def parse_positive(kind):
    """Make a reader of positive numbers of one kind (int or float)."""
    def read(text):
        value = kind(text)
        if value <= 0:
            raise ValueError(f'expected a positive number, got {text!r}')
        return value
    read.__name__ = kind.__name__
    return read


def parse_dns_server(text):
    """A DNS server as IP or IP:PORT ([IPv6]:PORT), normalised; '' is the system's (/etc/resolv.conf)."""
    text = str(text).strip()
    if not text:
        return ''
    found = re.fullmatch(r'\[([0-9A-Fa-f:.]+)\](?::(\d{1,5}))?|([0-9.]+)(?::(\d{1,5}))?|([0-9A-Fa-f:]+)', text)
    try:
        address = ipaddress.ip_address(found[1] or found[3] or found[5])
        port = int(found[2] or found[4] or 53)
    except (TypeError, ValueError):
        raise ValueError(f'expected an IP address, IP:PORT or [IPv6]:PORT, got {text!r}') from None
    if not 0 < port < 65536:
        raise ValueError(f'expected a port from 1 to 65535, got {port}')
    return f'[{address}]:{port}' if address.version == 6 else f'{address}:{port}'


@dataclass(frozen=True)
class Price:
    """An endpoint priced for x402: METHOD and its route (as in ROUTES), and what a call costs in USDC base units."""

    method: str
    rule: str
    amount: int

    @property
    def endpoint(self):
        return f'{self.method} {openapi_path(self.rule)}'

    @property
    def usdc(self):
        """The price as a decimal USDC amount: '0.01'."""
        return f'{self.amount // 10**6}.{self.amount % 10**6:06d}'.rstrip('0').rstrip('.')


def parse_prices(entries):
    """x402 prices: 'METHOD PATH=PRICE' entries (a list, or one string with entries separated by ';' or new
    lines), PATH a route of the service (/api/jobs/:id, /api/jobs/{id} or /api/jobs/<job_id>), PRICE in USDC.
    A price covers the operation, not one path: one Price per route of it (its aliases too); a later entry wins."""
    if isinstance(entries, str):
        entries = re.split(r'[;\n]', entries)
    prices = {}
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        endpoint, _, amount = entry.rpartition('=')
        found = _PRICE_AMOUNT.fullmatch(amount.strip())
        units = int(found[1] + (found[2] or '').ljust(6, '0')) if found else 0
        if units == 0:
            raise ValueError(f'{entry!r}: expected METHOD PATH=PRICE with a price in USDC above 0 and at most '
                             '6 decimal places, e.g. "GET /api/jobs/match=0.01"')
        method, rule = route_of(endpoint)
        if rule is None:
            raise ValueError(f'{entry!r}: the service has no endpoint {endpoint.strip()}')
        if rule == '/api/x402':
            raise ValueError(f'{entry!r}: /api/x402 tells callers how to pay; it cannot be priced')
        for alias in operation_routes(method, rule):
            prices[alias] = Price(*alias, units)
    return tuple(prices.values())


def operation_routes(method, rule):
    """The routes of the operation METHOD rule names: its own first, then its aliases (routes sharing its handler,
    as /api/jobs/<job_id>/submit shares deliver's)."""
    handler = next(handler for m, r, handler, _ in ROUTES if (m, r) == (method, rule))
    return [(method, rule)] + [(m, r) for m, r, h, _ in ROUTES if h is handler and (m, r) != (method, rule)]


def route_of(endpoint):
    """(METHOD, route) of 'METHOD PATH', PATH concrete (/api/jobs/3f…) or a template (/api/jobs/:id, {id},
    <job_id>); (METHOD, None) if the service has no such endpoint. A fixed path wins over a template."""
    method, _, path = endpoint.strip().partition(' ')
    method, path = method.upper(), path.strip()
    rules = sorted((rule for m, rule, _, _ in ROUTES if m == method), key=lambda rule: '<' in rule)
    return method, next((rule for rule in rules
                         if re.fullmatch(re.sub(r'<\w+>', '[^/]+', re.escape(rule)), path)), None)


_PRICE_AMOUNT = re.compile(r'([0-9]{1,6})(?:\.([0-9]{1,6}))?')


@dataclass(frozen=True)
class Setting:
    name: str
    default: object
    type: object
    help: str
    many: bool = False      # the flag may be given more than once; the env var separates entries with ';'

    @property
    def flag(self):
        return '--' + self.name.replace('_', '-')

    @property
    def env(self):
        return 'MARKETPLACE_' + self.name.upper()


SETTINGS = [
    Setting('host', '127.0.0.1', str, 'address to listen on'),
    Setting('port', 8080, int, 'port to listen on'),
    Setting('db', 'marketplace.db', str, 'path of the SQLite database file (the whole state)'),
    Setting('public_url', '', str,
            'base of the absolute URLs in responses (default http://HOST:PORT)'),
    Setting('site_name', 'Job Marketplace', str, "the site's name on its pages (their titles and header)"),
    Setting('admin_key', '', str,
            'an API key (32+ characters) made an admin key at start-up; best given as the env var'),
    Setting('fee_percent', Decimal('0'), parse_percent,
            "operator fee taken from each release, in percent (e.g. 2.5)"),
    Setting('open_registration', True, parse_bool,
            'allow POST /api/accounts and POST /api/agents/register without a key'),
    Setting('rate_limits', 'on', parse_choice('on', 'off'), 'rate limits per endpoint, per address or key: on or off'),
    Setting('rate_limit_scale', 1.0, parse_positive(float),
            'multiply every rate limit by this (e.g. 10 for a busy private deployment)'),
    Setting('keyed_rate_scale', 10.0, parse_positive(float),
            'a caller with a key (or OAuth token) is counted per key, at this many times the limits'),
    Setting('read_cache_mb', 64, parse_range(0, 65536),
            'memory for answers of repeated reads (lists, searches, jobs, agents, the feed), in MB; 0: none'),
    Setting('max_agents_per_account', 20, parse_positive(int),
            'agents one account may register (admins too); one more is 409 too_many_agents'),
    Setting('trust_proxy', False, parse_bool,
            'take the client IP from the last X-Forwarded-For entry (only behind your own proxy)'),
    Setting('log_format', 'text', parse_choice('text', 'json'),
            'log lines: text, or json (one object per line: each request with its route, status, duration, client '
            'and request id)'),
    Setting('shutdown_timeout', 10.0, parse_positive(float),
            'seconds SIGTERM waits for requests in flight before closing them'),
    Setting('header_timeout', 10.0, parse_positive(float),
            'seconds the request line and all headers of a request may take to arrive, in all'),
    Setting('body_timeout', 30.0, parse_positive(float),
            'seconds a request body may take to arrive in full, from the end of its headers; later is 408'),
    Setting('keepalive_timeout', 75.0, parse_positive(float),
            'seconds a kept-alive connection may wait idle for its next request'),
    Setting('max_connections_per_ip', 64, parse_positive(int),
            'open connections from one client address (IPv6: one /64); more are closed at once'),
    Setting('max_connections', 4096, parse_positive(int), 'open connections in all; more are closed at once'),
    Setting('max_requests_per_client', 64, parse_positive(int),
            'with --trust-proxy: requests in flight at once from one client (its X-Forwarded-For address; IPv6: one '
            '/64); more are answered 503'),
    Setting('sweep_interval', 60.0, parse_positive(float),
            'seconds between the automatic expire and auto-verify sweeps (the first runs one interval after start)'),
    Setting('required_votes', 3, parse_odd, 'arbitrator votes that decide a dispute (odd)'),
    Setting('stream_heartbeat', 30.0, parse_positive(float),
            'seconds between heartbeat events on an idle /api/jobs/stream'),
    Setting('stream_max_seconds', 600.0, parse_positive(float),
            'seconds a /api/jobs/stream stays open before its timeout event'),
    Setting('webhook_retry_base', 60.0, parse_positive(float),
            'seconds before the first webhook retry; each next wait is 3 times longer (8 attempts, ~18 h)'),
    Setting('webhook_timeout', 10.0, parse_positive(float), 'seconds one webhook attempt may take'),
    Setting('webhook_concurrency', 200, parse_positive(int),
            'webhook deliveries in flight at once (at most 4 per agent, 8 per account, half to failing receivers)'),
    Setting('allow_private_webhooks', False, parse_bool,
            'allow webhook URLs on loopback and private networks (tests and local demos only)'),
    Setting('dns_server', '', parse_dns_server,
            'the DNS server webhook host names are looked up at, IP or IP:PORT (default: the system\'s); a lookup '
            'may take 2 s'),
    Setting('rpc_url', '', str, 'JSON-RPC URL of a Base node: turns on onchain payments for rail base'),
    Setting('chain_id', 8453, parse_positive(int), 'chain id the node must report (8453 Base, 84532 Base Sepolia)'),
    Setting('usdc_address', '', str, 'the USDC contract (default: the USDC of --chain-id)'),
    Setting('escrow_key', '', str,
            'hex private key of the escrow wallet (payTo is its address); best given as the env var'),
    Setting('deployer_key', '', str,
            'hex private key `escrow deploy` signs with (else --escrow-key); best given as the env var'),
    Setting('escrow_contract', '', str,
            'the JobEscrow contract that holds each job\'s USDC (contract mode); its arbiter must be '
            'the --escrow-key'),
    Setting('confirmations', 2, parse_positive(int), 'blocks deep a payment must be (its own block counts as one)'),
    Setting('payout_rebroadcast_minutes', 10.0, parse_positive(float),
            'minutes a signed payout or x402 settlement may sit unmined before it is re-signed, '
            'same nonce, higher fee'),
    Setting('payout_max_fee_gwei', 50.0, parse_positive(float),
            'the most a re-priced payout may offer per gas (max fee per gas, in gwei)'),
    Setting('payment_max_age', 86400.0, parse_positive(float), 'seconds after which a payment is too old to use'),
    Setting('x402_price', (), parse_prices,
            'price an operation for x402: every caller pays but admins and exempt accounts, "METHOD PATH=USDC" '
            '(repeatable; needs --rpc-url and --x402-pay-to)',
            many=True),
    Setting('facilitator_url', '', str,
            'an x402 facilitator (its /verify and /settle) to settle authorizations instead of the escrow wallet'),
    Setting('x402_pay_to', '', str,
            'the address x402 payments go to (required with --x402-price; never the escrow address)'),
    Setting('allow_simulated_rails', False, parse_bool,
            'accept jobs on a simulated rail while another rail moves real money (demos only)'),
    Setting('open_arbitration', False, parse_bool,
            'arbitrators are active at registration, without an admin (demos and the seed only)'),
    Setting('dispute_timeout_hours', 168, parse_positive(int),
            'hours after which an open dispute shows needsAdmin: true'),
    Setting('stripe_secret_key', '', str,
            'a Stripe secret key: turns the stripe rail (USD) from simulated to real; best given as the env var'),
    Setting('stripe_webhook_secret', '', str, 'the signing secret (whsec_...) of the Stripe webhook endpoint'),
    Setting('stripe_connect_webhook_secret', '', str,
            "the signing secret (whsec_...) of the Stripe endpoint for connected accounts' events (account.updated)"),
    Setting('stripe_api_base', 'https://api.stripe.com', str, 'where the Stripe API is (tests point it at a fake)'),
    Setting('stripe_checkout_minutes', 60, parse_range(30, 1440),
            'minutes a Checkout Session stays open for the requester to pay (30 to 1440)'),
    Setting('session_idle_hours', 12, parse_range(1, 168),
            'hours a browser session lasts without a request (1 to 168; at most 7 days in all)'),
    Setting('replica_url', '', str,
            'stream the database to file:///dir or s3://bucket/path with Litestream (every second); '
            'credentials from AWS_*'),
    Setting('replica_endpoint', '', str,
            'the endpoint of an S3-compatible store for --replica-url or --read-replica-of (http(s)://host)'),
    Setting('heartbeat_interval', 5.0, parse_positive(float),
            'with --replica-url: seconds between the heartbeats by which read replicas measure their lag'),
    Setting('read_replica_of', '', str,
            'serve reads only, from the Litestream replica at file:///dir or s3://bucket/path (another server\'s '
            '--replica-url); credentials from AWS_*'),
    Setting('primary_url', '', str,
            'on a read replica: the primary, where writes are sent with 307 (unset: they are 503 read_only)'),
    Setting('max_replica_lag', 30.0, parse_positive(float),
            'on a read replica: seconds behind the primary past which reads go to the primary (307) or are 503 '
            'replica_lagging, health is 503, and the view of the replica is reopened'),
    Setting('url', 'http://127.0.0.1:8080', str, 'mcp: the API the MCP server calls (local or remote)'),
    Setting('api_key', '', str, 'mcp: the API key the MCP server acts with; best given as the env var'),
    Setting('mcp_timeout', 30.0, parse_positive(float), 'mcp: seconds one API call of the MCP server may take'),
    Setting('metrics_host', '127.0.0.1', str,
            'address of the --metrics-port listener (keep it loopback: no key asked)'),
    Setting('metrics_port', 0, parse_range(0, 65535),
            'serve GET /metrics without a key on this second port (0: off; on the main port it needs an admin key)'),
]


class Settings:
    """The settings in force: every Setting's name as an attribute (and, in onchain mode, `onchain`)."""

    onchain = None      # the OnChain of a running service: set by Service when --rpc-url is given
    stripe = None       # the StripeRail of a running service: set by Service when --stripe-secret-key is given

    def __init__(self, **values):
        for setting in SETTINGS:
            setattr(self, setting.name, values.pop(setting.name, setting.default))
        if values:
            raise TypeError(f'unknown settings: {", ".join(sorted(values))}')

    @property
    def base_url(self):
        host = f'[{self.host}]' if ':' in self.host else self.host      # an IPv6 address
        return (self.public_url or f'http://{host}:{self.port}').rstrip('/')


def add_setting_flags(parser):
    """Give an argparse parser one flag per setting (no defaults: unset flags fall through)."""
    for setting in SETTINGS:
        if setting.type is parse_bool:
            parser.add_argument(setting.flag, dest=setting.name, default=None,
                                action=argparse.BooleanOptionalAction,
                                help=f'{setting.help} [env {setting.env}]')
        elif setting.many:
            parser.add_argument(setting.flag, dest=setting.name, default=None, metavar='VALUE', action='append',
                                help=f'{setting.help} [env {setting.env}, entries separated by ;]')
        else:
            parser.add_argument(setting.flag, dest=setting.name, default=None, metavar='VALUE',
                                help=f'{setting.help} (default {setting.default!s:.40}) [env {setting.env}]')


def load_settings(flags=None, environ=None):
    """Settings from flags, else MARKETPLACE_* variables, else defaults; ValueError names the bad one."""
    flags = flags or {}
    environ = os.environ if environ is None else environ
    values = {}
    for setting in SETTINGS:
        raw, source = flags.get(setting.name), setting.flag
        if raw is None and environ.get(setting.env, '') != '':
            raw, source = environ[setting.env], setting.env
        if raw is None:
            continue
        if isinstance(raw, bool) and setting.type is parse_bool:
            values[setting.name] = raw
            continue
        try:
            values[setting.name] = setting.type(raw)
        except ValueError as exc:
            raise ValueError(f'{source}: {exc}') from None
    return Settings(**values)


def setting_secrets(settings):
    """What logs must never show of the settings: keys, webhook secrets, the paths and queries of the RPC and
    facilitator URLs (a provider's key is often there), the replica URL's user info and the AWS secret variables."""
    keys = [settings.escrow_key, settings.escrow_key.removeprefix('0x'), settings.deployer_key,
            settings.deployer_key.removeprefix('0x'), settings.admin_key,
            settings.stripe_secret_key, settings.stripe_webhook_secret, settings.stripe_connect_webhook_secret,
            settings.api_key]
    return ([key for key in keys if key] + url_secrets(settings.rpc_url) + url_secrets(settings.facilitator_url)
            + replication.secrets(settings.replica_url))


# Settings x402 cannot start without (Service, x402_pay_to).
X402_NEEDS_CHAIN = '--x402-price needs --rpc-url and --escrow-key: x402 payments are checked on chain'
X402_NEEDS_PAY_TO = '--x402-price needs --x402-pay-to: the address x402 payments go to (never the escrow address)'

# The reads answered from the read cache (read_cache.py) while nothing they show has changed.
CACHED_READS = {'/api/jobs', '/api/jobs/search', '/api/jobs/<job_id>', '/api/jobs/feed', '/api/agents',
                '/api/agents/<agent_id>'}


###############################################################################
# Time, ids and formats #######################################################
###############################################################################

class Clock:
    """The service's one source of 'now'; tests set or advance it instead of sleeping."""

    def __init__(self):
        self.fixed = None

    def now(self):
        return self.fixed or datetime.now(timezone.utc)

    def set(self, moment):
        self.fixed = moment

    def advance(self, **delta):
        self.fixed = self.now() + timedelta(**delta)


CLOCK = Clock()


def now():
    """The current time in UTC (CLOCK decides)."""
    return CLOCK.now()


def when(moment):
    """An ISO time as people read it: '2026-11-21 16:40 UTC'."""
    return f'{moment[:10]} {moment[11:16]} UTC' if moment else ''


def iso(moment):
    """ISO 8601 UTC with milliseconds and a Z (four-digit years)."""
    return moment.astimezone(timezone.utc).replace(tzinfo=None).isoformat(timespec='milliseconds') + 'Z'


def now_iso():
    return iso(now())


def parse_time(text):
    """Read an ISO 8601 time as UTC (a time without an offset is UTC); ValueError when it is not one, or when in UTC
    it falls outside years 1 to 9999 ('9999-12-31T23:59:59-23:59'), so that nothing later overflows."""
    moment = datetime.fromisoformat(text.strip())
    if moment.tzinfo is None:
        return moment.replace(tzinfo=timezone.utc)
    try:
        return moment.astimezone(timezone.utc)
    except OverflowError:
        raise ValueError('the time is out of range in UTC') from None


def new_id():
    return str(uuid.uuid4())


_UUID = re.compile(r'^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$')


def parse_uuid(text, what='id'):
    """A UUID in canonical lowercase form, or InvalidUUID."""
    value = text.lower() if isinstance(text, str) else None
    if value is None or not _UUID.fullmatch(value):
        raise InvalidUUID(f'The {what} is not a valid UUID.', fields={what: 'must be a UUID'})
    return value


###############################################################################
# Money and the ledger ########################################################
###############################################################################

# Ledger amounts are integer base units of the currency; job prices are integer cents.
DECIMALS = {'USD': 2, 'USDC': 6}
MAX_PAYMENT_CENTS = 100_000_000   # 1,000,000.00
RAILS = {'USDC': 'base', 'USD': 'stripe'}
FINAL_JOB_STATUSES = ('completed', 'rejected', 'refunded', 'expired', 'cancelled')
ACTIVE_CLAIMS = "('claimed', 'delivered', 'disputed')"   # claims that hold a worker slot, for SQL


def cents_to_units(cents, currency):
    return cents * 10 ** (DECIMALS[currency] - 2)


def format_cents(cents):
    """Integer hundredths as a decimal string with two places: 2550 -> '25.50'."""
    sign = '-' if cents < 0 else ''
    return f'{sign}{abs(cents) // 100}.{abs(cents) % 100:02d}'


def format_units(units, currency):
    """Base units as a two-place decimal string, cut down to the cent."""
    return format_cents(units // 10 ** (DECIMALS[currency] - 2))


def escrow_account(job_id):
    return f'escrow:{job_id}'


def record_payment(db, job, kind, amount, *, debit, credit, recipient, claim_id=None, status='simulated',
                   tx_hash=None, raw_tx=None, nonce=None, reference=None):
    """Write one payment record and its two ledger entries (debit and credit); return the record."""
    payment = {
        'id': new_id(), 'job_id': job['id'], 'claim_id': claim_id, 'type': kind,
        'amount': amount, 'currency': job['currency'], 'rail': job['rail'],
        'status': status, 'recipient': recipient, 'tx_hash': tx_hash, 'raw_tx': raw_tx, 'nonce': nonce,
        'broadcast_at': None, 'created_at': now_iso(), 'reference': reference,
    }
    db.insert('payments', payment)
    for account, signed in ((debit, -amount), (credit, amount)):
        db.insert('ledger_entries', {
            'payment_id': payment['id'], 'job_id': job['id'], 'account': account,
            'amount': signed, 'currency': job['currency'], 'created_at': payment['created_at'],
        })
    return payment


def reverse_entries(db, payment_id):
    """Two more ledger entries that undo a payment's two: it counts for nothing (cancelled, or its call reverted)."""
    db.execute('''INSERT INTO ledger_entries (payment_id, job_id, account, amount, currency, created_at)
                  SELECT payment_id, job_id, account, -amount, currency, :now FROM ledger_entries
                  WHERE payment_id = :id ORDER BY id''', {'id': payment_id, 'now': now_iso()})


def fail_payments(db, job_id, payment_ids, why):
    """Payments whose chain call reverted (CONTRACT 25): `failed` with the reason, their entries reversed (the
    money did not move), and the job needing an admin."""
    for payment_id in payment_ids:
        if db.execute("""UPDATE payments SET status = 'failed', failure = :why WHERE id = :id
                         AND status NOT IN ('failed', 'cancelled')""", {'id': payment_id, 'why': why}):
            reverse_entries(db, payment_id)
    db.execute('UPDATE jobs SET needs_admin = :why, updated_at = :now WHERE id = :id',
               {'why': why, 'now': now_iso(), 'id': job_id})


def escrow_balance(db, job_id):
    """What the job's escrow still holds, in base units."""
    return db.value('SELECT coalesce(sum(amount), 0) FROM ledger_entries WHERE account = :account',
                    {'account': escrow_account(job_id)})


def onchain_job(settings, job):
    """Does this job's money move on chain? Only in onchain mode, and only for a job funded on chain (a transfer to
    the escrow wallet, or a JobEscrow deposit): a job created in simulated mode locked no USDC, so it pays none."""
    return settings.onchain is not None and (job['escrow_tx_hash'] or job['escrow_deposit_id']) is not None


def contract_job(settings, job):
    """Is this job's money in the JobEscrow contract (funded by a deposit, CONTRACT 21)? Unavailable when this
    server cannot move it: no --rpc-url, or no --escrow-contract."""
    if job['escrow_deposit_id'] is None:
        return False
    if settings.onchain is None or settings.onchain.contract is None:
        raise Unavailable('This job was funded in the JobEscrow contract: only a server running with --rpc-url and '
                          '--escrow-contract can pay it out.', code='chain_unavailable', headers={'Retry-After': '60'})
    return True


def stripe_mode(settings):
    """Does the stripe rail move real money here (a Stripe secret key is set)? Takes the settings or a Service."""
    return bool(getattr(settings, 'settings', settings).stripe_secret_key)


def stripe_job(job):
    """Does this job's money move through Stripe? Only for a job paid through Checkout (its PaymentIntent is set):
    a job on rail stripe created while the rail was simulated paid nothing, so it pays nothing out."""
    return job['payment_intent'] is not None


def real_rails(settings):
    """The rails that move real money: base in onchain mode, stripe in stripe mode."""
    rails = set()
    if settings.onchain is not None:
        rails.add('base')
    if stripe_mode(settings):
        rails.add('stripe')
    return rails


def lock_escrow(db, job, funding=None, payment_intent=None):
    """Move the job's price (on chain: all the funding transfer brought) from the requester into escrow. In
    stripe mode the money sits in the platform's Stripe balance, paid by `payment_intent` (a Checkout)."""
    lock = functools.partial(record_payment, db, job, 'escrow', debit=f'funding:{job["requester_id"]}',
                             credit=escrow_account(job['id']))
    if funding is not None:
        return lock(funding['amount'], recipient=funding['to'], status='confirmed', tx_hash=funding['tx_hash'])
    price = cents_to_units(job['amount_cents'], job['currency'])
    if payment_intent is not None:
        return lock(price, recipient='platform', status='confirmed', reference=payment_intent)
    return lock(price, recipient='escrow')


def pay_out(db, settings, job, kind, amount, *, debit, credit, recipient, claim_id=None):
    """Record money leaving escrow. On chain the USDC transfer is signed and stored here, in the caller's
    transaction, and broadcast after the commit: a crash can only lead to sending the same transaction again.
    A contract job's refund is its `refund` call, signed and stored the same way.
    Through Stripe the record is written pending here; its Transfer or Refund is asked for after the commit with
    the record's id as idempotency key, so asking again can never pay twice."""
    if contract_job(settings, job):       # a refund: release_to_worker pays workers (contract_release)
        raw, tx_hash, nonce = settings.onchain.sign_call(db, 'refund', job['escrow_deposit_id'], amount)
        return record_payment(db, job, kind, amount, debit=debit, credit=credit, recipient=recipient,
                              claim_id=claim_id, status='pending', tx_hash=tx_hash, raw_tx=raw, nonce=nonce)
    if job['escrow_tx_hash'] and settings.onchain is None:
        raise Unavailable('This job was funded on chain: only a server running with --rpc-url can pay it out.',
                          code='chain_unavailable', headers={'Retry-After': '60'})
    if stripe_job(job):     # a Transfer or Refund made after the commit (send_stripe_payments)
        if settings.stripe is None:
            raise Unavailable('This job was paid through Stripe: only a server running with --stripe-secret-key '
                              'can pay it out.', code='payment_provider_unavailable', headers={'Retry-After': '60'})
        return record_payment(db, job, kind, amount, debit=debit, credit=credit, recipient=recipient,
                              claim_id=claim_id, status='pending')
    if not onchain_job(settings, job):
        return record_payment(db, job, kind, amount, debit=debit, credit=credit, recipient=recipient,
                              claim_id=claim_id)
    raw, tx_hash, nonce = settings.onchain.sign_payout(db, recipient, amount)
    return record_payment(db, job, kind, amount, debit=debit, credit=credit, recipient=recipient,
                          claim_id=claim_id, status='pending', tx_hash=tx_hash, raw_tx=raw, nonce=nonce)


def fee_of(amount, currency, fee_percent):
    """The operator's fee on `amount` base units: the fee percentage of it, rounded down to a whole cent (so that
    every record shows exactly with two places)."""
    cent = 10 ** (DECIMALS[currency] - 2)
    return amount // cent * int(fee_percent * 100) // 10_000 * cent


def release_fee(db, settings, job, amount):
    """The operator's fee on a release of `amount` base units. Fees are carried across a job's releases
    (CONTRACT.md 20): this one's is the fee of everything the job has released so far, this release included, less
    the fees already taken, so that shares round down once, not each on its own (100 shares of 0.39 pay the fee of
    39.00)."""
    before = db.row('''SELECT coalesce(sum(amount), 0) AS released,
                             coalesce(sum(CASE type WHEN 'fee' THEN amount END), 0) AS fees
                      FROM payments WHERE job_id = :id AND type IN ('release', 'fee')
                      AND status NOT IN ('cancelled', 'failed') ''', {'id': job['id']})
    fee = fee_of(before['released'] + amount, job['currency'], settings.fee_percent) - before['fees']
    return min(amount, max(0, fee))


def release_to_worker(db, settings, job, claim, agent, amount, signature=None):
    """Pay a worker `amount` base units from escrow, less the operator fee (release_fee); return the records. In
    contract mode the payer's Release `signature` pays at once, and without one the payment is scheduled
    (contract_release)."""
    fee = release_fee(db, settings, job, amount)
    if contract_job(settings, job):
        return contract_release(db, settings, job, claim, agent, amount - fee, fee, signature)
    if stripe_job(job):     # paid to the agent's connected account (its id until it has one)
        recipient = agent['stripe_account_id'] or agent['id']
    else:
        recipient = agent['wallet_address'] or agent['id']
    payments = [pay_out(db, settings, job, 'release', amount - fee, debit=escrow_account(job['id']),
                        credit=f'worker:{agent["id"]}', recipient=recipient, claim_id=claim['id'])]
    if fee:     # on chain the fee simply stays in the escrow wallet; through Stripe, in the platform's balance
        real = onchain_job(settings, job) or stripe_job(job)
        payments.append(record_payment(db, job, 'fee', fee, debit=escrow_account(job['id']), credit='fees',
                                       recipient='operator', claim_id=claim['id'],
                                       status='confirmed' if real else 'simulated'))
    return payments


def refund_escrow(db, settings, job):
    """Return whatever the job's escrow still holds to the requester (on chain: to the funding address)."""
    balance = escrow_balance(db, job['id'])
    if balance <= 0:
        return None
    return pay_out(db, settings, job, 'refund', balance, debit=escrow_account(job['id']),
                   credit=f'funding:{job["requester_id"]}', recipient=job['refund_address'] or job['requester_id'])


def ledger_problems(db):
    """Every way the books fail to balance; an empty list means they balance.

    For each job: locked = released + fee + refunded + still locked, the escrow never below zero,
    nothing left in escrow once the job is final, and escrowStatus agreeing with the balance (a held escrow may
    hold anything: its pending payments wait; a job needing an admin may hold what a reverted call did not move).
    Every payment moves its amount from one account to one other, in entries that come in pairs (a cancelled one,
    never sent, or a failed one, its call reverted, also their reversal: it counts for nothing; a failed one made
    after all, the pair again); no worker or fee account is negative.
    """
    problems = []
    for row in db.rows('''
        SELECT p.id, coalesce(sum(e.n), 0) AS entries, coalesce(sum(e.total), 0) AS net
        FROM payments p LEFT JOIN (SELECT payment_id, account, sum(amount) AS total, count(*) AS n
                                   FROM ledger_entries GROUP BY payment_id, account) e ON e.payment_id = p.id
        GROUP BY p.id
        HAVING entries = 0 OR entries % 2 != 0 OR count(e.account) != 2 OR net != 0
            OR coalesce(max(e.total), 0) != CASE WHEN p.status IN ('cancelled', 'failed') THEN 0 ELSE p.amount END
            OR coalesce(min(e.total), 0) != CASE WHEN p.status IN ('cancelled', 'failed') THEN 0 ELSE -p.amount END'''):
        problems.append(f'payment {row["id"]}: {row["entries"]} entries, net {row["net"]}')
    for job in db.rows('''
        SELECT j.id, j.status, j.escrow_status, j.needs_admin,
            coalesce(sum(CASE p.type WHEN 'escrow' THEN p.amount END), 0) AS locked,
            coalesce(sum(CASE p.type WHEN 'release' THEN p.amount END), 0) AS released,
            coalesce(sum(CASE p.type WHEN 'fee' THEN p.amount END), 0) AS fee,
            coalesce(sum(CASE WHEN p.type IN ('refund', 'reclaim') THEN p.amount END), 0) AS refunded,
            (SELECT coalesce(sum(e.amount), 0) FROM ledger_entries e
             WHERE e.account = 'escrow:' || j.id) AS held
        FROM jobs j LEFT JOIN payments p ON p.job_id = j.id AND p.status NOT IN ('cancelled', 'failed')
        GROUP BY j.id'''):
        name = f'job {job["id"]} ({job["status"]}, escrow {job["escrow_status"]})'
        if job['locked'] != job['released'] + job['fee'] + job['refunded'] + job['held']:
            problems.append(f'{name}: locked {job["locked"]} != released {job["released"]} + fee '
                            f'{job["fee"]} + refunded {job["refunded"]} + held {job["held"]}')
        if job['held'] < 0:
            problems.append(f'{name}: escrow holds {job["held"]}')
        if job['status'] in FINAL_JOB_STATUSES and job['held'] != 0 and job['needs_admin'] is None:
            problems.append(f'{name}: final but escrow still holds {job["held"]}')
        if job['escrow_status'] != 'held' and job['needs_admin'] is None and \
                (job['escrow_status'] == 'locked') != (job['held'] > 0):
            problems.append(f'{name}: escrowStatus does not match a balance of {job["held"]}')
    for row in db.rows('''
        SELECT account, currency, sum(amount) AS balance FROM ledger_entries
        WHERE account = 'fees' OR account LIKE 'worker:%'
        GROUP BY account, currency HAVING balance < 0'''):
        problems.append(f'account {row["account"]} holds {row["balance"]} {row["currency"]}')
    return problems


###############################################################################
# On-chain payments ###########################################################
###############################################################################

USDC_BY_CHAIN = {8453: '0x833589fCD6eDb6E08f4c7C32D4f71b54bdA02913', 84532: '0x036CbD53842c5426634e7929541eC2318f3dCF7e'}
NETWORK_BY_CHAIN = {8453: 'base', 84532: 'base-sepolia'}
DEFAULT_FEE_CAPS = (10 ** 9, 10 ** 6)        # 1 gwei max fee, 0.001 gwei tip, until the node is asked
SIGNED_TABLES = ('payments', 'x402_payments', 'escrow_calls')     # where signed transactions wait to be confirmed


class OnChain:
    """Onchain mode (CONTRACT.md 7): the node, the escrow wallet, and the payouts it signs.

    Payouts are signed inside the SQLite transaction that decides them (the nonce comes from the database,
    one at a time), stored, and broadcast after the commit; `confirm` (run by every sweep) marks them
    confirmed once deep enough and sends again what the node does not know. One nonce is one payout, so
    sending a transaction again can never pay twice. A payout stuck unmined, or refused for its fee, is re-signed
    with the same nonce and a higher fee (reprice); whichever of its signed transactions is mined pays it.
    """

    def __init__(self, settings):
        from verifier.chain import Chain
        from verifier.payouts import escrow_address
        if not settings.escrow_key:
            raise ValueError('--rpc-url needs --escrow-key (or MARKETPLACE_ESCROW_KEY): the escrow wallet')
        try:
            self.escrow_address = escrow_address(settings.escrow_key)
        except Exception:
            raise ValueError('--escrow-key is not a valid hex private key') from None
        self.usdc = settings.usdc_address or USDC_BY_CHAIN.get(settings.chain_id)
        if not self.usdc:
            raise ValueError(f'--usdc-address is needed on chain {settings.chain_id}')
        self.settings = settings
        self.chain = Chain(settings.rpc_url)
        self.quick = Chain(settings.rpc_url, timeout=2)      # for /api/health
        self.latest = None      # (when asked, the latest block number or None): health's view of the node
        self.fees = None
        self.sending = threading.RLock()     # one send at a time: each reads the key's nonce from the chain first
        self.contract = settings.escrow_contract or None    # contract mode: the JobEscrow (CONTRACT 21)
        self.terms = None       # contract mode: its immutables, read at start (or when first needed)
        if self.contract and address_problem(self.contract):
            raise ValueError(f'--escrow-contract: {address_problem(self.contract)}')

    def start(self, db):
        """Check the node's chain id (a mismatch refuses to start), then learn the nonce and the fees.
        A node that does not answer is no reason not to start: /api/health says so."""
        try:
            reported = self.chain.chain_id()
        except VerificationError:
            log.warning('the node at --rpc-url does not answer; payments wait for it')
            return False
        if reported != self.settings.chain_id:
            raise ValueError(f'the node at --rpc-url is on chain {reported}, not on --chain-id '
                             f'{self.settings.chain_id}: refusing to start')
        if self.contract:
            try:
                self.contract_terms()
                latest = self.chain.block_number()
            except VerificationError:
                log.warning('the node at --rpc-url does not answer for --escrow-contract; payments wait for it')
                return False
            with db.transaction():      # the contract's events are read from here on (reconcile_escrow)
                db.execute('''INSERT INTO chain_state (name, value) VALUES ('escrow_events_from', :block)
                              ON CONFLICT (name) DO NOTHING''', {'block': latest})
        self.sync(db)
        return True

    def contract_terms(self):
        """Contract mode: the contract's immutables, read once; refuse a contract this key cannot run (another
        arbiter, another token, a fee cap below --fee-percent). Network I/O the first time."""
        if self.terms is None:
            from verifier.escrow import EscrowReader
            self.reader = EscrowReader(self.chain, self.contract)
            try:
                terms = self.reader.settings()
            except VerificationError:
                raise
            except Exception as exc:       # no code there, or another ABI: not a JobEscrow
                raise ValueError(f'--escrow-contract {self.contract} does not answer as a JobEscrow: {exc}') from None
            from verifier.escrow import domain_separator
            problems = [f'its {name} is {terms[name]}, not {want}' for name, want in (
                ('arbiter', self.escrow_address), ('token', self.usdc)) if terms[name].lower() != want.lower()]
            if terms['domainSeparator'] != domain_separator(self.contract, self.settings.chain_id):
                problems.append('it is an older JobEscrow, whose Release the payer alone signs (deploy the new one '
                                'with `marketplace.py escrow deploy`)')
            if self.settings.fee_percent * 100 > terms['maxFeeBps']:
                problems.append(f'its fee cap is {terms["maxFeeBps"]} basis points, below --fee-percent '
                                f'{self.settings.fee_percent}')
            if problems:
                raise ValueError(f'--escrow-contract {self.contract}: ' + '; '.join(problems) + ': refusing to start')
            self.terms = terms
        return self.terms

    def sign_call(self, db, function, *args, gas=None):
        """Sign a call of the JobEscrow with the next nonce, inside the caller's transaction: (raw, hash, nonce)."""
        from verifier.escrow import CALL_GAS, call_data, sign_call
        nonce = self.next_nonce(db)
        max_fee, tip = self.fees or DEFAULT_FEE_CAPS
        raw, tx_hash = sign_call(self.settings.escrow_key, contract=self.contract, data=call_data(function, *args),
                                 nonce=nonce, chain_id=self.settings.chain_id, max_fee_per_gas=max_fee,
                                 max_priority_fee_per_gas=tip, gas=gas or CALL_GAS)
        return raw, tx_hash, nonce

    def store_call(self, db, function, args, *, deposit, gas=None, **row):
        """Sign a JobEscrow call that is not one payment (a relayed deposit, a proposal, its execution) and store
        it in escrow_calls, inside the caller's transaction; the sweep (or the caller, after the commit) sends it."""
        raw, tx_hash, nonce = self.sign_call(db, function, *args, gas=gas)
        call = dict({'job_id': None, 'account_id': None, 'proposal_id': None, 'executable_at': None}, **row,
                    id=new_id(), function=function, deposit_id=deposit, status='pending', tx_hash=tx_hash,
                    raw_tx=raw, nonce=nonce, broadcast_at=None, created_at=now_iso())
        db.insert('escrow_calls', call)
        return call

    def confirmed_deposit(self, deposit):
        """A deposit as the contract holds it at a block --confirmations deep, or None. Network I/O."""
        block = self.chain.block_number() - self.settings.confirmations + 1
        return self.reader.deposit(deposit, max(block, 0))

    def sync(self, db):
        """Ask the node for the escrow wallet's next nonce and the fees (network), then store the nonce."""
        try:
            pending = self.chain.nonce(self.escrow_address)
            self.fees = self.chain.fee_caps()
        except VerificationError:
            return
        with db.transaction():
            db.execute('''INSERT INTO chain_state (name, value) VALUES ('next_nonce', :pending)
                          ON CONFLICT (name) DO UPDATE SET value = max(value, :pending)''', {'pending': pending})

    @staticmethod
    def next_nonce(db):
        """The escrow wallet's next nonce, taken inside the caller's transaction (one per signed transaction)."""
        return db.value('''INSERT INTO chain_state (name, value) VALUES ('next_nonce', 1)
                           ON CONFLICT (name) DO UPDATE SET value = value + 1 RETURNING value - 1''')

    def sign_payout(self, db, to, amount):
        """Sign a USDC transfer from escrow with the next nonce, inside the caller's transaction."""
        from verifier.payouts import sign_usdc_transfer
        nonce = self.next_nonce(db)
        max_fee, tip = self.fees or DEFAULT_FEE_CAPS
        raw, tx_hash = sign_usdc_transfer(self.settings.escrow_key, token=self.usdc, to=to, amount=amount,
                                          nonce=nonce, chain_id=self.settings.chain_id, max_fee_per_gas=max_fee,
                                          max_priority_fee_per_gas=tip)
        return raw, tx_hash, nonce

    def sign_settlement(self, db, payment):
        """Sign the escrow wallet's call of transferWithAuthorization for an x402 payment (it pays the gas), with
        the next nonce, inside the caller's transaction."""
        from verifier.x402 import sign_transfer_with_authorization
        nonce = self.next_nonce(db)
        max_fee, tip = self.fees or DEFAULT_FEE_CAPS
        raw, tx_hash = sign_transfer_with_authorization(
            self.settings.escrow_key, token=self.usdc, payment=payment, nonce=nonce, chain_id=self.settings.chain_id,
            max_fee_per_gas=max_fee, max_priority_fee_per_gas=tip)
        return raw, tx_hash, nonce

    @staticmethod
    def signed_pending(db, condition=''):
        """The signed transactions (payouts and x402 settlements) not yet confirmed, oldest nonce first."""
        return db.rows(' UNION ALL '.join(
            f"SELECT '{table}' AS tbl, id, tx_hash, raw_tx, broadcast_at, nonce FROM {table} "
            f"WHERE status = 'pending' AND raw_tx IS NOT NULL {condition}" for table in SIGNED_TABLES)
            + ' ORDER BY nonce')

    def verify_funding(self, tx_hash, amount, *, account_id, signature):
        """The funding transfer of a job, checked on chain (one Transfer to escrow), then its signature by the
        transfer's sender for this account: (payer, amount moved). Network I/O."""
        from verifier.funding import check_funding_signature
        transfer = self.chain.verify_usdc_payment(
            tx_hash, chain_id=self.settings.chain_id, token=self.usdc, recipient=self.escrow_address,
            min_amount=amount, confirmations=self.settings.confirmations,
            max_age_seconds=self.settings.payment_max_age, now=now().timestamp(), one_transfer=True)
        check_funding_signature(signature, payer=transfer.payer, account=account_id, tx_hash=tx_hash,
                                chain_id=self.settings.chain_id, escrow=self.escrow_address)
        return transfer

    def funding_typed_data(self, account_id, tx_hash=None):
        """What the sender of a job's funding signs for `account_id` (EIP-712 typed data, CONTRACT.md 18)."""
        from verifier.funding import funding_typed_data
        return funding_typed_data(account=account_id, tx_hash=tx_hash, chain_id=self.settings.chain_id,
                                  escrow=self.escrow_address)

    def requirements(self, amount):
        """What a requester must send to fund a job of `amount` base units."""
        return {'payTo': self.escrow_address, 'amount': str(amount), 'asset': self.usdc,
                'network': NETWORK_BY_CHAIN.get(self.settings.chain_id, f'eip155:{self.settings.chain_id}'),
                'chainId': self.settings.chain_id}

    def broadcast(self, db):
        """Send every signed payout and settlement the node has not taken yet, oldest nonce first; stop at the
        first failure (one refused for its fee is re-priced and its replacement sent: see send)."""
        for payment in self.signed_pending(db, 'AND broadcast_at IS NULL'):
            try:
                self.send(db, payment)
            except VerificationError:
                return

    def send(self, db, payment):
        """Broadcast a payment's stored transaction and note when the node first took it. Refused for its fee, it
        is re-priced (same nonce) and the replacement sent. The key's nonce is read from the chain first
        (fill_gap). VerificationError when the node did not take it."""
        with self.sending:
            payment = self.fill_gap(db, payment)
            try:
                self.chain.send_raw(payment['raw_tx'])
            except FeeTooLow:
                self.fees = self.chain.fee_caps()       # what made it too low: the fees the node asks now
                payment = self.reprice(db, payment)
                if payment is None:
                    raise
                self.chain.send_raw(payment['raw_tx'])
            with db.transaction():
                db.execute(f"""UPDATE {payment['tbl']} SET broadcast_at = coalesce(broadcast_at, :now)
                               WHERE id = :id AND tx_hash = :tx_hash""",
                           {'now': now_iso(), 'id': payment['id'], 'tx_hash': payment['tx_hash']})
        return payment

    def fill_gap(self, db, payment):
        """Before a send, the key's next nonce as the node counts it (its pending transactions too): nonces others
        used are never signed again here, and a payment whose nonce lies past it with none of ours waiting in
        between (a transaction stored before it will never be sent: what it paid was paid by someone else,
        CONTRACT 25) is signed again with that nonce, stored before it is sent. Network I/O."""
        expected = self.chain.nonce(self.escrow_address)
        with db.transaction():
            db.execute("UPDATE chain_state SET value = max(value, :next) WHERE name = 'next_nonce'",
                       {'next': expected})
        if payment['nonce'] <= expected or self.signed_pending(
                db, f"AND nonce >= {int(expected)} AND nonce < {int(payment['nonce'])}"):
            return payment
        return self.reprice(db, payment, at_nonce=expected) or payment

    def reprice(self, db, payment, taken=None, at_nonce=None):
        """Sign a payment's transaction again with the same nonce and a higher fee (at least the node's fee caps
        and 12.5% over the last signature, at most --payout-max-fee-gwei), and store it, the new raw transaction
        and hash with broadcast_at cleared, in one transaction before anything is sent: after a crash the sweep
        sends it. Every hash signed stays in signed_transactions. With `taken` (how many nonces of the key are used
        on chain, --confirmations deep, one of them this payment's by another transaction), signed instead with a
        new nonce past them at the node's fees; with `at_nonce`, with that nonce at the node's fees (fill_gap).
        The payment as re-signed, or None when the fee would pass the ceiling or the payment changed meanwhile
        (mined, or re-signed by another greenlet)."""
        from verifier.payouts import replacement_fees, resign_with_fees, signed_fees
        table = payment['tbl']
        ceiling = int(Decimal(str(self.settings.payout_max_fee_gwei)) * 10 ** 9)
        with db.transaction():
            current = db.row(f"""SELECT '{table}' AS tbl, id, tx_hash, raw_tx, broadcast_at, nonce FROM {table}
                                 WHERE id = :id AND status = 'pending' AND tx_hash = :tx_hash""",
                             {'id': payment['id'], 'tx_hash': payment['tx_hash']})
            if current is None:
                return None
            previous, nonce = signed_fees(current['raw_tx']), current['nonce']
            if at_nonce is not None:    # a nonce no transaction of the key has: the node's fees
                fees, nonce = tuple(min(fee, ceiling) for fee in self.fees or DEFAULT_FEE_CAPS), at_nonce
            elif taken is None:
                fees = replacement_fees(previous, self.fees or DEFAULT_FEE_CAPS, ceiling)
            else:           # not a replacement: the node's fees, and the next nonce the chain has not used
                fees = tuple(min(fee, ceiling) for fee in self.fees or DEFAULT_FEE_CAPS)
                db.execute("UPDATE chain_state SET value = max(value, :taken) WHERE name = 'next_nonce'",
                           {'taken': taken})
                nonce = self.next_nonce(db)
            if fees is None:
                log.warning('%s %s (nonce %s) waits unmined: a higher fee would pass --payout-max-fee-gwei %s',
                            table, current['id'], current['nonce'], self.settings.payout_max_fee_gwei)
                return None
            raw, tx_hash = resign_with_fees(self.settings.escrow_key, current['raw_tx'], max_fee_per_gas=fees[0],
                                            max_priority_fee_per_gas=fees[1], nonce=nonce)
            db.execute(f"""UPDATE {table} SET raw_tx = :raw, tx_hash = :tx_hash, nonce = :nonce, broadcast_at = NULL
                           WHERE id = :id""", {'raw': raw, 'tx_hash': tx_hash, 'nonce': nonce, 'id': current['id']})
            if table == 'x402_payments':        # a settlement's hash never pays for anything else
                db.execute('''INSERT INTO used_payments (chain_id, tx_hash, purpose, created_at)
                              VALUES (:chain, :tx_hash, 'x402', :now) ON CONFLICT DO NOTHING''',
                           {'chain': self.settings.chain_id, 'tx_hash': tx_hash, 'now': now_iso()})
        if at_nonce is not None:
            log.warning('%s %s: no transaction of the escrow key will use the nonces before its own; signed again '
                        'with nonce %s: %s', table, current['id'], nonce, tx_hash)
        elif taken is None:
            log.info('%s %s re-priced with its nonce %s: max fee %s -> %s wei/gas, tip %s -> %s; %s replaces %s',
                     table, current['id'], nonce, previous[0], fees[0], previous[1], fees[1], tx_hash,
                     current['tx_hash'])
        else:
            log.warning('%s %s: its nonce %s was used by another transaction of the escrow key (never send from it '
                        'while the service runs); signed again with nonce %s: %s', table, current['id'],
                        current['nonce'], nonce, tx_hash)
        return dict(current, raw_tx=raw, tx_hash=tx_hash, nonce=nonce, broadcast_at=None)

    @staticmethod
    def signed_hashes(db, table, payment_id):
        """Every transaction hash signed for a payment, newest first."""
        return [row['tx_hash'] for row in db.rows(
            '''SELECT tx_hash FROM signed_transactions WHERE payment_id = :id AND source = :source
               ORDER BY seq DESC''', {'id': payment_id, 'source': table})]

    def mined_receipt(self, db, table, payment):
        """The receipt of whichever of a payment's signed transactions was mined (one nonce: at most one can be),
        or None. Network I/O."""
        for tx_hash in self.signed_hashes(db, table, payment['id']) or [payment['tx_hash']]:
            receipt = self.chain.receipt(tx_hash)
            if receipt is not None:
                return receipt
        return None

    def wait_for_receipt(self, db, table, payment, timeout_seconds, poll=0.2):
        """The receipt of a payment's mined transaction once there is one; ChainUnavailable after `timeout_seconds`."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            receipt = self.mined_receipt(db, table, payment)
            if receipt is not None:
                return receipt
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChainUnavailable(f'The transaction {payment["tx_hash"]} was not mined within '
                                       f'{timeout_seconds} seconds.')
            time.sleep(min(poll, left))        # gevent's, in the server (monkey-patched)

    def confirm(self, db):
        """Mark payouts and settlements confirmed once one of their signed transactions is `confirmations` deep on
        the canonical chain (its hash becomes the payment's), failed if it reverted; re-price those unmined past
        --payout-rebroadcast-minutes (with a new nonce those whose nonce another transaction of the key used) and
        send again those the node does not know. Returns {confirmed, failed, resent, repriced, renumbered}."""
        result = {'confirmed': 0, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
        pending = self.signed_pending(db)
        recently = iso(now() - timedelta(seconds=30))
        stale = iso(now() - timedelta(minutes=self.settings.payout_rebroadcast_minutes))
        if not pending:
            return result
        try:
            latest = self.chain.block_number()
            self.fees = self.chain.fee_caps()
            # Nonces used --confirmations deep, read before any receipt: one of ours used by then has its receipt.
            taken = self.chain.nonce(self.escrow_address, max(latest - self.settings.confirmations + 1, 0))
        except VerificationError:
            return result
        for payment in pending:
            try:
                receipt = self.mined_receipt(db, payment['tbl'], payment)
                if receipt is None:
                    stuck = payment['broadcast_at'] is not None and payment['broadcast_at'] < stale
                    lost = stuck and payment['nonce'] < taken       # another transaction used its nonce
                    repriced = self.reprice(db, payment, taken if lost else None) if stuck else None
                    if repriced is not None:
                        self.send(db, repriced)
                        result['renumbered' if lost else 'repriced'] += 1
                    elif payment['broadcast_at'] is None or payment['broadcast_at'] < recently:
                        self.send(db, payment)      # the node lost it, or never had it
                        result['resent'] += 1
                    continue
                block = self.chain.block(receipt['blockNumber'])
            except VerificationError:
                return result
            mined = receipt['transactionHash'].lower()
            if receipt['status'] != 1:
                if self.contract and payment['tbl'] != 'x402_payments' and receipt['blockNumber'] >= (db.value(
                        "SELECT value FROM chain_state WHERE name = 'escrow_events_from'") or 0):
                    continue    # once the sweep has read its block's events: someone else may have paid it
                status = 'failed'
                if payment['tbl'] != 'x402_payments':
                    log.error('%s %s reverted on chain (%s): the escrow needs attention',
                              'payout' if payment['tbl'] == 'payments' else 'escrow call', payment['id'], mined)
                else:
                    log.warning('x402 settlement %s reverted on chain (%s): its call was not answered',
                                payment['id'], mined)
            elif latest - receipt['blockNumber'] + 1 >= self.settings.confirmations and block and \
                    block['hash'].lower() == receipt['blockHash'].lower():
                status = 'confirmed'
            else:
                continue
            with db.transaction():
                if status == 'failed' and payment['tbl'] != 'x402_payments':
                    self.call_reverted(db, payment, mined)
                db.execute(f"""UPDATE {payment['tbl']} SET status = :status, tx_hash = :mined
                               WHERE id = :id AND status = 'pending'""",
                           {'status': status, 'mined': mined, 'id': payment['id']})
                if payment['tbl'] == 'payments' and status == 'confirmed':      # a co-signed release pays its fee
                    db.execute('''UPDATE payments SET status = 'confirmed', tx_hash = :mined WHERE type = 'fee'
                                  AND status = 'pending' AND raw_tx IS NULL AND (job_id, claim_id) =
                                  (SELECT job_id, claim_id FROM payments WHERE id = :id AND type = 'release')''',
                               {'mined': mined, 'id': payment['id']})
                if payment['tbl'] == 'escrow_calls' and status == 'confirmed':   # an execution pays its proposal
                    db.execute('''UPDATE payments SET status = 'confirmed', tx_hash = :mined WHERE status = 'scheduled'
                                  AND call_id = (SELECT proposal_id FROM escrow_calls WHERE id = :id
                                                 AND function = 'execute')''', {'mined': mined, 'id': payment['id']})
            result[status] += 1
        return result

    @staticmethod
    def call_reverted(db, payment, mined):
        """A payout, refund or proposal whose transaction reverted, inside the caller's transaction: what it would
        have paid `failed` (a release's fee with it), and the job needing an admin (CONTRACT 25). An execution or a
        relayed deposit pays nothing by itself: the escrow sweep looks at the proposal again."""
        if payment['tbl'] == 'payments':
            paid = db.row('SELECT id, job_id, claim_id, type FROM payments WHERE id = :id', {'id': payment['id']})
            ids = [paid['id']] + [row['id'] for row in db.rows(
                """SELECT id FROM payments WHERE job_id = :job AND claim_id = :claim AND type = 'fee' AND :type = 'release'
                   AND status IN ('pending', 'confirmed') AND raw_tx IS NULL AND origin IS NULL""",
                {'job': paid['job_id'], 'claim': paid['claim_id'], 'type': paid['type']})]
            job_id, what = paid['job_id'], f'its {paid["type"]}'
            db.execute('UPDATE payments SET tx_hash = :mined WHERE id = :id', {'mined': mined, 'id': paid['id']})
        else:
            call = db.row('SELECT job_id, function FROM escrow_calls WHERE id = :id', {'id': payment['id']})
            if call['function'] != 'propose':
                return
            ids = [row['id'] for row in db.rows("SELECT id FROM payments WHERE call_id = :id AND status = 'scheduled'",
                                                {'id': payment['id']})]
            job_id, what = call['job_id'], 'its proposal'
        fail_payments(db, job_id, ids, f'{what} transaction {mined} reverted on chain')

    def health(self):
        """What /api/health shows of the chain. The node is asked at most once per block time (2 s), so
        monitors probing often neither load it nor wait on it more than that."""
        if self.latest is None or time.monotonic() - self.latest[0] >= 2:
            try:
                self.latest = (time.monotonic(), self.quick.block_number())
            except VerificationError:
                self.latest = (time.monotonic(), None)
        latest = self.latest[1]
        return {'chainId': self.settings.chain_id, 'latestBlock': latest, 'escrowAddress': self.escrow_address,
                'usdcAddress': self.usdc, 'reachable': latest is not None}

    def escrow_health(self):
        """Health's `escrow`: where the jobs' USDC is held. In contract mode the contract's terms (null until the
        node has answered once); in wallet mode the escrow wallet, whose key is on this server (custodial)."""
        if not self.contract:
            return {'mode': 'wallet', 'contract': None, 'arbiter': None, 'guardian': None, 'arbiterDelay': None}
        terms = self.terms or {}
        return {'mode': 'contract', 'contract': self.contract, 'arbiter': self.escrow_address,
                'guardian': terms.get('guardian'), 'arbiterDelay': terms.get('arbiterDelay')}


###############################################################################
# Contract mode: the JobEscrow contract (CONTRACT 21) #########################
###############################################################################

_BYTES32 = re.compile(r'0x[0-9a-fA-F]{64}')
_SIGNATURE = re.compile(r'0x[0-9a-fA-F]{130}')
RELAY_WAIT_SECONDS = 10     # how long POST /api/jobs waits for a relayed deposit to be mined before a 402 pending
EVENT_BLOCKS = 5_000        # blocks of the contract's events read per sweep (nodes cap eth_getLogs ranges)


def read_bytes32(value):
    if not isinstance(value, str) or not _BYTES32.fullmatch(value):
        raise ValueError('must be 0x and 64 hexadecimal digits')
    return value.lower()


def read_signature(value):
    if not isinstance(value, str) or not _SIGNATURE.fullmatch(value):
        raise ValueError('must be a signature: 0x and 130 hexadecimal digits (r, s, v)')
    return value


def escrow_requirements(settings, fields, account):
    """What the 402 of POST /api/jobs asks for in contract mode: the deposit that funds this job. Network I/O the
    first time (the contract's terms)."""
    from verifier.escrow import account_hash, authorization_template
    onchain, terms = settings.onchain, settings.onchain.contract_terms()
    amount = cents_to_units(fields['amount_cents'], fields['currency'])
    waits = 3600 * (fields['verification_window_hours'] + settings.dispute_timeout_hours) + terms['arbiterDelay']
    return {'contract': onchain.contract, 'token': onchain.usdc, 'chainId': settings.chain_id, 'amount': str(amount),
            'account': account_hash(account['id']), 'arbiterDelay': terms['arbiterDelay'],
            'minRefundAfter': int(parse_time(fields['deadline']).timestamp()) + waits + 86400,
            'depositId': 'keccak256(abi.encode(payer, account, refundAfter, salt))',
            'authorizationTypedData': authorization_template(onchain.usdc, settings.chain_id, onchain.contract, amount,
                                                             int(time.time()) + 3600)}


def read_escrow_authorization(value, requirements):
    """escrowAuthorization {payer, refundAfter, salt, validAfter, validBefore, signature}, checked: (deposit id,
    the fields)."""
    from verifier.escrow import deposit_id
    form = Form(value if isinstance(value, dict) else {})
    if not isinstance(value, dict):
        form.errors['escrowAuthorization'] = 'must be an object'
    auth = {'payer': form.parsed('payer', read_address, required=True),
            'salt': form.parsed('salt', read_bytes32, required=True),
            'signature': form.parsed('signature', read_signature, required=True),
            **{name: form.integer(name, low=0, high=2 ** 64 - 1, default=None)
               for name in ('refundAfter', 'validAfter', 'validBefore')}}
    for name in ('refundAfter', 'validAfter', 'validBefore'):
        if auth[name] is None and name not in form.errors:
            form.errors[name] = 'is required'
    if form.errors:
        raise APIError('escrowAuthorization is not a signed authorization: see fields.', code='payment_invalid',
                       fields={f'escrowAuthorization.{name}': why for name, why in form.errors.items()})
    return deposit_id(auth['payer'], requirements['account'], auth['refundAfter'], auth['salt']).lower(), auth


def job_funded_by_deposit(db, deposit, account, fields):
    """The job a deposit funds already, if this requester posted it with these very fields (a retry); 409
    payment_replayed if it funds anything else; None if it funds nothing yet."""
    job = db.row('SELECT id, requester_id FROM jobs WHERE escrow_deposit_id = :id', {'id': deposit})
    if job is None:
        return None
    if job['requester_id'] == account['id']:
        job = get_job(db, job['id'])
        if same_job(job, fields):
            return job
        raise Conflict(f'This deposit funds your job {job["id"]} already, whose fields differ from these: one '
                       'deposit funds one job.', code='payment_replayed', extra={'jobId': job['id']})
    raise Conflict('This deposit funds another job already: one deposit funds one job.', code='payment_replayed')


def relay_deposit(svc, deposit, auth, requirements, account):
    """Make the deposit an escrowAuthorization signs: depositWithAuthorization, sent by the service's key (it pays
    the gas), once per deposit id, after simulating it (a refused authorization costs nothing). Waits a little for
    it to be mined; the deposit as held at the confirmed block, or None (not yet)."""
    from verifier.escrow import call_data
    onchain, db = svc.settings.onchain, svc.db
    args = [auth['payer'], requirements['account'], int(requirements['amount']), auth['refundAfter'], auth['salt'],
            auth['validAfter'], auth['validBefore'], auth['signature']]
    relayed = "SELECT * FROM escrow_calls WHERE deposit_id = :id AND function = 'depositWithAuthorization' " \
              "AND status != 'failed'"
    call = db.row(relayed, {'id': deposit})
    if call is None:
        relay_in_flight(db, auth['payer'])
        reason = onchain.chain.revert_reason(onchain.escrow_address, onchain.contract,
                                             call_data('depositWithAuthorization', *args))     # network
        if reason is not None:
            raise APIError(f'The contract refuses this authorization ({reason}): sign authorizationTypedData with '
                           'the payer\'s wallet, its nonce the deposit id, value the amount asked, validBefore '
                           'ahead.', code='payment_signature_invalid', status=402)
        try:
            with db.transaction():
                call = onchain.store_call(db, 'depositWithAuthorization', args, deposit=deposit,
                                          account_id=account['id'], payer=auth['payer'].lower())
        except apsw.ConstraintError:       # relayed by a request at the same time: this deposit, or this payer's
            call = db.row(relayed, {'id': deposit})
            if call is None:
                relay_in_flight(db, auth['payer'])
                raise
        onchain.broadcast(db)
    try:
        onchain.wait_for_receipt(db, 'escrow_calls', dict(call, tbl='escrow_calls'), RELAY_WAIT_SECONDS)
    except ChainUnavailable:
        return None
    return onchain.confirmed_deposit(deposit)


def relay_in_flight(db, payer):
    """409 payment_pending while another relayed deposit of this payer is in flight (CONTRACT 25): one balance
    backing many authorizations posted at once would make all but one revert, on the service's gas."""
    waiting = db.row("""SELECT deposit_id, tx_hash FROM escrow_calls WHERE function = 'depositWithAuthorization'
                        AND status = 'pending' AND payer = :payer""", {'payer': payer.lower()})
    if waiting is not None:
        raise Conflict(f'Another deposit of the payer {payer} is being relayed ({waiting["tx_hash"]}): post again once '
                       'it is mined (one relayed deposit a payer at a time).', code='payment_pending',
                       headers={'Retry-After': '10'}, extra={'depositId': waiting['deposit_id']})


def fund_from_deposit(svc, fields, body, account):
    """POST /api/jobs on rail base in contract mode (CONTRACT 21): the job is funded by a JobEscrow deposit naming
    the caller's account, the requester's own (escrowDepositId) or made here from the payer's signed authorization
    (escrowAuthorization). Returns (job, created); every payment error carries escrowRequirements."""
    try:
        requirements = escrow_requirements(svc.settings, fields, account)         # network, the first time
    except VerificationError as error:
        raise payment_error(error) from None
    except ValueError as error:     # read late (the node was down at start), the contract is not this server's
        raise Unavailable(str(error), code='chain_unavailable', headers={'Retry-After': '60'}) from None
    try:
        return deposit_job(svc, fields, body, requirements, account)
    except VerificationError as error:
        refusal = payment_error(error)
    except APIError as error:
        if not error.code.startswith('payment_'):
            raise
        refusal = error
    refusal.extra['escrowRequirements'] = requirements
    raise refusal


def deposit_job(svc, fields, body, requirements, account):
    """fund_from_deposit's checks in order; nothing is stored before they pass (but a relayed deposit's call)."""
    onchain, db = svc.settings.onchain, svc.db
    deposit, auth = body.get('escrowDepositId'), body.get('escrowAuthorization')
    if deposit is None and auth is None:
        raise APIError('Fund the job first: deposit into the JobEscrow contract as escrowRequirements says, then '
                       'post again with escrowDepositId; or sign authorizationTypedData and post it as '
                       'escrowAuthorization (the service makes the deposit and pays its gas).',
                       code='payment_required', status=402)
    if deposit is not None and auth is not None:
        raise APIError('Give escrowDepositId or escrowAuthorization, not both.', code='payment_invalid')
    if auth is not None:
        deposit, auth = read_escrow_authorization(auth, requirements)
        if auth['refundAfter'] < requirements['minRefundAfter']:
            raise APIError(f'refundAfter must be at least minRefundAfter ({requirements["minRefundAfter"]}).',
                           code='payment_invalid', fields={'escrowAuthorization.refundAfter': 'too soon'})
    elif not isinstance(deposit, str) or not _BYTES32.fullmatch(deposit):
        raise APIError('escrowDepositId must be a deposit id: 0x and 64 hexadecimal digits.', code='payment_invalid',
                       fields={'escrowDepositId': 'must be 0x and 64 hex digits'})
    deposit = deposit.lower()
    existing = job_funded_by_deposit(db, deposit, account, fields)
    if existing:
        return existing, False
    held = onchain.confirmed_deposit(deposit)                           # network
    if held is None and auth is not None:
        held = relay_deposit(svc, deposit, auth, requirements, account)  # network
    if held is None:
        raise APIError(f'No deposit with this id is {svc.settings.confirmations} block(s) deep in the contract yet: '
                       'post again once it is.', code='payment_pending', status=402,
                       headers={'Retry-After': str(2 * svc.settings.confirmations)})
    if held['account'].lower() != requirements['account']:
        raise APIError('This deposit names another account: a deposit funds only jobs of the account it names.',
                       code='payment_signature_invalid', status=402)
    if held['remaining'] < int(requirements['amount']):
        raise APIError(f'The deposit holds {held["remaining"]} base units; the job needs {requirements["amount"]}.',
                       code='payment_insufficient', status=402)
    if held['refundAfter'] < requirements['minRefundAfter']:
        raise APIError(f'The deposit can be reclaimed at {held["refundAfter"]}, before minRefundAfter '
                       f'({requirements["minRefundAfter"]}): the job could lose its money while it runs.',
                       code='payment_invalid')
    funding = {'tx_hash': None, 'payer': held['payer'], 'to': onchain.contract, 'amount': held['remaining'],
               'deposit_id': deposit}
    try:
        return create_job(db, svc.settings, fields, funding), True
    except apsw.ConstraintError:                               # the same deposit, posted twice at once
        existing = job_funded_by_deposit(db, deposit, account, fields)
        if existing:
            return existing, False
        raise


def release_typed_data(settings, job, claim_id, payee, amount, fee):
    """The Release of a contract job's deposit that its payer and the arbiter both sign to pay `payee` for a claim
    at once (EIP-712 JSON, version 2: it names the claim, CONTRACT 25)."""
    from verifier.escrow import claim_hash, release_typed_data as typed_data
    return typed_data(settings.onchain.contract, settings.chain_id, job['escrow_deposit_id'], claim_hash(claim_id),
                      payee, amount, fee)


def claim_release(db, settings, job, claim):
    """What approving a delivery of a contract job releases: the Release typed data for its worker's share."""
    agent = get_agent(db, claim['agent_id'])
    amount = cents_to_units(claim_share(job), job['currency'])
    fee = release_fee(db, settings, job, amount)
    return release_typed_data(settings, job, claim['id'], agent['wallet_address'], amount - fee, fee)


def contract_release(db, settings, job, claim, agent, amount, fee, signature):
    """Pay a contract job's worker `amount` (and `fee` to the fee recipient, by the same call). With the payer's
    Release `signature` the server's key co-signs that Release (only ever this claim's share to its worker's
    wallet) and sends it after the commit; the claim keeps both signatures as releaseAuthorization, so the worker
    can send it itself (CONTRACT 25). The fee is pending until the release is mined. Without a signature,
    scheduled: the sweep proposes it, and executes it after the contract's delay unless the guardian cancels it."""
    payee, signed = agent['wallet_address'], {'status': 'scheduled'}
    if signature is not None:
        from verifier.escrow import sign_typed_data, typed_data_signer
        typed = release_typed_data(settings, job, claim['id'], payee, amount, fee)
        if (typed_data_signer(typed, signature) or '').lower() != (job['refund_address'] or '-').lower():
            raise APIError("releaseSignature is not the payer's signature of this Release: sign releaseTypedData with "
                           "the wallet that made the deposit (a low-s signature, as wallets make), or approve without "
                           "it (paid after the contract's delay).", code='payment_signature_invalid', status=402,
                           extra={'releaseTypedData': typed})
        arbiter = sign_typed_data(settings.escrow_key, typed)
        deposit, claim_id = job['escrow_deposit_id'], typed['message']['claim']
        raw, tx_hash, nonce = settings.onchain.sign_call(db, 'release', deposit, claim_id, payee, amount, fee,
                                                         signature, arbiter)
        signed = {'status': 'pending', 'tx_hash': tx_hash, 'raw_tx': raw, 'nonce': nonce}
        authorization = {'contract': settings.onchain.contract, 'chainId': settings.chain_id, 'id': deposit,
                         'claim': claim_id, 'payee': typed['message']['payee'], 'amount': str(amount),
                         'fee': str(fee), 'payerSignature': signature, 'arbiterSignature': arbiter}
        db.execute('UPDATE claims SET release_authorization = :authorization WHERE id = :id',
                   {'authorization': orjson.dumps(authorization).decode(), 'id': claim['id']})
    records = [record_payment(db, job, 'release', amount, debit=escrow_account(job['id']),
                              credit=f'worker:{agent["id"]}', recipient=payee, claim_id=claim['id'], **signed)]
    if fee:
        records.append(record_payment(db, job, 'fee', fee, debit=escrow_account(job['id']), credit='fees',
                                      recipient=(settings.onchain.terms or {}).get('feeRecipient', 'operator'),
                                      claim_id=claim['id'], status=signed['status'], tx_hash=signed.get('tx_hash')))
    return records


def escrow_sweep(db, settings):
    """Contract mode, each sweep: propose each deposit's scheduled payments (one proposal pending per deposit),
    execute those whose delay has passed on chain, refund the payer what a cancelled proposal would have paid,
    after reconciling the ledger with the contract's events (reconcile_escrow). {proposed, executed, cancelled,
    reclaimed, reconciled, needingAdmin}. Network I/O."""
    from verifier.escrow import payees_gas
    onchain, result = settings.onchain, dict.fromkeys(('proposed', 'executed', 'cancelled', 'reclaimed'), 0)
    delay = onchain.contract_terms()['arbiterDelay']
    result.update(reconcile_escrow(db, settings))
    for row in db.rows('''SELECT DISTINCT job_id FROM payments p WHERE status = 'scheduled' AND call_id IS NULL
                          AND NOT EXISTS (SELECT 1 FROM payments o WHERE o.job_id = p.job_id
                                          AND o.status = 'scheduled' AND o.call_id IS NOT NULL)'''):
        with db.transaction():
            job = get_job(db, row['job_id'])
            waiting = db.rows('''SELECT * FROM payments WHERE job_id = :id AND status = 'scheduled'
                                 AND call_id IS NULL ORDER BY seq''', {'id': job['id']})
            releases = [payment for payment in waiting if payment['type'] == 'release']
            call = onchain.store_call(
                db, 'propose', [job['escrow_deposit_id'], [payment['recipient'] for payment in releases],
                                [payment['amount'] for payment in releases],
                                sum(payment['amount'] for payment in waiting if payment['type'] == 'fee')],
                deposit=job['escrow_deposit_id'], gas=payees_gas(len(releases)), job_id=job['id'],
                executable_at=iso(now() + timedelta(seconds=delay)))
            db.execute('''UPDATE payments SET call_id = :call, executable_at = :at WHERE job_id = :id
                          AND status = 'scheduled' AND call_id IS NULL''',
                       {'call': call['id'], 'at': call['executable_at'], 'id': job['id']})
        result['proposed'] += 1
    proposals = db.rows('''SELECT * FROM escrow_calls c WHERE function = 'propose' AND status = 'confirmed'
                           AND EXISTS (SELECT 1 FROM payments p WHERE p.call_id = c.id AND p.status = 'scheduled')
                           AND NOT EXISTS (SELECT 1 FROM escrow_calls e WHERE e.proposal_id = c.id
                                           AND e.status != 'failed')''')
    chain_time = onchain.chain.block('latest')['timestamp'] if proposals else None
    for call in proposals:
        proposal = onchain.reader.proposal(call['deposit_id'])
        if proposal is None:        # executed by someone else (anyone may), cancelled, or dropped by a reclaim
            proposed = onchain.chain.receipt(call['tx_hash'])
            if proposed is None:    # reorged away since it was confirmed: nothing to read yet
                log.warning('escrow: the proposal %s of job %s has no receipt now', call['id'], call['job_id'])
                continue
            ended = onchain.reader.proposal_end(call['deposit_id'], proposed['blockNumber'])
            if ended and ended[0] == 'executed':
                with db.transaction():
                    db.execute("""UPDATE payments SET status = 'confirmed', tx_hash = :tx WHERE call_id = :id
                                  AND status = 'scheduled'""", {'tx': ended[1], 'id': call['id']})
            elif ended and ended[0] == 'cancelled':
                proposal_cancelled(db, settings, call)
                result['cancelled'] += 1
        elif proposal['executableAt'] <= chain_time:
            with db.transaction():
                onchain.store_call(db, 'execute', [call['deposit_id']], deposit=call['deposit_id'],
                                   gas=payees_gas(len(proposal['payees'])), job_id=call['job_id'],
                                   proposal_id=call['id'])
            result['executed'] += 1
    return result


def proposal_cancelled(db, settings, call):
    """A proposal cancelled on chain (by the guardian, or the arbiter): what it would have paid is cancelled in the
    ledger, and the payer refunded at once (the guardian stops payouts it does not trust; the payer's money is
    never stuck). The job's escrow ends `refunded`."""
    with db.transaction():
        job = get_job(db, call['job_id'])
        cancel_payments(db, db.rows("SELECT id FROM payments WHERE call_id = :id AND status = 'scheduled'",
                                    {'id': call['id']}))
        refund_escrow(db, settings, job)
        db.execute("UPDATE jobs SET escrow_status = 'refunded', updated_at = :now WHERE id = :id",
                   {'id': job['id'], 'now': now_iso()})
    log.error('escrow: the proposal %s of job %s was cancelled on chain; its payer is refunded', call['id'], job['id'])


def reconcile_escrow(db, settings):
    """The chain is the truth (CONTRACT 25): every event of the contract about a deposit this database knows, read
    --confirmations deep in EVENT_BLOCKS steps from where the last sweep stopped, the ones other people sent
    included, is stored once (escrow_events) and reconciled in a transaction of its own: a reclaim ends its job, a
    payment someone else made is recorded as what it was (record_foreign_payment); then every deposit touched so,
    or whose job needs an admin, is read back (check_deposit). {reclaimed, reconciled, needingAdmin}. Network I/O."""
    onchain, counts = settings.onchain, {'reclaimed': 0, 'reconciled': 0, 'needingAdmin': 0}
    confirmed = onchain.chain.block_number() - settings.confirmations + 1
    start = db.value("SELECT value FROM chain_state WHERE name = 'escrow_events_from'")
    start = confirmed if start is None else start
    end = min(confirmed, start + EVENT_BLOCKS - 1)
    events = onchain.reader.events(start, end) if end >= start else []
    jobs = {row['escrow_deposit_id']: row['id'] for row in db.rows(
        'SELECT id, escrow_deposit_id FROM jobs WHERE escrow_deposit_id IN (SELECT value FROM json_each(:ids))',
        {'ids': json.dumps(sorted({event['id'].lower() for event in events}))})}
    touched = set()
    for event in events:
        job_id = jobs.get(event['id'].lower())
        if job_id is None or event['name'] == 'Deposited':
            continue
        with db.transaction():
            ours = db.value('SELECT 1 FROM signed_transactions WHERE tx_hash = :tx', {'tx': event['txHash']}) is not None
            if not db.execute('''INSERT OR IGNORE INTO escrow_events (tx_hash, log_index, block_number, deposit_id,
                                 name, payee, amount, fee, by_signature, ours) VALUES (:txHash, :logIndex, :blockNumber,
                                 :id, :name, :payee, :amount, :fee, :bySignature, :ours)''',
                              dict(event, id=event['id'].lower(), ours=int(ours))):
                continue        # read before
            job = get_job(db, job_id)
            if event['name'] == 'Reclaimed':
                if db.value("SELECT 1 FROM payments WHERE job_id = :id AND type = 'reclaim'", {'id': job_id}) is None:
                    deposit_reclaimed(db, job, event)
                    counts['reclaimed'] += 1
            elif not ours and event['name'] in ('Released', 'Refunded'):
                record_foreign_payment(db, job, event)
                counts['reconciled'] += 1
            elif not ours and event['name'] == 'Proposed':
                fail_payments(db, job_id, [], f'a proposal this service did not make ({event["txHash"]}): the arbiter '
                              'key was used elsewhere; the guardian can cancel it')
            else:
                continue
        touched.add(job_id)
    with db.transaction():
        db.execute('''INSERT INTO chain_state (name, value) VALUES ('escrow_events_from', :next)
                      ON CONFLICT (name) DO UPDATE SET value = :next''', {'next': max(start, end + 1)})
    flagged = {row['id'] for row in db.rows('SELECT id FROM jobs INDEXED BY jobs_needs_admin '
                                            'WHERE needs_admin IS NOT NULL AND escrow_deposit_id IS NOT NULL')}
    for job_id in sorted(touched | flagged):
        counts['needingAdmin'] += check_deposit(db, settings, job_id, confirmed)
    return counts


def record_foreign_payment(db, job, event):
    """A Released or Refunded that this service did not send, inside the caller's transaction. Our own record of the
    same payment (a worker sending its releaseAuthorization itself, a stranger executing our proposal first, a
    call that reverted and was then made by someone else) becomes `confirmed` with that transaction; anything else
    is recorded as what it was (origin `chain`): a release to its payee (its fee beside it), or a refund."""
    if db.value('SELECT 1 FROM payments WHERE job_id = :id AND tx_hash = :tx AND status = :confirmed',
                {'id': job['id'], 'tx': event['txHash'], 'confirmed': 'confirmed'}):
        return      # an execution's later payees: its first event reconciled them all
    params = {'job': job['id'], 'payee': event['payee'], 'amount': event['amount'], 'fee': event['fee'] or 0,
              'deposit': job['escrow_deposit_id']}
    if event['name'] == 'Refunded':
        ours = db.rows("""SELECT id FROM payments WHERE job_id = :job AND type = 'refund' AND origin IS NULL
                          AND status IN ('pending', 'failed') AND amount = :amount ORDER BY status = 'failed', seq
                          LIMIT 1""", params)
    elif event['bySignature']:
        ours = db.rows("""SELECT r.id FROM payments r WHERE r.job_id = :job AND r.type = 'release' AND r.origin IS NULL
                          AND r.status IN ('pending', 'failed') AND lower(r.recipient) = lower(:payee)
                          AND r.amount = :amount AND :fee = coalesce((SELECT f.amount FROM payments f WHERE
                              f.job_id = r.job_id AND f.claim_id = r.claim_id AND f.type = 'fee'
                              AND f.status = r.status), 0)
                          ORDER BY r.status = 'failed', r.seq LIMIT 1""", params)
        ours += db.rows("""SELECT f.id FROM payments f JOIN payments r ON r.job_id = f.job_id AND r.claim_id = f.claim_id
                           WHERE r.id = :id AND f.type = 'fee' AND f.status = r.status""",
                        {'id': ours[0]['id']}) if ours else []
    else:       # an execution of a proposal of ours that someone else sent first
        ours = db.rows("""SELECT p.id FROM payments p JOIN escrow_calls c ON c.id = p.call_id
                          WHERE p.job_id = :job AND p.status IN ('scheduled', 'failed') AND c.function = 'propose'
                          AND c.status = 'confirmed' AND c.deposit_id = :deposit""", params)
    if ours:
        for payment in ours:
            if db.value("SELECT status = 'failed' FROM payments WHERE id = :id", {'id': payment['id']}):
                restore_entries(db, payment['id'])
            db.execute("""UPDATE payments SET status = 'confirmed', tx_hash = :tx, failure = NULL WHERE id = :id""",
                       {'tx': event['txHash'], 'id': payment['id']})
        log.warning('escrow: job %s: %s by someone else (%s): our record of it is confirmed by that transaction',
                    job['id'], event['name'], event['txHash'])
        return
    recorded = functools.partial(record_payment, db, job, status='confirmed', tx_hash=event['txHash'])
    if event['name'] == 'Refunded':
        payments = [recorded('refund', event['amount'], debit=escrow_account(job['id']),
                             credit=f'funding:{job["requester_id"]}', recipient=event['payee'])]
    else:
        agent = db.row("""SELECT a.id FROM claims c JOIN agents a ON a.id = c.agent_id WHERE c.job_id = :job
                          AND lower(a.wallet_address) = lower(:payee) LIMIT 1""", params)
        payments = [recorded('release', event['amount'], debit=escrow_account(job['id']), recipient=event['payee'],
                             credit=f'worker:{agent["id"]}' if agent else f'wallet:{event["payee"].lower()}')]
        if event['fee']:
            payments.append(recorded('fee', event['fee'], debit=escrow_account(job['id']), credit='fees',
                                     recipient='operator'))
    for payment in payments:
        db.execute("UPDATE payments SET origin = 'chain' WHERE id = :id", {'id': payment['id']})
    log.error('escrow: job %s: %s %s by a transaction this service did not send (%s): recorded as it was',
              job['id'], event['name'], event['amount'], event['txHash'])


def check_deposit(db, settings, job_id, block):
    """Read a contract job's deposit at `block` and compare it with what the job still owes from it (its price less
    what this service itself paid out, refunded or will: every record of ours not failed or cancelled). Less on
    chain: the job needs an admin (the log says why). A job needing an admin no longer does once nothing remains on
    either side (settled), or once the deposit holds what it owes with no failed payment left. 1 when it needs an
    admin after, else 0. Network I/O, then one transaction."""
    job = get_job(db, job_id)
    held = settings.onchain.reader.deposit(job['escrow_deposit_id'], max(block, 0))
    holds = held['remaining'] if held else 0
    owed = db.value("""SELECT coalesce(sum(CASE type WHEN 'escrow' THEN amount ELSE -amount END), 0) FROM payments
                       WHERE job_id = :id AND origin IS NULL AND status NOT IN ('failed', 'cancelled')""", {'id': job_id})
    failed = db.value("SELECT count(*) FROM payments WHERE job_id = :id AND status = 'failed'", {'id': job_id})
    settled = holds == 0 and escrow_balance(db, job_id) == 0
    with db.transaction():
        if holds < owed and not settled:
            why = (f'the deposit holds {holds} base units on chain; the job still owes {owed} from it: money left it '
                   'by a call this service did not make')
            if job['needs_admin'] != why:
                log.error('escrow: job %s needs an admin: %s', job_id, why)
            db.execute('UPDATE jobs SET needs_admin = :why, updated_at = :now WHERE id = :id',
                       {'why': why, 'now': now_iso(), 'id': job_id})
            return 1
        agrees = not failed and not (job['needs_admin'] or '').startswith('a proposal')
        if job['needs_admin'] is not None and (settled or agrees):
            db.execute('UPDATE jobs SET needs_admin = NULL, updated_at = :now WHERE id = :id',
                       {'now': now_iso(), 'id': job_id})
            log.warning('escrow: job %s no longer needs an admin: the chain and the ledger agree', job_id)
            return 0
    return int(job['needs_admin'] is not None)


def restore_entries(db, payment_id):
    """A failed payment made after all: its two ledger entries again (the reversal undone)."""
    db.execute('''INSERT INTO ledger_entries (payment_id, job_id, account, amount, currency, created_at)
                  SELECT payment_id, job_id, account, amount, currency, :now FROM ledger_entries
                  WHERE payment_id = :id ORDER BY id LIMIT 2''', {'id': payment_id, 'now': now_iso()})


def deposit_reclaimed(db, job, reclaim):
    """A job's deposit went back to its payer by `reclaim` on chain (its refundAfter passed): what was scheduled
    and never proposed or executed is cancelled, what the escrow then holds goes back as a `reclaim` record, and a
    job still running ends `expired` (escrow `refunded`), its claims and disputes closed."""
    cancel_payments(db, db.rows("SELECT id FROM payments WHERE job_id = :id AND status = 'scheduled'",
                                {'id': job['id']}))
    record_payment(db, job, 'reclaim', max(0, escrow_balance(db, job['id'])), debit=escrow_account(job['id']),
                   credit=f'funding:{job["requester_id"]}', recipient=job['refund_address'], status='confirmed',
                   tx_hash=reclaim['txHash'])
    status = 'expired' if job['status'] not in FINAL_JOB_STATUSES else job['status']
    end_claims_and_disputes(db, job, 'the JobEscrow contract', 'The deposit was reclaimed by its payer.')
    db.execute("UPDATE jobs SET status = :status, escrow_status = 'refunded', updated_at = :now WHERE id = :id",
               {'status': status, 'now': now_iso(), 'id': job['id']})
    log.warning('escrow: the deposit of job %s was reclaimed on chain (%s)', job['id'], reclaim['txHash'])


def used_payment(db, chain_id, tx_hash):
    """What a transaction hash paid for already (used_payments), or None."""
    return db.row('SELECT * FROM used_payments WHERE chain_id = :chain AND tx_hash = :hash',
                  {'chain': chain_id, 'hash': tx_hash})


###############################################################################
# Validation ##################################################################
###############################################################################

CATEGORIES = ('code', 'content', 'data', 'research', 'design', 'custom')
COMPETITION_MODES = ('first-wins', 'best-wins', 'all-paid')
MAX_BODY = 1024 * 1024
# Digits are ASCII only: \d, int() and Decimal() take any script's digits ('２５', '٢٥'), which money must not.
_MONEY = re.compile(r'^[0-9]{1,9}(\.[0-9]{1,2})?$')
_DECIMAL_NUMBER = re.compile(r'[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]{1,4})?')
_MISSING = object()


def read_money(value):
    """Integer cents from a JSON string such as '25.00', '25.5' or '25'; ValueError otherwise, for a JSON number too
    (CONTRACT 14: money in bodies is a string, so no client's float rounds it)."""
    if not isinstance(value, str) or not _MONEY.match(value.strip()):
        raise ValueError('must be a decimal string with at most two places, e.g. "25.00" (a JSON string, not a number)')
    whole, _, part = value.strip().partition('.')
    return int(whole) * 100 + int(part.ljust(2, '0') or 0)


def read_hundredths(value):
    """Integer hundredths from a number or a decimal string (reputation), ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError('must be a number such as 10 or "10.00"')
    text = str(value).strip()
    if not _DECIMAL_NUMBER.fullmatch(text):
        raise ValueError('must be a number such as 10 or "10.00"')
    try:
        number = Decimal(text)
    except InvalidOperation:
        raise ValueError('must be a number such as 10 or "10.00"') from None
    if not number.is_finite() or number < 0 or number > 1_000_000:
        raise ValueError('must be a number from 0 to 1000000')
    return int((number * 100).to_integral_value(rounding=ROUND_DOWN))


def refuse_json_constant(name):
    raise ValueError(f'{name} is not JSON')


def finite_float(text):
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f'{text} is too large for a JSON number')
    return value


MAX_JSON_DEPTH = 32


_JSON_STRING = re.compile(rb'"[^"]*"')        # once escaped backslashes and quotes are gone
_NOT_BRACKETS = bytes(byte for byte in range(256) if byte not in b'[]{}')
_BRACKET_STEPS = bytes.maketrans(b'[{]}', b'\x01\x01\xff\xff')      # +1 and, read as signed bytes, -1


def utf8_json_nested_deeper_than(raw, limit):
    """Do the bytes of valid UTF-8 JSON nest arrays and objects more than `limit` deep? At C speed (the byte-by-byte
    scan it replaces took 270 ms on 1 MiB; this takes 10 to 50): escapes and strings dropped, only brackets kept,
    each an opening +1 or a closing -1, and the highest running sum is the depth."""
    if raw.count(b'[') + raw.count(b'{') <= limit:
        return False
    unescaped = raw.replace(b'\\\\', b'').replace(b'\\"', b'')       # JSON's escapes pair up from the left
    steps = _JSON_STRING.sub(b'', unescaped).translate(None, _NOT_BRACKETS).translate(_BRACKET_STEPS)
    return max(itertools.accumulate(memoryview(steps).cast('b')), default=0) > limit


def nested_deeper_than(value, limit):
    """Does a parsed JSON value nest arrays and objects more than `limit` deep? (Iterative, with an early exit:
    no recursion however deep.)"""
    level = [value]
    for _ in range(limit):
        level = [child for item in level if isinstance(item, (dict, list))
                 for child in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return False
    return any(isinstance(item, (dict, list)) for item in level)


# Digits runs that long may be integers beyond 64 bits, which orjson reads as floats: json reads those exactly.
_LONG_NUMBER = re.compile(rb'[0-9]{18}')


def parse_json_bytes(raw):
    """The JSON value of a body: orjson (refuses more than 1,024 levels itself, in C) first; json for what orjson
    reads otherwise or refuses (long integers, lone surrogates), so the rules stay json's: no NaN or Infinity,
    no number too large for a float, the last of duplicate keys wins. InvalidJSON when it is not JSON."""
    too_deep = InvalidJSON(f'The request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep.')
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith('depth limit exceeded'):
            raise too_deep from None
        value = _MISSING
    if value is not _MISSING:       # valid UTF-8 JSON
        if utf8_json_nested_deeper_than(raw, MAX_JSON_DEPTH):
            raise too_deep
        if not _LONG_NUMBER.search(raw):
            return value
    try:
        value = json.loads(raw, parse_constant=refuse_json_constant, parse_float=finite_float)
    except RecursionError:
        raise too_deep from None
    except ValueError:
        raise InvalidJSON('The request body is not valid JSON.') from None
    if nested_deeper_than(value, MAX_JSON_DEPTH):
        raise too_deep
    return value


# An answer given before the body was read (a refusal: no key, no right, a rate limit) closes the connection
# rather than read and drop the body (the server's make_server never drains one): a stranger's megabyte costs the
# service nothing. A body that does not arrive in full within --body-timeout, or arrives cut short or malformed,
# is BodyTimedOut (408) or BodyAborted (400) when read.
RAW_BODY = 'marketplace.raw_body'


def read_raw_body():
    """The request body as bytes, as sent: 413 over 1 MiB. Read once: the same bytes again after."""
    if RAW_BODY in request.environ:
        return request.environ[RAW_BODY]
    length = request.content_length
    if length > MAX_BODY:
        raise BodyTooLarge()
    stream = request.environ['wsgi.input']
    raw = stream.read(length) if length >= 0 else stream.read(MAX_BODY + 1)
    if len(raw) > MAX_BODY:
        raise BodyTooLarge()
    request.environ[RAW_BODY] = raw
    return raw


def require_json_content_type():
    """415 unless the body is declared JSON: a browser's cross-site form can send only text/plain, urlencoded or
    multipart bodies, never application/json."""
    media_type = request.environ.get('CONTENT_TYPE', '').partition(';')[0].strip().lower()
    if media_type != 'application/json':
        raise UnsupportedMediaType()


def read_json_body(optional=False):
    """The request body as a dict: 413 over 1 MiB, 400 unless it is one JSON object.

    With `optional`, an empty body is an empty object.
    """
    raw = read_raw_body()
    if not raw.strip():
        if optional:
            return {}
        raise InvalidJSON('The request body is empty; send a JSON object.')
    body = parse_json_bytes(raw)
    if not isinstance(body, dict):
        raise InvalidJSON('The request body must be a JSON object, not a '
                          f'{type(body).__name__.replace("dict", "object")}.')
    return body


class Form:
    """Reads the fields of a JSON body, collecting every problem before refusing the request."""

    def __init__(self, body):
        self.body = body
        self.errors = {}
        self.uuid_errors = set()

    def _raw(self, name, required):
        value = self.body.get(name, _MISSING)
        if value is _MISSING or value is None:
            if required:
                self.errors[name] = 'is required'
            return _MISSING
        return value

    def text(self, name, *, required=False, default=None, max_len=200, allow_empty=False):
        value = self._raw(name, required)
        if value is _MISSING:
            return default
        if not isinstance(value, str):
            self.errors[name] = 'must be a string'
        elif not allow_empty and not value.strip():
            self.errors[name] = 'must not be empty'
        elif len(value) > max_len:
            self.errors[name] = f'must be at most {max_len} characters'
        else:
            return value.strip()
        return default

    def choice(self, name, options, *, required=False, default=None):
        value = self._raw(name, required)
        if value is _MISSING:
            return default
        if value not in options:
            self.errors[name] = f'must be one of {", ".join(options)}'
            return default
        return value

    def integer(self, name, *, default=None, low, high):
        value = self._raw(name, False)
        if value is _MISSING:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            self.errors[name] = f'must be a whole number from {low} to {high}'
            return default
        return value

    def boolean(self, name, *, required=False, default=None):
        value = self._raw(name, required)
        if value is _MISSING:
            return default
        if not isinstance(value, bool):
            self.errors[name] = 'must be true or false'
            return default
        return value

    def uuid(self, name, *, required=False):
        value = self._raw(name, required)
        if value is _MISSING:
            return None
        try:
            return parse_uuid(value, name)
        except InvalidUUID:
            self.errors[name] = 'must be a UUID'
            self.uuid_errors.add(name)
            return None

    def parsed(self, name, reader, *, required=False, default=None):
        """A value read by `reader`, whose ValueError message becomes the field's error."""
        value = self._raw(name, required)
        if value is _MISSING:
            return default
        try:
            return reader(value)
        except ValueError as exc:
            self.errors[name] = str(exc)
            return default

    def done(self):
        """Refuse the request if any field was wrong."""
        if self.errors:
            names = ', '.join(sorted(self.errors))
            if set(self.errors) == self.uuid_errors:
                raise InvalidUUID(f'Not a valid UUID: {names}.', fields=self.errors)
            raise ValidationFailed(f'Some fields are not valid: {names}.', fields=self.errors)


# Characters a name may not hold, by Unicode category: they hide (zero-width, bidirectional overrides), break a
# line, or mean nothing yet (CONTRACT.md 20).
NAME_REFUSED = {'Cc': 'control', 'Cf': 'format (invisible or bidirectional)', 'Co': 'private-use',
                'Cn': 'unassigned', 'Cs': 'surrogate'}


def read_name(value, max_len=100):
    """A name (of an account, agent or arbitrator): NFKC-normalised and trimmed, 1 to `max_len` characters, none of
    them control, format, private-use or unassigned; ValueError otherwise."""
    if not isinstance(value, str):
        raise ValueError('must be a string')
    name = unicodedata.normalize('NFKC', value).strip()
    for char in value + name:
        kind = NAME_REFUSED.get(unicodedata.category(char))
        if kind:
            raise ValueError(f'must not hold {kind} characters (U+{ord(char):04X})')
    if not name:
        raise ValueError('must not be empty')
    if len(name) > max_len:
        raise ValueError(f'must be at most {max_len} characters')
    return name


_PCT, _SUB = r'%[0-9A-Fa-f]{2}', r"[A-Za-z0-9\-._~!$&'()*+,;=]"       # RFC 3986: pct-encoded; unreserved, sub-delims
_PCHAR = rf'(?:{_SUB}|{_PCT}|[:@])'
_URL = re.compile(rf'^https?://(?:(?:{_SUB}|{_PCT}|:)*@)?(?P<host>\[[0-9A-Fa-f:.]+\]|(?:{_SUB}|{_PCT})+)'
                  rf'(?::(?P<port>[0-9]{{1,5}}))?(?:/{_PCHAR}*)*(?:\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?$',
                  re.IGNORECASE)


def read_url(value):
    """An http(s) URL of at most 2048 characters, an RFC 3986 URI (other characters percent-encoded), as the
    document's format "uri" says: every answer that shows it stays valid."""
    if not isinstance(value, str) or len(value) > 2048:
        raise ValueError('must be an http or https URL of at most 2048 characters')
    match = _URL.match(value.strip())
    valid = match is not None and (match['port'] is None or int(match['port']) <= 65535)
    if valid and match['host'].startswith('['):
        try:
            ipaddress.IPv6Address(match['host'][1:-1])
        except ValueError:
            valid = False
    if not valid:
        raise ValueError('must be an http or https URL (RFC 3986: percent-encode spaces, non-ASCII and <>"{}|\\^`)')
    return value.strip()


def read_address(value):
    problem = address_problem(value)
    if problem:
        raise ValueError(problem)
    return value


def read_string_list(options=None, max_items=50, max_len=50):
    """Make a reader of a short array of short strings (from `options`, if given)."""
    def read(value):
        if not isinstance(value, list) or len(value) > max_items:
            raise ValueError(f'must be an array of at most {max_items} strings')
        for item in value:
            if not isinstance(item, str) or not item or len(item) > max_len:
                raise ValueError(f'must hold strings of 1 to {max_len} characters')
            if options and item not in options:
                raise ValueError(f'may hold only {", ".join(options)}')
        return list(dict.fromkeys(value))
    return read


def read_non_negative_number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1e12:
        raise ValueError('must be a number of at least 0')
    return value


MAX_FREEFORM_DEPTH = 8      # requirements, acceptanceCriteria, capabilities, pricing: nesting levels


def json_depth(value):
    """How deep arrays and objects nest in a parsed JSON value (a scalar is 0, {} or [] is 1)."""
    if isinstance(value, dict):
        return 1 + max(map(json_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(json_depth, value), default=0)
    return 0


def read_json_object(max_bytes, max_depth):
    """Make a reader of a JSON object whose encoding fits in max_bytes, nesting at most max_depth deep."""
    def read(value):
        if not isinstance(value, dict):
            raise ValueError('must be an object')
        if len(json.dumps(value)) > max_bytes:
            raise ValueError(f'must be at most {max_bytes} bytes of JSON')
        if json_depth(value) > max_depth:
            raise ValueError(f'must nest objects and arrays at most {max_depth} levels deep')
        return value
    return read


def read_criteria(value):
    """acceptanceCriteria: at most 50 objects, each with string `type` and `check`, 20,000 bytes of JSON in all
    (an item's other keys are kept, so they count)."""
    if not isinstance(value, list) or len(value) > 50:
        raise ValueError('must be an array of at most 50 objects')
    for item in value:
        if not isinstance(item, dict) or not all(
                isinstance(item.get(key), str) and 0 < len(item[key]) <= 2000 for key in ('type', 'check')):
            raise ValueError('each item must be an object with string type and check')
    if len(json.dumps(value)) > 20_000 or json_depth(value) > MAX_FREEFORM_DEPTH:
        raise ValueError(f'must be at most 20000 bytes of JSON, nesting at most {MAX_FREEFORM_DEPTH} levels deep')
    return value


def read_deadline(value):
    if not isinstance(value, str):
        raise ValueError('must be an ISO 8601 time, e.g. 2026-12-01T00:00:00Z')
    try:
        moment = parse_time(value)
    except ValueError:
        raise ValueError('must be an ISO 8601 time, e.g. 2026-12-01T00:00:00Z') from None
    if moment <= now():
        raise ValueError('must be in the future')
    return iso(moment)


def read_capabilities(value):
    if not isinstance(value, dict):
        raise ValueError('must be an object')
    result = dict(value)
    for key, reader in (('categories', read_string_list(CATEGORIES)), ('languages', read_string_list()),
                        ('maxJobValue', read_non_negative_number)):
        if value.get(key) is not None:
            result[key] = reader(value[key])
    if value.get('avgCompletionTime') is not None and not (
            isinstance(value['avgCompletionTime'], str) and len(value['avgCompletionTime']) <= 50):
        raise ValueError('avgCompletionTime must be a short string such as "30m"')
    return read_json_object(10_000, MAX_FREEFORM_DEPTH)(result)


def read_pricing(value):
    if not isinstance(value, dict):
        raise ValueError('must be an object')
    result = dict(value)
    if value.get('minimumJobValue') is not None:
        result['minimumJobValue'] = read_non_negative_number(value['minimumJobValue'])
    if value.get('acceptedCurrencies') is not None:
        result['acceptedCurrencies'] = read_string_list(tuple(DECIMALS))(value['acceptedCurrencies'])
    return read_json_object(10_000, MAX_FREEFORM_DEPTH)(result)


###############################################################################
# Accounts and API keys #######################################################
###############################################################################

def hash_key(key):
    return hashlib.sha256(key.encode('utf-8')).hexdigest()


def create_account(db, name, role='member'):
    """Create an account and its first API key; return (account, key). The key is shown once."""
    account = {'id': new_id(), 'name': name, 'role': role, 'created_at': now_iso()}
    with db.transaction():
        db.insert('accounts', account)
        key = issue_key(db, account['id'])
    return account, key


def issue_key(db, account_id):
    """A new random key for an account; only its SHA-256 hash is stored."""
    key = 'mk_' + secrets.token_urlsafe(32)
    db.insert('api_keys', {'id': new_id(), 'account_id': account_id, 'key_hash': hash_key(key),
                           'prefix': key[:10], 'created_at': now_iso(), 'revoked_at': None})
    return key


def ensure_admin_key(db, key):
    """Make `key` the admin key of the environment (MARKETPLACE_ADMIN_KEY), creating its account the first time,
    and revoke every other key an earlier value of the variable made admin: their sessions end, and their accounts
    are admins no more (unless it is this key's account). The same key again changes nothing."""
    if len(key) < 32:
        raise ValueError('the admin key must be at least 32 characters long')
    digest = hash_key(key)
    with db.transaction():
        row = db.row('SELECT account_id, revoked_at FROM api_keys WHERE key_hash = :h', {'h': digest})
        if row and row['revoked_at']:
            raise ValueError('the admin key was revoked: choose a new one')
        if row:
            account_id = row['account_id']
            db.execute("UPDATE accounts SET role = 'admin' WHERE id = :id AND role != 'admin'", {'id': account_id})
            db.execute('UPDATE api_keys SET from_env = 1 WHERE key_hash = :h AND from_env = 0', {'h': digest})
        else:
            account = {'id': new_id(), 'name': 'admin', 'role': 'admin', 'created_at': now_iso()}
            account_id = account['id']
            db.insert('accounts', account)
            db.insert('api_keys', {'id': new_id(), 'account_id': account['id'], 'key_hash': digest,
                                   'prefix': key[:4] + '…', 'created_at': now_iso(), 'revoked_at': None,
                                   'from_env': 1})
        retired = db.rows('SELECT id, account_id FROM api_keys WHERE from_env = 1 AND revoked_at IS NULL '
                          'AND key_hash != :h', {'h': digest})
        for old in retired:
            revoke_key(db, old['id'])
            if old['account_id'] != account_id:
                db.execute("UPDATE accounts SET role = 'member' WHERE id = :id", {'id': old['account_id']})
    if retired:
        log.warning('revoked %d admin key(s) that MARKETPLACE_ADMIN_KEY named before; their accounts are members '
                    'now and their browser sessions ended', len(retired))


def revoke_key(db, key_id):
    """Revoke a live key (`keys revoke`) and end the browser sessions it opened, in one transaction; was it live?"""
    with db.transaction():
        changed = db.execute('UPDATE api_keys SET revoked_at = :now WHERE id = :id AND revoked_at IS NULL',
                             {'now': now_iso(), 'id': key_id})
        if changed:
            db.execute('DELETE FROM sessions WHERE key_id = :id', {'id': key_id})
    return bool(changed)


def live_key(db, key):
    """(the key's id, its account) for a live key, or (None, None) for an unknown or revoked key."""
    digest = hash_key(key)
    row = db.row('''
        SELECT a.id, a.name, a.role, a.x402_exempt, k.key_hash, k.id AS key_id FROM api_keys k
        JOIN accounts a ON a.id = k.account_id WHERE k.key_hash = :digest AND k.revoked_at IS NULL''',
                 {'digest': digest})
    if row is None or not hmac.compare_digest(row.pop('key_hash'), digest):
        return None, None
    return row.pop('key_id'), row


ACCESS_TOKEN_PREFIX = 'mat_'    # an OAuth access token (oauth.py), taken by the API as a key is (CONTRACT 22)


def account_for_key(db, key):
    """The account of a live key, or of a live OAuth access token (unexpired, its grant not revoked, and the key
    whose session approved the grant not revoked); None otherwise."""
    if not key.startswith(ACCESS_TOKEN_PREFIX):
        return live_key(db, key)[1]
    digest = hash_key(key)
    row = db.row('''SELECT a.id, a.name, a.role, a.x402_exempt, t.token_hash FROM oauth_tokens t
                    JOIN oauth_grants g ON g.id = t.grant_id AND g.revoked_at IS NULL
                    JOIN api_keys k ON k.id = g.key_id AND k.revoked_at IS NULL
                    JOIN accounts a ON a.id = g.account_id
                    WHERE t.token_hash = :digest AND t.kind = 'access' AND t.expires_at > :now''',
                 {'digest': digest, 'now': now_iso()})
    if row is None or not hmac.compare_digest(row.pop('token_hash'), digest):
        return None
    return row


def caller():
    """The account behind the request's API key, or None without a (valid) key."""
    if 'marketplace.account' not in request.environ:
        header = request.get_header('Authorization', '')
        scheme, _, key = header.partition(' ')
        account = None
        if scheme.lower() == 'bearer' and key.strip():
            account = account_for_key(service().db, key.strip())
        request.environ['marketplace.account'] = account
    return request.environ['marketplace.account']


def require_account():
    """The caller's account; 401 when the key is missing, unknown or revoked."""
    account = caller()
    if account is None:
        if request.get_header('Authorization'):
            raise Unauthorized('The API key is unknown or revoked.')
        raise Unauthorized()
    return account


def is_admin(account):
    return account is not None and account['role'] == 'admin'


def forget_sessions(db, settings):
    """Delete the sessions past their lifetime or idle too long; how many."""
    moment = now()
    with db.transaction():
        return db.execute('DELETE FROM sessions WHERE expires_at <= :now OR seen_at <= :idle', {
            'now': iso(moment), 'idle': iso(moment - timedelta(hours=settings.session_idle_hours))})


def x402_pay_to(address, escrow_address):
    """--x402-pay-to checked and checksummed: required, an address, never the escrow address (a deposit could then
    pay a call, and a call's payment fund a job); ValueError otherwise."""
    from verifier.addresses import address_problem, to_checksum_address
    if not address:
        raise ValueError(X402_NEEDS_PAY_TO)
    problem = address_problem(address.strip())
    if problem:
        raise ValueError(f'--x402-pay-to {address.strip()!r} {problem}')
    pay_to = to_checksum_address(address.strip())
    if int(pay_to, 16) == 0:
        raise ValueError('--x402-pay-to is the zero address: USDC refuses transfers to it')
    if pay_to == escrow_address:
        raise ValueError(f'--x402-pay-to is the escrow address {escrow_address}: x402 payments must go elsewhere, so '
                         'that a deposit can never pay a call, nor a call\'s payment fund a job')
    return pay_to


def x402_exempt(account):
    """True for a caller whom x402 prices do not bind: an admin key, or an account an admin marked x402Exempt."""
    return account is not None and (is_admin(account) or bool(account.get('x402_exempt')))


###############################################################################
# Rate limits #################################################################
###############################################################################

# Requests per fixed one-hour window, for each endpoint (method and route template), by the endpoint's class: per
# client address without a key, per key (--keyed-rate-scale times as many) with one (CONTRACT.md 23).
# Every write route has one (tests/test_abuse_edge.py walks ROUTES): Stripe's events are counted too, with room
# for a busy day's retries, so a forged flood costs its sender, not the service.
RATE_LIMITS = {
    'read': 60, 'jobs_create': 20, 'agents_create': 10, 'job_action': 30, 'registration': 10,
    'votes': 30, 'arbitrators': 10, 'webhook_test': 10, 'sweeps': 60, 'pages': 600,
    'decisions': 30, 'account_admin': 30, 'stripe_events': 3600,
    'signin': 30,       # the pages' POST /signin and /signup: API keys are not guessed, accounts not made in bulk
    'oauth': 120,       # POST /oauth/token: codes and refresh tokens exchanged (a host refreshes once an hour)
    'mcp': 600,         # /mcp requests (a tool's own API call counts again, in its class, for the same caller)
    'a2a': 12,          # POST /message:send and /message:stream: 120 an hour per key (each stores a task)
}


def address_group(ip):
    """The group of client addresses that shares a limit: an IPv4 address itself, an IPv6 address its /64
    network ('2001:db8:1:2::/64'), an IPv6 address that carries an IPv4 one in its last 32 bits (IPv4-mapped,
    -compatible, -translated, NAT64: how IPv4 clients reach a server behind a translator) that IPv4 address."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if address.version == 4:
        return str(address)
    if int(address) > 1 and any(address in net for net in IPV4_IN_LAST_32 + [LOCAL_NAT64]):
        return str(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return str(ipaddress.IPv6Network((int(address) >> 64 << 64, 64)))


class RateLimiter:
    """Fixed one-hour windows per (endpoint, caller: an address group or a key), kept in memory."""

    def __init__(self, scale=1.0):
        self.scale = scale
        self.window = None
        self.counts = {}
        self.lock = threading.Lock()

    def hit(self, bucket, client, endpoint='', scale=1.0):
        """Count one request of `client` (an IP, counted by its address_group, or 'key:...') to `endpoint`, limited by
        its class `bucket` times `scale`; return (allowed, headers)."""
        client = client if client.startswith('key:') else address_group(client)
        moment = int(now().timestamp())
        window = moment // 3600
        limit = max(1, int(RATE_LIMITS[bucket] * self.scale * scale))
        with self.lock:
            if window != self.window:
                self.window, self.counts = window, {}
            used = self.counts.get((endpoint or bucket, client), 0)
            allowed = used < limit
            if allowed:
                used = self.counts[(endpoint or bucket, client)] = used + 1
        reset = (window + 1) * 3600
        headers = {'X-RateLimit-Limit': str(limit), 'X-RateLimit-Remaining': str(max(0, limit - used)),
                   'X-RateLimit-Reset': str(reset)}
        if not allowed:
            headers['Retry-After'] = str(max(1, reset - moment))
        return allowed, headers


def client_address(environ, trust_proxy):
    """The client of a request's WSGI environ: the socket's peer, or the last X-Forwarded-For hop with
    --trust-proxy (the address that proxy saw; what came before it, the client may have written)."""
    if trust_proxy:
        forwarded = environ.get('HTTP_X_FORWARDED_FOR', '')
        hops = [hop.strip() for hop in forwarded.split(',') if hop.strip()]
        if hops:
            return hops[-1]
    return environ.get('REMOTE_ADDR', '')


def client_ip():
    """The caller's IP, as the rate limits count it (client_address of this request); for an API call of the MCP
    child (remote_mcp.py), the address of the caller it acts for, which it carries signed (relayed_address)."""
    svc = service()
    return relayed_address(request.environ, svc.relay_secret) or client_address(request.environ,
                                                                                svc.settings.trust_proxy)


def relayed_address(environ, secret):
    """The caller's address an API call from the MCP child carries (X-Marketplace-Relay: 'secret address'), or None
    when it carries none or the secret is not this process's."""
    relayed, _, address = environ.get('HTTP_X_MARKETPLACE_RELAY', '').partition(' ')
    if relayed and hmac.compare_digest(relayed.encode(), secret.encode()):
        return address.strip() or None
    return None


def count_request(bucket):
    """Count this request against its endpoint's limit (its class `bucket`; none: not limited), with the
    X-RateLimit-* headers; 429 over the limit. A caller with a key is counted per key, at --keyed-rate-scale times
    the limit; admins are not counted; an unknown or revoked key is 401 before anything is counted."""
    svc = service()
    if not bucket or svc.settings.rate_limits != 'on':
        return
    account = caller()
    scheme, _, key = request.get_header('Authorization', '').partition(' ')
    key = key.strip() if scheme.lower() == 'bearer' else ''
    if account is None and key:
        raise Unauthorized('The API key is unknown or revoked.')
    if is_admin(account):
        return
    endpoint = f'{"GET" if request.method == "HEAD" else request.method} {route_template()}'
    if account is not None:
        who, scale = 'key:' + hash_key(key)[:32], svc.settings.keyed_rate_scale
    else:
        who, scale = client_ip(), 1.0
    ok, headers = svc.limiter.hit(bucket, who, endpoint, scale)
    for name, value in headers.items():
        response.set_header(name, value)
    if not ok:
        raise RateLimited(f'Too many requests; try again in {headers["Retry-After"]} seconds.',
                          extra={'retryAfter': int(headers['Retry-After'])})


###############################################################################
# Idempotency keys ############################################################
###############################################################################

# A POST or PATCH sent with an Idempotency-Key runs once (CONTRACT.md 14): its answer is stored in the transaction
# of the change it answers (Database.hold) and given back for the same key, method, path and body.
IDEMPOTENCY_KEY = re.compile(r'[\x20-\x7e]{1,255}')
IDEMPOTENCY_KEEP = timedelta(hours=24)
# Routes that ignore the header, and why (tests/test_idempotency.py walks ROUTES for the others).
UNKEYED_ROUTES = {('POST', '/api/stripe/webhook'): 'Stripe sends no Idempotency-Key: its events are applied once by '
                                                  'their event id already.',
                  ('POST', '/mcp'): 'MCP hosts send none: each tool call carries its own Idempotency-Key to the API.',
                  ('POST', '/oauth/register'): 'OAuth clients send none: a registration made twice is two clients.',
                  ('POST', '/oauth/token'): 'OAuth clients send none: a code is used once, a refresh token too.',
                  ('POST', '/message\\:send'): 'A2A clients send none: a message is answered with its own task.',
                  ('POST', '/message\\:stream'): 'A2A clients send none: a message is answered with its own task.',
                  ('POST', '/tasks/<task_id>\\:cancel'): 'A2A clients send none: it changes nothing.'}
# What a replay gives back besides the status and the body; the rate-limit headers are the replay's own.
REPLAYED_HEADERS = ('Content-Type', 'Location', 'X-PAYMENT-RESPONSE', 'PAYMENT-RESPONSE')
# Answers not stored, besides 5xx: 429, and 402, for a call refused for its payment is sent again with a payment
# and the same key. (409 idempotency_in_progress never reaches the store.)
UNSTORED_STATUSES = (402, 429)


class IdempotencyKeyReused(APIError):
    status = 422
    code = 'idempotency_key_reused'
    message = ('This Idempotency-Key was used for another request (another method, path or body) in the last 24 '
               'hours; use a new key for a new request.')


class IdempotencyInProgress(APIError):
    status = 409
    code = 'idempotency_in_progress'
    message = 'The first request with this Idempotency-Key is still running; send it again in a moment.'


def read_idempotency_key(header):
    """The Idempotency-Key as sent, if it is 1 to 255 printable ASCII characters; else 400."""
    if not IDEMPOTENCY_KEY.fullmatch(header):
        raise BadRequest('Idempotency-Key must be 1 to 255 printable ASCII characters (a UUID is a good one).',
                         code='invalid_idempotency_key', fields={'Idempotency-Key': 'must be 1 to 255 printable '
                                                                                    'ASCII characters'})
    return header


def idempotency_scope(account, ip):
    """Whose keys these are: the caller's account, or its address group without a (valid) API key."""
    return f'account:{account["id"]}' if account else f'ip:{address_group(ip)}'


def idempotency_key_hash(scope, key):
    """The row's name: a hash of the scope and the key (the key itself is never stored)."""
    return hashlib.sha256(f'{scope}\n{key}'.encode('utf-8')).hexdigest()


def answer_sealing_key(scope, key):
    """The AES key of a stored answer: HMAC-SHA256 of the scope under the Idempotency-Key, known only to its holder."""
    return hmac.new(key.encode('utf-8'), f'answer\n{scope}'.encode('utf-8'), hashlib.sha256).digest()


def request_fingerprint(method, target, raw):
    """A hash of what a request asks: method, path with query, and the body compared as parsed JSON (keys sorted;
    the bytes themselves when it is not JSON; an empty body as such)."""
    if not raw.strip():
        body = b'empty'
    else:
        try:
            body = b'json:' + orjson.dumps(parse_json_bytes(raw), option=orjson.OPT_SORT_KEYS)
        except (APIError, orjson.JSONEncodeError):      # not JSON, or integers beyond 64 bits: the bytes
            body = b'raw:' + raw
    digest = hashlib.sha256(f'{method} {target}\n'.encode('utf-8'))
    digest.update(body)
    return digest.hexdigest()


def seal_answer(secret, headers, body):
    """AES-GCM of an answer's headers and body: nonce, ciphertext, tag."""
    from Crypto.Cipher import AES
    nonce = secrets.token_bytes(12)
    cipher = AES.new(secret, AES.MODE_GCM, nonce=nonce)
    ciphertext, tag = cipher.encrypt_and_digest(orjson.dumps(headers) + b'\n' + body)
    return nonce + ciphertext + tag


def open_answer(secret, sealed):
    """The (headers, body) of a sealed answer."""
    from Crypto.Cipher import AES
    cipher = AES.new(secret, AES.MODE_GCM, nonce=sealed[:12])
    plain = cipher.decrypt_and_verify(sealed[12:-16], sealed[-16:])
    headers, _, body = plain.partition(b'\n')
    return orjson.loads(headers), body


def stored_answer(db, key_hash):
    return db.row('SELECT * FROM idempotency_keys WHERE key_hash = :hash', {'hash': key_hash})


def store_answer(db, key_hash, fingerprint, status, sealed):
    """Store an answer (in the caller's transaction); ConstraintError when the key has one already."""
    db.insert('idempotency_keys', {'key_hash': key_hash, 'fingerprint': fingerprint, 'status': status,
                                   'sealed': sealed, 'created_at': now_iso()})


def forget_idempotency_keys(db):
    """Delete the answers stored over 24 hours ago; how many (logged)."""
    with db.transaction():
        deleted = db.execute('DELETE FROM idempotency_keys WHERE created_at < :before',
                             {'before': iso(now() - IDEMPOTENCY_KEEP)})
    if deleted:
        log.info('sweep: forgot %d Idempotency-Key answers over 24 hours old', deleted)
    return deleted


class RunningKeys:
    """The keys whose first request is running in this process (another request with one: 409)."""

    def __init__(self):
        self.running = set()
        self.lock = threading.Lock()

    @contextmanager
    def running_once(self, key_hash):
        with self.lock:
            if key_hash in self.running:
                raise IdempotencyInProgress()
            self.running.add(key_hash)
        try:
            yield
        finally:
            with self.lock:
                self.running.discard(key_hash)


###############################################################################
# Agents ######################################################################
###############################################################################

AGENT_SELECT = '''
    SELECT a.*,
        (SELECT count(*) FROM claims c WHERE c.agent_id = a.id AND c.status = 'approved') AS jobs_completed,
        (SELECT count(*) FROM claims c WHERE c.agent_id = a.id
            AND c.status IN ('approved', 'rejected', 'expired')) AS jobs_finished,
        (SELECT coalesce(sum(CASE e.currency WHEN 'USDC' THEN e.amount / 10000 ELSE e.amount END), 0)
            FROM ledger_entries e WHERE e.account = 'worker:' || a.id) AS earned_cents
    FROM agents a'''
AGENT_SORTS = {
    'reputation': 'reputation DESC, created_at ASC',
    'jobs': 'jobs_completed DESC, reputation DESC',
    'earned': 'earned_cents DESC, reputation DESC',
    'newest': 'created_at DESC, rowid DESC',
}


def new_webhook_secret():
    return 'whsec_' + base64.b64encode(secrets.token_bytes(32)).decode('ascii')


WEBHOOK_FORMATS = ('json', 'slack', 'discord', 'telegram')


def service_wallet_problem(address, settings):
    """An agent's wallet must not be the service's own: the escrow address, nor the x402 address (CONTRACT.md 18)."""
    own = {'the escrow address': settings.onchain and settings.onchain.escrow_address,
           'the escrow contract': settings.escrow_contract, 'the x402 payTo address': settings.x402_pay_to}
    for name, wallet in own.items():
        if wallet and wallet.lower() == address.lower():
            return f'must not be {name} of this service'
    return None


def read_agent_body(body, settings, partial=False):
    """Validated agent fields from a POST /api/agents body (with `partial`, a PATCH: only those sent)."""
    form = Form(body)
    agent = {
        'name': form.parsed('name', read_name, required=not partial),
        'description': form.text('description', default='', max_len=2000, allow_empty=True),
        'wallet_address': form.parsed('walletAddress', read_address, required=not partial),
        'webhook_url': form.parsed('webhookUrl', read_url),
        'webhook_format': form.choice('webhookFormat', WEBHOOK_FORMATS, default='json'),
        'capabilities': form.parsed('capabilities', read_capabilities, default={}),
        'pricing': form.parsed('pricing', read_pricing, default={}),
    }
    for field in ('name', 'walletAddress'):
        if partial and field in body and body[field] is None:
            form.errors[field] = 'cannot be removed'
    if agent['webhook_url'] and 'webhookUrl' not in form.errors:
        problem = webhook_url_problem(agent['webhook_url'], settings.allow_private_webhooks, settings.dns_server)
        if problem:
            form.errors['webhookUrl'] = problem
    if agent['wallet_address'] and 'walletAddress' not in form.errors:
        problem = service_wallet_problem(agent['wallet_address'], settings)
        if problem:
            form.errors['walletAddress'] = problem
    form.done()
    if partial:
        names = {'name': 'name', 'description': 'description', 'walletAddress': 'wallet_address',
                 'webhookUrl': 'webhook_url', 'webhookFormat': 'webhook_format', 'capabilities': 'capabilities',
                 'pricing': 'pricing'}
        agent = {column: agent[column] for field, column in names.items() if field in body}
    return agent


def require_unlocked_wallet(db, agent, wallet):
    """409 wallet_locked when an agent with an open claim or dispute would change its wallet (CONTRACT.md 20): the
    claim is paid, and the dispute judged, with the wallet it was made with."""
    if (agent['wallet_address'] or '').lower() == wallet.lower():
        return
    if db.value(f'''SELECT 1 FROM claims c WHERE c.agent_id = :id AND (c.status IN {ACTIVE_CLAIMS}
                        OR EXISTS (SELECT 1 FROM disputes d WHERE d.claim_id = c.id AND d.status = 'open'))''',
                {'id': agent['id']}):
        raise Conflict('The agent holds an open claim or dispute: its walletAddress cannot change until they end.',
                       code='wallet_locked')


def require_agent_room(db, account_id, max_agents):
    """409 too_many_agents when an account has `max_agents` agents already."""
    if db.value('SELECT count(*) FROM agents WHERE account_id = :id', {'id': account_id}) >= max_agents:
        raise Conflict(f'An account may register at most {max_agents} agents.', code='too_many_agents')


def create_agent(db, account_id, fields, max_agents):
    """Register an agent for an account that has fewer than `max_agents` (else 409); return (agent row, webhook
    secret)."""
    moment = now_iso()
    secret = new_webhook_secret()
    row = dict(fields, id=new_id(), account_id=account_id, webhook_secret=secret,
               capabilities=json.dumps(fields['capabilities']), pricing=json.dumps(fields['pricing']),
               reputation=0, created_at=moment, updated_at=moment)
    with db.transaction():
        require_agent_room(db, account_id, max_agents)
        db.insert('agents', row)
        return get_agent(db, row['id']), secret


def get_agent(db, agent_id):
    agent = db.row(AGENT_SELECT + ' WHERE a.id = :id', {'id': agent_id})
    if agent is None:
        raise NotFound('No agent has this id.')
    return agent


def adjust_reputation(db, agent_id, delta, reason, job_id, claim_id):
    """Change an agent's reputation by `delta` hundredths (never below 0) and record it."""
    score = db.value('SELECT reputation FROM agents WHERE id = :id', {'id': agent_id})
    after = max(0, score + delta)
    db.execute('UPDATE agents SET reputation = :after, updated_at = :now WHERE id = :id',
               {'after': after, 'now': now_iso(), 'id': agent_id})
    db.insert('reputation_events', {
        'id': new_id(), 'agent_id': agent_id, 'delta': delta, 'reason': reason, 'job_id': job_id,
        'claim_id': claim_id, 'score_after': after, 'created_at': now_iso()})


def agent_json(agent, viewer=None):
    """An agent as the API shows it; webhookUrl only to its owner or an admin."""
    finished = agent['jobs_finished']
    shown = {
        'id': agent['id'],
        'accountId': agent['account_id'],
        'name': agent['name'],
        'description': agent['description'],
        'walletAddress': agent['wallet_address'],
        'capabilities': orjson.loads(agent['capabilities']),
        'pricing': orjson.loads(agent['pricing']),
        'reputationScore': format_cents(agent['reputation']),
        'jobsCompleted': agent['jobs_completed'],
        'totalEarned': format_cents(agent['earned_cents']),
        'completionRate': round(agent['jobs_completed'] / finished, 4) if finished else 0.0,
        'stripe': agent['stripe_account_id'] and {'accountId': agent['stripe_account_id'],
                                                  'payoutsEnabled': bool(agent['stripe_payouts_enabled'])},
        'createdAt': agent['created_at'],
        'updatedAt': agent['updated_at'],
    }
    if viewer and (viewer['id'] == agent['account_id'] or is_admin(viewer)):
        shown['webhookUrl'] = agent['webhook_url']
        shown['webhookFormat'] = agent['webhook_format']
        shown['webhookEnabled'] = agent['webhook_url'] is not None and agent['webhook_disabled_at'] is None
        shown['webhookStatus'] = webhook_status(agent)
    return shown


def webhook_status(agent):
    """null without a URL; "disabled" after a 410 (until the URL is set again); "paused" after 10 failed attempts in
    a row (until a PATCH sets the URL or a test succeeds); else "active"."""
    if agent['webhook_url'] is None:
        return None
    if agent['webhook_disabled_at']:
        return 'disabled'
    return 'paused' if agent['webhook_paused_at'] else 'active'


def reputation_json(event):
    return {'delta': format_cents(event['delta']), 'reason': event['reason'], 'jobId': event['job_id'],
            'claimId': event['claim_id'], 'scoreAfter': format_cents(event['score_after']),
            'createdAt': event['created_at']}


###############################################################################
# Webhook events: the outbox ##################################################
###############################################################################

FAN_OUT_BATCH = 100         # agents examined per fan-out transaction (a few milliseconds of the database)
FAN_OUT_INLINE = 25         # an event with at most this many agents to examine is expanded in its write's transaction


def webhook_agents(db, where, params):
    """Agents with a live webhook (a URL, not disabled by a 410) among those `where` selects."""
    return db.rows(f'''SELECT a.* FROM agents a WHERE a.webhook_url IS NOT NULL
                       AND a.webhook_disabled_at IS NULL AND {where}''', params)


def claim_holders(db, job_id):
    """The ids of the agents holding claims on a job (with a live webhook)."""
    return [agent['id'] for agent in webhook_agents(
        db, 'a.id IN (SELECT agent_id FROM claims WHERE job_id = :job)', {'job': job_id})]


def agent_wants(agent, job):
    """Does a new job suit an agent (CONTRACT.md 11)? Its category among theirs (none listed: all), its pay within
    their maxJobValue, its currency accepted."""
    capabilities, pricing = json.loads(agent['capabilities']), json.loads(agent['pricing'])
    categories, ceiling = capabilities.get('categories'), capabilities.get('maxJobValue')
    currencies = pricing.get('acceptedCurrencies')
    return ((not categories or job['category'] in categories)
            and (ceiling is None or job['amount_cents'] <= Decimal(str(ceiling)) * 100)
            and (not currencies or job['currency'] in currencies))


def agents_wanting(db, job, *, after='', registered_by=None, limit=FAN_OUT_BATCH):
    """The agents a new job suits, never the requester's own, in id order after `after` (registered at or before
    `registered_by`, at most `limit` examined, up to FAN_OUT_BATCH): (their ids, the last id examined or None when
    none was left, how many were examined). The statement's LIMIT is one of two constants (a post's look at a few,
    a fan-out batch): a bound one makes SQLite prepare the statement again at every run (40 us, more than the
    search itself when no agent has a webhook)."""
    rows = FAN_OUT_INLINE if limit <= FAN_OUT_INLINE else FAN_OUT_BATCH
    examined = webhook_agents(db, f'''a.account_id != :requester AND a.id > :after
                                      AND (:registered_by IS NULL OR a.created_at <= :registered_by)
                                      ORDER BY a.id LIMIT {rows}''',
                              {'requester': job['requester_id'], 'after': after, 'registered_by': registered_by})
    examined = examined[:limit]
    return ([agent['id'] for agent in examined if agent_wants(agent, job)],
            examined[-1]['id'] if examined else None, len(examined))


def queue_event(db, settings, event, job_id, recipients=None, *, agent_id=None, amount=None, tx_hash=None, job=None):
    """Write one event into the outbox, inside the caller's transaction: its body now (the job's status after the
    change; `job`: the job's row as the caller just wrote it, else read here). `recipients` are agent ids; None: the
    agents the job suits. A small audience (at most FAN_OUT_INLINE agents to look at or to tell) gets its deliveries
    here, in the same transaction, the event marked expanded: no second transaction for most writes. A larger one
    is left to fan_out_events, in batches.

    The body is SPEC.md's: {type, timestamp, data: {jobId, title, category, amount, currency, agentId,
    status (the job's, after the change), txHash, jobUrl}}; agentId is the agent the event is about,
    or the recipient itself for job.new and job.expired.
    """
    if recipients is not None and not recipients:
        return                          # nobody to tell
    job = job or db.row('SELECT * FROM jobs WHERE id = :id', {'id': job_id})
    moment = now_iso()
    body = {'type': event, 'timestamp': moment, 'data': {
        'jobId': job['id'], 'title': job['title'], 'category': job['category'],
        'amount': amount or format_cents(job['amount_cents']), 'currency': job['currency'],
        'agentId': agent_id, 'status': job['status'], 'txHash': tx_hash,
        'jobUrl': f'{settings.base_url}/jobs/{job["id"]}'}}
    row = {'event': event, 'job_id': job_id, 'payload': json.dumps(body), 'created_at': moment,
           'recipients': None if recipients is None else json.dumps(list(recipients)), 'expanded_at': None}
    if recipients is None:
        wanting, _, examined = agents_wanting(db, job, registered_by=moment, limit=FAN_OUT_INLINE)
        ready = wanting if examined < FAN_OUT_INLINE else None      # every agent there is was looked at
    else:
        ready = list(recipients) if len(recipients) <= FAN_OUT_INLINE else None
    if ready is not None:
        row['expanded_at'] = moment
        if ready:
            add_deliveries(db, row, ready, body)
    db.insert('webhook_events', row)


def add_deliveries(db, event, recipients, body=None):
    """One pending delivery per recipient of an outbox event, due at the event's time (inside a transaction); a
    paused agent's waits for its resumption (next_attempt_at null). `body`: the event's payload, parsed."""
    body = body or json.loads(event['payload'])
    held = {row['id'] for row in db.rows('''SELECT a.id FROM json_each(:ids) r JOIN agents a ON a.id = r.value
                                            WHERE a.webhook_paused_at IS NOT NULL''', {'ids': json.dumps(recipients)})}
    for recipient in recipients:
        paused = recipient in held
        addressed = dict(body, data=dict(body['data'], agentId=body['data']['agentId'] or recipient))
        db.insert('webhook_deliveries', {
            'id': new_id(), 'agent_id': recipient, 'event': event['event'], 'payload': json.dumps(addressed),
            'status': 'pending', 'attempts': 0, 'last_status_code': None, 'last_error': None,
            'next_attempt_at': None if paused else event['created_at'], 'created_at': event['created_at'],
            'updated_at': now_iso(), 'delivered_at': None})


def fan_out_step(db, batch=FAN_OUT_BATCH):
    """Expand the oldest outbox events by one batch of agents, in one transaction with their progress (so each
    recipient gets its delivery exactly once, crash or not): an event left unfinished ends the step, and one
    finished within the batch lets the next in, each counting as at least one agent (events that reach few
    agents, as most do, share a transaction and its commit); False when no event is left."""
    if not db.value('SELECT 1 FROM webhook_events WHERE expanded_at IS NULL LIMIT 1'):
        return False                # most requests queue nothing: no write transaction for them
    with db.transaction():
        budget, expanded = batch, 0
        while budget > 0:
            event = db.row('SELECT * FROM webhook_events WHERE expanded_at IS NULL ORDER BY seq LIMIT 1')
            if event is None:
                break
            expanded += 1
            if event['recipients'] is not None:
                recipients = json.loads(event['recipients'])
                add_deliveries(db, event, recipients)
                done, cost = True, len(recipients)
            else:
                job = db.row('SELECT * FROM jobs WHERE id = :id', {'id': event['job_id']})
                wanting, last, cost = agents_wanting(db, job, after=event['expanded_through'],
                                                     registered_by=event['created_at'], limit=budget)
                add_deliveries(db, event, wanting)
                done = last is None
                if last is not None:
                    db.execute('UPDATE webhook_events SET expanded_through = :last WHERE seq = :seq',
                               {'last': last, 'seq': event['seq']})
            if not done:
                break
            db.execute('UPDATE webhook_events SET expanded_at = :now WHERE seq = :seq',
                       {'now': now_iso(), 'seq': event['seq']})
            budget -= max(1, cost)
    return expanded > 0


def fan_out_events(db, pause=None, batch=FAN_OUT_BATCH):
    """Expand every outbox event into its deliveries, batch by batch, calling `pause` between batches (the
    server yields to other greenlets there); the number of batches run."""
    steps = 0
    while fan_out_step(db, batch):
        steps += 1
        if pause:
            pause()
    return steps


def resume_webhook(db, agent_id):
    """Resume a paused receiver (inside a transaction): its failure count back to 0, its held deliveries due."""
    moment = now_iso()
    db.execute('''UPDATE agents SET webhook_failures = 0, webhook_paused_at = NULL, updated_at = :now
                  WHERE id = :id''', {'now': moment, 'id': agent_id})
    db.execute('''UPDATE webhook_deliveries SET next_attempt_at = :now, updated_at = :now
                  WHERE agent_id = :id AND status = 'pending' AND next_attempt_at IS NULL''',
               {'now': moment, 'id': agent_id})


###############################################################################
# Jobs and claims #############################################################
###############################################################################

JOB_COLUMNS = f'''j.*, (SELECT count(*) FROM claims c WHERE c.job_id = j.id
                 AND c.status IN {ACTIVE_CLAIMS}) AS claim_count'''
JOB_SELECT = f'SELECT {JOB_COLUMNS} FROM jobs j'
JOB_SORTS = {
    'newest': 'j.seq DESC',
    'oldest': 'j.seq ASC',
    'pay_desc': 'j.amount_cents DESC, j.seq DESC',
    'pay_asc': 'j.amount_cents ASC, j.seq DESC',
    'deadline': 'j.deadline ASC, j.seq ASC',      # equal deadlines: the job posted first (index order)
}
JOB_STATUSES = ('open', 'claimed', 'delivered', 'disputed') + FINAL_JOB_STATUSES


def read_job_body(body, account):
    """Validated job fields from a POST /api/jobs body, with the defaults filled in."""
    form = Form(body)
    currency = form.choice('paymentCurrency', tuple(DECIMALS), default='USDC')
    job = {
        'title': form.text('title', required=True, max_len=200),
        'description': form.text('description', required=True, max_len=20_000),
        'category': form.choice('category', CATEGORIES, required=True),
        'amount_cents': form.parsed('paymentAmount', read_money, required=True),
        'currency': currency,
        'rail': form.choice('paymentRail', tuple(RAILS.values()), default=RAILS.get(currency)),
        'requester_id': form.uuid('requesterId') or account['id'],
        'requirements': form.parsed('requirements', read_json_object(20_000, MAX_FREEFORM_DEPTH), default={}),
        'acceptance_criteria': form.parsed('acceptanceCriteria', read_criteria, default=[]),
        'max_workers': form.integer('maxWorkers', default=1, low=1, high=100),
        'competition_mode': form.choice('competitionMode', COMPETITION_MODES, default='first-wins'),
        'deadline': form.parsed('deadline', read_deadline, required=True),
        'verification_window_hours': form.integer('verificationWindowHours', default=24, low=1, high=720),
        'claim_timeout_hours': form.integer('claimTimeoutHours', default=24, low=1, high=720),
        'min_reputation': form.parsed('minReputation', read_hundredths, default=0),
    }
    if job['amount_cents'] is not None and not 0 < job['amount_cents'] <= MAX_PAYMENT_CENTS:
        form.errors['paymentAmount'] = 'must be more than 0.00 and at most 1000000.00'
    elif (job['competition_mode'] == 'all-paid' and job['amount_cents'] and job['max_workers']
          and job['amount_cents'] < job['max_workers']):     # a share of 0.00 would pay nothing for reputation
        form.errors['paymentAmount'] = (f'must be at least 0.01 per worker in all-paid mode '
                                        f'({format_cents(job["max_workers"])} for {job["max_workers"]} workers)')
    if currency and job['rail'] and RAILS[currency] != job['rail']:
        form.errors['paymentRail'] = f'{currency} is paid only on rail {RAILS[currency]}'
    form.done()
    if job['requester_id'] != account['id']:
        if not is_admin(account):
            raise Forbidden('Only an admin may post a job on behalf of another requester.')
    return job


def create_job(db, settings, fields, funding=None, checkout=None):
    """Create an open job and lock its price in escrow, in one transaction. On chain, `funding` is the checked
    transfer {tx_hash, payer, to, amount}: its hash is used up here, and its payer gets any refunds. In stripe
    mode, `checkout` is the Checkout Session {id, url, expires_at} opened for the job (fields carry its id): the
    job waits as pending_payment, nothing locked and nobody told, until the payment opens it (open_paid_job)."""
    moment = now_iso()
    job = dict(fields, id=fields.get('id') or new_id(), status='open', escrow_status='locked',
               escrow_tx_hash=funding and funding['tx_hash'], refund_address=funding and funding['payer'],
               escrow_deposit_id=funding and funding.get('deposit_id'),
               requirements=json.dumps(fields['requirements']),
               acceptance_criteria=json.dumps(fields['acceptance_criteria']),
               created_at=moment, updated_at=moment)
    if checkout:
        job.update(status='pending_payment', escrow_status='pending', stripe_session_id=checkout['id'],
                   checkout_url=checkout['url'], checkout_expires_at=checkout['expires_at'])
    with db.transaction():
        if not db.value('SELECT 1 FROM accounts WHERE id = :id', {'id': job['requester_id']}):
            raise NotFound('No account has this id (requesterId).')
        job = dict(db.insert('jobs', job, returning=True), claim_count=0)     # as get_job reads it: no claims yet
        if funding and funding['tx_hash']:        # a deposit is used up by jobs.escrow_deposit_id (unique)
            db.insert('used_payments', {'chain_id': settings.chain_id, 'tx_hash': funding['tx_hash'],
                                        'purpose': 'escrow', 'account_id': job['requester_id'],
                                        'job_id': job['id'], 'created_at': moment})
        if not checkout:
            lock_escrow(db, job, funding)
            queue_event(db, settings, 'job.new', job['id'], job=job)
        return job


def get_job(db, job_id):
    job = db.row(JOB_SELECT + ' WHERE j.id = :id', {'id': job_id})
    if job is None:
        raise NotFound('No job has this id.')
    return job


def get_claim(db, job_id, claim_id):
    """A claim of this job, or 404."""
    claim = db.row('SELECT * FROM claims WHERE id = :id AND job_id = :job', {'id': claim_id, 'job': job_id})
    if claim is None:
        raise NotFound('This job has no claim with this id.')
    return claim


def require_open_deadline(job):
    if job['deadline'] <= now_iso():
        raise Conflict('The job is past its deadline.', code='deadline_passed')


def require_requester(job, account):
    if account['id'] != job['requester_id'] and not is_admin(account):
        raise Forbidden("Only the job's requester (or an admin) may do that.")


def paid_claims(db, job_id):
    """How many of the job's claims were approved (paid)."""
    return db.value("SELECT count(*) FROM claims WHERE job_id = :id AND status = 'approved'", {'id': job_id})


def active_claims(db, job_id):
    """How many of the job's claims hold a worker slot (claimed, delivered or disputed)."""
    return db.value(f'SELECT count(*) FROM claims WHERE job_id = :id AND status IN {ACTIVE_CLAIMS}', {'id': job_id})


def slots_taken(db, job):
    """Worker slots in use: active claims, plus paid ones in all-paid mode (each share is paid once)."""
    taken = active_claims(db, job['id'])
    if job['competition_mode'] == 'all-paid':
        taken += paid_claims(db, job['id'])
    return taken


def live_job_status(db, job):
    """What an unfinished job's status is, from its claims."""
    statuses = {row['status'] for row in db.rows(
        f'SELECT status FROM claims WHERE job_id = :id AND status IN {ACTIVE_CLAIMS}', {'id': job['id']})}
    if 'disputed' in statuses:
        return 'disputed'
    if 'delivered' in statuses:
        return 'delivered'
    return 'claimed' if slots_taken(db, job) >= job['max_workers'] else 'open'


def set_job_status(db, job_id, status, escrow_status=None):
    """Change a job's status (and its escrow's); while its escrow is held (hold_escrow), the escrow's new status is
    the one it takes when the hold lifts."""
    db.execute('''UPDATE jobs SET status = :status,
                  escrow_status = CASE WHEN escrow_status = 'held' THEN 'held'
                                       ELSE coalesce(:escrow, escrow_status) END,
                  escrow_unheld = CASE WHEN escrow_status = 'held' THEN coalesce(:escrow, escrow_unheld) END,
                  updated_at = :now WHERE id = :id''',
               {'status': status, 'escrow': escrow_status, 'now': now_iso(), 'id': job_id})


def set_claim_status(db, claim_id, status, **extra):
    """Change a claim's status (and the columns named in `allowed`)."""
    allowed = {'deliverable', 'delivered_at', 'verified_at', 'auto_approved', 'verification_reason'}
    assert set(extra) <= allowed
    assignments = ''.join(f', {name} = :{name}' for name in extra)
    db.execute(f'UPDATE claims SET status = :status, updated_at = :now{assignments} WHERE id = :id',
               dict(extra, status=status, now=now_iso(), id=claim_id))


def finish_job(db, settings, job, unpaid_status):
    """End a job: refund what its escrow still holds; `completed` if anyone was paid, else unpaid_status."""
    refund = refund_escrow(db, settings, job)
    paid = paid_claims(db, job['id'])
    set_job_status(db, job['id'], 'completed' if paid else unpaid_status, 'released' if paid else 'refunded')
    return refund


def claim_job(db, settings, job_id, agent_id, account):
    """Claim a job for an agent the caller owns; return the claim."""
    with db.transaction():
        job = get_job(db, job_id)
        agent = get_agent(db, agent_id)
        if agent['account_id'] != account['id']:
            raise Forbidden('You can claim only with an agent your account owns.')
        if job['requester_id'] == agent['account_id']:
            raise Forbidden('An agent cannot claim a job its own account posted.', code='own_job')
        # A multi-worker job with a delivery or a dispute waiting still takes claims in its free slots.
        takes_claims = ('open', 'claimed', 'delivered', 'disputed') if job['max_workers'] > 1 else ('open', 'claimed')
        if job['status'] not in takes_claims:
            raise Conflict(f'The job is {job["status"]} and takes no more claims.', code='job_not_open')
        require_open_deadline(job)
        # an account whose agent let a claim time out may not take the slot again with any of its agents: it would
        # freeze the job once more (CONTRACT.md 20, one account, one squat)
        if db.value('''SELECT 1 FROM claims c JOIN agents a ON a.id = c.agent_id
                       WHERE c.job_id = :job AND a.account_id = :account AND c.status = 'expired' ''',
                    {'job': job_id, 'account': agent['account_id']}):
            raise Conflict('An agent of your account let a claim on this job expire: your account may not claim it '
                           'again.', code='claim_expired')
        if db.value('''SELECT 1 FROM claims WHERE job_id = :job AND agent_id = :agent
                       AND status IN ('claimed', 'delivered', 'disputed', 'approved')''',
                    {'job': job_id, 'agent': agent_id}):
            raise Conflict('This agent already holds a claim on the job (or was paid for it).', code='already_claimed')
        if slots_taken(db, job) >= job['max_workers']:
            raise Conflict('Every worker slot of this job is taken.', code='already_claimed')
        if agent['reputation'] < job['min_reputation']:
            raise Forbidden(f'The job needs a reputation of {format_cents(job["min_reputation"])}; the '
                            f'agent has {format_cents(agent["reputation"])}.', code='insufficient_reputation')
        moment = now_iso()
        claim = {'id': new_id(), 'job_id': job_id, 'agent_id': agent_id, 'status': 'claimed',
                 'deliverable': None, 'delivered_at': None, 'verified_at': None, 'verification_reason': None,
                 'auto_approved': 0,
                 'created_at': moment, 'updated_at': moment}
        db.insert('claims', claim)
        set_job_status(db, job_id, live_job_status(db, job))
        queue_event(db, settings, 'job.claimed', job_id, claim_holders(db, job_id), agent_id=agent_id)
    return claim


def deliver_claim(db, settings, job_id, claim_id, deliverable, account):
    """Attach a deliverable to a claim the caller's agent holds; return (claim, job)."""
    with db.transaction():
        job = get_job(db, job_id)
        claim = get_claim(db, job_id, claim_id)
        owner = db.value('SELECT account_id FROM agents WHERE id = :id', {'id': claim['agent_id']})
        if owner != account['id']:
            raise Forbidden("Only the owner of the claim's agent may deliver.")
        if claim['status'] != 'claimed':
            raise Conflict(f'The claim is {claim["status"]}; only a claimed claim can deliver.',
                           code='already_delivered')
        require_open_deadline(job)
        set_claim_status(db, claim_id, 'delivered', deliverable=json.dumps(deliverable),
                         delivered_at=now_iso())
        set_job_status(db, job_id, live_job_status(db, job))
        queue_event(db, settings, 'job.delivered', job_id, claim_holders(db, job_id), agent_id=claim['agent_id'])
        return get_claim(db, job_id, claim_id), get_job(db, job_id)


REPUTATION = {
    'approved': (100, 'delivery approved'),
    'rejected': (-25, 'delivery rejected'),
    'dispute_won': (150, 'dispute won'),
    'dispute_lost': (-100, 'dispute lost'),
    'expired': (-50, 'claim expired without delivery'),
}


def claim_share(job):
    """The cents an approved delivery is paid: the price, or in all-paid mode paymentAmount / maxWorkers, rounded
    down to the cent."""
    return job['amount_cents'] // job['max_workers'] if job['competition_mode'] == 'all-paid' else job['amount_cents']


def approve_claim(db, settings, job, claim, *, auto=False, rule='approved', reason=None, release_signature=None):
    """Pay a delivered (or disputed) claim and, unless more all-paid shares remain, finish the job.

    first-wins and best-wins pay the whole price to one claim and supersede the others; while another
    claim of such a job is under dispute its escrow is spoken for, so the approval waits (409).
    all-paid pays each approved claim its share (claim_share). In contract mode `release_signature`, the payer's
    Release, pays at once; without it the payment is scheduled (contract_release).
    """
    if job['competition_mode'] != 'all-paid' and db.value(
            "SELECT 1 FROM claims WHERE job_id = :job AND status = 'disputed' AND id != :claim",
            {'job': job['id'], 'claim': claim['id']}):
        raise Conflict('Another delivery of this job is under dispute; approve after it is resolved.',
                       code='dispute_open')
    agent = get_agent(db, claim['agent_id'])
    verified = now_iso()        # the verdict comes before the payment it makes (the job's timeline shows that order)
    release = release_to_worker(db, settings, job, claim, agent, cents_to_units(claim_share(job), job['currency']),
                                release_signature)[0]
    set_claim_status(db, claim['id'], 'approved', verified_at=verified, auto_approved=int(auto),
                     verification_reason=reason)
    adjust_reputation(db, agent['id'], *REPUTATION[rule], job['id'], claim['id'])
    if job['competition_mode'] != 'all-paid' or paid_claims(db, job['id']) >= job['max_workers']:
        db.execute('''UPDATE claims SET status = 'superseded', updated_at = :now WHERE job_id = :id
                      AND status IN ('claimed', 'delivered')''', {'id': job['id'], 'now': now_iso()})
        finish_job(db, settings, job, 'completed')
    else:
        refresh_multi_worker_job(db, settings, job, 'completed')
    holders = claim_holders(db, job['id'])
    queue_event(db, settings, 'payment.released', job['id'], holders, agent_id=agent['id'],
                amount=format_units(release['amount'], job['currency']), tx_hash=release['tx_hash'])
    if db.value('SELECT status FROM jobs WHERE id = :id', {'id': job['id']}) == 'completed':
        queue_event(db, settings, 'job.completed', job['id'], holders, agent_id=agent['id'])


def refresh_multi_worker_job(db, settings, job, unpaid_status):
    """After one claim of a multi-worker job ends: past the deadline with no active claim left the
    job ends now (as the expiry sweep would end it), otherwise its status follows its claims."""
    if job['deadline'] <= now_iso() and not active_claims(db, job['id']):
        finish_job(db, settings, job, unpaid_status)
    else:
        set_job_status(db, job['id'], live_job_status(db, job))


def reject_claim(db, settings, job, claim, *, rule='rejected', unpaid_status='rejected', reason=None):
    """Refuse a delivered (or disputed) claim.

    A single-worker job ends (`unpaid_status`, escrow refunded). A multi-worker job frees the slot and
    stays open until its deadline; past the deadline with no active claim left, it ends now.
    """
    set_claim_status(db, claim['id'], 'rejected', verified_at=now_iso(), verification_reason=reason)
    adjust_reputation(db, claim['agent_id'], *REPUTATION[rule], job['id'], claim['id'])
    if job['max_workers'] == 1:
        finish_job(db, settings, job, unpaid_status)
    else:
        refresh_multi_worker_job(db, settings, job, unpaid_status)


def verify_claim(db, settings, job_id, claim_id, approved, account, reason=None, release_signature=None):
    """The requester's verdict on a delivery; return (job, claim, payments made)."""
    with db.transaction():
        job = get_job(db, job_id)
        require_requester(job, account)
        claim = get_claim(db, job_id, claim_id)
        if claim['status'] != 'delivered':
            raise Conflict(f'The claim is {claim["status"]}; only a delivered claim can be verified.',
                           code='claim_not_delivered')
        before = db.value('SELECT max(seq) FROM payments')
        if approved:
            approve_claim(db, settings, job, claim, reason=reason, release_signature=release_signature)
        else:
            reject_claim(db, settings, job, claim, reason=reason)
        payments = new_payments(db, job_id, before)
        return get_job(db, job_id), get_claim(db, job_id, claim_id), payments


def new_payments(db, job_id, after_seq):
    """The job's payment records written after a given seq."""
    return db.rows('SELECT * FROM payments WHERE job_id = :id AND seq > :after ORDER BY seq',
                   {'id': job_id, 'after': after_seq or 0})


def cancel_job(db, settings, job_id, account):
    """Cancel a job nobody holds a claim on, refunding its escrow."""
    with db.transaction():
        job = get_job(db, job_id)
        require_requester(job, account)
        if job['status'] != 'open' or job['claim_count'] or paid_claims(db, job_id):
            raise Conflict(f'The job is {job["status"]} with {job["claim_count"]} active claim(s); only an '
                           'open job with no active claim and nothing paid can be cancelled.',
                           code='job_not_open')
        finish_job(db, settings, job, 'cancelled')
        return get_job(db, job_id)


def claim_due(job, claim):
    """When a claim times out if it has not delivered: claimTimeoutHours after it was made (as CLAIM_DUE_SQL)."""
    return iso(parse_time(claim['created_at']) + timedelta(hours=job['claim_timeout_hours']))


def expire_claim(db, job, claim):
    """End a claim that never delivered, inside the caller's transaction: `expired`, with the expiry penalty;
    its slot frees and the job's status follows its claims."""
    set_claim_status(db, claim['id'], 'expired')
    adjust_reputation(db, claim['agent_id'], *REPUTATION['expired'], job['id'], claim['id'])
    set_job_status(db, job['id'], live_job_status(db, job))


def release_claim(db, job_id, claim_id, account):
    """The requester (or an admin) ends a claim that timed out without delivering, before the sweep would;
    return (claim, job)."""
    with db.transaction():
        job = get_job(db, job_id)
        require_requester(job, account)
        claim = get_claim(db, job_id, claim_id)
        if claim['status'] != 'claimed':
            raise Conflict(f'The claim is {claim["status"]}; only a claim still waiting for its delivery can be '
                           'released.', code='claim_not_claimed')
        due = claim_due(job, claim)
        if due > now_iso():
            raise Conflict(f'The claim has until {due} to deliver (claimTimeoutHours: {job["claim_timeout_hours"]}).',
                           code='claim_not_overdue')
        expire_claim(db, job, claim)
        return get_claim(db, job_id, claim_id), get_job(db, job_id)


def money_sql(column):
    """SQL of format_cents: integer hundredths as a decimal string with two places."""
    return (f"printf('%s%d.%02d', CASE WHEN {column} < 0 THEN '-' ELSE '' END, abs({column}) / 100, "
            f"abs({column}) % 100)")


# A job as the API shows it, field by field: its name, the SQL that renders it from a row of JOB_SELECT (job
# lists are rendered to JSON by SQLite itself: building 50 dicts and encoding them took most of a list's time,
# make bench), and the same in Python (job_json). tests/test_jobs.py checks that the two always agree.
JOB_FIELDS = (
    ('id', 'j.id', lambda job, base: job['id']),
    ('status', 'j.status', lambda job, base: job['status']),
    ('title', 'j.title', lambda job, base: job['title']),
    ('description', 'j.description', lambda job, base: job['description']),
    ('category', 'j.category', lambda job, base: job['category']),
    ('paymentAmount', money_sql('j.amount_cents'), lambda job, base: format_cents(job['amount_cents'])),
    ('paymentCurrency', 'j.currency', lambda job, base: job['currency']),
    ('paymentRail', 'j.rail', lambda job, base: job['rail']),
    ('requesterId', 'j.requester_id', lambda job, base: job['requester_id']),
    ('requirements', 'json(j.requirements)', lambda job, base: orjson.loads(job['requirements'])),
    ('acceptanceCriteria', 'json(j.acceptance_criteria)', lambda job, base: orjson.loads(job['acceptance_criteria'])),
    ('maxWorkers', 'j.max_workers', lambda job, base: job['max_workers']),
    ('competitionMode', 'j.competition_mode', lambda job, base: job['competition_mode']),
    ('deadline', 'j.deadline', lambda job, base: job['deadline']),
    ('verificationWindowHours', 'j.verification_window_hours', lambda job, base: job['verification_window_hours']),
    ('claimTimeoutHours', 'j.claim_timeout_hours', lambda job, base: job['claim_timeout_hours']),
    ('minReputation', money_sql('j.min_reputation'), lambda job, base: format_cents(job['min_reputation'])),
    ('escrowStatus', 'j.escrow_status', lambda job, base: job['escrow_status']),
    ('escrowTxHash', 'j.escrow_tx_hash', lambda job, base: job['escrow_tx_hash']),
    ('escrowDepositId', 'j.escrow_deposit_id', lambda job, base: job['escrow_deposit_id']),
    ('needsAdmin', "json(CASE WHEN j.escrow_status = 'held' OR j.needs_admin IS NOT NULL THEN 'true' ELSE 'false' END)",
     lambda job, base: job['escrow_status'] == 'held' or job['needs_admin'] is not None),
    ('claimCount', 'j.claim_count', lambda job, base: job['claim_count']),
    ('createdAt', 'j.created_at', lambda job, base: job['created_at']),
    ('updatedAt', 'j.updated_at', lambda job, base: job['updated_at']),
    ('url', "(:base || '/jobs/' || j.id)", lambda job, base: f'{base}/jobs/{job["id"]}'),
)


def json_object_sql(fields):
    """SQLite's json_object() of a field table ((name, SQL, Python) rows)."""
    return 'json_object(' + ', '.join(f"'{name}', {sql}" for name, sql, _ in fields) + ')'


JOB_JSON_SQL = json_object_sql(JOB_FIELDS)


def job_json(job, base_url):
    return {name: render(job, base_url) for name, _, render in JOB_FIELDS}


# Who may read the deliverable of a claim `c` (CONTRACT.md 18, work is private until it is paid): the job's
# requester, the worker's account, admins, and the owners of the arbitrators on the panel of a dispute over the
# claim. :viewer is the reader's account id (null: anonymous), :admin 1 for an admin.
DELIVERABLE_READERS_SQL = '''(:admin OR :viewer IN (
    SELECT requester_id FROM jobs WHERE id = c.job_id
    UNION ALL SELECT account_id FROM agents WHERE id = c.agent_id
    UNION ALL SELECT b.account_id FROM disputes d JOIN dispute_panels p ON p.dispute_id = d.id
              JOIN arbitrators b ON b.id = p.arbitrator_id WHERE d.claim_id = c.id))'''


def reader_params(account):
    """DELIVERABLE_READERS_SQL's parameters for the account reading (None: anonymous)."""
    return {'viewer': account and account['id'], 'admin': int(is_admin(account))}


def readable_claims(db, where, params, account):
    """The claims `where` selects (SQL over `c`, with its ORDER BY), each with `readable`: whether `account`
    may read its deliverable."""
    return db.rows(f'SELECT c.*, {DELIVERABLE_READERS_SQL} AS readable FROM claims c WHERE {where}',
                   dict(params, **reader_params(account)))


def deliverable_json(claim, readable):
    """A claim's deliverable: whole for its readers, {type, delivered: true} for everyone else, null before."""
    if not claim['deliverable']:
        return None
    deliverable = orjson.loads(claim['deliverable'])
    return deliverable if readable else {'type': deliverable.get('type'), 'delivered': True}


# Claims and payments as the API shows them, as JOB_FIELDS: SQLite renders a job's page of GET /api/jobs/:id
# whole (JOB_DETAIL_SQL); claim_json and payment_json are the same in Python. A claim's renderer also takes
# whether the reader may see its deliverable.
CLAIM_FIELDS = (
    ('id', 'c.id', lambda claim, readable: claim['id']),
    ('jobId', 'c.job_id', lambda claim, readable: claim['job_id']),
    ('agentId', 'c.agent_id', lambda claim, readable: claim['agent_id']),
    ('status', 'c.status', lambda claim, readable: claim['status']),
    ('deliverable', f'''CASE WHEN c.deliverable IS NULL THEN NULL WHEN {DELIVERABLE_READERS_SQL}
        THEN json(c.deliverable)
        ELSE json_object('type', json_extract(c.deliverable, '$.type'), 'delivered', json('true')) END''',
     deliverable_json),
    ('deliveredAt', 'c.delivered_at', lambda claim, readable: claim['delivered_at']),
    ('verifiedAt', 'c.verified_at', lambda claim, readable: claim['verified_at']),
    ('verificationReason', 'c.verification_reason', lambda claim, readable: claim['verification_reason']),
    ('autoApproved', "json(CASE WHEN c.auto_approved THEN 'true' ELSE 'false' END)",
     lambda claim, readable: bool(claim['auto_approved'])),
    ('releaseAuthorization', f'CASE WHEN {DELIVERABLE_READERS_SQL} THEN json(c.release_authorization) END',
     lambda claim, readable: orjson.loads(claim['release_authorization'])
     if readable and claim.get('release_authorization') else None),
    ('createdAt', 'c.created_at', lambda claim, readable: claim['created_at']),
    ('updatedAt', 'c.updated_at', lambda claim, readable: claim['updated_at']),
)
UNIT_DIVISORS_SQL = 'CASE p.currency ' + ' '.join(f"WHEN '{currency}' THEN {10 ** (places - 2)}"
                                                  for currency, places in DECIMALS.items()) + ' END'
PAYMENT_FIELDS = (
    ('id', 'p.id', lambda payment: payment['id']),
    ('type', 'p.type', lambda payment: payment['type']),
    ('amount', money_sql(f'(p.amount / {UNIT_DIVISORS_SQL})'),
     lambda payment: format_units(payment['amount'], payment['currency'])),
    ('currency', 'p.currency', lambda payment: payment['currency']),
    ('rail', 'p.rail', lambda payment: payment['rail']),
    ('status', 'p.status', lambda payment: payment['status']),
    ('recipient', 'p.recipient', lambda payment: payment['recipient']),
    ('txHash', 'p.tx_hash', lambda payment: payment['tx_hash']),
    ('reference', 'p.reference', lambda payment: payment['reference']),
    ('executableAt', 'p.executable_at', lambda payment: payment['executable_at']),
    ('failure', 'p.failure', lambda payment: payment.get('failure')),
    ('createdAt', 'p.created_at', lambda payment: payment['created_at']),
)
# GET /api/jobs/:id in one statement: the job, its claims (oldest first) and its payments (in the order money
# moved), as job_detail builds them in Python; deliverables as :viewer and :admin may read them (reader_params).
# A job still waiting for its payment is there only for its requester and admins, with the `checkoutUrl` where to
# pay. (A subquery's JSON comes back as text: json() makes it JSON again.)
JOB_DETAIL_SQL = f'''SELECT json_patch(json_object(
    'job', {JOB_JSON_SQL},
    'claims', json((SELECT json_group_array({json_object_sql(CLAIM_FIELDS)} ORDER BY c.created_at, c.rowid)
                    FROM claims c WHERE c.job_id = j.id)),
    'payments', json((SELECT json_group_array({json_object_sql(PAYMENT_FIELDS)} ORDER BY p.seq)
                      FROM payments p WHERE p.job_id = j.id))),
    CASE WHEN j.status = 'pending_payment' THEN json_object('checkoutUrl', j.checkout_url) ELSE '{{}}' END)
    FROM ({JOB_SELECT} WHERE j.id = :id
          AND (j.status != 'pending_payment' OR :admin OR j.requester_id = :viewer)) j'''


def claim_json(claim, readable):
    """A claim as the API shows it; `readable`: whether the reader may see its deliverable (deliverable_json)."""
    return {name: render(claim, readable) for name, _, render in CLAIM_FIELDS}


def payment_json(payment):
    return {name: render(payment) for name, _, render in PAYMENT_FIELDS}


def agent_names(db, agent_ids):
    """{agent id: name} of these agents."""
    ids = sorted(set(agent_ids))
    marks = ', '.join(f':a{i}' for i in range(len(ids)))
    rows = db.rows(f'SELECT id, name FROM agents WHERE id IN ({marks})', {f'a{i}': a for i, a in enumerate(ids)})
    return {row['id']: row['name'] for row in rows}


# A job's timeline (CONTRACT.md 20, the job's story is in the API): what happened to it, as its page shows it and
# GET /api/jobs/:id gives it. Each step has a kind; the steps of one moment (one transaction) keep the order of
# these kinds, the order in which they happen.
TIMELINE_KINDS = ('posted', 'stripe', 'escrow', 'claimed', 'delivered', 'disputed', 'dispute_decided', 'approved',
                  'rejected', 'claim_expired', 'release', 'fee', 'refund', 'reclaim', 'cancelled', 'expired')
PAYMENT_EVENTS = {'escrow': 'Escrow locked', 'release': 'Paid to the worker', 'refund': 'Refunded to the requester',
                  'fee': 'Operator fee', 'reclaim': 'Reclaimed from the contract by the payer'}


def job_timeline(job, claims, disputes, payments, names, notes=()):
    """What happened to a job, oldest first (steps of one moment in the order they happen): [{at, kind, what,
    detail, reference, txHash, dispute, link}] (the page's; timeline_json is the API's). `job`, `claims` and
    `payments` as the API shows them; `disputes` rows; `notes` what Stripe said of it (stripe_events rows with a summary)."""
    def step(at, kind, what, detail='', reference=None, tx_hash=None, dispute=None):
        return {'at': at, 'kind': kind, 'what': what, 'detail': detail, 'reference': reference, 'txHash': tx_hash,
                'dispute': dispute, 'link': dispute and f'/disputes/{dispute}'}
    events = [step(job['createdAt'], 'posted', 'Posted',
                   f'{job["paymentAmount"]} {job["paymentCurrency"]}, due {when(job["deadline"])}')]
    events += [step(note['created_at'], 'stripe', 'Stripe', note['summary'], note['reference']) for note in notes]
    for claim in claims:
        agent = names.get(claim['agentId'], 'an agent')
        events.append(step(claim['createdAt'], 'claimed', 'Claimed', f'by {agent}'))
        if claim['deliveredAt']:
            events.append(step(claim['deliveredAt'], 'delivered', 'Delivered', f'by {agent}'))
        if claim['verifiedAt'] and claim['status'] in ('approved', 'rejected'):
            what = 'Approved automatically' if claim['autoApproved'] else claim['status'].capitalize()
            events.append(step(claim['verifiedAt'], claim['status'], what,
                               f'{agent}\'s delivery' + (f': {claim["verificationReason"]}'
                                                        if claim['verificationReason'] else '')))
        elif claim['status'] == 'expired':
            events.append(step(claim['updatedAt'], 'claim_expired', 'Claim expired', f'{agent} did not deliver'))
    for dispute in disputes:
        events.append(step(dispute['created_at'], 'disputed', 'Disputed', dispute['reason'], dispute=dispute['id']))
        if dispute['resolved_at']:
            events.append(step(dispute['resolved_at'], 'dispute_decided',
                               f'Dispute decided for the {dispute["outcome"]}' if dispute['outcome'] else
                               'Dispute closed undecided', dispute['resolution'] or '', dispute=dispute['id']))
    for payment in payments:
        events.append(step(payment['createdAt'], payment['type'], PAYMENT_EVENTS[payment['type']],
                           f'{payment["amount"]} {payment["currency"]} ({payment["status"]})',
                           payment['reference'], payment['txHash']))
    if job['status'] in ('cancelled', 'expired'):
        events.append(step(job['updatedAt'], job['status'], job['status'].capitalize()))
    return sorted(events, key=lambda event: (event['at'], TIMELINE_KINDS.index(event['kind'])))


def job_story(db, detail):
    """job_timeline of a job as job_detail shows it (its job, claims and payments), with its disputes, its workers'
    names and what Stripe said of it: up to three small queries by the job's id, paid only by a job's detail (none
    for a job without claims on rail base)."""
    job_id, claims = detail['job']['id'], detail['claims']
    disputes = names = notes = ()
    if claims:      # a dispute is over a claim, a name is a worker's
        disputes = db.rows('''SELECT id, reason, outcome, resolution, created_at, resolved_at FROM disputes
                              WHERE job_id = :id ORDER BY created_at''', {'id': job_id})
        names = agent_names(db, [claim['agentId'] for claim in claims])
    if detail['job']['paymentRail'] == 'stripe':        # Stripe's events are about jobs paid by card
        notes = db.rows('''SELECT created_at, summary, reference FROM stripe_events
                           WHERE job_id = :id AND summary IS NOT NULL ORDER BY created_at''', {'id': job_id})
    return job_timeline(detail['job'], claims, disputes, detail['payments'], dict(names), notes)


def timeline_json(step):
    """A step of job_timeline as the API shows it: {at, kind, text, reference} (a transaction hash, a Stripe
    object id or a dispute id)."""
    return {'at': step['at'], 'kind': step['kind'],
            'text': step['what'] + (f' — {step["detail"]}' if step['detail'] else ''),
            'reference': step['txHash'] or step['reference'] or step['dispute']}


def read_deliverable(body):
    """{claimId, deliverable: {type, url, notes?}}, or the alias {claimId, deliveryUrl, deliveryNotes,
    artifactType}; return (claim id, deliverable)."""
    form = Form(body)
    claim_id = form.uuid('claimId', required=True)
    if 'deliverable' in body or 'deliveryUrl' not in body:
        raw = body.get('deliverable')
        if not isinstance(raw, dict):
            form.errors['deliverable'] = 'is required: an object {type, url}'
            raw = {}
        names = {'type': 'type', 'url': 'url', 'notes': 'notes'}
        prefix = 'deliverable.'
    else:
        raw = body
        names = {'type': 'artifactType', 'url': 'deliveryUrl', 'notes': 'deliveryNotes'}
        prefix = ''
    inner = Form({key: raw.get(name) for key, name in names.items()})
    deliverable = {
        'type': inner.text('type', default='url', max_len=50),
        'url': inner.parsed('url', read_url, required=True),
        'notes': inner.text('notes', max_len=5000, allow_empty=True),
    }
    for key, problem in inner.errors.items():
        form.errors[prefix + names[key]] = problem
    form.done()
    return claim_id, {key: value for key, value in deliverable.items() if value is not None}


###############################################################################
# Disputes and arbitration ####################################################
###############################################################################

# panel: the ids of the arbitrators drawn for the dispute, comma-separated (NULL when none were).
DISPUTE_SELECT = '''
    SELECT d.*, (SELECT count(*) FROM votes v WHERE v.dispute_id = d.id) AS votes_received,
        (SELECT group_concat(p.arbitrator_id) FROM dispute_panels p WHERE p.dispute_id = d.id) AS panel
    FROM disputes d'''
# An open dispute waits for an admin when no panel could be drawn or when it has been open too long.
NEEDS_ADMIN_SQL = "(d.status = 'open' AND (d.needs_admin = 1 OR d.created_at <= :stale_before))"
# accuracy: the share of an arbitrator's votes on resolved disputes that matched the outcome.
ARBITRATOR_SELECT = '''
    SELECT a.*,
        (SELECT count(*) FROM votes v WHERE v.arbitrator_id = a.id) AS votes_cast,
        (SELECT CAST(sum(v.vote = d.outcome) AS REAL) / count(*) FROM votes v
            JOIN disputes d ON d.id = v.dispute_id
            WHERE v.arbitrator_id = a.id AND d.status = 'resolved') AS accuracy
    FROM arbitrators a'''
ARBITRATOR_MIN_REPUTATION = 1000   # 10.00
OUTCOMES = ('requester', 'worker')
ARBITRATOR_STATUSES = ('pending', 'active', 'suspended')
PANEL_DRAW = secrets.SystemRandom()     # draws dispute panels; tests may put a seeded random.Random here


def get_dispute(db, dispute_id):
    dispute = db.row(DISPUTE_SELECT + ' WHERE d.id = :id', {'id': dispute_id})
    if dispute is None:
        raise NotFound('No dispute has this id.')
    return dispute


def get_arbitrator(db, arbitrator_id):
    arbitrator = db.row(ARBITRATOR_SELECT + ' WHERE a.id = :id', {'id': arbitrator_id})
    if arbitrator is None:
        raise NotFound('No arbitrator has this id.')
    return arbitrator


def party_ties(db, claim_id):
    """The parties of a dispute over this claim as they are now, to be stored with it: the requester's and the
    worker's accounts, the worker agent's wallet and the job's funding payer (disputes columns)."""
    return db.row('''SELECT j.requester_id AS requester_account, a.account_id AS worker_account,
                         a.wallet_address AS worker_wallet, j.refund_address AS payer_wallet
                     FROM claims c JOIN jobs j ON j.id = c.job_id JOIN agents a ON a.id = c.agent_id
                     WHERE c.id = :claim''', {'claim': claim_id})


def dispute_links(ties):
    """What ties an arbitrator to a dispute (its stored party_ties, or a disputes row): the parties' accounts, and
    the wallets (lowercase) of the worker's agent and of the job's funding payer. A wallet the worker's agent takes
    later changes nothing (CONTRACT.md 20)."""
    wallets = {address.lower() for address in (ties['worker_wallet'], ties['payer_wallet']) if address}
    return {ties['requester_account'], ties['worker_account']}, wallets


def is_linked(arbitrator, links):
    """The arbitrator's account is a party's, or its wallet is the worker agent's or the funding payer's."""
    accounts, wallets = links
    return arbitrator['account_id'] in accounts or arbitrator['wallet_address'].lower() in wallets


def draw_panel(db, ties, size):
    """The ids of `size` active arbitrators not linked to a dispute with these party_ties, drawn at random; []
    when fewer are eligible."""
    links = dispute_links(ties)
    eligible = [row['id'] for row in db.rows(
        "SELECT id, account_id, wallet_address FROM arbitrators WHERE status = 'active' ORDER BY id")
        if not is_linked(row, links)]
    return sorted(PANEL_DRAW.sample(eligible, size)) if len(eligible) >= size else []


def open_dispute(db, settings, job_id, claim_id, reason, account):
    """The requester disputes a delivery: claim and job become `disputed`, escrow stays locked."""
    with db.transaction():
        job = get_job(db, job_id)
        require_requester(job, account)
        claim = get_claim(db, job_id, claim_id)
        if db.value('SELECT 1 FROM disputes WHERE claim_id = :id', {'id': claim_id}):
            raise Conflict('This delivery has been disputed already.', code='already_disputed')
        if claim['status'] != 'delivered':
            raise Conflict(f'The claim is {claim["status"]}; only a delivered claim can be disputed.',
                           code='claim_not_delivered')
        # One price, one winner: a first-wins or best-wins job holds one open dispute at a time, so
        # that deciding it for the worker never collides with another claim's dispute.
        if job['competition_mode'] != 'all-paid' and db.value(
                "SELECT 1 FROM disputes WHERE job_id = :id AND status = 'open'", {'id': job_id}):
            raise Conflict('Another delivery of this job is under dispute; dispute this one after it is '
                           'resolved.', code='dispute_open')
        ties = party_ties(db, claim_id)      # stored: who is a party stays as it was when the dispute opened
        panel = draw_panel(db, ties, settings.required_votes)
        dispute = {'id': new_id(), 'job_id': job_id, 'claim_id': claim_id, 'status': 'open', 'reason': reason,
                   'outcome': None, 'resolution': None, 'resolved_by': None,
                   'required_votes': settings.required_votes,
                   'created_at': now_iso(), 'resolved_at': None, 'needs_admin': int(not panel), **ties}
        db.insert('disputes', dispute)
        for arbitrator_id in panel:
            db.insert('dispute_panels', {'dispute_id': dispute['id'], 'arbitrator_id': arbitrator_id})
        set_claim_status(db, claim_id, 'disputed')
        set_job_status(db, job_id, live_job_status(db, job))
        queue_event(db, settings, 'payment.disputed', job_id, claim_holders(db, job_id), agent_id=claim['agent_id'])
        return get_dispute(db, dispute['id']), get_job(db, job_id)


def decide_dispute(db, settings, dispute, outcome, resolution, resolved_by):
    """Settle an open dispute inside the caller's transaction: pay the worker or refund the requester."""
    job = get_job(db, dispute['job_id'])
    claim = get_claim(db, dispute['job_id'], dispute['claim_id'])
    decided = now_iso()         # before the verdict and the money it moves (the job's timeline shows that order)
    if outcome == 'worker':
        approve_claim(db, settings, job, claim, rule='dispute_won')
    else:
        reject_claim(db, settings, job, claim, rule='dispute_lost', unpaid_status='refunded')
    db.execute('''UPDATE disputes SET status = 'resolved', outcome = :outcome, resolution = :resolution,
                  resolved_by = :by, resolved_at = :now WHERE id = :id''',
               {'outcome': outcome, 'resolution': resolution, 'by': resolved_by, 'now': decided,
                'id': dispute['id']})


def require_open_dispute(dispute):
    if dispute['status'] != 'open':
        raise Conflict(f'The dispute was resolved already (outcome: {dispute["outcome"]}).',
                       code='dispute_resolved')


def trusted_decider(db, dispute, account):
    """The trusted, active arbitrator not linked to the dispute through which a member's account decides it."""
    links = dispute_links(dispute)
    if account['id'] in links[0]:
        raise Forbidden('A party to the dispute cannot decide it.', code='conflict_of_interest')
    trusted = db.rows("""SELECT * FROM arbitrators WHERE account_id = :id AND status = 'active' AND trusted = 1
                         ORDER BY created_at, id""", {'id': account['id']})
    unlinked = [arbitrator for arbitrator in trusted if not is_linked(arbitrator, links)]
    if trusted and not unlinked:
        raise Forbidden("Your trusted arbitrator's wallet is linked to a party of this dispute.",
                        code='conflict_of_interest')
    if not unlinked:
        raise Forbidden('Only an admin or the owner of a trusted, active arbitrator may decide a dispute alone.')
    return unlinked[0]


def resolve_dispute(db, settings, dispute_id, outcome, resolution, resolved_by, account):
    """An admin or a trusted, uninvolved arbitrator's owner decides a dispute; return (dispute, job).
    `resolved_by` counts only from an admin: an arbitrator's decision bears the arbitrator's name."""
    with db.transaction():
        dispute = get_dispute(db, dispute_id)
        if is_admin(account):
            resolved_by = resolved_by or account['name']
        else:
            resolved_by = trusted_decider(db, dispute, account)['name']
        require_open_dispute(dispute)
        decide_dispute(db, settings, dispute, outcome, resolution, resolved_by)
        return get_dispute(db, dispute_id), get_job(db, dispute['job_id'])


def register_arbitrator(db, settings, account, name, wallet, agent_id, owner_id):
    """An agent with reputation 10.00+ (its owner asking), or a human arbitrator (admins only); it waits,
    `pending`, for an admin to activate it, unless --open-arbitration."""
    with db.transaction():
        if agent_id:
            agent = get_agent(db, agent_id)
            if agent['account_id'] != account['id']:
                raise Forbidden('You can register only an agent your account owns as an arbitrator.')
            if agent['reputation'] < ARBITRATOR_MIN_REPUTATION:
                raise Forbidden(f'An arbitrator needs a reputation of at least 10.00; the agent has '
                                f'{format_cents(agent["reputation"])}.', code='insufficient_reputation')
            if db.value('SELECT 1 FROM arbitrators WHERE agent_id = :id', {'id': agent_id}):
                raise Conflict('This agent is an arbitrator already.', code='already_arbitrator')
            owner_id = account['id']
        elif not is_admin(account):
            raise Forbidden('Only an admin may register an arbitrator without an agentId.')
        elif owner_id and not db.value('SELECT 1 FROM accounts WHERE id = :id', {'id': owner_id}):
            raise NotFound('No account has this id (accountId).')
        moment = now_iso()
        arbitrator = {'id': new_id(), 'account_id': owner_id or account['id'], 'agent_id': agent_id,
                      'name': name, 'wallet_address': wallet,
                      'status': 'active' if settings.open_arbitration else 'pending',
                      'created_at': moment, 'updated_at': moment}
        db.insert('arbitrators', arbitrator)
        return get_arbitrator(db, arbitrator['id'])


def cast_vote(db, settings, dispute_id, arbitrator_id, choice, reasoning, account):
    """One arbitrator's vote; the vote that reaches requiredVotes decides by majority. Return (vote, dispute)."""
    with db.transaction():
        dispute = get_dispute(db, dispute_id)
        arbitrator = get_arbitrator(db, arbitrator_id)
        if arbitrator['account_id'] != account['id']:
            raise Forbidden('You can vote only with an arbitrator your account owns.')
        if arbitrator['status'] == 'suspended':
            raise Forbidden('This arbitrator is suspended.', code='arbitrator_suspended')
        if is_linked(arbitrator, dispute_links(dispute)):
            raise Forbidden('An arbitrator linked to a party of the dispute cannot vote on it.',
                            code='conflict_of_interest')
        if arbitrator['status'] != 'active' or not db.value(
                'SELECT 1 FROM dispute_panels WHERE dispute_id = :d AND arbitrator_id = :a',
                {'d': dispute_id, 'a': arbitrator_id}):
            raise Forbidden("Only the arbitrators drawn for this dispute's panel vote on it.", code='not_on_panel')
        require_open_dispute(dispute)
        if db.value('SELECT 1 FROM votes WHERE dispute_id = :d AND arbitrator_id = :a',
                    {'d': dispute_id, 'a': arbitrator_id}):
            raise Conflict('This arbitrator has voted on this dispute already.', code='already_voted')
        vote = {'id': new_id(), 'dispute_id': dispute_id, 'arbitrator_id': arbitrator_id, 'vote': choice,
                'reasoning': reasoning, 'created_at': now_iso()}
        db.insert('votes', vote)
        tally = vote_summary(db, dispute_id)
        if tally['total'] >= dispute['required_votes']:
            outcome = 'worker' if tally['worker'] > tally['requester'] else 'requester'
            resolution = (f'Community vote: {tally[outcome]} of {tally["total"]} arbitrators decided for the '
                          f'{outcome}.')
            decide_dispute(db, settings, dispute, outcome, resolution, 'community')
        return vote, get_dispute(db, dispute_id)        # as this vote left it (a later one in its group may decide)


def vote_summary(db, dispute_id):
    counts = dict(db.rows('''SELECT coalesce(sum(vote = 'requester'), 0) AS requester,
                              coalesce(sum(vote = 'worker'), 0) AS worker, count(*) AS total
                              FROM votes WHERE dispute_id = :id''', {'id': dispute_id})[0])
    return counts


def stale_before(settings):
    """Disputes opened at or before this time (ISO) have waited --dispute-timeout-hours: an admin's turn."""
    return iso(now() - timedelta(hours=settings.dispute_timeout_hours))


def dispute_json(dispute, settings):
    needs_admin = dispute['status'] == 'open' and (bool(dispute['needs_admin'])
                                                   or dispute['created_at'] <= stale_before(settings))
    return {
        'id': dispute['id'],
        'jobId': dispute['job_id'],
        'claimId': dispute['claim_id'],
        'status': dispute['status'],
        'reason': dispute['reason'],
        'outcome': dispute['outcome'],
        'resolution': dispute['resolution'],
        'resolvedBy': dispute['resolved_by'],
        'requiredVotes': dispute['required_votes'],
        'votesReceived': dispute['votes_received'],
        'panel': sorted(dispute['panel'].split(',')) if dispute['panel'] else [],
        'needsAdmin': needs_admin,
        'createdAt': dispute['created_at'],
        'resolvedAt': dispute['resolved_at'],
    }


def arbitrator_json(arbitrator):
    accuracy = arbitrator['accuracy']
    return {
        'id': arbitrator['id'],
        'name': arbitrator['name'],
        'walletAddress': arbitrator['wallet_address'],
        'agentId': arbitrator['agent_id'],
        'accountId': arbitrator['account_id'],
        'status': arbitrator['status'],
        'trusted': bool(arbitrator['trusted']),
        'accuracy': None if accuracy is None else round(accuracy, 4),
        'votesCast': arbitrator['votes_cast'],
        'createdAt': arbitrator['created_at'],
    }


def vote_json(vote):
    return {'id': vote['id'], 'disputeId': vote['dispute_id'], 'arbitratorId': vote['arbitrator_id'],
            'vote': vote['vote'], 'reasoning': vote['reasoning'], 'createdAt': vote['created_at']}


###############################################################################
# The stripe rail: jobs paid through Stripe Checkout ##########################
###############################################################################

# In stripe mode (CONTRACT.md 12) a job on rail stripe is paid through a Stripe Checkout Session and waits as
# pending_payment (hidden from everyone but its requester and admins) until Stripe says it is paid: by a signed
# webhook event, or when the sweep asks. Then it opens with its price locked in escrow, the money held in the
# platform's Stripe balance. stripe_rail.py alone talks to Stripe; nothing here calls it inside a transaction.

STRIPE_RETRY_AFTER = '30'       # seconds a client waits before posting again when Stripe fails
STRIPE_MIN_CENTS = 50           # the least a Checkout Session in usd may charge
STRIPE_NEEDS_WEBHOOK_SECRET = ('--stripe-secret-key needs --stripe-webhook-secret (whsec_...): without it no payment '
                               'event can be checked, and no job paid by card would open')


def open_stripe_rail(settings):
    """The StripeRail of a service in stripe mode, else None (the stripe library loads only in stripe mode)."""
    if not stripe_mode(settings):
        return None
    from stripe_rail import StripeRail
    return StripeRail(settings.stripe_secret_key, settings.stripe_webhook_secret,
                      connect_webhook_secret=settings.stripe_connect_webhook_secret, api_base=settings.stripe_api_base)


def provider_unavailable(exc):
    """The answer when a call to Stripe fails or is refused: 503 payment_provider_unavailable with Retry-After."""
    log.warning('stripe call failed: %s %s', type(exc).__name__, getattr(exc, 'code', None) or '')
    return Unavailable('The payment provider (Stripe) did not answer as it should; nothing was stored. Retry '
                       'in a moment.', code='payment_provider_unavailable', headers={'Retry-After': STRIPE_RETRY_AFTER})


def unix_iso(seconds):
    """Unix seconds (as Stripe gives times) as an ISO time."""
    return iso(datetime.fromtimestamp(int(seconds), timezone.utc))


def create_checkout_job(svc, fields):
    """POST /api/jobs on rail stripe in stripe mode: open the job's Checkout Session (network, before any
    transaction), then store the job pending_payment (create_job); return (job, the URL where to pay)."""
    settings = svc.settings
    expires = now() + timedelta(minutes=settings.stripe_checkout_minutes)
    if fields['deadline'] <= iso(expires):
        raise ValidationFailed(fields={'deadline': f'must be after the payment window closes ({iso(expires)}, '
                                                   f'{settings.stripe_checkout_minutes} minutes from now)'})
    if fields['amount_cents'] < STRIPE_MIN_CENTS:
        raise ValidationFailed(fields={'paymentAmount': 'must be at least 0.50 to be paid by card (Stripe Checkout '
                                                        'takes no less)'})
    if not svc.db.value('SELECT 1 FROM accounts WHERE id = :id', {'id': fields['requester_id']}):
        raise NotFound('No account has this id (requesterId).')      # before Stripe is asked for anything
    from stripe_rail import StripeRefused, StripeUnavailable
    job_id = new_id()
    page = f'{settings.base_url}/jobs/{job_id}'
    try:
        checkout = svc.stripe.open_checkout(job_id=job_id, title=fields['title'], amount_cents=fields['amount_cents'],
                                            expires_at=int(expires.timestamp()), success_url=page, cancel_url=page)
    except (StripeUnavailable, StripeRefused) as exc:
        raise provider_unavailable(exc) from None
    job = create_job(svc.db, settings, dict(fields, id=job_id),
                     checkout=dict(checkout, expires_at=unix_iso(checkout['expires_at'])))
    return job, checkout['url']


def checkout_job_id(session):
    """The job a Checkout Session pays for: its client_reference_id and metadata.job_id, which must agree."""
    reference = session.get('client_reference_id')
    tagged = session.get('job_id') or (session.get('metadata') or {}).get('job_id')
    if reference and tagged and reference != tagged:
        return None
    return reference or tagged


def checkout_outcome(session):
    """What a Checkout Session as Stripe shows it now means: 'paid', 'unpaid' (expired) or None (not yet)."""
    if session.get('status') == 'complete' and session.get('payment_status') == 'paid':
        return 'paid'
    return 'unpaid' if session.get('status') == 'expired' else None


def checkout_problem(job, session):
    """Why a paid Checkout Session does not open this job, or None when it does."""
    if job['stripe_session_id'] != session['id']:
        return f'the session {session["id"]} is not the one opened for the job'
    if session.get('amount_total') != job['amount_cents'] or str(session.get('currency')).lower() != 'usd':
        return (f'it paid {session.get("amount_total")} {session.get("currency")}, not {job["amount_cents"]} usd '
                '(cents)')
    if not session.get('payment_intent'):
        return 'it names no PaymentIntent'
    if job['status'] != 'pending_payment':
        return f'the job is {job["status"]} already'
    return None


def stripe_event_seen(db, event_id):
    return db.value('SELECT 1 FROM stripe_events WHERE id = :id', {'id': event_id}) is not None


def record_stripe_event(db, event, job_id=None, summary=None, reference=None, at=None):
    """Mark a Stripe event applied, in the transaction of its effect; `summary` goes on the job's timeline at `at`
    (default now), with the Stripe object it is about (`reference`)."""
    db.insert('stripe_events', {'id': event['id'], 'type': event['type'], 'job_id': job_id, 'summary': summary,
                                'created_at': at or now_iso(), 'reference': reference})


def open_paid_job(db, settings, job, session):
    """A pending job is paid: it opens with its price locked in escrow (the PaymentIntent as the escrow record's
    reference, its charge kept for the transfers) and job.new goes out, as for any new job."""
    db.execute('''UPDATE jobs SET status = 'open', escrow_status = 'locked', payment_intent = :intent,
                  stripe_charge = :charge, updated_at = :now WHERE id = :id''',
               {'intent': session['payment_intent'], 'charge': session.get('charge'), 'now': now_iso(),
                'id': job['id']})
    lock_escrow(db, job, payment_intent=session['payment_intent'])
    queue_event(db, settings, 'job.new', job['id'])


def settle_checkout(db, settings, session, outcome, event=None):
    """Apply what Stripe says of a Checkout Session in one transaction, with the event's stripe_events row (so it
    applies once): `paid` opens the pending job it was opened for, `unpaid` cancels it (nothing was locked, its
    escrowStatus stays pending); anything that does not fit changes nothing and is logged.
    Returns (opened | cancelled | unchanged | duplicate, the job's id or None)."""
    with db.transaction():
        if event and stripe_event_seen(db, event['id']):
            return 'duplicate', None
        job = db.row(f'{JOB_SELECT} WHERE j.id = :id', {'id': checkout_job_id(session)})
        result, summary = 'unchanged', None
        if job is None:
            log.warning('stripe: Checkout Session %s is for no job here; nothing opens', session.get('id'))
        elif outcome == 'paid':
            problem = checkout_problem(job, session)
            if problem is None:
                open_paid_job(db, settings, job, session)
                result, summary = 'opened', f'Paid through Stripe Checkout ({session["payment_intent"]})'
            else:
                log.warning('stripe: a payment does not open job %s: %s', job['id'], problem)
                summary = f'A payment that did not open the job: {problem}'
        elif outcome == 'unpaid' and job['status'] == 'pending_payment' and job['stripe_session_id'] == session['id']:
            set_job_status(db, job['id'], 'cancelled')
            result = 'cancelled'
            summary = 'The payment failed' if session.get('status') == 'complete' else 'The Checkout Session expired unpaid'
        if event:
            intent = session.get('payment_intent')
            record_stripe_event(db, event, job and job['id'], summary,
                                intent if isinstance(intent, str) else session.get('id'))
    return result, job and job['id']


def on_checkout_paid(db, settings, event):
    """checkout.session.completed (paid now, or later by an async payment) and async_payment_succeeded: the
    session as Stripe shows it now (with its charge; network, before the transaction) opens its job."""
    session = event['object']
    if stripe_event_seen(db, event['id']):
        return 'duplicate', None
    if event['type'] == 'checkout.session.completed' and session.get('payment_status') != 'paid':
        return settle_checkout(db, settings, session, None, event)      # an async payment is on its way
    session = settings.stripe.checkout_session(session['id'])
    return settle_checkout(db, settings, session, checkout_outcome(session), event)


def on_checkout_unpaid(db, settings, event):
    """checkout.session.expired and async_payment_failed: the pending job is cancelled."""
    return settle_checkout(db, settings, event['object'], 'unpaid', event)


def on_charge_event(db, settings, event):
    """charge.refunded, charge.dispute.created and charge.dispute.closed: recorded on the job (its timeline), and
    what they mean for its escrow (card money that goes back stops payouts, CONTRACT.md 20): a dispute holds it
    (hold_escrow), a dispute won lifts the hold, a dispute lost ends the job charged_back; a refund made outside
    the service (the Stripe Dashboard) of the whole charge ends it refunded, of a part holds it."""
    thing = event['object']
    dispute = event['type'].startswith('charge.dispute')
    charge = thing.get('charge') if dispute else thing.get('id')
    group = thing.get('transfer_group') or ''
    with db.transaction():
        if stripe_event_seen(db, event['id']):
            return 'duplicate', None
        received = now_iso()        # before what it does (the job's timeline shows that order)
        job = db.row(f'''{JOB_SELECT} WHERE j.id = :group OR j.stripe_charge = :charge
                         OR j.payment_intent = :intent LIMIT 1''',
                     {'group': group.removeprefix('job_'), 'charge': charge, 'intent': thing.get('payment_intent')})
        outcome, summary, reference = CHARGE_EVENTS[event['type']](db, job, thing, charge)
        if job is None:
            log.warning('stripe: %s for no job here: %s', event['type'], summary)
        elif outcome != 'recorded':
            log.warning('stripe: %s on job %s: %s', event['type'], job['id'], outcome)
        record_stripe_event(db, event, job and job['id'], summary, reference, received)
    return outcome, job and job['id']


def card_job(job):
    """Is this a job whose escrow Stripe's charge events govern: paid through Stripe, its escrow not ended by one?"""
    return job is not None and stripe_job(job) and job['escrow_status'] != 'charged_back'


def on_dispute_created(db, job, dispute, charge):
    summary = (f'The payer disputed charge {charge} ({format_cents(dispute.get("amount") or 0)} USD, '
               f'{dispute.get("reason") or "no reason given"}): the escrow is held until Stripe closes the dispute; '
               'answer it in the Stripe Dashboard')
    if not card_job(job):
        return 'recorded', summary, dispute.get('id')
    hold_escrow(db, job)
    return 'held', summary, dispute.get('id')


def on_dispute_closed(db, job, dispute, charge):
    status = dispute.get('status')
    if status == 'lost':
        summary = (f'Stripe closed the dispute over charge {charge}: lost; the card money went back to the payer, '
                   'and the job is cancelled')
        if not card_job(job):
            return 'recorded', summary, dispute.get('id')
        return_card_money(db, job, 'charged_back', dispute.get('id'))
        return 'charged_back', summary, dispute.get('id')
    summary = f'Stripe closed the dispute over charge {charge}: {status or "no status"}; the hold is lifted'
    if not card_job(job) or status not in ('won', 'warning_closed'):
        return 'recorded', summary.split(';')[0], dispute.get('id')
    lift_hold(db, job)
    return 'unheld', summary, dispute.get('id')


def on_charge_refunded(db, job, charge, charge_id):
    """A refund the service did not make changes the job: more refunded than the Refunds it made (each confirmed with
    its re_ id; they come back as this event too). One of its Refunds made but not yet confirmed when the event
    comes counts as outside: the job then ends cancelled rather than as decided, and the money is still right."""
    refunded = int(charge.get('amount_refunded') or 0)
    summary = f'Stripe refunded {format_cents(refunded)} USD of charge {charge_id}'
    if not card_job(job):
        return 'recorded', summary, charge_id
    ours = db.value('''SELECT coalesce(sum(amount), 0) FROM payments WHERE job_id = :id AND type = 'refund'
                       AND status = 'confirmed' AND reference LIKE 're!_%' ESCAPE '!' ''',
                    {'id': job['id']}) // 10 ** (DECIMALS[job['currency']] - 2)
    if refunded <= ours:
        return 'recorded', summary, charge_id
    if refunded >= int(charge.get('amount') or job['amount_cents']):
        return_card_money(db, job, 'refunded', charge_id)
        return 'refunded', summary + ' from outside the service: the job is cancelled', charge_id
    hold_escrow(db, job)
    return 'held', summary + ' from outside the service: the escrow is held for an admin', charge_id


# What each charge event means for its job: (db, the job row or None, the event's object, the charge's id) ->
# (what happened, the timeline's summary, the Stripe object's id).
CHARGE_EVENTS = {
    'charge.dispute.created': on_dispute_created,
    'charge.dispute.closed': on_dispute_closed,
    'charge.refunded': on_charge_refunded,
}


def hold_escrow(db, job):
    """Hold a job's escrow: nothing leaves it while held (send_stripe_payments skips it; a release or refund decided
    meanwhile is recorded pending and waits), and the job shows needsAdmin. The status it had is kept for when the
    hold lifts (set_job_status keeps it up to date meanwhile)."""
    db.execute('''UPDATE jobs SET escrow_unheld = CASE WHEN escrow_status = 'held' THEN escrow_unheld
                                                       ELSE escrow_status END,
                  escrow_status = 'held', updated_at = :now WHERE id = :id''', {'now': now_iso(), 'id': job['id']})


def lift_hold(db, job):
    """Lift a job's hold: its escrow takes the status it would have had, and its pending payments go out (now,
    after the commit, and with every sweep)."""
    db.execute('''UPDATE jobs SET escrow_status = coalesce(escrow_unheld, 'locked'), escrow_unheld = NULL,
                  updated_at = :now WHERE id = :id AND escrow_status = 'held' ''', {'now': now_iso(), 'id': job['id']})


def return_card_money(db, job, escrow_status, reference):
    """The job's card money went back to the payer outside the service (a dispute lost: `charged_back`; a refund of
    the whole charge from the Stripe Dashboard: `refunded`). In the ledger: every release or refund not sent yet is
    cancelled (status `cancelled`, its two entries reversed by two more: it never happened), and so is the fee taken
    with a release cancelled; what the escrow then holds goes back to the requester as a `refund` record, confirmed,
    whose reference is the dispute's or the charge's id (no Refund is sent: Stripe has made it). Transfers already
    made stay made. The job ends cancelled: its active claims superseded, its open disputes closed undecided."""
    unsent = db.rows('''SELECT id, type, claim_id FROM payments WHERE job_id = :id AND status = 'pending'
                        AND type IN ('release', 'refund')''', {'id': job['id']})
    claims = {p['claim_id'] for p in unsent if p['type'] == 'release'}
    fees = db.rows('''SELECT id, claim_id FROM payments WHERE job_id = :id AND type = 'fee'
                      AND status != 'cancelled' ''', {'id': job['id']})
    cancel_payments(db, unsent + [fee for fee in fees if fee['claim_id'] in claims])
    balance = escrow_balance(db, job['id'])
    if balance > 0:
        record_payment(db, job, 'refund', balance, debit=escrow_account(job['id']),
                       credit=f'funding:{job["requester_id"]}', recipient=job['refund_address'] or job['requester_id'],
                       status='confirmed', reference=reference)
    end_claims_and_disputes(db, job, 'Stripe', 'The card payment went back to the payer: nothing to decide.')
    db.execute('''UPDATE jobs SET status = 'cancelled', escrow_status = :escrow, escrow_unheld = NULL,
                  updated_at = :now WHERE id = :id''', {'escrow': escrow_status, 'now': now_iso(), 'id': job['id']})


def cancel_payments(db, payments):
    """Payments that will never be made: status `cancelled`, their two ledger entries reversed by two more."""
    for payment in payments:
        db.execute("UPDATE payments SET status = 'cancelled' WHERE id = :id", {'id': payment['id']})
        reverse_entries(db, payment['id'])


def end_claims_and_disputes(db, job, by, why):
    """Nothing is left to deliver, decide or pay: a job's active claims end superseded, its open disputes close
    undecided (resolved by `by`, for `why`)."""
    moment = now_iso()
    db.execute(f'''UPDATE claims SET status = 'superseded', updated_at = :now WHERE job_id = :id
                   AND status IN {ACTIVE_CLAIMS}''', {'id': job['id'], 'now': moment})
    db.execute('''UPDATE disputes SET status = 'resolved', resolution = :why, resolved_by = :by,
                  resolved_at = :now WHERE job_id = :id AND status = 'open' ''',
               {'id': job['id'], 'now': moment, 'why': why, 'by': by})


def account_ready(account):
    """Can a connected account (as Stripe shows it) take transfers and pay them out? payouts_enabled, and its
    transfers capability active."""
    capabilities = account.get('capabilities') or {}
    return bool(account.get('payouts_enabled')) and capabilities.get('transfers') == 'active'


def on_account_updated(db, settings, event):
    """account.updated (a Connect event): the agent paid to that connected account gets payoutsEnabled as Stripe
    says; releases waiting for it go out with the next sweep."""
    account = event['object']
    account_id = account.get('id') or event.get('account')
    with db.transaction():
        if stripe_event_seen(db, event['id']):
            return 'duplicate', None
        changed = db.execute('''UPDATE agents SET stripe_payouts_enabled = :ready, updated_at = :now
                                WHERE stripe_account_id = :account''',
                             {'ready': int(account_ready(account)), 'now': now_iso(), 'account': account_id})
        if not changed:
            log.warning('stripe: account.updated for %s, the account of no agent here', account_id)
        record_stripe_event(db, event)
    return ('recorded' if changed else 'unchanged'), None


# What each Stripe event does: (db, settings, event) -> (what happened, the job's id). Other types are answered
# 200 and ignored, not recorded.
STRIPE_EVENTS = {
    'checkout.session.completed': on_checkout_paid,
    'checkout.session.async_payment_succeeded': on_checkout_paid,
    'checkout.session.expired': on_checkout_unpaid,
    'checkout.session.async_payment_failed': on_checkout_unpaid,
    'charge.refunded': on_charge_event,
    'charge.dispute.created': on_charge_event,
    'charge.dispute.closed': on_charge_event,
    'account.updated': on_account_updated,
}


def apply_stripe_event(db, settings, event):
    """Apply one checked Stripe event, once by its id: (what happened, the job's id or None)."""
    handler = STRIPE_EVENTS.get(event['type'])
    return handler(db, settings, event) if handler else ('ignored', None)


def reconcile_checkouts(db, settings):
    """Lost webhooks: ask Stripe for the session of every job pending_payment for over a minute and apply it as
    its event would (paid: opens; expired: cancelled). Network first, then one transaction per job."""
    result = {'checked': 0, 'failed': 0, 'opened': [], 'cancelled': []}
    from stripe_rail import StripeRefused, StripeUnavailable
    pending = db.rows('''SELECT id, stripe_session_id FROM jobs WHERE status = 'pending_payment'
                         AND created_at <= :before ORDER BY seq''', {'before': iso(now() - timedelta(minutes=1))})
    for job in pending:
        time.sleep(0)     # under gevent, let requests in between
        try:
            session = settings.stripe.checkout_session(job['stripe_session_id'])
        except (StripeUnavailable, StripeRefused) as exc:
            log.warning('sweep: the Checkout Session of job %s could not be read (%s)', job['id'], type(exc).__name__)
            result['failed'] += 1
            continue
        result['checked'] += 1
        outcome, job_id = settle_checkout(db, settings, session, checkout_outcome(session))
        if outcome in ('opened', 'cancelled'):
            result[outcome].append(job_id)
    return result


###############################################################################
# The stripe rail: paying workers and refunds #################################
###############################################################################

# Workers are paid through Stripe Connect (CONTRACT.md 12): each agent has one Express connected account
# (onboard_agent), and a release is a Transfer from the platform's balance to it, drawn on the job's charge
# (source_transaction); a refund is a Refund of the job's PaymentIntent. The record is written pending in the
# transaction that decides it (pay_out); send_stripe_payments asks Stripe after the commit, and every sweep asks
# again for what is still pending, always with the record's id as the idempotency key: never paid twice.

STRIPE_PAYMENTS_DUE = '''
    SELECT p.id, p.type, p.amount, p.currency, p.job_id, j.payment_intent, j.stripe_charge,
           a.stripe_account_id, a.stripe_payouts_enabled
    FROM payments p JOIN jobs j ON j.id = p.job_id
    LEFT JOIN claims c ON c.id = p.claim_id LEFT JOIN agents a ON a.id = c.agent_id
    WHERE p.status = 'pending' AND p.type IN ('release', 'refund') AND j.payment_intent IS NOT NULL
    AND j.escrow_status != 'held' AND p.seq > :after
    ORDER BY p.seq'''


def onboard_agent(db, settings, agent):
    """The agent's Express connected account (made once: network first, then the transaction that stores it) and
    a fresh onboarding link to it, back to the agent's page: {url, expiresAt, accountId}. Both calls come before
    the transaction: one held open for an Idempotency-Key's answer (Database.hold) waits for no network."""
    from stripe_rail import StripeRefused, StripeUnavailable
    page = f'{settings.base_url}/agents/{agent["id"]}'
    try:
        account_id = agent['stripe_account_id']
        if account_id is None:
            made = settings.stripe.create_account(agent_id=agent['id'])
            link = settings.stripe.account_link(made, refresh_url=page, return_url=page)
            with db.transaction():      # two calls at once got the same account (one idempotency key)
                db.execute('''UPDATE agents SET stripe_account_id = :account, updated_at = :now
                              WHERE id = :id AND stripe_account_id IS NULL''',
                           {'account': made, 'now': now_iso(), 'id': agent['id']})
                account_id = db.value('SELECT stripe_account_id FROM agents WHERE id = :id', {'id': agent['id']})
            if account_id != made:      # not expected (Stripe answers one idempotency key with one account)
                link = settings.stripe.account_link(account_id, refresh_url=page, return_url=page)
        else:
            link = settings.stripe.account_link(account_id, refresh_url=page, return_url=page)
    except (StripeUnavailable, StripeRefused) as exc:
        raise provider_unavailable(exc) from None
    return {'url': link['url'], 'expiresAt': unix_iso(link['expires_at']), 'accountId': account_id}


def stripe_payment(settings, payment):
    """Ask Stripe to move one pending payment (network): the Transfer's or Refund's id, or None while its agent
    cannot take payouts."""
    cents = payment['amount'] // 10 ** (DECIMALS[payment['currency']] - 2)
    if payment['type'] == 'refund':
        return settings.stripe.refund(payment_intent=payment['payment_intent'], amount_cents=cents,
                                      idempotency_key=payment['id'])
    if not (payment['stripe_account_id'] and payment['stripe_payouts_enabled']):
        return None
    return settings.stripe.send_transfer(amount_cents=cents, destination=payment['stripe_account_id'],
                                         transfer_group=f'job_{payment["job_id"]}',
                                         source_transaction=payment['stripe_charge'], idempotency_key=payment['id'])


def payment_still_due(db, payment):
    """Is a pending payment read a moment ago still to be sent: still pending, and its job's escrow not held?"""
    return bool(db.value('''SELECT p.status = 'pending' AND j.escrow_status != 'held' FROM payments p
                            JOIN jobs j ON j.id = p.job_id WHERE p.id = :id''', {'id': payment['id']}))


def send_stripe_payments(db, settings, after_seq=0):
    """Send the pending transfers and refunds of jobs paid through Stripe (those recorded after `after_seq`), and
    mark each one Stripe made confirmed with its id as reference, in its own transaction. A refused call leaves
    its record pending; Stripe not answering ends the round. Returns {sent, waiting, failed}."""
    from stripe_rail import StripeRefused, StripeUnavailable
    result = {'sent': 0, 'waiting': 0, 'failed': 0}
    for payment in db.rows(STRIPE_PAYMENTS_DUE, {'after': after_seq or 0}):
        time.sleep(0)     # under gevent, let requests in between
        if not payment_still_due(db, payment):     # its escrow held meanwhile (a chargeback), or it was cancelled
            result['waiting'] += 1
            continue
        try:
            reference = stripe_payment(settings, payment)
        except StripeUnavailable as exc:
            log.warning('stripe: the %s %s waits, Stripe did not answer (%s)', payment['type'], payment['id'], exc)
            result['failed'] += 1
            break
        except StripeRefused as exc:
            log.warning('stripe: the %s %s waits, Stripe refused it (%s %s)', payment['type'], payment['id'],
                        exc.status, exc.code)
            result['failed'] += 1
            continue
        if reference is None:
            result['waiting'] += 1
            continue
        with db.transaction():
            confirmed = db.execute('''UPDATE payments SET status = 'confirmed', reference = :reference,
                          recipient = coalesce(:account, recipient) WHERE id = :id AND status = 'pending' ''',
                       {'reference': reference, 'id': payment['id'],
                        'account': payment['stripe_account_id'] if payment['type'] == 'release' else None})
        status = confirmed or db.value('SELECT status FROM payments WHERE id = :id', {'id': payment['id']})
        if status == 'cancelled':       # while the call ran: the card money went back meanwhile (return_card_money)
            log.error('stripe: the %s %s was made (%s) after its job\'s card money went back; reverse it in the '
                      'Stripe Dashboard', payment['type'], payment['id'], reference)
        result['sent'] += 1
    return result


STRIPE_ACCOUNT_CHECK = timedelta(minutes=10)     # a sweep asks Stripe for one connected account at most this often

# The connected accounts a sweep asks Stripe about: those paid a release that waits for their payouts, not asked
# within STRIPE_ACCOUNT_CHECK (pending payments are few: the partial index payments_pending finds them).
STRIPE_ACCOUNTS_DUE = '''
    SELECT DISTINCT a.id, a.stripe_account_id
    FROM payments p JOIN jobs j ON j.id = p.job_id JOIN claims c ON c.id = p.claim_id JOIN agents a ON a.id = c.agent_id
    WHERE p.status = 'pending' AND p.type = 'release' AND j.payment_intent IS NOT NULL
    AND a.stripe_account_id IS NOT NULL AND NOT a.stripe_payouts_enabled
    AND (a.stripe_checked_at IS NULL OR a.stripe_checked_at <= :before)
    ORDER BY a.id'''


def check_connected_accounts(db, settings):
    """Lost or never-configured Connect webhooks (CONTRACT.md 20): ask Stripe (accounts.retrieve) for each connected
    account with a release waiting for its payouts, at most once per ten minutes per account, and enable its payouts
    when Stripe says it takes them, as account.updated would. Network first, then one transaction per account (the
    time asked is stored even when Stripe fails, so a failing Stripe is not asked more often); Stripe not answering
    ends the round. Returns {checked, enabled, failed}."""
    from stripe_rail import StripeRefused, StripeUnavailable
    result = {'checked': 0, 'enabled': 0, 'failed': 0}
    for agent in db.rows(STRIPE_ACCOUNTS_DUE, {'before': iso(now() - STRIPE_ACCOUNT_CHECK)}):
        time.sleep(0)     # under gevent, let requests in between
        ready, error = False, None
        try:
            account = settings.stripe.account(agent['stripe_account_id'])
            ready = account['payouts_enabled'] and account['transfers_active']
        except (StripeUnavailable, StripeRefused) as exc:
            log.warning('sweep: the connected account %s could not be read (%s)', agent['stripe_account_id'],
                        type(exc).__name__)
            error = exc
        with db.transaction():
            db.execute('''UPDATE agents SET stripe_checked_at = :now,
                          stripe_payouts_enabled = max(stripe_payouts_enabled, :ready) WHERE id = :id''',
                       {'now': now_iso(), 'ready': int(ready), 'id': agent['id']})
        if error is not None:
            result['failed'] += 1
            if isinstance(error, StripeUnavailable):
                break
            continue
        result['checked'] += 1
        result['enabled'] += int(ready)
    return result


###############################################################################
# Sweeps: expiry and auto-verification ########################################
###############################################################################

# When a claim made at c.created_at on job j times out (claimTimeoutHours later), as an ISO time that sorts.
CLAIM_DUE_SQL = "strftime('%Y-%m-%dT%H:%M:%fZ', c.created_at, printf('+%d hours', j.claim_timeout_hours))"


def expire_overdue_jobs(db, settings):
    """End the jobs whose deadline has passed; expire claims that never delivered (with a penalty).

    A job with a delivery or a dispute waiting is left to auto-verify and the arbitrators; its claims
    that never delivered still expire. A multi-worker job that paid someone ends `completed`, its
    unpaid shares refunded. Then every claim of a job still running that is `claimed` claimTimeoutHours
    after it was made expires too, and its slot frees (CONTRACT.md 18; counted in reputationPenalties).
    Each job is its own transaction, so the sweep can be interrupted anywhere.
    """
    result = {'expired': 0, 'refunded': 0, 'reputationPenalties': 0, 'jobIds': []}
    overdue = [row['id'] for row in db.rows('''SELECT id FROM jobs WHERE deadline <= :now
        AND status IN ('open', 'claimed', 'delivered', 'disputed') ORDER BY deadline''', {'now': now_iso()})]
    for job_id in overdue:
        db.let_others_in()     # under gevent, let requests in between jobs (each job is its own transaction)
        try:
            penalties, ended, refunded = expire_job(db, settings, job_id)
        except Unavailable as exc:          # funded on chain, and no chain here: leave it for a server that has one
            log.warning('expiry of job %s waits: %s', job_id, exc.message)
            continue
        result['reputationPenalties'] += penalties
        result['refunded'] += refunded
        if ended:
            result['expired'] += 1
            result['jobIds'].append(job_id)
    overdue_claims = db.rows(f'''SELECT c.id, c.job_id FROM claims c JOIN jobs j ON j.id = c.job_id
        WHERE c.status = 'claimed' AND j.status IN ('open', 'claimed', 'delivered', 'disputed')
        AND j.deadline > :now AND {CLAIM_DUE_SQL} <= :now
        ORDER BY c.created_at, c.rowid''', {'now': now_iso()})
    for row in overdue_claims:
        db.let_others_in()     # as above
        with db.transaction():
            claim = get_claim(db, row['job_id'], row['id'])
            if claim['status'] == 'claimed':        # not delivered or released since the list was read
                expire_claim(db, get_job(db, row['job_id']), claim)
                result['reputationPenalties'] += 1
    return result


def expire_job(db, settings, job_id):
    """Expire one overdue job (see expire_overdue_jobs) in one transaction: (penalties, ended, refunded)."""
    with db.transaction():
        job = get_job(db, job_id)
        if job['status'] in FINAL_JOB_STATUSES or job['deadline'] > now_iso():
            return 0, False, False
        stale = db.rows("SELECT * FROM claims WHERE job_id = :id AND status = 'claimed'", {'id': job_id})
        for claim in stale:
            set_claim_status(db, claim['id'], 'expired')
            adjust_reputation(db, claim['agent_id'], *REPUTATION['expired'], job_id, claim['id'])
        if active_claims(db, job_id):
            if stale:     # a job left waiting changes only when some of its claims expired
                set_job_status(db, job_id, live_job_status(db, job))
            return len(stale), False, False
        refunded = finish_job(db, settings, job, 'expired') is not None
        ended = db.value('SELECT status FROM jobs WHERE id = :id', {'id': job_id})
        queue_event(db, settings, 'job.expired' if ended == 'expired' else 'job.completed', job_id,
                    claim_holders(db, job_id))
        return len(stale), True, refunded


def auto_verify_deliveries(db, settings):
    """Approve every delivery whose requester let the verification window pass, as an approval would."""
    delivered = db.rows('''SELECT c.id, c.job_id, c.delivered_at, j.verification_window_hours
        FROM claims c JOIN jobs j ON j.id = c.job_id WHERE c.status = 'delivered'
        ORDER BY c.delivered_at, c.rowid''')
    result = {'autoApproved': 0, 'claimIds': [], 'checked': len(delivered)}
    moment = now()
    for row in delivered:
        db.let_others_in()     # as in expire_overdue_jobs
        if parse_time(row['delivered_at']) + timedelta(hours=row['verification_window_hours']) > moment:
            continue
        with db.transaction():
            claim = get_claim(db, row['job_id'], row['id'])
            job = get_job(db, row['job_id'])
            if claim['status'] != 'delivered' or job['status'] in FINAL_JOB_STATUSES:
                continue      # superseded or settled since the list was read
            try:
                approve_claim(db, settings, job, claim, auto=True)
            except (Conflict, Unavailable):
                continue      # another delivery is under dispute, or it was funded on chain and no chain is here
        result['autoApproved'] += 1
        result['claimIds'].append(row['id'])
    return result


def run_sweeps(db, settings, fan_out=True):
    """Both sweeps once (expiry first, so that an overdue job with nothing delivered cannot be approved);
    on chain, then send the new payouts and confirm the pending ones; in stripe mode, then settle the Checkout
    Sessions of jobs still pending_payment (reconcile_checkouts: their `opened` jobs are the caller's to publish),
    ask Stripe for the connected accounts that releases wait for (check_connected_accounts) and send what is due;
    then forget the Idempotency-Key answers over 24 hours old and the browser sessions past their time."""
    result = {'expire': expire_overdue_jobs(db, settings), 'autoVerify': auto_verify_deliveries(db, settings)}
    if settings.onchain and settings.onchain.contract:
        try:
            result['escrow'] = escrow_sweep(db, settings)
        except (VerificationError, ValueError) as exc:     # the node, or a contract not this server's
            log.warning('escrow sweep waits: %s', exc)
    if settings.onchain:
        settings.onchain.broadcast(db)
        result['payouts'] = settings.onchain.confirm(db)
    if settings.stripe:
        result['checkouts'] = reconcile_checkouts(db, settings)
        result['stripeAccounts'] = check_connected_accounts(db, settings)
        result['stripePayments'] = send_stripe_payments(db, settings)
    forget_idempotency_keys(db)     # not in the result, whose shape scripts and tests read
    forget_sessions(db, settings)   # nor this: browser sessions past their time
    if fan_out:             # the server's fan-out greenlet does it there
        fan_out_events(db)  # the events of this sweep, and any a stopped server left unexpanded
    return result


###############################################################################
# Search and matching #########################################################
###############################################################################

def find_jobs(db, *, match=None, category=None, status=None, min_pay=None, sort='newest', limit=50, offset=0):
    """The seqs of a page of the jobs that match the filters, in order, and their total; `match` is an FTS5
    query (see fts_query). Sorting and paging run over the keys alone: sorting thousands of text matches with
    every column (and the claim count) along took 15 ms a search (make bench). Text alone is ranked in jobs_fts
    without reading jobs; a total filtered by category and status alone is read from job_counts. A job waiting
    for its payment (pending_payment) is never listed: without a status filter it is filtered out of the rows read
    in index order, and of the totals (ranked text alone leaves out the few pending rowids, read from jobs_status)."""
    source, where, params = 'jobs j', [], {'limit': limit, 'offset': offset}
    if match is not None:
        source = 'jobs_fts JOIN jobs j ON j.seq = jobs_fts.rowid'
        where.append('jobs_fts MATCH :match')
        params['match'] = match
    if category:
        where.append('j.category = :category')
        params['category'] = category
    if status:
        where.append('j.status = :status')
        params['status'] = status
    else:
        where.append("j.status != 'pending_payment'")
    if min_pay is not None:
        where.append('j.amount_cents >= :min_pay')
        params['min_pay'] = min_pay
    clause = (' WHERE ' + ' AND '.join(where)) if where else ''
    key, order = 'j.seq', 'bm25(jobs_fts, 4.0, 1.0), j.seq DESC' if sort == 'relevance' else JOB_SORTS[sort]
    if match is not None and len(where) == 2 and not status and sort == 'relevance':    # text alone: rank without
        ranked = [row[0] for row in db.reader().execute(  # reading jobs, every match in one pass that also counts
            "SELECT rowid FROM jobs_fts WHERE jobs_fts MATCH :match AND rowid NOT IN (SELECT seq FROM jobs WHERE "
            "status = 'pending_payment') ORDER BY bm25(jobs_fts, 4.0, 1.0), rowid DESC", {'match': match})]
        return ranked[offset:offset + limit], len(ranked)       # (a page and a count: two passes, 25 % more)
    if match is None and min_pay is None:       # job_counts has the totals by category and status
        total = db.value('''SELECT coalesce(sum(jobs), 0) FROM job_counts WHERE coalesce(:category, category) = category
                            AND coalesce(:status, status) = status AND status != 'pending_payment' ''',
                         {'category': category, 'status': status})
    else:
        total = db.value(f'SELECT count(*) FROM {source}{clause}', params)
    page = [row[0] for row in db.reader().execute(
        f'SELECT {key} FROM {source}{clause} ORDER BY {order} LIMIT :limit OFFSET :offset', params)]
    return page, total


def jobs_in_order(db, seqs, base_url=None):
    """The jobs with these seqs, in that order: rows, or with `base_url` their JSON texts (JOB_JSON_SQL)."""
    params = {f's{n}': seq for n, seq in enumerate(seqs)}
    marks = ', '.join(f':{name}' for name in params)
    if base_url is None:
        found = {job['seq']: job for job in db.rows(f'{JOB_SELECT} WHERE j.seq IN ({marks})', params)}
    else:
        found = dict(db.reader().execute(f'SELECT j.seq, {JOB_JSON_SQL} FROM ({JOB_SELECT} WHERE j.seq IN ({marks})) j',
                                     dict(params, base=base_url)))
    return [found[seq] for seq in seqs]


def list_jobs(db, **filters):
    """A page of jobs (rows) and the total that match the filters (find_jobs)."""
    seqs, total = find_jobs(db, **filters)
    return jobs_in_order(db, seqs), total


def json_page(name, texts, **rest):
    """A JSON answer {name: [texts...], **rest} whose list items are JSON texts already."""
    response.content_type = JSON_TYPE
    return b''.join((b'{"', name.encode(), b'":[', ','.join(texts).encode(), b'],', orjson.dumps(rest)[1:]))


def fts_query(text):
    """User text as an FTS5 query in which every word must match; each word is a quoted string, so
    quotes, `*`, `NEAR(`, `-`, parentheses and operators are only ever text. None if it has no word.
    (q is at most MAX_QUERY_LENGTH characters, so the query stays small.)"""
    words = dict.fromkeys(re.findall(r'\w+', text))
    return ' '.join(f'"{word}"' for word in words) or None


# Job matching for an agent: matchScore = 0.5 × category fit + 0.3 × language fit + 0.2 × pay fit.
# Jobs outside the asked categories, or requiring a language not asked for, are not matches at all.
MATCH_JOBS_SQL = f'''
    SELECT * FROM (
        SELECT {JOB_COLUMNS},
            CASE WHEN :languages IS NULL THEN 1.0
                 WHEN lower(json_extract(j.requirements, '$.language')) IN (SELECT value FROM json_each(:languages))
                   OR EXISTS (SELECT 1 FROM json_each(j.requirements, '$.languages') l
                              WHERE lower(l.value) IN (SELECT value FROM json_each(:languages))) THEN 1.0
                 WHEN coalesce(json_type(j.requirements, '$.language'), 'null') = 'null'
                   AND NOT EXISTS (SELECT 1 FROM json_each(j.requirements, '$.languages') l
                                   WHERE l.type != 'null') THEN 0.5
                 ELSE 0.0 END AS language_fit,
            CASE WHEN :min_pay IS NULL OR :min_pay = 0 THEN 1.0
                 ELSE min(1.0, j.amount_cents / (2.0 * :min_pay)) END AS pay_fit
        FROM jobs j
        WHERE j.status = 'open' AND j.deadline > :now AND j.amount_cents >= coalesce(:min_pay, 0)
          AND (:categories IS NULL OR j.category IN (SELECT value FROM json_each(:categories))))
    WHERE language_fit > 0'''


def match_jobs(db, categories, languages, min_pay, limit):
    """Open jobs for an agent's categories, languages and minimum pay, best first: (jobs, total)."""
    params = {'categories': json.dumps(categories) if categories else None,
              'languages': json.dumps([l.lower() for l in languages]) if languages else None,
              'min_pay': min_pay, 'now': now_iso(), 'limit': limit}
    total = db.value(f'SELECT count(*) FROM ({MATCH_JOBS_SQL})', params)
    jobs = db.rows(f'''SELECT *, 0.5 + 0.3 * language_fit + 0.2 * pay_fit AS match_score FROM ({MATCH_JOBS_SQL})
                       ORDER BY match_score DESC, amount_cents DESC, seq DESC LIMIT :limit''', params)
    return jobs, total


def job_languages(job):
    """The languages a job asks for (requirements.language or .languages), lowercased."""
    requirements = json.loads(job['requirements'])
    found = requirements.get('languages')
    found = found if isinstance(found, list) else [found] if found else []
    if requirements.get('language'):
        found.append(requirements['language'])
    return {str(language).lower() for language in found}


# Agent matching: the weighted mean of the fits that apply (a fit applies when both sides say something):
# category 0.35, language 0.25, reputation 0.20 (score / (score + 10)), value 0.10 (the job's pay within the
# agent's minimumJobValue..maxJobValue), currency 0.10 (in acceptedCurrencies). An agent whose categories
# or languages exclude the job is no match.
AGENT_MATCH_WEIGHTS = {'category': 0.35, 'language': 0.25, 'reputation': 0.20, 'value': 0.10, 'currency': 0.10}


def agent_match_score(agent, *, category=None, languages=(), job=None):
    """matchScore of an agent for a category/languages (and a job's pay and currency), or None."""
    capabilities, pricing = json.loads(agent['capabilities']), json.loads(agent['pricing'])
    fits = {}
    if category:
        offered = capabilities.get('categories') or []
        fits['category'] = 1.0 if category in offered else 0.5 if not offered else 0.0
    if languages:
        spoken = {str(language).lower() for language in capabilities.get('languages') or []}
        fits['language'] = 1.0 if spoken & set(languages) else 0.5 if not spoken else 0.0
    if 0.0 in fits.values():
        return None
    points = agent['reputation'] / 100
    fits['reputation'] = points / (points + 10)
    if job is not None:
        pay = job['amount_cents'] / 100
        low, high = pricing.get('minimumJobValue'), capabilities.get('maxJobValue')
        fits['value'] = 1.0 if (low is None or pay >= low) and (high is None or pay <= high) else 0.0
        accepted = pricing.get('acceptedCurrencies')
        fits['currency'] = 1.0 if not accepted or job['currency'] in accepted else 0.0
    weight = sum(AGENT_MATCH_WEIGHTS[name] for name in fits)
    return round(sum(AGENT_MATCH_WEIGHTS[name] * fit for name, fit in fits.items()) / weight, 4)


# agent_match_score in SQL, so that a page of GET /api/agents/match is scored, counted and sorted by SQLite
# (20,000 agents in Python took 1.4 s): each fit as a SQL expression over `a`, an agent row.
AGENT_FIT_SQL = {
    'category': """CASE WHEN coalesce(json_array_length(a.capabilities, '$.categories'), 0) = 0 THEN 0.5
        WHEN EXISTS (SELECT 1 FROM json_each(a.capabilities, '$.categories') WHERE value = :category) THEN 1.0
        ELSE 0.0 END""",
    'language': """CASE WHEN coalesce(json_array_length(a.capabilities, '$.languages'), 0) = 0 THEN 0.5
        WHEN EXISTS (SELECT 1 FROM json_each(a.capabilities, '$.languages') spoken
                     WHERE unicode_lower(spoken.value) IN (SELECT value FROM json_each(:languages))) THEN 1.0
        ELSE 0.0 END""",
    'reputation': '(a.reputation / 100.0) / (a.reputation / 100.0 + 10)',
    'value': """CASE WHEN (json_extract(a.pricing, '$.minimumJobValue') IS NULL
                           OR :pay >= json_extract(a.pricing, '$.minimumJobValue'))
                      AND (json_extract(a.capabilities, '$.maxJobValue') IS NULL
                           OR :pay <= json_extract(a.capabilities, '$.maxJobValue')) THEN 1.0 ELSE 0.0 END""",
    'currency': """CASE WHEN coalesce(json_array_length(a.pricing, '$.acceptedCurrencies'), 0) = 0
        OR EXISTS (SELECT 1 FROM json_each(a.pricing, '$.acceptedCurrencies') WHERE value = :currency) THEN 1.0
        ELSE 0.0 END""",
}


def match_agents(db, *, category, languages, min_reputation, job, limit, offset):
    """A page of the agents matching a category/languages (or a job), best first, and how many match in all:
    ([(agent row, matchScore)], total)."""
    fits = [name for name, wanted in (('category', category), ('language', languages)) if wanted]
    kept = ' AND '.join(f'({AGENT_FIT_SQL[name]}) != 0.0' for name in fits) or '1'
    fits += ['reputation'] + (['value', 'currency'] if job is not None else [])
    weight = sum(AGENT_MATCH_WEIGHTS[name] for name in fits)       # in agent_match_score's order: the same float
    points = ' + '.join(f':weight_{name} * ({AGENT_FIT_SQL[name]})' for name in fits)
    params = {**{f'weight_{name}': AGENT_MATCH_WEIGHTS[name] for name in fits},
              'category': category, 'languages': json.dumps(sorted(languages)), 'low': min_reputation,
              'requester': job and job['requester_id'], 'pay': job and job['amount_cents'] / 100,
              'currency': job and job['currency'], 'weight': weight, 'limit': limit, 'offset': offset}
    matching = f"""FROM agents a WHERE a.reputation >= :low AND (:requester IS NULL OR a.account_id != :requester)
                   AND {kept}"""
    page = db.rows(f"""SELECT a.id, round(({points}) / :weight, 4) AS score, count(*) OVER () AS total {matching}
                       ORDER BY score DESC, a.reputation DESC, a.created_at, a.rowid
                       LIMIT :limit OFFSET :offset""", params)
    total = page[0]['total'] if page else db.value(f'SELECT count(*) {matching}', params)
    if not page:
        return [], total
    rows = {row['id']: row for row in db.rows(
        f"{AGENT_SELECT} WHERE a.id IN (SELECT value FROM json_each(:ids))",
        {'ids': json.dumps([row['id'] for row in page])})}
    return [(rows[row['id']], agent_match_score(rows[row['id']], category=category, languages=languages, job=job))
            for row in page], total


###############################################################################
# The live job stream #########################################################
###############################################################################

_CLOSE = object()   # put into a stream's queue when the server stops


def job_summary(job, base_url):
    """What a `job.new` event carries: the job without its long description."""
    shown = job_json(job, base_url)
    return {key: shown[key] for key in (
        'id', 'status', 'title', 'category', 'paymentAmount', 'paymentCurrency', 'paymentRail', 'requirements',
        'maxWorkers', 'competitionMode', 'deadline', 'minReputation', 'createdAt', 'url')}


class StreamFilter:
    """Which jobs a stream wants: categories (none: all) and a minimum pay in cents."""

    def __init__(self, categories=(), min_pay=None):
        self.categories = tuple(categories)
        self.min_pay = min_pay

    def wants(self, job):
        return ((not self.categories or job['category'] in self.categories)
                and (self.min_pay is None or job['amount_cents'] >= self.min_pay))

    def as_json(self):
        return {'categories': list(self.categories),
                'min_pay': None if self.min_pay is None else format_cents(self.min_pay)}


class StreamHub:
    """Fans each new job out to the open streams that want it.

    A stream is a greenlet waiting on its own queue: an idle stream costs a few kilobytes and no CPU,
    and a post wakes only the streams whose filter the job passes.
    """

    def __init__(self, base_url, db=None):
        self.base_url = base_url
        self.db = db            # publish waits for a held transaction (Database.hold) to commit
        self.streams = {}
        self.closed = False

    def subscribe(self, stream_filter):
        queue = gevent.queue.Queue(maxsize=1000)
        self.streams[queue] = stream_filter
        return queue

    def unsubscribe(self, queue):
        self.streams.pop(queue, None)

    def publish(self, job):
        """Offer a committed job to the streams: now, or once the transaction this greenlet holds commits."""
        if self.db is None:
            self.offer(job)
        else:
            self.db.after_commit(functools.partial(self.offer, job))

    def offer(self, job):
        """Offer a committed job to every stream that wants it (a stream 1,000 jobs behind misses it).
        The event is rendered once, whatever the number of streams."""
        event = None
        for queue, stream_filter in list(self.streams.items()):
            if stream_filter.wants(job):
                event = event or (job['id'], sse('job.new', job_summary(job, self.base_url), job['id']))
                try:
                    queue.put_nowait(event)
                except gevent.queue.Full:
                    pass

    def close(self):
        """End every stream with a `timeout` event (server shutdown)."""
        self.closed = True
        for queue in list(self.streams):
            try:
                queue.put_nowait(_CLOSE)
            except gevent.queue.Full:
                pass


def sse(event, data, event_id=None):
    """One Server-Sent Event; every event carries a JSON data line."""
    head = f'id: {event_id}\n' if event_id else ''
    return f'{head}event: {event}\ndata: {json.dumps(data, separators=(",", ":"))}\n\n'.encode('utf-8')


def job_stream(svc, stream_filter, after_seq=None, since=None):
    """The events of one /api/jobs/stream connection, as a generator of bytes.

    It subscribes before replaying (open jobs after `after_seq` or created after `since`, oldest first), so
    that no job posted meanwhile is lost; a job both replayed and queued is sent once.
    """
    settings, hub = svc.settings, svc.hub
    queue = hub.subscribe(stream_filter)
    try:
        yield b'retry: 3000\n' + sse('connected', {'filters': stream_filter.as_json(),
                                                   'heartbeatSeconds': settings.stream_heartbeat,
                                                   'maxSeconds': settings.stream_max_seconds})
        sent = set()
        if after_seq is not None or since is not None:
            if since is not None:       # start at the first job made after it (by jobs_created, not every open job)
                after_seq = svc.db.value('''SELECT coalesce(min(seq), 1 << 62) - 1 FROM jobs INDEXED BY jobs_created
                                            WHERE created_at > :since''', {'since': since})
            for job in svc.db.rows(f'''{JOB_SELECT} WHERE j.status = 'open' AND j.seq > :seq
                                       AND j.created_at > :since ORDER BY j.seq LIMIT 500''',
                                   {'seq': after_seq, 'since': since or ''}):
                if stream_filter.wants(job):
                    sent.add(job['id'])
                    yield sse('job.new', job_summary(job, settings.base_url), job['id'])
        ends = time.monotonic() + settings.stream_max_seconds
        while not hub.closed:
            left = ends - time.monotonic()
            if left <= 0:
                break
            try:
                item = queue.get(timeout=min(settings.stream_heartbeat, left))
            except gevent.queue.Empty:
                if ends - time.monotonic() > 0:
                    yield sse('heartbeat', {'time': now_iso()})
                continue
            if item is _CLOSE:
                break
            job_id, event = item
            if job_id not in sent:
                yield event
        reason = 'the server is stopping' if hub.closed else 'the maximum duration was reached'
        yield sse('timeout', {'reason': reason, 'reconnect': True})
    finally:
        hub.unsubscribe(queue)


###############################################################################
# Read replicas ###############################################################
###############################################################################


def write_heartbeat(db, moment=None):
    """Store the time (unix seconds, default now) as the primary's heartbeat, in one transaction."""
    moment = time.time() if moment is None else moment
    with db.transaction():
        db.execute('''INSERT INTO chain_state (name, value) VALUES ('heartbeat_ms', :ms)
                      ON CONFLICT (name) DO UPDATE SET value = :ms''', {'ms': int(moment * 1000)})


def replica_lag(db):
    """Seconds since the primary's newest heartbeat this database holds, to a tenth (None before the first)."""
    beat = db.value("SELECT value FROM chain_state WHERE name = 'heartbeat_ms'")
    return None if beat is None else round(max(0.0, time.time() - beat / 1000), 1)


def replica_lagging(service, lag):
    """A read replica's lag (`lag`, read by replica_lag) when it is over --max-replica-lag, or the lag it last had
    over it while the view that lagged is not yet replaced by a fresh one (watch_replica_forever): it then serves no
    reads. Else None."""
    if lag is not None and lag > service.settings.max_replica_lag:
        return lag
    return service.replica_resync_lag


def publish_replicated_jobs(db, hub, after_seq, waiting):
    """Offer the streams of a replica the jobs the primary made after `after_seq` that are open now, and those of
    `waiting` (seen pending_payment) that have opened since; the new (after_seq, waiting)."""
    rows = db.rows(f'{JOB_SELECT} WHERE j.seq > :seq ORDER BY j.seq LIMIT 1000', {'seq': after_seq})
    if waiting:
        rows += db.rows(f"""{JOB_SELECT} WHERE j.id IN (SELECT value FROM json_each(:ids))
                            AND j.status != 'pending_payment' ORDER BY j.seq""", {'ids': json.dumps(sorted(waiting))})
    waiting = set(waiting)
    for job in {row['id']: row for row in rows}.values():      # a job made and opened since the last look: once
        after_seq = max(after_seq, job['seq'])
        if job['status'] == 'pending_payment':
            waiting.add(job['id'])
            continue
        waiting.discard(job['id'])
        if job['status'] == 'open':
            hub.publish(job)
    return after_seq, waiting


###############################################################################
# Routes: the service, accounts and agents ####################################
###############################################################################

ROUTES = []
_READ = object()   # the default rate-limit class: 'read' for GET, none otherwise


def route(method, path, limit=_READ):
    """Register a handler for METHOD PATH with its rate-limit class (None: not limited)."""
    def register(handler):
        ROUTES.append((method, path, handler, ('read' if method == 'GET' else None) if limit is _READ else limit))
        return handler
    return register


def openapi_path(path):
    """A route path in OpenAPI form: /api/jobs/<job_id> (or <job_id:re:...>) becomes /api/jobs/{job_id}, and
    bottle's escaped colon (/message\\:send) a colon."""
    return re.sub(r'<(\w+)(?::[^>]*)?>', r'{\1}', path).replace('\\:', ':')


def service():
    """The Service of the app handling this request."""
    return request.app.service


MAX_OFFSET = 1_000_000_000
MAX_QUERY_PARAMS = 50


def page_params(query):
    """limit (1..200, clamped above) and offset (0..MAX_OFFSET) from the query string."""
    def number(name, default, low):
        raw = query.get(name)
        if raw is None or raw == '':
            return default
        if not re.fullmatch(r'[0-9]+', raw.strip()):
            raise BadRequest(f'{name} must be a whole number of at least {low}.', code='invalid_parameter',
                             fields={name: f'must be a whole number of at least {low}'})
        return int(raw)
    limit, offset = number('limit', 50, 1), number('offset', 0, 0)
    if limit < 1:
        raise BadRequest('limit must be at least 1.', code='invalid_parameter', fields={'limit': 'must be 1 to 200'})
    if offset > MAX_OFFSET:
        raise BadRequest(f'offset must be at most {MAX_OFFSET}.', code='invalid_parameter',
                         fields={'offset': f'must be at most {MAX_OFFSET}'})
    return min(limit, 200), offset


def query_choice(query, name, options, default=None):
    value = query.get(name) or default
    if value is not None and value not in options:
        raise BadRequest(f'{name} must be one of {", ".join(options)}.', code='invalid_parameter',
                         fields={name: f'must be one of {", ".join(options)}'})
    return value


def query_min_pay(query):
    raw = query.get('min_pay')
    if raw is None or raw == '':
        return None
    try:
        value = Decimal(raw.strip()) if _DECIMAL_NUMBER.fullmatch(raw.strip()) else Decimal(-1)
    except InvalidOperation:
        value = Decimal(-1)
    if not value.is_finite() or value < 0:
        raise BadRequest('min_pay must be a number of at least 0, such as 10.5.', code='invalid_parameter',
                         fields={'min_pay': 'must be a number of at least 0'})
    value = min(value, Decimal(MAX_PAYMENT_CENTS + 1) / 100)   # nothing costs more; keeps SQLite's integers small
    return int((value * 100).to_integral_value(rounding='ROUND_CEILING'))


# System ----------------------------------------------------------------------

@route('GET', '/api/health', limit=None)
def health():
    svc = service()
    try:
        connected = svc.db.value('SELECT 1') == 1
    except apsw.Error:
        connected = False
    health = {'status': 'ok' if connected else 'unavailable', 'version': __version__,
              'dbConnected': connected, 'payments': 'onchain' if svc.settings.onchain else 'simulated',
              'rails': {'base': 'onchain' if svc.settings.onchain else 'simulated',
                        'stripe': 'stripe' if svc.stripe else 'simulated'},
              'replication': {'enabled': bool(svc.settings.replica_url),
                              'url': replication.public_url(svc.settings.replica_url)},
              'role': 'replica' if svc.replica else 'primary'}
    if svc.replica and connected:
        health['replicaOf'] = svc.db.path
        health['lag'] = replica_lag(svc.db)
        lagging = replica_lagging(svc, health['lag'])
        if lagging is not None:
            # Over its limit: a proxy's health check takes it out of the pool until it catches up.
            error = ReplicaLagging(lagging, svc.settings.max_replica_lag)
            response.status = 503
            response.set_header('Retry-After', '5')
            health.update(status='lagging', error=error.message, code=error.code)
    if svc.settings.onchain:
        health['chain'] = svc.settings.onchain.health()
        health['escrow'] = svc.settings.onchain.escrow_health()
    if not connected:
        # The health shape, with the error fields too, for clients that read every 5xx as an error.
        response.status = 503
        health.update(error='The database cannot be read.', code='unavailable')
    return cacheable(health, 1)


def metrics_state(svc):
    """What /metrics shows of the service now: a few indexed counts and what the server already knows (the
    chain's reachability is health's, asked at most every 2 s with a 2 s time-out)."""
    db = svc.db
    deliveries = {'pending': 0, 'failed': 0}
    for row in db.rows("""SELECT status, count(*) AS n FROM webhook_deliveries INDEXED BY webhook_deliveries_due
                          WHERE status IN ('pending', 'failed') GROUP BY status"""):
        deliveries[row['status']] = row['n']
    pending = {(rail, kind): 0 for rail in RAILS.values() for kind in ('payout', 'refund')}
    for row in db.rows("""SELECT rail, type, count(*) AS n FROM payments INDEXED BY payments_pending
                          WHERE status = 'pending' AND type IN ('release', 'refund') GROUP BY rail, type"""):
        pending[(row['rail'], 'payout' if row['type'] == 'release' else 'refund')] = row['n']
    sizes = [os.path.getsize(path) for path in (db.path, db.path + '-wal') if os.path.exists(path)]
    last_sweep, cache = svc.last_sweep or (None, None), svc.read_cache
    return metrics.State(open_streams=len(svc.hub.streams), webhook_deliveries=deliveries, payments_pending=pending,
                         last_sweep_at=last_sweep[0], last_sweep_seconds=last_sweep[1],
                         chain_reachable=svc.settings.onchain.health()['reachable'] if svc.settings.onchain else None,
                         database_bytes=sum(sizes), replica_lag=replica_lag(db) if svc.replica else None,
                         replica_reopenings=svc.replica_reopenings if svc.replica else None,
                         escrow_proposals=escrow_proposals(db) if svc.settings.onchain and svc.settings.onchain.contract
                         else None, read_cache=None if cache is None else (cache.hits, cache.misses, cache.size),
                         jobs_needing_admin=db.value('SELECT count(*) FROM jobs INDEXED BY jobs_needs_admin '
                                                     'WHERE needs_admin IS NOT NULL'))


def escrow_proposals(db):
    """Contract mode: how many jobs have scheduled payouts waiting to be proposed, and proposed (CONTRACT 21)."""
    counts = {'waiting': 0, 'proposed': 0}
    for row in db.rows("""SELECT call_id IS NOT NULL AS proposed, count(DISTINCT job_id) AS n FROM payments
                          INDEXED BY payments_scheduled WHERE status = 'scheduled' GROUP BY 1"""):
        counts['proposed' if row['proposed'] else 'waiting'] = row['n']
    return counts


@route('GET', '/metrics')
def get_metrics():
    """The Prometheus text format of every series (metrics.py), for admin keys."""
    if not is_admin(require_account()):
        raise Forbidden('Only an admin key may read the metrics.')
    response.content_type = metrics.CONTENT_TYPE
    return service().metrics.scrape()


@route('GET', '/api/stats')
def stats():
    db = service().db
    counts = db.row('''SELECT coalesce(sum(status != 'pending_payment'), 0) AS total,
        coalesce(sum(status = 'open'), 0) AS open, coalesce(sum(status = 'completed'), 0) AS completed
        FROM jobs''')
    released = {row['currency']: row['amount'] for row in db.rows(
        "SELECT currency, sum(amount) AS amount FROM payments WHERE type = 'release' GROUP BY currency")}
    return {
        'totalJobs': counts['total'],
        'totalAgents': db.value('SELECT count(*) FROM agents'),
        'totalUSDC': format_units(released.get('USDC', 0), 'USDC'),
        'totalUSD': format_units(released.get('USD', 0), 'USD'),
        'openJobs': counts['open'],
        'completedJobs': counts['completed'],
        'openDisputes': db.value("SELECT count(*) FROM disputes WHERE status = 'open'"),
        'totalArbitrators': db.value('SELECT count(*) FROM arbitrators'),
    }


# Accounts and agents ---------------------------------------------------------

def require_open_registration():
    """403 when registration is closed; 415 unless the body is declared JSON (no cross-site form signs anyone up)."""
    if not service().settings.open_registration:
        raise Forbidden('Open registration is turned off here; ask the operator for an API key.',
                        code='registration_closed')
    require_json_content_type()


@route('POST', '/api/accounts', limit='registration')
def post_account():
    require_open_registration()
    form = Form(read_json_body())
    name = form.parsed('name', read_name, required=True)
    form.done()
    account, key = create_account(service().db, name)
    response.status = 201
    return {'account': {'id': account['id'], 'name': account['name'], 'role': account['role']},
            'apiKey': key}


@route('PATCH', '/api/accounts/<account_id>', limit='account_admin')
def patch_account(account_id):
    """An admin exempts an account from x402 prices, or binds it to them again."""
    account = require_account()
    account_id = parse_uuid(account_id, 'accountId')
    require_admin(account)
    form = Form(read_json_body())
    exempt = form.boolean('x402Exempt', required=True)
    form.done()
    db = service().db
    with db.transaction():
        if not db.execute('UPDATE accounts SET x402_exempt = :exempt WHERE id = :id',
                          {'exempt': int(exempt), 'id': account_id}):
            raise NotFound('No account has this id.')
        row = db.row('SELECT id, name, role, x402_exempt FROM accounts WHERE id = :id', {'id': account_id})
        return {'account': {'id': row['id'], 'name': row['name'], 'role': row['role'],
                            'x402Exempt': bool(row['x402_exempt'])}}


@route('POST', '/api/agents/register', limit='registration')
def post_agent_register():
    require_open_registration()
    fields = read_agent_body(read_json_body(), service().settings)
    db = service().db
    with db.transaction():
        account, key = create_account(db, fields['name'])
        agent, secret = create_agent(db, account['id'], fields, service().settings.max_agents_per_account)
    response.status = 201
    return {'agent': agent_json(agent, account), 'apiKey': key, 'webhookSecret': secret}


@route('POST', '/api/agents', limit='agents_create')
def post_agent():
    account = require_account()
    svc = service()
    require_agent_room(svc.db, account['id'], svc.settings.max_agents_per_account)    # before the body (and in create_agent)
    agent, secret = create_agent(svc.db, account['id'], read_agent_body(read_json_body(), svc.settings),
                                 svc.settings.max_agents_per_account)
    response.status = 201
    return {'agent': agent_json(agent, account), 'webhookSecret': secret}


@route('GET', '/api/agents')
def list_agents():
    query = request.query
    sort = query_choice(query, 'sort', tuple(AGENT_SORTS), 'reputation')
    limit, offset = page_params(query)
    db = service().db
    agents = db.rows(f'{AGENT_SELECT} ORDER BY {AGENT_SORTS[sort]} LIMIT :limit OFFSET :offset',
                     {'limit': limit, 'offset': offset})
    viewer = caller()
    return {'agents': [agent_json(agent, viewer) for agent in agents],
            'total': db.value('SELECT count(*) FROM agents'), 'limit': limit, 'offset': offset}


AGENT_HISTORY = 200     # reputation changes an agent's detail shows


def agent_detail(db, agent_id, viewer=None):
    """An agent with its 50 newest claims and 200 newest reputation changes, as GET /api/agents/:id shows it
    to `viewer` (an account, or None)."""
    agent = get_agent(db, agent_id)
    claims = readable_claims(db, 'c.agent_id = :id ORDER BY c.created_at DESC, c.rowid DESC LIMIT 50',
                             {'id': agent['id']}, viewer)
    history = db.rows('''SELECT * FROM reputation_events WHERE agent_id = :id
                         ORDER BY created_at DESC, rowid DESC LIMIT :limit''',
                      {'id': agent['id'], 'limit': AGENT_HISTORY})
    return {'agent': agent_json(agent, viewer), 'claims': [claim_json(c, c['readable']) for c in claims],
            'reputationHistory': [reputation_json(e) for e in history]}


@route('GET', '/api/agents/<agent_id>')
def show_agent(agent_id):
    return agent_detail(service().db, parse_uuid(agent_id, 'agentId'), caller())


def owned_agent(agent_id, account, admin_too=True):
    """The agent, if the caller owns it (or is an admin, when `admin_too`); else 403."""
    agent = get_agent(service().db, parse_uuid(agent_id, 'agentId'))
    if agent['account_id'] != account['id'] and not (admin_too and is_admin(account)):
        raise Forbidden("Only the agent's owner may do that.")
    return agent


@route('PATCH', '/api/agents/<agent_id>', limit='agents_create')
def patch_agent(agent_id):
    account = require_account()
    agent_id = parse_uuid(agent_id, 'agentId')
    svc = service()
    agent = owned_agent(agent_id, account, admin_too=False)     # before the body: strangers' bodies are never read
    changes = read_agent_body(read_json_body(), svc.settings, partial=True)
    for column in ('capabilities', 'pricing'):
        if column in changes:
            changes[column] = json.dumps(changes[column])
    if 'webhook_url' in changes:
        changes['webhook_disabled_at'] = None      # a new (or the same) URL turns a disabled webhook back on
    if changes:
        assignments = ', '.join(f'{column} = :{column}' for column in changes)
        with svc.db.transaction():
            if 'wallet_address' in changes:
                require_unlocked_wallet(svc.db, get_agent(svc.db, agent['id']), changes['wallet_address'])
            svc.db.execute(f'UPDATE agents SET {assignments}, updated_at = :now WHERE id = :id',
                           dict(changes, now=now_iso(), id=agent['id']))
            if 'webhook_url' in changes:
                resume_webhook(svc.db, agent['id'])     # and resumes a paused one
    return {'agent': agent_json(get_agent(svc.db, agent['id']), account)}


@route('POST', '/api/agents/<agent_id>/webhook-secret', limit='webhook_test')
def post_webhook_secret(agent_id):
    account = require_account()
    agent = owned_agent(agent_id, account, admin_too=False)
    read_json_body(optional=True)
    secret = new_webhook_secret()
    db = service().db
    with db.transaction():
        db.execute('UPDATE agents SET webhook_secret = :secret, updated_at = :now WHERE id = :id',
                   {'secret': secret, 'now': now_iso(), 'id': agent['id']})
    return {'agentId': agent['id'], 'webhookSecret': secret}


@route('POST', '/api/agents/<agent_id>/stripe/onboarding', limit='agents_create')
def post_stripe_onboarding(agent_id):
    """The agent's Stripe Connect onboarding (its owner only): its Express account, made once, and a fresh link."""
    account = require_account()
    agent = owned_agent(agent_id, account, admin_too=False)
    read_json_body(optional=True)
    svc = service()
    if svc.stripe is None:
        raise NotFound('The stripe rail is simulated on this service: there is no Stripe account to open.',
                       code='stripe_not_enabled')
    return onboard_agent(svc.db, svc.settings, agent)


def delivery_json(row):
    return {'id': row['id'], 'event': row['event'], 'status': row['status'], 'attempts': row['attempts'],
            'lastStatusCode': row['last_status_code'], 'lastError': row['last_error'],
            'nextAttemptAt': row['next_attempt_at'], 'createdAt': row['created_at'],
            'deliveredAt': row['delivered_at'], 'payload': json.loads(row['payload'])}


@route('GET', '/api/agents/<agent_id>/webhooks')
def get_webhook_deliveries(agent_id):
    account = require_account()
    agent = owned_agent(agent_id, account)
    query = request.query
    limit, offset = page_params(query)
    status = query_choice(query, 'status', ('pending', 'delivered', 'failed'))
    clause = 'agent_id = :agent' + (' AND status = :status' if status else '')
    params = {'agent': agent['id'], 'status': status, 'limit': limit, 'offset': offset}
    db = service().db
    rows = db.rows(f'''SELECT * FROM webhook_deliveries WHERE {clause}
                       ORDER BY created_at DESC, rowid DESC LIMIT :limit OFFSET :offset''', params)
    return {'deliveries': [delivery_json(row) for row in rows],
            'total': db.value(f'SELECT count(*) FROM webhook_deliveries WHERE {clause}', params),
            'limit': limit, 'offset': offset}


@route('POST', '/api/agents/<agent_id>/webhooks/<delivery_id>/redeliver', limit='webhook_test')
def post_redeliver(agent_id, delivery_id):
    account = require_account()
    agent_id, delivery_id = parse_uuid(agent_id, 'agentId'), parse_uuid(delivery_id, 'deliveryId')
    agent = owned_agent(agent_id, account)
    read_json_body(optional=True)
    db = service().db
    with db.transaction():
        if not db.value('SELECT 1 FROM webhook_deliveries WHERE id = :id AND agent_id = :agent',
                        {'id': delivery_id, 'agent': agent['id']}):
            raise NotFound('This agent has no delivery with this id.')
        if agent['webhook_url'] is None or agent['webhook_disabled_at']:
            raise Conflict('The agent has no live webhook; set its webhookUrl (PATCH /api/agents/:id) first.',
                           code='webhook_disabled')
        db.execute('''UPDATE webhook_deliveries SET status = 'pending', attempts = 0, last_error = NULL,
                      next_attempt_at = :due, delivered_at = NULL, updated_at = :now WHERE id = :id''',
                   {'now': now_iso(), 'due': None if agent['webhook_paused_at'] else now_iso(), 'id': delivery_id})
        response.status = 202
        return {'delivery': delivery_json(db.row('SELECT * FROM webhook_deliveries WHERE id = :id',
                                                 {'id': delivery_id}))}


###############################################################################
# Routes: jobs, search, matching and the stream ###############################
###############################################################################

@route('GET', '/api/jobs')
def get_jobs():
    query = request.query
    limit, offset = page_params(query)
    svc = service()
    seqs, total = find_jobs(
        svc.db, category=query_choice(query, 'category', CATEGORIES),
        status=query_choice(query, 'status', JOB_STATUSES), min_pay=query_min_pay(query),
        sort=query_choice(query, 'sort', tuple(JOB_SORTS), 'newest'), limit=limit, offset=offset)
    return json_page('jobs', jobs_in_order(svc.db, seqs, svc.settings.base_url), total=total, limit=limit,
                     offset=offset)


_TX_HASH = re.compile(r'0x[0-9a-fA-F]{64}')


JOB_JSON_FIELDS = ('requirements', 'acceptance_criteria')       # stored as JSON text


def same_job(job, fields):
    """Is a stored job the one these validated POST /api/jobs fields describe (every field equal)?"""
    return all((json.loads(job[name]) if name in JOB_JSON_FIELDS else job[name]) == value
               for name, value in fields.items())


def job_funded_by(db, settings, tx_hash, account, fields):
    """The job a funding hash already paid for, if this requester posted it with these very fields (a retry); 409
    payment_replayed if the hash paid for anything else, or for another job of the caller (with its jobId: a hash
    is not an idempotency key, CONTRACT 14); None if it is unused. (No signature is asked again: the hash was bound
    to this account when it funded the job, so the answer shows only what the account already owns.)"""
    used = used_payment(db, settings.chain_id, tx_hash)
    if used is None:
        return None
    if used['purpose'] == 'escrow' and used['account_id'] == account['id']:
        job = get_job(db, used['job_id'])
        if same_job(job, fields):
            return job
        raise Conflict(f'This transaction funded your job {job["id"]} already, whose fields differ from these: fund '
                       'each job with its own transfer (a retry sends the same body, or an Idempotency-Key).',
                       code='payment_replayed', extra={'jobId': job['id']})
    raise Conflict('This transaction has paid for something else already.', code='payment_replayed')


def create_funded_job(svc, fields, body, account):
    """POST /api/jobs on rail base in onchain mode: check the funding transfer and its signature, then create
    the job. Returns (job, created). Every payment error carries fundingTypedData, what to sign."""
    tx_hash = body.get('escrowTxHash')
    well_formed = tx_hash.lower() if isinstance(tx_hash, str) and _TX_HASH.fullmatch(tx_hash) else None
    try:
        return fund_job(svc, fields, body, account, well_formed)
    except VerificationError as error:
        refusal = payment_error(error)
    except APIError as error:
        if not error.code.startswith('payment_'):
            raise
        refusal = error
    refusal.extra['fundingTypedData'] = svc.settings.onchain.funding_typed_data(account['id'], well_formed)
    raise refusal


def fund_job(svc, fields, body, account, tx_hash):
    """create_funded_job's checks in order: the hash, its earlier use, the signature's form, the chain, the
    signer; nothing is stored before they all pass."""
    onchain, db = svc.settings.onchain, svc.db
    amount = cents_to_units(fields['amount_cents'], fields['currency'])
    if body.get('escrowTxHash') is None:
        raise APIError('Fund the job first: send the USDC to payTo, then post again with escrowTxHash and '
                       'escrowSignature (fundingTypedData signed by the sender).', code='payment_required',
                       status=402, extra={'paymentRequirements': onchain.requirements(amount)})
    if tx_hash is None:
        raise APIError('escrowTxHash must be a transaction hash: 0x and 64 hexadecimal digits.',
                       code='payment_invalid', fields={'escrowTxHash': 'must be 0x and 64 hex digits'})
    existing = job_funded_by(db, svc.settings, tx_hash, account, fields)
    if existing:
        return existing, False
    from verifier.funding import signature_bytes
    signature = body.get('escrowSignature')
    signature_bytes(signature)                    # missing or malformed: refused before asking the node
    transfer = onchain.verify_funding(tx_hash, amount, account_id=account['id'], signature=signature)   # network
    funding = {'tx_hash': tx_hash, 'payer': transfer.payer, 'to': transfer.recipient, 'amount': transfer.amount}
    try:
        return create_job(db, svc.settings, fields, funding), True
    except apsw.ConstraintError:                               # the same hash, posted twice at once
        existing = job_funded_by(db, svc.settings, tx_hash, account, fields)
        if existing:
            return existing, False
        raise


@route('POST', '/api/jobs', limit='jobs_create')
def post_job():
    account = require_account()
    svc = service()
    body = read_json_body()
    fields = read_job_body(body, account)
    real = real_rails(svc.settings)
    if real and fields['rail'] not in real and not svc.settings.allow_simulated_rails:
        # simulated money must not mix with real money: free jobs would farm the reputation real ones earn
        raise BadRequest(f'Rail {fields["rail"]} is only simulated on this service, which moves real money on '
                         f'{" and ".join(sorted(real))}: post the job there.', code='rail_unavailable')
    if svc.stripe and fields['rail'] == 'stripe':       # pending until paid: nobody sees it yet
        job, checkout_url = create_checkout_job(svc, fields)
        response.status = 201
        return {'job': job_json(job, svc.settings.base_url), 'checkoutUrl': checkout_url}
    if svc.settings.onchain and svc.settings.onchain.contract and fields['rail'] == 'base':
        job, created = fund_from_deposit(svc, fields, body, account)
    elif svc.settings.onchain and fields['rail'] == 'base':
        job, created = create_funded_job(svc, fields, body, account)
    else:
        job, created = create_job(svc.db, svc.settings, fields), True
    if created:
        svc.hub.publish(job)      # committed: now the live streams may see it
    response.status = 201 if created else 200
    return {'job': job_json(job, svc.settings.base_url)}


def job_parts(db, job_id, base_url, viewer=None):
    """A job with its claims and payments, as `viewer` may see them (its page shows them to anyone)."""
    job = get_job(db, job_id)
    claims = readable_claims(db, 'c.job_id = :id ORDER BY c.created_at, c.rowid', {'id': job['id']}, viewer)
    payments = db.rows('SELECT * FROM payments WHERE job_id = :id ORDER BY seq', {'id': job['id']})
    return {'job': job_json(job, base_url), 'claims': [claim_json(c, c['readable']) for c in claims],
            'payments': [payment_json(p) for p in payments]}


def job_detail(db, job_id, base_url, viewer=None):
    """A job with its claims, payments and timeline, as GET /api/jobs/:id shows it to `viewer`."""
    detail = job_parts(db, job_id, base_url, viewer)
    detail['timeline'] = [timeline_json(step) for step in job_story(db, detail)]
    return detail


@route('GET', '/api/jobs/<job_id>')
def show_job(job_id):
    """job_detail: the job, claims and payments rendered by SQLite in one statement (JOB_DETAIL_SQL; make bench:
    0.48 → 0.6 of the ceiling), the timeline built from them (job_story) and added to the text."""
    svc = service()
    text = svc.db.value(JOB_DETAIL_SQL, {'id': parse_uuid(job_id, 'jobId'), 'base': svc.settings.base_url,
                                         **reader_params(caller())})
    if text is None:
        raise NotFound('No job has this id.')
    detail = orjson.loads(text)
    timeline = [timeline_json(step) for step in job_story(svc.db, detail)]
    tail = b',"timeline":' + orjson.dumps(timeline)
    releases = releases_to_sign(svc, detail['job']['id'], caller())
    if releases:
        tail += b',"releaseTypedData":' + orjson.dumps(releases)
    response.content_type = JSON_TYPE
    return text[:-1].encode() + tail + b'}'     # the text is one JSON object


def releases_to_sign(svc, job_id, account):
    """Contract mode, for the requester: the Release to sign for each delivery waiting for a decision, by claim id
    (approving with its signature pays at once; without one, after the contract's delay)."""
    if not (svc.settings.onchain and svc.settings.onchain.contract and account):
        return None
    job = get_job(svc.db, job_id)
    if job['escrow_deposit_id'] is None or job['requester_id'] != account['id']:
        return None
    return {claim['id']: claim_release(svc.db, svc.settings, job, claim) for claim in svc.db.rows(
        "SELECT * FROM claims WHERE job_id = :id AND status = 'delivered' ORDER BY created_at", {'id': job_id})}


@route('POST', '/api/jobs/<job_id>/claim', limit='job_action')
def post_claim(job_id):
    account = require_account()
    job_id = parse_uuid(job_id, 'jobId')
    form = Form(read_json_body(optional=True))
    agent_id = form.uuid('agentId')
    form.done()
    svc = service()
    if agent_id is None:
        owned = [row['id'] for row in svc.db.rows('SELECT id FROM agents WHERE account_id = :id LIMIT 2',
                                                  {'id': account['id']})]
        if len(owned) != 1:
            raise ValidationFailed('Say which agent claims the job.', fields={
                'agentId': 'is required: your account owns ' + ('no agent' if not owned else 'several agents')})
        agent_id = owned[0]
    claim = claim_job(svc.db, svc.settings, job_id, agent_id, account)
    response.status = 201
    return {'claim': claim_json(claim, True), 'job': job_json(get_job(svc.db, job_id), svc.settings.base_url)}


@route('POST', '/api/jobs/<job_id>/deliver', limit='job_action')
@route('POST', '/api/jobs/<job_id>/submit', limit='job_action')
def post_delivery(job_id):
    account = require_account()
    job_id = parse_uuid(job_id, 'jobId')
    claim_id, deliverable = read_deliverable(read_json_body())
    svc = service()
    claim, job = deliver_claim(svc.db, svc.settings, job_id, claim_id, deliverable, account)
    return {'claim': claim_json(claim, True), 'job': job_json(job, svc.settings.base_url)}     # the worker's own


@route('POST', '/api/jobs/<job_id>/verify', limit='job_action')
def post_verify(job_id):
    account = require_account()
    job_id = parse_uuid(job_id, 'jobId')
    require_requester(get_job(service().db, job_id), account)      # before the body (verify_claim checks again)
    form = Form(read_json_body())
    claim_id = form.uuid('claimId', required=True)
    approved = form.boolean('approved', required=True)
    reason = form.text('reason', max_len=5000, allow_empty=True)
    signature = form.parsed('releaseSignature', read_signature)     # contract mode: the payer's Release
    form.done()
    svc = service()
    job, claim, payments = verify_claim(svc.db, svc.settings, job_id, claim_id, approved, account, reason or None,
                                        signature if approved else None)
    return {'job': job_json(job, svc.settings.base_url), 'claim': claim_json(claim, True),     # the requester's
            'escrowStatus': job['escrow_status'], 'payments': [payment_json(p) for p in payments]}


@route('POST', '/api/jobs/<job_id>/cancel', limit='job_action')
def post_cancel(job_id):
    account = require_account()
    job_id = parse_uuid(job_id, 'jobId')
    svc = service()
    require_requester(get_job(svc.db, job_id), account)         # before the body (cancel_job checks again)
    read_json_body(optional=True)    # nothing to read, but a malformed body is still a 400
    job = cancel_job(svc.db, svc.settings, job_id, account)
    return {'job': job_json(job, svc.settings.base_url)}


@route('POST', '/api/jobs/<job_id>/claims/<claim_id>/release', limit='job_action')
def post_release(job_id, claim_id):
    account = require_account()
    job_id, claim_id = parse_uuid(job_id, 'jobId'), parse_uuid(claim_id, 'claimId')
    svc = service()
    require_requester(get_job(svc.db, job_id), account)         # before the body (release_claim checks again)
    read_json_body(optional=True)    # nothing to read, but a malformed body is still a 400
    claim, job = release_claim(svc.db, job_id, claim_id, account)
    return {'claim': claim_json(claim, True), 'job': job_json(job, svc.settings.base_url)}     # the requester's


# Stripe's events ---------------------------------------------------------------

@route('POST', '/api/stripe/webhook', limit='stripe_events')
def post_stripe_webhook():
    """An event from Stripe, checked by its signature, applied once (STRIPE_EVENTS); 200 once its change commits.
    Limited per IP (stripe_events, far above Stripe's pace): a bad signature costs one HMAC and touches nothing,
    and an event refused with 429 is sent again by Stripe later."""
    svc = service()
    if svc.stripe is None:
        raise NotFound('The stripe rail is simulated on this service: it takes no Stripe events.')
    from stripe_rail import InvalidSignature, StripeRefused, StripeUnavailable
    try:
        event = svc.stripe.event(read_raw_body(), request.get_header('Stripe-Signature', ''))
    except InvalidSignature:
        raise BadRequest('The Stripe-Signature header is missing or does not sign this body with the webhook '
                         'secret.', code='invalid_signature') from None
    try:
        outcome, job_id = apply_stripe_event(svc.db, svc.settings, event)
    except (StripeUnavailable, StripeRefused) as exc:
        raise provider_unavailable(exc) from None       # not applied: Stripe sends it again later
    if outcome == 'opened':
        svc.hub.publish(get_job(svc.db, job_id))        # committed: now the live streams may see it
    elif outcome == 'unheld':
        svc.send_stripe_payouts(0)      # the payments that waited for the hold go out now (else the next sweep)
    return {'received': True, 'eventId': event['id'], 'outcome': outcome, 'jobId': job_id}


# Search, matching and the stream ---------------------------------------------

MAX_QUERY_LENGTH = 500


def query_list(query, name, options=None):
    """A comma-separated query parameter as a list (checked against `options`, if given)."""
    raw = query.getunicode(name) or ''
    values = [value.strip() for value in raw.split(',') if value.strip()]
    bad = [value for value in values if options and value not in options]
    if bad or len(values) > 50 or any(len(value) > 50 for value in values):
        hint = f'one or more of {", ".join(options)}' if options else 'up to 50 short values'
        raise BadRequest(f'{name} must be a comma-separated list of {hint}.', code='invalid_parameter',
                         fields={name: f'must list {hint}'})
    return values


@route('GET', '/api/jobs/search')
def search_jobs():
    query = request.query
    text = query.getunicode('q')
    if text is not None and len(text) > MAX_QUERY_LENGTH:
        raise BadRequest(f'q must be at most {MAX_QUERY_LENGTH} characters.', code='invalid_parameter',
                         fields={'q': f'must be at most {MAX_QUERY_LENGTH} characters'})
    category = query_choice(query, 'category', CATEGORIES)
    status = query_choice(query, 'status', JOB_STATUSES)
    min_pay = query_min_pay(query)
    if not (text or '').strip() and category is None and min_pay is None:
        raise BadRequest('Give at least one of q, category and min_pay.', code='missing_query')
    sort = query_choice(query, 'sort', ('relevance',) + tuple(s for s in JOB_SORTS if s != 'oldest'),
                        'relevance' if (text or '').strip() else 'newest')
    limit, offset = page_params(query)
    match = fts_query(text) if (text or '').strip() else None
    if not (text or '').strip() and sort == 'relevance':
        sort = 'newest'              # nothing to rank by without a query
    svc = service()
    if (text or '').strip() and match is None:
        seqs, total = [], 0          # text with no word in it (only punctuation or emoji) matches nothing
    else:
        seqs, total = find_jobs(svc.db, match=match, category=category, status=status, min_pay=min_pay,
                                sort=sort, limit=limit, offset=offset)
    return json_page('results', jobs_in_order(svc.db, seqs, svc.settings.base_url), total=total, limit=limit,
                     offset=offset, query=text, filters={'category': category, 'status': status,
                                                         'min_pay': None if min_pay is None else format_cents(min_pay)},
                     sort=sort)


@route('GET', '/api/jobs/match')
def get_job_matches():
    query = request.query
    categories = query_list(query, 'categories', CATEGORIES)
    languages = query_list(query, 'languages')
    min_pay = query_min_pay(query)
    limit, _ = page_params(query)
    svc = service()
    jobs, total = match_jobs(svc.db, categories, languages, min_pay, limit)
    return {'matches': [dict(job_json(job, svc.settings.base_url), matchScore=round(job['match_score'], 4))
                        for job in jobs], 'total': total}


@route('GET', '/api/agents/match')
def get_agent_matches():
    query = request.query
    limit, offset = page_params(query)
    db = service().db
    job = None
    if query.get('job_id'):
        job = get_job(db, parse_uuid(query['job_id'], 'job_id'))
        if job['status'] == 'pending_payment':
            raise NotFound('No job has this id.')       # not matched before it is paid
        category, languages, min_reputation = job['category'], job_languages(job), job['min_reputation']
    else:
        category = query_choice(query, 'category', CATEGORIES)
        languages = {language.lower() for language in query_list(query, 'language')}
        raw = query.get('min_reputation')
        try:
            min_reputation = read_hundredths(raw) if raw not in (None, '') else 0
        except ValueError as exc:
            raise BadRequest(f'min_reputation {exc}.', code='invalid_parameter',
                             fields={'min_reputation': str(exc)}) from None
        if category is None and not languages and not raw:
            raise BadRequest('Give job_id, or at least one of category, language and min_reputation.',
                             code='missing_query')
    # the job's requester's own agents are left out: they could not claim its account's job
    page, total = match_agents(db, category=category, languages=languages, min_reputation=min_reputation, job=job,
                               limit=limit, offset=offset)
    return {'matches': [dict(agent_json(agent), matchScore=score) for agent, score in page], 'total': total,
            'limit': limit, 'offset': offset}


@route('GET', '/api/jobs/stream')
def stream_jobs():
    query = request.query
    svc = service()
    stream_filter = StreamFilter(query_list(query, 'categories', CATEGORIES), query_min_pay(query))
    after_seq = since = None
    last_event_id = request.get_header('Last-Event-ID', '').strip().lower()
    if last_event_id and _UUID.fullmatch(last_event_id):
        after_seq = svc.db.value('SELECT seq FROM jobs WHERE id = :id', {'id': last_event_id})
    elif query.get('since'):
        try:
            since = iso(parse_time(query['since']))
        except ValueError:
            raise BadRequest('since must be an ISO 8601 time, e.g. 2026-11-21T16:40:00Z.',
                             code='invalid_parameter', fields={'since': 'must be an ISO 8601 time'}) from None
    response.content_type = 'text/event-stream; charset=utf-8'
    response.set_header('Cache-Control', 'no-cache')
    response.set_header('X-Accel-Buffering', 'no')      # tell a proxy in front not to buffer the stream
    response.set_header('Connection', 'close')          # the stream's end (timeout) ends the connection
    return job_stream(svc, stream_filter, after_seq, since)


###############################################################################
# Routes: disputes, arbitration and sweeps ####################################
###############################################################################

def require_admin(account):
    if not is_admin(account):
        raise Forbidden('Only an admin key may do that.')


@route('POST', '/api/jobs/<job_id>/dispute', limit='job_action')
def post_dispute(job_id):
    account = require_account()
    job_id = parse_uuid(job_id, 'jobId')
    require_requester(get_job(service().db, job_id), account)      # before the body (open_dispute checks again)
    form = Form(read_json_body())
    claim_id = form.uuid('claimId', required=True)
    reason = form.text('reason', required=True, max_len=5000)
    form.done()
    svc = service()
    dispute, job = open_dispute(svc.db, svc.settings, job_id, claim_id, reason, account)
    response.status = 201
    return {'dispute': dispute_json(dispute, svc.settings), 'job': job_json(job, svc.settings.base_url)}


@route('GET', '/api/disputes')
def get_disputes():
    query = request.query
    limit, offset = page_params(query)
    where, params = [], {'limit': limit, 'offset': offset}
    status = query_choice(query, 'status', ('open', 'resolved'))
    if status:
        where.append('d.status = :status')
        params['status'] = status
    if query.get('job_id'):
        where.append('d.job_id = :job_id')
        params['job_id'] = parse_uuid(query['job_id'], 'job_id')
    needs_admin = query_choice(query, 'needsAdmin', ('true', 'false'))
    svc = service()
    if needs_admin:
        where.append(NEEDS_ADMIN_SQL if needs_admin == 'true' else f'NOT {NEEDS_ADMIN_SQL}')
        params['stale_before'] = stale_before(svc.settings)
    clause = (' WHERE ' + ' AND '.join(where)) if where else ''
    db = svc.db
    disputes = db.rows(f'{DISPUTE_SELECT}{clause} ORDER BY d.created_at DESC, d.rowid DESC LIMIT :limit OFFSET :offset',
                       params)
    return {'disputes': [dispute_json(d, svc.settings) for d in disputes],
            'total': db.value('SELECT count(*) FROM disputes d' + clause, params), 'limit': limit, 'offset': offset}


@route('GET', '/api/claims')
def my_claims():
    """The caller's claims (those of its agents), newest first, each with its job: what its agents hold, deliver or
    wait on (MCP's my_claims)."""
    account = require_account()
    limit, offset = page_params(request.query)
    svc = service()
    mine, params = 'c.agent_id IN (SELECT id FROM agents WHERE account_id = :account)', {'account': account['id']}
    claims = readable_claims(svc.db, f'{mine} ORDER BY c.created_at DESC, c.rowid DESC LIMIT :limit OFFSET :offset',
                             dict(params, limit=limit, offset=offset), account)
    jobs = {job['id']: job for job in svc.db.rows(f'{JOB_SELECT} WHERE j.id IN (SELECT value FROM json_each(:ids))',
                                                  {'ids': json.dumps([claim['job_id'] for claim in claims])})}
    return {'claims': [dict(claim_json(claim, claim['readable']),
                            job=job_json(jobs[claim['job_id']], svc.settings.base_url)) for claim in claims],
            'total': svc.db.value(f'SELECT count(*) FROM claims c WHERE {mine}', params), 'limit': limit,
            'offset': offset}


def dispute_detail(db, dispute_id, settings, viewer=None):
    """A dispute with its job and the disputed claim, as GET /api/disputes/:id shows it to `viewer`."""
    dispute = get_dispute(db, dispute_id)
    (claim,) = readable_claims(db, 'c.id = :id', {'id': dispute['claim_id']}, viewer)
    return {'dispute': dispute_json(dispute, settings),
            'job': job_json(get_job(db, dispute['job_id']), settings.base_url),
            'claim': claim_json(claim, claim['readable'])}


@route('GET', '/api/disputes/<dispute_id>')
def show_dispute(dispute_id):
    svc = service()
    return dispute_detail(svc.db, parse_uuid(dispute_id, 'disputeId'), svc.settings, caller())


@route('PATCH', '/api/disputes/<dispute_id>', limit='decisions')
def patch_dispute(dispute_id):
    account = require_account()
    dispute_id = parse_uuid(dispute_id, 'disputeId')
    svc = service()
    if not is_admin(account):       # before the body (resolve_dispute checks again in its transaction)
        trusted_decider(svc.db, get_dispute(svc.db, dispute_id), account)
    form = Form(read_json_body())
    outcome = form.choice('outcome', OUTCOMES, required=True)
    resolution = form.text('resolution', required=True, max_len=5000)
    resolved_by = form.text('resolvedBy', max_len=200)
    form.done()
    dispute, job = resolve_dispute(svc.db, svc.settings, dispute_id, outcome, resolution, resolved_by, account)
    return {'dispute': dispute_json(dispute, svc.settings), 'escrowStatus': job['escrow_status'],
            'jobStatus': job['status']}


@route('POST', '/api/disputes/<dispute_id>/vote', limit='votes')
def post_vote(dispute_id):
    account = require_account()
    dispute_id = parse_uuid(dispute_id, 'disputeId')
    if not service().db.value('SELECT 1 FROM arbitrators WHERE account_id = :id', {'id': account['id']}):
        raise Forbidden('You can vote only with an arbitrator your account owns.')     # before the body
    form = Form(read_json_body())
    arbitrator_id = form.uuid('arbitratorId', required=True)
    choice = form.choice('vote', OUTCOMES, required=True)
    reasoning = form.text('reasoning', default='', max_len=5000, allow_empty=True)
    form.done()
    svc = service()
    vote, dispute = cast_vote(svc.db, svc.settings, dispute_id, arbitrator_id, choice, reasoning, account)
    response.status = 201
    return {'vote': vote_json(vote), 'votesReceived': dispute['votes_received'],
            'requiredVotes': dispute['required_votes'], 'resolved': dispute['status'] == 'resolved',
            'outcome': dispute['outcome']}


@route('GET', '/api/disputes/<dispute_id>/vote')
def get_votes(dispute_id):
    db = service().db
    dispute = get_dispute(db, parse_uuid(dispute_id, 'disputeId'))
    votes = db.rows('SELECT * FROM votes WHERE dispute_id = :id ORDER BY created_at, rowid', {'id': dispute['id']})
    return {'votes': [vote_json(v) for v in votes], 'summary': vote_summary(db, dispute['id'])}


@route('POST', '/api/arbitrators', limit='arbitrators')
def post_arbitrator():
    account = require_account()
    form = Form(read_json_body())
    name = form.parsed('name', read_name, required=True)
    wallet = form.parsed('walletAddress', read_address, required=True)
    agent_id = form.uuid('agentId')
    owner_id = form.uuid('accountId')
    form.done()
    svc = service()
    arbitrator = register_arbitrator(svc.db, svc.settings, account, name, wallet, agent_id, owner_id)
    response.status = 201
    return {'arbitrator': arbitrator_json(arbitrator)}


@route('GET', '/api/arbitrators')
def get_arbitrators():
    query = request.query
    limit, offset = page_params(query)
    status = query_choice(query, 'status', ARBITRATOR_STATUSES)
    clause = ' WHERE a.status = :status' if status else ''
    params = {'status': status, 'limit': limit, 'offset': offset}
    db = service().db
    arbitrators = db.rows(f'''{ARBITRATOR_SELECT}{clause}
        ORDER BY accuracy IS NULL, accuracy DESC, votes_cast DESC, a.created_at LIMIT :limit OFFSET :offset''', params)
    return {'arbitrators': [arbitrator_json(a) for a in arbitrators],
            'total': db.value('SELECT count(*) FROM arbitrators a' + clause, params), 'limit': limit, 'offset': offset}


@route('PATCH', '/api/arbitrators/<arbitrator_id>', limit='arbitrators')
def patch_arbitrator(arbitrator_id):
    account = require_account()
    arbitrator_id = parse_uuid(arbitrator_id, 'arbitratorId')
    require_admin(account)
    form = Form(read_json_body())
    status = form.choice('status', ('active', 'suspended'))
    trusted = form.boolean('trusted')
    form.done()
    if status is None and trusted is None:
        raise ValidationFailed('Send status, trusted or both.', fields={'status': 'status or trusted is required',
                                                                       'trusted': 'status or trusted is required'})
    db = service().db
    with db.transaction():
        arbitrator = get_arbitrator(db, arbitrator_id)
        db.execute('UPDATE arbitrators SET status = :status, trusted = :trusted, updated_at = :now WHERE id = :id',
                   {'status': status or arbitrator['status'],
                    'trusted': int(arbitrator['trusted'] if trusted is None else trusted),
                    'now': now_iso(), 'id': arbitrator_id})
        return {'arbitrator': arbitrator_json(get_arbitrator(db, arbitrator_id))}


# Sweeps ----------------------------------------------------------------------

def run_sweep_for_admin(sweep):
    account = require_account()
    require_admin(account)
    read_json_body(optional=True)
    svc = service()
    return sweep(svc.db, svc.settings)


@route('POST', '/api/jobs/expire', limit='sweeps')
def post_expire():
    return run_sweep_for_admin(expire_overdue_jobs)


@route('POST', '/api/jobs/auto-verify', limit='sweeps')
def post_auto_verify():
    return run_sweep_for_admin(auto_verify_deliveries)


###############################################################################
# The application #############################################################
###############################################################################

JSON_TYPE = 'application/json; charset=utf-8'


def json_bytes(body):
    """An answer's JSON (orjson: several times faster than json for the job lists, make bench)."""
    return orjson.dumps(body)


def etag_matches(header, etag):
    """Does an If-None-Match header name this ETag (weak comparison, as RFC 9110 asks)?"""
    tags = [tag.strip().removeprefix('W/') for tag in header.split(',')]
    return '*' in tags or etag in tags


def cacheable(body, max_age):
    """A discovery document's answer (CONTRACT.md 23): `Cache-Control: max-age` and a strong ETag of its JSON; 304
    without a body when If-None-Match names it. (Its route is not rate limited.)"""
    raw = json_bytes(body)
    etag = '"' + hashlib.sha256(raw).hexdigest()[:32] + '"'
    response.set_header('Cache-Control', f'public, max-age={max_age}')
    response.set_header('ETag', etag)
    response.content_type = JSON_TYPE
    if response.status_code == 200 and etag_matches(request.headers.get('If-None-Match', ''), etag):
        response.status = 304
        return b''
    return raw


def send_error(error):
    """Turn an APIError into the JSON answer, keeping headers already set (rate limits)."""
    response.status = error.status
    response.content_type = JSON_TYPE
    for name, value in error.headers.items():
        response.set_header(name, value)
    return json_bytes(error.body())


def check_replica_schema(db):
    """Refuse to serve a replica whose schema is not this program's (the primary runs another version)."""
    version = db.value('PRAGMA user_version')
    if version != SCHEMA_VERSION:
        raise replication.ReplicationError(f'the replica {db.path} has schema version {version}, this program '
                                           f'{SCHEMA_VERSION}: run the same version as the primary')


@dataclass(frozen=True)
class Faces:
    """What the app is handed of its faces, the modules that speak other vocabularies than the marketplace's rules
    (docs/development.md). They import these rules; the rules never import them: wiring.py, the program's top,
    builds this once and hands it to make_app and command_line.main. A face's API routes register themselves with
    `route`."""
    openapi_document: object    # openapi_spec: (base URL, x402 prices) -> the document; fails on an undocumented route
    operations: dict            # openapi_spec.API_OPERATIONS: (method, rule) -> its operation (the app reads `auth`)
    x402: type                  # pay_per_call.X402: pay per call, made when --x402-price prices an endpoint
    webhook_session: object     # webhook_delivery: (allow private, DNS server) -> the client webhooks are sent with
    webhook_worker: type        # webhook_delivery.WebhookWorker: delivers the outbox under the server
    make_server: object         # http_server: (app, settings) -> the gevent server, reading requests within limits
    mount_pages: object         # pages.mount: (app) -> the signed-in browser's forms routed on the app
    run_mcp: object             # mcp_server.run: (API URL, key, time-out) -> `marketplace.py mcp`, on stdio


class Service:
    """What the handlers share: settings, the database, the rate limiter and the faces."""

    def __init__(self, settings, faces):
        if settings.x402_price and not settings.rpc_url:
            raise ValueError(X402_NEEDS_CHAIN)      # before the database file is made
        if settings.x402_price and not settings.x402_pay_to:
            raise ValueError(X402_NEEDS_PAY_TO)
        if stripe_mode(settings) and not settings.stripe_webhook_secret:
            raise ValueError(STRIPE_NEEDS_WEBHOOK_SECRET)
        self.settings = settings
        self.replica = bool(settings.read_replica_of)   # reads only, from the primary's replica (ReplicaDatabase)
        self.replica_reopenings = 0     # a replica's views reopened: lagged, caught up, failed (watch_replica_forever)
        self.replica_resync_lag = None      # a replica's lag while a view that lagged is not yet replaced
        if self.replica:
            self.db = ReplicaDatabase(settings.read_replica_of)
            check_replica_schema(self.db)
        else:
            self.db = Database(settings.db, replicated=bool(settings.replica_url))
            self.db.migrate()
        if settings.admin_key and not self.replica:     # a replica knows the keys the primary stored
            ensure_admin_key(self.db, settings.admin_key)
        self.limiter = RateLimiter(settings.rate_limit_scale)
        self.hub = StreamHub(settings.base_url, self.db)
        self.faces = faces
        self.webhooks = faces.webhook_session(settings.allow_private_webhooks, settings.dns_server)
        self.openapi = faces.openapi_document(settings.base_url, settings.x402_price)
        self.background = False     # True under the server: network work then runs in its own greenlet
        self.fan_out_wanted = None  # under the server: the gevent Event that wakes the fan-out greenlet
        self.running_keys = RunningKeys()   # Idempotency-Keys whose first request is running here
        self.last_sweep = None      # (unix time it ended, seconds it took) of the last automatic sweep
        self.read_cache = None      # the answers of repeated reads (read_cache.py), made with the app when wanted
        self.metrics = metrics.Metrics(functools.partial(metrics_state, self))
        self.relay_secret = secrets.token_hex(32)   # signs the caller's address on the MCP child's API calls
        self.on_close = []      # what the faces started for this app, stopped with it (the MCP child)
        try:
            if settings.rpc_url:
                settings.onchain = OnChain(settings)
                if not self.replica:        # start learns the nonce and stores it: the primary's to do
                    settings.onchain.start(self.db)
            self.x402 = faces.x402(settings) if settings.x402_price else None     # pay per call: needs the chain
            self.stripe = settings.stripe = open_stripe_rail(settings)          # None: the stripe rail is simulated
        except BaseException:
            self.db.close()
            raise

    def broadcast_payouts(self):
        """Send the payouts just committed (under the server without holding up the answer)."""
        if self.background:
            import gevent
            gevent.spawn(self.settings.onchain.broadcast, self.db)
        else:
            self.settings.onchain.broadcast(self.db)

    def send_stripe_payouts(self, after_seq):
        """Ask Stripe for the transfers and refunds recorded after `after_seq` (under the server without holding
        up the answer; in-process at once, where a failure is logged: the answer's change is committed already)."""
        if self.background:
            import gevent
            gevent.spawn(send_stripe_payments, self.db, self.settings, after_seq)
            return
        try:
            send_stripe_payments(self.db, self.settings, after_seq)
        except Exception:
            log.exception('sending the payments through Stripe failed; the sweep sends them')

    def fan_out(self):
        """Expand the outbox events just committed into deliveries: under the server by waking its fan-out
        greenlet (the answer does not wait), in-process at once."""
        if self.fan_out_wanted is not None:
            self.fan_out_wanted.set()
        else:
            fan_out_events(self.db)

    def close(self):
        for stop in self.on_close:
            stop()
        self.db.close()


# Every answer carries X-Request-Id, and --log-format json writes it in the request's line: the client's own id
# when it is sane, else a new one. '_' is not among the characters, so an API key (mk_...) is never taken as one.
REQUEST_ID = re.compile(r'[A-Za-z0-9.:-]{1,128}')
REQUEST_ID_KEY = 'marketplace.request_id'       # where a request's id is kept in its WSGI environ
ANSWER_UNTIL = 'marketplace.answer_until'       # ... and the moment its answer stops holding (answer_holds_until)


def answer_holds_until(moment):
    """Say that this request's answer changes with the clock at `moment` (an ISO time) though nothing is written
    (the feed drops a job at its deadline): the read cache gives it no later than that."""
    request.environ[ANSWER_UNTIL] = min(request.environ.get(ANSWER_UNTIL, moment), moment)
NO_ROUTE = metrics.UNMATCHED    # the route template of a request that matched none: 404, 405, refused before the app


REQUEST_ID_PREFIX = secrets.token_hex(8)   # this process's, before a counter: new ids without a syscall each
REQUEST_COUNTER = itertools.count(1)


def sane_request_id(sent):
    """The client's X-Request-Id if sane (1-128 of A-Z a-z 0-9 . : -), else a new one (32 hex digits: this
    process's random prefix and its count of requests)."""
    return sent if sent and REQUEST_ID.fullmatch(sent) else f'{REQUEST_ID_PREFIX}{next(REQUEST_COUNTER):016x}'


def request_id(environ):
    """The id of the request of this WSGI environ, chosen once (sane_request_id) and kept in it."""
    if REQUEST_ID_KEY not in environ:
        environ[REQUEST_ID_KEY] = sane_request_id(environ.get('HTTP_X_REQUEST_ID'))
    return environ[REQUEST_ID_KEY]


def route_template(environ=None):
    """The route template the request matched ('/api/jobs/<job_id>'), never its raw path: a bounded label for logs
    and metrics; NO_ROUTE when it matched none. `environ`: the request's WSGI environ (default: this request's)."""
    route = (request.environ if environ is None else environ).get('bottle.route')
    return route.rule if route is not None else NO_ROUTE


# Every answer is read as the type it declares; pages run only this origin's scripts and styles, post forms only
# here, and are framed by nobody.
PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
            "base-uri 'none'; form-action 'self'")


def common_headers(headers, answer_id):
    """An answer's headers with X-Content-Type-Options: nosniff, for a page its Content-Security-Policy, and its
    X-Request-Id (in one pass: every answer pays it)."""
    kept, page = [], False
    for name, value in headers:
        lower = name.lower()
        if lower == 'x-content-type-options' or lower == 'x-request-id':
            continue
        if lower == 'content-type' and value.startswith('text/html'):
            page = True
        kept.append((name, value))
    kept.append(('X-Content-Type-Options', 'nosniff'))
    if page:
        kept.append(('Content-Security-Policy', PAGE_CSP))
    kept.append(('X-Request-Id', answer_id))
    return kept


READ_METHODS = ('GET', 'HEAD')


def priced_call(app):
    """Is this request a call priced for x402 (whose payment is money, taken by a write)?"""
    if app.service.x402 is None:
        return False
    try:
        route, _ = app.router.match(request.environ)
    except bottle.HTTPError:
        return False
    return ('GET', route.rule) in app.service.x402.prices


# What a lagging replica still answers itself: its health (503, saying so), its metrics and the static files.
LAG_EXEMPT = ('/api/health', '/metrics')


def send_writes_to_primary(app):
    """On a read replica, before any route: a write (every method but GET and HEAD, and a call priced for x402)
    is sent to the same path and query on --primary-url with 307 (the client keeps the method and the body), or
    refused with 503 read_only without it. A replica never answers a write itself. While it lags more than
    --max-replica-lag, a read goes the same way (503 replica_lagging without --primary-url): never stale data."""
    error = None
    if request.method in READ_METHODS and not priced_call(app):
        if request.path in LAG_EXEMPT or request.path.startswith('/static/'):
            return
        lag = replica_lagging(app.service, replica_lag(app.service.db))
        if lag is None:
            return
        error = ReplicaLagging(lag, app.service.settings.max_replica_lag)
    primary = app.service.settings.primary_url
    if not primary:
        error = error or ReadOnlyReplica()
        raise bottle.HTTPResponse(json_bytes(error.body()), error.status,
                                  dict(error.headers, **{'Content-Type': JSON_TYPE}))
    # The request path always starts with '/' here: a request line's target need not (`POST .evil.example/x`,
    # `POST @evil.example/x`), and glued to the primary's URL it would name another host (CONTRACT.md 20).
    path = quote(request.environ['PATH_INFO'].encode('latin-1'), safe="/:@!$&'()*+,;=-._~")
    path = path if path.startswith('/') else '/' + path
    location = primary.rstrip('/') + path + ('?' + request.query_string if request.query_string else '')
    raise bottle.HTTPResponse(json_bytes({'primary': location}), 307,
                              {'Location': location, 'Content-Type': JSON_TYPE})


def make_app(settings, faces):
    """The WSGI app for these settings and faces (wiring.py): routes, JSON errors and rate limits."""
    app = bottle.Bottle(catchall=True)
    app.service = Service(settings, faces)
    if app.service.replica:
        app.add_hook('before_request', functools.partial(send_writes_to_primary, app))
    static_methods = {}
    for method, path, _, _ in ROUTES:
        if '<' not in path:
            static_methods.setdefault(path, set()).add(method)

    def check_request(bucket):
        """What every API request passes before its handler: sizes, the method, the rate limit."""
        if request.content_length > MAX_BODY and request.route.rule != '/mcp':    # /mcp answers it in JSON-RPC
            raise BodyTooLarge()
        if request.query_string.count('&') >= MAX_QUERY_PARAMS:
            raise BadRequest(f'A request takes at most {MAX_QUERY_PARAMS} query parameters.',
                             code='invalid_parameter')
        # A static path of another method wins over a dynamic one: GET /api/jobs/expire is a 405.
        allowed = static_methods.get(request.path)
        if allowed and request.route.rule != request.path:
            raise MethodNotAllowed(allowed)
        count_request(bucket)

    def run(handler, params, hold=None):
        """The handler's answer as bytes (an APIError's JSON included) and whether it succeeded. `hold` is called
        just before the handler runs: for a paid call, inside the transaction that consumes the payment."""
        def held_handler(**params):
            hold()
            return handler(**params)
        try:
            method = 'GET' if request.method == 'HEAD' else request.method      # Bottle serves HEAD with GET
            price = app.service.x402 and app.service.x402.prices.get((method, request.route.rule))
            if price and not x402_exempt(caller()):     # priced for x402: every caller pays but the exempt
                if caller() is None and request.get_header('Authorization'):
                    raise Unauthorized('The API key is unknown or revoked (or pay with x402, without a key).')
                result = app.service.x402.answer(price, held_handler if hold else handler, params, caller())
            else:
                if hold:
                    hold()
                result = handler(**params)
        except APIError as error:
            return send_error(error), False
        except VerificationError as error:
            return send_error(payment_error(error)), False
        except apsw.BusyError:
            log.warning('database busy: %s %s', request.method, request.path)
            return send_error(Unavailable('The database is busy; retry in a moment.',
                                          headers={'Retry-After': '1'})), False
        if isinstance(result, dict):
            response.content_type = JSON_TYPE
            return json_bytes(result), True
        return result, True

    def after_write(before):
        """The work a write's committed change starts: webhook fan-out, payouts on chain and through Stripe."""
        app.service.fan_out()
        if settings.onchain:
            app.service.broadcast_payouts()
        if before is not None:
            app.service.send_stripe_payouts(before)

    def replay(stored, fingerprint, secret):
        """A stored answer given back byte for byte (Idempotent-Replayed), or 422 for another request."""
        for name in REPLAYED_HEADERS:       # those a handler whose change was undone may have set
            response.headers.pop(name, None)
        if not hmac.compare_digest(stored['fingerprint'], fingerprint):
            raise IdempotencyKeyReused()
        headers, body = open_answer(secret, stored['sealed'])
        response.status = stored['status']
        for name, value in headers:
            response.set_header(name, value)
        response.set_header('Idempotent-Replayed', 'true')
        return body

    def refused_for_no_key():
        """Will this write be 401 for want of a (valid) API key, with no payment to stand in for one? Then its
        Idempotency-Key is not looked at: the handler refuses before the body is read, as without a key, and a
        stranger's megabyte is neither read nor hashed (a 401 changes nothing a retry could repeat)."""
        rule = (request.method, request.route.rule)
        return (faces.operations[rule].get('auth') == 'key' and caller() is None
                and not (app.service.x402 and rule in app.service.x402.prices))

    def keyed(handler, params, key, before):
        """A request with an Idempotency-Key: a replay, or the handler run once with its answer stored in the
        transaction of its change (Database.hold), committed before the work that change starts."""
        db = app.service.db
        scope = idempotency_scope(caller(), client_ip())
        key_hash, secret = idempotency_key_hash(scope, key), answer_sealing_key(scope, key)
        fingerprint = request_fingerprint(request.method, request.path + (
            '?' + request.query_string if request.query_string else ''), read_raw_body())
        stored = stored_answer(db, key_hash)
        if stored is not None:
            return replay(stored, fingerprint, secret)
        with app.service.running_keys.running_once(key_hash):
            stored = stored_answer(db, key_hash)        # finished between the two looks, in another thread
            if stored is not None:
                return replay(stored, fingerprint, secret)
            paid = bool(app.service.x402) and (request.method, request.route.rule) in app.service.x402.prices
            if not paid:
                db.hold()
            try:
                body, succeeded = run(handler, params, hold=db.hold if paid else None)
            except BaseException:
                db.end_hold()       # what the handler changed commits, as without a key; nothing is stored
                raise
            status = response.status_code
            if status >= 500 or status in UNSTORED_STATUSES:
                db.end_hold()
            else:
                headers = [[name, response.headers[name]] for name in REPLAYED_HEADERS if name in response.headers]
                sealed = seal_answer(secret, headers, body)
                try:
                    db.end_hold(lambda db: store_answer(db, key_hash, fingerprint, status, sealed))
                except apsw.ConstraintError:    # another process answered this key first: this change is undone
                    return replay(stored_answer(db, key_hash), fingerprint, secret)
                except APIError:        # its COMMIT failed: nothing holds, an x402 payment is not spent
                    for name in ('X-PAYMENT-RESPONSE', 'PAYMENT-RESPONSE'):
                        response.headers.pop(name, None)
                    raise
        if succeeded:
            after_write(before)
        return body

    cache = ReadCache(settings.read_cache_mb * 2 ** 20) if settings.read_cache_mb else None
    app.service.read_cache = cache

    def cached_read(handler, params):
        """A GET of CACHED_READS: the answer kept for this generation, request and caller while it holds, or the
        handler's, kept when it is a 200 (until the moment it gave with answer_holds_until, if it did); its ETag (the
        generation and a digest of the rest), and 304 without a body when If-None-Match names it."""
        generation = app.service.db.value('SELECT n FROM generation')      # before the answer is computed
        who = caller()
        key = (generation, request.path, request.query_string, who and who['id'], who and who['role'])
        kept = cache.get(key, now_iso())
        if kept is not None:
            response.content_type, body, etag = kept
        else:
            body, succeeded = run(handler, params)
            if not (succeeded and response.status_code == 200 and isinstance(body, bytes)):
                return body                 # only a 200 is kept and tagged
            until = request.environ.get(ANSWER_UNTIL)
            etag = f'"{generation}-' + hashlib.sha256(repr((key[1:], until)).encode()).hexdigest()[:20] + '"'
            cache.put(key, response.content_type, body, etag, until)
        response.set_header('ETag', etag)
        if etag_matches(request.headers.get('If-None-Match', ''), etag):
            response.status = 304
            return b''
        return body

    def api(handler, bucket):
        def wrapper(**params):
            before = None
            try:
                check_request(bucket)
                # in stripe mode, the payments this request records are sent after it (send_stripe_payouts)
                if app.service.stripe is not None and request.method not in ('GET', 'HEAD'):
                    before = app.service.db.value('SELECT coalesce(max(seq), 0) FROM payments')
                key = request.environ.get('HTTP_IDEMPOTENCY_KEY')    # as sent (bottle's get_header decodes UTF-8)
                if key is not None and request.method in ('POST', 'PATCH') and \
                        (request.method, request.route.rule) not in UNKEYED_ROUTES and not refused_for_no_key():
                    return keyed(handler, params, read_idempotency_key(key), before)
            except APIError as error:
                return send_error(error)
            except apsw.BusyError:
                log.warning('database busy: %s %s', request.method, request.path)
                return send_error(Unavailable('The database is busy; retry in a moment.',
                                              headers={'Retry-After': '1'}))
            if cache is not None and request.method in ('GET', 'HEAD') and request.route.rule in CACHED_READS and not (
                    app.service.x402 and ('GET', request.route.rule) in app.service.x402.prices):
                return cached_read(handler, params)
            body, succeeded = run(handler, params)
            if succeeded and request.method not in ('GET', 'HEAD'):
                after_write(before)
            return body
        return wrapper

    for method, path, handler, bucket in ROUTES:
        app.route(path, method, api(handler, bucket), name=handler.__name__)
    faces.mount_pages(app)      # pages of the signed-in browser: not API

    def error_page(error):
        if error.status_code >= 500:
            log.error('%s %s failed: %s\n%s', request.method, request.path, error.exception, error.traceback)
            message = 'The server failed to answer; the failure is logged.'
        elif error.status_code == 404:
            message = 'There is no such endpoint.'
        elif error.status_code == 405:
            allow = allow_header(error.headers.get('Allow', '').split(','))
            response.set_header('Allow', allow)
            message = f'This path accepts only {allow}.'
        else:
            message = str(error.body or 'The request failed.')
        response.content_type = JSON_TYPE
        return json_bytes({'error': message, 'code': STATUS_CODES.get(error.status_code, 'error'),
                           'status': error.status_code})

    app.default_error_handler = error_page
    bottle_wsgi = app.wsgi

    def wsgi_with_common_headers(environ, start_response):
        started = time.perf_counter()
        answer_id = request_id(environ)

        def start(status, headers, exc_info=None):
            app.service.metrics.count_request(environ['REQUEST_METHOD'], route_template(environ), status[:3], started)
            return start_response(status, common_headers(headers, answer_id), exc_info)
        return bottle_wsgi(environ, start)

    # Every answer, API, pages, errors, static files, the feed, /metrics itself, passes here: its security headers
    # and X-Request-Id, and it is counted for /metrics by route template (its headers' time: a stream's first event).
    app.wsgi = wsgi_with_common_headers
    return app


def call_app(app, method, path, body=None, key=None, headers=None):
    """Run one request through the WSGI app in-process; return (status, headers, decoded body)."""
    raw = body if isinstance(body, bytes) else (b'' if body is None else json.dumps(body).encode('utf-8'))
    path, _, query = path.partition('?')
    environ = {
        'REQUEST_METHOD': method, 'PATH_INFO': path, 'QUERY_STRING': query, 'SERVER_NAME': '127.0.0.1',
        'SERVER_PORT': '8080', 'SERVER_PROTOCOL': 'HTTP/1.1', 'REMOTE_ADDR': '127.0.0.1',
        'wsgi.url_scheme': 'http', 'wsgi.input': io.BytesIO(raw), 'wsgi.errors': sys.stderr,
        'wsgi.version': (1, 0), 'wsgi.multithread': False, 'wsgi.multiprocess': False,
        'wsgi.run_once': False, 'CONTENT_LENGTH': str(len(raw)), 'CONTENT_TYPE': 'application/json',
    }
    if key:
        environ['HTTP_AUTHORIZATION'] = f'Bearer {key}'
    for name, value in (headers or {}).items():
        if name.lower() == 'content-type':
            environ['CONTENT_TYPE'] = value
        else:
            environ['HTTP_' + name.upper().replace('-', '_')] = value
    outcome = {}

    def start_response(status, response_headers, exc_info=None):
        outcome['status'] = int(status.split()[0])
        outcome['headers'] = dict(response_headers)

    data = b''.join(app(environ, start_response))
    content_type = outcome['headers'].get('Content-Type', '')
    decoded = json.loads(data) if content_type.startswith('application/json') and data else data
    return outcome['status'], outcome['headers'], decoded


if __name__ == '__main__':
    # The program's top is wiring.py, which hands the rules their faces: run as a script, this file imports it, and
    # it imports this file again as the module `marketplace` (what the faces and the tests use). This file as a
    # module never imports a face (tests/test_layout.py).
    import wiring
    sys.exit(wiring.main())
