"""The JobEscrow contract (contracts/JobEscrow.sol, CONTRACT.md sections 21 and 25): its calls encoded and signed with the
arbiter's key, its state read at a block, and the typed data payers sign. Nothing is sent from here: the caller
stores a signed transaction before broadcasting it (the payouts' rule: a crash between the two sends the same one).
"""

import json
import sys
from functools import lru_cache
from pathlib import Path

_recursion_limit = sys.getrecursionlimit()
from eth_abi import encode  # noqa: E402
from eth_account import Account  # noqa: E402
from eth_account.messages import encode_typed_data  # noqa: E402
from web3 import Web3  # noqa: E402
sys.setrecursionlimit(_recursion_limit)     # importing eth_account raises it to 100000: deep input could then crash us

from verifier.checks import checksummed  # noqa: E402
from verifier.funding import HALF_CURVE_ORDER  # noqa: E402

ARTIFACT = Path(__file__).resolve().parent.parent / 'contracts' / 'JobEscrow.json'
CALL_GAS = 250_000          # refund, release, execute of one payee, reclaim, depositWithAuthorization
GAS_PER_PAYEE = 60_000      # propose and execute, per payee beyond the first
DEPLOY_GAS = 2_500_000
DOMAIN_VERSION = '2'        # the Release that both the payer and the arbiter sign, naming the claim (CONTRACT 25)
RELEASE_TYPES = {'Release': [{'name': 'id', 'type': 'bytes32'}, {'name': 'claim', 'type': 'bytes32'},
                             {'name': 'payee', 'type': 'address'}, {'name': 'amount', 'type': 'uint256'},
                             {'name': 'fee', 'type': 'uint256'}]}
RECEIVE_TYPES = {'ReceiveWithAuthorization': [
    {'name': 'from', 'type': 'address'}, {'name': 'to', 'type': 'address'}, {'name': 'value', 'type': 'uint256'},
    {'name': 'validAfter', 'type': 'uint256'}, {'name': 'validBefore', 'type': 'uint256'},
    {'name': 'nonce', 'type': 'bytes32'}]}
EIP712_DOMAIN = [{'name': 'name', 'type': 'string'}, {'name': 'version', 'type': 'string'},
                 {'name': 'chainId', 'type': 'uint256'}, {'name': 'verifyingContract', 'type': 'address'}]


@lru_cache(maxsize=1)
def artifact():
    return json.loads(ARTIFACT.read_text())


@lru_cache(maxsize=1)
def _abi_only():
    return Web3().eth.contract(abi=artifact()['abi'])


def _bytes32(value, what):
    raw = bytes.fromhex(value[2:]) if isinstance(value, str) and value.startswith('0x') else value
    if not isinstance(raw, bytes) or len(raw) != 32:
        raise ValueError(f'{what} must be 32 bytes')
    return raw


def account_hash(account_id):
    """What a deposit names of the posting account: keccak256 of its id as UTF-8 ('0x' + 64 hex digits)."""
    return Web3.keccak(text=account_id).to_0x_hex()


def claim_hash(claim_id):
    """What a Release names of the claim it pays: keccak256 of the claim's id as UTF-8 ('0x' + 64 hex digits)."""
    return Web3.keccak(text=claim_id).to_0x_hex()


def deposit_id(payer, account, refund_after, salt):
    """keccak256(abi.encode(payer, account, refundAfter, salt)), as the contract computes it."""
    encoded = encode(['address', 'bytes32', 'uint64', 'bytes32'],
                     [checksummed(payer, 'payer'), _bytes32(account, 'account'), int(refund_after),
                      _bytes32(salt, 'salt')])
    return Web3.keccak(encoded).to_0x_hex()


def _abi_value(value):
    """An argument as web3 encodes it: addresses checksummed, bytes32 and signatures given in hex as bytes."""
    if isinstance(value, list):
        return [_abi_value(item) for item in value]
    if isinstance(value, str) and value.startswith('0x'):
        return checksummed(value, 'address') if len(value) == 42 else bytes.fromhex(value[2:])
    return value


def call_data(function, *args):
    """The calldata of one of the contract's functions ('0x...'); hex strings are taken as addresses (42
    characters) or bytes."""
    return _abi_only().encode_abi(function, args=[_abi_value(arg) for arg in args])


