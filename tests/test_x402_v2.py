"""x402 version 2 beside version 1 (CONTRACT.md 13, docs/x402.md "Pay per call: x402"): the wire format of version 2
read and written as the official `x402` SDK (pinned 2.25.0) reads and writes it, and checked by the same
verifier.x402.evaluate_payment as version 1; then, in-process on anvil, a PAYMENT-SIGNATURE paying with either
payload form, a replay refused, an `accepted` that was not offered refused with nothing moved, the PAYMENT-REQUIRED
header on every 402 and the facilitator spoken to in the payment's own version. The official client against the
real server: test_x402_live.py.
"""

import base64
import json
import sys
import time

import pytest

# web3 and eth_account come through chain.py, which keeps the recursion limit as it was (see there).
from chain import DEV_ADDRESSES, DEV_KEYS, OTHER_TOKEN, USDC, Account, sign_authorization, sign_proof

import marketplace as mp
import discovery
from test_cards import header
from test_x402 import BASE, MATCH_SUMMARY, PAY_TO, REQUIREMENTS, REQUIREMENTS_V2
from test_x402 import pay as transfer_to_pay_to
from test_x402_settle import (ESCROW, MATCH, MATCH_PRICE, PAYER, PAYER_KEY, SETTLED, answers, app, app_f, calls,  # noqa: F401
                              client_f, escrow_nonce, facilitator, failed_checks, only_row, start, x402_rows)
from test_x402_verifier import header_of, x_payment
from verifier.x402 import (AUTHORIZATION_CHECKS, PROOF_CHECKS, check_names, decode_payment_header, encode_header,
                           evaluate_payment, network_name)

_RECURSION_LIMIT = sys.getrecursionlimit()     # importing x402 may raise it (see chain.py): put it back
from x402 import x402ClientSync  # noqa: E402
from x402.http.utils import (decode_payment_required_header, decode_payment_response_header,  # noqa: E402
                             encode_payment_signature_header)
from x402.mechanisms.evm.exact.register import register_exact_evm_client  # noqa: E402
from x402.schemas import PaymentRequired, PaymentRequirements  # noqa: E402
sys.setrecursionlimit(_RECURSION_LIMIT)

NOW = 1_800_000_000
RESOURCE = {'url': BASE + '/api/jobs/match', 'description': f'GET /api/jobs/match: {MATCH_SUMMARY}',
            'mimeType': 'application/json'}
SOMEONE = DEV_ADDRESSES[4]


def v2_payment(payload, accepted=REQUIREMENTS_V2, **fields):
    """A PAYMENT-SIGNATURE object around a payload (x402's PaymentPayload), naming `accepted`."""
    return dict({'x402Version': 2, 'accepted': accepted, 'payload': payload, 'resource': RESOURCE}, **fields)


def authorization_payload(anvil=None, key=PAYER_KEY, value=MATCH_PRICE, window=(NOW - 600, NOW + 60)):
    """An EIP-3009 payload of `value` to PAY_TO, valid on anvil's clock and the server's (or around NOW)."""
    return sign_authorization(key, PAY_TO, value, *(anvil.window() if anvil else window))


def evaluate(payment, **overrides):
    """evaluate_payment of a version 2 payment without a node, against the price of REQUIREMENTS_V2."""
    args = dict(chain_id=8453, token=USDC, pay_to=PAY_TO, min_amount=MATCH_PRICE, now=NOW, x402_version=2)
    args.update(overrides)
    return evaluate_payment(payment, **args)


def sdk_client(key=PAYER_KEY):
    return register_exact_evm_client(x402ClientSync(), Account.from_key(key))


# The wire format, without a node -------------------------------------------------------

def test_network_names_in_both_versions():
    assert [network_name(chain, version) for chain in (8453, 84532, 31337) for version in (1, 2)] == \
        ['base', 'eip155:8453', 'base-sepolia', 'eip155:84532', None, None]


def test_version_2_adds_the_accepted_check_after_network():
    assert check_names('proof', 1) == list(PROOF_CHECKS)
    assert check_names('authorization', 2) == ['decoded', 'version', 'scheme', 'network', 'accepted',
                                               *AUTHORIZATION_CHECKS[4:]]
    assert check_names('proof', 2, on_chain=False) == ['decoded', 'version', 'scheme', 'network', 'accepted',
                                                       'chainId', 'token', 'recipient', 'amount', 'fresh',
                                                       'notReplayed', 'signature']
    assert check_names('proof', 2, on_chain=False, signed_call=False)[-1] == 'notReplayed'


