"""Pure checks of USDC payments over receipt dicts: no node, no web3.

A receipt here is a plain dict: {transactionHash, status (1 or 0), blockNumber (int), blockHash,
logs: [{address, topics: [hex...], data: hex}]}; `verifier.chain` turns the node's answers into it.
Token amounts are integers in base units (USDC: 6 decimals); addresses are compared checksummed.
"""

from dataclasses import dataclass

from verifier.addresses import address_problem, to_checksum_address
from verifier.errors import VerificationError

# keccak256("Transfer(address,address,uint256)")
TRANSFER_TOPIC = '0xddf252ad1be2c89b69c2b068fc378daa952ba7f163c4a11628f55a4df523b3ef'
BASE_BLOCK_SECONDS = 2
# The checks of a USDC payment on chain, in the order they are made (Chain.check_transfer)
TRANSFER_CHECKS = ('found', 'succeeded', 'chainId', 'token', 'recipient', 'payer', 'amount', 'confirmations', 'fresh')
TRANSFER_STEPS = ('token', 'recipient', 'payer', 'amount')     # check_usdc_transfer's, in its order
STEP_OF_CODE = {'payment_wrong_token': 'token', 'payment_wrong_recipient': 'recipient',
                'payment_wrong_payer': 'payer', 'payment_insufficient': 'amount'}


@dataclass(frozen=True)
class Transfer:
    """What a checked payment moved: from `payer` to `recipient`, `amount` base units."""

    payer: str
    recipient: str
    amount: int


def checksummed(address, what='address'):
    """An address in EIP-55 form; VerificationError (payment_invalid) if it is not one."""
    if not isinstance(address, str) or address_problem(address):
        raise VerificationError(f'The {what} is not a valid address.', 'payment_invalid')
    return to_checksum_address(address)


def _topic_address(topic):
    return to_checksum_address('0x' + topic[-40:])


def usdc_transfers(receipt, token):
    """The Transfer logs of a receipt emitted by `token` (a log from any other contract does not count)."""
    token = checksummed(token, 'token address')
    found = []
    for log in receipt.get('logs') or []:
        topics = log.get('topics') or []
        if len(topics) != 3 or topics[0].lower() != TRANSFER_TOPIC:
            continue
        if checksummed(log.get('address'), 'log address') != token:
            continue
        try:
            amount = int(log.get('data') or '0x0', 16)
        except ValueError:
            raise VerificationError('A Transfer log carries no amount.', 'payment_invalid') from None
        found.append(Transfer(_topic_address(topics[1]), _topic_address(topics[2]), amount))
    return found


def check_succeeded(receipt):
    if receipt.get('status') != 1:
        raise VerificationError('The transaction reverted: it moved no money.', 'payment_reverted')


def check_usdc_transfer(receipt, *, token, recipient, min_amount, payer=None, one_transfer=False):
    """The USDC that `receipt` moved to `recipient` (from `payer`, if given), at least `min_amount`. With
    `one_transfer` (a job's funding: its one sender is refunded), several Transfers to `recipient` are refused."""
    check_succeeded(receipt)
    recipient = checksummed(recipient, 'recipient')
    transfers = usdc_transfers(receipt, token)
    if not transfers:
        raise VerificationError('The transaction moved no USDC (a Transfer counts only from the USDC '
                                'contract).', 'payment_wrong_token')
    to_recipient = [t for t in transfers if t.recipient == recipient]
    if not to_recipient:
        raise VerificationError(f'The USDC went to {transfers[0].recipient}, not to {recipient}.',
                                'payment_wrong_recipient')
    if one_transfer and len(to_recipient) > 1:
        raise VerificationError(f'The transaction moved USDC to {recipient} {len(to_recipient)} times; a funding '
                                'must be one transfer from one sender.', 'payment_invalid')
    if payer is not None:
        payer = checksummed(payer, 'payer')
        to_recipient = [t for t in to_recipient if t.payer == payer]
        if not to_recipient:
            raise VerificationError(f'The USDC came from another address than {payer}.', 'payment_wrong_payer')
    amount = sum(t.amount for t in to_recipient)
    if amount < min_amount:
        raise VerificationError(f'The transfer is {amount} base units; at least {min_amount} are needed.',
                                'payment_insufficient')
    return Transfer(to_recipient[0].payer, recipient, amount)


def check_chain_id(actual, expected):
    if actual is not None and int(actual) != int(expected):
        raise VerificationError(f'The payment is on chain {actual}, not on chain {expected}.', 'payment_wrong_chain')


def check_confirmations(receipt_block, latest_block, required):
    """The receipt's block counts as one confirmation; too few: payment_pending with a Retry-After."""
    confirmations = latest_block - receipt_block + 1
    if confirmations < required:
        missing = required - max(confirmations, 0)
        raise VerificationError(f'The payment has {max(confirmations, 0)} of {required} confirmations.',
                                'payment_pending', retry_after=max(1, missing * BASE_BLOCK_SECONDS))
    return confirmations


def check_canonical(receipt_block_hash, canonical_block_hash):
    if (receipt_block_hash or '').lower() != (canonical_block_hash or '').lower():
        raise VerificationError('The block holding the payment is no longer on the chain (a reorganisation).',
                                'payment_reorged')


def check_fresh(block_timestamp, now_timestamp, max_age_seconds):
    if max_age_seconds is not None and now_timestamp - block_timestamp > max_age_seconds:
        raise VerificationError(f'The payment is older than {max_age_seconds} seconds.', 'payment_expired')


class Checks:
    """Named checks of one payment, in a fixed order: each passes, or fails with the error that says why (or
    with none when it could not be checked because an earlier one failed). The first failure in that order is
    the payment's error. With `first_only`, the first failure is raised at once instead (nothing more is asked)."""

    def __init__(self, names, first_only=False):
        self.names = tuple(names)
        self.first_only = first_only
        self.results = {}       # name -> True / False
        self.errors = {}        # name -> the VerificationError of a failed check

    def passed(self, name):
        self._know(name)
        self.results.setdefault(name, True)

    def fail(self, name, error=None):
        self._know(name)
        self.results[name] = False
        if error is not None:
            self.errors.setdefault(name, error)
            if self.first_only:
                raise error

    def _know(self, name):
        if name not in self.names:      # a check only some payments or settings make: it comes last
            self.names += (name,)

    def run(self, name, check, /, *args, **kwargs):
        """Run a check that raises VerificationError when it fails (a node that does not answer is not a failed
        check: ChainUnavailable goes up). True if it passed."""
        try:
            check(*args, **kwargs)
        except VerificationError as error:
            if error.code == 'chain_unavailable':
                raise
            self.fail(name, error)
            return False
        self.passed(name)
        return True

    def skip(self, *names):
        """These could not be checked (an earlier check failed): they do not pass."""
        for name in names:
            self.fail(name)

    @property
    def error(self):
        """The first failure in the checks' order, or None when every check passed."""
        return next((self.errors[name] for name in self.names if name in self.errors), None)

    def as_dict(self):
        """{name: passed} for every check, in order; one never run does not pass."""
        return {name: self.results.get(name, False) for name in self.names}

    def raise_first(self):
        if self.error is not None:
            raise self.error
