"""Webhook delivery: sending the outbox's events to the agents' receivers.

It owns the HTTP client (addresses checked against server-side request forgery and pinned for the connection,
answers read within bounds), the signature headers, the chat formats (Slack, Discord, Telegram), retries with
backoff and Retry-After, the pause of a receiver that keeps failing, fairness between receivers (a slow one never
holds up the rest), and the routes that test a receiver and show the formats. The rules queue events in the same
transaction as the change they report (marketplace.queue_event); WebhookWorker delivers them under the server.
"""

import base64
import email.utils
import hashlib
import hmac
import html
import json
import re
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import timedelta, timezone
from urllib.parse import urlsplit

import gevent.queue
import urllib3

from host_guard import pinned_address, webhook_url_problem
from marketplace import (BadRequest, Form, __version__, iso, log, new_id, now, now_iso, owned_agent, read_json_body,
                         require_account, resume_webhook, route, service)


WEBHOOK_ATTEMPTS = 8            # waits of base × 1, 3, 9, … 729: about 18 hours with the default 60 s
WEBHOOK_RETRY_FACTOR = 3
MAX_RETRY_AFTER = 24 * 3600
EVENT_HEADLINES = {
    'job.new': 'New job', 'job.claimed': 'Job claimed', 'job.delivered': 'Work delivered',
    'job.completed': 'Job completed', 'job.expired': 'Job expired', 'payment.released': 'Payment released',
    'payment.disputed': 'Payment disputed', 'webhook.test': 'Webhook test',
}


WEBHOOK_UNREACHABLE = 'no HTTP answer (could not connect, or no answer in time)'
WEBHOOK_PAUSE_AFTER = 10        # failed attempts in a row that pause a receiver