def sign_call(private_key, *, contract, data, nonce, chain_id, max_fee_per_gas, max_priority_fee_per_gas,
              gas=CALL_GAS):
    """A signed EIP-1559 call of the contract: (raw transaction hex, transaction hash hex). Nothing is sent."""
    signed = Account.sign_transaction({
        'type': 2, 'chainId': int(chain_id), 'nonce': int(nonce), 'to': checksummed(contract, 'escrow contract'),
        'value': 0, 'data': data, 'gas': int(gas), 'maxFeePerGas': int(max_fee_per_gas),
        'maxPriorityFeePerGas': int(max_priority_fee_per_gas)}, private_key)
    return signed.raw_transaction.to_0x_hex(), signed.hash.to_0x_hex()


def sign_deploy(private_key, *, token, arbiter, guardian, fee_recipient, max_fee_bps, arbiter_delay, nonce,
                chain_id, max_fee_per_gas, max_priority_fee_per_gas, gas=DEPLOY_GAS):
    """A signed creation of the contract: (raw hex, transaction hash hex). The contract's address is in the receipt."""
    constructor = Web3().eth.contract(abi=artifact()['abi'], bytecode=artifact()['bytecode']).constructor(
        checksummed(token, 'token'), checksummed(arbiter, 'arbiter'), checksummed(guardian, 'guardian'),
        checksummed(fee_recipient, 'fee recipient'), int(max_fee_bps), int(arbiter_delay))
    signed = Account.sign_transaction({
        'type': 2, 'chainId': int(chain_id), 'nonce': int(nonce), 'value': 0, 'data': constructor.data_in_transaction,
        'gas': int(gas), 'maxFeePerGas': int(max_fee_per_gas),
        'maxPriorityFeePerGas': int(max_priority_fee_per_gas)}, private_key)
    return signed.raw_transaction.to_0x_hex(), signed.hash.to_0x_hex()


def deploy(chain, private_key, *, token, arbiter, guardian, fee_recipient, max_fee_bps, arbiter_delay, chain_id,
           wait_seconds=120):
    """Deploy the contract with `private_key` through a verifier.chain.Chain and wait for it: its address. A
    ValueError when the creation reverted (the constructor's checks: its reason is not kept by the chain)."""
    sender = Account.from_key(private_key).address
    fees = chain.fee_caps()
    raw, tx_hash = sign_deploy(private_key, token=token, arbiter=arbiter, guardian=guardian,
                               fee_recipient=fee_recipient, max_fee_bps=max_fee_bps, arbiter_delay=arbiter_delay,
                               nonce=chain.nonce(sender), chain_id=chain_id, max_fee_per_gas=fees[0],
                               max_priority_fee_per_gas=fees[1])
    chain.send_raw(raw)
    if chain.wait_for_receipt(tx_hash, wait_seconds)['status'] != 1:
        raise ValueError(f'the deployment {tx_hash} reverted: check the arguments against the constructor\'s rules')
    return chain._ask('eth_getTransactionReceipt', lambda: chain.w3.eth.get_transaction_receipt(tx_hash))[
        'contractAddress']


def release_typed_data(contract, chain_id, deposit, claim, payee, amount, fee):
    """The EIP-712 Release that the payer and the arbiter both sign to pay `amount` (and `fee`) of `deposit` to
    `payee` for the claim hashing to `claim` (claim_hash): the JSON a wallet's eth_signTypedData_v4 takes (numbers
    as decimal strings, so that JavaScript reads them exactly)."""
    return {'types': {'EIP712Domain': EIP712_DOMAIN, **RELEASE_TYPES}, 'primaryType': 'Release',
            'domain': {'name': 'JobEscrow', 'version': DOMAIN_VERSION, 'chainId': int(chain_id),
                       'verifyingContract': checksummed(contract, 'escrow contract')},
            'message': {'id': deposit, 'claim': claim, 'payee': checksummed(payee, 'payee'),
                        'amount': str(int(amount)), 'fee': str(int(fee))}}


def domain_separator(contract, chain_id):
    """The EIP-712 domain separator of the JobEscrow this code speaks to (version DOMAIN_VERSION)."""
    return Web3.keccak(encode(['bytes32', 'bytes32', 'bytes32', 'uint256', 'address'], [
        Web3.keccak(text='EIP712Domain(string name,string version,uint256 chainId,address verifyingContract)'),
        Web3.keccak(text='JobEscrow'), Web3.keccak(text=DOMAIN_VERSION), int(chain_id),
        checksummed(contract, 'escrow contract')])).to_0x_hex()


