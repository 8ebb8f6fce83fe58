"""x402 in the verifier (verifier/x402.py, and Chain.authorization_used / wait_for_receipt), version 1 here
(version 2: test_x402_v2.py):
the X-PAYMENT header, its two forms (CONTRACT.md 7), EIP-712 signer recovery and every refusal code
without a node; then EIP-3009 authorizations settled on anvil with the relayer's signed transaction.

The authorizations are signed as the official `x402` package's v1 "exact" EVM client signs them
(x402/mechanisms/evm/exact/v1/client.py: eth-account's sign_typed_data over TransferWithAuthorization,
validAfter = now - 600, validBefore = now + maxTimeoutSeconds, value = maxAmountRequired, a random nonce).
"""

import base64
import json
import os
import time

import pytest
import responses

# web3 and eth_account come through chain.py, which keeps the recursion limit as it was (see there).
from chain import CHAIN_ID, DEV_ADDRESSES, DEV_KEYS, OTHER_TOKEN, USDC, Account, sign_authorization, sign_proof
from chain import proof_typed_data as proof_typed_data_of
from eth_account.typed_transactions import TypedTransaction
from eth_utils import keccak
from hexbytes import HexBytes

from test_verifier import NODE_URL, FakeNode, answering, make_receipt, tx_hash_of
from verifier.chain import Chain
from verifier.checks import check_usdc_transfer
from verifier.errors import ChainUnavailable, VerificationError
from verifier.x402 import (AUTHORIZATION_CHECKS, AUTHORIZATION_TYPES, NETWORKS, SETTLEMENT_GAS, TRANSFER_WITH_AUTHORIZATION, ProofClaims,
                           check_proof_signature, decode_payment_header, encode_header, evaluate_payment,
                           parse_authorization, proof_claims, proof_typed_data, recover_authorization_signer, sign_transfer_with_authorization,
                           usdc_base_units)

PAYER_KEY = DEV_KEYS[1]
PAYER = DEV_ADDRESSES[1]
PAY_TO = DEV_ADDRESSES[2]          # the service's payTo
RELAYER_KEY = DEV_KEYS[3]
RELAYER = DEV_ADDRESSES[3]
SOMEONE_KEY, SOMEONE = DEV_KEYS[4], DEV_ADDRESSES[4]
PRICE = 10_000                     # 0.01 USDC
NOW = 1_800_000_000
SEPOLIA_USDC = OTHER_TOKEN         # Base Sepolia's USDC address
N = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141   # secp256k1's order

# What the service's 402 body offers in `accepts` (CONTRACT.md 7; x402's PaymentRequirementsV1).
REQUIREMENTS = {'scheme': 'exact', 'network': 'base', 'maxAmountRequired': str(PRICE),
                'resource': 'http://market.test/api/jobs/match', 'description': 'GET /api/jobs/match',
                'mimeType': 'application/json', 'payTo': PAY_TO, 'maxTimeoutSeconds': 60, 'asset': USDC,
                'extra': {'name': 'USD Coin', 'version': '2'}}


def code_of(raised):
    return raised.value.code


def refused(call, *args, **kwargs):
    """The code of the VerificationError that `call` raises (and nothing else may be raised)."""
    with pytest.raises(Exception) as raised:
        call(*args, **kwargs)
    assert type(raised.value) is VerificationError, raised.value
    return raised.value.code


def x_payment(payload, network='base'):
    """The X-PAYMENT object around a payload (x402's PaymentPayloadV1)."""
    return {'x402Version': 1, 'scheme': 'exact', 'network': network, 'payload': payload}


def header_of(payment, encode=base64.b64encode):
    return encode(json.dumps(payment, separators=(',', ':')).encode()).decode()


def x402_client_payment(key, requirements=REQUIREMENTS, now=None, nonce=None):
    """What x402's v1 "exact" EVM client sends as X-PAYMENT for `requirements`, signed by `key`."""
    account = Account.from_key(key)
    now = int(time.time()) if now is None else now
    nonce = nonce or '0x' + os.urandom(32).hex()
    authorization = {'from': account.address, 'to': requirements['payTo'], 'value': requirements['maxAmountRequired'],
                     'validAfter': str(now - 600), 'validBefore': str(now + requirements['maxTimeoutSeconds']),
                     'nonce': nonce}
    message = dict(authorization, value=int(authorization['value']), validAfter=int(authorization['validAfter']),
                   validBefore=int(authorization['validBefore']), nonce=bytes.fromhex(nonce[2:]))
    chain_id = {'base': 8453, 'base-sepolia': 84532}[requirements['network']]
    signed = account.sign_typed_data(
        domain_data={'name': requirements['extra']['name'], 'version': requirements['extra']['version'],
                     'chainId': chain_id, 'verifyingContract': requirements['asset']},
        message_types={'TransferWithAuthorization': [{'name': f['name'], 'type': f['type']} for f in
                                                     AUTHORIZATION_TYPES['TransferWithAuthorization']]},
        message_data=message)
    payload = {'authorization': authorization, 'signature': '0x' + bytes(signed.signature).hex()}
    return x_payment(payload, requirements['network'])


