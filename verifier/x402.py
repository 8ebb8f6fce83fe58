"""x402 payments, version 1 and version 2: the payment headers, the two payload forms, and the EIP-3009 "exact"
scheme.

Pure but for eth-account (EIP-712 signer recovery, the signed settlement transaction): no web3. What is on
chain is asked of a verifier.chain.Chain handed in. `evaluate_payment` runs every check of a payment and
records each result (POST /api/x402 shows them; a priced call refuses with the first failure).

`payment` is the decoded payment header's object. Version 1 (X-PAYMENT): {x402Version: 1, scheme: 'exact',
network ('base'), payload}. Version 2 (PAYMENT-SIGNATURE): {x402Version: 2, accepted: the requirements it pays
({scheme, network ('eip155:8453', CAIP-2), amount, asset, payTo, ...}), payload, resource?, extensions?}. A
version is only a wire format: both are checked by the same functions. `payload` is either a proof of a transfer
already made (form 1: {txHash, from, amount, to, chainId, tokenAddress, timestamp, signature}) or an EIP-3009
authorization (form 2: {signature, authorization: {from, to, value, validAfter, validBefore, nonce}}). Amounts
are integers in USDC base units; addresses are compared checksummed.

A transaction hash is public, so a form-1 proof also carries `signature` (CONTRACT.md 20): an EIP-712 signature
by the transfer's sender, in the funding domain of verifier.funding, of PaymentProof(bytes32 txHash,string
method,string path) for the call it pays (the path without its query string). Told apart from form 2 by the
`authorization` object, which a proof never has.
"""

import base64
import binascii
import json
import re
import sys
from dataclasses import dataclass

_recursion_limit = sys.getrecursionlimit()
from eth_account import Account  # noqa: E402
from eth_account.messages import encode_typed_data  # noqa: E402
sys.setrecursionlimit(_recursion_limit)     # importing eth_account raises it to 100000: deep input could then crash us

from verifier.checks import Checks, checksummed  # noqa: E402
from verifier.errors import VerificationError  # noqa: E402
from verifier.funding import DOMAIN_NAME, DOMAIN_VERSION, FUNDING_TYPES  # noqa: E402

# network -> (chain id, EIP-712 domain name, version) of its USDC, as x402 clients sign them
NETWORKS = {'base': (8453, 'USD Coin', '2'), 'base-sepolia': (84532, 'USDC', '2')}
# network (version 1's name) -> its CAIP-2 name, as version 2 writes it
CAIP2_NETWORKS = {'base': 'eip155:8453', 'base-sepolia': 'eip155:84532'}
PAYMENT_HEADERS = {1: 'X-PAYMENT', 2: 'PAYMENT-SIGNATURE'}           # x402Version -> the header that carries it
RESPONSE_HEADERS = {1: 'X-PAYMENT-RESPONSE', 2: 'PAYMENT-RESPONSE'}
USDC_DECIMALS = 6
# transferWithAuthorization(address,address,uint256,uint256,uint256,bytes32,uint8,bytes32,bytes32)
TRANSFER_WITH_AUTHORIZATION = '0xe3ee160e'
SETTLEMENT_GAS = 120_000
AUTHORIZATION_TYPES = {'TransferWithAuthorization': [
    {'name': 'from', 'type': 'address'}, {'name': 'to', 'type': 'address'}, {'name': 'value', 'type': 'uint256'},
    {'name': 'validAfter', 'type': 'uint256'}, {'name': 'validBefore', 'type': 'uint256'},
    {'name': 'nonce', 'type': 'bytes32'}]}
# what the sender of a form-1 proof's transfer signs: the call it pays, in the funding domain (verifier.funding)
PROOF_TYPES = {'EIP712Domain': FUNDING_TYPES['EIP712Domain'],
               'PaymentProof': [{'name': 'txHash', 'type': 'bytes32'}, {'name': 'method', 'type': 'string'},
                                {'name': 'path', 'type': 'string'}]}
