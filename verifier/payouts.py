"""Payouts signed locally with the escrow key (eth-account): USDC transfers as EIP-1559 transactions."""

import sys

_recursion_limit = sys.getrecursionlimit()
from eth_account import Account  # noqa: E402
from eth_account.typed_transactions import TypedTransaction  # noqa: E402
from hexbytes import HexBytes  # noqa: E402
sys.setrecursionlimit(_recursion_limit)     # importing eth_account raises it to 100000: deep input could then crash us

from verifier.checks import checksummed  # noqa: E402

TRANSFER = '0xa9059cbb'        # transfer(address,uint256)
TRANSFER_GAS = 100_000


def escrow_address(private_key):
    """The address of the escrow wallet that a private key controls."""
    return Account.from_key(private_key).address


def sign_usdc_transfer(private_key, *, token, to, amount, nonce, chain_id, max_fee_per_gas,
                       max_priority_fee_per_gas, gas=TRANSFER_GAS):
    """A signed USDC transfer: (raw transaction hex, transaction hash hex). Nothing is sent."""
    data = TRANSFER + checksummed(to, 'payee')[2:].lower().rjust(64, '0') + format(int(amount), '064x')
    signed = Account.sign_transaction({
        'type': 2, 'chainId': int(chain_id), 'nonce': int(nonce), 'to': checksummed(token, 'token address'),
        'value': 0, 'data': data, 'gas': int(gas), 'maxFeePerGas': int(max_fee_per_gas),
        'maxPriorityFeePerGas': int(max_priority_fee_per_gas)}, private_key)
    return signed.raw_transaction.to_0x_hex(), signed.hash.to_0x_hex()


def signed_fees(raw_hex):
    """(maxFeePerGas, maxPriorityFeePerGas) of a signed EIP-1559 transaction."""
    fields = TypedTransaction.from_bytes(HexBytes(raw_hex)).as_dict()
    return int(fields['maxFeePerGas']), int(fields['maxPriorityFeePerGas'])


def replacement_fees(previous, quoted, ceiling):
    """Fee caps (maxFeePerGas, tip) for a transaction that replaces one signed with `previous` caps: at least the
    node's `quoted` caps and at least 12.5% (rounded up) over the previous on both, as nodes require of a
    replacement; None when that would pass `ceiling` (the most this service pays per gas)."""
    bumped_fee, bumped_tip = (-(-value * 9 // 8) for value in previous)
    tip = max(bumped_tip, quoted[1])
    max_fee = max(bumped_fee, quoted[0], tip)
    if max_fee > ceiling:
        if bumped_fee > ceiling or bumped_tip > ceiling:
            return None
        max_fee, tip = ceiling, min(tip, ceiling)
    return max_fee, tip


def resign_with_fees(private_key, raw_hex, *, max_fee_per_gas, max_priority_fee_per_gas, nonce=None):
    """The same transaction (recipient, data, gas; its nonce unless `nonce` is given) signed again with other fee
    caps: (raw hex, hash hex)."""
    fields = TypedTransaction.from_bytes(HexBytes(raw_hex)).as_dict()
    for signature_field in ('v', 'r', 's'):
        fields.pop(signature_field, None)
    fields.update(maxFeePerGas=int(max_fee_per_gas), maxPriorityFeePerGas=int(max_priority_fee_per_gas))
    if nonce is not None:
        fields['nonce'] = int(nonce)
    fields['to'] = checksummed('0x' + bytes(fields['to']).hex(), 'recipient')
    fields['data'] = '0x' + bytes(fields['data']).hex()
    signed = Account.sign_transaction(fields, private_key)
    return signed.raw_transaction.to_0x_hex(), signed.hash.to_0x_hex()
