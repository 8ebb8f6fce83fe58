"""The verifier package without a node: the pure checks (verifier/checks.py), the signing of payouts
(verifier/payouts.py), and the web3 boundary (verifier/chain.py) against a fake JSON-RPC node served by
`responses` (nothing leaves the process: the node's URL is never resolved).

FakeNode is also used by test_onchain_unit.py.
"""

import hashlib
import json
import time

import pytest
import requests
import responses

# web3 and eth_account come through chain.py, which keeps the recursion limit as it was (see there).
from chain import DEV_ADDRESSES, DEV_KEYS, OTHER_TOKEN, USDC, Account, funding_typed_data, sign_funding
from eth_account.typed_transactions import TypedTransaction
from eth_utils import keccak
from hexbytes import HexBytes

from verifier.chain import Chain, plain_receipt
from verifier.checks import (TRANSFER_CHECKS, TRANSFER_TOPIC, Checks, Transfer, check_canonical, check_chain_id,
                             check_confirmations, check_fresh, check_succeeded, check_usdc_transfer, usdc_transfers)
from verifier.errors import ChainUnavailable, FeeTooLow, VerificationError
from verifier.funding import check_funding_signature
from verifier.funding import funding_typed_data as server_typed_data
from verifier.payouts import TRANSFER, TRANSFER_GAS, escrow_address, sign_usdc_transfer

NODE_URL = 'http://node.test/'
ESCROW_KEY = DEV_KEYS[0]
ESCROW = '0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266'      # anvil's first dev account
PAYER = DEV_ADDRESSES[1]                                    # 0x70997970C51812dc3A010C7d01b50e0d17dc79C8
SOMEONE = DEV_ADDRESSES[2]
BASE_CHAIN = 8453
APPROVAL_TOPIC = '0x8c5be1e5ebec7d5bd14f71427d1e84f3dd0314c0f7b2291e5b200ac8c7c3b925'


# ----- receipts as the checks take them (plain dicts) -----

def word(address):
    """An address as a 32-byte log topic, lowercase like a node sends it."""
    return '0x' + address[2:].lower().rjust(64, '0')


def tx_hash_of(label):
    return '0x' + hashlib.sha256(f'tx:{label}'.encode()).hexdigest()


def block_hash_of(number, fork=''):
    return '0x' + hashlib.sha256(f'block:{number}{fork}'.encode()).hexdigest()


def transfer_log(token, frm, to, amount):
    """An ERC-20 Transfer(from, to, value) log emitted by `token`, shaped as a node reports it."""
    return {'address': token, 'topics': [TRANSFER_TOPIC, word(frm), word(to)], 'data': '0x' + format(amount, '064x')}


def make_receipt(status=1, block=100, logs=(), tx_hash=None, block_hash=None):
    """A receipt in the plain form of verifier.checks (what verifier.chain.plain_receipt returns)."""
    return {'transactionHash': tx_hash or tx_hash_of('receipt'), 'status': status, 'blockNumber': block,
            'blockHash': block_hash or block_hash_of(block), 'logs': [dict(log) for log in logs]}


def paid(amount=25_000_000, token=USDC, frm=PAYER, to=ESCROW, **receipt):
    """A successful receipt of one USDC transfer."""
    return make_receipt(logs=[transfer_log(token, frm, to, amount)], **receipt)


def code_of(raised):
    return raised.value.code


# ----- check_usdc_transfer and its parts -----

def test_a_good_transfer_returns_payer_recipient_and_amount():
    transfer = check_usdc_transfer(paid(), token=USDC, recipient=ESCROW, min_amount=25_000_000)
    assert transfer == Transfer(PAYER, ESCROW, 25_000_000)
    assert check_usdc_transfer(paid(30_000_000), token=USDC, recipient=ESCROW,
                               min_amount=25_000_000) == Transfer(PAYER, ESCROW, 30_000_000)


def test_a_reverted_transaction_is_payment_reverted():
    with pytest.raises(VerificationError) as raised:
        check_usdc_transfer(paid(status=0), token=USDC, recipient=ESCROW, min_amount=1)
    assert code_of(raised) == 'payment_reverted'
    with pytest.raises(VerificationError) as raised:
        check_succeeded(make_receipt(status=0))
    assert code_of(raised) == 'payment_reverted'
    assert check_succeeded(make_receipt(status=1)) is None


def test_a_transfer_from_another_token_contract_is_payment_wrong_token():
    receipt = paid(token=OTHER_TOKEN)
    assert usdc_transfers(receipt, USDC) == []
    with pytest.raises(VerificationError) as raised:
        check_usdc_transfer(receipt, token=USDC, recipient=ESCROW, min_amount=25_000_000)
    assert code_of(raised) == 'payment_wrong_token'


def test_a_receipt_without_any_transfer_is_payment_wrong_token():
    approval = {'address': USDC, 'topics': [APPROVAL_TOPIC, word(PAYER), word(ESCROW)],
                'data': '0x' + format(25_000_000, '064x')}
    erc721 = {'address': USDC, 'topics': [TRANSFER_TOPIC, word(PAYER), word(ESCROW), '0x' + '0' * 63 + '1'],
              'data': '0x'}
    for logs in ([], [approval], [erc721]):
        with pytest.raises(VerificationError) as raised:
            check_usdc_transfer(make_receipt(logs=logs), token=USDC, recipient=ESCROW, min_amount=1)
        assert code_of(raised) == 'payment_wrong_token'


def test_a_transfer_to_someone_else_is_payment_wrong_recipient():
    with pytest.raises(VerificationError) as raised:
        check_usdc_transfer(paid(to=SOMEONE), token=USDC, recipient=ESCROW, min_amount=25_000_000)
    assert code_of(raised) == 'payment_wrong_recipient'
    assert SOMEONE in raised.value.message


