"""The boundary to a JSON-RPC node: the only module that imports web3.

Every answer becomes a plain dict or int, and every failure of the node (down, slow, garbage) becomes
ChainUnavailable, so callers never see a web3 or requests exception. Each call has a time-out and no
hidden retries. A transaction named by a caller (its receipt, the transaction itself) is read raw, within
bounds (RECEIPT_MAX_BYTES, RECEIPT_MAX_LOGS), never decoded by web3: a receipt of 70,000 logs would cost
the process seconds of Python (CONTRACT.md 20).
"""

import json
import logging
import re
import sys
import time

import requests

_recursion_limit = sys.getrecursionlimit()
from web3 import HTTPProvider, Web3  # noqa: E402
from web3.exceptions import BlockNotFound, ContractLogicError, TransactionNotFound  # noqa: E402
sys.setrecursionlimit(_recursion_limit)     # importing web3 raises it to 100000: deep input could then crash us

from verifier.checks import (STEP_OF_CODE, TRANSFER_CHECKS, TRANSFER_STEPS, Checks, check_canonical, check_chain_id,
                             check_confirmations, check_fresh, check_succeeded, check_usdc_transfer, checksummed)
from verifier.addresses import to_checksum_address  # noqa: E402
from verifier.errors import ChainUnavailable, FeeTooLow, ReceiptTooLarge, VerificationError  # noqa: E402
from verifier.redact import redact_url, url_secrets, without_secrets  # noqa: E402

log = logging.getLogger('verifier.chain')
BALANCE_OF = '0x70a08231'      # balanceOf(address)
ALREADY_SENT = ('already known', 'nonce too low', 'known transaction', 'already imported')
# How nodes (geth, anvil, reth, erigon) refuse a transaction for its fee: below the base fee, or a replacement
# that does not pay enough more than the transaction it replaces.
FEE_REFUSED = ('underpriced', 'less than block base fee', 'fee cap', 'feecap', 'base fee', 'gas price too low',
               'max fee per gas less than')
# A caller's transaction is read within these bounds (CONTRACT.md 20): more is refused (payment_invalid) unread.
RECEIPT_MAX_BYTES = 1 << 20         # of the node's JSON answer, for the receipt and for the transaction
RECEIPT_MAX_LOGS = 256
REFUSAL_MEMORY_SECONDS = 3600       # a hash refused for its size is refused again, without asking the node
REFUSALS_KEPT = 10_000              # at most this many remembered (per process), the oldest forgotten first
_ADDRESS = re.compile(r'0x[0-9a-fA-F]{40}')


def _hex(value):
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        return '0x' + bytes(value).hex()
    return value if str(value).startswith('0x') else '0x' + str(value)


def _int(value):
    """A JSON-RPC quantity ('0x1a') or an int as an int."""
    if isinstance(value, str):
        if not value.startswith('0x'):
            raise ValueError(f'{value[:20]!r} is not a hex quantity')
        return int(value, 16)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f'{type(value).__name__} is not a quantity')
    return value


def _log_address(address):
    address = _hex(address)
    return to_checksum_address(address) if _ADDRESS.fullmatch(address) else address     # malformed: the checks say so


def plain_receipt(receipt):
    """A receipt, as the node's JSON or web3's decoding of it, as the plain dict the checks take; ReceiptTooLarge
    (counted before anything is decoded) with more than RECEIPT_MAX_LOGS logs."""
    logs = receipt['logs']
    if not isinstance(logs, list):
        raise TypeError('logs is not a list')
    if len(logs) > RECEIPT_MAX_LOGS:
        raise ReceiptTooLarge(f'The transaction emitted {len(logs)} logs; a payment is read with at most '
                              f'{RECEIPT_MAX_LOGS}.')
    return {
        'transactionHash': _hex(receipt['transactionHash']).lower(),
        'status': _int(receipt['status']),
        'blockNumber': _int(receipt['blockNumber']),
        'blockHash': _hex(receipt['blockHash']).lower(),
        'logs': [{'address': _log_address(log_['address']), 'topics': [_hex(t).lower() for t in log_['topics']],
                  'data': _hex(log_['data']).lower()} for log_ in logs],
    }