def authorized(key=PAYER_KEY, to=PAY_TO, value=PRICE, valid_after=NOW - 600, valid_before=NOW + 60, nonce=None,
               network='base', **domain):
    """A form-2 payment signed with tests/chain.py's sign_authorization (domain overrides: token, chain_id, ...)."""
    return x_payment(sign_authorization(key, to, value, valid_after, valid_before, nonce, **domain), network)


def evaluate(payment, **overrides):
    """evaluate_payment without a node: only the checks that need none."""
    args = dict(chain_id=CHAIN_ID, token=USDC, pay_to=PAY_TO, min_amount=PRICE, now=NOW)
    args.update(overrides)
    return evaluate_payment(payment, **args)


def refusal(payment, **overrides):
    """The code of a payment's first failed check (None if every check passed)."""
    error = evaluate(payment, **overrides).error
    return error and error.code


def of_form(form, evaluation):
    """The evaluation's first failure raised; payment_invalid if the payment is of the other form."""
    evaluation.checks.raise_first()
    if evaluation.form != form:
        raise VerificationError(f'not a payment of the form {form}', 'payment_invalid')
    return evaluation


def check(payment, **overrides):
    """The payer of a good authorization; the first failure raised."""
    return of_form('authorization', evaluate(payment, **overrides)).payer


def proof(**changes):
    """A form-1 payment (SPEC.md's proof of a transfer already made)."""
    payload = {'txHash': tx_hash_of('paid'), 'from': PAYER, 'amount': '0.01', 'to': PAY_TO, 'chainId': CHAIN_ID,
               'tokenAddress': USDC, 'timestamp': NOW}
    payload.update(changes)
    return x_payment(payload)


def claims(payment, **overrides):
    """The claims of a good proof (checked without a node); the first failure raised."""
    return proof_claims(of_form('proof', evaluate(payment, **overrides)).payment['payload'])


# ----- the headers -----

def test_decode_standard_and_url_safe_base64_with_or_without_padding():
    payment = {'x402Version': 1, 'note': '>>>???~~~' * 3 + '!'}      # its base64 holds '+', '/' and '='
    standard = header_of(payment)
    assert '+' in standard and '/' in standard and standard.endswith('=')
    url_safe = header_of(payment, base64.urlsafe_b64encode)
    for header in (standard, standard.rstrip('='), url_safe, url_safe.rstrip('='), f' {standard} '):
        assert decode_payment_header(header) == payment


@pytest.mark.parametrize('header', [
    None, 42, b'eyJ9', '', '   ', 'not base64!', 'e30=e30=', '====', 'A',
    base64.b64encode(b'not json').decode(), base64.b64encode(b'[1, 2]').decode(), base64.b64encode(b'"x"').decode(),
    base64.b64encode(b'12').decode(), base64.b64encode(b'null').decode(), base64.b64encode(b'\xff\xfe{}').decode(),
    base64.b64encode(b'[' * 12_000).decode(),            # nested past the recursion limit: an error, not a crash
    'e30' * 10_000,                                       # longer than any header we read
])
def test_anything_but_base64_of_a_json_object_is_payment_invalid(header):
    assert refused(decode_payment_header, header) == 'payment_invalid'


def test_encode_header_is_standard_base64_json():
    response = {'success': True, 'transaction': tx_hash_of('settled'), 'network': 'base', 'payer': PAYER}
    header = encode_header(response)
    assert json.loads(base64.b64decode(header, validate=True)) == response
    assert decode_payment_header(header) == response
    assert encode_header({'note': '>>>???~~~'}) == 'eyJub3RlIjoiPj4+Pz8/fn5+In0='   # '+', '/', padding


# ----- the two forms -----

def test_payment_form_tells_the_two_forms_apart_by_the_payloads_keys():
    assert evaluate(proof(), chain_id=CHAIN_ID).form == 'proof'
    assert evaluate(authorized(), chain_id=CHAIN_ID).form == 'authorization'
    assert evaluate(x402_client_payment(PAYER_KEY), chain_id=CHAIN_ID).form == 'authorization'
    sepolia = x_payment({'txHash': tx_hash_of('x')}, network='base-sepolia')
    assert evaluate(sepolia, chain_id=84532).form == 'proof'


def test_the_networks_and_their_usdc_domains():
    assert NETWORKS == {'base': (8453, 'USD Coin', '2'), 'base-sepolia': (84532, 'USDC', '2')}


@pytest.mark.parametrize('change, code', [
    ({'x402Version': 2}, 'payment_invalid'), ({'x402Version': '1'}, 'payment_invalid'),
    ({'x402Version': True}, 'payment_invalid'), ({'x402Version': None}, 'payment_invalid'),
    ({'scheme': 'upto'}, 'payment_invalid'), ({'scheme': None}, 'payment_invalid'),
    ({'network': 'base-sepolia'}, 'payment_wrong_chain'), ({'network': 'polygon'}, 'payment_wrong_chain'),
    ({'network': 'eip155:8453'}, 'payment_wrong_chain'), ({'network': None}, 'payment_invalid'),
    ({'network': 8453}, 'payment_invalid'),
    ({'payload': None}, 'payment_invalid'), ({'payload': []}, 'payment_invalid'), ({'payload': {}}, 'payment_invalid'),
    ({'payload': {'signature': '0x'}}, 'payment_invalid'),                          # no authorization
    ({'payload': {'authorization': {}}}, 'payment_invalid'),                        # no signature
    ({'payload': {'txHash': tx_hash_of('x'), 'signature': '0x', 'authorization': {}}}, 'payment_invalid'),  # both
])
def test_payment_form_refusals(change, code):
    assert refusal(dict(proof(), **change)) == code
    if list(change.values()) == [None]:                                         # missing, not null
        missing = {key: value for key, value in proof().items() if key not in change}
        assert refusal(missing) == code