def test_a_transfer_from_another_payer_is_payment_wrong_payer():
    with pytest.raises(VerificationError) as raised:
        check_usdc_transfer(paid(frm=SOMEONE), token=USDC, recipient=ESCROW, min_amount=25_000_000, payer=PAYER)
    assert code_of(raised) == 'payment_wrong_payer'
    ok = check_usdc_transfer(paid(), token=USDC, recipient=ESCROW, min_amount=25_000_000, payer=PAYER)
    assert ok == Transfer(PAYER, ESCROW, 25_000_000)


def test_too_little_is_payment_insufficient():
    with pytest.raises(VerificationError) as raised:
        check_usdc_transfer(paid(24_999_999), token=USDC, recipient=ESCROW, min_amount=25_000_000)
    assert code_of(raised) == 'payment_insufficient'
    assert '24999999' in raised.value.message and '25000000' in raised.value.message


def test_several_transfers_to_the_recipient_add_up_and_others_do_not_count():
    receipt = make_receipt(logs=[
        transfer_log(USDC, PAYER, ESCROW, 10_000_000),
        transfer_log(USDC, PAYER, SOMEONE, 50_000_000),            # to someone else: not counted
        transfer_log(OTHER_TOKEN, PAYER, ESCROW, 50_000_000),      # another token: not counted
        transfer_log(USDC, PAYER, ESCROW, 15_000_000),
    ])
    assert check_usdc_transfer(receipt, token=USDC, recipient=ESCROW,
                               min_amount=25_000_000) == Transfer(PAYER, ESCROW, 25_000_000)
    with pytest.raises(VerificationError) as raised:
        check_usdc_transfer(receipt, token=USDC, recipient=ESCROW, min_amount=25_000_001)
    assert code_of(raised) == 'payment_insufficient'


def test_the_payer_filter_adds_up_only_that_payers_transfers():
    receipt = make_receipt(logs=[transfer_log(USDC, PAYER, ESCROW, 20_000_000),
                                 transfer_log(USDC, SOMEONE, ESCROW, 20_000_000)])
    with pytest.raises(VerificationError) as raised:
        check_usdc_transfer(receipt, token=USDC, recipient=ESCROW, min_amount=25_000_000, payer=PAYER)
    assert code_of(raised) == 'payment_insufficient'
    assert check_usdc_transfer(receipt, token=USDC, recipient=ESCROW,
                               min_amount=40_000_000) == Transfer(PAYER, ESCROW, 40_000_000)


@pytest.mark.parametrize('second_payer', [PAYER, SOMEONE])
def test_one_transfer_refuses_several_transfers_to_the_recipient(second_payer):
    """A job's funding: only one sender can be refunded, so a second Transfer to escrow is payment_invalid."""
    receipt = make_receipt(logs=[transfer_log(USDC, PAYER, ESCROW, 25_000_000),
                                 transfer_log(USDC, second_payer, ESCROW, 1)])
    with pytest.raises(VerificationError) as raised:
        check_usdc_transfer(receipt, token=USDC, recipient=ESCROW, min_amount=1, one_transfer=True)
    assert code_of(raised) == 'payment_invalid'
    assert check_usdc_transfer(receipt, token=USDC, recipient=ESCROW, min_amount=1).amount == 25_000_001
    others = make_receipt(logs=[transfer_log(USDC, PAYER, SOMEONE, 50_000_000),       # not to escrow
                                transfer_log(OTHER_TOKEN, PAYER, ESCROW, 50_000_000),  # another token
                                transfer_log(USDC, PAYER, ESCROW, 25_000_000)])
    assert check_usdc_transfer(others, token=USDC, recipient=ESCROW, min_amount=25_000_000,
                               one_transfer=True) == Transfer(PAYER, ESCROW, 25_000_000)


def test_mixed_case_and_lowercase_addresses_compare_equal_checksummed():
    receipt = paid(token=USDC.lower())                           # a node may send the log address lowercase
    receipt['logs'][0]['topics'][1] = receipt['logs'][0]['topics'][1].upper().replace('0X', '0x')
    transfer = check_usdc_transfer(receipt, token=USDC.lower(), recipient=ESCROW.lower(), min_amount=25_000_000,
                                   payer='0x' + PAYER[2:].upper())
    assert transfer == Transfer(PAYER, ESCROW, 25_000_000)     # answered checksummed
    assert transfer.payer == '0x70997970C51812dc3A010C7d01b50e0d17dc79C8'
    assert check_usdc_transfer(paid(), token=USDC, recipient=ESCROW, min_amount=1).recipient == ESCROW


BAD_ADDRESSES = ['nope', '0x1234', ESCROW[:-1] + 'g', ESCROW.replace('f39F', 'F39f'), None, 42]


@pytest.mark.parametrize('where, bad', [(where, bad) for where in ('token', 'recipient', 'payer')
                                        for bad in BAD_ADDRESSES if (where, bad) != ('payer', None)])
def test_a_malformed_address_is_payment_invalid(where, bad):
    args = {'token': USDC, 'recipient': ESCROW, 'payer': PAYER, where: bad}
    with pytest.raises(VerificationError) as raised:
        check_usdc_transfer(paid(), min_amount=1, **args)
    assert code_of(raised) == 'payment_invalid'


def test_a_log_from_a_malformed_address_is_payment_invalid():
    receipt = paid()
    receipt['logs'][0]['address'] = 'not an address'
    with pytest.raises(VerificationError) as raised:
        check_usdc_transfer(receipt, token=USDC, recipient=ESCROW, min_amount=1)
    assert code_of(raised) == 'payment_invalid'


@pytest.mark.parametrize('data', ['0xnot-hex', 'garbage', '0x'])
def test_garbage_log_data_is_payment_invalid_never_a_bare_value_error(data):
    receipt = paid()
    receipt['logs'][0]['data'] = data
    with pytest.raises(Exception) as raised:
        check_usdc_transfer(receipt, token=USDC, recipient=ESCROW, min_amount=1)
    assert type(raised.value) is VerificationError
    assert not isinstance(raised.value, ValueError)
    assert code_of(raised) == 'payment_invalid'


