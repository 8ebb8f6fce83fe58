"""x402: pay per call, in USDC on Base, versions 1 and 2 of the protocol.

It owns the prices of the endpoints that --x402-price names, the 402 answer with its payment requirements, the two
forms of payment (a USDC transfer proven by its sender's signature, or an EIP-3009 authorization the service or a
facilitator settles), the binding of each accepted payment to its call (spent by the first answer below 400), the
receipts in X-PAYMENT-RESPONSE and PAYMENT-RESPONSE, and the /api/x402 routes. The chain is read and written
through verifier/; the app calls X402.answer for a priced route (Faces.x402).
"""

import hashlib
import hmac
import json
import re
from datetime import timedelta
from urllib.parse import urlsplit

import apsw
import requests
from bottle import request, response

from marketplace import (APIError, BadRequest, NETWORK_BY_CHAIN, NotFound, X402_NEEDS_CHAIN, cacheable, hash_key, log,
                         new_id, now, now_iso, openapi_path, parse_time, payment_error, read_raw_body, route, route_of,
                         service, used_payment, x402_pay_to)
from openapi_spec import API_OPERATIONS
from verifier.errors import ChainUnavailable, VerificationError
from verifier.redact import redact_url, url_secrets, without_secrets


X402_TIMEOUT_SECONDS = 60       # maxTimeoutSeconds: how long a client's authorization stays valid
SETTLEMENT_WAIT = 10            # seconds a paid call waits for its settlement to be mined
SETTLE_MARGIN = 6               # an authorization must stay valid this long for the relayer to settle it
PAYMENT_WINDOW = 3600           # seconds an accepted payment not yet spent may pay its own call again (CONTRACT 20)
# A facilitator's invalidReason / errorReason (x402's), as this service's codes and the check it names
FACILITATOR_REASONS = {
    'insufficient_funds': ('payment_insufficient', 'balance'),
    'invalid_exact_evm_payload_authorization_value': ('payment_insufficient', 'amount'),
    'invalid_exact_evm_payload_authorization_valid_after': ('payment_expired', 'fresh'),
    'invalid_exact_evm_payload_authorization_valid_before': ('payment_expired', 'fresh'),
    'invalid_exact_evm_payload_recipient_mismatch': ('payment_wrong_recipient', 'recipient'),
    'invalid_exact_evm_payload_signature': ('payment_signature_invalid', 'signature'),
    'invalid_network': ('payment_wrong_chain', 'network'),
    'invalid_scheme': ('payment_invalid', 'scheme'),
    'invalid_x402_version': ('payment_invalid', 'version'),
    'invalid_transaction_state': ('payment_reverted', 'notReplayed'),
}


