"""The one error root of the verifier: every failed check, parse or node call ends in it."""


class VerificationError(Exception):
    """A payment that does not check out, with a snake_case `code` naming the failed check."""

    code = 'payment_invalid'

    def __init__(self, message, code=None, *, retry_after=None):
        super().__init__(message)
        self.message = message
        self.code = code or self.code
        self.retry_after = retry_after


class ChainUnavailable(VerificationError):
    """The JSON-RPC node is down, slow, or answered something that is not an answer."""

    code = 'chain_unavailable'


class FeeTooLow(ChainUnavailable):
    """The node refused a transaction for its fee (below the base fee, or an underpriced replacement)."""

    code = 'fee_too_low'


class ReceiptTooLarge(VerificationError):
    """A caller's transaction is too large to read (over 1 MiB of receipt or 256 logs): refused unread."""

    code = 'payment_invalid'