def test_confirmations_count_the_receipts_own_block():
    assert check_confirmations(100, 101, 2) == 2
    assert check_confirmations(100, 100, 1) == 1
    assert check_confirmations(100, 150, 2) == 51
    with pytest.raises(VerificationError) as raised:
        check_confirmations(100, 100, 2)
    assert code_of(raised) == 'payment_pending'
    assert raised.value.retry_after == 2
    with pytest.raises(VerificationError) as raised:
        check_confirmations(100, 99, 2)          # the node is behind the block: nothing yet, 2 blocks to go
    assert code_of(raised) == 'payment_pending'
    assert raised.value.retry_after == 4
    with pytest.raises(VerificationError) as raised:
        check_confirmations(100, 102, 5)
    assert (code_of(raised), raised.value.retry_after) == ('payment_pending', 4)


def test_check_canonical():
    assert check_canonical(block_hash_of(100), block_hash_of(100).upper().replace('0X', '0x')) is None
    with pytest.raises(VerificationError) as raised:
        check_canonical(block_hash_of(100), block_hash_of(100, fork='b'))
    assert code_of(raised) == 'payment_reorged'
    with pytest.raises(VerificationError) as raised:
        check_canonical(block_hash_of(100), None)          # no block at that height any more
    assert code_of(raised) == 'payment_reorged'


def test_check_fresh():
    assert check_fresh(1_000, 1_000 + 3600, 3600) is None                 # exactly the window: still fresh
    assert check_fresh(1_000, 10**9, None) is None                        # no window
    with pytest.raises(VerificationError) as raised:
        check_fresh(1_000, 1_000 + 3601, 3600)
    assert code_of(raised) == 'payment_expired'
    assert '3600' in raised.value.message


def test_check_chain_id():
    assert check_chain_id(8453, 8453) is None
    assert check_chain_id(None, 8453) is None             # a legacy transaction carries no chain id
    with pytest.raises(VerificationError) as raised:
        check_chain_id(1, 8453)
    assert code_of(raised) == 'payment_wrong_chain'
    assert '1' in raised.value.message and '8453' in raised.value.message
    with pytest.raises(VerificationError) as raised:
        check_chain_id(84532, 8453)
    assert code_of(raised) == 'payment_wrong_chain'


def test_errors_carry_their_code_and_chain_unavailable_is_a_verification_error():
    error = VerificationError('x')
    assert (error.code, error.message, error.retry_after) == ('payment_invalid', 'x', None)
    down = ChainUnavailable('down')
    assert isinstance(down, VerificationError) and down.code == 'chain_unavailable'


# ----- payouts: signing with eth-account -----

def test_escrow_address_of_anvils_first_dev_key():
    assert escrow_address(ESCROW_KEY) == ESCROW
    assert escrow_address(ESCROW_KEY[2:]) == ESCROW


def sign(**overrides):
    args = dict(token=USDC, to=PAYER, amount=25_000_000, nonce=7, chain_id=BASE_CHAIN,
                max_fee_per_gas=2 * 10**9, max_priority_fee_per_gas=10**6)
    args.update(overrides)
    return sign_usdc_transfer(ESCROW_KEY, **args)


def decode(raw):
    """A signed raw transaction as a dict (chainId, nonce, to, data, ... and type)."""
    return TypedTransaction.from_bytes(HexBytes(raw)).as_dict()


def transfer_data(to, amount):
    return TRANSFER + to[2:].lower().rjust(64, '0') + format(amount, '064x')


def test_a_signed_payout_is_an_eip1559_usdc_transfer_from_escrow():
    raw, tx_hash = sign()
    assert raw.startswith('0x02') and len(tx_hash) == 66
    assert tx_hash == '0x' + keccak(HexBytes(raw)).hex()
    assert Account.recover_transaction(raw) == ESCROW
    tx = decode(raw)
    assert tx['type'] == 2
    assert tx['chainId'] == BASE_CHAIN
    assert tx['nonce'] == 7
    assert tx['to'] == HexBytes(USDC)
    assert tx['value'] == 0
    assert tx['gas'] == TRANSFER_GAS == 100_000
    assert (tx['maxFeePerGas'], tx['maxPriorityFeePerGas']) == (2 * 10**9, 10**6)
    assert HexBytes(tx['data']).hex() == transfer_data(PAYER, 25_000_000)[2:]
    assert HexBytes(tx['data'])[:4] == bytes.fromhex('a9059cbb')


def test_signing_is_deterministic_and_depends_on_every_input():
    raw, tx_hash = sign()
    assert sign() == (raw, tx_hash)
    assert sign(to=PAYER.lower()) == (raw, tx_hash)        # the same payee in another case
    others = {sign(nonce=8)[1], sign(amount=25_000_001)[1], sign(to=SOMEONE)[1], sign(chain_id=84532)[1],
              sign(token=OTHER_TOKEN)[1]}
    assert tx_hash not in others and len(others) == 5


@pytest.mark.parametrize('bad', [{'to': 'nope'}, {'to': '0x1234'}, {'to': ESCROW.replace('f39F', 'F39f')},
                                 {'token': 'usdc'}])
def test_a_bad_recipient_or_token_is_a_verification_error(bad):
    with pytest.raises(VerificationError) as raised:
        sign(**bad)
    assert code_of(raised) == 'payment_invalid'


# ----- the funding signature (verifier/funding.py) -----

ACCOUNT = '5b1e8a0c-3f7d-4c2a-9e61-0d4b7a2c9f10'
FUNDED = tx_hash_of('funding')
PAYER_KEY = DEV_KEYS[1]


def check_signature(signature, **overrides):
    args = dict(payer=PAYER, account=ACCOUNT, tx_hash=FUNDED, chain_id=BASE_CHAIN, escrow=ESCROW)
    args.update(overrides)
    return check_funding_signature(signature, **args)