class X402:
    """x402 pay-per-call, versions 1 and 2 (CONTRACT.md 7 and 13): the priced endpoints, the 402 answer, and taking
    a payment. A version is only a wire format: a payment in X-PAYMENT (1) or PAYMENT-SIGNATURE (2) goes through the
    same checks (verifier.x402.evaluate_payment), settlement and consumption, and is answered in its own version.

    Payments go to --x402-pay-to, never to the escrow address. A payment is bound to the call it is first accepted
    for (call_digest, CONTRACT.md 20) and spent in the transaction that answers that call below 400; until then only
    that call may send it again, for PAYMENT_WINDOW. A form-1 proof, signed by its transfer's sender for the call
    (PaymentProof), is checked on chain and stored with the call's digest. A form-2 authorization is checked and its
    settlement simulated, then settled before the call is answered: signed by the escrow wallet as relayer (it pays
    the gas) and stored in the same transaction that reserves the authorization (so a crash never leaves a gap in
    the wallet's nonces), sent, and awaited; or settled by --facilitator-url. A call whose settlement is slower
    than SETTLEMENT_WAIT answers 503, and the same call sending the same payment again is answered once the
    settlement is mined.
    """

    def __init__(self, settings):
        from verifier.x402 import NETWORKS, network_name
        onchain = settings.onchain
        if onchain is None:
            raise ValueError(X402_NEEDS_CHAIN)
        self.network = NETWORK_BY_CHAIN.get(settings.chain_id)
        if self.network is None:
            raise ValueError(f'x402 works on Base (8453) and Base Sepolia (84532), not on chain {settings.chain_id}')
        self.network_v2 = network_name(settings.chain_id, 2)       # CAIP-2: 'eip155:8453'
        _, self.token_name, self.token_version = NETWORKS[self.network]
        self.pay_to = x402_pay_to(settings.x402_pay_to, onchain.escrow_address)
        self.settings, self.onchain = settings, onchain
        self.prices = {(price.method, price.rule): price for price in settings.x402_price}
        self.facilitator = settings.facilitator_url.rstrip('/')
        self.session = requests.Session()

    # ----- what a caller is told -----

    def card_terms(self):
        """What the service card advertises (hashable, so the card can be cached)."""
        return (self.network, self.network_v2, self.settings.chain_id, self.onchain.usdc, self.pay_to,
                tuple(price.endpoint for price in self.prices.values()))

    def network_of(self, x402_version):
        """The network's name in that version of x402: 'base' (1) or 'eip155:8453' (2)."""
        return self.network_v2 if x402_version == 2 else self.network

    def requirements(self, price, resource):
        """The x402 PaymentRequirements (v1) of a priced endpoint; `resource` is the full URL being paid for."""
        summary = API_OPERATIONS[(price.method, price.rule)]['summary']
        return {'scheme': 'exact', 'network': self.network, 'maxAmountRequired': str(price.amount),
                'resource': resource, 'description': f'{price.endpoint}: {summary}',
                'mimeType': 'application/json', 'payTo': self.pay_to,
                'maxTimeoutSeconds': X402_TIMEOUT_SECONDS, 'asset': self.onchain.usdc,
                'extra': {'name': self.token_name, 'version': self.token_version}}

    def requirements_v2(self, price):
        """The x402 PaymentRequirements (v2) of a priced endpoint: what a PAYMENT-SIGNATURE's `accepted` names."""
        from verifier.x402 import requirements_v2
        return requirements_v2(chain_id=self.settings.chain_id, token=self.onchain.usdc, pay_to=self.pay_to,
                               amount=price.amount, max_timeout_seconds=X402_TIMEOUT_SECONDS, name=self.token_name,
                               version=self.token_version)

    def payment_required(self, price, resource, message):
        """The x402 PaymentRequired (v2) of a priced call, as its 402's PAYMENT-REQUIRED header carries it."""
        summary = API_OPERATIONS[(price.method, price.rule)]['summary']
        return {'x402Version': 2, 'error': message,
                'resource': {'url': resource, 'description': f'{price.endpoint}: {summary}',
                             'mimeType': 'application/json'},
                'accepts': [self.requirements_v2(price)]}

    def refusal(self, price, message, code, checks=None, retry_after=None, spent=None):
        """The 402 of a priced call in both versions: the x402 v1 body (x402Version, error, accepts, and the
        PaymentProof a form-1 proof's sender signs for this call) with this service's code, and the v2
        PaymentRequired in the PAYMENT-REQUIRED header; `spent` (paymentSpent) on a payment taken before. A node or
        facilitator that cannot answer is the usual 503 instead (payment_error)."""
        from verifier.x402 import encode_header, proof_typed_data
        if code == 'chain_unavailable':
            return payment_error(ChainUnavailable(message))
        resource = service().settings.base_url + request.path
        extra = {'x402Version': 1, 'accepts': [self.requirements(price, resource)],
                 'proofTypedData': proof_typed_data(tx_hash=None, method=price.method, path=request.path,
                                                    chain_id=self.settings.chain_id,
                                                    escrow=self.onchain.escrow_address)}
        if checks is not None:
            extra['checks'] = checks
        if spent is not None:
            extra['paymentSpent'] = spent
        headers = {'PAYMENT-REQUIRED': encode_header(self.payment_required(price, resource, message))}
        if retry_after:
            headers['Retry-After'] = str(retry_after)
        return APIError(message, code=code, status=402, extra=extra, headers=headers)

    def refuse(self, price, evaluation):
        error = evaluation.error
        return self.refusal(price, error.message, error.code, evaluation.checks.as_dict(), error.retry_after)

    # ----- checking a payment -----

    def payment_header(self, price=None):
        """The payment a request carries: (the header's text, its x402 version), from X-PAYMENT (1) or
        PAYMENT-SIGNATURE (2); (None, None) without one. Both at once is refused (a 402 on the call of `price`,
        else 400): which one would pay?"""
        from verifier.x402 import PAYMENT_HEADERS
        sent = [(request.get_header(name), version) for version, name in PAYMENT_HEADERS.items()
                if request.get_header(name)]
        if len(sent) > 1:
            message = 'Send one payment header, X-PAYMENT (x402 v1) or PAYMENT-SIGNATURE (v2), not both.'
            raise self.refusal(price, message, 'payment_invalid') if price else \
                BadRequest(message, code='payment_invalid')
        return sent[0] if sent else (None, None)

    def evaluate(self, db, header, price, mark=None, x402_version=1, path=None):
        """Every check of a payment (the text of its header, of that x402 version) against a price
        (verifier.x402.evaluate_payment), the chain's included, the balance less what is promised to pending
        settlements (`mark`: settled_mark before the chain is read) and, for the relayer, the settlement
        simulated; with a facilitator, an authorization's on-chain checks are the facilitator's. A proof's
        signature is checked for the call of `price` at `path` (default: the request's)."""
        from verifier.x402 import PAYMENT_HEADERS, decode_payment_header, evaluate_payment
        mark = mark or self.settled_mark(db)
        try:
            payment = decode_payment_header(header, PAYMENT_HEADERS[x402_version])
        except VerificationError:
            payment = header            # evaluate_payment records it as not decoded
        form = payment.get('payload') if isinstance(payment, dict) else None
        by_facilitator = self.facilitator and isinstance(form, dict) and 'authorization' in form
        evaluation = evaluate_payment(
            payment, chain_id=self.settings.chain_id, token=self.onchain.usdc, pay_to=self.pay_to,
            min_amount=price.amount, now=now().timestamp(), chain=None if by_facilitator else self.onchain.chain,
            confirmations=self.settings.confirmations, max_age_seconds=self.settings.payment_max_age,
            tx_used=lambda tx_hash: used_payment(db, self.settings.chain_id, tx_hash) is not None,
            authorization_used=lambda payer, nonce: self.authorization_record(db, payer, nonce) is not None,
            name=self.token_name, version=self.token_version, settle_within=0 if by_facilitator else SETTLE_MARGIN,
            x402_version=x402_version, escrow=self.onchain.escrow_address, method=price.method,
            path=request.path if path is None else path)
        resource = payment.get('resource', (payment.get('payload') or {}).get('resource')) \
            if evaluation.form else None
        if isinstance(resource, dict):  # version 2: {url, description, mimeType}
            resource = resource.get('url')
        if resource is not None:        # a payment that names what it pays for: compared by path
            path = urlsplit(resource).path if isinstance(resource, str) else None
            if path is not None and route_of(f'{price.method} {path}') == (price.method, price.rule):
                evaluation.checks.passed('resource')
            else:
                evaluation.checks.fail('resource', VerificationError(
                    f'The payment is for {resource!r}, not for {price.endpoint}.', 'payment_invalid'))
        self.covered(db, evaluation, mark)
        if evaluation.form == 'authorization' and not by_facilitator and evaluation.error is None:
            if not evaluation.checks.run('settles', self.check_settles, evaluation.payment):
                # A settlement of the same payer reserved since the balance was judged may be why it reverts: then
                # the balance speaks (payment_insufficient, before `settles` in the checks' order), not the revert.
                self.covered(db, evaluation, mark)
        return evaluation

    def covered(self, db, evaluation, mark):
        """Whether the payer's balance as read from the chain, less what its settlements that balance may not show
        yet will move (those pending, or made or pending since `mark`, taken before the read), still covers this
        authorization (its own settlement aside: that one is a replay); if not, its `balance` check fails
        (payment_insufficient). True when there is no balance to compare."""
        if evaluation.form != 'authorization' or evaluation.balance is None or \
                evaluation.checks.results.get('balance') is not True:
            return True
        promised = db.value('''
            SELECT coalesce(sum(amount), 0) FROM x402_payments
            WHERE chain_id = :chain AND asset = :asset AND payer = :payer AND form = 'authorization'
              AND status != 'failed' AND authorization_nonce != :nonce
              AND (status = 'pending' OR seq > :seq OR id IN (SELECT value FROM json_each(:pending)))''',
            {'chain': self.settings.chain_id, 'asset': self.onchain.usdc, 'payer': evaluation.payer,
             'nonce': evaluation.nonce, **mark})
        if evaluation.balance - promised >= evaluation.amount:
            return True
        evaluation.checks.fail('balance', VerificationError(
            f'The payer holds {evaluation.balance} base units of USDC, {promised} of them promised to settlements not '
            f'yet done; the authorization moves {evaluation.amount}.', 'payment_insufficient'))
        return False

    def check_settles(self, payment):
        """The relayer's settlement run as an eth_call from the escrow wallet, in the block being built: one that
        would revert is refused before anything is signed, so the escrow wallet never pays gas for it."""
        from verifier.x402 import settlement_data
        reason = self.onchain.chain.revert_reason(self.onchain.escrow_address, self.onchain.usdc,
                                                  settlement_data(payment))
        if reason is not None:
            raise VerificationError(f'Settling this authorization would revert on chain ({reason}); nothing was '
                                    'signed or sent.', 'payment_reverted')

    @staticmethod
    def settled_mark(db):
        """Where the settlements stand before the chain is read: the newest row, and those still pending. A
        settlement after the mark, or pending at it, may be missing from a balance read then (see covered)."""
        return {'seq': db.value('SELECT coalesce(max(seq), 0) FROM x402_payments'),
                'pending': json.dumps([row['id'] for row in
                                       db.rows("SELECT id FROM x402_payments WHERE status = 'pending'")])}

    def authorization_record(self, db, payer, nonce):
        return db.row('''SELECT * FROM x402_payments WHERE chain_id = :chain AND asset = :asset AND payer = :payer
                         AND authorization_nonce = :nonce''',
                      {'chain': self.settings.chain_id, 'asset': self.onchain.usdc, 'payer': payer, 'nonce': nonce})

    def facilitator_call(self, step, evaluation, price):
        """POST {facilitator}/verify or /settle, in the payment's own x402 version (its payload as sent, and the
        requirements of that version); its JSON answer. A facilitator that does not answer properly is
        ChainUnavailable (503): the payment may be fine."""
        requirements = self.requirements_v2(price) if evaluation.x402_version == 2 else \
            self.requirements(price, self.settings.base_url + openapi_path(price.rule))
        body = {'x402Version': evaluation.x402_version, 'paymentPayload': evaluation.payment,
                'paymentRequirements': requirements}
        try:
            answer = self.session.post(f'{self.facilitator}/{step}', json=body, timeout=10, allow_redirects=False)
            answer.raise_for_status()
            result = answer.json()
            if not isinstance(result, dict):
                raise ValueError('not a JSON object')
        except (requests.RequestException, ValueError) as exc:
            log.warning('facilitator /%s at %s failed: %s: %s', step, redact_url(self.facilitator),
                        type(exc).__name__, without_secrets(str(exc), url_secrets(self.facilitator)))
            raise ChainUnavailable(f'The x402 facilitator did not answer /{step} ({type(exc).__name__}).') from None
        return result

    def facilitator_verdict(self, evaluation, price):
        """Ask the facilitator's /verify about a form-2 payment our own checks passed; its refusal goes into
        the evaluation's checks."""
        result = self.facilitator_call('verify', evaluation, price)
        if result.get('isValid') is not True:
            reason = str(result.get('invalidReason') or 'unknown')
            code, check = FACILITATOR_REASONS.get(reason, ('payment_invalid', 'decoded'))
            message = str(result.get('invalidMessage') or f'The facilitator refused the payment: {reason}.')
            evaluation.checks.fail(check, VerificationError(message, code))

    # ----- taking a payment -----

    def call_digest(self, db, account):
        """What an accepted payment is bound to (CONTRACT.md 20): SHA-256 of the method, the path with its query, the
        SHA-256 of the body, and the caller (its API key's id; a browser session's account; nothing without a key)."""
        caller_id = ''
        if account is not None:
            scheme, _, key = request.get_header('Authorization', '').partition(' ')
            caller_id = (scheme.lower() == 'bearer' and key.strip() and db.value(
                'SELECT id FROM api_keys WHERE key_hash = :hash', {'hash': hash_key(key.strip())})) \
                or f'account:{account["id"]}'
        target = request.path + ('?' + request.query_string if request.query_string else '')
        body = hashlib.sha256(read_raw_body()).hexdigest()
        return hashlib.sha256(f'{request.method}\n{target}\n{body}\n{caller_id}'.encode('utf-8')).hexdigest()

    def accepted(self, db, evaluation):
        """The record of a payment accepted before (a proof by its transaction, an authorization by its payer and
        nonce), or None."""
        if evaluation.form == 'proof' and evaluation.tx_hash:
            return db.row('''SELECT * FROM x402_payments
                             WHERE chain_id = :chain AND tx_hash = :tx AND form = 'proof' ''',
                          {'chain': self.settings.chain_id, 'tx': evaluation.tx_hash})
        if evaluation.form == 'authorization' and evaluation.payer and evaluation.nonce:
            return self.authorization_record(db, evaluation.payer, evaluation.nonce)
        return None

    def require_same_call(self, price, evaluation, record, digest):
        """A payment accepted before pays again only for the call it was accepted for (the same digest), while that
        call has no answer below 400 and for PAYMENT_WINDOW after it was accepted, whatever the authorization's
        validBefore: else 402 payment_replayed, or payment_expired once the window has passed."""
        checks = dict(evaluation.checks.as_dict(), notReplayed=False)
        if record['granted_at'] is not None:
            raise self.refusal(price, 'This payment has paid for a call already.', 'payment_replayed', checks,
                               spent=True)
        if parse_time(record['created_at']) + timedelta(seconds=PAYMENT_WINDOW) <= now():
            raise self.refusal(price, f'This payment was taken at {record["created_at"]} for a call that was never '
                                      'answered below 400; it could pay that call again for an hour only.',
                               'payment_expired', checks, spent=False)
        if not (record['call_digest'] and hmac.compare_digest(record['call_digest'], digest)):
            raise self.refusal(price, 'This payment was taken for another call (method, path, query, body or key), '
                                      'not yet answered: only that call may send it again, within an hour.',
                               'payment_replayed', checks, spent=False)

    def refuse_but(self, price, evaluation, allowed):
        """Refuse a payment presented again for its own call if a check fails that its first acceptance does not
        explain (`allowed`: its use, its age)."""
        failed = [name for name in evaluation.checks.names if name in evaluation.checks.errors and name not in allowed]
        if failed:
            error = evaluation.checks.errors[failed[0]]
            raise self.refusal(price, error.message, error.code, evaluation.checks.as_dict(), error.retry_after)

    def answer(self, price, handler, params, account=None):
        """Answer a priced call paid with X-PAYMENT (x402 v1) or PAYMENT-SIGNATURE (v2): the payment checked and
        accepted for this call (a proof stored, an authorization settled, each with the call's digest), then spent
        in the transaction that runs the handler if it answers below 400, and the receipt set in that version's
        header (`paymentSpent` says whether it was spent). 402 if it does not check out, or if it was accepted for
        another call. A call with a key acts as the key's `account`; without one, as the payer's wallet account
        (a proof's signature, an authorization's, names the payer), made once and kept."""
        from verifier.x402 import RESPONSE_HEADERS, encode_header
        svc = service()
        header, x402_version = self.payment_header(price)
        if not header:
            raise self.refusal(price, ('Only admin keys and exempt accounts call this free: pay' if account else
                                       'X-PAYMENT (x402 v1) or PAYMENT-SIGNATURE (v2) header is required: pay')
                               + ' with one of `accepts` (x402).', 'payment_required')
        mark = self.settled_mark(svc.db)        # before the chain is read
        evaluation = self.evaluate(svc.db, header, price, mark, x402_version)
        record = self.accepted(svc.db, evaluation)
        if record is None and evaluation.error is not None:
            raise self.refuse(price, evaluation)        # before the body is read: a refused payment takes nothing
        digest = self.call_digest(svc.db, account)
        if record is not None:
            self.require_same_call(price, evaluation, record, digest)
        if evaluation.form == 'authorization':
            record = self.settlement(svc.db, evaluation, price, mark, digest)
        else:
            record = self.take_proof(svc.db, evaluation, price, record, digest)
        if account is None:
            account = wallet_account(svc.db, evaluation.payer)
        receipt = {'success': True, 'transaction': record['tx_hash'], 'network': self.network_of(x402_version),
                   'payer': evaluation.payer}
        try:
            with svc.db.transaction():
                granted = svc.db.execute('''UPDATE x402_payments SET granted_at = :moment, account_id = :account,
                                            endpoint = :endpoint WHERE id = :id AND granted_at IS NULL''',
                                         {'moment': now_iso(), 'account': account['id'], 'endpoint': price.endpoint,
                                          'id': record['id']})
                if granted:
                    request.environ['marketplace.account'] = account
                    result = handler(**params)
        except (APIError, VerificationError):     # answered 400 or more: not spent, still this call's
            response.set_header(RESPONSE_HEADERS[x402_version], encode_header(dict(receipt, paymentSpent=False)))
            raise
        if not granted:         # the same call, answered at the same moment
            raise self.refusal(price, 'This payment has paid for a call already.', 'payment_replayed',
                               dict(evaluation.checks.as_dict(), notReplayed=False), spent=True)
        response.set_header(RESPONSE_HEADERS[x402_version], encode_header(dict(receipt, paymentSpent=True)))
        return result

    def take_proof(self, db, evaluation, price, record, digest):
        """A form-1 proof accepted for this call: stored with the call's digest, its hash marked used, in a
        transaction of its own (so that it stays bound to this call whatever the call answers); or, when this call
        presents it again, the record stored then."""
        allowed = ('fresh', 'notReplayed')          # what its first acceptance changed, or time did
        if record is None and evaluation.error is None:
            moment = now_iso()
            record = {'id': new_id(), 'form': 'proof', 'endpoint': price.endpoint, 'chain_id': self.settings.chain_id,
                      'asset': self.onchain.usdc, 'payer': evaluation.payer, 'amount': evaluation.amount,
                      'tx_hash': evaluation.tx_hash, 'status': 'confirmed', 'call_digest': digest,
                      'created_at': moment}
            try:
                with db.transaction():
                    db.insert('used_payments', {'chain_id': self.settings.chain_id, 'tx_hash': record['tx_hash'],
                                                'purpose': 'x402', 'created_at': moment})
                    db.insert('x402_payments', record)
                return record
            except apsw.ConstraintError:        # taken at the same moment, for this call or another
                record = self.accepted(db, evaluation)
                if record is None:
                    raise self.refusal(price, 'This transaction has paid for something already.',
                                       'payment_replayed') from None
                self.require_same_call(price, evaluation, record, digest)
        if record is None:
            raise self.refuse(price, evaluation)
        self.refuse_but(price, evaluation, allowed)
        return record

    def settlement(self, db, evaluation, price, mark, digest):
        """The confirmed settlement of a form-2 payment not yet answered: made now (stored with the call's
        `digest`), or, when the same call sends the same payment again (after a 503, a 4xx or a time-out), the one
        made then."""
        record = evaluation.payer and self.authorization_record(db, evaluation.payer, evaluation.nonce)
        # The same authorization again: only what its own settlement changed may fail now.
        again = record is not None and record['tx_hash'] is not None and record['granted_at'] is None and \
            set(evaluation.checks.errors) <= {'fresh', 'notReplayed', 'balance', 'settles'}
        if again and record['status'] == 'failed':
            raise self.refusal(price, f'The settlement {record["tx_hash"]} reverted on chain: nothing was paid.',
                               'payment_reverted')
        if not again:
            if record is not None:      # reserved by another call since it was checked: a replay (not a revert)
                evaluation.checks.fail('notReplayed', VerificationError('This authorization has been used already.',
                                                                        'payment_replayed'))
            self.covered(db, evaluation, mark)      # once more: one reserved since may be why the simulation reverted
            if evaluation.error is None and self.facilitator:
                self.facilitator_verdict(evaluation, price)
            if evaluation.error:
                raise self.refuse(price, evaluation)
            record = self.settle_by_facilitator(db, evaluation, price, digest) if self.facilitator else \
                self.relay(db, evaluation, price, mark, digest)
        if record['status'] == 'pending':
            record = self.await_settlement(db, record, price)
        return record

    def new_record(self, evaluation, price, digest, **fields):
        return dict({'id': new_id(), 'form': 'authorization', 'endpoint': price.endpoint,
                     'chain_id': self.settings.chain_id, 'asset': self.onchain.usdc, 'payer': evaluation.payer,
                     'amount': evaluation.amount, 'authorization_nonce': evaluation.nonce, 'status': 'pending',
                     'call_digest': digest, 'created_at': now_iso()}, **fields)

    def reserve(self, db, record, price, sign=None, covered=None):
        """Store a settlement (its authorization can be reserved once), signing it inside the transaction, after
        `covered` (run in it too) found the payer's balance still covers it."""
        try:
            with db.transaction():
                if covered:
                    covered()
                if sign:
                    record['raw_tx'], record['tx_hash'], record['nonce'] = sign()
                    db.insert('used_payments', {'chain_id': record['chain_id'], 'tx_hash': record['tx_hash'],
                                                'purpose': 'x402', 'account_id': None, 'job_id': None,
                                                'created_at': record['created_at']})
                db.insert('x402_payments', record)
        except apsw.ConstraintError:        # reserved at the same moment by another call (or this one)
            taken = self.authorization_record(db, record['payer'], record['authorization_nonce'])
            raise self.refusal(price, 'This authorization has been used already.', 'payment_replayed',
                               spent=bool(taken and taken['granted_at'])) from None

    def relay(self, db, evaluation, price, mark, digest):
        """Settle with the escrow wallet as relayer: signed and stored (await_settlement sends it), if in that
        transaction the payer's balance still covers it. Requests racing each other may all have read the same
        balance; one transaction at a time, each finds what the others reserved."""
        def covered():
            if not self.covered(db, evaluation, mark):
                raise self.refuse(price, evaluation)
        record = self.new_record(evaluation, price, digest)
        self.reserve(db, record, price, sign=lambda: self.onchain.sign_settlement(db, evaluation.payment),
                     covered=covered)
        return record

    def settle_by_facilitator(self, db, evaluation, price, digest):
        """Settle through the facilitator's /settle. The authorization is reserved while it runs; if the
        facilitator refuses or does not answer, the reservation goes, so that the payment can be tried again."""
        record = self.new_record(evaluation, price, digest)
        self.reserve(db, record, price)
        try:
            result = self.facilitator_call('settle', evaluation, price)
            tx_hash = str(result.get('transaction') or '').lower()
            if result.get('success') is not True or not re.fullmatch(r'0x[0-9a-f]{64}', tx_hash):
                reason = str(result.get('errorReason') or 'unknown')
                code, _ = FACILITATOR_REASONS.get(reason, ('payment_invalid', None))
                raise self.refusal(price, str(result.get('errorMessage') or
                                              f'The facilitator could not settle the payment: {reason}.'), code)
        except BaseException:
            with db.transaction():
                db.execute('DELETE FROM x402_payments WHERE id = :id', {'id': record['id']})
            raise
        with db.transaction():
            db.execute("UPDATE x402_payments SET status = 'confirmed', tx_hash = :tx WHERE id = :id",
                       {'tx': tx_hash, 'id': record['id']})
            db.execute('''INSERT INTO used_payments (chain_id, tx_hash, purpose, created_at)
                          VALUES (:chain, :tx, 'x402', :now) ON CONFLICT DO NOTHING''',
                       {'chain': record['chain_id'], 'tx': tx_hash, 'now': now_iso()})
        return dict(record, status='confirmed', tx_hash=tx_hash)

    def await_settlement(self, db, record, price):
        """Send the relayer's settlement if it is not yet (with anything older waiting: nonces go in order; also
        after a crash), and wait for it to be mined: confirmed if it moved the money, else 402."""
        from verifier.checks import check_usdc_transfer
        if record.get('broadcast_at') is None:
            self.onchain.broadcast(db)
        try:
            receipt = self.onchain.wait_for_receipt(db, 'x402_payments', record, SETTLEMENT_WAIT)
        except ChainUnavailable:
            raise self.refusal(price, f'The payment is being settled on chain ({record["tx_hash"]}); send the '
                                      'same payment header again in a few seconds.', 'chain_unavailable') from None
        try:
            check_usdc_transfer(receipt, token=self.onchain.usdc, recipient=self.pay_to,
                                min_amount=record['amount'], payer=record['payer'])
            status = 'confirmed'
        except VerificationError:
            status = 'failed'
        mined = receipt['transactionHash'].lower()      # the first signature or a re-priced one: same nonce
        with db.transaction():
            db.execute('''UPDATE x402_payments SET status = :status, tx_hash = :mined
                          WHERE id = :id AND status = 'pending' ''',
                       {'status': status, 'mined': mined, 'id': record['id']})
        if status == 'failed':
            raise self.refusal(price, f'The settlement {mined} reverted on chain: nothing was paid.',
                               'payment_reverted')
        return dict(record, status=status, tx_hash=mined)