def test_a_payment_that_is_not_an_object_is_payment_invalid():
    for payment in (None, [], 'base', 1):
        assert refusal(payment, chain_id=CHAIN_ID) == 'payment_invalid'


def test_the_network_must_be_the_configured_chains():
    assert refusal(proof(), chain_id=84532) == 'payment_wrong_chain'
    assert refusal(proof(), chain_id=31337) == 'payment_wrong_chain'


# ----- form 1: the claims of a proof, before any node is asked -----

def test_good_proof_claims_are_returned_normalised():
    payment = proof(txHash=tx_hash_of('paid').upper().replace('0X', '0x'), to=PAY_TO.lower(),
                    tokenAddress=USDC.lower(), chainId=str(CHAIN_ID), amount='0.010000')
    assert claims(payment) == ProofClaims(tx_hash=tx_hash_of('paid'), payer=PAYER, recipient=PAY_TO, amount=PRICE,
                                          chain_id=CHAIN_ID, token=USDC, timestamp=NOW)
    assert claims(proof(amount='25')).amount == 25_000_000          # more than the price is fine


@pytest.mark.parametrize('change, code', [
    ({'chainId': 84532}, 'payment_wrong_chain'), ({'chainId': '1'}, 'payment_wrong_chain'),
    ({'tokenAddress': OTHER_TOKEN}, 'payment_wrong_token'),
    ({'to': SOMEONE}, 'payment_wrong_recipient'),
    ({'amount': '0.009999'}, 'payment_insufficient'), ({'amount': '0'}, 'payment_insufficient'),
])
def test_each_wrong_claim_has_its_own_code(change, code):
    assert refused(claims, proof(**change)) == code


def test_the_claims_are_compared_in_order_chain_token_recipient_amount():
    everything_wrong = dict(chainId=1, tokenAddress=OTHER_TOKEN, to=SOMEONE, amount='0.001')
    assert refused(claims, proof(**everything_wrong)) == 'payment_wrong_chain'
    assert refused(claims, proof(**dict(everything_wrong, chainId=CHAIN_ID))) == 'payment_wrong_token'
    assert refused(claims, proof(to=SOMEONE, amount='0.001')) == 'payment_wrong_recipient'


@pytest.mark.parametrize('change', [
    {'txHash': '0x1234'}, {'txHash': tx_hash_of('x')[2:]}, {'txHash': None}, {'txHash': 12},
    {'txHash': tx_hash_of('x')[:-1] + 'g'},
    {'from': 'nope'}, {'from': None}, {'from': PAYER.replace('7099', '7O99')},
    {'to': '0x1234'}, {'tokenAddress': 'usdc'},
    {'amount': 0.01}, {'amount': 1}, {'amount': '0.0100001'}, {'amount': '1e-2'}, {'amount': '-0.01'},
    {'amount': '.5'}, {'amount': '0,01'}, {'amount': ''}, {'amount': None}, {'amount': ' 0.01'},
    {'chainId': None}, {'chainId': '0x2105'}, {'chainId': True}, {'chainId': -8453}, {'chainId': 8453.0},
    {'timestamp': None}, {'timestamp': 'yesterday'}, {'timestamp': 1.5},
])
def test_a_malformed_claim_is_payment_invalid(change):
    assert refused(claims, proof(**change)) == 'payment_invalid'


def test_an_authorization_is_not_a_proof():
    assert refused(claims, authorized()) == 'payment_invalid'


def test_usdc_base_units():
    assert [usdc_base_units(a) for a in ('0.01', '1', '25.00', '0.000001', '1.5', '007')] == \
        [10_000, 1_000_000, 25_000_000, 1, 1_500_000, 7_000_000]


# ----- form 2: the EIP-712 signer of an authorization -----

def test_the_x402_clients_payload_is_exactly_sign_authorizations():
    nonce = '0x' + '5a' * 32
    client = x402_client_payment(PAYER_KEY, now=NOW, nonce=nonce)
    harness = authorized(valid_after=NOW - 600, valid_before=NOW + 60, nonce=nonce)
    assert client == harness
    assert set(client['payload']) == {'authorization', 'signature'}
    assert list(client['payload']['authorization']) == ['from', 'to', 'value', 'validAfter', 'validBefore', 'nonce']
    assert client['payload']['authorization']['value'] == '10000'           # numbers as decimal strings