MAX_HEADER = 16_384
UINT256_MAX = 2**256 - 1
HALF_CURVE_ORDER = 0x7fffffffffffffffffffffffffffffff5d576e7357a4501ddfe92f46681b20a0   # EIP-2: s above is refused

_BASE64 = re.compile(r'[A-Za-z0-9+/_-]+={0,2}')
_HASH = re.compile(r'0x[0-9a-fA-F]{64}')
_SIGNATURE = re.compile(r'0x[0-9a-fA-F]{130}')
_UINT = re.compile(r'[0-9]{1,78}')
_USDC_AMOUNT = re.compile(r'([0-9]{1,60})(?:\.([0-9]{1,6}))?')


def _invalid(message):
    return VerificationError(message, 'payment_invalid')


# ----- the headers -----

def decode_payment_header(header, name='X-PAYMENT'):
    """A payment header `name` (base64, standard or URL-safe, padding optional, of a JSON object) as a dict."""
    if not isinstance(header, str) or len(header) > MAX_HEADER or not _BASE64.fullmatch(header.strip()):
        raise _invalid(f'{name} is not base64.')
    text = header.strip().rstrip('=').replace('-', '+').replace('_', '/')
    try:
        payment = json.loads(base64.b64decode(text + '=' * (-len(text) % 4), validate=True).decode('utf-8'))
    except (ValueError, binascii.Error, RecursionError):
        raise _invalid(f'{name} is not base64 of a JSON object.') from None
    if not isinstance(payment, dict):
        raise _invalid(f'{name} is not base64 of a JSON object.')
    return payment


def encode_header(value):
    """A dict as an x402 header value (PAYMENT-REQUIRED, X-PAYMENT-RESPONSE, PAYMENT-RESPONSE): standard base64 of
    its JSON, as the x402 SDK reads them."""
    return base64.b64encode(json.dumps(value, separators=(',', ':')).encode('utf-8')).decode('ascii')


def network_name(chain_id, x402_version):
    """The network of `chain_id` as x402 version 1 ('base') or 2 ('eip155:8453', CAIP-2) names it; None for a
    chain x402 is not offered on."""
    name = next((name for name, (chain, _, _) in NETWORKS.items() if chain == int(chain_id)), None)
    return CAIP2_NETWORKS.get(name) if x402_version == 2 else name


def requirements_v2(*, chain_id, token, pay_to, amount, max_timeout_seconds, name, version):
    """x402 version 2's PaymentRequirements of a price of `amount` base units of `token` to `pay_to`."""
    return {'scheme': 'exact', 'network': network_name(chain_id, 2), 'amount': str(amount), 'asset': token,
            'payTo': pay_to, 'maxTimeoutSeconds': max_timeout_seconds, 'extra': {'name': name, 'version': version}}


# ----- checking a payment -----

# The checks of each form, in the order their failures are reported (CONTRACT.md 7: POST /api/x402's `checks`).
# chainId, token, recipient and amount of a proof compare its claims and, on chain, the transaction itself.
# A proof's `signature` (the sender's PaymentProof) is checked when the call it pays is known (evaluate_payment's
# `escrow`, `method` and `path`).
PROOF_CHECKS = ('decoded', 'version', 'scheme', 'network', 'chainId', 'token', 'recipient', 'payer', 'amount',
                'found', 'succeeded', 'confirmations', 'fresh', 'notReplayed', 'signature')
AUTHORIZATION_CHECKS = ('decoded', 'version', 'scheme', 'network', 'signature', 'recipient', 'amount', 'fresh',
                        'notReplayed', 'balance')
ON_CHAIN_ONLY = ('payer', 'found', 'succeeded', 'confirmations', 'balance')     # left out without a node


def check_names(form, x402_version, on_chain=True, signed_call=True):
    """The checks of a payment of this form and version, in order: version 2 adds `accepted` (the requirements
    it names are those offered) after `network`; without a node, those of ON_CHAIN_ONLY are left out, and a
    proof's `signature` without a call to check it for (`signed_call` false)."""
    names = [name for name in (PROOF_CHECKS if form == 'proof' else AUTHORIZATION_CHECKS)
             if (on_chain or name not in ON_CHAIN_ONLY) and (signed_call or form != 'proof' or name != 'signature')]
    if x402_version == 2:
        names.insert(names.index('network') + 1, 'accepted')
    return names