def wallet_account(db, address):
    """The account a wallet's keyless paid calls act as, made when its first payment is accepted, in a transaction
    of its own: it stays whatever that call answers, so the account a client is told (fundingTypedData) is the
    same on every try."""
    query = '''SELECT a.id, a.name, a.role FROM wallet_accounts w JOIN accounts a ON a.id = w.account_id
               WHERE w.address = :address'''
    account = db.row(query, {'address': address})
    if account is None:
        with db.transaction():
            account = db.row(query, {'address': address})     # made meanwhile by another call
            if account is None:
                account = {'id': new_id(), 'name': f'wallet {address}', 'role': 'member'}
                db.insert('accounts', dict(account, created_at=now_iso()))
                db.insert('wallet_accounts', {'address': address, 'account_id': account['id'],
                                              'created_at': now_iso()})
    return account


@route('GET', '/api/x402', limit=None)
def get_x402():
    """What x402 prices here, a discovery document: not rate limited, cacheable for a minute (ETag)."""
    return cacheable(x402_terms(), 60)


def x402_terms():
    svc = service()
    x402 = svc.x402
    if x402 is None:
        return {'x402Version': 1, 'enabled': False, 'endpoints': []}
    base = svc.settings.base_url
    return {'x402Version': 1, 'x402Versions': [1, 2], 'enabled': True, 'network': x402.network,
            'networkV2': x402.network_v2, 'chainId': svc.settings.chain_id, 'asset': x402.onchain.usdc,
            'payTo': x402.pay_to, 'settlement': 'facilitator' if x402.facilitator else 'relayer',
            'endpoints': [{'method': price.method, 'path': openapi_path(price.rule), 'price': price.usdc,
                           'currency': 'USDC', 'maxAmountRequired': str(price.amount),
                           'networks': [x402.network, x402.network_v2],
                           'accepts': [x402.requirements(price, base + openapi_path(price.rule))],
                           'acceptsV2': [x402.requirements_v2(price)]}
                          for price in x402.prices.values()]}