def test_recover_the_signer():
    payload = authorized()['payload']
    signer = recover_authorization_signer(payload['authorization'], payload['signature'], chain_id=CHAIN_ID,
                                          token=USDC, name='USD Coin', version='2')
    assert signer == PAYER


def test_the_signature_covers_the_domain():
    """Signed for another chain, token, name or version, it recovers to some other address."""
    for domain in ({'chain_id': 84532}, {'token': OTHER_TOKEN}, {'name': 'USDC'}, {'version': '1'}):
        payload = authorized(**domain)['payload']
        assert recover_authorization_signer(payload['authorization'], payload['signature'], chain_id=CHAIN_ID,
                                            token=USDC, name='USD Coin', version='2') != PAYER
        assert recover_authorization_signer(payload['authorization'], payload['signature'],
                                            **{'chain_id': CHAIN_ID, 'token': USDC, 'name': 'USD Coin',
                                               'version': '2', **domain}) == PAYER


def with_signature(payment, signature):
    return dict(payment, payload=dict(payment['payload'], signature=signature))


def test_v_as_0_or_1_is_read_as_27_or_28():
    payment = authorized()
    signature = payment['payload']['signature']
    v = int(signature[-2:], 16)
    assert v in (27, 28)
    assert check(with_signature(payment, signature[:-2] + format(v - 27, '02x'))) == PAYER


def high_s(signature):
    """The same signature with s' = n - s (and v flipped): valid for ecrecover, refused by USDC (EIP-2)."""
    raw = bytes.fromhex(signature[2:])
    s = N - int.from_bytes(raw[32:64], 'big')
    return '0x' + (raw[:32] + s.to_bytes(32, 'big') + bytes([55 - raw[64]])).hex()


@pytest.mark.parametrize('mangle', [
    lambda sig: sig[:-2] + '1f',                 # v = 31
    lambda sig: sig[:-2] + '23',                 # v = 35 (an EIP-155 v: not for typed data)
    lambda sig: '0x' + '00' * 65,                # r = s = 0
    lambda sig: '0x' + 'ff' * 65,
    high_s,
    lambda sig: sig[:-2],                        # 64 bytes
    lambda sig: sig + '00',                      # 66 bytes
    lambda sig: sig[2:],                         # no 0x
    lambda sig: sig[:-3] + 'g1',                 # not hex
    lambda sig: None, lambda sig: 42, lambda sig: '',
])
def test_a_malformed_or_unrecoverable_signature_is_payment_signature_invalid(mangle):
    payment = authorized()
    assert refused(check, with_signature(payment, mangle(payment['payload']['signature']))) == \
        'payment_signature_invalid'


# ----- form 2: the checks of an authorization, without a node -----

def test_a_good_authorization_returns_the_payer():
    assert check(authorized()) == PAYER
    assert check(x402_client_payment(PAYER_KEY, now=NOW), now=NOW) == PAYER
    assert check(x402_client_payment(PAYER_KEY), now=int(time.time())) == PAYER
    assert check(authorized(value=5 * PRICE)) == PAYER                      # more than the price is fine


def test_numbers_may_be_ints_and_addresses_lowercase():
    payment = authorized()
    auth = payment['payload']['authorization']
    auth.update({'value': int(auth['value']), 'validAfter': int(auth['validAfter']),
                 'validBefore': int(auth['validBefore']), 'from': auth['from'].lower(), 'to': auth['to'].lower(),
                 'nonce': auth['nonce'].upper().replace('0X', '0x')})
    assert check(payment, pay_to=PAY_TO.lower(), token=USDC.lower()) == PAYER      # answered checksummed


def test_base_sepolia_uses_its_own_usdc_domain():
    payment = authorized(network='base-sepolia', chain_id=84532, token=SEPOLIA_USDC, name='USDC')
    assert check(payment, chain_id=84532, token=SEPOLIA_USDC) == PAYER
    assert refused(check, payment, chain_id=CHAIN_ID) == 'payment_wrong_chain'
    # the domain name and version can be given (the 402 body's extra), else they are the network's
    renamed = authorized(name='Test USD', version='9')
    assert check(renamed, name='Test USD', version='9') == PAYER
    assert refused(check, renamed) == 'payment_signature_invalid'


def altered(payment, **changes):
    """The authorization changed after it was signed."""
    payment = json.loads(json.dumps(payment))
    payment['payload']['authorization'].update(changes)
    return payment


@pytest.mark.parametrize('payment, code', [
    # signed by someone else than `from`, or altered after signing, or for another domain
    (altered(authorized(key=DEV_KEYS[4]), **{'from': PAYER}), 'payment_signature_invalid'),
    (altered(authorized(), value=str(100 * PRICE)), 'payment_signature_invalid'),
    (altered(authorized(to=SOMEONE), to=PAY_TO), 'payment_signature_invalid'),
    (altered(authorized(), validBefore=str(NOW + 86_400)), 'payment_signature_invalid'),
    (altered(authorized(), nonce='0x' + '00' * 32), 'payment_signature_invalid'),
    (authorized(chain_id=1), 'payment_signature_invalid'),
    (authorized(token=OTHER_TOKEN), 'payment_signature_invalid'),
    (authorized(name='USDC'), 'payment_signature_invalid'),
    (authorized(version='1'), 'payment_signature_invalid'),
    (authorized(to=SOMEONE), 'payment_wrong_recipient'),
    (authorized(value=PRICE - 1), 'payment_insufficient'),
    (authorized(value=0), 'payment_insufficient'),
    (authorized(valid_before=NOW), 'payment_expired'),                      # validBefore is exclusive
    (authorized(valid_before=NOW - 1), 'payment_expired'),
    (authorized(valid_after=NOW), 'payment_expired'),                       # validAfter is exclusive
    (authorized(valid_after=NOW + 60, valid_before=NOW + 120), 'payment_expired'),   # not valid yet
])
def test_each_failed_check_has_its_own_code(payment, code):
    assert refused(check, payment) == code