class Chain:
    """A JSON-RPC node, asked one thing at a time with a time-out."""

    def __init__(self, rpc_url, *, timeout=10):
        self.rpc_url = rpc_url
        self.timeout = timeout
        self.where = redact_url(rpc_url)        # what logs may show of it: a provider's key is in its path or query
        self.secrets = url_secrets(rpc_url)
        self.w3 = Web3(HTTPProvider(rpc_url, request_kwargs={'timeout': timeout},
                                    exception_retry_configuration=None))
        self.session = requests.Session()       # for the bounded reads (read_bounded)
        self.refused = {}       # (chain id, lowercase hash) -> (until: a time.monotonic(), why it was refused)

    def read_bounded(self, method, params, max_bytes=RECEIPT_MAX_BYTES):
        """The `result` of one JSON-RPC call whose answer is read as it streams in and dropped (the connection
        closed, unread) past `max_bytes`: ReceiptTooLarge then. Nothing of it is decoded but the JSON itself."""
        deadline = time.monotonic() + self.timeout
        with self.session.post(self.rpc_url, json={'jsonrpc': '2.0', 'id': 1, 'method': method, 'params': params},
                               timeout=self.timeout, stream=True) as answer:
            answer.raise_for_status()
            length = answer.headers.get('Content-Length', '')
            too_large = ReceiptTooLarge(f'The node\'s answer to {method} is over {max_bytes} bytes; a payment is '
                                        f'read with at most {max_bytes}.')
            if length.isdigit() and int(length) > max_bytes:
                raise too_large
            body, size = [], 0
            for chunk in answer.iter_content(64 * 1024):
                size += len(chunk)
                if size > max_bytes:
                    raise too_large
                if time.monotonic() > deadline:
                    raise requests.exceptions.ReadTimeout(f'the answer took over {self.timeout} s')
                body.append(chunk)
        reply = json.loads(b''.join(body))
        if not isinstance(reply, dict) or 'result' not in reply:
            raise ValueError(f'the node answered {method} with an error or without a result')
        return reply['result']

    def refusal(self, chain_id, tx_hash):
        """A ReceiptTooLarge as the hash got within the last REFUSAL_MEMORY_SECONDS on `chain_id`, or None."""
        key = (int(chain_id), str(tx_hash).lower())
        found = self.refused.get(key)
        if found is not None and found[0] < time.monotonic():
            del self.refused[key]
            return None
        return found and ReceiptTooLarge(found[1])

    def remember_refusal(self, chain_id, tx_hash, error):
        """Refuse this hash again for REFUSAL_MEMORY_SECONDS without asking the node (in this process)."""
        moment = time.monotonic()
        for key in [key for key, (until, _) in self.refused.items() if until < moment]:
            del self.refused[key]
        while len(self.refused) >= REFUSALS_KEPT:
            del self.refused[next(iter(self.refused))]
        self.refused[(int(chain_id), str(tx_hash).lower())] = (moment + REFUSAL_MEMORY_SECONDS, error.message)

    def _ask(self, what, call, *args):
        try:
            return call(*args)
        except (VerificationError, TransactionNotFound, BlockNotFound):
            raise
        except Exception as exc:       # the boundary: connection, time-out, bad JSON, an error answer
            log.warning('node call %s to %s failed: %s: %s', what, self.where, type(exc).__name__,
                        without_secrets(str(exc), self.secrets))
            raise ChainUnavailable(f'The blockchain node did not answer {what} ({type(exc).__name__}).') from None

    def chain_id(self):
        return self._ask('eth_chainId', lambda: int(self.w3.eth.chain_id))

    def block_number(self):
        return self._ask('eth_blockNumber', lambda: int(self.w3.eth.block_number))

    def block(self, number='latest'):
        """{number, hash, timestamp, baseFeePerGas} of a block, or None if there is none."""
        try:
            block = self._ask('eth_getBlockByNumber', self.w3.eth.get_block, number)
        except BlockNotFound:
            return None
        try:
            return {'number': int(block['number']), 'hash': _hex(block['hash']), 'timestamp': int(block['timestamp']),
                    'baseFeePerGas': int(block.get('baseFeePerGas') or 0)}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ChainUnavailable(f'The node answered a malformed block ({exc!r}).') from None

    def receipt(self, tx_hash):
        """The transaction's receipt as a plain dict, or None while it is unknown or not mined; ReceiptTooLarge
        past RECEIPT_MAX_BYTES or RECEIPT_MAX_LOGS (read raw, never decoded by web3)."""
        receipt = self._ask('eth_getTransactionReceipt', self.read_bounded, 'eth_getTransactionReceipt', [tx_hash])
        if receipt is None:
            return None
        try:
            return plain_receipt(receipt)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ChainUnavailable(f'The node answered a malformed receipt ({exc}).') from None

    def transaction_chain_id(self, tx_hash):
        """The chainId the transaction was signed for (None for legacy transactions without one); read within
        RECEIPT_MAX_BYTES, as the receipt."""
        tx = self._ask('eth_getTransactionByHash', self.read_bounded, 'eth_getTransactionByHash', [tx_hash])
        if tx is None:
            return None
        try:
            return None if tx.get('chainId') is None else _int(tx['chainId'])
        except (TypeError, ValueError, AttributeError) as exc:
            raise ChainUnavailable(f'The node answered a malformed transaction ({exc}).') from None

    def nonce(self, address, block='pending'):
        """The next nonce of an address: counting its pending transactions, or as of a block (a number)."""
        address = checksummed(address)
        return self._ask('eth_getTransactionCount', lambda: int(self.w3.eth.get_transaction_count(address, block)))

    def fee_caps(self):
        """(maxFeePerGas, maxPriorityFeePerGas) for an EIP-1559 transaction now: twice the base fee plus the tip."""
        tip = self._ask('eth_maxPriorityFeePerGas', lambda: int(self.w3.eth.max_priority_fee))
        base = (self.block('latest') or {}).get('baseFeePerGas', 0)
        return 2 * base + tip, tip

    def token_balance(self, token, address):
        data = BALANCE_OF + checksummed(address)[2:].lower().rjust(64, '0')
        answer = self._ask('eth_call', self.w3.eth.call, {'to': checksummed(token), 'data': data})
        return int.from_bytes(bytes(answer), 'big') if answer else 0

    def revert_reason(self, sender, to, data):
        """Run a call as `sender` would send it, in the block being built ('pending': the time and state a
        transaction sent now meets), without sending anything: None if it would succeed, else why it would revert."""
        transaction = {'from': checksummed(sender, 'sender'), 'to': checksummed(to, 'contract address'), 'data': data}

        def call():
            try:
                self.w3.eth.call(transaction, 'pending')
            except ContractLogicError as revert:       # an answer, not a failure of the node
                return str(revert.message or '').removeprefix('execution reverted').lstrip(': ') or 'no reason given'
            return None
        return self._ask('eth_call', call)

    def send_raw(self, raw_hex):
        """Broadcast a signed transaction; True if the node took it, also when it knew it already. FeeTooLow
        when the node refuses it for its fee."""
        try:
            self.w3.eth.send_raw_transaction(raw_hex)
            return True
        except Exception as exc:
            text = str(exc).lower()
            if any(known in text for known in ALREADY_SENT):
                return True
            reason = without_secrets(str(exc), self.secrets)
            if any(known in text for known in FEE_REFUSED):
                log.warning('broadcast refused for its fee by %s: %s', self.where, reason)
                raise FeeTooLow('The node refused the transaction for its fee.') from None
            log.warning('broadcast to %s failed: %s: %s', self.where, type(exc).__name__, reason)
            raise ChainUnavailable(f'The node did not take the transaction ({type(exc).__name__}).') from None

    def verify_usdc_payment(self, tx_hash, *, chain_id, token, recipient, min_amount, payer=None,
                            confirmations=1, max_age_seconds=None, now=None, one_transfer=False):
        """Fetch a transaction and check it paid `recipient` at least `min_amount` USDC: found, succeeded, on
        `chain_id`, from the token contract, deep enough, still canonical, fresh. Returns the Transfer; the
        first failed check is raised, and nothing more is asked of the node after it."""
        return self.check_transfer(Checks(TRANSFER_CHECKS, first_only=True), tx_hash, chain_id=chain_id, token=token,
                                   recipient=recipient, min_amount=min_amount, payer=payer,
                                   confirmations=confirmations, max_age_seconds=max_age_seconds, now=now,
                                   one_transfer=one_transfer)

    def check_transfer(self, checks, tx_hash, *, chain_id, token, recipient, min_amount, payer=None,
                       confirmations=1, max_age_seconds=None, now=None, one_transfer=False):
        """Run the TRANSFER_CHECKS of a USDC payment into `checks`; the Transfer if the money moved, else None.
        A transaction too large to read (ReceiptTooLarge) fails `found`, and is refused again for an hour
        without asking the node."""
        refused = self.refusal(chain_id, tx_hash)
        try:
            if refused is not None:
                raise refused
            receipt = self.receipt(tx_hash)
            tx_chain_id = self.transaction_chain_id(tx_hash) if receipt is not None and receipt['status'] == 1 \
                else None
        except ReceiptTooLarge as error:
            if refused is None:
                self.remember_refusal(chain_id, tx_hash, error)
            checks.fail('found', error)
            checks.skip(*TRANSFER_CHECKS[1:])
            return None
        if receipt is None:
            checks.fail('found', VerificationError('No mined transaction has this hash (yet).', 'payment_not_found',
                                                   retry_after=2))
            checks.skip(*TRANSFER_CHECKS[1:])
            return None
        checks.passed('found')
        if not checks.run('succeeded', check_succeeded, receipt):
            checks.skip(*TRANSFER_CHECKS[2:])
            return None
        checks.run('chainId', check_chain_id, tx_chain_id, chain_id)
        try:
            transfer = check_usdc_transfer(receipt, token=token, recipient=recipient, min_amount=min_amount,
                                           payer=payer, one_transfer=one_transfer)
        except VerificationError as error:      # check_usdc_transfer's steps, in order: which one failed
            transfer, failed = None, TRANSFER_STEPS.index(STEP_OF_CODE.get(error.code, 'token'))
            for step in TRANSFER_STEPS[:failed]:
                checks.passed(step)
            checks.fail(TRANSFER_STEPS[failed], error)
            checks.skip(*TRANSFER_STEPS[failed + 1:])
        else:
            for step in TRANSFER_STEPS:
                checks.passed(step)
        checks.run('confirmations', check_confirmations, receipt['blockNumber'], self.block_number(), confirmations)
        block = self.block(receipt['blockNumber'])
        checks.run('confirmations', check_canonical, receipt['blockHash'], block and block['hash'])
        if max_age_seconds is None:
            checks.passed('fresh')
        elif block is None:
            checks.skip('fresh')
        else:       # too old by the server's clock or by the chain's own (its head)
            head = self.block('latest')
            reference = max(now if now is not None else time.time(), head['timestamp'] if head else 0)
            checks.run('fresh', check_fresh, block['timestamp'], reference, max_age_seconds)
        return transfer

    def authorization_used(self, token, authorizer, nonce):
        """True once `authorizer`'s EIP-3009 `nonce` (0x + 64 hex digits) is used on `token` (authorizationState)."""
        try:
            word = bytes.fromhex(nonce[2:]) if isinstance(nonce, str) and nonce[:2] == '0x' else b''
        except ValueError:
            word = b''
        if len(word) != 32 or len(nonce) != 66:        # (fromhex skips spaces: the length rules them out)
            raise VerificationError('The nonce is not 0x followed by 64 hexadecimal digits.', 'payment_invalid')
        data = AUTHORIZATION_STATE + checksummed(authorizer, 'authorizer')[2:].lower().rjust(64, '0') + word.hex()
        answer = self._ask('eth_call', self.w3.eth.call, {'to': checksummed(token, 'token address'), 'data': data})
        if answer is None or len(bytes(answer)) != 32 or int.from_bytes(bytes(answer), 'big') > 1:
            raise ChainUnavailable('The node answered authorizationState with something that is not a bool.')
        return bytes(answer)[-1] == 1

    def wait_for_receipt(self, tx_hash, timeout_seconds, poll=0.2):
        """The receipt of a transaction once it is mined (a plain dict); ChainUnavailable after `timeout_seconds`."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            receipt = self.receipt(tx_hash)
            if receipt is not None:
                return receipt
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChainUnavailable(f'The transaction {tx_hash} was not mined within {timeout_seconds} seconds.')
            time.sleep(min(poll, left))        # gevent's, in the server (monkey-patched)


AUTHORIZATION_STATE = '0xe94a0102'      # authorizationState(address,bytes32)