@route('POST', '/api/x402', limit='read')
def post_x402():
    """Check a payment (X-PAYMENT or PAYMENT-SIGNATURE) against a priced endpoint without taking it."""
    svc = service()
    x402 = svc.x402
    if x402 is None:
        raise NotFound('No endpoint is priced: x402 is off on this marketplace.', code='not_priced')
    endpoint = request.query.get('endpoint')
    if endpoint:
        price = x402.prices.get(route_of(endpoint))
        if price is None:
            raise NotFound(f'{endpoint} is not priced; GET /api/x402 lists the priced endpoints.', code='not_priced')
        path = endpoint.strip().partition(' ')[2].strip()       # a proof's signature is checked for this path
    else:
        price = next(iter(x402.prices.values()))
        path = openapi_path(price.rule)
    header, x402_version = x402.payment_header()
    if not header:
        raise BadRequest('Send the payment to check as the X-PAYMENT (x402 v1) or PAYMENT-SIGNATURE (v2) header '
                         '(base64 of its JSON).', code='payment_invalid')
    evaluation = x402.evaluate(svc.db, header, price, x402_version=x402_version, path=path)
    if x402.facilitator and evaluation.form == 'authorization' and evaluation.error is None:
        x402.facilitator_verdict(evaluation, price)
    answer = {'valid': evaluation.valid, 'checks': evaluation.checks.as_dict(), 'endpoint': price.endpoint,
              'form': evaluation.form}
    if evaluation.error:
        answer.update(error=evaluation.error.message, code=evaluation.error.code)
    return answer