@dataclass
class Evaluation:
    """What checking a payment found: its form ('proof', 'authorization' or None when it does not decode), every
    check's result and the first failure (`error`), and what it pays with. Amounts are base units."""

    form: object
    checks: Checks
    payment: object = None          # the decoded payment header's object
    x402_version: int = 1           # the version of the header it came in: 1 (X-PAYMENT) or 2 (PAYMENT-SIGNATURE)
    payer: object = None
    amount: object = None           # form 1: moved on chain (claimed, without a node); form 2: authorized
    tx_hash: object = None          # form 1, lowercase
    nonce: object = None            # form 2, lowercase
    balance: object = None          # form 2, with a node: the payer's USDC when it was read

    @property
    def error(self):
        return self.checks.error

    @property
    def valid(self):
        return all(self.checks.as_dict().values())


def _expect(condition, message, code):
    if not condition:
        raise VerificationError(message, code)


def _payload_form(payment, x402_version):
    """'proof' (form 1) or 'authorization' (form 2), told apart by the payload's keys; in version 2 the payment
    must also name the requirements it pays (`accepted`)."""
    if x402_version == 2 and not isinstance(payment.get('accepted'), dict):
        raise _invalid('The payment has no `accepted` object (the one of `accepts` it pays, x402 version 2).')
    payload = payment.get('payload')
    if not isinstance(payload, dict):
        raise _invalid('The payment has no payload object.')
    if 'txHash' in payload and 'authorization' not in payload:
        return 'proof'
    if 'signature' in payload and 'authorization' in payload and 'txHash' not in payload:
        return 'authorization'
    raise _invalid('The payload is neither a proof (txHash) nor an authorization (signature, authorization).')


def _terms(payment, x402_version):
    """Where a payment names its scheme and network: at its top (version 1) or in `accepted` (version 2)."""
    return payment['accepted'] if x402_version == 2 else payment


def _check_version(payment, x402_version):
    version = payment.get('x402Version')
    _expect(type(version) is int and version == x402_version,
            f'x402Version is {version!r}; {PAYMENT_HEADERS[x402_version]} carries version {x402_version}.',
            'payment_invalid')


def _check_scheme(terms):
    _expect(terms.get('scheme') == 'exact', f'The scheme is {terms.get("scheme")!r}; only "exact" is supported.',
            'payment_invalid')


def _check_network(terms, chain_id, x402_version):
    network = terms.get('network')
    if not isinstance(network, str):
        raise _invalid('The network is missing.')
    _expect(network == network_name(chain_id, x402_version),
            f'The payment is for network {network!r}, not for chain {chain_id}.', 'payment_wrong_chain')


def _same_address(address, other):
    return isinstance(address, str) and address.lower() == other.lower()


def _check_accepted(accepted, offered):
    """Version 2: the requirements a payment names (`accepted`) must be one offered, in scheme, network, amount,
    asset and payTo."""
    differ = [key for key in ('scheme', 'network', 'amount') if accepted.get(key) != offered[key]] + \
             [key for key in ('asset', 'payTo') if not _same_address(accepted.get(key), offered[key])]
    _expect(not differ, f'`accepted` is not one of the requirements offered: its {", ".join(differ)} differ from '
            f'those of `accepts` (the PAYMENT-REQUIRED header of the 402).', 'payment_requirements_mismatch')