def test_the_checks_run_in_order_signature_recipient_amount_time():
    everything_wrong = dict(to=SOMEONE, value=1, valid_before=NOW - 1)
    assert refused(check, authorized(key=DEV_KEYS[4], **everything_wrong)) == 'payment_wrong_recipient'
    assert refused(check, altered(authorized(key=DEV_KEYS[4], **everything_wrong), **{'from': PAYER})) == \
        'payment_signature_invalid'
    assert refused(check, authorized(value=1, valid_before=NOW - 1)) == 'payment_insufficient'
    assert refused(check, authorized(valid_before=NOW - 1)) == 'payment_expired'


@pytest.mark.parametrize('change', [
    {'nonce': '0x1234'}, {'nonce': '00' * 32}, {'nonce': '0x' + '00' * 33}, {'nonce': '0x' + 'zz' * 32},
    {'nonce': 7}, {'nonce': None},
    {'from': 'nope'}, {'from': None}, {'to': '0x1234'}, {'to': PAY_TO.replace('3C44', '3c44')},
    {'value': '-1'}, {'value': '1e4'}, {'value': '0x2710'}, {'value': 10_000.0}, {'value': True}, {'value': ''},
    {'value': str(2**256)}, {'validAfter': None}, {'validBefore': 'soon'}, {'validBefore': -1},
])
def test_a_malformed_authorization_field_is_payment_invalid(change):
    """A malformed field is payment_invalid before the signature is looked at (the signature covers the nonce as
    bytes32 and the numbers as uint256, so there is nothing to recover without them)."""
    assert refused(check, altered(authorized(), **change)) == 'payment_invalid'


def test_parse_authorization_normalises():
    payment = authorized(nonce='0x' + 'AB' * 32)
    fields = parse_authorization(payment)
    assert {k: v for k, v in fields.items() if k != 'signature'} == {
        'from': PAYER, 'to': PAY_TO, 'value': PRICE, 'validAfter': NOW - 600, 'validBefore': NOW + 60,
        'nonce': '0x' + 'ab' * 32}
    assert fields['signature'] == bytes.fromhex(payment['payload']['signature'][2:])


def test_a_proof_is_not_an_authorization_and_the_network_must_match():
    assert refused(check, proof()) == 'payment_invalid'
    assert refused(check, authorized(network='base-sepolia')) == 'payment_wrong_chain'
    assert refused(check, dict(authorized(), x402Version=2)) == 'payment_invalid'


# ----- the settlement transaction -----

def settle_tx(payment, **overrides):
    args = dict(token=USDC, payment=payment, nonce=3, chain_id=CHAIN_ID, max_fee_per_gas=2 * 10**9,
                max_priority_fee_per_gas=10**6)
    args.update(overrides)
    return sign_transfer_with_authorization(RELAYER_KEY, **args)


def words_of(data):
    """A call's data as (selector, [32-byte words as hex])."""
    data = HexBytes(data)
    return '0x' + data[:4].hex(), [data[i:i + 32].hex() for i in range(4, len(data), 32)]


def test_the_settlement_calls_transfer_with_authorization_with_v_r_s():
    payment = authorized(nonce='0x' + '42' * 32)
    raw, tx_hash = settle_tx(payment)
    assert tx_hash == '0x' + keccak(HexBytes(raw)).hex()
    assert Account.recover_transaction(raw) == RELAYER                  # the relayer pays the gas
    tx = TypedTransaction.from_bytes(HexBytes(raw)).as_dict()
    assert (tx['type'], tx['chainId'], tx['nonce'], tx['to'], tx['value']) == (2, CHAIN_ID, 3, HexBytes(USDC), 0)
    assert (tx['gas'], tx['maxFeePerGas'], tx['maxPriorityFeePerGas']) == (SETTLEMENT_GAS, 2 * 10**9, 10**6)
    assert SETTLEMENT_GAS == 120_000

    selector, words = words_of(tx['data'])
    signature_text = 'transferWithAuthorization(address,address,uint256,uint256,uint256,bytes32,uint8,bytes32,bytes32)'
    assert selector == TRANSFER_WITH_AUTHORIZATION == '0x' + keccak(text=signature_text)[:4].hex() == '0xe3ee160e'
    signature = bytes.fromhex(payment['payload']['signature'][2:])
    assert words == [PAYER[2:].lower().rjust(64, '0'), PAY_TO[2:].lower().rjust(64, '0'), format(PRICE, '064x'),
                     format(NOW - 600, '064x'), format(NOW + 60, '064x'), '42' * 32,
                     format(signature[64], '064x'), signature[:32].hex(), signature[32:64].hex()]
    assert signature[64] in (27, 28)


