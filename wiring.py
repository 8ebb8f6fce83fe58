"""The program's top: the marketplace's rules (marketplace.py) handed their faces.

The faces speak other vocabularies than the rules: the pages for people (pages.py), the OpenAPI document
(openapi_spec.py), the HTTP layer (http_server.py), x402 (pay_per_call.py), webhook delivery
(webhook_delivery.py), the feed and the agent cards (discovery.py), MCP on stdio (mcp_server.py, an HTTP client
of the API) and at /mcp (remote_mcp.py, which runs mcp_server.py as a child process), and the operator's command
line with the server around the app (command_line.py). Each imports the rules it uses; the rules never import a
face. This module, imported by `python marketplace.py` and by the tests, is the one place that knows them all:
importing the faces registers their API routes with the rules' `route` (all discovery.py and remote_mcp.py have
to hand over), and FACES hands the app what it calls of them (marketplace.Faces).
"""

import a2a_binding
import command_line
import discovery
import http_server
import oauth
import marketplace
import openapi_spec
import pages
import pay_per_call
import remote_mcp
import webhook_delivery


def run_mcp(url, api_key, timeout, http_fd=None):
    """`marketplace.py mcp`: the MCP server on stdio, an HTTP client of the API at `url`; with `http_fd`, over
    Streamable HTTP on that inherited socket (the child remote_mcp.py starts for /mcp). mcp_server.py, the only user
    of the mcp SDK, is imported for this command alone: the SDK runs on asyncio, never under gevent's patches, and
    `serve` never loads it. It imports nothing of the service, so this import hides no cycle."""
    import mcp_server
    if http_fd is not None:
        mcp_server.run_http(url, http_fd, timeout)
    else:
        mcp_server.run(url, api_key, timeout)


FACES = marketplace.Faces(
    openapi_document=openapi_spec.openapi_document,
    operations=openapi_spec.API_OPERATIONS,
    x402=pay_per_call.X402,
    webhook_session=webhook_delivery.webhook_session,
    webhook_worker=webhook_delivery.WebhookWorker,
    make_server=http_server.make_server,
    mount_pages=pages.mount,
    run_mcp=run_mcp,
)


def make_app(settings):
    """The whole app for these settings: the API, the pages, the OpenAPI document, x402 and webhooks."""
    return marketplace.make_app(settings, FACES)


def main(argv=None):
    """The command line (command_line.main) with the faces."""
    return command_line.main(FACES, argv)
