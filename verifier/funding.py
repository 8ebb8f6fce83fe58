"""The signature that binds a job's funding transfer to the account that posts it (CONTRACT.md 18).

A transaction hash is public: anyone watching the escrow address sees it. So POST /api/jobs carries, beside
`escrowTxHash`, an EIP-712 signature by the transfer's sender over `Funding(string account,bytes32 txHash)`
in the domain {name: "Job Marketplace", version: "1", chainId, verifyingContract: the escrow address}, with
`account` the posting account's id. Pure but for eth-account (signer recovery); no web3. Contract wallets
(ERC-1271) cannot sign this way and are not supported.
"""

import re
import sys

_recursion_limit = sys.getrecursionlimit()
from eth_account import Account  # noqa: E402
from eth_account.messages import encode_typed_data  # noqa: E402
sys.setrecursionlimit(_recursion_limit)     # importing eth_account raises it to 100000: deep input could then crash us

from verifier.checks import checksummed  # noqa: E402
from verifier.errors import VerificationError  # noqa: E402

DOMAIN_NAME, DOMAIN_VERSION = 'Job Marketplace', '1'
FUNDING_TYPES = {
    'EIP712Domain': [{'name': 'name', 'type': 'string'}, {'name': 'version', 'type': 'string'},
                     {'name': 'chainId', 'type': 'uint256'}, {'name': 'verifyingContract', 'type': 'address'}],
    'Funding': [{'name': 'account', 'type': 'string'}, {'name': 'txHash', 'type': 'bytes32'}],
}
HALF_CURVE_ORDER = 0x7fffffffffffffffffffffffffffffff5d576e7357a4501ddfe92f46681b20a0   # EIP-2: s above is refused

_HASH = re.compile(r'0x[0-9a-fA-F]{64}')
_SIGNATURE = re.compile(r'0x[0-9a-fA-F]{130}')


def _refused(message):
    return VerificationError(message, 'payment_signature_invalid')


def funding_typed_data(*, account, tx_hash, chain_id, escrow):
    """The EIP-712 typed data a funding's sender signs (JSON-able, as eth_signTypedData_v4 and eth-account's
    `full_message` take it); `tx_hash` None leaves the message's txHash null for the client to fill in."""
    return {'domain': {'name': DOMAIN_NAME, 'version': DOMAIN_VERSION, 'chainId': int(chain_id),
                       'verifyingContract': checksummed(escrow, 'escrow address')},
            'types': {name: [dict(field) for field in fields] for name, fields in FUNDING_TYPES.items()},
            'primaryType': 'Funding',
            'message': {'account': account, 'txHash': tx_hash.lower() if tx_hash else None}}


def signature_bytes(signature):
    """65 bytes r || s || v from 0x and 130 hex digits, v 27 or 28 (0 and 1 read as 27 and 28), s in the lower
    half; payment_signature_invalid otherwise."""
    if not isinstance(signature, str) or not _SIGNATURE.fullmatch(signature):
        raise _refused('escrowSignature must be an EIP-712 signature: 0x followed by 130 hexadecimal digits.')
    raw = bytes.fromhex(signature[2:])
    v = raw[64] + 27 if raw[64] in (0, 1) else raw[64]
    if v not in (27, 28) or int.from_bytes(raw[32:64], 'big') > HALF_CURVE_ORDER:
        raise _refused('escrowSignature is malformed (v must be 27 or 28, s in the lower half).')
    return raw[:64] + bytes([v])


def check_funding_signature(signature, *, payer, account, tx_hash, chain_id, escrow):
    """The signer of a funding signature (checksummed), which must be `payer`, the transfer's sender; every
    failure is payment_signature_invalid."""
    raw = signature_bytes(signature)
    if not isinstance(tx_hash, str) or not _HASH.fullmatch(tx_hash) or not isinstance(account, str):
        raise _refused('The funding to check has no well-formed transaction hash or account.')
    try:
        typed_data = funding_typed_data(account=account, tx_hash=tx_hash, chain_id=chain_id, escrow=escrow)
        signer = Account.recover_message(encode_typed_data(full_message=typed_data), signature=raw)
    except Exception:       # eth_keys' BadSignature, ValueError: a signature that recovers to no one
        raise _refused('escrowSignature recovers to no address.') from None
    payer = checksummed(payer, 'payer')
    if checksummed(signer, 'signer') != payer:
        raise _refused(f'escrowSignature is not signed by {payer}, the sender of the funding transfer (or it '
                       'signs another account, transaction, chain or escrow address).')
    return signer