def test_a_v_of_0_or_1_is_sent_as_27_or_28_and_gas_can_be_set():
    payment = authorized()
    signature = payment['payload']['signature']
    v = int(signature[-2:], 16)
    raw, _ = settle_tx(with_signature(payment, signature[:-2] + format(v - 27, '02x')), gas=200_000)
    tx = TypedTransaction.from_bytes(HexBytes(raw)).as_dict()
    assert tx['gas'] == 200_000
    assert words_of(tx['data'])[1][6] == format(v, '064x')
    assert settle_tx(payment) == settle_tx(payment)                     # deterministic
    assert settle_tx(payment)[1] != settle_tx(payment, nonce=4)[1]


@pytest.mark.parametrize('payment, code', [
    (altered(authorized(), nonce='0x12'), 'payment_invalid'),
    (with_signature(authorized(), '0x1234'), 'payment_signature_invalid'),
    (proof(), 'payment_invalid'),
])
def test_a_malformed_authorization_is_never_signed(payment, code):
    assert refused(settle_tx, payment) == code


def test_a_malformed_token_is_never_signed():
    assert refused(settle_tx, authorized(), token='usdc') == 'payment_invalid'


# ----- the chain: authorization_used and wait_for_receipt against a fake node -----

@pytest.fixture
def node():
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        yield FakeNode().install(mock)


def bool_word(value):
    return answering(json.dumps({'jsonrpc': '2.0', 'id': 0, 'result': '0x' + format(value, '064x')}))


def test_authorization_used_calls_authorization_state(node):
    node.answers['eth_call'] = bool_word(1)
    nonce = '0x' + 'AB' * 32
    assert Chain(NODE_URL).authorization_used(USDC.lower(), PAYER.lower(), nonce) is True
    [params] = [params for method, params in node.calls if method == 'eth_call']       # (web3 also asks the chain id)
    assert params[0] == {'to': USDC, 'data': '0xe94a0102' + PAYER[2:].lower().rjust(64, '0') + 'ab' * 32}
    assert params[0]['data'][:10] == '0x' + keccak(text='authorizationState(address,bytes32)')[:4].hex()
    node.answers['eth_call'] = bool_word(0)
    assert Chain(NODE_URL).authorization_used(USDC, PAYER, nonce) is False


@pytest.mark.parametrize('nonce', ['0x1234', 'ab' * 33, '0x' + 'zz' * 32, '0x' + 'ab ' * 21 + 'a', None, 7])
def test_authorization_used_refuses_a_malformed_nonce_without_asking(node, nonce):
    assert refused(Chain(NODE_URL).authorization_used, USDC, PAYER, nonce) == 'payment_invalid'
    assert node.calls == []


@pytest.mark.parametrize('result', ['0x', '0x' + format(2, '064x'), '0x01'])
def test_authorization_used_with_a_strange_answer_is_chain_unavailable(node, result):
    node.answers['eth_call'] = answering(json.dumps({'jsonrpc': '2.0', 'id': 0, 'result': result}))
    with pytest.raises(ChainUnavailable):
        Chain(NODE_URL).authorization_used(USDC, PAYER, '0x' + '00' * 32)


def test_authorization_used_with_the_node_down_is_chain_unavailable(node):
    import requests
    node.fail = requests.exceptions.ConnectionError('refused')
    with pytest.raises(ChainUnavailable):
        Chain(NODE_URL).authorization_used(USDC, PAYER, '0x' + '00' * 32)
    assert len(node.calls) == 1


def revert_answer(reason):
    """A node's answer to an eth_call that reverts with Error(reason) (JSON-RPC error code 3, as geth and anvil)."""
    data = '0x08c379a0' + format(32, '064x') + format(len(reason), '064x') + reason.encode().hex().ljust(64, '0')
    return answering(json.dumps({'jsonrpc': '2.0', 'id': 0, 'error': {
        'code': 3, 'message': f'execution reverted: {reason}', 'data': data}}))


def test_revert_reason_runs_the_call_in_the_pending_block(node):
    data = '0x' + 'ab' * 36
    node.answers['eth_call'] = answering(json.dumps({'jsonrpc': '2.0', 'id': 0, 'result': '0x'}))
    assert Chain(NODE_URL).revert_reason(RELAYER.lower(), USDC.lower(), data) is None
    [params] = [params for method, params in node.calls if method == 'eth_call']
    assert params == [{'from': RELAYER, 'to': USDC, 'data': data}, 'pending']
    node.answers['eth_call'] = revert_answer('FiatTokenV2: authorization is expired')
    assert Chain(NODE_URL).revert_reason(RELAYER, USDC, data) == 'FiatTokenV2: authorization is expired'