def refused(signature, **overrides):
    with pytest.raises(VerificationError) as raised:
        check_signature(signature, **overrides)
    assert type(raised.value) is VerificationError
    assert code_of(raised) == 'payment_signature_invalid'
    return raised.value


def test_the_funding_typed_data_is_plain_json_as_a_client_writes_it():
    typed_data = server_typed_data(account=ACCOUNT, tx_hash=FUNDED.upper().replace('0X', '0x'), chain_id=BASE_CHAIN,
                                   escrow=ESCROW.lower())
    assert typed_data == funding_typed_data(ACCOUNT, FUNDED, ESCROW)
    assert json.loads(json.dumps(typed_data)) == typed_data
    assert typed_data['domain'] == {'name': 'Job Marketplace', 'version': '1', 'chainId': 8453,
                                    'verifyingContract': ESCROW}
    assert typed_data['types']['Funding'] == [{'name': 'account', 'type': 'string'},
                                              {'name': 'txHash', 'type': 'bytes32'}]
    assert (typed_data['primaryType'], typed_data['message']) == ('Funding', {'account': ACCOUNT, 'txHash': FUNDED})
    unsigned = server_typed_data(account=ACCOUNT, tx_hash=None, chain_id=84532, escrow=ESCROW)
    assert unsigned['message'] == {'account': ACCOUNT, 'txHash': None}
    assert unsigned['domain']['chainId'] == 84532


def test_a_funding_signed_by_the_transfers_sender_recovers_to_it():
    signature = sign_funding(PAYER_KEY, ACCOUNT, FUNDED, ESCROW)
    assert check_signature(signature) == PAYER
    assert check_signature(signature, payer=PAYER.lower(), escrow=ESCROW.lower(),
                           tx_hash=FUNDED.upper().replace('0X', '0x')) == PAYER
    raw = bytes.fromhex(signature[2:])
    assert check_signature('0x' + (raw[:64] + bytes([raw[64] - 27])).hex()) == PAYER      # v as 0 or 1


def test_a_funding_signed_by_anyone_else_is_refused():
    assert PAYER in refused(sign_funding(DEV_KEYS[2], ACCOUNT, FUNDED, ESCROW)).message
    refused(sign_funding(ESCROW_KEY, ACCOUNT, FUNDED, ESCROW))


@pytest.mark.parametrize('signed, checked', [
    ({'account': 'b0e0c1f5-0000-4000-8000-000000000000'}, {}),          # another account in the message
    ({'tx_hash': tx_hash_of('another transfer')}, {}),                   # another transaction
    ({'chain_id': 84532}, {}),                                           # another chain
    ({'escrow': SOMEONE}, {}),                                           # another escrow address
    ({}, {'account': ACCOUNT.upper()}),                                  # the account is compared exactly
])
def test_a_signature_of_other_terms_is_refused(signed, checked):
    terms = dict(account=ACCOUNT, tx_hash=FUNDED, escrow=ESCROW, chain_id=BASE_CHAIN)
    terms.update(signed)
    signature = sign_funding(PAYER_KEY, terms['account'], terms['tx_hash'], terms['escrow'], terms['chain_id'])
    refused(signature, **checked)


GOOD_SIGNATURE = sign_funding(PAYER_KEY, ACCOUNT, FUNDED, ESCROW)


@pytest.mark.parametrize('bad', [
    None, 42, b'\x00' * 65, '', '0x', GOOD_SIGNATURE[2:], GOOD_SIGNATURE[:-2], GOOD_SIGNATURE + '00',
    GOOD_SIGNATURE[:-1] + 'g', GOOD_SIGNATURE + '\n',
    GOOD_SIGNATURE[:-2] + '1d',                                          # v 29
    GOOD_SIGNATURE[:66] + 'ff' * 32 + GOOD_SIGNATURE[-2:],               # s in the upper half
    '0x' + '00' * 64 + '1b',                                             # r = s = 0: recovers to no one
])
def test_a_malformed_signature_is_payment_signature_invalid_never_a_bare_error(bad):
    refused(bad)


@pytest.mark.parametrize('overrides', [{'tx_hash': None}, {'tx_hash': '0x1234'}, {'account': None},
                                       {'escrow': 'nope'}])
def test_malformed_terms_are_payment_signature_invalid(overrides):
    refused(GOOD_SIGNATURE, **overrides)


# ----- a fake JSON-RPC node (responses) -----

def node_log(log, receipt, index):
    return dict(log, blockNumber=hex(receipt['blockNumber']), blockHash=receipt['blockHash'],
                transactionHash=receipt['transactionHash'], transactionIndex='0x0', logIndex=hex(index),
                removed=False)


def node_receipt(receipt, frm=PAYER, to=USDC):
    """A plain receipt in the JSON-RPC form a node answers eth_getTransactionReceipt with."""
    return {'transactionHash': receipt['transactionHash'], 'transactionIndex': '0x0',
            'blockHash': receipt['blockHash'], 'blockNumber': hex(receipt['blockNumber']),
            'from': frm.lower(), 'to': to.lower(), 'cumulativeGasUsed': '0xb5c8', 'gasUsed': '0xb5c8',
            'effectiveGasPrice': '0x3b9aca00', 'contractAddress': None, 'type': '0x2',
            'logsBloom': '0x' + '00' * 256, 'status': hex(receipt['status']),
            'logs': [node_log(log, receipt, i) for i, log in enumerate(receipt['logs'])]}


