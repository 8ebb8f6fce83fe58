"""The API's answers other than success (CONTRACT.md 1): one APIError base with a status, a snake_case code and a
sentence for a person, its small subclasses, and how a payment that does not check out is answered. The rules
(marketplace.py) raise them and one plugin turns each into its JSON body. Below the rules: it imports nothing of
ours."""


class APIError(Exception):
    """An answer other than success: a status, a snake_case code and a sentence for a person."""

    status = 400
    code = 'bad_request'
    message = 'The request is not valid.'

    def __init__(self, message=None, *, code=None, fields=None, headers=None, extra=None, status=None):
        super().__init__(message or self.message)
        self.message = message or self.message
        self.code = code or self.code
        self.fields = fields
        self.headers = headers or {}
        self.extra = extra or {}
        self.status = status or self.status

    def body(self):
        body = {'error': self.message, 'code': self.code, 'status': self.status}
        if self.fields:
            body['fields'] = self.fields
        body.update(self.extra)
        return body


class BadRequest(APIError):
    pass


class ValidationFailed(APIError):
    code = 'validation_failed'
    message = 'Some fields are not valid; see fields.'


class InvalidJSON(APIError):
    code = 'invalid_json'
    message = 'The request body must be a JSON object.'


class InvalidUUID(APIError):
    code = 'invalid_uuid'
    message = 'An id is not a valid UUID.'


class Unauthorized(APIError):
    status = 401
    code = 'unauthorized'
    message = 'An API key is required: send Authorization: Bearer <key>.'

    def __init__(self, message=None, **kwargs):
        super().__init__(message, headers={'WWW-Authenticate': 'Bearer'}, **kwargs)


class Forbidden(APIError):
    status = 403
    code = 'forbidden'
    message = 'This API key may not do that.'


class NotFound(APIError):
    status = 404
    code = 'not_found'
    message = 'There is nothing here.'


def allow_header(methods):
    """The Allow header for a set of methods: sorted, with HEAD wherever GET is allowed."""
    methods = {m.strip().upper() for m in methods if m.strip()}
    return ', '.join(sorted(methods | ({'HEAD'} if 'GET' in methods else set())))


class MethodNotAllowed(APIError):
    status = 405
    code = 'method_not_allowed'

    def __init__(self, allowed):
        allow = allow_header(allowed)
        super().__init__(f'This path accepts only {allow}.', headers={'Allow': allow})


class BodyTimedOut(APIError):
    status = 408
    code = 'request_timeout'
    message = 'The request body did not all arrive within the time allowed; the connection is closed.'


class BodyAborted(BadRequest):
    message = ('The request body ended before its Content-Length, or its chunked framing is malformed; the '
               'connection is closed.')


class Conflict(APIError):
    status = 409
    code = 'conflict'


class BodyTooLarge(APIError):
    status = 413
    code = 'body_too_large'
    message = 'The request body is larger than 1 MiB.'


class UnsupportedMediaType(APIError):
    status = 415
    code = 'unsupported_media_type'
    message = 'Send the body as JSON with Content-Type: application/json.'


class RateLimited(APIError):
    status = 429
    code = 'rate_limited'


class Unavailable(APIError):
    status = 503
    code = 'unavailable'


class ReadOnlyReplica(APIError):
    status = 503
    code = 'read_only'
    message = 'This server is a read replica: it serves reads only; send writes to the primary.'


class ReplicaLagging(APIError):
    status = 503
    code = 'replica_lagging'

    def __init__(self, lag, max_lag):
        super().__init__(f'This read replica is {lag} s behind its primary, more than {max_lag:g} s: it serves no '
                         'reads until it catches up. Retry shortly, or read from the primary.',
                         headers={'Retry-After': '5'}, extra={'lag': lag})


class CommitFailed(Unavailable):
    """The COMMIT of a group of transactions failed (a full disk, an I/O error): none of them was applied."""

    code = 'commit_failed'
    message = 'The change could not be written to disk, and nothing of it was applied; retry in a moment.'


# A payment that does not check out is 402, except these (CONTRACT.md 7).
PAYMENT_STATUSES = {'payment_invalid': 400, 'payment_replayed': 409, 'chain_unavailable': 503}


def payment_error(exc):
    """The API answer for a VerificationError: its code, 402 unless PAYMENT_STATUSES says otherwise."""
    headers = {'Retry-After': str(exc.retry_after)} if exc.retry_after else None
    if exc.code == 'chain_unavailable':
        headers = {'Retry-After': '5'}
    return APIError(exc.message, code=exc.code, status=PAYMENT_STATUSES.get(exc.code, 402), headers=headers)


STATUS_CODES = {400: 'bad_request', 401: 'unauthorized', 403: 'forbidden', 404: 'not_found',
                405: 'method_not_allowed', 408: 'request_timeout', 409: 'conflict', 413: 'body_too_large',
                415: 'unsupported_media_type', 422: 'unprocessable_entity', 429: 'rate_limited', 500: 'internal_error',
                503: 'unavailable'}