def test_revert_reason_with_the_node_down_or_erring_is_chain_unavailable(node):
    import requests
    node.answers['eth_call'] = answering('{"jsonrpc": "2.0", "id": 0, "error": {"code": -32603, "message": "no"}}')
    with pytest.raises(ChainUnavailable):
        Chain(NODE_URL).revert_reason(RELAYER, USDC, '0x')
    node.fail = requests.exceptions.ConnectionError('refused')
    with pytest.raises(ChainUnavailable):
        Chain(NODE_URL).revert_reason(RELAYER, USDC, '0x')


def test_wait_for_receipt_polls_until_mined(node):
    receipt = make_receipt(tx_hash=tx_hash_of('settled'))
    original, asked = node.result, []

    def result(method, params):
        if method == 'eth_getTransactionReceipt':
            asked.append(params[0])
            if len(asked) == 3:
                node.add(receipt)          # mined between the second and third look
        return original(method, params)
    node.result = result
    assert Chain(NODE_URL).wait_for_receipt(tx_hash_of('settled'), 5, poll=0.01) == receipt
    assert asked == [tx_hash_of('settled')] * 3


def test_wait_for_receipt_times_out_as_chain_unavailable(node):
    started = time.monotonic()
    with pytest.raises(ChainUnavailable) as raised:
        Chain(NODE_URL).wait_for_receipt(tx_hash_of('never'), 0.3, poll=0.05)
    assert 0.3 <= time.monotonic() - started < 10      # waited its 0.3 s, and was cut (not a latency figure)
    assert 'not mined within 0.3 seconds' in raised.value.message
    assert 3 <= node.count('eth_getTransactionReceipt') <= 8


# ----- on anvil: settling an authorization -----

def settle(node, payment, key=RELAYER_KEY):
    """Sign the settlement with the relayer, broadcast it, wait for it: the receipt."""
    max_fee, tip = node.fee_caps()
    raw, tx_hash = sign_transfer_with_authorization(key, token=USDC, payment=payment,
                                                    nonce=node.nonce(Account.from_key(key).address),
                                                    chain_id=node.chain_id(), max_fee_per_gas=max_fee,
                                                    max_priority_fee_per_gas=tip)
    assert node.send_raw(raw) is True
    receipt = node.wait_for_receipt(tx_hash, 10, poll=0.02)
    assert receipt['transactionHash'] == tx_hash
    return receipt


def test_an_authorization_settles_on_chain_once(anvil, usdc):
    node = Chain(anvil.url)
    pay_to = Account.create().address
    anvil.mint(PAYER, 3 * PRICE)
    payer_usdc, payer_eth = anvil.balance(PAYER), anvil.w3.eth.get_balance(PAYER)
    valid_after, valid_before = anvil.window()      # valid on the wall clock (`now`) and the chain's alike
    now = int(time.time())
    signed = sign_authorization(PAYER_KEY, pay_to, PRICE, valid_after=valid_after, valid_before=valid_before)
    header = header_of(x_payment(signed))

    evaluation = evaluate(header, chain=node, pay_to=pay_to, now=now)        # every check, the node's too
    assert evaluation.form == 'authorization' and evaluation.payer == PAYER and evaluation.amount == PRICE
    assert evaluation.checks.as_dict() == dict.fromkeys(AUTHORIZATION_CHECKS, True) and evaluation.valid
    payment, payer, nonce = evaluation.payment, evaluation.payer, evaluation.nonce
    assert nonce == payment['payload']['authorization']['nonce']
    assert node.authorization_used(USDC, payer, nonce) is False
    assert node.token_balance(USDC, payer) >= PRICE

    receipt = settle(node, payment)
    assert receipt['status'] == 1
    assert anvil.receipt(receipt['transactionHash'])['from'] == RELAYER
    assert check_usdc_transfer(receipt, token=USDC, recipient=pay_to, min_amount=PRICE, payer=payer).amount == PRICE
    assert anvil.balance(PAYER) == payer_usdc - PRICE
    assert anvil.balance(pay_to) == PRICE
    assert anvil.w3.eth.get_balance(PAYER) == payer_eth                 # the relayer paid the gas
    assert node.authorization_used(USDC, payer, nonce) is True
    assert node.authorization_used(USDC, payer, nonce.upper().replace('0X', '0x')) is True
    assert node.authorization_used(USDC, pay_to, nonce) is False

    # Checked again, it is a replay (authorizationState); the service's own record is asked first.
    again = evaluate(header, chain=node, pay_to=pay_to, now=now)
    assert again.checks.as_dict() == dict(dict.fromkeys(AUTHORIZATION_CHECKS, True), notReplayed=False)
    assert again.error.code == 'payment_replayed' and not again.valid
    seen = []
    assert evaluate(header, chain=node, pay_to=pay_to, now=now,
                    authorization_used=lambda *key: seen.append(key) or True).error.code == 'payment_replayed'
    assert seen == [(PAYER, nonce)]
    # The same authorization sent again: the token refuses it (mined, status 0), and nothing moves.
    again = settle(node, payment)
    assert again['status'] == 0 and again['logs'] == []
    assert anvil.balance(PAYER) == payer_usdc - PRICE
    assert anvil.balance(pay_to) == PRICE