class FakeNode:
    """A JSON-RPC node in memory, answering POSTs to NODE_URL by method (install it in a RequestsMock).

    Every call is recorded in `calls` as (method, params); `sent` holds the raw transactions it took.
    `fail` (an exception) is raised for every call, as a node that is down or slow; `answers` maps a
    method to a function (params -> (status, body text)) that answers instead of the node.
    """

    def __init__(self, chain_id=BASE_CHAIN, latest=101, nonce=0, base_fee=5 * 10**8, tip=10**6):
        self.chain_id = chain_id
        self.latest = latest
        self.nonce = nonce
        self.base_fee = base_fee
        self.tip = tip
        self.receipts = {}          # lowercase hash -> JSON receipt
        self.transactions = {}      # lowercase hash -> JSON transaction
        self.blocks = {}            # number -> {'hash', 'timestamp'}
        self.balances = {}          # (token, holder) lowercase -> base units
        self.calls = []
        self.requests = []
        self.sent = []
        self.send_error = None      # the message of a JSON-RPC error for eth_sendRawTransaction
        self.fail = None
        self.answers = {}

    def install(self, mock):
        mock.add_callback(responses.POST, NODE_URL, callback=self.callback)
        return self

    def count(self, method):
        return sum(1 for name, _ in self.calls if name == method)

    def methods(self):
        return [name for name, _ in self.calls]

    def block(self, number):
        """The block at a height (made up on first use: a fresh timestamp, a hash of its number)."""
        return self.blocks.setdefault(number, {'hash': block_hash_of(number), 'timestamp': int(time.time()) - 60})

    def add(self, receipt, *, chain_id=None, timestamp=None, frm=PAYER):
        """Put a mined transaction (a plain receipt) on the chain; its hash."""
        tx_hash = receipt['transactionHash'].lower()
        block = self.block(receipt['blockNumber'])
        if timestamp is not None:
            block['timestamp'] = timestamp
        self.receipts[tx_hash] = node_receipt(receipt, frm=frm)
        self.transactions[tx_hash] = {
            'hash': tx_hash, 'type': '0x2', 'chainId': hex(self.chain_id if chain_id is None else chain_id),
            'nonce': '0x0', 'from': frm.lower(), 'to': USDC.lower(), 'value': '0x0', 'gas': '0x186a0',
            'maxFeePerGas': '0x3b9aca00', 'maxPriorityFeePerGas': '0xf4240', 'input': '0x',
            'blockNumber': hex(receipt['blockNumber']), 'blockHash': receipt['blockHash'], 'transactionIndex': '0x0',
            'accessList': [], 'v': '0x0', 'r': '0x1', 's': '0x1', 'yParity': '0x0'}
        return tx_hash

    def pay(self, amount=25_000_000, *, token=USDC, frm=PAYER, to=ESCROW, status=1, block=100, label=None,
            block_hash=None, chain_id=None, timestamp=None):
        """A mined USDC transfer; its hash."""
        logs = [transfer_log(token, frm, to, amount)] if status == 1 else []      # a revert leaves no logs
        receipt = make_receipt(status=status, block=block, logs=logs, block_hash=block_hash,
                               tx_hash=tx_hash_of(label or f'{len(self.receipts)}:{amount}:{frm}:{to}:{token}'))
        return self.add(receipt, chain_id=chain_id, timestamp=timestamp, frm=frm)

    def result(self, method, params):
        if method == 'eth_chainId':
            return hex(self.chain_id)
        if method == 'eth_blockNumber':
            return hex(self.latest)
        if method == 'eth_getBlockByNumber':
            number = self.latest if params[0] == 'latest' else int(params[0], 16)
            if number > self.latest:
                return None
            block = self.block(number)
            return {'number': hex(number), 'hash': block['hash'], 'parentHash': block_hash_of(number - 1),
                    'timestamp': hex(block['timestamp']), 'baseFeePerGas': hex(self.base_fee),
                    'gasLimit': '0x1c9c380', 'gasUsed': '0x0', 'miner': '0x' + '00' * 20, 'extraData': '0x',
                    'logsBloom': '0x' + '00' * 256, 'transactions': [], 'uncles': []}
        if method == 'eth_getTransactionReceipt':
            return self.receipts.get(params[0].lower())
        if method == 'eth_getTransactionByHash':
            return self.transactions.get(params[0].lower())
        if method == 'eth_getTransactionCount':
            return hex(self.nonce)
        if method == 'eth_maxPriorityFeePerGas':
            return hex(self.tip)
        if method == 'eth_call':
            call = params[0]
            holder = '0x' + call['data'][-40:]
            return '0x' + format(self.balances.get((call['to'].lower(), holder.lower()), 0), '064x')
        if method == 'eth_sendRawTransaction':
            self.sent.append(params[0])
            if self.send_error:
                raise RPCFailure(self.send_error)
            return '0x' + keccak(HexBytes(params[0])).hex()
        raise RPCFailure(f'the method {method} does not exist/is not available', -32601)

    def callback(self, request):
        body = json.loads(request.body)
        method, params = body['method'], body.get('params') or []
        self.calls.append((method, params))
        self.requests.append(request)
        if self.fail is not None:
            raise self.fail
        if method in self.answers:
            return self.answers[method](params)
        try:
            answer = {'jsonrpc': '2.0', 'id': body['id'], 'result': self.result(method, params)}
        except RPCFailure as failure:
            answer = {'jsonrpc': '2.0', 'id': body['id'], 'error': {'code': failure.code, 'message': str(failure)}}
        return 200, {'Content-Type': 'application/json'}, json.dumps(answer)


class RPCFailure(Exception):
    def __init__(self, message, code=-32000):
        super().__init__(message)
        self.code = code


@pytest.fixture
def node():
    """A FakeNode at NODE_URL; any other HTTP request fails (responses lets nothing through)."""
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        yield FakeNode().install(mock)


@pytest.fixture
def chain():
    return Chain(NODE_URL)


def verify(chain, tx_hash, **overrides):
    args = dict(chain_id=BASE_CHAIN, token=USDC, recipient=ESCROW, min_amount=25_000_000, confirmations=2,
                max_age_seconds=3600)
    args.update(overrides)
    return chain.verify_usdc_payment(tx_hash, **args)


# ----- the chain boundary -----