def test_the_sdks_client_pays_our_payment_required_and_we_read_its_payment_signature():
    required = {'x402Version': 2, 'error': 'Pay.', 'resource': RESOURCE, 'accepts': [REQUIREMENTS_V2]}
    parsed = decode_payment_required_header(encode_header(required))
    assert isinstance(parsed, PaymentRequired) and parsed.x402_version == 2
    assert parsed.accepts[0] == PaymentRequirements.model_validate(REQUIREMENTS_V2)
    assert parsed.model_dump(by_alias=True, exclude_none=True) == required       # nothing lost or renamed

    signed = encode_payment_signature_header(sdk_client().create_payment_payload(parsed))
    payment = decode_payment_header(signed, 'PAYMENT-SIGNATURE')
    assert (payment['x402Version'], payment['accepted'], payment['resource']) == (2, REQUIREMENTS_V2, RESOURCE)
    assert payment['payload']['authorization']['from'] == PAYER
    evaluation = evaluate(signed, now=int(payment['payload']['authorization']['validBefore']) - 30)
    assert (evaluation.form, evaluation.x402_version, evaluation.payer, evaluation.amount) == \
        ('authorization', 2, PAYER, MATCH_PRICE)
    assert evaluation.checks.as_dict() == dict.fromkeys(check_names('authorization', 2, on_chain=False), True)


def test_our_payment_response_is_the_sdks_settle_response():
    receipt = {'success': True, 'transaction': '0x' + 'ab' * 32, 'network': 'eip155:8453', 'payer': PAYER}
    settled = decode_payment_response_header(encode_header(receipt))
    assert (settled.success, settled.transaction, settled.network, settled.payer) == \
        (True, receipt['transaction'], 'eip155:8453', PAYER)


def test_a_version_2_proof_checks_like_a_version_1_proof():
    payload = {'txHash': '0x' + '12' * 32, 'from': PAYER, 'amount': '0.01', 'to': PAY_TO, 'chainId': 8453,
               'tokenAddress': USDC, 'timestamp': NOW}
    v2, v1 = evaluate(v2_payment(payload)), evaluate(x_payment(payload), x402_version=1)
    assert (v2.form, v2.payer, v2.amount, v2.tx_hash) == (v1.form, v1.payer, v1.amount, v1.tx_hash)
    assert v2.checks.as_dict() == dict(v1.checks.as_dict(), accepted=True) and v2.error is None
    wrong = evaluate(v2_payment(dict(payload, to=SOMEONE)))
    assert (wrong.error.code, wrong.checks.as_dict()) == \
        ('payment_wrong_recipient', dict(v2.checks.as_dict(), recipient=False))


@pytest.mark.parametrize('change, code, failed', [
    ({'amount': '1'}, 'payment_requirements_mismatch', 'accepted'),
    ({'amount': '10001'}, 'payment_requirements_mismatch', 'accepted'),
    ({'amount': 10000}, 'payment_requirements_mismatch', 'accepted'),              # a string, as offered
    ({'payTo': SOMEONE}, 'payment_requirements_mismatch', 'accepted'),
    ({'asset': OTHER_TOKEN}, 'payment_requirements_mismatch', 'accepted'),
    ({'network': 'eip155:84532'}, 'payment_wrong_chain', 'network'),
    ({'network': 'base'}, 'payment_wrong_chain', 'network'),                        # version 1's name
    ({'scheme': 'upto'}, 'payment_invalid', 'scheme'),
])
def test_accepted_must_be_the_offer(change, code, failed):
    evaluation = evaluate(v2_payment(authorization_payload(), dict(REQUIREMENTS_V2, **change)))
    assert (evaluation.error.code, failed_checks(evaluation.checks.as_dict())) == \
        (code, [failed] if failed == 'accepted' else [failed, 'accepted'])      # the first failure is the error


def test_accepted_compares_addresses_in_any_case():
    accepted = dict(REQUIREMENTS_V2, payTo=PAY_TO.lower(), asset=USDC.lower())
    assert evaluate(v2_payment(authorization_payload(), accepted)).valid