def evaluate_payment(payment, *, chain_id, token, pay_to, min_amount, now, chain=None, confirmations=1,
                     max_age_seconds=None, tx_used=None, authorization_used=None, name=None, version=None,
                     settle_within=0, x402_version=1, escrow=None, method=None, path=None):
    """Check a payment (the header's text, or the object it decodes to) of x402 version `x402_version` (that of
    the header it came in) against what is asked: `min_amount` USDC base units of `token` to `pay_to` on
    `chain_id`, at `now` (unix seconds). Both versions go through the same checks; version 2's `accepted` must
    also be the requirements offered. Every check of its form runs and is recorded (a node that does not answer
    raises ChainUnavailable). `chain` (a verifier.chain.Chain) is asked what is on chain; without it those
    checks are left out. `tx_used(tx_hash)` and `authorization_used(payer, nonce)` say whether the service has
    taken a proof already. The EIP-712 domain's name and version default to those of the network's USDC
    (NETWORKS). An authorization must stay valid `settle_within` seconds more, to be settled before it expires.
    A proof's `signature` must be its sender's PaymentProof of the call `method` `path` (no query string) in the
    funding domain of `escrow`; without `escrow` that check is left out."""
    if x402_version not in PAYMENT_HEADERS:
        raise ValueError(f'x402 version {x402_version!r}: only 1 and 2 exist')
    try:
        if isinstance(payment, str):
            payment = decode_payment_header(payment, PAYMENT_HEADERS[x402_version])
        if not isinstance(payment, dict):
            raise _invalid('The payment is not a JSON object.')
        form = _payload_form(payment, x402_version)
    except VerificationError as error:
        checks = Checks(('decoded',))
        checks.fail('decoded', error)
        return Evaluation(None, checks, x402_version=x402_version)
    names = check_names(form, x402_version, on_chain=chain is not None, signed_call=escrow is not None)
    checks = Checks(names)
    checks.passed('decoded')
    terms = _terms(payment, x402_version)
    checks.run('version', _check_version, payment, x402_version)
    checks.run('scheme', _check_scheme, terms)
    checks.run('network', _check_network, terms, chain_id, x402_version)
    if x402_version == 2:
        offered = {'scheme': 'exact', 'network': network_name(chain_id, 2), 'amount': str(min_amount), 'asset': token,
                   'payTo': pay_to}
        checks.run('accepted', _check_accepted, terms, offered)
    evaluation = Evaluation(form, checks, payment, x402_version)
    later = names[names.index('accepted' if x402_version == 2 else 'network') + 1:]
    try:
        if form == 'proof':
            _evaluate_proof(evaluation, chain=chain, chain_id=chain_id, token=token, pay_to=pay_to,
                            min_amount=min_amount, now=now, confirmations=confirmations,
                            max_age_seconds=max_age_seconds, tx_used=tx_used,
                            call=(escrow, method, path) if escrow is not None else None)
        else:
            _evaluate_authorization(evaluation, chain=chain, chain_id=chain_id, token=token, pay_to=pay_to,
                                    min_amount=min_amount, now=now, authorization_used=authorization_used,
                                    name=name, version=version, settle_within=settle_within)
    except _Undecodable as undecodable:
        checks.fail('decoded', undecodable.error)
        checks.skip(*later)
    return evaluation


class _Undecodable(Exception):
    """A field of the payload is malformed: nothing after decoding can be checked."""

    def __init__(self, error):
        super().__init__(error.message)
        self.error = error


def _uint(value, what):
    """A uint256 from an int or a decimal string."""
    if type(value) is int or (isinstance(value, str) and _UINT.fullmatch(value)):
        number = int(value)
        if 0 <= number <= UINT256_MAX:
            return number
    raise _invalid(f'{what} is not a whole number (an integer or a decimal string).')


def usdc_base_units(amount):
    """A decimal USDC amount ("0.01") in base units (10000)."""
    found = _USDC_AMOUNT.fullmatch(amount) if isinstance(amount, str) else None
    if not found:
        raise _invalid(f'The amount {amount!r} is not a decimal USDC amount with at most {USDC_DECIMALS} places.')
    whole, fraction = found.groups()
    return int(whole) * 10**USDC_DECIMALS + int((fraction or '').ljust(USDC_DECIMALS, '0'))


# ----- form 1: a proof of a transfer already made -----

@dataclass(frozen=True)
class ProofClaims:
    """What a form-1 payload claims (to compare with the chain, never to trust): normalised."""

    tx_hash: str        # lowercase
    payer: str
    recipient: str
    amount: int
    chain_id: int
    token: str
    timestamp: int