def test_the_x402_clients_authorization_settles_on_chain(anvil, usdc):
    """Signed as the x402 client signs (validAfter ten minutes back), checked, then settled."""
    node = Chain(anvil.url)
    requirements = dict(REQUIREMENTS, payTo=Account.create().address)
    now = int(time.time())      # as the client signs: the wall clock, which the next blocks follow too
    # (after a revert the chain's clock restarts from the snapshot's block, minutes old late in a long session)
    anvil.set_next_timestamp(max(now, anvil.timestamp() + 1))
    anvil.mint(PAYER, PRICE)
    payment = decode_payment_header(header_of(x402_client_payment(PAYER_KEY, requirements, now=now)))
    assert check(payment, token=requirements['asset'], pay_to=requirements['payTo'],
                 min_amount=int(requirements['maxAmountRequired']), now=now) == PAYER
    assert settle(node, payment)['status'] == 1
    assert anvil.balance(requirements['payTo']) == PRICE
    assert anvil.balance(PAYER) == 0


def test_an_authorization_for_another_token_chain_or_name_is_refused_before_anything_is_sent(anvil, usdc):
    node = Chain(anvil.url)
    anvil.mint(PAYER, PRICE)
    (valid_after, valid_before), now = anvil.window(), int(time.time())
    block, relayer_nonce = anvil.block_number(), node.nonce(RELAYER)
    for domain in ({'token': OTHER_TOKEN}, {'chain_id': 84532}, {'chain_id': 1}, {'name': 'USDC'}, {'version': '1'}):
        payment = x_payment(sign_authorization(PAYER_KEY, PAY_TO, PRICE, valid_after, valid_before, **domain))
        with pytest.raises(VerificationError) as raised:
            check(payment, now=now)
        assert code_of(raised) == 'payment_signature_invalid', domain
    assert (anvil.block_number(), node.nonce(RELAYER), anvil.balance(PAYER)) == (block, relayer_nonce, PRICE)
    # and the chain agrees: the token refuses such a signature
    bad = x_payment(sign_authorization(PAYER_KEY, PAY_TO, PRICE, valid_after, valid_before, name='USDC'))
    assert settle(node, bad)['status'] == 0
    assert anvil.balance(PAYER) == PRICE


def test_wait_for_receipt_on_a_pending_transaction(anvil, usdc):
    node = Chain(anvil.url)
    anvil.mint(PAYER, PRICE)
    payment = x_payment(sign_authorization(PAYER_KEY, PAY_TO, PRICE, *anvil.window()))
    anvil.automine(False)
    max_fee, tip = node.fee_caps()
    raw, tx_hash = sign_transfer_with_authorization(RELAYER_KEY, token=USDC, payment=payment,
                                                    nonce=node.nonce(RELAYER), chain_id=CHAIN_ID,
                                                    max_fee_per_gas=max_fee, max_priority_fee_per_gas=tip)
    assert node.send_raw(raw) is True
    with pytest.raises(ChainUnavailable):
        node.wait_for_receipt(tx_hash, 0.3, poll=0.05)
    anvil.mine()
    assert node.wait_for_receipt(tx_hash, 5)['status'] == 1


# ----- form 1: the sender's PaymentProof signature (CONTRACT.md 20) -----

def test_a_proofs_signature_names_its_sender_and_its_call():
    escrow = RELAYER
    tx_hash = tx_hash_of('paid')
    good = sign_proof(PAYER_KEY, tx_hash, 'GET', '/api/jobs/match', escrow)
    signed = dict(proof()['payload'], signature=good)
    args = dict(escrow=escrow, method='GET', path='/api/jobs/match')
    evaluation = evaluate(x_payment(signed), **args)
    assert (evaluation.form, evaluation.error, evaluation.checks.as_dict()['signature']) == ('proof', None, True)
    assert check_proof_signature(good, payer=PAYER, tx_hash=tx_hash, method='GET', path='/api/jobs/match',
                                 chain_id=CHAIN_ID, escrow=escrow) == PAYER
    assert proof_typed_data(tx_hash=None, method='GET', path='/api/jobs/match', chain_id=CHAIN_ID, escrow=escrow) == \
        dict(proof_typed_data_of(None, 'GET', '/api/jobs/match', escrow))
    for payload, call in [
            ({k: v for k, v in signed.items() if k != 'signature'}, args),               # missing
            (dict(signed, signature=sign_proof(SOMEONE_KEY, tx_hash, 'GET', '/api/jobs/match', escrow)), args),
            (signed, dict(args, path='/api/agents/match')),                                # another call
            (signed, dict(args, method='POST')),
            (signed, dict(args, escrow=SOMEONE)),                                          # another domain
            (dict(signed, signature='0x1234'), args), (dict(signed, signature=7), args),   # malformed
            (dict(signed, signature='0x' + 'ff' * 65), args)]:
        evaluation = evaluate(x_payment(payload), **call)
        assert evaluation.error.code == 'payment_signature_invalid', (payload.get('signature'), call)
        assert list(evaluation.checks.errors) == ['signature']       # (fresh needs a node: not run here)
    assert 'signature' not in evaluate(x_payment(signed)).checks.as_dict()      # no call given: not checked