@pytest.mark.parametrize('payment, x402_version, failed', [
    (x_payment(authorization_payload()), 2, 'decoded'),             # a version 1 object: no `accepted`
    (v2_payment(authorization_payload(), None), 2, 'decoded'),
    (v2_payment(authorization_payload()), 1, 'version'),            # a version 2 object in X-PAYMENT
    (v2_payment(authorization_payload(), x402Version=1), 2, 'version'),
])
def test_the_header_says_the_version(payment, x402_version, failed):
    evaluation = evaluate(payment, x402_version=x402_version)
    assert evaluation.error.code == 'payment_invalid' and failed_checks(evaluation.checks.as_dict())[0] == failed


# In-process on anvil -----------------------------------------------------------------

def paid_v2(client, payment, path=MATCH):
    return client.get(path, headers={'PAYMENT-SIGNATURE': header_of(payment)})


def payment_required_of(answer):
    """The PAYMENT-REQUIRED header of a 402, decoded by the SDK and as its JSON."""
    text = header(answer, 'PAYMENT-REQUIRED')
    assert decode_payment_required_header(text).x402_version == 2
    return json.loads(base64.b64decode(text, validate=True))


def receipt_of(answer):
    """The PAYMENT-RESPONSE of a paid version 2 answer, as the SDK decodes it (and no version 1 receipt)."""
    assert header(answer, 'X-PAYMENT-RESPONSE') is None
    settled = decode_payment_response_header(header(answer, 'PAYMENT-RESPONSE'))
    return settled.model_dump(by_alias=True, exclude_none=True)


def refused_v2(answer, code, check):
    """A 402 of a refused payment in both versions' shapes; its body."""
    assert answer.status == 402, answer
    body = answer.json
    assert (body['code'], body['x402Version'], body['accepts'][0]['network']) == (code, 1, 'base'), body
    assert body['checks'][check] is False, body
    assert payment_required_of(answer) == {'x402Version': 2, 'error': body['error'],
                                           'resource': dict(RESOURCE, url=BASE + '/api/jobs/match'),
                                           'accepts': [REQUIREMENTS_V2]}
    assert header(answer, 'PAYMENT-RESPONSE') is None and header(answer, 'X-PAYMENT-RESPONSE') is None
    return body


def test_every_402_carries_payment_required(anvil, app, client):
    unpaid = client.get(MATCH)
    assert unpaid.status == 402 and unpaid.json['code'] == 'payment_required', unpaid
    assert unpaid.json['accepts'] == [dict(REQUIREMENTS, resource=BASE + '/api/jobs/match')]
    assert payment_required_of(unpaid) == {'x402Version': 2, 'error': unpaid.json['error'], 'resource': RESOURCE,
                                           'accepts': [REQUIREMENTS_V2]}
    both = client.get(MATCH, headers={'X-PAYMENT': 'e30=', 'PAYMENT-SIGNATURE': 'e30='})
    assert (both.status, both.json['code']) == (402, 'payment_invalid')
    assert payment_required_of(both)['accepts'] == [REQUIREMENTS_V2]


def test_a_version_2_authorization_pays_once_and_is_answered_in_version_2(anvil, app, client):
    anvil.mint(PAYER, 1_000_000)
    before, nonce = (anvil.balance(PAYER), anvil.balance(PAY_TO)), escrow_nonce(anvil)
    payment = v2_payment(authorization_payload(anvil))

    answer = paid_v2(client, payment)
    assert answer.status == 200, answer
    row = only_row(app)
    assert receipt_of(answer) == {'success': True, 'transaction': row['tx_hash'], 'network': 'eip155:8453',
                                  'payer': PAYER}
    assert (row['form'], row['status'], row['amount'], row['granted_at'] is not None) == \
        ('authorization', 'confirmed', MATCH_PRICE, True)
    assert (anvil.balance(PAYER), anvil.balance(PAY_TO)) == (before[0] - MATCH_PRICE, before[1] + MATCH_PRICE)

    replayed = refused_v2(paid_v2(client, payment), 'payment_replayed', 'notReplayed')
    assert replayed['checks']['accepted'] is True
    assert (anvil.balance(PAYER), anvil.balance(PAY_TO)) == (before[0] - MATCH_PRICE, before[1] + MATCH_PRICE)
    assert escrow_nonce(anvil) == nonce + 1 and len(x402_rows(app)) == 1