def proof_claims(payload):
    """A form-1 payload's claims, normalised; payment_invalid if one is malformed."""
    tx_hash = payload.get('txHash')
    if not isinstance(tx_hash, str) or not _HASH.fullmatch(tx_hash):
        raise _invalid('payload.txHash is not 0x followed by 64 hexadecimal digits.')
    return ProofClaims(tx_hash.lower(), checksummed(payload.get('from'), 'payer (payload.from)'),
                       checksummed(payload.get('to'), 'recipient (payload.to)'),
                       usdc_base_units(payload.get('amount')), _uint(payload.get('chainId'), 'payload.chainId'),
                       checksummed(payload.get('tokenAddress'), 'token (payload.tokenAddress)'),
                       _uint(payload.get('timestamp'), 'payload.timestamp'))


def _evaluate_proof(evaluation, *, chain, chain_id, token, pay_to, min_amount, now, confirmations,
                    max_age_seconds, tx_used, call):
    checks = evaluation.checks
    try:
        claims = proof_claims(evaluation.payment['payload'])
    except VerificationError as error:
        raise _Undecodable(error) from None
    token, pay_to = checksummed(token, 'token address'), checksummed(pay_to, 'payTo')
    evaluation.payer, evaluation.amount, evaluation.tx_hash = claims.payer, claims.amount, claims.tx_hash
    checks.run('chainId', _expect, claims.chain_id == int(chain_id),
               f'The payment claims chain {claims.chain_id}, not chain {chain_id}.', 'payment_wrong_chain')
    checks.run('token', _expect, claims.token == token, f'The payment claims token {claims.token}, not USDC at '
               f'{token}.', 'payment_wrong_token')
    checks.run('recipient', _expect, claims.recipient == pay_to,
               f'The payment claims to pay {claims.recipient}, not {pay_to}.', 'payment_wrong_recipient')
    checks.run('amount', _expect, claims.amount >= min_amount,
               f'The payment claims {claims.amount} base units; at least {min_amount} are needed.',
               'payment_insufficient')
    if chain is not None:       # the claims are compared with the transaction itself
        transfer = chain.check_transfer(checks, claims.tx_hash, chain_id=chain_id, token=token, recipient=pay_to,
                                        min_amount=min_amount, payer=claims.payer, confirmations=confirmations,
                                        max_age_seconds=max_age_seconds, now=now)
        evaluation.amount = transfer.amount if transfer else None
    checks.run('notReplayed', _expect, not (tx_used and tx_used(claims.tx_hash)),
               'This transaction has paid for something already.', 'payment_replayed')
    if call is not None:
        escrow, method, path = call
        checks.run('signature', check_proof_signature, evaluation.payment['payload'].get('signature'),
                   payer=claims.payer, tx_hash=claims.tx_hash, method=method, path=path, chain_id=chain_id,
                   escrow=escrow)


def proof_typed_data(*, tx_hash, method, path, chain_id, escrow):
    """The EIP-712 typed data the sender of a form-1 proof's transfer signs for the call `method` `path` (JSON-able,
    as eth_signTypedData_v4 and eth-account's `full_message` take it); `tx_hash` None leaves it null for the
    client to fill in."""
    return {'domain': {'name': DOMAIN_NAME, 'version': DOMAIN_VERSION, 'chainId': int(chain_id),
                       'verifyingContract': checksummed(escrow, 'escrow address')},
            'types': {name: [dict(field) for field in fields] for name, fields in PROOF_TYPES.items()},
            'primaryType': 'PaymentProof',
            'message': {'txHash': tx_hash.lower() if tx_hash else None, 'method': method, 'path': path}}