def pinned(connection_class):
    """An urllib3 connection class that connects to the `address` it is given, never resolving its host again;
    the host name still goes into the Host header, the TLS SNI and the certificate check."""
    class Pinned(connection_class):
        address = None          # (family, sockaddr) from pinned_address

        def _new_conn(self):
            family, sockaddr = self.address
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.settimeout(self.timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.connect(sockaddr)
            except BaseException:
                sock.close()
                raise
            return sock
    return Pinned


PinnedHTTP = pinned(urllib3.connection.HTTPConnection)
PinnedHTTPS = pinned(urllib3.connection.HTTPSConnection)


@dataclass
class WebhookAnswer:
    """What a webhook attempt keeps of the receiver's answer."""
    status_code: int
    headers: object

    def close(self):
        pass


class WebhookClient:
    """POSTs webhooks: resolves each URL's host once, checks every address (unless private ones are allowed),
    connects to the address checked (so DNS rebinding between the check and the connection cannot help), never
    follows redirects and never reads a proxy from the environment."""

    def __init__(self, allow_private, dns_server=''):
        self.allow_private = allow_private
        self.dns_server = dns_server        # where host names are looked up (lookup_host)

    def post(self, url, data, headers, timeout, **_):
        """One POST (called as requests' Session.post is, which tests may stand in for): the answer's status_code
        and headers, its body never read; any failure without an HTTP answer raises."""
        parts = urlsplit(url)
        address = pinned_address(url, self.allow_private, self.dns_server)
        if parts.scheme == 'https':
            import certifi
            connection = PinnedHTTPS(parts.hostname, parts.port or 443, timeout=timeout,
                                     cert_reqs='CERT_REQUIRED', ca_certs=certifi.where())
        else:
            connection = PinnedHTTP(parts.hostname, parts.port or 80, timeout=timeout)
        connection.address = address
        try:
            connection.request('POST', (parts.path or '/') + (f'?{parts.query}' if parts.query else ''),
                               body=data, headers=headers, preload_content=False)
            answer = connection.getresponse()
            return WebhookAnswer(answer.status, answer.headers)
        finally:
            connection.close()


def webhook_session(allow_private, dns_server=''):
    """The client that sends every webhook of a service (see WebhookClient)."""
    return WebhookClient(allow_private, dns_server)


def signature_headers(secret, delivery_id, event, body, moment):
    """X-Service-* headers and the Standard Webhooks headers for one attempt.

    X-Service-Signature is the hex HMAC-SHA256 of the raw body keyed with the whole `whsec_...` string;
    webhook-signature is `v1,` + base64 HMAC-SHA256 of "{id}.{timestamp}.{body}" keyed with the decoded secret.
    """
    timestamp = str(int(moment.timestamp()))
    signed = f'{delivery_id}.{timestamp}.'.encode('utf-8') + body
    standard = hmac.new(base64.b64decode(secret.removeprefix('whsec_')), signed, hashlib.sha256).digest()
    return {
        'Content-Type': 'application/json',
        'User-Agent': f'marketplace-webhooks/{__version__}',
        'X-Service-Event': event,
        'X-Service-Delivery': delivery_id,
        'X-Service-Timestamp': timestamp,
        'X-Service-Signature': hmac.new(secret.encode('utf-8'), body, hashlib.sha256).hexdigest(),
        'webhook-id': delivery_id,
        'webhook-timestamp': timestamp,
        'webhook-signature': 'v1,' + base64.b64encode(standard).decode('ascii'),
    }


DISCORD_MARKUP = re.compile(r'([\\*_~`|><\[\]()#-])')


def discord_text(text):
    """Text from users shown as itself in Discord: its markdown escaped (no masked link, no heading), and a zero-width
    space after every @ (no mention; allowed_mentions also pings nobody)."""
    return DISCORD_MARKUP.sub(r'\\\1', text).replace('@', '@\u200b')


def chat_message(body, webhook_format):
    """The event as the chat tool's own message body (Slack, Discord, Telegram), or the JSON body as is."""
    if webhook_format == 'json':
        return body
    data = body['data']
    headline = EVENT_HEADLINES.get(body['type'], body['type'])
    if body['type'] == 'webhook.test':
        terms, title, url = 'the marketplace can reach this channel', 'Webhook test', None
    else:
        terms = f'{data["amount"]} {data["currency"]} · {data["category"]} · {data["status"]}'
        title, url = data['title'], data['jobUrl']
    if webhook_format == 'slack':
        def escape(text):
            return text.replace('&', '&amp;').replace('<', '&lt;').replace('>', '&gt;')
        link = f'<{url}|{escape(title)}>' if url else escape(title)
        return {'text': f'{headline}: {escape(title)} ({escape(terms)})' + (f' {url}' if url else ''),
                'blocks': [{'type': 'section', 'text': {'type': 'mrkdwn', 'text': f'*{headline}*: {link}\n{escape(terms)}'}}]}
    if webhook_format == 'discord':
        if body['type'] != 'webhook.test':
            title = discord_text(title)
            terms = f'{data["amount"]} {data["currency"]} · {discord_text(data["category"])} · {data["status"]}'
        embed = {'title': title[:256], 'description': f'{headline} · {terms}'[:4096]}
        if url:
            embed['url'] = url
        return {'content': f'{headline}: {title}'[:2000], 'embeds': [embed], 'allowed_mentions': {'parse': []}}
    link = f'<a href="{html.escape(url)}">{html.escape(title)}</a>' if url else html.escape(title)
    return {'text': f'<b>{html.escape(headline)}</b>: {link}\n{html.escape(terms)}', 'parse_mode': 'HTML',
            'disable_web_page_preview': True}


def retry_after_seconds(header):
    """Seconds from a Retry-After header (a number or an HTTP date), or None."""
    if not header:
        return None
    try:
        return max(0, min(MAX_RETRY_AFTER, int(header.strip())))
    except ValueError:
        pass
    try:
        moment = email.utils.parsedate_to_datetime(header)
    except (TypeError, ValueError, OverflowError):
        return None
    if moment.tzinfo is None:       # '-0000': UTC, the RFC says
        moment = moment.replace(tzinfo=timezone.utc)
    return max(0, min(MAX_RETRY_AFTER, int((moment - now()).total_seconds())))


def send_webhook(session, settings, agent, delivery_id, event, body):
    """POST one event to an agent's webhook; return {statusCode, error, retryAfter, responseTime (ms)}.

    Every failure without an HTTP answer (a blocked address, a refused or failed connection, TLS, a time-out)
    reports the same error, so that the owner of a webhook cannot probe the network behind the service; the
    log keeps the reason. Network I/O: never call it inside a transaction.
    """
    raw = json.dumps(chat_message(body, agent['webhook_format']), separators=(',', ':')).encode('utf-8')
    headers = signature_headers(agent['webhook_secret'], delivery_id, event, raw, now())
    started = time.monotonic()
    outcome = {'statusCode': None, 'error': None, 'retryAfter': None}
    problem = webhook_url_problem(agent['webhook_url'], allow_private=True)     # the scheme; addresses: below
    if problem:
        outcome['error'] = f'webhookUrl {problem}'
    else:
        try:
            with gevent.Timeout(settings.webhook_timeout, TimeoutError):
                answer = session.post(agent['webhook_url'], data=raw, headers=headers, allow_redirects=False,
                                      timeout=settings.webhook_timeout, stream=True)
                answer.close()           # the receiver's body is not needed
            status = answer.status_code
            outcome['statusCode'] = status
            outcome['retryAfter'] = retry_after_seconds(answer.headers.get('Retry-After'))
            if not 200 <= status < 300:
                outcome['error'] = f'the receiver answered {status}'
        except Exception as exc:        # OSError, TLS, urllib3 and http.client errors, the time-out
            log.info('webhook %s to agent %s: %s: %s', delivery_id, agent.get('id'), type(exc).__name__,
                     str(exc)[:200])
            outcome['error'] = WEBHOOK_UNREACHABLE
    outcome['responseTime'] = round((time.monotonic() - started) * 1000, 1)
    return outcome


def count_webhook_attempt(db, agent_id, succeeded):
    """Record an attempt's outcome on its agent (inside a transaction): a success resets the failures in a row;
    the 10th failure in a row pauses the receiver and holds its pending deliveries (next_attempt_at null)."""
    if succeeded:
        db.execute('UPDATE agents SET webhook_failures = 0 WHERE id = :id', {'id': agent_id})
        return
    db.execute('UPDATE agents SET webhook_failures = webhook_failures + 1 WHERE id = :id', {'id': agent_id})
    if db.value('''SELECT webhook_failures >= :limit AND webhook_paused_at IS NULL FROM agents WHERE id = :id''',
                {'limit': WEBHOOK_PAUSE_AFTER, 'id': agent_id}):
        moment = now_iso()
        db.execute('UPDATE agents SET webhook_paused_at = :now, updated_at = :now WHERE id = :id',
                   {'now': moment, 'id': agent_id})
        db.execute('''UPDATE webhook_deliveries SET next_attempt_at = NULL, updated_at = :now
                      WHERE agent_id = :id AND status = 'pending' ''', {'now': moment, 'id': agent_id})
        log.info('webhook of agent %s paused after %s failures in a row', agent_id, WEBHOOK_PAUSE_AFTER)


def deliver_webhook(db, settings, session, delivery_id):
    """One attempt at a pending delivery, then its new state in one transaction: delivered, failed (410, the
    last attempt, or a webhook gone), or pending again after a backoff with jitter (or Retry-After). A paused
    receiver's delivery is not attempted: it waits (next_attempt_at null) for the receiver to be resumed."""
    row = db.row("SELECT * FROM webhook_deliveries WHERE id = :id AND status = 'pending'", {'id': delivery_id})
    if row is None:
        return None
    agent = db.row('SELECT * FROM agents WHERE id = :id', {'id': row['agent_id']})
    if agent['webhook_paused_at'] and agent['webhook_url'] and not agent['webhook_disabled_at']:
        with db.transaction():
            db.execute('''UPDATE webhook_deliveries SET next_attempt_at = NULL WHERE id = :id
                          AND status = 'pending' ''', {'id': delivery_id})
        return 'pending'
    if agent['webhook_url'] is None or agent['webhook_disabled_at']:
        outcome = {'statusCode': None, 'error': 'the agent has no live webhook'}
    else:
        outcome = send_webhook(session, settings, agent, delivery_id, row['event'], json.loads(row['payload']))
    with db.transaction():
        if db.value('SELECT status FROM webhook_deliveries WHERE id = :id', {'id': delivery_id}) != 'pending':
            return None                  # settled meanwhile
        attempts, code = row['attempts'] + 1, outcome['statusCode']
        changes = {'attempts': attempts, 'last_status_code': code, 'last_error': outcome['error'],
                   'next_attempt_at': None, 'delivered_at': None, 'status': 'failed'}
        if code is not None and 200 <= code < 300:
            changes.update(status='delivered', delivered_at=now_iso())
        elif code == 410:
            changes['last_error'] = 'the receiver answered 410 Gone: the webhook is disabled'
            db.execute('UPDATE agents SET webhook_disabled_at = :now, updated_at = :now WHERE id = :id',
                       {'now': now_iso(), 'id': agent['id']})
        elif outcome['error'] != 'the agent has no live webhook' and attempts < WEBHOOK_ATTEMPTS:
            wait = settings.webhook_retry_base * WEBHOOK_RETRY_FACTOR ** (attempts - 1)
            wait *= secrets.SystemRandom().uniform(0.8, 1.2)       # jitter: receivers coming back are not stampeded
            if (code == 429 or (code or 0) >= 500) and outcome.get('retryAfter') is not None:
                wait = max(wait, outcome['retryAfter'])
            changes.update(status='pending', next_attempt_at=iso(now() + timedelta(seconds=wait)))
        db.execute('''UPDATE webhook_deliveries SET status = :status, attempts = :attempts,
                      last_status_code = :last_status_code, last_error = :last_error,
                      next_attempt_at = :next_attempt_at, delivered_at = :delivered_at, updated_at = :now
                      WHERE id = :id''', dict(changes, now=now_iso(), id=delivery_id))
        if outcome['error'] != 'the agent has no live webhook':
            count_webhook_attempt(db, agent['id'], changes['status'] == 'delivered')
    return changes['status']


class WebhookWorker:
    """Delivers the outbox fairly: every quarter second it starts due deliveries in their own greenlets, taking
    agents round-robin (each one's oldest due first, one per agent before any agent gets a second), at most
    `per_agent` in flight per agent and `per_account` per account, receivers that have been failing at most half
    the pool, and a second delivery in flight to one receiver never the last quarter: a slow or dead receiver
    delays only itself."""

    def __init__(self, service, concurrency=None, per_agent=4, per_account=8):
        import gevent.pool
        self.service = service
        self.size = concurrency or service.settings.webhook_concurrency
        self.pool = gevent.pool.Pool(self.size)
        self.per_agent, self.per_account = per_agent, per_account
        self.reserve = self.size // 4      # slots only a receiver with nothing in flight may take
        self.busy = set()
        self.agents = {}        # agent id -> deliveries in flight
        self.accounts = {}      # account id -> deliveries in flight
        self.failing = 0        # deliveries in flight to receivers whose last attempt failed
        self.cursor = ''        # the round-robin: the last agent served

    def run(self):
        import gevent
        while True:
            try:
                self.start_due()
            except Exception:
                log.exception('webhook dispatch failed; trying again')
            gevent.sleep(0.25)

    def due_agents(self, moment, limit):
        """Up to `limit` agents with due deliveries, in id order from the one after the cursor, wrapping round."""
        query = '''SELECT DISTINCT agent_id FROM webhook_deliveries INDEXED BY webhook_deliveries_pending
                   WHERE status = 'pending' AND next_attempt_at <= :now AND agent_id > :after
                   ORDER BY agent_id LIMIT :limit'''     # in agent order, stopping at the limit: no sort of them all
        found = [row['agent_id'] for row in self.service.db.rows(
            query, {'now': moment, 'after': self.cursor, 'limit': limit})]
        if len(found) < limit and self.cursor:
            found += [row['agent_id'] for row in self.service.db.rows(
                query, {'now': moment, 'after': '', 'limit': limit - len(found)}) if row['agent_id'] not in found]
        return found

    def due_of(self, agent_id, moment, count):
        """An agent's oldest due deliveries not in flight (none while it is paused), with its account."""
        rows = self.service.db.rows('''SELECT d.id, a.account_id, a.webhook_failures FROM webhook_deliveries d
                                       JOIN agents a ON a.id = d.agent_id
                                       WHERE d.agent_id = :agent AND d.status = 'pending' AND d.next_attempt_at <= :now
                                       AND a.webhook_paused_at IS NULL
                                       ORDER BY d.next_attempt_at, d.rowid LIMIT :limit''',
                                    {'agent': agent_id, 'now': moment, 'limit': count + self.per_agent})
        return [row for row in rows if row['id'] not in self.busy][:count]

    def start_due(self):
        moment = now_iso()
        free = self.pool.free_count()
        if not free:
            return
        agents = [agent for agent in self.due_agents(moment, free + len(self.agents))
                  if self.agents.get(agent, 0) < self.per_agent]
        # Those with nothing in flight first, and the last quarter of the pool is theirs alone: a receiver whose
        # first attempt hangs is not known to fail yet, and its later deliveries (a job posted meanwhile) must not
        # fill the pool ahead of a live receiver's (written a moment later by the fan-out)
        agents.sort(key=lambda agent: self.agents.get(agent, 0))
        for rounds in (1, self.per_agent):          # one each first, then up to the per-agent cap
            for agent in agents:
                room = min(rounds, self.per_agent) - self.agents.get(agent, 0)
                if room <= 0:
                    continue
                for row in self.due_of(agent, moment, room):
                    free = self.pool.free_count()
                    if not free:
                        return
                    if self.agents.get(agent) and free <= self.reserve:
                        break
                    failing = row['webhook_failures'] > 0
                    if (self.accounts.get(row['account_id'], 0) >= self.per_account
                            or (failing and self.failing >= self.size // 2)):
                        break
                    self.start(row['id'], agent, row['account_id'], failing)
                    if rounds == 1:
                        self.cursor = agent

    def start(self, delivery_id, agent_id, account_id, failing):
        self.busy.add(delivery_id)
        self.agents[agent_id] = self.agents.get(agent_id, 0) + 1
        self.accounts[account_id] = self.accounts.get(account_id, 0) + 1
        self.failing += failing
        self.pool.spawn(self.attempt, delivery_id, agent_id, account_id, failing)

    def attempt(self, delivery_id, agent_id, account_id, failing):
        try:
            status = deliver_webhook(self.service.db, self.service.settings, self.service.webhooks, delivery_id)
            log.debug('webhook %s: %s', delivery_id, status)
        except Exception:
            log.exception('webhook %s failed', delivery_id)
        finally:
            self.busy.discard(delivery_id)
            self.failing -= failing
            for counts, key in ((self.agents, agent_id), (self.accounts, account_id)):
                counts[key] -= 1
                if not counts[key]:
                    del counts[key]

    def stop(self):
        self.pool.kill(block=False)     # attempts cut short stay pending: sent again after a restart


@route('POST', '/api/webhooks/test', limit='webhook_test')
def post_webhook_test():
    account = require_account()
    form = Form(read_json_body())
    agent_id = form.uuid('agentId', required=True)
    form.done()
    agent = owned_agent(agent_id, account, admin_too=False)
    if agent['webhook_url'] is None:
        raise BadRequest('The agent has no webhookUrl to test; set one with PATCH /api/agents/:id.',
                         code='no_webhook')
    svc = service()
    body = {'type': 'webhook.test', 'timestamp': now_iso(),
            'data': {'agentId': agent['id'], 'message': 'A test event from the marketplace.'}}
    outcome = send_webhook(svc.webhooks, svc.settings, agent, new_id(), 'webhook.test', body)
    if outcome['error'] is None and (agent['webhook_paused_at'] or agent['webhook_failures']):
        with svc.db.transaction():
            resume_webhook(svc.db, agent['id'])     # a receiver that answers again is resumed
    answer = {'success': outcome['error'] is None, 'statusCode': outcome['statusCode'] or 0,
              'responseTime': outcome['responseTime'], 'webhookUrl': agent['webhook_url'], 'signed': True}
    if outcome['error']:
        answer['error'] = outcome['error']
    return answer


SAMPLE_EVENT = {'type': 'job.new', 'timestamp': '2026-11-21T16:40:00.000Z', 'data': {
    'jobId': '6e1c1e73-c263-4038-be66-93257721f391', 'title': 'Fix the flaky test', 'category': 'code',
    'amount': '25.00', 'currency': 'USDC', 'agentId': '0b5d8d8e-3f7e-4c36-9d64-2f6f3c1c9a10', 'status': 'open',
    'txHash': None, 'jobUrl': 'https://market.example/jobs/6e1c1e73-c263-4038-be66-93257721f391'}}


WEBHOOK_TEMPLATES = [
    {'id': 'slack', 'name': 'Slack',
     'description': 'Post each event to a Slack channel through an incoming webhook.',
     'relay': 'No relay needed: create an incoming webhook in Slack, then set the agent\'s webhookUrl to its '
              'URL (https://hooks.slack.com/services/...) and webhookFormat to "slack". The service sends '
              '{text, blocks}. With webhookFormat "json", a relay must turn data.title, data.amount, '
              'data.currency and data.jobUrl into {"text": ...}.'},
    {'id': 'discord', 'name': 'Discord',
     'description': 'Post each event to a Discord channel through a channel webhook.',
     'relay': 'No relay needed: create a webhook in the channel settings, then set webhookUrl to it '
              '(https://discord.com/api/webhooks/...) and webhookFormat to "discord". The service sends '
              '{content, embeds, allowed_mentions: {parse: []}}, with the markdown of titles and categories '
              'escaped: they show as text and mention nobody.'},
    {'id': 'telegram', 'name': 'Telegram',
     'description': 'Send each event to a Telegram chat through a bot.',
     'relay': 'No relay needed: create a bot with @BotFather, then set webhookUrl to '
              'https://api.telegram.org/bot<token>/sendMessage?chat_id=<chat id> and webhookFormat to '
              '"telegram". The service sends {text, parse_mode: "HTML"}; the chat id travels in the URL.'},
]


@route('GET', '/api/webhooks/templates')
def get_webhook_templates():
    return {'templates': [dict(template, example=chat_message(SAMPLE_EVENT, template['id']))
                          for template in WEBHOOK_TEMPLATES]}