def test_a_version_2_proof_pays_once(anvil, app, client):
    tx_hash = transfer_to_pay_to(anvil)
    payload = {'txHash': tx_hash, 'from': PAYER, 'amount': '0.01', 'to': PAY_TO, 'chainId': 8453,
               'tokenAddress': USDC, 'timestamp': int(time.time()),
               'signature': sign_proof(PAYER_KEY, tx_hash, 'GET', '/api/jobs/match', ESCROW)}
    checked = client.post('/api/x402', headers={'PAYMENT-SIGNATURE': header_of(v2_payment(payload))})
    assert checked.status == 200, checked
    assert checked.json['checks'] == dict.fromkeys([*check_names('proof', 2), 'resource'], True)
    assert checked.json['valid'] is True
    assert x402_rows(app) == []

    answer = paid_v2(client, v2_payment(payload))
    assert answer.status == 200, answer
    assert receipt_of(answer) == {'success': True, 'transaction': tx_hash, 'network': 'eip155:8453', 'payer': PAYER}
    refused_v2(paid_v2(client, v2_payment(payload)), 'payment_replayed', 'notReplayed')
    assert refused_v2(client.get(MATCH, headers={'X-PAYMENT': header_of(x_payment(payload))}),
                      'payment_replayed', 'notReplayed')['checks'].get('accepted') is None     # one consumption
    assert [(row['form'], row['tx_hash']) for row in x402_rows(app)] == [('proof', tx_hash)]


@pytest.mark.parametrize('change', [{'amount': '1'}, {'payTo': SOMEONE}, {'asset': OTHER_TOKEN}])
def test_accepted_that_matches_no_offer_is_refused_and_moves_nothing(anvil, app, client, change):
    anvil.mint(PAYER, 1_000_000)
    before, nonce = (anvil.balance(PAYER), anvil.balance(PAY_TO), anvil.balance(SOMEONE)), escrow_nonce(anvil)
    payment = v2_payment(authorization_payload(anvil), dict(REQUIREMENTS_V2, **change))

    body = refused_v2(paid_v2(client, payment), 'payment_requirements_mismatch', 'accepted')
    assert failed_checks(body['checks']) == ['accepted']
    checked = client.post('/api/x402', headers={'PAYMENT-SIGNATURE': header_of(payment)}).json
    assert (checked['valid'], checked['code'], checked['checks']) == (False, 'payment_requirements_mismatch',
                                                                      body['checks'])
    assert (anvil.balance(PAYER), anvil.balance(PAY_TO), anvil.balance(SOMEONE)) == before
    assert escrow_nonce(anvil) == nonce and x402_rows(app) == []
    assert app.service.db.value('SELECT count(*) FROM used_payments') == 0


def test_the_facilitator_gets_each_payment_in_its_own_version(anvil, app_f, client_f, facilitator):
    answers(facilitator)
    v2 = v2_payment(authorization_payload(anvil))
    answer = paid_v2(client_f, v2)
    assert answer.status == 200, answer
    assert receipt_of(answer) == {'success': True, 'transaction': SETTLED, 'network': 'eip155:8453', 'payer': PAYER}
    expected = {'x402Version': 2, 'paymentPayload': v2, 'paymentRequirements': REQUIREMENTS_V2}
    assert (calls(facilitator, 'verify'), calls(facilitator, 'settle')) == ([expected], [expected])

    answers(facilitator, settle={'success': True, 'transaction': '0x' + 'cd' * 32, 'network': 'base',
                                 'payer': DEV_ADDRESSES[3]})
    v1 = x_payment(sign_authorization(DEV_KEYS[3], PAY_TO, MATCH_PRICE, *anvil.window()))
    answer = client_f.get(MATCH, headers={'X-PAYMENT': header_of(v1)})
    assert answer.status == 200, answer
    assert json.loads(base64.b64decode(header(answer, 'X-PAYMENT-RESPONSE')))['network'] == 'base'
    assert header(answer, 'PAYMENT-RESPONSE') is None
    expected = {'x402Version': 1, 'paymentPayload': v1,
                'paymentRequirements': dict(REQUIREMENTS, resource=BASE + '/api/jobs/match')}
    assert (calls(facilitator, 'verify')[1:], calls(facilitator, 'settle')[1:]) == ([expected], [expected])


def test_the_service_lists_both_versions(anvil, app, client):
    listing = client.get('/api/x402').json
    assert (listing['x402Versions'], listing['network'], listing['networkV2']) == ([1, 2], 'base', 'eip155:8453')
    [endpoint] = [e for e in listing['endpoints'] if e['path'] == '/api/jobs/match']
    assert (endpoint['networks'], endpoint['acceptsV2']) == (['base', 'eip155:8453'], [REQUIREMENTS_V2])
    assert discovery.X402_EXTENSION in json.dumps(client.get('/.well-known/agent-card.json').json)