def check_proof_signature(signature, *, payer, tx_hash, method, path, chain_id, escrow):
    """The signer of a proof's PaymentProof (checksummed), which must be `payer`, the transfer's sender; every
    failure is payment_signature_invalid."""
    if signature is None:
        raise VerificationError('The proof has no `signature`: its transfer\'s sender signs PaymentProof(bytes32 '
                                'txHash,string method,string path) for this call (see proofTypedData).',
                                'payment_signature_invalid')
    raw = _signature_bytes(signature)
    if not isinstance(method, str) or not isinstance(path, str):
        raise VerificationError('There is no call to check the proof\'s signature for.', 'payment_signature_invalid')
    try:
        typed_data = proof_typed_data(tx_hash=tx_hash, method=method, path=path, chain_id=chain_id, escrow=escrow)
        signer = Account.recover_message(encode_typed_data(full_message=typed_data), signature=raw)
    except Exception:       # eth_keys' BadSignature, ValueError: a signature that recovers to no one
        raise VerificationError('The proof\'s signature recovers to no address.', 'payment_signature_invalid') \
            from None
    payer = checksummed(payer, 'payer')
    _expect(checksummed(signer, 'signer') == payer, f'The proof is not signed by {payer}, the sender of its transfer '
            f'(or it signs another transaction, call ({method} {path}), chain or domain).', 'payment_signature_invalid')
    return signer


# ----- form 2: an EIP-3009 authorization (the x402 "exact" EVM scheme) -----

def _authorization_fields(authorization):
    """An authorization's fields but the signature, normalised; payment_invalid if one is malformed."""
    if not isinstance(authorization, dict):
        raise _invalid('The payload has no authorization object.')
    nonce = authorization.get('nonce')
    if not isinstance(nonce, str) or not _HASH.fullmatch(nonce):
        raise _invalid('authorization.nonce is not 32 bytes as 0x followed by 64 hexadecimal digits.')
    return {'from': checksummed(authorization.get('from'), 'payer (authorization.from)'),
            'to': checksummed(authorization.get('to'), 'recipient (authorization.to)'),
            'value': _uint(authorization.get('value'), 'authorization.value'),
            'validAfter': _uint(authorization.get('validAfter'), 'authorization.validAfter'),
            'validBefore': _uint(authorization.get('validBefore'), 'authorization.validBefore'),
            'nonce': nonce.lower()}


def parse_authorization(payment):
    """A form-2 payload's fields, normalised: {from, to (checksummed), value, validAfter, validBefore (ints),
    nonce (lowercase 0x + 64 hex), signature (65 bytes)}; payment_invalid if one is malformed."""
    payload = payment.get('payload') if isinstance(payment, dict) else None
    fields = _authorization_fields(payload.get('authorization') if isinstance(payload, dict) else None)
    return dict(fields, signature=_signature_bytes(payload.get('signature')))


def _signature_bytes(signature):
    """65 bytes r || s || v with v 27 or 28 (0 and 1 are read as 27 and 28) and a low s, as USDC takes them."""
    if not isinstance(signature, str) or not _SIGNATURE.fullmatch(signature):
        raise VerificationError('The signature is not 65 bytes as 0x followed by 130 hexadecimal digits.',
                                'payment_signature_invalid')
    raw = bytes.fromhex(signature[2:])
    v = raw[64] + 27 if raw[64] in (0, 1) else raw[64]
    if v not in (27, 28) or int.from_bytes(raw[32:64], 'big') > HALF_CURVE_ORDER:
        raise VerificationError('The signature is malformed (v must be 27 or 28, s in the lower half).',
                                'payment_signature_invalid')
    return raw[:64] + bytes([v])


def recover_authorization_signer(authorization, signature, *, chain_id, token, name, version):
    """The address that signed this EIP-712 TransferWithAuthorization for the token's domain."""
    fields = parse_authorization({'payload': {'authorization': authorization, 'signature': signature}})
    message = {'from': fields['from'], 'to': fields['to'], 'value': fields['value'],
               'validAfter': fields['validAfter'], 'validBefore': fields['validBefore'],
               'nonce': bytes.fromhex(fields['nonce'][2:])}
    try:
        signable = encode_typed_data(
            domain_data={'name': name, 'version': version, 'chainId': int(chain_id),
                         'verifyingContract': checksummed(token, 'token address')},
            message_types=AUTHORIZATION_TYPES, message_data=message)
        return Account.recover_message(signable, signature=fields['signature'])
    except VerificationError:
        raise
    except Exception:       # eth_keys' BadSignature, ValueError: a signature that recovers to no one
        raise VerificationError('The signature recovers to no address.', 'payment_signature_invalid') from None