def test_plain_receipt_turns_web3s_answer_into_the_checks_form():
    receipt = plain_receipt({'transactionHash': HexBytes(tx_hash_of('a')), 'status': 1, 'blockNumber': 100,
                             'blockHash': HexBytes(block_hash_of(100)),
                             'logs': [{'address': USDC, 'topics': [HexBytes(TRANSFER_TOPIC), HexBytes(word(PAYER)),
                                                                   HexBytes(word(ESCROW))],
                                       'data': HexBytes(format(25_000_000, '064x'))}]})
    assert receipt == paid(tx_hash=tx_hash_of('a'))


def test_verify_usdc_payment_end_to_end(node, chain):
    tx_hash = node.pay(25_000_000)
    assert verify(chain, tx_hash) == Transfer(PAYER, ESCROW, 25_000_000)
    # one call per question, no retries, no other method
    assert node.methods() == ['eth_getTransactionReceipt', 'eth_getTransactionByHash', 'eth_blockNumber',
                              'eth_getBlockByNumber', 'eth_getBlockByNumber']
    assert node.calls[0][1] == [tx_hash]
    assert node.calls[3][1] == ['0x64', False]
    assert node.calls[4][1] == ['latest', False]        # the chain's own clock, for the age check
    assert all(request.req_kwargs['timeout'] == 10 for request in node.requests)   # the 10 s time-out


def test_verify_answers_checksummed_addresses_for_lowercase_input(node, chain):
    tx_hash = node.pay(30_000_000)
    transfer = verify(chain, tx_hash.upper().replace('0X', '0x'), token=USDC.lower(), recipient=ESCROW.lower(),
                      payer=PAYER.lower())
    assert transfer == Transfer(PAYER, ESCROW, 30_000_000)


def test_verify_an_unknown_hash_is_payment_not_found(node, chain):
    with pytest.raises(VerificationError) as raised:
        verify(chain, tx_hash_of('never mined'))
    assert code_of(raised) == 'payment_not_found'
    assert raised.value.retry_after == 2
    assert node.methods() == ['eth_getTransactionReceipt']


def test_verify_a_transaction_signed_for_another_chain_is_payment_wrong_chain(node, chain):
    tx_hash = node.pay(chain_id=1)
    with pytest.raises(VerificationError) as raised:
        verify(chain, tx_hash)
    assert code_of(raised) == 'payment_wrong_chain'
    assert node.count('eth_getTransactionByHash') == 1


def test_verify_too_few_confirmations_is_payment_pending(node, chain):
    tx_hash = node.pay(block=100)
    node.latest = 100
    with pytest.raises(VerificationError) as raised:
        verify(chain, tx_hash)
    assert (code_of(raised), raised.value.retry_after) == ('payment_pending', 2)
    assert node.count('eth_blockNumber') == 1
    node.latest = 101
    assert verify(chain, tx_hash).amount == 25_000_000


def test_verify_a_block_hash_that_differs_from_the_receipts_is_payment_reorged(node, chain):
    tx_hash = node.pay(block=100, block_hash=block_hash_of(100, fork='orphaned'))
    with pytest.raises(VerificationError) as raised:
        verify(chain, tx_hash)
    assert code_of(raised) == 'payment_reorged'
    assert node.count('eth_getBlockByNumber') == 1


def test_verify_a_receipt_whose_block_is_gone_is_payment_reorged(node, chain):
    tx_hash = node.pay(block=100)
    node.answers['eth_getBlockByNumber'] = lambda params: (200, {}, json.dumps(
        {'jsonrpc': '2.0', 'id': 1, 'result': None}))
    with pytest.raises(VerificationError) as raised:
        verify(chain, tx_hash)
    assert code_of(raised) == 'payment_reorged'


def test_verify_too_old_is_payment_expired(node, chain):
    tx_hash = node.pay(timestamp=int(time.time()) - 7200)
    with pytest.raises(VerificationError) as raised:
        verify(chain, tx_hash, max_age_seconds=3600)
    assert code_of(raised) == 'payment_expired'
    assert verify(chain, tx_hash, max_age_seconds=None).amount == 25_000_000
    # Too old by the chain's clock (its head is recent) even when the server's clock says otherwise ...
    with pytest.raises(VerificationError) as raised:
        verify(chain, tx_hash, max_age_seconds=3600, now=int(time.time()) - 7000)
    assert code_of(raised) == 'payment_expired'
    # ... and fresh only when both clocks agree.
    node.block(node.latest)['timestamp'] = int(time.time()) - 7000
    assert verify(chain, tx_hash, max_age_seconds=3600, now=int(time.time()) - 7000).amount == 25_000_000


@pytest.mark.parametrize('kind, code', [('token', 'payment_wrong_token'), ('recipient', 'payment_wrong_recipient'),
                                        ('amount', 'payment_insufficient'), ('reverted', 'payment_reverted'),
                                        ('payer', 'payment_wrong_payer')])
def test_verify_runs_every_check_of_the_receipt(node, chain, kind, code):
    tx_hash = {'token': lambda: node.pay(token=OTHER_TOKEN), 'recipient': lambda: node.pay(to=SOMEONE),
               'amount': lambda: node.pay(24_990_000), 'reverted': lambda: node.pay(status=0),
               'payer': lambda: node.pay(frm=SOMEONE)}[kind]()
    with pytest.raises(VerificationError) as raised:
        verify(chain, tx_hash, payer=PAYER)
    assert code_of(raised) == code
    assert node.count('eth_getTransactionReceipt') == 1


@pytest.mark.parametrize('failure', [requests.exceptions.ReadTimeout('read timed out'),
                                     requests.exceptions.ConnectTimeout('connect timed out'),
                                     requests.exceptions.ConnectionError('connection refused')])
