"""A stateful fake of the parts of the Stripe API that stripe_rail.py uses, served on 127.0.0.1.

It speaks what the real `stripe` library sends (form bodies with bracket keys, Bearer auth with the
secret key, an Idempotency-Key header) and answers Stripe-shaped JSON and errors. Tests drive it with
plain methods, not HTTP: complete(), settle(), expire(), enable_payouts(), dispute(), close_dispute(),
refund_from_dashboard(), fail_next(), delay_next(), event(), connect_event() (signed with the Connect endpoint's
secret), sign(), and read state with session(), payment_intent(), charge(), account(), dispute_json(),
transfer_list(), refund_list(), posts(), account_reads() and log.

    from fake_stripe import fake_stripe, fake_stripe_server   # noqa: F401  (the fixtures)

    def test_something(fake_stripe):
        rail = StripeRail(fake_stripe.secret_key, fake_stripe.webhook_secret, api_base=fake_stripe.url)

Idempotency as Stripe documents it: the first answer to a key is saved and replayed (header
Idempotent-Replayed: true) for the same method, path and parameters; other parameters under the same
key are a 400 idempotency_error. Answers to requests that failed validation are not saved, nor are the
failures injected by fail_next() before the request ran (so a retry with the same key can succeed).
"""

import json
import secrets
import string
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

import pytest
import requests
import stripe

SECRET_KEY = 'sk_test_fake_' + 'k' * 24
WEBHOOK_SECRET = 'whsec_fake_' + 'w' * 24
CONNECT_WEBHOOK_SECRET = 'whsec_fake_connect_' + 'c' * 24      # the Connect endpoint's: connected accounts' events
API_VERSION = stripe.api_version
_ALPHABET = string.ascii_letters + string.digits


def new_id(prefix, length=24):
    """A Stripe-looking id: the prefix, then random letters and digits."""
    return prefix + ''.join(secrets.choice(_ALPHABET) for _ in range(length))


def parse_form(pairs):
    """Bracket-keyed form pairs (a[b][0][c]=v) as nested dicts, with lists where every key is an index."""
    root = {}
    for key, value in pairs:
        parts = key.replace(']', '').split('[')
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise StripeFail(400, 'parameter_invalid', f'Invalid parameter {key}.', key)
        node[parts[-1]] = value
    return _lists(root)


def _lists(node):
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(k.isdigit() for k in node):
        return [node[k] for k in sorted(node, key=int)]
    return node


class StripeFail(Exception):
    """An error answer in Stripe's shape; `saved` says whether the idempotency layer keeps it."""

    def __init__(self, status, code, message, param=None, *, type='invalid_request_error', saved=False):
        super().__init__(message)
        self.status, self.saved = status, saved
        self.body = {'error': {'type': type, 'code': code, 'message': message, 'param': param,
                               'doc_url': f'https://stripe.com/docs/error-codes/{code}' if code else None}}
        if code is None:
            del self.body['error']['code'], self.body['error']['doc_url']


def _missing(kind, value, param):
    return StripeFail(404 if param is None else 400, 'resource_missing', f"No such {kind}: '{value}'", param)


def _integer(form, name, *, required=True, minimum=None):
    value = form.get(name)
    if value is None:
        if required:
            raise StripeFail(400, 'parameter_missing', f'Missing required param: {name}.', name)
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise StripeFail(400, 'parameter_invalid_integer', f'Invalid integer: {value}', name) from None
    if minimum is not None and number < minimum:
        raise StripeFail(400, 'parameter_invalid_integer',
                         f'This value must be greater than or equal to {minimum}.', name)
    return number


def _required(form, name):
    value = form.get(name)
    if value in (None, ''):
        raise StripeFail(400, 'parameter_missing', f'Missing required param: {name}.', name)
    return value


