"""The boundary to Stripe: the only module that imports the `stripe` library.

One StripeClient, made with the platform's secret key, answers a few verbs that the app needs for the
stripe rail (CONTRACT.md section 12: Connect "separate charges and transfers", the platform holds the
money). Every answer is a plain dict or string, never a stripe object. Every call has a time-out and
no hidden retries (max_network_retries=0), and every POST carries an idempotency key, so the caller may
retry a failed call with the same key and Stripe will not do it twice. Failures become this module's
errors at the boundary:

- StripeUnavailable: no usable answer (network failure, time-out, 409, 429, 5xx); the call may be retried.
- StripeRefused: Stripe answered 4xx; `.message`, `.code` (Stripe's error code, else its error type),
  `.status`.
- InvalidSignature: a webhook whose Stripe-Signature is bad, missing or stale, or whose body is not an event.
"""

import logging
import uuid

import stripe

log = logging.getLogger('stripe_rail')
TOLERANCE = 300             # seconds a webhook's signed timestamp may be old


class StripeUnavailable(Exception):
    """Stripe gave no usable answer (network failure, time-out, 409, 429 or 5xx): the call may be retried."""


class StripeRefused(Exception):
    """Stripe answered 4xx: the request as made will not succeed."""

    def __init__(self, message, code=None, status=None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status


class InvalidSignature(Exception):
    """A webhook with a bad, missing or stale Stripe-Signature, or a body that is not a Stripe event."""


def _id(value):
    """The id of an expandable field, whether Stripe answered an id, an object or nothing."""
    if isinstance(value, dict):
        return value['id']
    return value


def _the_id(answer):
    return answer['id']


def _opened_checkout(session):
    return {'id': session['id'], 'url': session['url'], 'expires_at': session['expires_at']}


def _checkout_state(session):
    intent = session.get('payment_intent')
    return {
        'id': session['id'],
        'status': session['status'],
        'payment_status': session['payment_status'],
        'amount_total': session.get('amount_total'),
        'currency': session.get('currency'),
        'client_reference_id': session.get('client_reference_id'),
        'job_id': (session.get('metadata') or {}).get('job_id'),
        'payment_intent': _id(intent),
        'charge': _id(intent.get('latest_charge')) if isinstance(intent, dict) else None,
    }


def _link(link):
    return {'url': link['url'], 'expires_at': link['expires_at']}


def _account_state(account):
    return {
        'id': account['id'],
        'payouts_enabled': bool(account.get('payouts_enabled')),
        'transfers_active': (account.get('capabilities') or {}).get('transfers') == 'active',
    }


class StripeRail:
    """The platform's Stripe account, asked one thing at a time with a time-out."""

    def __init__(self, secret_key, webhook_secret, *, connect_webhook_secret='', api_base='https://api.stripe.com',
                 timeout=10):
        self.webhook_secret = webhook_secret
        # Stripe signs the platform's own events and its connected accounts' events (account.updated) at two
        # endpoints with two secrets: an event signed with either is good
        self.webhook_secrets = [secret for secret in (webhook_secret, connect_webhook_secret) if secret]
        self.api_base = api_base.rstrip('/')
        self.client = stripe.StripeClient(
            secret_key,
            base_addresses={'api': self.api_base, 'connect': self.api_base, 'files': self.api_base},
            max_network_retries=0,
            http_client=stripe.RequestsClient(timeout=timeout),
        )

    def _call(self, what, read, call, *args, **kwargs):
        """Make one request and `read` what the app needs from its answer (a plain dict); any failure, a
        malformed answer included, becomes this module's errors."""
        try:
            answer = call(*args, **kwargs).to_dict()
        except (stripe.APIConnectionError, stripe.RateLimitError) as exc:
            log.warning('stripe %s failed: %s: %s', what, type(exc).__name__, exc)
            raise StripeUnavailable(f'Stripe did not answer {what} ({type(exc).__name__}).') from None
        except stripe.StripeError as exc:
            status = exc.http_status
            if status is None or not 400 <= status < 500 or status == 409:
                log.warning('stripe %s failed: HTTP %s: %s', what, status, exc)
                raise StripeUnavailable(f'Stripe could not answer {what} (HTTP {status}).') from None
            body = exc.json_body if isinstance(exc.json_body, dict) else {}
            error = body.get('error') if isinstance(body.get('error'), dict) else {}
            code = exc.code or error.get('code') or error.get('type')
            message = getattr(exc, 'user_message', None) or error.get('message') or str(exc)
            log.info('stripe %s refused: HTTP %s %s: %s', what, status, code, message)
            raise StripeRefused(message, code, status) from None
        try:
            return read(answer)
        except (KeyError, TypeError, AttributeError) as exc:
            log.warning('stripe %s answered a malformed %s: %r', what, answer.get('object'), exc)
            raise StripeUnavailable(f'Stripe answered {what} with a malformed object ({exc!r}).') from None

    # --- Checkout (the requester pays the platform) ---

    def open_checkout(self, *, job_id, title, amount_cents, expires_at, success_url, cancel_url):
        """Create a Checkout Session that charges the job's price in USD to the platform; {id, url, expires_at}."""
        job_id = str(job_id)
        create = self.client.v1.checkout.sessions.create
        return self._call('checkout.sessions.create', _opened_checkout, create, params={
            'mode': 'payment',
            'line_items': [{
                'quantity': 1,
                'price_data': {'currency': 'usd', 'unit_amount': int(amount_cents), 'product_data': {'name': title}},
            }],
            'client_reference_id': job_id,
            'metadata': {'job_id': job_id},
            'payment_intent_data': {'transfer_group': f'job_{job_id}', 'metadata': {'job_id': job_id}},
            'expires_at': int(expires_at),
            'success_url': success_url,
            'cancel_url': cancel_url,
        }, options={'idempotency_key': f'checkout-{job_id}'})

    def checkout_session(self, session_id):
        """Retrieve a Checkout Session with its PaymentIntent expanded: its state, amount and latest charge."""
        return self._call('checkout.sessions.retrieve', _checkout_state, self.client.v1.checkout.sessions.retrieve,
                          session_id, params={'expand': ['payment_intent']})

    # --- Connect (workers' accounts) ---

    def create_account(self, *, agent_id):
        """Create an Express connected account that can receive transfers; its id (acct_...)."""
        return self._call('accounts.create', _the_id, self.client.v1.accounts.create, params={
            'type': 'express',
            'capabilities': {'transfers': {'requested': True}},
            'metadata': {'agent_id': str(agent_id)},
        }, options={'idempotency_key': f'account-{agent_id}'})

    def account_link(self, account_id, *, refresh_url, return_url):
        """Create a one-time onboarding link (account_onboarding) for a connected account; {url, expires_at}."""
        return self._call('account_links.create', _link, self.client.v1.account_links.create, params={
            'account': account_id,
            'type': 'account_onboarding',
            'refresh_url': refresh_url,
            'return_url': return_url,
        }, options={'idempotency_key': f'account-link-{account_id}-{uuid.uuid4()}'})   # a fresh link each time

    def account(self, account_id):
        """Retrieve a connected account: {id, payouts_enabled, transfers_active}."""
        return self._call('accounts.retrieve', _account_state, self.client.v1.accounts.retrieve, account_id)

    # --- Money out of the platform's balance ---

    def send_transfer(self, *, amount_cents, destination, transfer_group, source_transaction, idempotency_key):
        """Transfer USD from the platform balance to a connected account, tied to the funding charge; its id."""
        return self._call('transfers.create', _the_id, self.client.v1.transfers.create, params={
            'amount': int(amount_cents),
            'currency': 'usd',
            'destination': destination,
            'transfer_group': transfer_group,
            'source_transaction': source_transaction,
        }, options={'idempotency_key': str(idempotency_key)})

    def refund(self, *, payment_intent, amount_cents, idempotency_key):
        """Refund part or all of a PaymentIntent to the requester's card; the refund's id."""
        return self._call('refunds.create', _the_id, self.client.v1.refunds.create, params={
            'payment_intent': payment_intent,
            'amount': int(amount_cents),
        }, options={'idempotency_key': str(idempotency_key)})

    # --- Webhooks ---

    def event(self, payload: bytes, signature_header: str) -> dict:
        """Verify a webhook's signature on its raw body (tolerance 300 s) with the platform's endpoint secret or the
        Connect endpoint's (each checked in constant time by the library, both always tried); {id, type, account,
        object}."""
        events, problem = [], None
        for secret in self.webhook_secrets:
            try:
                events.append(self.client.construct_event(payload, signature_header, secret, TOLERANCE).to_dict())
            except (stripe.SignatureVerificationError, ValueError, TypeError, KeyError, AttributeError) as exc:
                problem = problem or exc
        try:
            event = events[0]
            return {'id': event['id'], 'type': event['type'], 'account': event.get('account'),
                    'object': dict(event['data']['object'])}
        except (IndexError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise InvalidSignature(f'The Stripe webhook is not valid ({type(problem or exc).__name__}).') from None