def test_a_node_that_is_down_or_slow_is_chain_unavailable_without_retries(node, chain, failure):
    node.fail = failure
    with pytest.raises(Exception) as raised:
        verify(chain, tx_hash_of('any'))
    assert type(raised.value) is ChainUnavailable
    assert code_of(raised) == 'chain_unavailable'
    assert not isinstance(raised.value, requests.exceptions.RequestException)
    assert type(raised.value).__module__ == 'verifier.errors'
    assert node.methods() == ['eth_getTransactionReceipt']           # asked once, never again
    for call in (chain.chain_id, chain.block_number, lambda: chain.block(100), lambda: chain.nonce(ESCROW),
                 chain.fee_caps, lambda: chain.token_balance(USDC, ESCROW), lambda: chain.send_raw(sign()[0]),
                 lambda: chain.receipt(tx_hash_of('any')), lambda: chain.transaction_chain_id(tx_hash_of('any'))):
        before = len(node.calls)
        with pytest.raises(ChainUnavailable):
            call()
        assert len(node.calls) == before + 1


def answering(text, status=200):
    return lambda params: (status, {'Content-Type': 'application/json'}, text)


GARBAGE = {
    'not JSON': answering('<html>502 Bad Gateway</html>'),
    'an HTTP error': answering('{"error": "overloaded"}', status=503),
    'JSON without result': answering('{"jsonrpc": "2.0", "id": 0}'),
    'a JSON-RPC error': answering('{"jsonrpc": "2.0", "id": 0, "error": {"code": -32603, "message": "internal"}}'),
    'a string result': answering('{"jsonrpc": "2.0", "id": 0, "result": "hello"}'),
}


@pytest.mark.parametrize('garbage', sorted(GARBAGE))
def test_a_node_answering_garbage_is_chain_unavailable(node, chain, garbage):
    node.answers['eth_getTransactionReceipt'] = GARBAGE[garbage]
    with pytest.raises(Exception) as raised:
        verify(chain, tx_hash_of('any'))
    assert type(raised.value) is ChainUnavailable
    assert node.count('eth_getTransactionReceipt') == 1


@pytest.mark.parametrize('missing', ['status', 'blockHash', 'blockNumber', 'logs', 'transactionHash'])
def test_a_receipt_missing_fields_is_chain_unavailable(node, chain, missing):
    tx_hash = node.pay()
    del node.receipts[tx_hash][missing]
    with pytest.raises(Exception) as raised:
        verify(chain, tx_hash)
    assert type(raised.value) is ChainUnavailable
    assert code_of(raised) == 'chain_unavailable'


def test_a_receipt_log_missing_topics_is_chain_unavailable(node, chain):
    tx_hash = node.pay()
    del node.receipts[tx_hash]['logs'][0]['topics']
    with pytest.raises(Exception) as raised:
        verify(chain, tx_hash)
    assert type(raised.value) is ChainUnavailable


@pytest.mark.parametrize('method', ['eth_chainId', 'eth_blockNumber', 'eth_getTransactionCount',
                                    'eth_maxPriorityFeePerGas'])
@pytest.mark.parametrize('result', [None, {'number': '0x1'}])
def test_a_number_answered_as_null_or_an_object_is_chain_unavailable(node, chain, method, result):
    """CONTRACT.md 7: anything the node answers that is not an answer is chain_unavailable, never a bare
    TypeError (which the service would turn into a 500, or a crash at start)."""
    node.answers[method] = answering(json.dumps({'jsonrpc': '2.0', 'id': 0, 'result': result}))
    ask = {'eth_chainId': chain.chain_id, 'eth_blockNumber': chain.block_number,
           'eth_getTransactionCount': lambda: chain.nonce(ESCROW), 'eth_maxPriorityFeePerGas': chain.fee_caps}[method]
    with pytest.raises(Exception) as raised:
        ask()
    assert type(raised.value) is ChainUnavailable


@pytest.mark.parametrize('missing', ['hash', 'timestamp', 'number'])
def test_a_block_missing_fields_is_chain_unavailable(node, chain, missing):
    tx_hash = node.pay()
    original = node.result

    def result(method, params):
        answer = original(method, params)
        if method == 'eth_getBlockByNumber':
            del answer[missing]
        return answer
    node.result = result
    with pytest.raises(Exception) as raised:
        verify(chain, tx_hash)
    assert type(raised.value) is ChainUnavailable


# ----- receipts read within bounds (CONTRACT.md 20) -----

def with_logs(node, count, data_bytes=32):
    """A mined transfer of 25 USDC to escrow among `count` logs (the others Approvals of another token); its hash."""
    other = {'address': OTHER_TOKEN, 'topics': [APPROVAL_TOPIC, word(PAYER), word(ESCROW)],
             'data': '0x' + '00' * data_bytes}
    return node.add(make_receipt(logs=[transfer_log(USDC, PAYER, ESCROW, 25_000_000)] + [other] * (count - 1),
                                 tx_hash=tx_hash_of(f'{count} logs of {data_bytes} bytes')))


def test_a_receipt_of_256_logs_is_read_and_one_of_257_is_payment_invalid_unread(node, chain):
    assert verify(chain, with_logs(node, 256)).amount == 25_000_000
    asked = len(node.calls)
    with pytest.raises(VerificationError) as raised:
        verify(chain, with_logs(node, 257))
    assert (code_of(raised), raised.value.message) == (
        'payment_invalid', 'The transaction emitted 257 logs; a payment is read with at most 256.')
    assert node.methods()[asked:] == ['eth_getTransactionReceipt']       # nothing more was asked


def test_a_receipt_over_1_mib_is_payment_invalid(node, chain):
    tx_hash = with_logs(node, 100, data_bytes=6_000)        # 100 logs, 1.2 MB of hex
    with pytest.raises(VerificationError) as raised:
        verify(chain, tx_hash)
    assert code_of(raised) == 'payment_invalid'
    assert raised.value.message == ("The node's answer to eth_getTransactionReceipt is over 1048576 bytes; a "
                                    "payment is read with at most 1048576.")
    assert node.methods() == ['eth_getTransactionReceipt']
    assert verify(chain, with_logs(node, 100, data_bytes=4_000)).amount == 25_000_000     # 0.8 MB: read