class FakeStripe:
    """The fake Stripe API: its state, its HTTP server and the controls tests use."""

    def __init__(self, *, secret_key=SECRET_KEY, webhook_secret=WEBHOOK_SECRET,
                 connect_webhook_secret=CONNECT_WEBHOOK_SECRET):
        self.secret_key = secret_key
        self.webhook_secret = webhook_secret
        self.connect_webhook_secret = connect_webhook_secret
        self.lock = threading.RLock()
        self.server = None
        self.url = None
        self.webhook_url = None         # where the checkout page sends its event (a test sets its server's)
        self.reset()

    # --- lifecycle ---

    def start(self):
        """Serve on 127.0.0.1 on a free port; self.url is the api_base to give the rail."""
        fake = self

        class Handler(_Handler):
            pass
        Handler.fake = fake
        self.server = _Server(('127.0.0.1', 0), Handler)
        self.url = f'http://127.0.0.1:{self.server.server_address[1]}'
        threading.Thread(target=self.server.serve_forever, args=(0.05,), name='fake-stripe', daemon=True).start()
        return self

    def stop(self):
        """Stop serving, waking any delayed request."""
        self._wake.set()
        if self.server:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def reset(self):
        """Forget every object, request, failure and delay (a fresh Stripe account)."""
        with self.lock:
            wake = getattr(self, '_wake', None)
            if wake:
                wake.set()                  # delayed requests of the test before end without running
            self._wake = threading.Event()
            self.generation = getattr(self, 'generation', 0) + 1
            self.sessions, self.intents, self.charges = {}, {}, {}
            self.accounts, self.transfers, self.refunds, self.links = {}, {}, {}, {}
            self.disputes = {}
            self._session_secret = {}       # what a session was made with that its JSON does not show
            self.idempotency = {}           # key -> (method, path, params, status, body)
            self.log = []                   # every request: {method, path, idempotency_key, form, query, ...}
            self.events = []                # every event() made: its dict
            self._failures = []             # fail_next(): (status, after) per coming request
            self.clock = time.time          # Stripe's time (tests with a clock of their own set it; signatures
                                            # keep the real time, which the library checks them against)
            self._delays = []               # delay_next(): seconds per coming request

    # --- controls for tests ---

    def complete(self, session_id, *, paid=True):
        """Pay an open Checkout Session: a succeeded PaymentIntent and its Charge, payment_status paid; with
        paid=False a delayed payment method instead (status complete, payment_status unpaid, the PaymentIntent
        processing and its charge pending until settle()). The session's JSON."""
        with self.lock:
            session = self.sessions[session_id]
            if session['status'] != 'open':
                raise ValueError(f'session {session_id} is {session["status"]}, not open')
            secret = self._session_secret[session_id]
            now = int(self.clock())
            intent_id, charge_id = new_id('pi_'), new_id('ch_')
            self.charges[charge_id] = {
                'id': charge_id, 'object': 'charge', 'amount': session['amount_total'], 'amount_captured': 0,
                'amount_refunded': 0, 'captured': False, 'created': now, 'currency': session['currency'],
                'livemode': False, 'metadata': {}, 'paid': False, 'payment_intent': intent_id, 'refunded': False,
                'status': 'pending', 'transfer_group': secret['transfer_group'],
            }
            self.intents[intent_id] = {
                'id': intent_id, 'object': 'payment_intent', 'amount': session['amount_total'],
                'amount_received': 0, 'created': now, 'currency': session['currency'], 'latest_charge': charge_id,
                'livemode': False, 'metadata': secret['intent_metadata'], 'status': 'processing',
                'transfer_group': secret['transfer_group'],
            }
            session.update(status='complete', payment_status='unpaid', payment_intent=intent_id, url=None)
            if paid:
                self._settle(session, True)
            return self.session(session_id)

    def settle(self, session_id, *, succeeded=True):
        """End a delayed payment of a completed, unpaid session: paid, or failed (the PaymentIntent then
        requires_payment_method and its charge failed). The session's JSON."""
        with self.lock:
            session = self.sessions[session_id]
            intent = self.intents.get(session['payment_intent'])
            if intent is None or intent['status'] != 'processing':
                raise ValueError(f'session {session_id} has no payment in processing')
            self._settle(session, succeeded)
            return self.session(session_id)

    def _settle(self, session, succeeded):
        intent = self.intents[session['payment_intent']]
        charge = self.charges[intent['latest_charge']]
        if succeeded:
            intent.update(status='succeeded', amount_received=intent['amount'])
            charge.update(status='succeeded', paid=True, captured=True, amount_captured=charge['amount'])
            session['payment_status'] = 'paid'
        else:
            intent.update(status='requires_payment_method')
            charge.update(status='failed')

    def expire(self, session_id):
        """Expire an open Checkout Session; its JSON."""
        with self.lock:
            session = self.sessions[session_id]
            if session['status'] != 'open':
                raise ValueError(f'session {session_id} is {session["status"]}, not open')
            session.update(status='expired', url=None)
            return self.session(session_id)

    def enable_payouts(self, account_id):
        """Finish a connected account's onboarding: payouts enabled, transfers active; its JSON."""
        with self.lock:
            account = self.accounts[account_id]
            account.update(payouts_enabled=True, charges_enabled=True, details_submitted=True,
                           capabilities={'transfers': 'active'})
            return self.account(account_id)

    def dispute(self, charge_id, *, reason='fraudulent', amount=None):
        """The payer disputes a charge at its bank (Stripe takes the amount from the platform's balance meanwhile): the
        new dispute's JSON, the object of charge.dispute.created."""
        with self.lock:
            charge = self.charges[charge_id]
            dispute_id = new_id('du_')
            self.disputes[dispute_id] = {
                'id': dispute_id, 'object': 'dispute', 'amount': charge['amount'] if amount is None else amount,
                'charge': charge_id, 'created': int(self.clock()), 'currency': charge['currency'],
                'livemode': False, 'metadata': {}, 'payment_intent': charge['payment_intent'], 'reason': reason,
                'status': 'needs_response',
            }
            charge['disputed'] = True
            return self.dispute_json(dispute_id)

    def close_dispute(self, dispute_id, status):
        """The bank decides: status 'won' or 'lost'; the dispute's JSON, the object of charge.dispute.closed."""
        if status not in ('won', 'lost', 'warning_closed'):
            raise ValueError(f'a dispute closes won, lost or warning_closed, not {status}')
        with self.lock:
            self.disputes[dispute_id]['status'] = status
            return self.dispute_json(dispute_id)

    def refund_from_dashboard(self, charge_id, amount=None):
        """Someone refunds a charge in the Stripe Dashboard (not through the API the service uses): the refund is made
        (amount: the rest of the charge by default) and the charge's JSON is returned, the object of charge.refunded."""
        with self.lock:
            charge = self.charges[charge_id]
            amount = charge['amount'] - charge['amount_refunded'] if amount is None else amount
            charge['amount_refunded'] += amount
            charge['refunded'] = charge['amount_refunded'] == charge['amount']
            refund_id = new_id('re_')
            self.refunds[refund_id] = {
                'id': refund_id, 'object': 'refund', 'amount': amount, 'charge': charge_id,
                'created': int(self.clock()), 'currency': charge['currency'], 'metadata': {},
                'payment_intent': charge['payment_intent'], 'reason': 'requested_by_customer', 'status': 'succeeded',
                'dashboard': True,
            }
            return self.charge(charge_id)

    def connect_event(self, type, obj, account, **options):
        """A Connect event (about a connected account, `account` set) as Stripe sends it to the Connect endpoint:
        signed with that endpoint's own secret. (payload, Stripe-Signature header), as event()."""
        return self.event(type, obj, account, secret=self.connect_webhook_secret, **options)

    def fail_next(self, n=1, status=500, *, after=False, body=None):
        """Fail the next n requests with HTTP `status` (Stripe's api_error shape, or `body`: a dict as JSON, bytes
        as they are) or 'drop' (close the connection without an answer); with after=True each request runs first
        (its effect and idempotent answer stay), and only its answer is lost."""
        with self.lock:
            self._failures.extend([(status, after, body)] * n)

    def clear_failures(self):
        """Forget the failures fail_next() armed that no request has met yet."""
        with self.lock:
            self._failures.clear()

    def delay_next(self, seconds, n=1):
        """Hold the next n requests for `seconds` before running them (a request held past reset() never runs)."""
        with self.lock:
            self._delays.extend([seconds] * n)

    def event(self, type, obj, account=None, *, timestamp=None, secret=None, event_id=None):
        """A webhook event of `type` about `obj`, as (payload bytes, Stripe-Signature header), signed with the
        webhook secret (or `secret`) at `timestamp` (default now) by the stripe library's own helper."""
        event = {
            'id': event_id or new_id('evt_'), 'object': 'event', 'api_version': API_VERSION,
            'created': int(time.time()), 'data': {'object': obj}, 'livemode': False, 'pending_webhooks': 1,
            'request': {'id': None, 'idempotency_key': None}, 'type': type,
        }
        if account is not None:
            event['account'] = account
        with self.lock:
            self.events.append(event)
        payload = json.dumps(event).encode()
        return payload, self.sign(payload, timestamp=timestamp, secret=secret)

    def sign(self, payload, *, timestamp=None, secret=None):
        """The Stripe-Signature header for any body (bytes), made by the stripe library's own helper."""
        if isinstance(payload, bytes):
            try:
                text = payload.decode('utf-8')
            except UnicodeDecodeError:          # Stripe never sends such a body; a test may
                text = payload.decode('latin-1')
        else:
            text = payload
        return stripe.WebhookSignature.generate_signature_header(
            text, secret or self.webhook_secret, timestamp=int(time.time()) if timestamp is None else timestamp)

    # --- objects' current JSON ---

    def session(self, session_id):
        """A Checkout Session's JSON as Stripe would answer it."""
        with self.lock:
            return json.loads(json.dumps(self.sessions[session_id]))

    def payment_intent(self, intent_id):
        with self.lock:
            return json.loads(json.dumps(self.intents[intent_id]))

    def charge(self, charge_id):
        with self.lock:
            return json.loads(json.dumps(self.charges[charge_id]))

    def account(self, account_id):
        with self.lock:
            return json.loads(json.dumps(self.accounts[account_id]))

    def dispute_json(self, dispute_id):
        with self.lock:
            return json.loads(json.dumps(self.disputes[dispute_id]))

    def account_reads(self, account_id=None):
        """The logged accounts.retrieve requests (GET /v1/accounts/:id), of one account if given, oldest first."""
        with self.lock:
            return [r for r in self.log if r['method'] == 'GET' and r['path'].startswith('/v1/accounts/')
                    and (account_id is None or r['path'] == f'/v1/accounts/{account_id}')]

    def transfer_list(self):
        """Every transfer made, oldest first."""
        with self.lock:
            return json.loads(json.dumps(list(self.transfers.values())))

    def refund_list(self):
        """Every refund made, oldest first."""
        with self.lock:
            return json.loads(json.dumps(list(self.refunds.values())))

    def posts(self, path=None):
        """The logged POST requests (to `path` if given), oldest first."""
        with self.lock:
            return [r for r in self.log if r['method'] == 'POST' and (path is None or r['path'] == path)]

    # --- the API ---

    def answer(self, method, path, query, form, key):
        """Run one authenticated request: (status, body, replayed)."""
        if key is not None and method == 'POST':
            saved = self.idempotency.get(key)
            if saved is not None:
                if saved[:3] != (method, path, form):
                    raise StripeFail(400, None, 'Keys for idempotent requests can only be used with the same '
                                     'parameters they were first used with. Try using a key other than '
                                     f"'{key}' if you meant to execute a different request.",
                                     type='idempotency_error')
                return saved[3], saved[4], True
        try:
            status, body = 200, self.route(method, path, query, form)
        except StripeFail as fail:
            if not fail.saved:
                raise
            status, body = fail.status, fail.body
        if key is not None and method == 'POST':
            self.idempotency[key] = (method, path, form, status, body)
        return status, body, False

    def route(self, method, path, query, form):
        parts = path.strip('/').split('/')
        if method == 'POST' and path == '/v1/checkout/sessions':
            return self.create_session(form)
        if method == 'GET' and path == '/v1/checkout/sessions':
            return self.list_sessions(query)
        if method == 'GET' and parts[:3] == ['v1', 'checkout', 'sessions'] and len(parts) == 4:
            return self.retrieve_session(parts[3], query)
        if method == 'POST' and path == '/v1/accounts':
            return self.create_account(form)
        if method == 'GET' and parts[:2] == ['v1', 'accounts'] and len(parts) == 3:
            if parts[2] not in self.accounts:
                raise StripeFail(403, 'account_invalid', 'The provided key does not have access to account '
                                 f"'{parts[2]}' (or that account does not exist).", type='invalid_request_error')
            return self.account(parts[2])
        if method == 'POST' and path == '/v1/account_links':
            return self.create_account_link(form)
        if method == 'POST' and path == '/v1/transfers':
            return self.create_transfer(form)
        if method == 'POST' and path == '/v1/refunds':
            return self.create_refund(form)
        if method == 'GET' and parts[:2] == ['v1', 'payment_intents'] and len(parts) == 3:
            if parts[2] not in self.intents:
                raise _missing('payment_intent', parts[2], None)
            return self.payment_intent(parts[2])
        if method == 'GET' and parts[:2] == ['v1', 'charges'] and len(parts) == 3:
            if parts[2] not in self.charges:
                raise _missing('charge', parts[2], None)
            return self.charge(parts[2])
        raise StripeFail(404, None, f'Unrecognized request URL ({method}: {path}). Please see https://stripe.com'
                         '/docs or we can help at https://support.stripe.com/.')

    def create_session(self, form):
        now = int(self.clock())
        if form.get('mode') not in ('payment', 'setup', 'subscription'):
            raise StripeFail(400, 'parameter_missing' if 'mode' not in form else 'parameter_invalid_string',
                             'Missing required param: mode.', 'mode')
        items = form.get('line_items')
        if not isinstance(items, list) or not items:
            raise StripeFail(400, 'parameter_missing', 'Missing required param: line_items.', 'line_items')
        total, currency = 0, None
        for n, item in enumerate(items):
            price = item.get('price_data') if isinstance(item, dict) else None
            if not isinstance(price, dict):
                raise StripeFail(400, 'parameter_missing', f'Missing required param: line_items[{n}][price_data].',
                                 f'line_items[{n}][price_data]')
            amount = _integer(price, 'unit_amount', minimum=0)
            quantity = _integer(item, 'quantity', minimum=1)
            currency = _required(price, 'currency').lower()
            if not (price.get('product_data') or {}).get('name'):
                raise StripeFail(400, 'parameter_missing', f'Missing required param: line_items[{n}][price_data]'
                                 '[product_data][name].', f'line_items[{n}][price_data][product_data][name]')
            total += amount * quantity
        if currency == 'usd' and total < 50:
            raise StripeFail(400, 'amount_too_small', 'The Checkout Session\'s total amount due must add up to at '
                             'least $0.50 usd', 'line_items')
        expires_at = _integer(form, 'expires_at', required=False)
        if expires_at is None:
            expires_at = now + 86400
        elif not now + 1800 - 60 <= expires_at <= now + 86400 + 60:
            raise StripeFail(400, 'parameter_invalid_integer', 'The `expires_at` timestamp must be between 30 '
                             'minutes and 24 hours from Checkout Session creation.', 'expires_at')
        _required(form, 'success_url')
        session_id = new_id('cs_test_', 58)
        intent_data = form.get('payment_intent_data') or {}
        self.sessions[session_id] = {
            'id': session_id, 'object': 'checkout.session', 'amount_subtotal': total, 'amount_total': total,
            'cancel_url': form.get('cancel_url'), 'client_reference_id': form.get('client_reference_id'),
            'created': now, 'currency': currency, 'expires_at': expires_at, 'livemode': False,
            'metadata': form.get('metadata') or {}, 'mode': form['mode'], 'payment_intent': None,
            'payment_status': 'unpaid', 'status': 'open', 'success_url': form['success_url'],
            'url': f'{self.url}/c/pay/{session_id}',
        }
        self._session_secret[session_id] = {
            'transfer_group': intent_data.get('transfer_group'), 'intent_metadata': intent_data.get('metadata') or {},
            'line_items': items,
        }
        return self.session(session_id)

    def retrieve_session(self, session_id, query):
        if session_id not in self.sessions:
            raise _missing('checkout.session', session_id, None)
        session = self.session(session_id)
        if 'payment_intent' in (query.get('expand') or []) and session['payment_intent']:
            session['payment_intent'] = self.payment_intent(session['payment_intent'])
        return session

    def list_sessions(self, query):
        sessions = [self.session(s) for s in reversed(list(self.sessions))]
        if query.get('payment_intent'):
            sessions = [s for s in sessions if s['payment_intent'] == query['payment_intent']]
        limit = _integer(query, 'limit', required=False, minimum=1) or 10
        return {'object': 'list', 'data': sessions[:limit], 'has_more': len(sessions) > limit,
                'url': '/v1/checkout/sessions'}

    def create_account(self, form):
        if form.get('type') not in (None, 'express', 'standard', 'custom'):
            raise StripeFail(400, 'parameter_invalid_string', f"Invalid type: {form['type']}", 'type')
        account_id = new_id('acct_', 16)
        requested = {name: 'inactive' for name, want in (form.get('capabilities') or {}).items()
                     if isinstance(want, dict) and want.get('requested') == 'true'}
        self.accounts[account_id] = {
            'id': account_id, 'object': 'account', 'capabilities': requested, 'charges_enabled': False,
            'country': form.get('country') or 'US', 'created': int(self.clock()), 'default_currency': 'usd',
            'details_submitted': False, 'metadata': form.get('metadata') or {}, 'payouts_enabled': False,
            'type': form.get('type') or 'standard',
        }
        return self.account(account_id)

    def create_account_link(self, form):
        account_id = _required(form, 'account')
        if account_id not in self.accounts:
            raise _missing('account', account_id, 'account')
        if form.get('type') not in ('account_onboarding', 'account_update'):
            raise StripeFail(400, 'parameter_invalid_string' if form.get('type') else 'parameter_missing',
                             'Invalid type: must be one of account_onboarding or account_update', 'type')
        _required(form, 'return_url')
        now = int(self.clock())
        link = {'object': 'account_link', 'created': now, 'expires_at': now + 300,
                'url': f'{self.url}/setup/e/{account_id}/{new_id("", 12)}'}
        self.links[link['url']] = dict(link, account=account_id, refresh_url=form.get('refresh_url'),
                                       return_url=form['return_url'])
        return link

    def create_transfer(self, form):
        amount = _integer(form, 'amount', minimum=1)
        currency = _required(form, 'currency').lower()
        destination = _required(form, 'destination')
        account = self.accounts.get(destination)
        if account is None:
            raise _missing('destination', destination, 'destination')
        if account['capabilities'].get('transfers') != 'active':
            raise StripeFail(400, 'insufficient_capabilities_for_transfer', 'Your destination account needs to '
                             'have at least one of the following capabilities enabled: transfers, crypto_transfers, '
                             'legacy_payments', 'destination')
        source = form.get('source_transaction')
        if source is not None:
            charge = self.charges.get(source)
            if charge is None:
                raise _missing('charge', source, 'source_transaction')
            if charge['status'] != 'succeeded':
                raise StripeFail(400, None, f'The source_transaction {source} has not succeeded '
                                 f'(it is {charge["status"]}).', 'source_transaction')
            if charge['currency'] != currency:
                raise StripeFail(400, 'parameter_invalid_string', f'The currency of source_transaction\'s balance '
                                 f'transaction ({charge["currency"]}) must be the same as the transfer currency '
                                 f'({currency}).', 'currency')
            sent = sum(t['amount'] for t in self.transfers.values() if t['source_transaction'] == source)
            remaining = charge['amount'] - charge['amount_refunded'] - sent
            if amount > remaining:
                raise StripeFail(400, 'balance_insufficient', f'Insufficient funds in Stripe account: the transfer '
                                 f'amount ({amount}) exceeds what remains of source_transaction {source} '
                                 f'({remaining}).', 'amount', saved=True)
        transfer_id = new_id('tr_')
        self.transfers[transfer_id] = {
            'id': transfer_id, 'object': 'transfer', 'amount': amount, 'amount_reversed': 0,
            'created': int(self.clock()), 'currency': currency, 'destination': destination, 'livemode': False,
            'metadata': form.get('metadata') or {}, 'reversed': False, 'source_transaction': source,
            'transfer_group': form.get('transfer_group'),
        }
        return dict(self.transfers[transfer_id])

    def create_refund(self, form):
        intent_id, charge_id = form.get('payment_intent'), form.get('charge')
        if intent_id is None and charge_id is None:
            raise StripeFail(400, 'parameter_missing', 'One of the following params should be provided for this '
                             'request: payment_intent or charge.', 'payment_intent')
        if intent_id is not None:
            intent = self.intents.get(intent_id)
            if intent is None:
                raise _missing('payment_intent', intent_id, 'payment_intent')
            if intent['status'] != 'succeeded':
                raise StripeFail(400, 'payment_intent_unexpected_state', f'This PaymentIntent ({intent_id}) does '
                                 'not have a successful charge to refund.', 'payment_intent')
            charge_id = intent['latest_charge']
        charge = self.charges.get(charge_id)
        if charge is None:
            raise _missing('charge', charge_id, 'charge')
        remaining = charge['amount'] - charge['amount_refunded']
        amount = _integer(form, 'amount', required=False, minimum=1)
        amount = remaining if amount is None else amount
        if remaining == 0:
            raise StripeFail(400, 'charge_already_refunded', f'Charge {charge_id} has already been refunded.',
                             saved=True)
        if amount > remaining:
            raise StripeFail(400, 'amount_too_large', f'Refund amount (${amount / 100:.2f}) is greater than '
                             f'unrefunded amount on charge (${remaining / 100:.2f})', 'amount', saved=True)
        charge['amount_refunded'] += amount
        charge['refunded'] = charge['amount_refunded'] == charge['amount']
        refund_id = new_id('re_')
        self.refunds[refund_id] = {
            'id': refund_id, 'object': 'refund', 'amount': amount, 'charge': charge_id,
            'created': int(self.clock()), 'currency': charge['currency'], 'metadata': form.get('metadata') or {},
            'payment_intent': charge['payment_intent'], 'reason': form.get('reason'), 'status': 'succeeded',
        }
        return dict(self.refunds[refund_id])