def receive_typed_data(token, chain_id, payer, contract, amount, valid_after, valid_before, nonce):
    """The EIP-3009 ReceiveWithAuthorization (USD Coin, version 2) a payer signs for depositWithAuthorization,
    whose nonce is the deposit's id."""
    return {'types': {'EIP712Domain': EIP712_DOMAIN, **RECEIVE_TYPES}, 'primaryType': 'ReceiveWithAuthorization',
            'domain': {'name': 'USD Coin', 'version': '2', 'chainId': int(chain_id),
                       'verifyingContract': checksummed(token, 'token')},
            'message': {'from': checksummed(payer, 'payer'), 'to': checksummed(contract, 'escrow contract'),
                        'value': str(int(amount)), 'validAfter': str(int(valid_after)),
                        'validBefore': str(int(valid_before)), 'nonce': nonce}}


def _signable(typed):
    """typed data as eth-account encodes it: numbers as ints, bytes32 as bytes."""
    fields = {field['name']: field['type'] for field in typed['types'][typed['primaryType']]}
    message = {name: (int(value) if fields[name].startswith('uint') else
                      _bytes32(value, name) if fields[name] == 'bytes32' else value)
               for name, value in typed['message'].items()}
    return encode_typed_data(full_message=dict(typed, message=message))


def typed_data_signer(typed, signature):
    """The address whose key signed the typed data (ECDSA), or None when the signature is malformed or not of the
    form the contract takes (v 27 or 28, or 0 or 1; s in the lower half: a high-s twin would revert on chain)."""
    try:
        raw = bytes.fromhex(signature[2:] if signature.startswith('0x') else signature)
        if len(raw) != 65 or raw[64] not in (0, 1, 27, 28) or int.from_bytes(raw[32:64], 'big') > HALF_CURVE_ORDER:
            return None
        return Account.recover_message(_signable(typed), signature=raw)
    except (ValueError, TypeError):
        return None


def sign_typed_data(private_key, typed):
    """Sign typed data with a key ('0x' + 130 hex digits): what a wallet does, for tests and the CLI."""
    return Account.sign_message(_signable(typed), private_key).signature.to_0x_hex()