def test_a_hash_refused_for_its_size_is_refused_for_an_hour_per_chain_without_asking_the_node(node, chain,
                                                                                             monkeypatch):
    import verifier.chain
    tx_hash = with_logs(node, 300)
    for again in (tx_hash, tx_hash, tx_hash.upper().replace('0X', '0x')):
        with pytest.raises(VerificationError) as raised:
            verify(chain, again)
        assert code_of(raised) == 'payment_invalid'
    assert node.count('eth_getTransactionReceipt') == 1
    with pytest.raises(VerificationError):          # on another chain it is another transaction: asked
        verify(chain, tx_hash, chain_id=84532)
    assert node.count('eth_getTransactionReceipt') == 2
    later = time.monotonic() + 3601
    monkeypatch.setattr(verifier.chain, 'time', type('Clock', (), {'monotonic': staticmethod(lambda: later),
                                                                  'time': staticmethod(time.time)}))
    with pytest.raises(VerificationError):          # an hour later: asked again
        verify(chain, tx_hash)
    assert node.count('eth_getTransactionReceipt') == 3


def test_a_proof_naming_a_receipt_too_large_fails_found_and_every_later_check(node, chain):
    """The x402 form-1 path (all checks recorded, none raised): payment_invalid, 402 on a priced call."""
    checks = Checks(TRANSFER_CHECKS)
    tx_hash = with_logs(node, 1_000)
    assert chain.check_transfer(checks, tx_hash, chain_id=BASE_CHAIN, token=USDC, recipient=ESCROW,
                                min_amount=25_000_000, payer=PAYER) is None
    assert checks.as_dict() == {name: False for name in TRANSFER_CHECKS}
    assert checks.error.code == 'payment_invalid'
    assert node.methods() == ['eth_getTransactionReceipt']


def test_receipt_and_transaction_chain_id(node, chain):
    assert chain.receipt(tx_hash_of('unknown')) is None
    assert chain.transaction_chain_id(tx_hash_of('unknown')) is None
    tx_hash = node.pay(30_000_000)
    assert chain.receipt(tx_hash) == paid(30_000_000, tx_hash=tx_hash)
    assert chain.transaction_chain_id(tx_hash) == BASE_CHAIN
    del node.transactions[tx_hash]['chainId']        # a legacy transaction
    node.transactions[tx_hash]['type'] = '0x0'
    node.transactions[tx_hash]['gasPrice'] = '0x3b9aca00'
    assert chain.transaction_chain_id(tx_hash) is None


def test_chain_id_block_number_block_and_nonce(node, chain):
    node.nonce, node.latest = 7, 150
    assert chain.chain_id() == BASE_CHAIN
    assert chain.block_number() == 150
    block = chain.block(120)
    assert block == {'number': 120, 'hash': block_hash_of(120), 'timestamp': node.blocks[120]['timestamp'],
                     'baseFeePerGas': 5 * 10**8}
    assert chain.block('latest')['number'] == 150
    assert chain.block(151) is None                  # not mined yet
    assert chain.nonce(ESCROW.lower()) == 7
    assert node.calls[-1] == ('eth_getTransactionCount', [ESCROW, 'pending'])


def test_fee_caps_are_twice_the_base_fee_plus_the_tip(node, chain):
    node.base_fee, node.tip = 5 * 10**8, 10**6
    assert chain.fee_caps() == (2 * 5 * 10**8 + 10**6, 10**6)
    assert node.methods() == ['eth_maxPriorityFeePerGas', 'eth_getBlockByNumber']
    assert node.calls[1][1] == ['latest', False]
    node.base_fee = 0
    assert chain.fee_caps() == (10**6, 10**6)


def test_token_balance_calls_balance_of(node, chain):
    node.balances[(USDC.lower(), ESCROW.lower())] = 1_234_567
    assert chain.token_balance(USDC, ESCROW.lower()) == 1_234_567
    assert chain.token_balance(USDC, PAYER) == 0
    calls = [params for method, params in node.calls if method == 'eth_call']
    assert len(calls) == 2
    assert calls[0][0] == {'to': USDC, 'data': '0x70a08231' + ESCROW[2:].lower().rjust(64, '0')}
    node.answers['eth_call'] = answering('{"jsonrpc": "2.0", "id": 0, "result": "0x"}')
    assert chain.token_balance(USDC, ESCROW) == 0


def test_send_raw_broadcasts_once(node, chain):
    raw, tx_hash = sign()
    assert chain.send_raw(raw) is True
    assert node.sent == [raw]
    assert node.count('eth_sendRawTransaction') == 1


@pytest.mark.parametrize('message', ['already known', 'nonce too low', 'Known transaction: 0x1234',
                                     'transaction already imported', 'ALREADY KNOWN'])
def test_send_raw_treats_already_known_and_nonce_too_low_as_taken(node, chain, message):
    node.send_error = message
    raw, _ = sign()
    assert chain.send_raw(raw) is True
    assert node.count('eth_sendRawTransaction') == 1


@pytest.mark.parametrize('message, error', [
    ('insufficient funds for gas * price + value', ChainUnavailable),
    ('replacement transaction underpriced', FeeTooLow),         # a ChainUnavailable that OnChain re-prices
    ('max fee per gas less than block base fee', FeeTooLow),
    ('transaction underpriced', FeeTooLow),
])
def test_send_raw_refused_is_chain_unavailable_without_retries(node, chain, message, error):
    node.send_error = message
    with pytest.raises(Exception) as raised:
        chain.send_raw(sign()[0])
    assert type(raised.value) is error and isinstance(raised.value, ChainUnavailable)
    assert node.count('eth_sendRawTransaction') == 1


def test_the_fake_node_lets_nothing_else_through(node):
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.post('http://elsewhere.test/', json={}, timeout=1)