class _Server(ThreadingHTTPServer):
    """A threaded server whose backlog takes a burst of concurrent clients."""

    daemon_threads = True
    request_queue_size = 128


class _Handler(BaseHTTPRequestHandler):
    """One HTTP request to the fake, as the stripe library sends it."""

    fake = None
    protocol_version = 'HTTP/1.1'
    disable_nagle_algorithm = True      # headers and body go out in two writes: no 40 ms delayed-ACK stalls

    def log_message(self, format, *args):
        pass

    def do_GET(self):
        self.serve('GET')

    def do_POST(self):
        self.serve('POST')

    def do_DELETE(self):
        self.serve('DELETE')

    def serve(self, method):
        fake = self.fake
        length = int(self.headers.get('Content-Length') or 0)
        raw = self.rfile.read(length).decode() if length else ''
        split = urlsplit(self.path)
        path, key = split.path, self.headers.get('Idempotency-Key')
        with fake.lock:
            generation = fake.generation
            delay = fake._delays.pop(0) if fake._delays else 0
            failure = fake._failures.pop(0) if fake._failures else None
            wake = fake._wake
            try:
                form = parse_form(parse_qsl(raw, keep_blank_values=True))
                query = parse_form(parse_qsl(split.query, keep_blank_values=True))
            except StripeFail as fail:
                form, query, early = {}, {}, fail
            else:
                early = None
            record = {'method': method, 'path': path, 'idempotency_key': key, 'form': form, 'query': query,
                      'authorization': self.headers.get('Authorization'),
                      'stripe_version': self.headers.get('Stripe-Version'),
                      'content_type': self.headers.get('Content-Type'), 'at': time.time(),
                      'status': None, 'replayed': False}      # what the fake answered, once it has
            fake.log.append(record)
        if delay:
            wake.wait(delay)
            with fake.lock:
                if fake.generation != generation:
                    return self.drop()
        if failure is not None and not failure[1]:
            return self.fail(failure)
        if path.startswith('/c/pay/'):
            return self.checkout_page(method, path.removeprefix('/c/pay/'))
        if path.startswith('/setup/'):
            return self.send(200, {'object': 'page', 'path': path}, {})
        with fake.lock:
            try:
                if early is not None:
                    raise early
                if self.headers.get('Authorization') != f'Bearer {fake.secret_key}':
                    given = (self.headers.get('Authorization') or '').removeprefix('Bearer ')
                    raise StripeFail(401, None, f'Invalid API Key provided: {given[:8]}{"*" * 8}')
                status, body, replayed = fake.answer(method, path, query, form, key)
            except StripeFail as fail:
                status, body, replayed = fail.status, fail.body, False
            record.update(status=status, replayed=replayed)
        if failure is not None:
            return self.fail(failure)
        headers = {'Idempotent-Replayed': 'true'} if replayed else {}
        if key is not None and method == 'POST':
            headers['Idempotency-Key'] = key
        self.send(status, body, headers)

    def checkout_page(self, method, session_id):
        """Stripe Checkout as a person sees it, at its least: GET shows a Pay button; POST pays the session, sends
        the signed checkout.session.completed event to fake.webhook_url, then redirects to the success_url."""
        fake = self.fake
        if method == 'GET':
            page = (f'<!doctype html><title>Fake Checkout</title><h1>Pay {session_id}</h1>'
                    f'<form method="post" action="/c/pay/{session_id}"><button type="submit">Pay</button></form>')
            return self.send_html(200, page.encode())
        paid = fake.complete(session_id)
        payload, signature = fake.event('checkout.session.completed', paid)
        requests.post(fake.webhook_url, data=payload, headers={'Stripe-Signature': signature,
                                                              'Content-Type': 'application/json'}, timeout=10)
        self.send_response(303)
        self.send_header('Location', paid['success_url'])
        self.send_header('Content-Length', '0')
        self.end_headers()

    def send_html(self, status, data):
        self.send_response(status)
        self.send_header('Content-Type', 'text/html; charset=utf-8')
        self.send_header('Content-Length', str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def fail(self, failure):
        status, _, body = failure
        if status == 'drop':
            return self.drop()
        if body is None:
            body = {'error': {'type': 'api_error', 'message': 'An unknown error occurred in the fake.'}}
        self.send(int(status), body, {'Stripe-Should-Retry': 'true'})

    def drop(self):
        """Close the connection with no answer at all."""
        self.close_connection = True
        try:
            self.connection.shutdown(2)
        except OSError:
            pass

    def send(self, status, body, headers):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(data)))
        self.send_header('Request-Id', new_id('req_', 14))
        self.send_header('Stripe-Version', API_VERSION)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope='module')
def fake_stripe_server():
    """One fake Stripe served for a test module."""
    fake = FakeStripe().start()
    yield fake
    fake.stop()


@pytest.fixture
def fake_stripe(fake_stripe_server):
    """The module's fake Stripe, emptied for this test."""
    fake_stripe_server.reset()
    yield fake_stripe_server
    fake_stripe_server.reset()