class EscrowReader:
    """The contract's state through a verifier.chain.Chain, read at a given block."""

    def __init__(self, chain, contract):
        self.chain, self.address = chain, checksummed(contract, 'escrow contract')
        self.contract = chain.w3.eth.contract(address=self.address, abi=artifact()['abi'])

    def deposit(self, deposit, block='latest'):
        """{payer, account, remaining, refundAfter} of a deposit, or None when there is none."""
        call = self.contract.functions.deposits(_bytes32(deposit, 'deposit id'))
        payer, account, remaining, refund_after = self.chain._ask(
            'eth_call', lambda: call.call(block_identifier=block))
        if int(payer, 16) == 0:
            return None
        return {'payer': payer, 'account': '0x' + bytes(account).hex(), 'remaining': int(remaining),
                'refundAfter': int(refund_after)}

    def proposal(self, deposit, block='latest'):
        """{payees, amounts, fee, executableAt} of the pending proposal of a deposit, or None."""
        call = self.contract.functions.proposals(_bytes32(deposit, 'deposit id'))
        payees, amounts, fee, executable_at = self.chain._ask(
            'eth_call', lambda: call.call(block_identifier=block))
        if not executable_at:
            return None
        return {'payees': list(payees), 'amounts': [int(amount) for amount in amounts], 'fee': int(fee),
                'executableAt': int(executable_at)}

    def settings(self):
        """The contract's immutables: {token, arbiter, guardian, feeRecipient, maxFeeBps, arbiterDelay,
        domainSeparator} (an older JobEscrow has another domain separator: its Release is not this one)."""
        functions = self.contract.functions
        terms = {name: self.chain._ask('eth_call', getattr(functions, name)().call)
                 for name in ('token', 'arbiter', 'guardian', 'feeRecipient', 'maxFeeBps', 'arbiterDelay')}
        terms['domainSeparator'] = '0x' + bytes(self.chain._ask('eth_call', functions.domainSeparator().call)).hex()
        return terms

    def proposed_ids(self, from_block=0, to_block='latest'):
        """The deposit ids that had a proposal made in these blocks (each once, oldest first)."""
        logs = self.chain._ask('eth_getLogs', lambda: self.contract.events.Proposed().get_logs(
            from_block=from_block, to_block=to_block))
        seen = {}
        for entry in logs:
            seen.setdefault('0x' + bytes(entry['args']['id']).hex(), None)
        return list(seen)

    def pending_proposals(self, from_block=0):
        """Every proposal still pending: [{id, payees, amounts, fee, executableAt}] (what the guardian watches)."""
        pending = []
        for deposit in self.proposed_ids(from_block):
            proposal = self.proposal(deposit)
            if proposal is not None:
                pending.append(dict(proposal, id=deposit))
        return pending

    def events(self, from_block, to_block):
        """Every event of the contract in these blocks, oldest first: [{name, id, txHash, logIndex, blockNumber,
        payee, amount, fee, bySignature}] (Released: its payee; Refunded and Reclaimed: the payer in `payee`)."""
        topics = {Web3.keccak(text=f'{name}({",".join(i["type"] for i in abi["inputs"])})'): name
                  for abi in artifact()['abi'] if abi['type'] == 'event' for name in [abi['name']]}
        logs = self.chain._ask('eth_getLogs', lambda: self.chain.w3.eth.get_logs(
            {'address': self.address, 'fromBlock': from_block, 'toBlock': to_block}))
        found = []
        for entry in logs:
            name = topics.get(bytes(entry['topics'][0])) if entry['topics'] else None
            if name is None:
                continue
            args = getattr(self.contract.events, name)().process_log(entry)['args']
            found.append({'name': name, 'id': '0x' + bytes(args['id']).hex(), 'txHash': entry['transactionHash'].to_0x_hex(),
                          'logIndex': int(entry['logIndex']), 'blockNumber': int(entry['blockNumber']),
                          'payee': args.get('payee') or args.get('payer'),
                          'amount': int(args['amount']) if 'amount' in args else None,
                          'fee': int(args['fee']) if 'fee' in args else None,
                          'bySignature': args.get('bySignature')})
        return found

    def proposal_end(self, deposit, from_block):
        """How the proposal of a deposit made at `from_block` left the contract: ('executed', tx hash) when a
        Released without signature came after it, ('cancelled' | 'reclaimed', tx hash), or None."""
        deposit = _bytes32(deposit, 'deposit id')
        for name, kind in (('Cancelled', 'cancelled'), ('Reclaimed', 'reclaimed'), ('Released', 'executed')):
            event = getattr(self.contract.events, name)()
            logs = self.chain._ask('eth_getLogs', lambda: event.get_logs(
                from_block=from_block, to_block='latest', argument_filters={'id': deposit}))
            for entry in logs:
                if name != 'Released' or not entry['args']['bySignature']:
                    return kind, entry['transactionHash'].to_0x_hex()
        return None


def payees_gas(count):
    """Gas for a propose or execute of `count` payees."""
    return CALL_GAS + GAS_PER_PAYEE * max(0, count - 1)


def authorization_template(token, chain_id, contract, amount, valid_before):
    """The ReceiveWithAuthorization a payer signs to fund a deposit of `amount`, with `from` and the nonce (the
    deposit's id: keccak256(abi.encode(payer, account, refundAfter, salt))) left for the payer to fill in."""
    typed = receive_typed_data(token, chain_id, '0x' + '00' * 20, contract, amount, 0, valid_before, '0x' + '00' * 32)
    typed['message'].update({'from': None, 'nonce': None})
    return typed


def send_call(chain, private_key, *, contract, chain_id, function, args, wait_seconds=120):
    """Sign a call of the contract with `private_key` (its next nonce at the node), send it and wait for it: the
    transaction's hash. A ValueError when it reverted. For the operator's commands (a guardian's cancel): the
    service's own calls are stored before they are sent (OnChain.store_call)."""
    fees = chain.fee_caps()
    raw, tx_hash = sign_call(private_key, contract=contract, data=call_data(function, *args),
                             nonce=chain.nonce(Account.from_key(private_key).address), chain_id=chain_id,
                             max_fee_per_gas=fees[0], max_priority_fee_per_gas=fees[1])
    chain.send_raw(raw)
    if chain.wait_for_receipt(tx_hash, wait_seconds)['status'] != 1:
        raise ValueError(f'{function} {tx_hash} reverted')
    return tx_hash


def key_address(private_key):
    """The address of a hex private key; ValueError when it is not one."""
    try:
        return Account.from_key(private_key).address
    except Exception:
        raise ValueError('not a hex private key') from None