def _check_signer(payload, payer, **domain):
    signer = recover_authorization_signer(payload['authorization'], payload.get('signature'), **domain)
    _expect(signer == payer, f'The authorization is signed by {signer}, not by {payer} (or for another token, '
            'chain or amount).', 'payment_signature_invalid')


def _evaluate_authorization(evaluation, *, chain, chain_id, token, pay_to, min_amount, now, authorization_used,
                            name, version, settle_within):
    checks, payload = evaluation.checks, evaluation.payment['payload']
    try:
        fields = _authorization_fields(payload['authorization'])
    except VerificationError as error:
        raise _Undecodable(error) from None
    token, pay_to = checksummed(token, 'token address'), checksummed(pay_to, 'payTo')
    evaluation.payer, evaluation.amount, evaluation.nonce = fields['from'], fields['value'], fields['nonce']
    _, default_name, default_version = next((n for n in NETWORKS.values() if n[0] == int(chain_id)), (0, None, None))
    checks.run('signature', _check_signer, payload, fields['from'], chain_id=chain_id, token=token,
               name=name or default_name, version=version or default_version)
    checks.run('recipient', _expect, fields['to'] == pay_to, f'The authorization pays {fields["to"]}, not {pay_to}.',
               'payment_wrong_recipient')
    checks.run('amount', _expect, fields['value'] >= min_amount, f'The authorization is for {fields["value"]} base '
               f'units; at least {min_amount} are needed.', 'payment_insufficient')
    checks.run('fresh', _expect, fields['validAfter'] < now < fields['validBefore'] - settle_within,
               f'The authorization is valid only after {fields["validAfter"]} and before {fields["validBefore"]}; '
               f'it is {int(now)}' + (f', and settling it may take {settle_within} seconds.' if settle_within else '.'),
               'payment_expired')
    used = bool(authorization_used and authorization_used(fields['from'], fields['nonce']))
    if not used and chain is not None:
        used = chain.authorization_used(token, fields['from'], fields['nonce'])
    checks.run('notReplayed', _expect, not used, 'This authorization has been used already.', 'payment_replayed')
    if chain is not None:
        balance = evaluation.balance = chain.token_balance(token, fields['from'])
        checks.run('balance', _expect, balance >= fields['value'], f'The payer holds {balance} base units of USDC; '
                   f'the authorization moves {fields["value"]}.', 'payment_insufficient')


def _word(value):
    return format(value, '064x')


def settlement_data(payment):
    """The calldata that settles a form-2 payment: transferWithAuthorization(from, to, value, validAfter,
    validBefore, nonce, v, r, s) as 0x hex."""
    fields = parse_authorization(payment)
    signature = fields['signature']
    return (TRANSFER_WITH_AUTHORIZATION + _word(int(fields['from'], 16)) + _word(int(fields['to'], 16))
            + _word(fields['value']) + _word(fields['validAfter']) + _word(fields['validBefore'])
            + fields['nonce'][2:] + _word(signature[64]) + signature[:32].hex() + signature[32:64].hex())


def sign_transfer_with_authorization(relayer_key, *, token, payment, nonce, chain_id, max_fee_per_gas,
                                     max_priority_fee_per_gas, gas=SETTLEMENT_GAS):
    """The settlement of a form-2 payment, signed by the relayer (who pays the gas): an EIP-1559 call of
    transferWithAuthorization(..., v, r, s) on `token`. (raw transaction hex, transaction hash hex); nothing is sent."""
    data = settlement_data(payment)
    signed = Account.sign_transaction({
        'type': 2, 'chainId': int(chain_id), 'nonce': int(nonce), 'to': checksummed(token, 'token address'),
        'value': 0, 'data': data, 'gas': int(gas), 'maxFeePerGas': int(max_fee_per_gas),
        'maxPriorityFeePerGas': int(max_priority_fee_per_gas)}, relayer_key)
    return signed.raw_transaction.to_0x_hex(), signed.hash.to_0x_hex()
